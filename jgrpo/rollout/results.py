"""Scored rollout batches: `RolloutResult`, its statistics (`batch_stats`), and the joins of
several workers' batches (`concat_results`, Ray) and of a pod's hosts (`join_pod_slice`,
`gather_pod_rows`), which keep padding rows (group id -1) as padding and add up the counts that
add up (failures, an agent endpoint's sampler calls)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jgrpo import distributed
from jgrpo.batch import TrainBatch, left_pad
from jgrpo.rollout import agent_rollout, dapo, turns
from jgrpo.rollout.dapo import PADDED_KEYS
from jgrpo.tasks.child import ERROR

STEP_KEYS = tuple(TrainBatch.FIELDS)
"""The batch fields the train step consumes (jgrpo.batch.TrainBatch)."""


@dataclasses.dataclass
class RolloutResult:
    """One scored rollout batch (numpy) with its per-batch statistics."""

    batch: dict[str, np.ndarray]
    stats: dict[str, float]
    samples: list[dict[str, Any]]
    """A few (prompt, completion, reward) records for logging (logging.num_samples)."""
    reward_names: tuple[str, ...] = ()
    """Names of the custom reward terms, the columns of batch["reward_terms"]."""
    failures: list = dataclasses.field(default_factory=list)
    """Each piece of user code's first failure in this batch (jgrpo.tasks.child.Failure): the
    backends hand them to `report_failures` in the trainer process."""

    def step_batch(self) -> TrainBatch:
        """The train step's input: the TrainBatch fields of `batch` (checked)."""
        return TrainBatch.from_mapping(self.batch)


def concat_results(results: list[RolloutResult], group_offsets: list[int]) -> RolloutResult:
    """Join per-worker results (rows in order); group ids are shifted by `group_offsets`."""
    width = max(r.batch["input_ids"].shape[1] for r in results)
    parts = []
    for r, offset in zip(results, group_offsets):
        b = dict(r.batch)
        b["group_ids"] = shift_groups(b["group_ids"], offset)
        pad = width - b["input_ids"].shape[1]
        if pad:  # different prompt buckets: left-pad the narrower batch
            for key in PADDED_KEYS:
                if key in b:
                    b[key] = left_pad(key, b[key], pad)
        parts.append(b)
    batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    counts = {k: float(sum(r.stats[k] for r in results)) for k in failure_keys(results[0].stats)}
    # workers run side by side: a phase lasts as long as its slowest worker
    counts |= {k: max(r.stats[k] for r in results) for k in PHASE_KEYS if k in results[0].stats}
    counts |= agent_rollout.merge_sampler_parts(
        [agent_rollout.sampler_parts(r.stats) for r in results]
    )
    samples = [s for r in results for s in r.samples]
    names = results[0].reward_names
    failures = [f for r in results for f in r.failures]
    return RolloutResult(batch, batch_stats(batch, names) | counts, samples, names, failures)


def shift_groups(group_ids: np.ndarray, offset: int) -> np.ndarray:
    """Group ids + offset, padding rows (id < 0: no sample) left at -1."""
    return np.where(group_ids >= 0, group_ids + offset, group_ids).astype(np.int32)


REWARD_FAILURE_KEYS = ("reward/num_errors", "reward/num_timeouts", "reward/num_none")


def failure_keys(stats: dict) -> tuple[str, ...]:
    """The counts of a rollout's failures that add up over workers and hosts: the reward
    failures and each tool's `tools/<name>/num_errors` (every worker reports every tool)."""
    tools = sorted(k for k in stats if k.startswith("tools/") and k.endswith("/num_errors"))
    return REWARD_FAILURE_KEYS + tuple(tools)


PHASE_KEYS = (
    "perf/sample_s",
    "perf/detokenize_s",
    "perf/tools_s",
    "perf/reward_s",
    "perf/reward_model_s",
)
"""Seconds of a rollout's phases: the sampler (tokens out, on the host; every turn's), tokenizer
decode of the completions, tool calls and environment steps with the replies' ids (multi-turn
only), and reward scoring (the task's verifier, reward functions and models), of which the
reward models' forwards (re-tokenising included)."""


