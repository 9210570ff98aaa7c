"""Reward models: a one-label HF *ForSequenceClassification folder scored in JAX.

Owns `RewardModel` (load, the text it reads, the batched forward) and `load_reward_models`.
`RewardModel.score(prompts, completions) -> float64[N]` gives TRL's reward-model score:
- text: a chat-message prompt (with `chat_template`) is the prompt messages + the completion
  messages through the reward model's own chat template; a string prompt is prompt +
  completion as plain text (message contents joined without `chat_template`). Its own tokenizer
  (add_special_tokens=False) re-tokenises the decoded policy text; the first max_length kept.
- score: the float32 logit at the last non-pad token (HF's rule: the rightmost id that is not
  the pad id; a tokenizer without a pad token pads with eos, as TRL sets it); right padding.
- batches: texts sorted by length, padded to a length bucket (16 x 2^k, capped at max_length)
  and a row count (batch shards x 2^k) with rows x length <= batch_tokens: few shapes, few
  compiles; a text's score does not depend on its batch (its own row, padding masked).
- placement: frozen, in `dtype`, sharded by `jgrpo.sharding`'s rules over the given mesh (rows
  over data x fsdp); `dispatch` starts every batch's jitted forward and returns at once."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jgrpo import sharding
from jgrpo.config import MeshConfig
from jgrpo.models.hf import config_from_hf, model_from_tensors, read_hf_weights
from jgrpo.models.transformer import Transformer, TransformerConfig

MIN_BUCKET = 16
"""The shortest padded length of a reward-model batch; longer buckets double it."""


def reward_model_config(folder, dtype: str, kernels: str = "auto") -> TransformerConfig:
    """The decoder of a reward-model folder, tied (no LM head is allocated), pure `dtype`."""
    hf = json.loads((Path(folder) / "config.json").read_text())
    hf = {**hf, "tie_word_embeddings": True}
    return config_from_hf(hf, dtype=dtype, param_dtype=dtype, kernels=kernels)


def _abstract(model_cfg: TransformerConfig):
    return nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))


def param_shardings(model_cfg: TransformerConfig, mesh, rules) -> tuple[dict, Any]:
    """(decoder parameter shardings as a pure dict, the score vector's: replicated)."""
    state = nnx.state(_abstract(model_cfg))
    return sharding.param_shardings(state, mesh, rules), sharding.replicated(mesh)


def abstract_params(model_cfg: TransformerConfig, mesh, rules):
    """(decoder params, score [d]) as sharded jax.ShapeDtypeStructs (inspect-step sizes them)."""
    state = nnx.to_pure_dict(nnx.state(_abstract(model_cfg)))
    p_shard, s_shard = param_shardings(model_cfg, mesh, rules)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, p_shard
    )
    score = jax.ShapeDtypeStruct((model_cfg.hidden_size,), model_cfg.jnp_dtype, sharding=s_shard)
    return params, score


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, score_d, ids_bt, mask_bt, last_b):
    model = nnx.merge(graphdef, params)
    hidden_btd = model.hidden_states(ids_bt, mask_bt)
    hidden_bd = jnp.take_along_axis(hidden_btd, last_b[:, None, None], axis=1)[:, 0]
    return jnp.einsum(
        "bd,d->b", hidden_bd, score_d.astype(hidden_bd.dtype), preferred_element_type=jnp.float32
    )


@dataclasses.dataclass
class PendingScores:
    """Forwards started by `RewardModel.dispatch`: (row indices, float32[rows] on the device)
    per batch; `result()` waits for them."""

    num_rows: int
    parts: list[tuple[list[int], jax.Array]]

    def result(self) -> np.ndarray:
        """float64[num_rows], in the order of the texts given to `dispatch`."""
        scores = np.zeros(self.num_rows, np.float64)
        for take, out in self.parts:
            scores[take] = np.asarray(out, np.float64)[: len(take)]
        return scores


def _ceil_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


