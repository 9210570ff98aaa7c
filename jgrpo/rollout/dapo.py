"""DAPO's batch transforms (docs/dapo.md): overlong shaping and filtering, informative groups.

All numpy on a rollout batch (the dict of `RolloutResult.batch`), no JAX:
- `overlong_penalty(lengths, max_new_tokens, length, penalty)`: DAPO Eq. 13 per row, L the
  generated token count (stop token included), Lmax = rollout.max_new_tokens.
- `shape_training_batch(batch, cfg)`: run by the engine on training rollouts only; keeps the
  unshaped reward (`rewards_unshaped`), adds the penalty (`reward_overlong`) to `rewards`, and
  with loss.overlong_filtering sets sample_mask 0 on truncated rows (they still count in their
  group's statistics: NeMo-RL's choice, its baseline is over every response).
- `informative_groups(batch, on)`: per group id, whether its unshaped reward (or `correct`)
  is not all equal; `frac_zero_std(batch)` the fraction of groups where it is.
- `select_groups(batches, num_groups, group_size)`: the step's P x G rows from the informative
  groups of successive generation batches, in order (NeMo-RL: accumulate, slice); a shortfall
  is filled with padding rows (group id -1, sample_mask 0: in no statistic and no loss).
"""

from __future__ import annotations

import numpy as np

from jgrpo.batch import TrainBatch
from jgrpo.config import Config

PADDED_KEYS = tuple(k for k, (axes, _) in TrainBatch.FIELDS.items() if axes == "bt")
"""The [B, T] arrays of a rollout batch (TrainBatch's); every other key is per row."""


def overlong_penalty(lengths, max_new_tokens: int, length: int, penalty: float) -> np.ndarray:
    """float32[B] min(-(L - (Lmax - length)) / length * penalty, 0)."""
    exceed = np.asarray(lengths, np.float64) - (max_new_tokens - length)
    return np.minimum(-exceed / length * penalty, 0.0).astype(np.float32)


def shape_training_batch(batch: dict, cfg: Config) -> dict:
    """In place (and returned): the overlong term and overlong filtering (module docstring)."""
    batch["rewards_unshaped"] = batch["rewards"].copy()
    ob = cfg.grpo.overlong_buffer
    if ob is not None:
        term = overlong_penalty(batch["lengths"], cfg.rollout.max_new_tokens, ob.length, ob.penalty)
        batch["reward_overlong"] = term
        batch["rewards"] = (batch["rewards"] + term).astype(np.float32)
    if cfg.loss.overlong_filtering:
        batch["sample_mask"] = np.where(batch["truncated"], 0.0, batch["sample_mask"]).astype(
            np.float32
        )
    return batch


def _filter_values(batch: dict, on: str) -> np.ndarray:
    if on == "correct":
        return batch["correct"].astype(np.float32)
    return batch.get("rewards_unshaped", batch["rewards"]).astype(np.float32)


def informative_groups(batch: dict, on: str = "reward") -> dict[int, bool]:
    """{group id: the group's values are not all equal}, ids >= 0 in first-row order."""
    values, gids = _filter_values(batch, on), batch["group_ids"]
    out: dict[int, bool] = {}
    for gid in dict.fromkeys(int(g) for g in gids if g >= 0):
        v = values[gids == gid]
        out[gid] = bool(v.max() != v.min())
    return out


def frac_zero_std(batch: dict, on: str = "reward") -> float:
    """Fraction of the groups whose values are all equal (zero std: zero advantage)."""
    groups = informative_groups(batch, on)
    return float(sum(not k for k in groups.values()) / max(len(groups), 1))


def _pad_width(batch: dict, width: int) -> dict:
    pad = width - batch["input_ids"].shape[1]
    if not pad:
        return batch
    return {k: np.pad(v, ((0, 0), (pad, 0))) if k in PADDED_KEYS else v for k, v in batch.items()}


def select_groups(
    batches: list[dict], num_groups: int, group_size: int, on: str = "reward"
) -> tuple[dict, int]:
    """(batch of num_groups x group_size rows, informative groups kept). Groups are renumbered
    0.. in order; [B, T] arrays are left-padded to the widest batch; only keys every batch has
    are kept."""
    width = max(b["input_ids"].shape[1] for b in batches)
    keys = [k for k in batches[0] if all(k in b for b in batches)]
    parts, kept = [], 0
    for b in batches:
        b = _pad_width({k: b[k] for k in keys}, width)
        for gid, ok in informative_groups(b, on).items():
            if ok and kept < num_groups:
                rows = np.flatnonzero(b["group_ids"] == gid)
                part = {k: v[rows] for k, v in b.items()}
                part["group_ids"] = np.full(len(rows), kept, np.int32)
                parts.append(part)
                kept += 1
    missing = num_groups * group_size - sum(len(p["group_ids"]) for p in parts)
    if missing:  # padding rows: copies of the first row, in no group and no loss
        first = _pad_width({k: batches[0][k] for k in keys}, width)
        filler = {k: np.repeat(v[:1], missing, axis=0) for k, v in first.items()}
        filler["group_ids"] = np.full(missing, -1, np.int32)
        filler["sample_mask"] = np.zeros(missing, np.float32)
        parts.append(filler)
    return {k: np.concatenate([p[k] for p in parts]) for k in keys}, kept
