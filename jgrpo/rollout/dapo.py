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
- `plan_groups(rows, num_groups, group_size)`: which rows of successive generation batches
  make the step's P x G rows: the informative groups in order (NeMo-RL: accumulate, slice), a
  shortfall filled with padding rows (group id -1, sample_mask 0: in no statistic and no loss);
  `select_groups` applies it to one process's batches (a pod moves rows: rollout/exchange.py).
"""

from __future__ import annotations

import numpy as np

from jgrpo.batch import TOKEN_KEYS, left_pad
from jgrpo.config import Config

PADDED_KEYS = TOKEN_KEYS
"""The [B, T, ...] arrays of a rollout batch (jgrpo.batch.TOKEN_KEYS); every other key is per
row."""


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


def pad_width(batch: dict, width: int) -> dict:
    """`batch` with its [B, T] arrays left-padded to `width` columns."""
    pad = width - batch["input_ids"].shape[1]
    if not pad:
        return batch
    return {k: left_pad(k, v, pad) if k in PADDED_KEYS else v for k, v in batch.items()}


def join_batches(batches: list[dict]) -> dict:
    """The rows of successive batches as one, left-padded to the widest; the keys all have."""
    width = max(b["input_ids"].shape[1] for b in batches)
    keys = [k for k in batches[0] if all(k in b for b in batches)]
    padded = [pad_width({k: b[k] for k in keys}, width) for b in batches]
    return {k: np.concatenate([b[k] for b in padded]) for k in keys}


def plan_groups(
    rows: list[dict], num_groups: int, group_size: int, on: str = "reward"
) -> tuple[np.ndarray, np.ndarray, int]:
    """(pick_b, group_b, kept) of the step's num_groups x group_size rows from successive
    generation batches (`rows`: each batch's per-row arrays, group ids unique within a batch):
    row b copies row pick_b[b] of the batches' rows concatenated and gets group id group_b[b].
    The first num_groups informative groups in order (renumbered 0..), then padding rows
    (copies of the first row, group id -1); kept = the informative groups used."""
    picks, groups, kept, offset = [], [], 0, 0
    for b in rows:
        for gid, ok in informative_groups(b, on).items():
            if ok and kept < num_groups:
                r = np.flatnonzero(b["group_ids"] == gid)
                picks.append(offset + r)
                groups.append(np.full(len(r), kept))
                kept += 1
        offset += len(b["group_ids"])
    missing = num_groups * group_size - sum(len(p) for p in picks)
    picks.append(np.zeros(missing, np.int64))
    groups.append(np.full(missing, -1))
    return np.concatenate(picks).astype(np.int64), np.concatenate(groups).astype(np.int32), kept


def relabel(batch: dict, group_b: np.ndarray) -> dict:
    """In place (and returned): the planned group ids; padding rows (-1) get sample_mask 0, so
    they are in no statistic and no loss."""
    batch["group_ids"] = np.asarray(group_b, np.int32)
    batch["sample_mask"] = np.where(group_b < 0, 0.0, batch["sample_mask"]).astype(np.float32)
    return batch


def select_groups(
    batches: list[dict], num_groups: int, group_size: int, on: str = "reward"
) -> tuple[dict, int]:
    """(batch of num_groups x group_size rows, informative groups kept) of one process's
    generation batches (`plan_groups` applied to `join_batches`)."""
    pick_b, group_b, kept = plan_groups(batches, num_groups, group_size, on)
    joined = join_batches(batches)
    return relabel({k: v[pick_b] for k, v in joined.items()}, group_b), kept
