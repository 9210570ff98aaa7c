"""Token draws: greedy argmax and Gumbel-max sampling over top-k / top-p filtered logits.

`greedy_token` and `sample_token` draw one token per row in float32 and return the logprobs the
sampler reports: log_softmax(logits / temperature)[token] before filtering (the loss's `lg`) and,
when sampling, the logprob under the filtered distribution the token was drawn from.
`filter_logits` is transformers' order: top-k, then top-p on what top-k kept, both thresholds on
the logit value (exact ties at the threshold are kept); `_nucleus_threshold` finds the top-p
threshold by bisection on the "cpu" path, among the 16 largest logits (checked, else by
bisection) on the portable one: never a sort. Sampling is `jax.random.categorical`'s Gumbel-max with
one key per row, with the platform's Gumbel and argmax kernels (jgrpo.models.kernels): the same
bits on every path. Details: docs/sampler.md."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jgrpo.models import kernels
from jgrpo.models.kernels import KernelPath


def filter_logits(
    scaled_bv: jax.Array, top_p, top_k: Optional[int], path: KernelPath = "cpu"
) -> jax.Array:
    """Top-k (static k) then top-p (traced p) on temperature-scaled logits; dropped -> -inf.
    `path` picks how the top-p threshold is found (`_nucleus_threshold`), never what it is."""
    v = scaled_bv.shape[-1]
    sorted_bk = None
    if top_k is not None and top_k < v:
        sorted_bk, _ = jax.lax.top_k(scaled_bv, top_k)  # descending
        scaled_bv = jnp.where(scaled_bv < sorted_bk[:, -1:], -jnp.inf, scaled_bv)

    def nucleus(x_bv):
        if sorted_bk is None:
            return jnp.where(x_bv < _nucleus_threshold(x_bv, top_p, path), -jnp.inf, x_bv)
        probs_bk = jax.nn.softmax(sorted_bk, axis=-1)
        mass_before_bk = jnp.cumsum(probs_bk, axis=-1) - probs_bk
        num_keep_b = jnp.maximum(jnp.sum(mass_before_bk < top_p, axis=-1), 1)
        threshold_b1 = jnp.take_along_axis(sorted_bk, num_keep_b[:, None] - 1, axis=-1)
        return jnp.where(x_bv < threshold_b1, -jnp.inf, x_bv)

    return jax.lax.cond(top_p < 1.0, nucleus, lambda x_bv: x_bv, scaled_bv)


NUCLEUS_CANDIDATES = 16
"""Largest logits `_nucleus_threshold` looks at first: XLA:GPU runs `lax.top_k` with k <= 16 as
one custom kernel (a larger k sorts the vocabulary)."""


def _nucleus_threshold(x_bv, top_p, path: KernelPath):
    """The largest logit value t with mass(x >= t) >= top_p, per row -> [b, 1].

    mass(x >= t) is `_mass_at`: one float32 masked sum over the vocabulary, the definition; the
    result is one of the row's own logit values. Never a sort of the vocabulary. The "cpu" path
    bisects (`_bisect_threshold`: 32 masked sums; XLA:CPU's top_k of 16 costs about as much as
    four of them). The portable path first seeks a row's threshold among its 16 largest logits
    (`lax.top_k`: one pass on GPU) and checks it with two masked sums, t and the next larger
    value (mass(t) >= top_p > mass(next)); rows whose nucleus needs more tokens (or whose check
    fails) are bisected: an eighth of the batch at most as a narrower batch, else every row.
    Both searches return the largest value whose `_mass_at` reaches top_p (a masked sum only
    grows as the threshold falls), so both paths find the same threshold, bit for bit,
    whichever rows take which branch (tested).
    """
    probs_bv = jax.nn.softmax(x_bv, axis=-1)
    keys_bv = _order_keys(x_bv)
    b, v = x_bv.shape
    if path == "cpu" or v <= NUCLEUS_CANDIDATES:
        return _bisect_threshold(x_bv, keys_bv, probs_bv, top_p)
    top_bk, index_bk = jax.lax.top_k(x_bv, NUCLEUS_CANDIDATES)  # descending
    # candidate: the largest of them whose mass over the candidates alone reaches top_p (a
    # guess: the check below decides); none reaches it -> the 16th, which the check rejects
    # unless ties beyond the 16 carry the mass
    probs_bk = jnp.take_along_axis(probs_bv, index_bk, axis=-1)
    ge_bkk = top_bk[:, None, :] >= top_bk[:, :, None]  # [b, candidate, other]
    guess_bk = jnp.sum(jnp.where(ge_bkk, probs_bk[:, None, :], 0.0), axis=-1)
    reached_bk = guess_bk >= top_p
    at_b = jnp.where(jnp.any(reached_bk, axis=-1), jnp.argmax(reached_bk, axis=-1), -1)
    t_b = jnp.take_along_axis(top_bk, at_b[:, None] % NUCLEUS_CANDIDATES, axis=-1)[:, 0]
    above_bk = top_bk > t_b[:, None]
    has_next_b = jnp.any(above_bk, axis=-1)
    next_b = jnp.min(jnp.where(above_bk, top_bk, jnp.inf), axis=-1)
    mass_b = _mass_at(keys_bv, probs_bv, _order_keys(t_b))
    next_mass_b = _mass_at(keys_bv, probs_bv, _order_keys(next_b))
    wrong_b = (mass_b < top_p) | (has_next_b & (next_mass_b >= top_p))

    few = max(1, b // 8)

    def bisect_few(t_b):
        rows_f = jnp.nonzero(wrong_b, size=few, fill_value=0)[0]  # filler row 0: exact too
        pick = lambda a: a[rows_f]
        t_f = _bisect_threshold(pick(x_bv), pick(keys_bv), pick(probs_bv), top_p)
        return t_b.at[rows_f].set(t_f[:, 0])

    def bisect_all(t_b):
        return jnp.where(wrong_b, _bisect_threshold(x_bv, keys_bv, probs_bv, top_p)[:, 0], t_b)

    num_wrong = jnp.sum(wrong_b)
    branch = jnp.where(num_wrong == 0, 0, jnp.where(num_wrong <= few, 1, 2))
    t_b = jax.lax.switch(branch, [lambda t_b: t_b, bisect_few, bisect_all], t_b)
    return t_b[:, None]


def _order_keys(x):
    """float32 -> uint32 keys in the floats' order (-0.0 just below +0.0)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >= jnp.uint32(0x80000000), ~bits, bits | jnp.uint32(0x80000000))


