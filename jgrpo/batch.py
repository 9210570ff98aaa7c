"""The rollout -> trainer batch: one typed definition of what a train step consumes.

`TrainBatch` is a `flax.struct.dataclass` (a pytree of its seven arrays); `FIELDS` holds each
field's axes and dtype. Per-token arrays [B, T] are aligned with the tokens they score:
  input_ids [B, T] int32 (left-padded prompt ++ completion, pad after the end);
  attention_mask [B, T] float32 (1 on real tokens); token_mask [B, T] float32 (1 on generated
  tokens, the stop token included, all at columns >= rollout.prompt_bucket);
  generation_logprobs [B, T] float32 (the sampler's logprob of each generated token, else 0);
  rewards [B] float32; group_ids [B] int32 (rows of one prompt share an id); sample_mask [B]
  float32 (1 = the row takes part in the loss); `OPTIONAL`: expert_ids [B, T, l_moe, k] int16
  only when the sampler recorded them (router replay, docs/moe.md; else None).
API: `TrainBatch(**arrays)`, `from_mapping(d)` (checked); `abstract(rows, tokens, mesh=None,
routing=None)` (ShapeDtypeStructs; routing = (l_moe, k) adds expert_ids); `TOKEN_KEYS` /
`left_pad` (a rollout batch's [B, T, ...] arrays, widened); `check_scored_from(first)`;
`shard(mesh)` (host -> device, process-local rows on a pod); mapping-style access."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import numpy as np
from flax import struct

from jgrpo import sharding


@struct.dataclass
class TrainBatch:
    """One rollout batch as the train step consumes it (see the module docstring)."""

    input_ids: Any
    attention_mask: Any
    token_mask: Any
    generation_logprobs: Any
    rewards: Any
    group_ids: Any
    sample_mask: Any
    expert_ids: Any = None

    FIELDS: ClassVar[dict[str, tuple[str, Any]]] = {
        "input_ids": ("bt", np.int32),
        "attention_mask": ("bt", np.float32),
        "token_mask": ("bt", np.float32),
        "generation_logprobs": ("bt", np.float32),
        "rewards": ("b", np.float32),
        "group_ids": ("b", np.int32),
        "sample_mask": ("b", np.float32),
    }
    """field -> (axes: b rows, t tokens; dtype)."""
    OPTIONAL: ClassVar[dict[str, tuple[str, Any]]] = {"expert_ids": ("btlk", np.int16)}
    """Fields present only when recorded (None otherwise): axes (l MoE layers, k experts per
    token), dtype."""

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_mapping(cls, data) -> TrainBatch:
        """The step's fields of `data` (extra keys ignored; optional ones when present),
        checked: see `check`."""
        present = [name for name in cls.OPTIONAL if data.get(name) is not None]
        return cls(**{name: data[name] for name in (*cls.FIELDS, *present)}).check()

    @classmethod
    def abstract(cls, rows: int, tokens: int, mesh=None, routing=None) -> TrainBatch:
        """ShapeDtypeStructs of a [rows, tokens] batch; batch-sharded over `mesh` if given;
        `routing` = (l_moe, k): with recorded expert_ids."""

        def struct_of(axes, dtype):
            shape = (rows, tokens, *(routing or ()))[: len(axes)]
            shard = None if mesh is None else sharding.batch_sharding(mesh, len(shape))
            return jax.ShapeDtypeStruct(shape, dtype, sharding=shard)

        fields = {name: struct_of(*spec) for name, spec in cls.FIELDS.items()}
        if routing is not None:
            fields["expert_ids"] = struct_of(*cls.OPTIONAL["expert_ids"])
        return cls(**fields)

    def check(self) -> TrainBatch:
        """Raise ValueError unless every field has its dtype and all share B (and T)."""
        rows, tokens = self.input_ids.shape[:1], self.input_ids.shape[:2]
        for name, (axes, dtype) in {**self.FIELDS, **self.OPTIONAL}.items():
            value = getattr(self, name)
            if value is None and name in self.OPTIONAL:
                continue
            want = {"bt": tokens, "b": rows}.get(axes, tuple(tokens) + tuple(value.shape[2:4]))
            if tuple(value.shape) != tuple(want) or np.dtype(value.dtype) != dtype:
                raise ValueError(
                    f"TrainBatch.{name}: {value.dtype}{list(value.shape)}, want "
                    f"{np.dtype(dtype)}{list(want)}"
                )
        return self

    def check_scored_from(self, first: int) -> TrainBatch:
        """Raise ValueError if a generated token (token_mask) sits in a column < `first`: the
        train step computes no logprob there (`StepFlags.first_scored`)."""
        early = np.asarray(self.token_mask)[:, :first]
        if early.any():
            column = int(np.argmax(early.any(axis=0)))
            raise ValueError(
                f"TrainBatch.token_mask: a generated token in column {column}, left of "
                f"rollout.prompt_bucket = {first}: completions must start at or after it"
            )
        return self

    def shard(self, mesh) -> TrainBatch:
        """This process's rows (numpy) -> global device arrays split over data x fsdp."""
        return TrainBatch(**sharding.shard_batch(self.check().as_dict(), mesh))

    # ------------------------------------------------------------------ mapping access

    def as_dict(self) -> dict[str, Any]:
        """The fields by name, optional ones only when present."""
        fields = (f.name for f in dataclasses.fields(self))
        return {k: getattr(self, k) for k in fields if getattr(self, k) is not None}

    def keys(self):
        return self.as_dict().keys()

    def items(self):
        return self.as_dict().items()

    def __getitem__(self, name: str):
        if name not in self.FIELDS and name not in self.OPTIONAL:
            raise KeyError(name)
        return getattr(self, name)

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T)."""
        return tuple(self.input_ids.shape)


TOKEN_KEYS = tuple(k for k, (axes, _) in TrainBatch.FIELDS.items() if axes == "bt") + tuple(
    TrainBatch.OPTIONAL
)
"""The [B, T, ...] arrays of a rollout batch; every other key is per row."""


def left_pad(key: str, value: np.ndarray, pad: int) -> np.ndarray:
    """A TOKEN_KEYS array widened by `pad` columns on the left (a narrower prompt bucket): 0,
    or -1 (not recorded) for expert_ids."""
    widths = ((0, 0), (pad, 0)) + ((0, 0),) * (value.ndim - 2)
    return np.pad(value, widths, constant_values=-1 if key in TrainBatch.OPTIONAL else 0)
