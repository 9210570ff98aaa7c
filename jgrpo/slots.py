"""The sampler's continuous-batching loop: B rows decoded in S < B slots (rollout.decode_slots).

Owns `decode_in_slots`, traced inside `jgrpo.sampling.generate_padded` (which owns the contract:
row keys, cache columns, positions). A stopped row's slot takes the next waiting row, its
prompt prefilled into the slot (once per group of identical prompts, staged until the group's
last row is in); once no row waits, the tail compacts under `compact_decode` (the slots narrow
to a half, a quarter, an eighth as their rows stop); the whole schedule is nested
`while_loop`s in the one program. docs/sampler.md ("Decode slots") explains the schedule, its
memory and its cost."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jgrpo.draws import greedy_token, sample_token
from jgrpo.models import kernels as _kernels
from jgrpo.models.moe import RECORDED_ID_DTYPE, expert_rows


def decode_in_slots(
    model,
    layers,
    prompt_ids_up,
    prompt_lengths_u,
    key,
    temperature,
    top_p,
    row_ids_b,
    *,
    spec,
    cache_len,
    segments,
    widths,
    path,
    record=False,
):
    """The slot loop of `jgrpo.sampling.generate_padded` (spec.decode_slots S < the B rows):
    its arguments, less the prompt positions it computes per entering prompt, plus `segments`:
    (end, attend_len) per decode segment, in order (the last one attends the whole cache),
    `widths`: the slot counts of the tail, S first (`sampling.compact_widths(S)` under
    spec.compact, else (S,)). `record`: also return the experts of the fed tokens (`expert_ids`
    [B, N, l_moe, k], column c = completion token c, and `prompt_expert_ids` [U, P, l_moe, k];
    an MoE model)."""
    u, p = prompt_ids_up.shape
    b = row_ids_b.shape[0]
    group = b // u
    n = spec.max_new_tokens
    num_slots = spec.decode_slots
    head_dv = model.head_weights()  # once per call, outside the loop (as `layers`)
    stops = jnp.asarray(spec.stop_token_ids or (-1,), jnp.int32)
    if not spec.greedy:
        temperature = jnp.asarray(temperature, jnp.float32)
        top_p = jnp.asarray(top_p, jnp.float32)
        row_keys_b = jax.vmap(jax.random.fold_in, (None, 0))(key, row_ids_b)

    def draw(rows_k, i_k, logits_kv):
        if spec.greedy:
            token_k, lp_k = greedy_token(logits_kv, path)
            return token_k, lp_k, jnp.zeros_like(lp_k)
        keys_k = jax.vmap(jax.random.fold_in)(row_keys_b[jnp.minimum(rows_k, b - 1)], i_k)
        return sample_token(
            logits_kv, keys_k, temperature, top_p, spec.top_k, spec.nucleus, path=path
        )

    def record_token(out, rows_k, i_k, logits_kv, live_k, ids_lkk=None):
        """Draw token i_k of rows rows_k (where live_k) and write it -> (out, token_k, ended_k);
        ids_lkk: the experts of the fed token i_k - 1 (record)."""
        tokens_bn, logprobs_bn, filtered_bn, lengths_b, stopped_b, *experts = out
        token_k, lp_k, flp_k = draw(rows_k, i_k, logits_kv)
        at_k = jnp.where(live_k, rows_k, b)  # out of range: dropped
        stop_k = jnp.isin(token_k, stops)
        out = (
            tokens_bn.at[at_k, i_k].set(token_k, mode="drop"),
            logprobs_bn.at[at_k, i_k].set(lp_k, mode="drop"),
            filtered_bn.at[at_k, i_k].set(flp_k, mode="drop"),
            lengths_b.at[at_k].set(i_k + 1, mode="drop"),
            stopped_b.at[at_k].set(stop_k, mode="drop"),
        )
        if experts and ids_lkk is not None:
            completion = experts[0].at[at_k, i_k - 1].set(expert_rows(ids_lkk), mode="drop")
            experts = [completion, *experts[1:]]
        return (*out, *experts), token_k, stop_k | (i_k + 1 >= n)

    def prefill_prompt(prompt):
        """Prompt `prompt`'s (1 row) last logits and cache, staged for its rows."""
        ids_1p = jax.lax.dynamic_slice_in_dim(prompt_ids_up, prompt, 1)
        mask_1p = jnp.arange(p)[None, :] >= p - prompt_lengths_u[prompt]
        positions_1p = jnp.maximum(jnp.cumsum(mask_1p, axis=-1) - 1, 0)
        if record:
            logits_1v, cache_1, ids_l1pk = model.prefill_routed(
                ids_1p, positions_1p, mask_1p, cache_len
            )
            cache_1 = _kernels.cache_in(cache_1, spec.kv_cache_dtype)
            return prompt, logits_1v, cache_1, expert_rows(ids_l1pk)
        logits_1v, cache_1 = model.prefill(
            ids_1p, positions_1p, mask_1p, cache_len, last_layer=layers[-1]
        )
        return prompt, logits_1v, _kernels.cache_in(cache_1, spec.kv_cache_dtype)

    def admit(state):
        """Give the next waiting row's prompt (prefilled once: it stays staged until its last
        row is in) to as many free slots as there are waiting rows of it; draw their token 0."""
        next_row, staged, slots, cache, out = state
        row_s, emitted_s, token_s, active_s, plen_s = slots
        free_s = ~active_s
        prompt = next_row // group
        staged = jax.lax.cond(staged[0] == prompt, lambda: staged, lambda: prefill_prompt(prompt))
        _, logits_1v, cache_1 = staged[:3]
        if record:  # the prompt's experts (written again by each of its entries: the same)
            out = (*out[:6], out[6].at[prompt].set(staged[3][0]))
        take = jnp.minimum(jnp.sum(free_s), group - next_row % group)
        j_g = jnp.arange(group)
        live_g = j_g < take
        slot_g = jnp.nonzero(free_s, size=group, fill_value=num_slots)[0]
        slot_g = jnp.where(live_g, slot_g, num_slots)  # out of range: dropped
        rows_g = next_row + j_g
        put = lambda c, c1: c.at[slot_g].set(
            jnp.broadcast_to(c1, (group,) + c1.shape[1:]), mode="drop"
        )
        cache = jax.tree.map(put, cache, cache_1)
        logits_gv = jnp.broadcast_to(logits_1v, (group, logits_1v.shape[-1]))
        zero_g = jnp.zeros((group,), jnp.int32)
        out, token_g, ended_g = record_token(out, rows_g, zero_g, logits_gv, live_g)
        slots = (
            row_s.at[slot_g].set(rows_g, mode="drop"),
            emitted_s.at[slot_g].set(1, mode="drop"),
            token_s.at[slot_g].set(token_g, mode="drop"),
            active_s.at[slot_g].set(~ended_g, mode="drop"),
            plen_s.at[slot_g].set(prompt_lengths_u[prompt], mode="drop"),
        )
        return next_row + take, staged, slots, cache, out

    def fill(state):
        waiting = lambda st: (st[0] < b) & ~jnp.all(st[2][3])
        return jax.lax.while_loop(waiting, admit, state)

    staged = jax.tree.map(jnp.zeros_like, jax.eval_shape(prefill_prompt, jnp.asarray(0, jnp.int32)))
    staged = (jnp.asarray(-1, jnp.int32),) + staged[1:]
    cache = jax.tree.map(lambda x: jnp.zeros((num_slots,) + x.shape[1:], x.dtype), staged[2])
    slots = (
        jnp.full((num_slots,), b, jnp.int32),
        jnp.zeros((num_slots,), jnp.int32),
        jnp.zeros((num_slots,), jnp.int32),
        jnp.zeros((num_slots,), jnp.bool_),
        jnp.zeros((num_slots,), jnp.int32),
    )
    out = (
        jnp.full((b, n), spec.pad_id, jnp.int32),
        jnp.zeros((b, n), jnp.float32),
        jnp.zeros((b, n), jnp.float32),
        jnp.zeros((b,), jnp.int32),
        jnp.zeros((b,), jnp.bool_),
    )
    if record:  # completion [b, n, l, k] and prompt [u, p, l, k] experts
        lk = staged[3].shape[2:]
        out += (
            jnp.full((b, n, *lk), -1, RECORDED_ID_DTYPE),
            jnp.full((u, p, *lk), -1, RECORDED_ID_DTYPE),
        )

    def step(loop, attend_len):
        """One decode step of every slot: feed its last token, draw its next."""
        t, (next_row, staged, slots, cache, out) = loop
        row_s, emitted_s, token_s, active_s, plen_s = slots
        col_s = jnp.where(active_s, p + emitted_s - 1, p)  # free slots write where unread
        positions_s = jnp.where(active_s, plen_s + emitted_s - 1, 0)
        kv_mask_sl = jnp.arange(cache_len)[None, :] >= p - plen_s[:, None]
        args = (layers, token_s, positions_s, kv_mask_sl, cache, col_s, attend_len, head_dv)
        if record:
            logits_sv, cache, ids_lsk = model.decode_step_routed(*args)
        else:
            (logits_sv, cache), ids_lsk = model.decode_step(*args), None
        out, token_s, ended_s = record_token(out, row_s, emitted_s, logits_sv, active_s, ids_lsk)
        slots = (row_s, emitted_s + 1, token_s, active_s & ~ended_s, plen_s)
        return t + 1, (next_row, staged, slots, cache, out)

    def run_segments(loop, narrower):
        """Decode until a slot frees up while rows wait, or (no row waiting) until no more
        slots than `narrower` still run (0: none). A segment [start, end) runs while every
        active slot has emitted fewer than `end` tokens, so it attends only the cache columns
        written by then (its rows' ages, not the step count: a young pool after a refill reads
        a short cache); the last segment runs to the end."""
        for k, (end, attend_len) in enumerate(segments):
            last = k == len(segments) - 1

            def cond(loop, end=end, last=last):
                _, (next_row, _, (_, emitted_s, _, active_s, _), _, _) = loop
                go = jnp.any(active_s) & ((next_row >= b) | jnp.all(active_s))
                if narrower:
                    go = go & ((next_row < b) | (jnp.sum(active_s) > narrower))
                oldest = jnp.max(jnp.where(active_s, emitted_s, 0))
                return go if last else go & (oldest < end)

            loop = jax.lax.while_loop(cond, functools.partial(step, attend_len=attend_len), loop)
        return loop

    def narrow(state, width):
        """The slots narrowed to `width`: the active ones (no more than `width`: the tail
        narrows only then), in slot order, their cache rows gathered, then idle fillers."""
        next_row, staged, slots, cache, out = state
        row_s, emitted_s, token_s, active_s, plen_s = slots
        wide = active_s.shape[0]
        at_k = jnp.nonzero(active_s, size=width, fill_value=wide)[0]
        live_k = at_k < wide
        keep = lambda x: x[jnp.minimum(at_k, wide - 1)]
        slots = (
            jnp.where(live_k, keep(row_s), b),
            keep(emitted_s),
            keep(token_s),
            live_k,
            keep(plen_s),
        )
        return next_row, staged, slots, jax.tree.map(keep, cache), out

    first_narrower = widths[1] if len(widths) > 1 else 0
    decode = lambda loop: run_segments((loop[0], fill(loop[1])), first_narrower)
    state = (jnp.asarray(0, jnp.int32), staged, slots, cache, out)
    # refills, until no row waits and no more slots than the tail's next width still run
    busy = lambda loop: (loop[1][0] < b) | (jnp.sum(loop[1][2][3]) > first_narrower)
    t, state = jax.lax.while_loop(busy, decode, (jnp.asarray(1, jnp.int32), state))
    for level, width in enumerate(widths[1:], start=1):  # the tail (compact_decode)
        narrower = widths[level + 1] if level + 1 < len(widths) else 0
        t, state = run_segments((t, narrow(state, width)), narrower)
    tokens_bn, logprobs_bn, filtered_bn, lengths_b, stopped_b, *experts = state[4]
    recorded = dict(expert_ids=experts[0], prompt_expert_ids=experts[1]) if record else {}
    return dict(
        tokens=tokens_bn,
        logprobs=logprobs_bn,
        filtered_logprobs=filtered_bn,
        lengths=lengths_b,
        truncated=~stopped_b,
        num_decode_steps=t - 1,
        **recorded,
    )