class RewardModel:
    """One loaded reward model (see the module docstring)."""

    def __init__(
        self,
        folder,
        *,
        dtype: str = "float32",
        batch_tokens: int = 16384,
        max_length: Optional[int] = None,
        chat_template: bool = True,
        mesh=None,
        rules=None,
        kernels: str = "auto",
    ):
        import transformers

        self.folder = Path(folder)
        self.model_cfg = reward_model_config(folder, dtype, kernels)
        limit = self.model_cfg.max_position_embeddings
        self.max_length = int(max_length or min(limit, batch_tokens))
        self.batch_tokens = int(batch_tokens)
        self.chat_template = bool(chat_template)
        if mesh is None:  # one device (tests, scripts)
            mesh = sharding.make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
        self.mesh = mesh
        rules = sharding.DEFAULT_RULES if rules is None else rules
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if tokenizer.pad_token_id is None:
            raise ValueError(f"{folder}: the reward model's tokenizer has no pad or eos token")
        self.tokenizer = tokenizer
        self.pad_id = int(tokenizer.pad_token_id)
        tensors = read_hf_weights(self.folder)
        model = model_from_tensors(self.model_cfg, tensors, self.folder, ("score.weight",))
        self.graphdef, state = nnx.split(model)
        p_shard, s_shard = param_shardings(self.model_cfg, self.mesh, rules)
        self.params = sharding.shard_params(nnx.to_pure_dict(state), p_shard)
        score = np.asarray(tensors["score.weight"], np.float32)[0]
        self.score_d = jax.device_put(jnp.asarray(score, self.model_cfg.jnp_dtype), s_shard)
        self.num_shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        self._batch = sharding.batch_sharding(self.mesh, 2)
        self._rows = sharding.batch_sharding(self.mesh, 1)

    # ------------------------------------------------------------------------- text

    def text(self, prompt, completion) -> str:
        """The text the reward model reads for one (prompt, completion) (module docstring)."""
        if isinstance(completion, list):
            completion_messages = completion
        else:
            completion_messages = [{"role": "assistant", "content": completion}]
        if isinstance(prompt, str):
            if isinstance(completion, list):
                completion = "".join(m["content"] for m in completion)
            return prompt + completion
        if self.chat_template:
            return self.tokenizer.apply_chat_template(
                list(prompt) + list(completion_messages), tokenize=False
            )
        return "".join(m["content"] for m in list(prompt) + list(completion_messages))

    def encode(self, prompts, completions) -> list[list[int]]:
        """Token ids per row: `text` through the reward model's tokenizer, cut to max_length."""
        texts = [self.text(p, c) for p, c in zip(prompts, completions)]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [list(x[: self.max_length]) or [self.pad_id] for x in ids]

    # ------------------------------------------------------------------------- batches

    def bucket(self, length: int) -> int:
        """The padded length of a text of `length` tokens."""
        return min(max(MIN_BUCKET, _ceil_pow2(length)), max(self.max_length, 1))

    def batches(self, lengths: Sequence[int]) -> list[tuple[list[int], int, int]]:
        """[(row indices, padded rows, padded length)]: longest first, each within the budget."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        out, start = [], 0
        while start < len(order):
            width = self.bucket(lengths[order[start]])
            fit = max(self.batch_tokens // width // self.num_shards, 1)
            max_rows = self.num_shards * (1 << (fit.bit_length() - 1))
            take = order[start : start + max_rows]
            rows = self.num_shards * _ceil_pow2(-(-len(take) // self.num_shards))
            out.append((take, rows, width))
            start += len(take)
        return out

    def dispatch_ids(self, ids: Sequence[Sequence[int]]) -> PendingScores:
        """Start the forwards of token-id rows (already cut to max_length); returns at once."""
        parts = []
        for take, rows, width in self.batches([len(x) for x in ids]):
            ids_bt = np.full((rows, width), self.pad_id, np.int32)
            mask_bt = np.zeros((rows, width), np.int32)
            mask_bt[:, 0] = 1  # padding rows hold one (pad) token: no fully masked row
            last_b = np.zeros(rows, np.int32)
            for r, i in enumerate(take):
                row = np.asarray(ids[i], np.int32)
                ids_bt[r, : len(row)] = row
                mask_bt[r, : len(row)] = 1
                real = np.nonzero(row != self.pad_id)[0]  # HF: the rightmost non-pad id
                last_b[r] = real[-1] if len(real) else 0
            out = _forward(
                self.graphdef,
                self.params,
                self.score_d,
                jax.device_put(ids_bt, self._batch),
                jax.device_put(mask_bt, self._batch),
                jax.device_put(last_b, self._rows),
            )
            parts.append((take, out))  # not waited for: the next batch is built meanwhile
        return PendingScores(len(ids), parts)

    def score_ids(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        """float64[N] scores of token-id rows (already cut to max_length)."""
        return self.dispatch_ids(ids).result()

    def dispatch(self, prompts, completions) -> PendingScores:
        """Re-tokenise and start the forwards of (prompt, completion) pairs; returns before the
        device is done (`PendingScores.result` waits)."""
        if len(prompts) == 0:
            return PendingScores(0, [])
        return self.dispatch_ids(self.encode(prompts, completions))

    def score(self, prompts, completions) -> np.ndarray:
        """float64[N]: the reward model's score of each (prompt, completion)."""
        return self.dispatch(prompts, completions).result()

    def bytes_per_device(self) -> int:
        """Bytes of the reward model's parameters on the most loaded device."""
        return sum(
            math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in jax.tree.leaves((self.params, self.score_d))
        )


def load_reward_models(cfg, mesh=None) -> dict[int, RewardModel]:
    """{index in data.reward_functions: RewardModel} of a run config's reward models ({} if
    none), on `mesh`: the trainer's (this process's rows of it, `sharding.host_mesh`: a pod
    host's own replica), or None: this process's devices, rows split over them (a Ray
    rollout worker's)."""
    from jgrpo.models.sources import resolve_model_path

    platform = jax.default_backend()
    rules = sharding.make_rules(cfg.mesh)
    if mesh is None:
        mesh = sharding.make_mesh(MeshConfig(data=-1), jax.local_devices())
    local = sharding.host_mesh(mesh)
    out = {}
    for i, rf in enumerate(cfg.data.reward_functions):
        if rf.model is None:
            continue
        dtype = rf.dtype if rf.dtype != "auto" else cfg.model.resolved_compute_dtype(platform)
        out[i] = RewardModel(
            resolve_model_path(rf.model),
            dtype=dtype,
            batch_tokens=rf.batch_tokens,
            max_length=rf.max_length,
            chat_template=rf.chat_template,
            mesh=local,
            rules=rules,
            kernels=cfg.model.kernels,
        )
    return out
