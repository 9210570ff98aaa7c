"""The sampler: jitted prefill + decode loop over a preallocated KV cache, generation logprobs.

Owns `SamplingParams` (`from_rollout_config()`), `generate(model | (graphdef, state), prompts,
params, key, first_row=0, group_size=1, row_ids=None) -> Generation` (numpy; G: groups of G
identical prompts, each prefilled once; row_ids: keys of non-consecutive rows), the jitted core
`generate_padded`, `pad_prompts` / `shared_prompts`, `kv_cache_bytes`, `compile_count()`.
Draws (`filter_logits`, greedy, Gumbel-max): jgrpo/draws.py.

Contract: prompts are left-padded to a multiple of `prompt_bucket`; token i of row b sits at
cache column P + i and position prompt_len_b + i, the positions the trainer's forward gives it.
`Generation.logprobs` are log_softmax(logits / temperature) BEFORE filtering (the loss's `lg`).
Token i of row b draws with `fold_in(fold_in(key, first_row + b), i)`: a row's tokens depend
neither on its batch, nor on `decode_slots` S < B (jgrpo/slots.py), nor on `compact_decode`;
`record_experts`: each fed token's experts. One executable per (B, U, P, S, DecodeSpec)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jgrpo.draws import greedy_token, sample_token
from jgrpo.models import kernels
from jgrpo.models.kernels import resolve_kernels
from jgrpo.models.moe import RECORDED_ID_DTYPE, expert_rows
from jgrpo.models.transformer import Transformer
from jgrpo.slots import decode_in_slots

_MAX_SEGMENTS = 8  # decode-loop copies in the program: bounds compile time
KV_CACHE_DTYPES = ("float32", "bfloat16", "float8_e4m3fn")
"""Storage dtypes of the KV cache (rollout.kv_cache_dtype)."""
_SLOT_ALIGN = 16  # cache / attended lengths rounded up to this: XLA:CPU's attention dots are
# faster over whole vectors of slots (one AVX-512 vector is 16 floats; docs/performance.md)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What to generate. Fields marked static change the compiled program."""

    max_new_tokens: int = 256
    """N, completion length cap (static); rows reaching it without a stop are truncated."""
    temperature: float = 1.0
    """Softmax temperature (traced); 0 = greedy argmax."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1] (traced); 1 = off."""
    top_k: Optional[int] = None
    """Keep the k largest logits (static); None = off."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop tokens in addition to the model config's eos_token_ids (static)."""
    pad_id: Optional[int] = None
    """Written after a row's end and in prompt padding; None = cfg.pad_token_id, else the
    first eos id, else 0 (static)."""
    prompt_bucket: int = 32
    """Prompt lengths are padded up to a multiple of this, so varying prompts share a compile."""
    ignore_eos: bool = False
    """Do not stop at the model's eos_token_ids (stop_token_ids still stop); for benchmarks."""
    attention_chunk: int = 64
    """Decode steps per loop segment: attention reads the cache filled by the segment's end."""
    decode_slots: Optional[int] = None
    """Rows decoded at once (static): a stopped row's slot takes the next waiting row, so the
    KV cache holds this many rows; None (or >= the rows) = every row at once."""
    compact_decode: bool = False
    """Narrow the decode batch as rows stop (static): once no more than half, a quarter, an
    eighth of the rows still run, they go on as a batch of that width (same tokens); with
    decode_slots < the rows, the slots narrow so once no row waits (the tail). False here, for
    direct calls; a run's rollout.compact_decode defaults to true."""
    record_experts: bool = False
    """An MoE model records the experts of every token it feeds (the prompt's and the
    completion's) in `Generation.expert_ids` (static; model.moe.router_replay)."""
    kv_cache_dtype: Optional[str] = None
    """Dtype the KV cache is stored in (static; `KV_CACHE_DTYPES`): keys and values are rounded
    to it when written and read back up to the compute dtype; None = the compute dtype."""

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must lie in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k: must be >= 1 or None, got {self.top_k}")
        if self.prompt_bucket < 1 or self.attention_chunk < 1:
            raise ValueError("prompt_bucket and attention_chunk: must be >= 1")
        if self.decode_slots is not None and self.decode_slots < 1:
            raise ValueError(f"decode_slots: must be >= 1 or None, got {self.decode_slots}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES} or None, "
                f"got {self.kv_cache_dtype!r}"
            )

    @classmethod
    def from_rollout_config(cls, rollout, **overrides) -> SamplingParams:
        """From `jgrpo.config.RolloutConfig` (temperature, top_p, top_k, max_new_tokens,
        prompt_bucket); `overrides` set the other fields (stop_token_ids, pad_id, ...)."""
        fields = dict(
            max_new_tokens=rollout.max_new_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            prompt_bucket=rollout.prompt_bucket,
            decode_slots=rollout.decode_slots,
            compact_decode=rollout.compact_decode,
            kv_cache_dtype=rollout.kv_cache_dtype,
        )
        return cls(**{**fields, **overrides})


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeSpec:
    """The static part of a generate call (hashable: a jit static argument)."""

    max_new_tokens: int
    greedy: bool
    """temperature == 0: argmax, no random draws (a separate program from sampling)."""
    top_k: Optional[int]
    nucleus: bool
    """top_p < 1 (sampling only): without it and top_k, no filtering code is compiled."""
    stop_token_ids: tuple[int, ...]
    """The full stop set (model eos ids unless ignored, plus extra stops), sorted."""
    pad_id: int
    attention_chunk: int
    decode_slots: Optional[int] = None
    """Slots of the continuous-batching loop (< the rows); None = every row in one batch."""
    compact: bool = False
    """The one-batch loop, or the slot loop's tail, narrows as rows stop (`compact_widths`)."""
    record_experts: bool = False
    """Record each fed token's experts (an MoE model's `prefill_routed` / `decode_step_routed`)."""
    kv_cache_dtype: Optional[str] = None
    """The KV cache's storage dtype; None = the compute dtype."""


