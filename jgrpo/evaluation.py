"""Validation metrics of a policy on every held-out set: what training logs and `jgrpo eval` prints.

Sets: the run's own held-out set (`val/...`) and each data.val_sets entry (`val/<name>/...`),
each prompted and scored by its own task and reward terms (`Task.val_tasks`), so a set can
measure the task independently of the training reward. Per set:
- greedy `accuracy` (the verifier's), `reward_mean`, `length_mean`;
- with grpo.val_num_generations n > 1, n samples per example at rollout.val_temperature:
  `mean@n` (mean correctness), `pass@k` for k in grpo.val_pass_at (the unbiased estimator
  1 - C(n - c, k) / C(n, k) of Chen et al. 2021 with c correct of n, averaged over examples)
  and `maj@n` (majority vote over the verifier's extracted answers, `majority_correct`).
Tasks without a verifier get the reward and length metrics only (`reward_mean@n` sampled).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from jgrpo.config import Config
from jgrpo.rollout import RolloutResult


def greedy_metrics(result: RolloutResult) -> dict[str, float]:
    """reward_mean, length_mean and (with a verifier) accuracy of one greedy sample per example."""
    metrics = {
        "reward_mean": float(result.batch["rewards"].mean()),
        "length_mean": float(result.batch["lengths"].mean()),
    }
    if "correct" in result.batch:
        metrics["accuracy"] = float(result.batch["correct"].mean())
    return metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one example: c of n samples correct, k <= n (exact integers)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(votes_n, correct_n) -> bool:
    """maj@n of one example: the answer most samples gave (votes, -1 = no answer, which does
    not vote) is correct. Ties go to the tied answer first given in sample order (as
    `collections.Counter.most_common`); no answer at all counts as wrong."""
    votes = [int(v) for v in votes_n]
    counts = Counter(v for v in votes if v != -1)
    if not counts:
        return False
    winner = counts.most_common(1)[0][0]
    return bool(correct_n[votes.index(winner)])


def sampled_metrics(result: RolloutResult, num_examples: int, n: int, ks) -> dict[str, float]:
    """mean@n, pass@k, maj@n of n example-major samples per example (no prefix)."""
    if "correct" not in result.batch:
        return {f"reward_mean@{n}": float(result.batch["rewards"].mean())}
    correct = result.batch["correct"].reshape(num_examples, n)
    c = correct.sum(axis=1)
    out = {f"mean@{n}": float(correct.mean())}
    for k in ks:
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(ci), k) for ci in c]))
    if "vote_ids" in result.batch:
        votes = result.batch["vote_ids"].reshape(num_examples, n)
        out[f"maj@{n}"] = float(np.mean([majority_correct(v, r) for v, r in zip(votes, correct)]))
    return out


def has_held_out(task) -> bool:
    """Some set has examples (record data without a val source has none: no validation)."""
    return bool(task.val) or any(vt.val for vt in task.val_tasks.values())


def validate_all(cfg: Config, backend, task, step: int) -> dict[str, float]:
    """Every set's metrics (module docstring) with the backend's current weights."""
    g = cfg.grpo
    sets = [("val", None, task.val), *((n, n, vt.val) for n, vt in task.val_tasks.items())]
    metrics: dict[str, float] = {}
    for name, val_set, examples in sets:
        if not examples:  # record data with no held-out set (jgrpo.tasks.task): nothing to score
            continue
        prefix = "val/" if val_set is None else f"val/{name}/"
        result = backend.evaluate(examples, step, pass_k=1, val_set=val_set)
        metrics |= {prefix + k: v for k, v in greedy_metrics(result).items()}
        if g.val_num_generations > 1:
            n = g.val_num_generations
            result = backend.evaluate(examples, step, pass_k=n, val_set=val_set)
            for key, value in sampled_metrics(result, len(examples), n, g.val_pass_at).items():
                metrics[prefix + key] = value
    return metrics


def format_table(metrics: dict[str, float]) -> str:
    """One `key value` line per metric, sets in order."""
    return "\n".join(f"{key:32s} {value:.4f}" for key, value in metrics.items())
