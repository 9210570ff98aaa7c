"""The turn loop: a batch of conversations generated turn by turn, kept as token ids.

A row is [left-padded prompt, P][completion region, N = rollout.max_new_tokens][pad]; the region
holds gen_1 ++ reply_1 ++ gen_2 ++ ...: gen_t the sampler's ids of turn t, stop token included
(mask 1, logprobs kept; a turn also stops at the template's end-of-turn token, ChatFormat.stop_ids),
reply_t the chat template's suffix for the tool results or observation answering it (mask 0;
jgrpo.rollout.conversation). A row ends when a turn makes no tool call and the environment (if
any) is done or absent, after rollout.max_turns turns, or when the region runs out (truncated: a
turn reached its end, or the next reply leaves no room for one generated token). Turn t is one
`sampling.generate` over the running rows with the whole sequence so far as prompt (re-prefill),
key `key` for t = 1 (so one turn is the single-turn rollout) and fold_in(key, t) after, each row
keyed by its global index. Compiled shapes stay bounded: running rows are padded (a repeated row
draws identically) to a power of two (at most B), contexts to a multiple of prompt_bucket, a
turn's max_new_tokens is the largest remaining budget rounded up to one; rows are cut at their
own budget on the host. Tool calls and environment steps of a turn run as one batch of ops."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Optional

import jax
import numpy as np

from jgrpo import sampling
from jgrpo.rollout.conversation import ChatFormat, tool_message
from jgrpo.rollout.tool_calls import ParsedTurn, parse_tool_calls
from jgrpo.tasks.child import OK, TIMEOUT

ROW_COUNTS = (
    "turns",
    "tool_calls",
    "tool_errors",
    "tool_timeouts",
    "tool_responses_cut",
    "environment_errors",
    "environment_timeouts",
    "reply_tokens",
)
"""Per-row int32 counts of a multi-turn batch (batch keys `turns`, `tool_calls`, ...)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TurnSettings:
    """The rollout.* and data.* values the loop reads."""

    max_turns: int = 1
    max_tool_response_tokens: Optional[int] = None
    tool_call_format: str = "hermes"
    tools: bool = False
    """Parse tool calls and run them."""
    environment: bool = False
    """Step the rows' environments after turns without tool calls."""

    @classmethod
    def from_config(cls, cfg, tools: bool, environment: bool) -> TurnSettings:
        ro = cfg.rollout
        return cls(
            max_turns=ro.max_turns,
            max_tool_response_tokens=ro.max_tool_response_tokens,
            tool_call_format=ro.tool_call_format,
            tools=tools,
            environment=environment,
        )