@dataclasses.dataclass(frozen=True)
class Generation:
    """One batch of completions (numpy). Per-token arrays are aligned with `tokens`."""

    tokens: np.ndarray
    """[B, N] int32 completion ids, the stop token included, pad_id after the end."""
    logprobs: np.ndarray
    """[B, N] float32 log_softmax(logits / T)[token] before top-k/top-p; 0 after the end."""
    filtered_logprobs: np.ndarray
    """[B, N] float32 logprob under the filtered distribution sampled from; 0 after the end."""
    lengths: np.ndarray
    """[B] int32 generated tokens including the stop token."""
    truncated: np.ndarray
    """[B] bool: N tokens generated without a stop token."""
    prompt_tokens: np.ndarray
    """[B, P] int32 left-padded prompts (P a multiple of prompt_bucket)."""
    prompt_lengths: np.ndarray
    """[B] int32 real prompt tokens per row."""
    num_decode_steps: int
    """Decode-loop iterations run (<= N - 1; fewer when every row stopped early)."""
    expert_ids: Optional[np.ndarray] = None
    """[B, P + N, l_moe, k] int16 (`record_experts`, MoE models): the experts each MoE layer
    routed every token the sampler fed to; -1 on the others (prompt padding, the last token
    and after the end). Aligned with prompt_tokens ++ tokens. None when not recorded."""


# ----------------------------------------------------------------------------- the jitted core


_COMPILES = [0]  # traced-function side effect: +1 per trace of the core


def compile_count() -> int:
    """Traces of `generate_padded` so far in this process: one per new (model config, spec, input
    shapes); each is a compile. (A new parameter sharding may compile again without a retrace.)"""
    return _COMPILES[0]


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def cache_length(prompt_width: int, max_new_tokens: int) -> int:
    """Slots per row of the KV cache: the prompt's P and the N - 1 tokens fed back (the last
    token is never fed), rounded up to a multiple of 16."""
    return _round_up(prompt_width + max_new_tokens - 1, _SLOT_ALIGN)


def kv_cache_bytes(model_cfg, rows: int, prompt_width: int, params: SamplingParams) -> int:
    """Bytes of the KV cache of one `generate` call over `rows` rows: keys and values of every
    layer for min(rows, params.decode_slots) rows x `cache_length` slots, in the compute dtype
    (the staged prompt of the decode-slot loop adds one row; under compact_decode the first
    narrowing gathers half of them into a new cache while the wider one is still live), in
    params.kv_cache_dtype when set."""
    slots = params.decode_slots
    pool = rows if slots is None or slots >= rows else slots
    held = pool if pool == rows else pool + 1
    if params.compact_decode and pool > 1:
        held += compact_widths(pool)[1]
    per_row = cache_length(prompt_width, params.max_new_tokens) * 2 * model_cfg.num_layers
    dtype = jnp.dtype(params.kv_cache_dtype or model_cfg.jnp_dtype)
    per_row *= model_cfg.num_kv_heads * model_cfg.head_dim * dtype.itemsize
    return held * per_row