def _mass_at(keys_bv, probs_bv, key_b):
    """mass(x >= t) of each row, t given by its key: the one definition both searches use."""
    return jnp.sum(jnp.where(keys_bv >= key_b[:, None], probs_bv, 0.0), axis=-1)


def _bisect_threshold(x_bv, keys_bv, probs_bv, top_p):
    """`_nucleus_threshold` by bisection over the keys (`_order_keys`): 32 masked sums over
    the vocabulary, exact, no sort (a 49k-entry sort per row costs ~100x more on CPU)."""
    lo_b = jnp.min(keys_bv, axis=-1)  # mass(x >= min) = 1 >= top_p: lo always qualifies
    hi_b = jnp.max(keys_bv, axis=-1)

    def step(_, bounds):
        lo_b, hi_b = bounds
        gap_b = hi_b - lo_b
        mid_b = lo_b + gap_b // 2 + (gap_b & 1)  # ceil midpoint, no uint32 overflow
        ok_b = (_mass_at(keys_bv, probs_bv, mid_b) >= top_p) & (lo_b < hi_b)
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
    filtered_bv = filter_logits(scaled_bv, top_p, top_k, path) if filtering else scaled_bv
    noise_bv = kernels.gumbel_noise(keys_b, filtered_bv.shape[1], path)
    token_b = kernels.argmax(filtered_bv + noise_bv, path)

    def pick(logp_bv):
        return jnp.take_along_axis(logp_bv, token_b[:, None], axis=-1)[:, 0]

    logprob_b = pick(jax.nn.log_softmax(scaled_bv, axis=-1))
    if not filtering:
        return token_b, logprob_b, logprob_b
    return token_b, logprob_b, pick(jax.nn.log_softmax(filtered_bv, axis=-1))
