"""Blockwise (flash-style) causal attention: memory linear in the row, the materialised
attention's math (`jgrpo.models.kernels`); docs/long-context.md explains it.

Queries and keys are cut into blocks; per query a running max m, sum l and weighted value sum
are updated key block by key block (online softmax) in one loop over the block pairs at or
below the diagonal (`causal_pairs`: a static trip count), the output is acc / l. The backward
(`jax.custom_vjp`) keeps the output and lse = m + log l and recomputes each pair's
p = e^(s - lse): dv += p^T do, ds = p (do v^T - rowsum(do * o)), dq += ds k / sqrt(h),
dk += ds^T q / sqrt(h). Temporaries: one block pair per head beyond the row's sums. The mask is
described (`RowMask`: causal, real keys, same segment), never materialised; masked scores are
MASK_VALUE as in the materialised path, so a padding query (no visible key) stays finite, with
a value of its own that no real token reads. Scores, sums and gradients accumulate in float32;
probabilities meet v in v's dtype. float32 equals the materialised path to rounding
(tests/test_long_context.py).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

MASK_VALUE = -1e30  # the materialised path's (kernels.MASK_VALUE); kept equal by a test


class RowMask(NamedTuple):
    """Who attends to whom in aligned rows, described: query i sees key j <= i when key j is
    a real token and both are in the same segment."""

    valid_bs: jax.Array
    """[b, s] True = a real token."""
    segments_bs: Optional[jax.Array] = None
    """[b, s] segment ids of packed rows (None = one sequence per row)."""

    def dense(self) -> jax.Array:
        """The materialised [b, t, s] boolean mask (True = attend)."""
        t = self.valid_bs.shape[1]
        mask_bts = jnp.tril(jnp.ones((t, t), jnp.bool_))[None] & self.valid_bs[:, None, :]
        if self.segments_bs is not None:
            mask_bts &= self.segments_bs[:, :, None] == self.segments_bs[:, None, :]
        return mask_bts


def blockwise_attention(q_btnh, k_bskh, v_bskh, valid_bs, segments_bs=None, *, block: int):
    """Causal grouped-query attention of aligned rows (t == s) -> [b, t, n, h] in q's dtype.

    `valid_bs`: True = a real key token; `segments_bs`: packed rows' segment ids (None = one
    sequence per row); `block`: the query and key block length (static; the row is padded to
    a multiple of it, padded keys masked)."""
    b, t, n, h = q_btnh.shape
    if k_bskh.shape[1] != t:
        raise ValueError(f"blockwise attention: needs aligned rows, got t={t}, s={k_bskh.shape[1]}")
    if segments_bs is None:
        segments_bs = jnp.zeros((b, t), jnp.int32)
    padded = -(-t // block) * block
    if padded != t:
        pad = ((0, 0), (0, padded - t))
        q_btnh, k_bskh, v_bskh = (
            jnp.pad(x, pad + ((0, 0), (0, 0))) for x in (q_btnh, k_bskh, v_bskh)
        )
        valid_bs = jnp.pad(valid_bs, pad)
        segments_bs = jnp.pad(segments_bs, pad, constant_values=-1)
    valid_bs = valid_bs.astype(jnp.bool_)
    seg = (segments_bs, segments_bs)  # whole row: query block i is row block i (qblocks None)
    out_btnh = _attention(q_btnh, k_bskh, v_bskh, valid_bs, *seg, None, block, 0)
    return out_btnh[:, :t]


def blockwise_attention_at(
    q_btnh, k_bskh, v_bskh, valid_bs, seg_q_bt, seg_k_bs, qblocks, block, count: int
):
    """Causal attention of query blocks that sit anywhere in the row: query block i (of t /
    block) is block `qblocks[i]` of the s-token row of keys (ascending; t and s multiples of
    `block`), so it sees keys up to its end. `count` (static) = sum(qblocks + 1), the pairs'
    trip count. The context axis's local chunks (models/context.py)."""
    valid_bs = valid_bs.astype(jnp.bool_)
    return _attention(q_btnh, k_bskh, v_bskh, valid_bs, seg_q_bt, seg_k_bs, qblocks, block, count)