@dataclasses.dataclass
class Conversations:
    """The loop's output (numpy; [B, N] arrays aligned with the completion region)."""

    tokens: np.ndarray
    """[B, N] int32 gen_1 ++ reply_1 ++ ..., pad after the end."""
    logprobs: np.ndarray
    """[B, N] float32 sampler logprobs of generated ids, 0 elsewhere."""
    generated: np.ndarray
    """[B, N] bool: the sampler generated this id (the loss mask)."""
    lengths: np.ndarray
    """[B] int32 region tokens used (generated and reply)."""
    truncated: np.ndarray
    """[B] bool: the region ran out (truncated by the budget)."""
    prompt_tokens: np.ndarray
    """[B, P] int32 the turn-1 prompts, left-padded."""
    prompt_lengths: np.ndarray
    texts: list[str]
    """Each row's last assistant turn: its content (outside tool calls) with tools on, else
    its whole decoded text (the single-turn completion)."""
    messages: list[list[dict]]
    """The messages after the prompt (assistant, tool, user observations), as TRL gives them."""
    counts: dict[str, np.ndarray]
    """ROW_COUNTS -> int32 [B]."""
    environment_rewards: np.ndarray
    """[B] float32 sum of the environment's step rewards, NaN when it gave none."""
    decode_s: float = 0.0
    """Seconds spent decoding turns (for the tool-call parser and the environment)."""
    tools_s: float = 0.0
    """Seconds spent in tool calls, environment steps and the replies' ids."""
    tool_errors_by_name: dict[str, int] = dataclasses.field(default_factory=dict)
    """Calls of each named tool that failed (raised, timed out, returned what is not text)."""
    expert_ids: Optional[np.ndarray] = None
    """[B, P + N, l_moe, k] int16 the sampler's recorded experts (`Generation.expert_ids`; one
    turn only: params.record_experts refuses several)."""


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _row_bucket(n: int, total: int) -> int:
    return min(total, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def run_turns(
    model,
    prompts: list[list[int]],
    params: sampling.SamplingParams,
    key,
    settings: TurnSettings,
    tokenizer,
    *,
    first_row: int = 0,
    group_size: int = 1,
    chat: Optional[ChatFormat] = None,
    runner=None,
    environment_ok: Optional[np.ndarray] = None,
) -> Conversations:
    """Generate conversations for `prompts` (module docstring). `chat` and `runner` (a
    jgrpo.tasks.tools.ToolRunner whose environments were reset for rows 0..B-1;
    `environment_ok` [B] marks the resets that succeeded) are needed once a reply can happen
    (settings.tools / settings.environment)."""
    b_total, n = len(prompts), params.max_new_tokens
    if params.record_experts and (settings.max_turns > 1 or settings.tools or settings.environment):
        raise ValueError(
            "router replay: the sampler records the experts of single-turn rollouts only "
            "(a later turn re-prefills the earlier ones and routes them anew)"
        )
    if chat is not None:  # a turn also ends at the template's end-of-turn token
        stops = tuple(sorted(set(params.stop_token_ids) | set(chat.stop_ids)))
        params = dataclasses.replace(params, stop_token_ids=stops)
    region: list[list[int]] = [[] for _ in range(b_total)]
    lps: list[list[float]] = [[] for _ in range(b_total)]
    gen_bits: list[list[bool]] = [[] for _ in range(b_total)]
    alive = np.ones(b_total, bool)
    truncated = np.zeros(b_total, bool)
    counts = {k: np.zeros(b_total, np.int32) for k in ROW_COUNTS}
    env_reward = np.full(b_total, np.nan, np.float64)
    texts = [""] * b_total
    messages: list[list[dict]] = [[] for _ in range(b_total)]
    first_gen = None
    seconds = {"decode": 0.0, "tools": 0.0}
    by_name: dict[str, int] = {}
    for turn in range(1, settings.max_turns + 1):
        running = np.flatnonzero(alive)
        if running.size == 0:
            break
        gen = _generate(model, prompts, region, running, params, key, turn, first_row, group_size)
        if turn == 1:
            first_gen = gen
        ops, pending = [], {}
        for i, b in enumerate(running):
            budget = n - len(region[b])
            length = int(gen.lengths[i])
            keep = min(length, budget)
            region[b] += gen.tokens[i, :keep].tolist()
            lps[b] += gen.logprobs[i, :keep].tolist()
            gen_bits[b] += [True] * keep
            counts["turns"][b] += 1
            start = time.perf_counter()
            text = tokenizer.decode(gen.tokens[i, :keep], skip_special_tokens=True)
            seconds["decode"] += time.perf_counter() - start
            parsed = (
                parse_tool_calls(text, settings.tool_call_format)
                if settings.tools
                else ParsedTurn(content=text)
            )
            texts[b] = parsed.content if settings.tools else text
            messages[b].append(parsed.message())
            if bool(gen.truncated[i]) or length > budget:
                truncated[b], alive[b] = True, False
                continue
            last = turn == settings.max_turns
            if parsed.blocks:
                counts["tool_calls"][b] += len(parsed.blocks)
                counts["tool_errors"][b] += len(parsed.errors)
                if last:
                    alive[b] = False
                    continue
                pending[b] = []  # tool message i answers block i: errors stay in place
                for block in parsed.blocks:
                    if isinstance(block, str):
                        pending[b].append(tool_message("", block))
                        continue
                    pending[b].append(tool_message(block.name, ""))
                    ops.append(("call", int(b), (block.name, block.arguments), len(pending[b]) - 1))
            elif settings.environment and environment_ok[b]:
                pending[b] = []
                ops.append(("step", int(b), text, None))
            else:
                alive[b] = False
        start = time.perf_counter()
        results = runner.run([op[:3] for op in ops]) if ops else []
        for (kind, b, arg, slot), (status, value) in zip(ops, results):
            if kind == "call":
                counts["tool_errors"][b] += status != OK
                by_name[arg[0]] = by_name.get(arg[0], 0) + (status != OK)
                counts["tool_timeouts"][b] += status == TIMEOUT
                pending[b][slot] = dict(pending[b][slot], content=value)
                continue
            if status != OK:
                counts["environment_errors"][b] += 1
                counts["environment_timeouts"][b] += status == TIMEOUT
                alive[b] = False
                continue
            observation, reward, done = value
            if reward is not None:
                env_reward[b] = np.nan_to_num(env_reward[b]) + reward
            if done or turn == settings.max_turns:
                alive[b] = False
            elif observation is not None:
                pending[b] = [{"role": "user", "content": observation}]
        for b, reply in pending.items():
            if not alive[b]:
                continue
            reply = [_cut(m, tokenizer, settings, counts, b) for m in reply]
            ids = chat.reply_ids(reply)
            if len(region[b]) + len(ids) >= n:  # no room left for a generated token
                truncated[b], alive[b] = True, False
                continue
            region[b] += ids
            lps[b] += [0.0] * len(ids)
            gen_bits[b] += [False] * len(ids)
            counts["reply_tokens"][b] += len(ids)
            messages[b] += reply
        seconds["tools"] += time.perf_counter() - start
    conv = _pack(first_gen, region, lps, gen_bits, truncated, texts, messages, counts, env_reward)
    return dataclasses.replace(
        conv, decode_s=seconds["decode"], tools_s=seconds["tools"], tool_errors_by_name=by_name
    )


def _cut(message: dict, tokenizer, settings: TurnSettings, counts: dict, b: int) -> dict:
    """A tool message whose content has more than max_tool_response_tokens ids keeps the first
    ones (decoded: tool text, not generated text, so no token-in/token-out rule applies)."""
    limit = settings.max_tool_response_tokens
    if message["role"] != "tool" or limit is None:
        return message
    ids = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
    if len(ids) <= limit:
        return message
    counts["tool_responses_cut"][b] += 1
    return dict(message, content=tokenizer.decode(ids[:limit]))


def _generate(model, prompts, region, running, params, key, turn, first_row, group_size):
    """Turn `turn`'s sampler call over the `running` rows (turn 1: every row, as the
    single-turn rollout calls it)."""
    if turn == 1:
        return sampling.generate(
            model, prompts, params, key, first_row=first_row, group_size=group_size
        )
    n = params.max_new_tokens
    budget = max(n - len(region[b]) for b in running)
    turn_params = dataclasses.replace(
        params, max_new_tokens=min(n, _round_up(budget, params.prompt_bucket))
    )
    rows = list(running) + [running[0]] * (_row_bucket(len(running), len(prompts)) - len(running))
    return sampling.generate(
        model,
        [prompts[b] + region[b] for b in rows],
        turn_params,
        jax.random.fold_in(key, turn),
        row_ids=[first_row + int(b) for b in rows],
    )


def _pack(first_gen, region, lps, gen_bits, truncated, texts, messages, counts, env_reward):
    b, n = first_gen.tokens.shape
    tokens = np.array(first_gen.tokens)  # pad after each row's turn-1 end, overwritten below
    logprobs = np.zeros((b, n), np.float32)
    generated = np.zeros((b, n), bool)
    lengths = np.asarray([len(r) for r in region], np.int32)
    for row in range(b):
        m = len(region[row])
        tokens[row, :m] = region[row]
        logprobs[row, :m] = lps[row]
        generated[row, :m] = gen_bits[row]
    return Conversations(
        tokens=tokens,
        logprobs=logprobs,
        generated=generated,
        lengths=lengths,
        truncated=truncated,
        prompt_tokens=first_gen.prompt_tokens,
        prompt_lengths=first_gen.prompt_lengths,
        texts=texts,
        messages=messages,
        counts=counts,
        environment_rewards=env_reward.astype(np.float32),
        expert_ids=first_gen.expert_ids,
    )


def row_counts_stats(batch: dict[str, Any]) -> dict[str, float]:
    """The multi-turn metrics of a batch holding ROW_COUNTS (empty when it does not)."""
    if "turns" not in batch:
        return {}
    turns = batch["turns"].astype(np.float64)
    used = batch["lengths"].astype(np.float64).sum()
    stats = {
        "turns/mean": float(turns.mean()),
        "turns/max": float(turns.max()),
        "tools/calls": float(batch["tool_calls"].sum()),
        "tools/errors": float(batch["tool_errors"].sum()),
        "tools/timeouts": float(batch["tool_timeouts"].sum()),
        "tools/responses_cut": float(batch["tool_responses_cut"].sum()),
        "environment/errors": float(batch["environment_errors"].sum()),
        "environment/timeouts": float(batch["environment_timeouts"].sum()),
        "tokens/tool_fraction": float(batch["reply_tokens"].sum() / max(used, 1.0)),
        "tokens/truncated_by_budget": float(batch["truncated"].sum()),
    }
    return stats
