"""Context parallelism: the train step's rows split over the mesh's `context` axis.

A row of t tokens is cut into 2C chunks of L = t / 2C and permuted zig-zag: device i of the C
holds chunks i and 2C-1-i, so every device has the same causal work. Positions (RoPE), valid
keys and segment ids are computed on the row as it is, then permuted with the tokens; the
layers' [b, t, d] activations are split over context on t (`sharding.ContextParallel`).
Attention (`attention`) runs in a `jax.shard_map`: each device all-gathers its rows' keys,
values, valid keys and segment ids over context, puts them back in row order, and runs the
blockwise attention for its two query chunks at their places in the row (blocks above the
diagonal skipped as ever). The gather's transpose (a reduce-scatter) returns the key and value
gradients. The LM head scores every slot against the token after it in the row, then the
[b, t] logprobs are put back in row order. docs/long-context.md: the design and its limits.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from jgrpo.models.blockwise import RowMask, blockwise_attention_at

# True while `token_logprobs` traces a model's layers on its split rows (`rows_split`)
ROWS_SPLIT = contextvars.ContextVar("rows_split", default=False)


@contextlib.contextmanager
def rows_split():
    """While tracing inside, `transformer._project` keeps [b, t] (no flattening): a reshape of t,
    split over context, makes XLA all-gather the whole row's activations before every dot."""
    token = ROWS_SPLIT.set(True)
    try:
        yield
    finally:
        ROWS_SPLIT.reset(token)


def zigzag(x, c: int):
    """[b, t, ...] in row order -> permuted: chunks (0, 2c-1, 1, 2c-2, ..., c-1, c)."""
    b, t, rest = x.shape[0], x.shape[1], x.shape[2:]
    x = x.reshape(b, 2, c, t // (2 * c), *rest)
    return jnp.stack([x[:, 0], jnp.flip(x[:, 1], axis=1)], axis=2).reshape(b, t, *rest)


def unzigzag(x, c: int):
    """The inverse of `zigzag`: permuted [b, t, ...] -> row order."""
    b, t, rest = x.shape[0], x.shape[1], x.shape[2:]
    x = x.reshape(b, c, 2, t // (2 * c), *rest)
    first = x[:, :, 0].reshape(b, t // 2, *rest)
    second = jnp.flip(x[:, :, 1], axis=1).reshape(b, t // 2, *rest)
    return jnp.concatenate([first, second], axis=1)


def context_block(t: int, c: int, block: int) -> int:
    """The attention block of a t-token row split over c devices: `block` (0 = one chunk),
    at most a chunk L = t / 2c, dividing L (ValueError otherwise; the config checks first)."""
    chunk = t // (2 * c)
    size = min(block or chunk, chunk)
    if t % (2 * c) or chunk % size:
        raise ValueError(
            f"context parallelism: a {t}-token row needs t divisible by 2 x mesh.context "
            f"= {2 * c} and its chunks of {chunk} by the attention block {size}"
        )
    return size


def attention(q_btnh, k_bskh, v_bskh, mask: RowMask, cp, block: int):
    """Causal grouped-query attention of permuted rows split over `cp.axis` (a
    `sharding.ContextParallel`) -> [b, t, n, h] permuted, in q's dtype."""
    c, t = cp.size, q_btnh.shape[1]
    block = context_block(t, c, block)
    segments_bs = mask.segments_bs
    if segments_bs is None:
        segments_bs = jnp.zeros(mask.valid_bs.shape, jnp.int32)

    def local(q_btnh, k_bskh, v_bskh, valid_bs, seg_bs):
        gather = lambda x: unzigzag(jax.lax.all_gather(x, cp.axis, axis=1, tiled=True), c)
        k_all, v_all, valid_all, seg_all = map(gather, (k_bskh, v_bskh, valid_bs, seg_bs))
        i = jax.lax.axis_index(cp.axis)
        per = q_btnh.shape[1] // 2 // block  # blocks per chunk
        own = jnp.arange(per)
        qblocks = jnp.concatenate([i * per + own, (2 * c - 1 - i) * per + own])
        count = per * (2 * c * per + 1)  # sum(qblocks + 1), the same on every device
        return blockwise_attention_at(
            q_btnh, k_all, v_all, valid_all, seg_bs, seg_all, qblocks, block, count
        )

    tokens = cp.tokens
    return jax.shard_map(
        local,
        mesh=cp.mesh,
        in_specs=(cp.qkv, cp.qkv, cp.qkv, tokens, tokens),
        out_specs=cp.qkv,
        check_vma=False,  # the blockwise loops' carries start replicated, then vary
    )(q_btnh, k_bskh, v_bskh, mask.valid_bs.astype(jnp.bool_), segments_bs)


def token_logprobs(model, input_ids_bt, attention_mask_bt, temperature, use_lora, first, packed):
    """`Transformer.token_logprobs` of rows split over `model.context_parallel`: the same
    [b, t] (or packed [b, n]) logprobs in row order."""
    cp, cfg = model.context_parallel, model.cfg
    c = cp.size
    b, t = input_ids_bt.shape
    context_block(t, c, cfg.attention_block_size)
    if packed is None:
        valid = jnp.ones((b, t), jnp.bool_) if attention_mask_bt is None else attention_mask_bt
        valid = valid.astype(jnp.bool_)
        positions = jnp.maximum(jnp.cumsum(valid, axis=-1) - 1, 0)
        segments = None
    else:
        positions, seg_bt = packed[0], packed[1]
        valid, segments = seg_bt > 0, (zigzag(positions, c), zigzag(seg_bt, c))
    targets_bt = jnp.pad(input_ids_bt[:, 1:], ((0, 0), (0, 1)))  # the token after each slot
    rows = zigzag(input_ids_bt, c), zigzag(positions, c), zigzag(valid, c)
    with rows_split():  # the layers keep [b, t]
        hidden = model._hidden(*rows, use_lora, segments, True)
    x_btd = model._final_norm(hidden)
    per = t // c  # each device's slots, scored in chunks that stay on it
    size = min(cfg.logprob_chunk_size or per, per)
    if per % size:
        raise ValueError(
            f"context parallelism: {per} tokens a device do not split into "
            f"model.logprob_chunk_size={size} chunks"
        )
    k = per // size
    x_kbcd = x_btd.reshape(b, c, k, size, -1).transpose(2, 0, 1, 3, 4).reshape(k, b, c * size, -1)
    tg = zigzag(targets_bt, c).reshape(b, c, k, size).transpose(2, 0, 1, 3).reshape(k, b, -1)
    lp_kbc = model._chunk_logprobs(x_kbcd, tg, temperature)
    lp_bt = unzigzag(lp_kbc.reshape(k, b, c, size).transpose(1, 2, 0, 3).reshape(b, t), c)
    lp_bt = jnp.pad(lp_bt[:, :-1], ((0, 0), (1, 0)))  # column p: token p, from slot p - 1
    if packed is not None:
        scored_bn = packed[2]
        return jnp.where(scored_bn > 0, jnp.take_along_axis(lp_bt, scored_bn, axis=1), 0.0)
    return jnp.where(jnp.arange(t) >= max(int(first), 1), lp_bt, 0.0)
