"""Token draws: greedy argmax and Gumbel-max sampling over top-k / top-p filtered logits.

`greedy_token` and `sample_token` draw one token per row in float32 and return the logprobs the
sampler reports: log_softmax(logits / temperature)[token] before filtering (the loss's `lg`) and,
when sampling, the logprob under the filtered distribution the token was drawn from.
`filter_logits` is transformers' order: top-k, then top-p on what top-k kept, both thresholds on
the logit value (exact ties at the threshold are kept); `_nucleus_threshold` finds the top-p
threshold by bisection instead of a sort. Sampling is `jax.random.categorical`'s Gumbel-max with
one key per row, with the platform's Gumbel and argmax kernels (jgrpo.models.kernels): the same
bits on every path. Details: docs/sampler.md."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jgrpo.models import kernels
from jgrpo.models.kernels import KernelPath


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