def _visible(i, g, j, block, valid_bs, seg_q_bt, seg_k_bs):
    """[b, block_q, block_k] mask of query block i (block g of the row) against key block j."""
    qpos = g * block + jnp.arange(block)
    kpos = j * block + jnp.arange(block)
    valid_bk = jax.lax.dynamic_slice_in_dim(valid_bs, j * block, block, axis=1)
    seg_q = jax.lax.dynamic_slice_in_dim(seg_q_bt, i * block, block, axis=1)
    seg_k = jax.lax.dynamic_slice_in_dim(seg_k_bs, j * block, block, axis=1)
    causal_qk = qpos[:, None] >= kpos[None, :]
    return causal_qk[None] & valid_bk[:, None, :] & (seg_q[:, :, None] == seg_k[:, None, :])


def _grouped(q_btnh, kv_heads: int):
    b, t, n, h = q_btnh.shape
    return q_btnh.reshape(b, t, kv_heads, n // kv_heads, h)


def _block(x, i, block):
    return jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=1)


def _scores(q_bqkgh, k_bkkh, mask_bqk, scale):
    """[b, k, q, g, s] float32 scores of one block pair, masked."""
    s = jnp.einsum("bqkgh,bskh->bkqgs", q_bqkgh, k_bkkh, preferred_element_type=jnp.float32)
    return jnp.where(mask_bqk[:, None, :, None, :], s * scale, MASK_VALUE)


def causal_pairs(qblocks, count: int):
    """(i, j), each [count]: every pair of local query block i and key block j <= qblocks[i]
    (the row block query block i is), by query block, key blocks in order. `count` (static:
    the sum of qblocks + 1; blocks (blocks + 1) / 2 for a whole row) is the trip count of the
    one loop over them, which XLA and inspect-step then know. Every sum accumulates in the
    order of nested loops: dq of block i over j, dk and dv of block j over i, ascending."""
    xp = np if isinstance(qblocks, np.ndarray) else jnp  # numpy: the lists are constants
    ends = xp.cumsum(qblocks + 1)
    flat = xp.arange(count)
    i = xp.searchsorted(ends, flat, side="right")
    return i, flat - ends[i] + qblocks[i] + 1


