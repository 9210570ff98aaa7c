"""Packed sequences for the train step (`grpo.sequence_packing`): rows first-fit decreasing.

Host (numpy, deterministic): `pack_batch(batch, spec)` -> `PackedBatch(rows, layout)`. `rows` is
the TrainBatch unchanged; `layout` holds each row's real tokens (attention_mask 1, in order, the
row whole) in packed rows of `spec.width` tokens and `spec.scored_width` scored slots: longest
row first, into the first packed row with room for its tokens and its scored tokens (token_mask
1). Minibatch m packs its own rows (row i, packed row j in minibatch i, j mod M, as the step
splits them). A packed row holds segment ids (1, 2, ...; 0 = padding), per-segment positions
(0..L-1 = the row's cumsum(mask) - 1) and `scored` [R, H], the packed position of each scored
token, row by row in column order (recorded `expert_ids` [R, W, l_moe, k] go with their
tokens, -1 elsewhere). The packed rows per minibatch are a multiple of
`spec.row_quantum`, bucketed (`row_buckets`: at most 4 log2(n) + 1 counts). Device:
`unpack_logprobs` reads [R, H] slot logprobs back to rows [B, T], 0 off token_mask, so
losses.py sees the unpacked batch's arrays; `microbatch_of` says which microbatch holds a row.
Legend: r packed rows, w packed width, h scored slots; b, t the batch's rows and columns.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jgrpo import distributed, sharding
from jgrpo.batch import TrainBatch


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackSpec:
    """How a run packs its batches (`from_config`)."""

    width: Optional[int]
    """Tokens per packed row (grpo.packing_budget; None = the batch's row width)."""
    scored_width: int
    """Scored slots per packed row: rollout.max_new_tokens (a row never scores more)."""
    num_minibatches: int
    row_quantum: int
    """Packed rows per minibatch are a multiple of this: microbatches x this process's
    data x fsdp devices (every microbatch splits over the batch-sharded devices)."""

    @classmethod
    def from_config(cls, cfg, batch_devices: int) -> PackSpec:
        """`batch_devices`: the mesh's data x fsdp size (all processes)."""
        g = cfg.grpo
        return cls(
            width=g.packing_budget,
            scored_width=cfg.rollout.max_new_tokens,
            num_minibatches=g.num_minibatches,
            row_quantum=g.num_microbatches * max(batch_devices // jax.process_count(), 1),
        )


def row_buckets(max_units: int) -> tuple[int, ...]:
    """The packed-row counts (in units of the row quantum) a minibatch may take, ascending:
    every integer up to `max_units` with at most three significant binary digits (1..8, 10,
    12, 14, 16, 20, ...: at most 25% more rows than needed), and `max_units` (no packing gain).
    There are at most 4 log2(max_units) + 1 of them."""
    small = [v for v in range(1, min(max_units, 8) + 1)]
    large = [m << e for e in range(1, max_units.bit_length()) for m in range(4, 8)]
    return tuple(sorted({*small, *(v for v in large if 8 < v <= max_units), max_units}))


def bucket_units(need: int, max_units: int) -> int:
    """The smallest of `row_buckets(max_units)` >= need."""
    return next(v for v in row_buckets(max_units) if v >= need)


@struct.dataclass
class PackedLayout:
    """Where a batch's tokens sit in packed rows (see the module docstring)."""

    input_ids: Any
    positions: Any
    segment_ids: Any
    scored: Any
    row: Any
    slot: Any
    expert_ids: Any = None
    """[R, W, l_moe, k] int16 the rows' recorded experts (TrainBatch.expert_ids) at their packed
    positions, -1 elsewhere; None when the batch has none."""

    FIELDS: ClassVar[dict[str, str]] = {
        "input_ids": "rw",
        "positions": "rw",
        "segment_ids": "rw",
        "scored": "rh",
        "row": "b",
        "slot": "b",
    }
    """field -> axes (all int32): input_ids, positions, segment_ids [R, W]; scored [R, H] (the
    packed position of each scored token, 0 = empty slot); row [B] (the packed row holding
    row b, global index), slot [B] (its first scored slot in that packed row)."""

    def tokens(self) -> tuple:
        """The per-packed-row arrays (what one forward reads), in FIELDS order."""
        return self.input_ids, self.positions, self.segment_ids, self.scored

    def as_dict(self) -> dict[str, Any]:
        """The fields by name (expert_ids when present)."""
        names = (*self.FIELDS, *(() if self.expert_ids is None else ("expert_ids",)))
        return {name: getattr(self, name) for name in names}


@struct.dataclass
class PackedBatch:
    """A TrainBatch (`rows`, as it was) and its packed layout: the packed step's input."""

    rows: TrainBatch
    layout: PackedLayout

    @classmethod
    def abstract(
        cls, rows, tokens, packed_rows, width, scored_width, mesh=None, routing=None
    ) -> PackedBatch:
        """ShapeDtypeStructs (batch-sharded over `mesh` if given) for lowering; `routing` =
        (l_moe, k): with recorded expert ids (TrainBatch.abstract)."""
        shapes = {"rw": (packed_rows, width), "rh": (packed_rows, scored_width), "b": (rows,)}
        shapes["rwlk"] = (packed_rows, width, *(routing or ()))

        def struct_of(axes, dtype=jnp.int32):
            shard = None if mesh is None else sharding.batch_sharding(mesh, len(shapes[axes]))
            return jax.ShapeDtypeStruct(shapes[axes], dtype, sharding=shard)

        layout = {name: struct_of(axes) for name, axes in PackedLayout.FIELDS.items()}
        if routing is not None:
            layout["expert_ids"] = struct_of("rwlk", TrainBatch.OPTIONAL["expert_ids"][1])
        return cls(TrainBatch.abstract(rows, tokens, mesh, routing), PackedLayout(**layout))

    def shard(self, mesh) -> PackedBatch:
        """This process's rows and packed rows (numpy) -> global arrays over data x fsdp."""
        layout = sharding.shard_batch(self.layout.as_dict(), mesh)
        return PackedBatch(self.rows.shard(mesh), PackedLayout(**layout))

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T) of the rows."""
        return self.rows.shape


# ----------------------------------------------------------------------------- host


def _first_fit_decreasing(lengths_n, scored_n, width: int, scored_width: int):
    """-> (packed row, token offset, slot offset, segment id) per row, and the packed-row
    count. Rows in decreasing length (ties: row order), each into the first packed row with
    `lengths` free tokens and `scored` free slots; empty rows (length 0) go nowhere (row 0,
    segment 0)."""
    n = len(lengths_n)
    free_tok, free_slot = np.zeros(n, np.int64), np.zeros(n, np.int64)
    segments = np.zeros(n, np.int64)
    out = np.zeros((4, n), np.int64)
    used = 0
    for i in np.lexsort((np.arange(n), -lengths_n)):
        length, scored = lengths_n[i], scored_n[i]
        if length == 0:
            continue
        fits = (free_tok[:used] >= length) & (free_slot[:used] >= scored)
        j = int(np.argmax(fits)) if fits.any() else used
        if j == used:
            free_tok[j], free_slot[j], used = width, scored_width, used + 1
        segments[j] += 1
        out[:, i] = j, width - free_tok[j], scored_width - free_slot[j], segments[j]
        free_tok[j] -= length
        free_slot[j] -= scored
    return out, used


def _check_rows(real_bt, scored_bt, width: int, scored_width: int) -> None:
    """Raise ValueError where a batch cannot be packed to the same numbers."""
    if (scored_bt & ~real_bt).any():
        raise ValueError("TrainBatch.token_mask: a generated token outside attention_mask")
    after_real_bt = np.pad(real_bt[:, :-1], ((0, 0), (1, 0)))
    if (scored_bt & ~after_real_bt).any():
        raise ValueError(
            "TrainBatch.token_mask: a generated token with no real token before it (its logprob "
            "would be read from padding)"
        )
    longest, most = int(real_bt.sum(1).max(initial=0)), int(scored_bt.sum(1).max(initial=0))
    if longest > width:
        raise ValueError(
            f"grpo.packing_budget = {width}: a row of {longest} real tokens does not fit"
        )
    if most > scored_width:
        raise ValueError(
            f"TrainBatch.token_mask: a row with {most} generated tokens, more than "
            f"rollout.max_new_tokens = {scored_width}"
        )


def pack_batch(batch: TrainBatch, spec: PackSpec) -> PackedBatch:
    """This process's rows (numpy TrainBatch) -> the packed batch (numpy). On a pod every
    process packs its own rows to the same, agreed packed-row count (the largest any needs)."""
    host = {name: np.asarray(value) for name, value in batch.items()}
    real_bt, scored_bt = host["attention_mask"] > 0, host["token_mask"] > 0
    b, t = real_bt.shape
    m_count = spec.num_minibatches
    width, h = spec.width or t, spec.scored_width
    _check_rows(real_bt, scored_bt, width, h)
    lengths_b, scored_b = real_bt.sum(1), scored_bt.sum(1)
    plans, need = [], 1
    for m in range(m_count):
        plan, used = _first_fit_decreasing(lengths_b[m::m_count], scored_b[m::m_count], width, h)
        plans.append(plan)
        need = max(need, used)
    q = spec.row_quantum
    units = bucket_units(-(-need // q), (b // m_count) // q)
    if distributed.is_multiprocess():  # one program on every process: the largest count
        units = max(int(u) for u in distributed.allgather(np.int64(units)))
    per_minibatch = units * q
    r = per_minibatch * m_count
    first = distributed.process_index() * r if distributed.is_multiprocess() else 0
    arrays = {name: np.zeros((r, width), np.int32) for name in ("input_ids", "positions")}
    arrays["segment_ids"] = np.zeros((r, width), np.int32)
    arrays["scored"] = np.zeros((r, h), np.int32)
    experts = host.get("expert_ids")
    if experts is not None:
        arrays["expert_ids"] = np.full((r, width, *experts.shape[2:]), -1, experts.dtype)
    row_b, slot_b = np.zeros(b, np.int32), np.zeros(b, np.int32)
    for m, plan in enumerate(plans):
        for n, i in enumerate(range(m, b, m_count)):
            j, offset, slot, segment = (int(x) for x in plan[:, n])
            g = j * m_count + m  # this process's packed row; minibatch g mod M = m
            row_b[i], slot_b[i] = first + g, slot
            if segment == 0:
                continue
            cols = np.flatnonzero(real_bt[i])
            span = slice(offset, offset + len(cols))
            arrays["input_ids"][g, span] = host["input_ids"][i, cols]
            arrays["positions"][g, span] = np.arange(len(cols))
            arrays["segment_ids"][g, span] = segment
            if experts is not None:
                arrays["expert_ids"][g, span] = experts[i, cols]
            ranks = np.flatnonzero(scored_bt[i, cols])  # scored tokens among the real ones
            arrays["scored"][g, slot : slot + len(ranks)] = offset + ranks
    return PackedBatch(batch, PackedLayout(**arrays, row=row_b, slot=slot_b))


# ----------------------------------------------------------------------------- device


def unpack_logprobs(lp_rh, row_b, slot_b, token_mask_bt):
    """[B, T] float32: lp_bt[b, t] = lp_rh[row_b, slot_b + (scored tokens of row b before t)]
    where token_mask_bt > 0, else 0 ([R, H, ...] -> [B, T, ...] likewise). A gather: its
    gradient scatters each token's cotangent to its one slot."""
    scored_bt = token_mask_bt > 0
    slot_bt = slot_b[:, None] + jnp.cumsum(scored_bt, axis=1, dtype=jnp.int32) - 1
    lp_bt = lp_rh[row_b[:, None], jnp.where(scored_bt, slot_bt, 0)]
    scored = scored_bt.reshape(*scored_bt.shape, *[1] * (lp_rh.ndim - 2))
    return jnp.where(scored, lp_bt, jnp.zeros((), lp_bt.dtype))


def microbatch_of(row_b, num_minibatches: int, num_microbatches: int):
    """(microbatch, packed row within it) of each row of a minibatch: the step splits a
    minibatch's packed rows as `step.chunk_rows` does (packed row j of the minibatch, global
    row j x M + m, to microbatch j mod K)."""
    within_b = row_b // num_minibatches
    return within_b % num_microbatches, within_b // num_microbatches