def batch_stats(batch: dict[str, np.ndarray], reward_names=()) -> dict[str, float]:
    """Per-batch statistics; `reward/<name>/mean` averages a custom term over the rows where it
    gave a value (NaN when none did: logged as null)."""
    lengths = batch["lengths"].astype(np.float64)
    stats = {
        "length/mean": float(lengths.mean()),
        "length/min": float(lengths.min()),
        "length/max": float(lengths.max()),
        "length/truncation_rate": float(batch["truncated"].mean()),
        "batch/frac_reward_zero_std": dapo.frac_zero_std(batch),
        "rollout/weight_version_min": float(batch["weight_version"].min()),
        "rollout/weight_version_max": float(batch["weight_version"].max()),
        "reward/num_masked": float((batch["sample_mask"] == 0).sum()),
    }
    if "correct" in batch:  # tasks with a verifier
        stats["reward/accuracy"] = float(batch["correct"].mean())
    if "reward_overlong" in batch:
        stats["reward/overlong/mean"] = float(batch["reward_overlong"].astype(np.float64).mean())
    stats |= turns.row_counts_stats(batch)  # multi-turn batches only
    stats |= agent_rollout.agent_stats(batch)  # data.agent batches only
    terms = batch.get("reward_terms")
    for f, name in enumerate(reward_names):
        column = terms[:, f].astype(np.float64)
        given = ~np.isnan(column)
        stats[f"reward/{name}/mean"] = float(column[given].mean()) if given.any() else math.nan
        if "reward_status" in batch:
            failed = batch["reward_status"][:, f] == ERROR
            stats[f"reward/{name}/num_errors"] = float(failed.sum())
    return stats


def join_pod_slice(result: RolloutResult, group_offset: int = 0) -> RolloutResult:
    """This host's rows of a pod step, ready to feed the global batch, with pod-wide statistics.

    Group ids are shifted by `group_offset` (to the step's global prompt index), the [B, T]
    arrays left-padded to the widest host's width (another host's prompts may take a wider
    bucket: every host must feed the same shape), and the statistics recomputed over every
    host's rows (`gather_pod_rows`). Every process must call it (collective)."""
    batch = dict(result.batch)
    batch["group_ids"] = shift_groups(batch["group_ids"], group_offset)
    width = max(int(w) for w in distributed.allgather(np.int64(batch["input_ids"].shape[1])))
    if "agent_calls" in batch:  # agent batches: as many rows as the host with the most
        rows = max(int(r) for r in distributed.allgather(np.int64(len(batch["group_ids"]))))
        batch = agent_rollout.pad_rows(batch, rows)
    pad = width - batch["input_ids"].shape[1]
    if pad:
        for k in PADDED_KEYS:
            if k in batch:
                batch[k] = left_pad(k, batch[k], pad)
    stats = gather_pod_rows(RolloutResult(batch, result.stats, [], result.reward_names)).stats
    return RolloutResult(batch, stats, result.samples, result.reward_names, result.failures)


def gather_pod_rows(result: RolloutResult | None, reward_names=None) -> RolloutResult:
    """Every host's per-row arrays (not the [B, T] ones: a few scalars per row), in process
    order, with `batch_stats` of them and the summed reward-failure counts: the one-process
    numbers. `result` None: this host has no rows (then `reward_names` names the terms).
    Every process must call it (collective)."""
    names = tuple(result.reward_names if result is not None else reward_names)
    batch = {} if result is None else result.batch
    local = dict.fromkeys(REWARD_FAILURE_KEYS, 0.0) if result is None else result.stats
    rows = distributed.allgather_rows({k: v for k, v in batch.items() if k not in PADDED_KEYS})
    here = np.concatenate(
        [[local[k] for k in REWARD_FAILURE_KEYS], agent_rollout.sampler_parts(local)]
    )
    counts = np.asarray(distributed.allgather(here))
    total = np.sum(counts[:, : len(REWARD_FAILURE_KEYS)], axis=0)
    failures = {k: float(v) for k, v in zip(REWARD_FAILURE_KEYS, total)}
    failures |= agent_rollout.merge_sampler_parts(counts[:, len(REWARD_FAILURE_KEYS) :])
    # per-tool counts: this host's (a host with no rows may not know the tools' names)
    failures |= {k: local[k] for k in failure_keys(local)[len(REWARD_FAILURE_KEYS) :]}
    phases = {k: local[k] for k in PHASE_KEYS if k in local}  # this host's phase timings
    mine = [] if result is None else result.failures  # this host's, reported by this host
    return RolloutResult(rows, batch_stats(rows, names) | failures | phases, [], names, mine)
