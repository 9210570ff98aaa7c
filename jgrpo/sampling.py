"""The sampler: jitted prefill + decode loop over a preallocated KV cache, generation logprobs.

Owns `SamplingParams` (`from_rollout_config()`), `generate(model | (graphdef, state), prompts,
params, key, first_row=0, group_size=1, row_ids=None) -> Generation` (numpy; G: groups of G
identical prompts, each prefilled once; row_ids: keys of non-consecutive rows), the jitted core
`generate_padded`, `pad_prompts` / `shared_prompts`, `filter_logits` and `compile_count()`.

Contract: prompts are left-padded to a multiple of `prompt_bucket`; token i of row b sits at
cache slot P + i and position prompt_len_b + i, the positions the trainer's forward gives it.
`Generation.logprobs` are log_softmax(logits / temperature) BEFORE filtering (the loss's `lg`);
`filtered_logprobs` are under the filtered distribution the token was drawn from. The draw of
token i of row b uses `fold_in(fold_in(key, first_row + b), i)`, so rows do not depend on their
batch. One executable per (B, U, P, DecodeSpec), shardings; temperature and top_p are traced.
Kernels follow `model.cfg.kernels`; the core compiles with `kernels.COMPILER_OPTIONS`. In full:
docs/sampler.md."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jgrpo.models import kernels
from jgrpo.models.kernels import KernelPath, resolve_kernels
from jgrpo.models.transformer import Transformer

_MAX_SEGMENTS = 8  # decode-loop copies in the program: bounds compile time
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


# ----------------------------------------------------------------------------- sampling math


def filter_logits(scaled_bv: jax.Array, top_p, top_k: Optional[int]) -> jax.Array:
    """Top-k (static k) then top-p (traced p) on temperature-scaled logits; dropped -> -inf."""
    v = scaled_bv.shape[-1]
    sorted_bk = None
    if top_k is not None and top_k < v:
        sorted_bk, _ = jax.lax.top_k(scaled_bv, top_k)  # descending
        scaled_bv = jnp.where(scaled_bv < sorted_bk[:, -1:], -jnp.inf, scaled_bv)

    def nucleus(x_bv):
        if sorted_bk is None:
            return jnp.where(x_bv < _nucleus_threshold(x_bv, top_p), -jnp.inf, x_bv)
        probs_bk = jax.nn.softmax(sorted_bk, axis=-1)
        mass_before_bk = jnp.cumsum(probs_bk, axis=-1) - probs_bk
        num_keep_b = jnp.maximum(jnp.sum(mass_before_bk < top_p, axis=-1), 1)
        threshold_b1 = jnp.take_along_axis(sorted_bk, num_keep_b[:, None] - 1, axis=-1)
        return jnp.where(x_bv < threshold_b1, -jnp.inf, x_bv)

    return jax.lax.cond(top_p < 1.0, nucleus, lambda x_bv: x_bv, scaled_bv)


def _nucleus_threshold(x_bv, top_p):
    """The largest logit value t with mass(x >= t) >= top_p, per row -> [b, 1].

    Bisection over the float32 values' order-preserving uint32 keys: 32 masked sums over the
    vocabulary instead of a full sort (a 49k-entry sort per row costs ~100x more on CPU), and
    exact: the result is one of the row's own logit values.
    """
    probs_bv = jax.nn.softmax(x_bv, axis=-1)
    bits_bv = jax.lax.bitcast_convert_type(x_bv, jnp.uint32)
    negative = bits_bv >= jnp.uint32(0x80000000)
    keys_bv = jnp.where(negative, ~bits_bv, bits_bv | jnp.uint32(0x80000000))
    lo_b = jnp.min(keys_bv, axis=-1)  # mass(x >= min) = 1 >= top_p: lo always qualifies
    hi_b = jnp.max(keys_bv, axis=-1)

    def step(_, bounds):
        lo_b, hi_b = bounds
        gap_b = hi_b - lo_b
        mid_b = lo_b + gap_b // 2 + (gap_b & 1)  # ceil midpoint, no uint32 overflow
        mass_b = jnp.sum(jnp.where(keys_bv >= mid_b[:, None], probs_bv, 0.0), axis=-1)
        ok_b = (mass_b >= top_p) & (lo_b < hi_b)
        return jnp.where(ok_b, mid_b, lo_b), jnp.where(ok_b | (lo_b >= hi_b), hi_b, mid_b - 1)

    lo_b, _ = jax.lax.fori_loop(0, 32, step, (lo_b, hi_b))
    keep_bv = keys_bv >= lo_b[:, None]
    return jnp.min(jnp.where(keep_bv, x_bv, jnp.inf), axis=-1, keepdims=True)


def greedy_token(logits_bv, path: KernelPath):
    """Greedy pick in float32 -> (token_b = first argmax, log_softmax(logits)[token_b]).

    The logprob is -log(sum(exp(logits - max))): log_softmax at the argmax, where
    `logits - max` is exactly 0 (bit-identical to indexing `jax.nn.log_softmax`)."""
    logits_bv = logits_bv.astype(jnp.float32)
    max_b1 = jnp.max(logits_bv, axis=-1, keepdims=True)  # shared with the CPU argmax's (CSE)
    logprob_b = -jnp.log(jnp.sum(jnp.exp(logits_bv - max_b1), axis=-1))
    return kernels.argmax(logits_bv, path), logprob_b


def sample_token(
    logits_bv,
    keys_b,
    temperature,
    top_p,
    top_k: Optional[int],
    nucleus: bool = True,
    *,
    path: KernelPath,
):
    """Draw one token per row at temperature > 0 in float32
    -> (token_b, logprob_b, filtered_logprob_b).

    Gumbel-max over the filtered, temperature-scaled logits with one key per row (a row's draw
    does not depend on which other rows share the batch): `jax.random.categorical`'s draw,
    with the platform's Gumbel and argmax kernels (`path`; the same bits on every path).
    `nucleus=False` (static) promises top_p == 1: with no top_k either, nothing is filtered
    and the two logprobs coincide.
    """
    scaled_bv = logits_bv.astype(jnp.float32) / temperature
    filtering = nucleus or top_k is not None
    filtered_bv = filter_logits(scaled_bv, top_p, top_k) if filtering else scaled_bv
    noise_bv = kernels.gumbel_noise(keys_b, filtered_bv.shape[1], path)
    token_b = kernels.argmax(filtered_bv + noise_bv, path)

    def pick(logp_bv):
        return jnp.take_along_axis(logp_bv, token_b[:, None], axis=-1)[:, 0]

    logprob_b = pick(jax.nn.log_softmax(scaled_bv, axis=-1))
    if not filtering:
        return token_b, logprob_b, logprob_b
    return token_b, logprob_b, pick(jax.nn.log_softmax(filtered_bv, axis=-1))


# ----------------------------------------------------------------------------- the jitted core


_COMPILES = [0]  # traced-function side effect: +1 per trace of the core


def compile_count() -> int:
    """Traces of `generate_padded` so far in this process: one per new (model config, spec, input
    shapes); each is a compile. (A new parameter sharding may compile again without a retrace.)"""
    return _COMPILES[0]


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _segments(n: int, chunk: int) -> list[tuple[int, int]]:
    """Decode steps 1..n-1 split into [start, end) segments of `chunk` (at most 8)."""
    steps = n - 1
    if steps <= 0:
        return []
    chunk = max(chunk, math.ceil(steps / _MAX_SEGMENTS))
    return [(a, min(a + chunk, n)) for a in range(1, n, chunk)]


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
    cache_len = _round_up(p + n - 1, _SLOT_ALIGN)  # slots past p + n - 2 are never written
    path = resolve_kernels(model.cfg.kernels)
    model = _in_compute_dtype(model)
    layers = model.layer_weights()  # once per call, not per token (fused q|k|v, gate|up)
    logits_uv, cache = model.prefill(
        prompt_ids_up, positions_up, prompt_mask_up, cache_len, last_layer=layers[-1]
    )
    # each prompt's cache and last logits go to its `group` rows
    to_rows = (lambda x: x) if group == 1 else (lambda x: jnp.repeat(x, group, axis=0))
    logits_bv, cache = to_rows(logits_uv), jax.tree.map(to_rows, cache)
    prompt_lengths_b, prompt_mask_bp = to_rows(prompt_lengths_u), to_rows(prompt_mask_up)
    kv_mask_bs = jnp.concatenate([prompt_mask_bp, jnp.ones((b, cache_len - p), jnp.bool_)], -1)

    if spec.greedy:

        def draw(i, logits_bv):
            token_b, lp_b = greedy_token(logits_bv, path)
            return token_b, lp_b, jnp.zeros_like(lp_b)
    else:
        temperature = jnp.asarray(temperature, jnp.float32)
        top_p = jnp.asarray(top_p, jnp.float32)
        row_keys_b = jax.vmap(jax.random.fold_in, (None, 0))(key, row_ids_b)
        fold_rows = jax.vmap(jax.random.fold_in, (0, None))
        step_keys_nb = jax.vmap(fold_rows, (None, 0))(row_keys_b, jnp.arange(n))  # hoisted

        def draw(i, logits_bv):
            keys_b = step_keys_nb[i]
            return sample_token(
                logits_bv, keys_b, temperature, top_p, spec.top_k, spec.nucleus, path=path
            )

    def emit(i, logits_bv, carry):
        """Draw token i from logits_bv and record it (rows already done emit pad)."""
        tokens_bn, logprobs_bn, filtered_bn, done_b, lengths_b = carry
        token_b, lp_b, flp_b = draw(i, logits_bv)
        token_b = jnp.where(done_b, spec.pad_id, token_b)
        lp_b = jnp.where(done_b, 0.0, lp_b)
        flp_b = jnp.where(done_b, 0.0, flp_b)
        lengths_b = lengths_b + (~done_b).astype(jnp.int32)
        done_b = done_b | jnp.isin(token_b, stops)
        put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x[:, None], i, axis=1)
        return (
            put(tokens_bn, token_b),
            put(logprobs_bn, lp_b),
            put(filtered_bn, flp_b),
            done_b,
            lengths_b,
        ), token_b

    out = (
        jnp.full((b, n), spec.pad_id, jnp.int32),
        jnp.zeros((b, n), jnp.float32),
        jnp.zeros((b, n), jnp.float32),
        jnp.zeros((b,), jnp.bool_),
        jnp.zeros((b,), jnp.int32),
    )
    out, token_b = emit(0, logits_bv, out)
    i = jnp.asarray(1, jnp.int32)

    for _, end in _segments(n, spec.attention_chunk):
        # slots written by the segment's last step, rounded up (unwritten slots are masked)
        attend_len = min(_round_up(p + end - 1, _SLOT_ALIGN), cache_len)

        def cond(loop, end=end):
            i, _, _, out = loop
            return (i < end) & ~jnp.all(out[3])

        def body(loop, attend_len=attend_len):
            i, cache, token_b, out = loop
            slot = p + i - 1  # token i - 1 goes into its cache slot; its logits give token i
            logits_bv, cache = model.decode_step(
                layers, token_b, prompt_lengths_b + i - 1, kv_mask_bs, cache, slot, attend_len
            )
            out, token_b = emit(i, logits_bv, out)
            return i + 1, cache, token_b, out

        i, cache, token_b, out = jax.lax.while_loop(cond, body, (i, cache, token_b, out))

    tokens_bn, logprobs_bn, filtered_bn, done_b, lengths_b = out
    return dict(
        tokens=tokens_bn,
        logprobs=logprobs_bn,
        filtered_logprobs=filtered_bn,
        lengths=lengths_b,
        truncated=~done_b,
        num_decode_steps=i - 1,
    )


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
    return Generation(
        tokens=out["tokens"],
        logprobs=out["logprobs"],
        filtered_logprobs=out["filtered_logprobs"],
        lengths=out["lengths"],
        truncated=out["truncated"],
        prompt_tokens=np.repeat(ids_up, group_size, axis=0),
        prompt_lengths=np.repeat(lengths_u, group_size),
        num_decode_steps=int(out["num_decode_steps"]),
    )
