"""A rollout run by `data.agent`: agents call the endpoint, their calls become training rows.

`run_agents` opens one endpoint rollout per row, starts the rows' agents (jgrpo.tasks.agents)
and serves their requests on this thread (the device's) in batches until every agent has
reported, cancelling an agent whose own time (not its calls') passes data.agent_timeout_s.
`build_rows`: every SEQUENCE of every rollout (jgrpo.rollout.agent_record) is a row
[prompt, P][region, N] with the rollout's reward and group, so a rollout split in k sequences
counts k times in its group's statistics and each sequence is a row for every normaliser; a
rollout without sequences gets one empty row; rows are padded to a multiple of the rollouts B
(group id -1: no sample). A failed agent's rows hold no sample. `agent_stats` (the agents/*
metrics), `pad_rows` (a pod host's rows up to the others'), `sampler_parts` /
`merge_sampler_parts` (endpoint batch sizes over Ray workers and pod hosts). docs/agents.md."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from jgrpo import sampling
from jgrpo.rollout.agent_record import Sequence
from jgrpo.tasks.child import OK, TIMEOUT

AGENT_COUNTS = (
    "agent_calls",
    "agent_sequences",
    "agent_errors",
    "agent_timeouts",
    "agent_budget_cuts",
    "agent_bad_requests",
)
"""Per-row int32 counts of an agent batch, on each rollout's first row (0 on its others)."""


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _row_bucket(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def make_generate(model, params: sampling.SamplingParams, key):
    """The endpoint's sampler: (prompts, max_new_tokens, top_p, row_ids) -> Generation, rows
    padded to a power of two (a repeated row) and max_new_tokens rounded up to prompt_bucket
    so a run compiles few programs."""

    def generate(prompts, max_new, top_p, row_ids):
        n = len(prompts)
        width = _row_bucket(n)
        budget = min(params.max_new_tokens, _round_up(max_new, params.prompt_bucket))
        call_params = dataclasses.replace(params, max_new_tokens=budget, top_p=float(top_p))
        pad = width - n
        return sampling.generate(
            model,
            list(prompts) + [prompts[0]] * pad,
            call_params,
            key,
            row_ids=list(row_ids) + [row_ids[0]] * pad,
        )

    return generate


def run_agents(endpoint, runner, model, examples, key, params_s, settings, first_row, task, g):
    """Run the agents of `examples` (g rows each) to the end -> (the endpoint's Rollout
    records, {row: (status, checked result or error text)}, timings and batch sizes)."""
    rows = [i for i in range(len(examples)) for _ in range(g)]
    ids = endpoint.open([first_row + b for b in range(len(rows))], settings)
    records = []
    for i in rows:
        record = task.columns(examples[i])
        record["prompt_messages"] = task.prompt_messages(examples[i])
        records.append(record)
    jobs = [(b, endpoint.base_url(rid), records[b]) for b, rid in enumerate(ids)]
    generate = make_generate(model, params_s, key)
    results: dict[int, tuple[int, object]] = {}
    start = time.perf_counter()
    sample_s = 0.0
    runner.submit(jobs, endpoint.api_key)
    began = time.perf_counter()  # the agents' own time counts from here
    try:
        while runner.running:
            for row, status, value in runner.poll(0.0):
                results[row] = (status, value)
            now = time.perf_counter() - began
            for b, waited in enumerate(endpoint.waited(ids)):  # the agent's own time
                if b not in results and now - waited > runner.timeout_s:
                    runner.cancel(b)
            t0 = time.perf_counter()
            if endpoint.step(generate, runner.running):
                sample_s += time.perf_counter() - t0
    finally:
        rollouts = endpoint.close_rollouts(ids)
    agent_s = time.perf_counter() - start
    return (
        rollouts,
        results,
        dict(sample_s=sample_s, agent_s=agent_s, batch_sizes=list(endpoint.batch_sizes)),
    )


def build_rows(rollouts, results, tokenizer, prompt_bucket: int, n: int, pad_id: int):
    """The training rows of the rollouts' sequences (module docstring) -> dict of numpy
    arrays (input_ids, attention_mask, token_mask, generation_logprobs, lengths, truncated,
    owner [R] = the rollout index of each row, -1 for padding), plus per-rollout completion
    texts; AGENT_COUNTS (and agent_first_row: 1 on each rollout's first row) are in the
    arrays."""
    b_total = len(rollouts)
    seqs, owner, first = [], [], []
    counts = {k: np.zeros(b_total, np.int32) for k in AGENT_COUNTS}
    completions = [""] * b_total
    for b, r in enumerate(rollouts):
        status, value = results.get(b, (TIMEOUT, "no result"))
        counts["agent_calls"][b] = len(r.calls)
        counts["agent_sequences"][b] = len(r.sequences)
        counts["agent_errors"][b] = status != OK and status != TIMEOUT
        counts["agent_timeouts"][b] = status == TIMEOUT
        counts["agent_budget_cuts"][b] = r.budget_cuts
        counts["agent_bad_requests"][b] = r.bad_requests
        last = r.calls[-1].choices[0] if r.calls and r.calls[-1].choices else None
        if last is not None:
            completions[b] = (
                last.message.get("content") or "" if last.message is not None else last.text
            )
        if status == OK and value.get("completion") is not None:
            completions[b] = value["completion"]
        first.append(len(seqs))
        for s in r.sequences or [Sequence([])]:  # a rollout without calls: one empty row
            seqs.append(s)
            owner.append(b)
    rows = _round_up(len(seqs), b_total)
    p = _round_up(max([len(s.prompt) for s in seqs] + [1]), prompt_bucket)
    t = p + n
    input_ids = np.full((rows, t), pad_id, np.int32)
    attention = np.zeros((rows, t), np.float32)
    token_mask = np.zeros((rows, t), np.float32)
    logprobs = np.zeros((rows, t), np.float32)
    lengths = np.zeros(rows, np.int32)
    truncated = np.zeros(rows, bool)
    for i, s in enumerate(seqs):
        lp, m = len(s.prompt), len(s.region)
        input_ids[i, p - lp : p] = s.prompt
        attention[i, p - lp : p] = 1.0
        input_ids[i, p : p + m] = s.region
        attention[i, p : p + m] = 1.0
        gen = np.asarray(s.generated, bool)
        token_mask[i, p : p + m] = gen
        logprobs[i, p : p + m] = np.where(gen, s.logprobs, 0.0)
        lengths[i], truncated[i] = m, s.truncated
    arrays = dict(
        input_ids=input_ids,
        attention_mask=attention,
        token_mask=token_mask,
        generation_logprobs=logprobs,
        lengths=lengths,
        truncated=truncated,
    )
    owner_r = np.full(rows, -1, np.int32)
    owner_r[: len(seqs)] = owner
    first_r = np.zeros(rows, np.int32)
    first_r[first] = 1
    for k, v in counts.items():  # each rollout's counts on its first row
        row_counts = np.zeros(rows, np.int32)
        row_counts[first] = v
        arrays[k] = row_counts
    arrays["agent_first_row"] = first_r
    return arrays, owner_r, completions


def score_rows(arrays, owner, rollouts, ok, rows, rewards, info, version: int) -> dict:
    """The batch of `build_rows`' arrays with each row's rollout scores (`Task.score`'s
    rewards and info, per rollout): reward, group (rows[b]; -1 for padding and for a rollout
    whose agent failed or made no sequence: no sample), sample_mask, correct, reward terms."""
    has_rows = ok & np.asarray([bool(r.sequences) for r in rollouts])
    real = owner >= 0
    at = np.maximum(owner, 0)
    batch = dict(arrays)
    batch["rewards"] = np.where(real, rewards[at], 0.0).astype(np.float32)
    keep = real & has_rows[at]
    batch["group_ids"] = np.where(keep, np.asarray(rows)[at], -1).astype(np.int32)
    sample_mask = np.asarray(info["sample_mask"], np.float32)[at]
    batch["sample_mask"] = np.where(keep, sample_mask, 0.0).astype(np.float32)
    batch["weight_version"] = np.full(len(owner), version, np.int32)
    if info["correct"] is not None:
        batch["correct"] = np.where(real, np.asarray(info["correct"], bool)[at], False)
    terms = np.asarray(info["reward_terms"], np.float32).reshape(len(rows), -1)
    status = np.asarray(info["reward_status"], np.int8).reshape(len(rows), terms.shape[1])
    batch["reward_terms"] = np.where(real[:, None], terms[at], np.nan).astype(np.float32)
    batch["reward_status"] = np.where(real[:, None], status[at], 0).astype(np.int8)
    return batch


def reward_columns(results, ok, terms: tuple[str, ...] | None) -> np.ndarray:
    """The agents' reward terms, NaN where none: float64[B] of each agent's reward, or with
    `terms` (a verifiers environment's components) float64[B, len(terms)] from its "terms"."""
    b_total = len(ok)
    if terms is None:
        out = np.full(b_total, np.nan)
        for b in np.flatnonzero(ok):
            out[b] = np.nan if results[b][1]["reward"] is None else results[b][1]["reward"]
        return out
    out = np.full((b_total, len(terms)), np.nan)
    for b in np.flatnonzero(ok):
        given = results[b][1]["terms"] or {}
        unknown = set(given) - set(terms)
        if unknown:
            raise ValueError(f"the environment gave reward components {unknown} not in {terms}")
        for k, name in enumerate(terms):
            out[b, k] = np.nan if given.get(name) is None else given[name]
    return out


def agent_stats(batch) -> dict[str, float]:
    """The agent metrics of a batch holding AGENT_COUNTS (empty when it does not), and its
    per-rollout `reward/num_masked` and `reward/accuracy` (read on each rollout's first row:
    padding rows and a split rollout's other rows are not counted)."""
    if "agent_calls" not in batch:
        return {}
    seqs = batch["agent_sequences"]
    first = batch["agent_first_row"] > 0
    per_rollout = {"reward/num_masked": float((batch["sample_mask"][first] == 0).sum())}
    if "correct" in batch:
        correct = batch["correct"][first]
        per_rollout["reward/accuracy"] = float(correct.mean()) if len(correct) else math.nan
    return per_rollout | {
        "agents/calls": float(batch["agent_calls"].sum()),
        "agents/sequences": float(seqs.sum()),
        "agents/split_rollouts": float((seqs > 1).sum()),
        "agents/no_calls": float(
            ((batch["agent_calls"] == 0) & (batch["agent_first_row"] > 0)).sum()
        ),
        "agents/errors": float(batch["agent_errors"].sum()),
        "agents/timeouts": float(batch["agent_timeouts"].sum()),
        "agents/budget_cuts": float(batch["agent_budget_cuts"].sum()),
        "agents/bad_requests": float(batch["agent_bad_requests"].sum()),
    }


def pad_rows(batch: dict, rows: int) -> dict:
    """`batch` with padding rows appended up to `rows` (a pod's hosts must feed as many rows
    each; an agent batch's row count depends on its splits): group id -1, no sample, no loss,
    zeros elsewhere (reward terms NaN, the weight version repeated)."""
    have = len(batch["group_ids"])
    if have >= rows:
        return batch
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        fill = {"group_ids": -1, "reward_terms": np.nan}.get(key, 0)
        extra = np.full((rows - have,) + value.shape[1:], fill, value.dtype)
        if key == "weight_version":
            extra[:] = value[0]
        out[key] = np.concatenate([value, extra])
    return out


SAMPLER_PARTS = 5
"""Length of `sampler_parts`: [has agents, sampler calls, rows of all calls, max rows, agent_s]."""


def sampler_parts(stats: dict) -> np.ndarray:
    """float64[SAMPLER_PARTS] of one worker's or host's endpoint statistics (zeros without
    agents), which `merge_sampler_parts` joins: a fixed shape, so hosts can allgather it."""
    if "agents/sampler_calls" not in stats:
        return np.zeros(SAMPLER_PARTS)
    calls = stats["agents/sampler_calls"]
    rows = calls * stats["agents/sampler_batch_mean"]
    return np.asarray(
        [1.0, calls, rows, stats["agents/sampler_batch_max"], stats["perf/agent_s"]], np.float64
    )


def merge_sampler_parts(parts) -> dict[str, float]:
    """The endpoint statistics of several workers or hosts (`sampler_parts` rows): calls
    summed, the mean over every call, the max, agent time the slowest one's (side by side)."""
    parts = np.asarray(parts, np.float64).reshape(-1, SAMPLER_PARTS)
    if not (parts[:, 0] > 0).any():
        return {}
    calls, rows = float(parts[:, 1].sum()), float(parts[:, 2].sum())
    return {
        "agents/sampler_calls": calls,
        "agents/sampler_batch_mean": rows / calls if calls else 0.0,
        "agents/sampler_batch_max": float(parts[:, 3].max()),
        "perf/agent_s": float(parts[:, 4].max()),
    }