def _segments(n: int, chunk: int, p: int) -> list[tuple[int, int]]:
    """Decode steps 1..n-1 split into segments of `chunk` (at most 8) -> (end, attend_len) each:
    the segment runs up to step `end` and attends the cache slots written by its last step,
    rounded up (unwritten slots are masked); the last one attends the whole cache."""
    steps = n - 1
    if steps <= 0:
        return []
    chunk = max(chunk, math.ceil(steps / _MAX_SEGMENTS))
    ends = [min(a + chunk, n) for a in range(1, n, chunk)]
    return [(end, min(_round_up(p + end - 1, _SLOT_ALIGN), cache_length(p, n))) for end in ends]


def compact_widths(rows: int) -> tuple[int, ...]:
    """Batch widths of the compacting decode loop: rows, then halved (rounded up) down to an
    eighth; narrower would save little, as a step reads every weight whatever its width."""
    return tuple(sorted({-(-rows // 2**k) for k in range(4)}, reverse=True))


def _compact(rows, cache, token_w, done_b, width: int, b: int):
    """The decode batch narrowed to `width` rows -> ((rows, prompt lengths, kv masks), cache,
    last tokens): its running rows, in batch order (they fit: the loop narrows only then), then
    fillers (row b: never written)."""
    rows_w, plen_w, kv_mask_ws = rows
    rows_w = jnp.arange(b) if rows_w is None else rows_w
    running_w = (rows_w < b) & ~done_b[jnp.minimum(rows_w, b - 1)]
    at_k = jnp.nonzero(running_w, size=width, fill_value=rows_w.shape[0])[0]
    keep = lambda x: x[jnp.minimum(at_k, rows_w.shape[0] - 1)]
    rows_k = jnp.where(at_k < rows_w.shape[0], keep(rows_w), b)
    return (rows_k, keep(plen_w), keep(kv_mask_ws)), jax.tree.map(keep, cache), keep(token_w)


def _in_compute_dtype(model: Transformer) -> Transformer:
    """The model with its embedding, final norm and LM head in the compute dtype (cfg.dtype;
    parameters may be stored in another, e.g. float32 master weights): cast once per call, so
    the decode loop never converts weights per token. The layer weights are cast where the
    sampler takes them (`layer_weights`, `prefill`). A no-op when the dtypes agree."""
    dtype = model.cfg.jnp_dtype
    graphdef, layers, rest = nnx.split(model, nnx.PathContains("layers"), ...)
    return nnx.merge(graphdef, layers, jax.tree.map(lambda x: x.astype(dtype), rest))


def _generate_padded(
    model: Transformer, prompt_ids_up, prompt_lengths_u, key, temperature, top_p, row_ids_b, *, spec
):
    _COMPILES[0] += 1
    u, p = prompt_ids_up.shape
    b = row_ids_b.shape[0]
    group = b // u  # rows b = u * group + g share prompt u (1: every row its own prompt)
    n = spec.max_new_tokens
    stops = jnp.asarray(spec.stop_token_ids or (-1,), jnp.int32)

    prompt_lengths_u = prompt_lengths_u.astype(jnp.int32)
    prompt_mask_up = jnp.arange(p)[None, :] >= p - prompt_lengths_u[:, None]
    positions_up = jnp.maximum(jnp.cumsum(prompt_mask_up, axis=-1) - 1, 0)
    cache_len = cache_length(p, n)
    path = resolve_kernels(model.cfg.kernels)
    record = spec.record_experts and hasattr(model, "decode_step_routed")
    if record and model.cfg.moe.num_experts > jnp.iinfo(RECORDED_ID_DTYPE).max:
        raise ValueError(f"record_experts: {model.cfg.moe.num_experts} experts exceed int16 ids")
    model = _in_compute_dtype(model)
    layers = model.layer_weights()  # once per call, not per token (fused q|k|v, gate|up)
    head_dv = model.head_weights()  # likewise (the tied head: the embedding transposed)
    if spec.decode_slots is not None:
        return decode_in_slots(
            model,
            layers,
            prompt_ids_up,
            prompt_lengths_u,
            key,
            temperature,
            top_p,
            row_ids_b,
            spec=spec,
            cache_len=cache_len,
            segments=_segments(n, spec.attention_chunk, p) or [(2, cache_len)],
            widths=compact_widths(spec.decode_slots) if spec.compact else (spec.decode_slots,),
            path=path,
            record=record,
        )
    if record:
        logits_uv, cache, prompt_ids_lupk = model.prefill_routed(
            prompt_ids_up, positions_up, prompt_mask_up, cache_len
        )
    else:
        logits_uv, cache = model.prefill(
            prompt_ids_up, positions_up, prompt_mask_up, cache_len, last_layer=layers[-1]
        )
    cache = kernels.cache_in(cache, spec.kv_cache_dtype)  # rollout.kv_cache_dtype
    # each prompt's cache and last logits go to its `group` rows
    to_rows = (lambda x: x) if group == 1 else (lambda x: jnp.repeat(x, group, axis=0))
    logits_bv, cache = to_rows(logits_uv), jax.tree.map(to_rows, cache)
    prompt_lengths_b, prompt_mask_bp = to_rows(prompt_lengths_u), to_rows(prompt_mask_up)
    kv_mask_bs = jnp.concatenate([prompt_mask_bp, jnp.ones((b, cache_len - p), jnp.bool_)], -1)

    if spec.greedy:

        def draw(i, logits_bv, rows_b=None):
            token_b, lp_b = greedy_token(logits_bv, path)
            return token_b, lp_b, jnp.zeros_like(lp_b)
    else:
        temperature = jnp.asarray(temperature, jnp.float32)
        top_p = jnp.asarray(top_p, jnp.float32)
        row_keys_b = jax.vmap(jax.random.fold_in, (None, 0))(key, row_ids_b)
        fold_rows = jax.vmap(jax.random.fold_in, (0, None))
        step_keys_nb = jax.vmap(fold_rows, (None, 0))(row_keys_b, jnp.arange(n))  # hoisted

        def draw(i, logits_bv, rows_b=None):
            keys_b = step_keys_nb[i] if rows_b is None else step_keys_nb[i][rows_b]
            return sample_token(
                logits_bv, keys_b, temperature, top_p, spec.top_k, spec.nucleus, path=path
            )

    def emit(i, logits_wv, carry, rows_w=None, ids_lwk=None):
        """Draw token i from logits_wv and record it (rows already done emit pad). rows_w: the
        batch's rows after compaction (b: a filler row, never written); None: all b rows.
        ids_lwk: the experts of the fed token i - 1 (record_experts)."""
        tokens_bn, logprobs_bn, filtered_bn, done_b, lengths_b, *experts = carry
        at_w = None if rows_w is None else jnp.minimum(rows_w, b - 1)
        done_w = done_b if rows_w is None else done_b[at_w] | (rows_w >= b)
        token_w, lp_w, flp_w = draw(i, logits_wv, at_w)
        token_w = jnp.where(done_w, spec.pad_id, token_w)
        lp_w = jnp.where(done_w, 0.0, lp_w)
        flp_w = jnp.where(done_w, 0.0, flp_w)
        ended_w = done_w | jnp.isin(token_w, stops)
        if rows_w is None:
            put = lambda buf, x, i=i: jax.lax.dynamic_update_slice_in_dim(
                buf, x[:, None], i, axis=1
            )
            done_b, lengths_b = ended_w, lengths_b + (~done_w).astype(jnp.int32)
        else:
            put = lambda buf, x, i=i: buf.at[rows_w, i].set(x, mode="drop")
            done_b = done_b.at[rows_w].set(ended_w, mode="drop")
            lengths_b = lengths_b.at[rows_w].add((~done_w).astype(jnp.int32), mode="drop")
        carry = (put(tokens_bn, token_w), put(logprobs_bn, lp_w), put(filtered_bn, flp_w))
        if experts and ids_lwk is not None:  # column i - 1: the fed token's
            experts = [put(experts[0], expert_rows(ids_lwk), i - 1)]
        return (*carry, done_b, lengths_b, *experts), token_w

    out = (
        jnp.full((b, n), spec.pad_id, jnp.int32),
        jnp.zeros((b, n), jnp.float32),
        jnp.zeros((b, n), jnp.float32),
        jnp.zeros((b,), jnp.bool_),
        jnp.zeros((b,), jnp.int32),
    )
    if record:  # [b, n, l_moe, k]: column c holds the experts of completion token c
        moe = model.cfg.moe
        out += (jnp.full((b, n, moe.num_sparse, moe.top_k), -1, RECORDED_ID_DTYPE),)
    out, token_b = emit(0, logits_bv, out)
    i = jnp.asarray(1, jnp.int32)
    # compaction: the batch narrows to the next width once no more rows than that still run
    widths = compact_widths(b) if spec.compact else (b,)
    rows = (None, prompt_lengths_b, kv_mask_bs)  # the batch's rows (None: all), their prompts
    for level, width in enumerate(widths):
        narrower = widths[level + 1] if level + 1 < len(widths) else 0
        if level:
            rows, cache, token_b = _compact(rows, cache, token_b, out[3], width, b)
        rows_w = rows[0]  # rows are loop constants: the carry holds only what changes
        for end, attend_len in _segments(n, spec.attention_chunk, p):

            def cond(loop, end=end, narrower=narrower, rows_w=rows_w):
                i, _, _, out = loop
                running = ~out[3] if rows_w is None else ~out[3][rows_w] & (rows_w < b)
                go = (i < end) & jnp.any(running)
                return go & (jnp.sum(running) > narrower) if narrower else go

            def body(loop, attend_len=attend_len, rows=rows):
                i, cache, token_w, out = loop
                rows_w, plen_w, kv_mask_ws = rows
                slot = p + i - 1  # token i - 1 goes into its cache slot; its logits give token i
                args = (
                    layers,
                    token_w,
                    plen_w + i - 1,
                    kv_mask_ws,
                    cache,
                    slot,
                    attend_len,
                    head_dv,
                )
                if record:
                    logits_wv, cache, ids_lwk = model.decode_step_routed(*args)
                else:
                    (logits_wv, cache), ids_lwk = model.decode_step(*args), None
                out, token_w = emit(i, logits_wv, out, rows_w, ids_lwk)
                return i + 1, cache, token_w, out

            i, cache, token_b, out = jax.lax.while_loop(cond, body, (i, cache, token_b, out))

    tokens_bn, logprobs_bn, filtered_bn, done_b, lengths_b, *experts = out
    recorded = {}
    if record:
        recorded = dict(expert_ids=experts[0], prompt_expert_ids=expert_rows(prompt_ids_lupk))
    return dict(
        tokens=tokens_bn,
        logprobs=logprobs_bn,
        filtered_logprobs=filtered_bn,
        lengths=lengths_b,
        truncated=~done_b,
        num_decode_steps=i - 1,
        **recorded,
    )


def recorded_expert_ids(out: dict, lengths_b, prompt_lengths_b, group_size: int):
    """The host's [B, P + N, l_moe, k] `Generation.expert_ids` of a core's output: prompt
    (repeated to the group's rows) ++ completion, -1 where no fed token was routed (prompt
    padding, each row's last token and after its end)."""
    prompt_bplk = np.repeat(np.asarray(out["prompt_expert_ids"]), group_size, axis=0)
    completion_bnlk = np.asarray(out["expert_ids"])
    p, n = prompt_bplk.shape[1], completion_bnlk.shape[1]
    pad_bp = np.arange(p)[None, :] < (p - prompt_lengths_b[:, None])
    unfed_bn = np.arange(n)[None, :] >= (lengths_b[:, None] - 1)
    ids = np.concatenate([prompt_bplk, completion_bnlk], axis=1)
    ids[np.concatenate([pad_bp, unfed_bn], axis=1)] = -1
    return ids


generate_padded = jax.jit(
    _generate_padded, static_argnames="spec", compiler_options=kernels.COMPILER_OPTIONS
)
"""The jitted core on padded arrays: prompt_ids_up [U, P] left-padded int32, prompt_lengths_u
[U], row_ids_b [B] with B a multiple of U (rows u * B/U .. (u + 1) * B/U - 1 continue prompt u,
which is prefilled once); temperature / top_p scalars (traced). Returns device arrays [B, ...]
(see `Generation`)."""


# ----------------------------------------------------------------------------- host wrapper


def pad_prompts(prompts: list[list[int]], bucket: int, pad_id: int):
    """Left-pad to P = ceil(longest / bucket) * bucket -> (ids [B, P] int32, lengths [B])."""
    lengths_b = np.asarray([len(p) for p in prompts], np.int32)
    if len(prompts) == 0 or lengths_b.min() < 1:
        raise ValueError("generate: needs at least one prompt, each with >= 1 token")
    width = _round_up(int(lengths_b.max()), bucket)
    ids_bp = np.full((len(prompts), width), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        ids_bp[row, width - len(prompt) :] = prompt
    return ids_bp, lengths_b


def make_decode_spec(cfg, params: SamplingParams) -> DecodeSpec:
    """Resolve the stop set and pad id against the model config."""
    eos = () if params.ignore_eos else tuple(cfg.eos_token_ids)
    if params.pad_id is not None:
        pad_id = params.pad_id
    elif cfg.pad_token_id is not None:
        pad_id = cfg.pad_token_id
    else:
        pad_id = eos[0] if eos else 0
    return DecodeSpec(
        max_new_tokens=params.max_new_tokens,
        greedy=params.temperature == 0,
        top_k=None if params.temperature == 0 else params.top_k,
        nucleus=params.temperature > 0 and params.top_p < 1,
        stop_token_ids=tuple(sorted(set(eos) | set(params.stop_token_ids))),
        pad_id=int(pad_id),
        attention_chunk=params.attention_chunk,
        decode_slots=params.decode_slots,
        compact=params.compact_decode,
        record_experts=params.record_experts,
        kv_cache_dtype=params.kv_cache_dtype,
    )


def shared_prompts(prompts: list[list[int]], group_size: int) -> list[list[int]]:
    """The prompt of each group of `group_size` consecutive rows, checked: every row of a group
    holds the same prompt (ValueError naming the first row that does not)."""
    if group_size < 1 or len(prompts) % group_size:
        raise ValueError(
            f"generate: group_size must be >= 1 and divide the {len(prompts)} prompts, "
            f"got {group_size}"
        )
    for row, prompt in enumerate(prompts):
        if list(prompt) != list(prompts[row - row % group_size]):
            raise ValueError(
                f"generate: group_size {group_size}: row {row}'s prompt differs from its "
                f"group's first row {row - row % group_size}"
            )
    return prompts[::group_size]


def generate(
    model,
    prompts: list[list[int]],
    params: SamplingParams,
    key,
    first_row: int = 0,
    group_size: int = 1,
    row_ids: Optional[list[int]] = None,
) -> Generation:
    """Sample completions of `prompts` from `model` (a Transformer or (graphdef, state)).

    Row b draws with `fold_in(key, first_row + b)`: a batch split into parts (one per rollout
    worker, each with its `first_row`) samples exactly what the whole batch would.
    `group_size` G > 1 says the rows come in consecutive groups of G identical prompts (a GRPO
    step's G completions per prompt, checked): each group's prompt is prefilled once and its KV
    cache and last logits are given to its G rows (prefill work / G); the draws stay keyed by
    row, so the tokens are those of group_size=1 (up to float rounding of the prefill, which
    XLA may compile differently for a different number of rows; docs/sampler.md).
    `row_ids` (instead of first_row): each prompt's global row index, for a batch of rows that
    are not consecutive (a multi-turn rollout's running rows, jgrpo.rollout.turns)."""
    if not isinstance(model, nnx.Module):
        model = nnx.merge(*model)  # shares the state's arrays
    spec = make_decode_spec(model.cfg, params)
    if spec.decode_slots is not None and spec.decode_slots >= len(prompts):
        spec = dataclasses.replace(spec, decode_slots=None)  # every row at once: one batch
    unique = prompts if group_size == 1 else shared_prompts(prompts, group_size)
    ids_up, lengths_u = pad_prompts(unique, params.prompt_bucket, spec.pad_id)
    out = generate_padded(
        model,
        ids_up,
        lengths_u,
        key,
        np.float32(params.temperature),
        np.float32(params.top_p),
        np.asarray(row_ids, np.int32)
        if row_ids is not None
        else np.arange(first_row, first_row + len(prompts), dtype=np.int32),
        spec=spec,
    )
    out = {name: np.asarray(x) for name, x in out.items()}  # waits; cheaper than device_get
    prompt_lengths = np.repeat(lengths_u, group_size)
    experts = None
    if "expert_ids" in out:
        experts = recorded_expert_ids(out, out["lengths"], prompt_lengths, group_size)
    return Generation(
        tokens=out["tokens"],
        logprobs=out["logprobs"],
        filtered_logprobs=out["filtered_logprobs"],
        lengths=out["lengths"],
        truncated=out["truncated"],
        prompt_tokens=np.repeat(ids_up, group_size, axis=0),
        prompt_lengths=prompt_lengths,
        num_decode_steps=int(out["num_decode_steps"]),
        expert_ids=experts,
    )