def _whole_row(blocks: int):
    """`causal_pairs` of a whole row of `blocks` blocks."""
    return causal_pairs(np.arange(blocks), blocks * (blocks + 1) // 2)


def _over_pairs(pair, init, pairs):
    """carry = pair(carry, (i, j)) for the `causal_pairs` in order, in a while loop that XLA
    sees counted (len(i) trips). Not a scan: under remat JAX's partial evaluation would stack
    what each trip computes from its inputs alone (the masks) as a [pairs, ...] residual."""
    i_all, j_all = (jnp.asarray(x, jnp.int32) for x in pairs)

    def body(state):
        p, carry = state
        return p + 1, pair(carry, (i_all[p], j_all[p]))

    count = i_all.shape[0]
    return jax.lax.while_loop(lambda state: state[0] < count, body, (0, init))[1]


def _pairs(qblocks, count: int, blocks: int):
    """The causal pairs and a map from local query block to row block: a whole row of
    `blocks` blocks when qblocks is None, else `causal_pairs(qblocks, count)`."""
    if qblocks is None:
        return _whole_row(blocks), lambda i: i
    return causal_pairs(qblocks, count), lambda i: qblocks[i]


def _forward(q_btnh, k_bskh, v_bskh, valid_bs, seg_q_bt, seg_k_bs, qblocks, block, count):
    """-> (out [b, t, n, h] in q's dtype, lse [b, k, t, g] float32)."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    g = n // kv
    scale = np.float32(1 / math.sqrt(h))
    q_btkgh = _grouped(q_btnh, kv)
    pairs, row_block = _pairs(qblocks, count, t // block)

    def pair(carry, ij):
        i, j = ij
        # carry: the whole row's m [b, k, t, g], l [b, k, t, g] and acc [b, k, t, g, h]
        m_i, l_i, acc_i = (jax.lax.dynamic_slice_in_dim(x, i * block, block, 2) for x in carry)
        mask = _visible(i, row_block(i), j, block, valid_bs, seg_q_bt, seg_k_bs)
        s = _scores(_block(q_btkgh, i, block), _block(k_bskh, j, block), mask, scale)
        m_new = jnp.maximum(m_i, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m_i - m_new)
        pv = jnp.einsum(
            "bkqgs,bskh->bkqgh",
            p.astype(v_bskh.dtype),
            _block(v_bskh, j, block),
            preferred_element_type=jnp.float32,
        )
        new = (m_new, l_i * corr + p.sum(-1), acc_i * corr[..., None] + pv)
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(x, x_i, i * block, 2) for x, x_i in zip(carry, new)
        )

    init = (
        jnp.full((b, kv, t, g), -jnp.inf, jnp.float32),
        jnp.zeros((b, kv, t, g), jnp.float32),
        jnp.zeros((b, kv, t, g, h), jnp.float32),
    )
    # every query block's key blocks up to the diagonal, in order
    m, l, acc = _over_pairs(pair, init, pairs)
    out_btnh = (acc / l[..., None]).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)
    return out_btnh.astype(q_btnh.dtype), m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _attention(q_btnh, k_bskh, v_bskh, valid_bs, seg_q_bt, seg_k_bs, qblocks, block, count):
    args = (q_btnh, k_bskh, v_bskh, valid_bs, seg_q_bt, seg_k_bs, qblocks, block, count)
    return _forward(*args)[0]


def _attention_fwd(q_btnh, k_bskh, v_bskh, valid_bs, seg_q_bt, seg_k_bs, qblocks, block, count):
    out_btnh, lse_bktg = _forward(
        q_btnh, k_bskh, v_bskh, valid_bs, seg_q_bt, seg_k_bs, qblocks, block, count
    )
    masks = (valid_bs, seg_q_bt, seg_k_bs, qblocks)
    return out_btnh, (q_btnh, k_bskh, v_bskh, masks, out_btnh, lse_bktg)


def _attention_bwd(block, count, residuals, dout_btnh):
    q_btnh, k_bskh, v_bskh, masks, out_btnh, lse_bktg = residuals
    valid_bs, seg_q_bt, seg_k_bs, qblocks = masks
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    scale = np.float32(1 / math.sqrt(h))
    q_btkgh = _grouped(q_btnh, kv)
    do_btkgh = _grouped(dout_btnh, kv)
    pairs, row_block = _pairs(qblocks, count, t // block)
    # rowsum(do * o) per query and head: the softmax backward's correction
    delta_bktg = jnp.einsum(
        "btkgh,btkgh->bktg",
        do_btkgh.astype(jnp.float32),
        _grouped(out_btnh, kv).astype(jnp.float32),
    )

    def pair(carry, ij):
        i, j = ij
        dq, dk, dv = carry  # the whole row's float32 gradients
        k_j, v_j = _block(k_bskh, j, block), _block(v_bskh, j, block)
        q_i, do_i = _block(q_btkgh, i, block), _block(do_btkgh, i, block)
        lse_i = jax.lax.dynamic_slice_in_dim(lse_bktg, i * block, block, axis=2)
        delta_i = jax.lax.dynamic_slice_in_dim(delta_bktg, i * block, block, axis=2)
        mask = _visible(i, row_block(i), j, block, valid_bs, seg_q_bt, seg_k_bs)
        p = jnp.exp(_scores(q_i, k_j, mask, scale) - lse_i[..., None])  # [b, k, q, g, s]
        dv_j = jnp.einsum(
            "bkqgs,bqkgh->bskh",
            p.astype(v_bskh.dtype),
            do_i,
            preferred_element_type=jnp.float32,
        )
        dp = jnp.einsum("bqkgh,bskh->bkqgs", do_i, v_j, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_i[..., None]) * scale
        dq_i = jnp.einsum(
            "bkqgs,bskh->bqkgh",
            ds.astype(k_bskh.dtype),
            k_j,
            preferred_element_type=jnp.float32,
        )
        dk_j = jnp.einsum(
            "bkqgs,bqkgh->bskh",
            ds.astype(q_btnh.dtype),
            q_i,
            preferred_element_type=jnp.float32,
        )

        def add(x, x_i, at):
            return jax.lax.dynamic_update_slice_in_dim(x, _block(x, at, block) + x_i, at * block, 1)

        return add(dq, dq_i, i), add(dk, dk_j, j), add(dv, dv_j, j)

    zeros = jnp.zeros(k_bskh.shape, jnp.float32)
    # the forward's pairs: key block j meets query blocks i from the diagonal down, in order
    init = (jnp.zeros(q_btkgh.shape, jnp.float32), zeros, zeros)
    dq_btkgh, dk_bskh, dv_bskh = _over_pairs(pair, init, pairs)
    return (
        dq_btkgh.reshape(q_btnh.shape).astype(q_btnh.dtype),
        dk_bskh.astype(k_bskh.dtype),
        dv_bskh.astype(v_bskh.dtype),
        None,
        None,
        None,
        None,
    )


_attention.defvjp(_attention_fwd, _attention_bwd)
