"""Platform-specific kernels of the model and its sampler, behind one switch.

The switch is `TransformerConfig.kernels`: "auto" (default) | "cpu" | "portable", resolved by
`resolve_kernels` at trace time ("auto" -> "cpu" when `jax.default_backend()` is "cpu", else
"portable"). Every kernel below takes the resolved path; nothing else in jgrpo branches on the
platform. The pieces: attention (forward, prefill, decode), the KV cache layout, RoPE cos/sin,
argmax, Gumbel noise, uint16 views of 16-bit stacks. "cpu" is tuned for XLA:CPU (einsum
attention over [b,k,t,g,s] scores, keys [b,k,h,s], trace-time RoPE, threefry written out);
"portable" is the idiomatic GPU/TPU code (jax.nn.dot_product_attention: cuDNN's on CUDA where
it takes the call, prefill causal flash, decode reading only the live cache; a [b,s,k,h] cache).

Contract: both paths compute the same math and differ in float rounding only; the Gumbel noise
is bit-identical and both argmaxes return the first index of the maximum, so a key draws the
same tokens on both paths whenever their logits agree. Forcing "portable" on CPU runs the
GPU/TPU code on a laptop (the tests do). Why each CPU piece: docs/performance.md."""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

KernelPath = Literal["cpu", "portable"]
KERNEL_CHOICES = ("auto", "cpu", "portable")
"""Values of `TransformerConfig.kernels`."""

COMPILER_OPTIONS = {"xla_allow_excess_precision": False}
"""XLA options for every jit that runs the model (the sampler's and the train step's): round
to the compute dtype after every op as written. By default XLA may keep bfloat16 intermediates
in float32 inside a fusion, so two programs of the same math (the sampler's prefill + decode
steps and the trainer's one forward) round differently wherever XLA fused differently: on the
tiny bf16 test model token_mult_prob_error is 1.011 with XLA's default and 1.0000001 with this
(both kernel paths). No effect on float32 programs."""

MASK_VALUE = -1e30  # finite: a fully masked (padding) query row gives a uniform softmax, not NaN


def resolve_kernels(choice: str) -> KernelPath:
    """Resolve a `kernels` value: auto -> cpu on the CPU backend, portable elsewhere."""
    if choice == "auto":
        return "cpu" if jax.default_backend() == "cpu" else "portable"
    if choice in ("cpu", "portable"):
        return choice
    raise ValueError(f"model kernels: must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")


# ----------------------------------------------------------------------------- attention


def attention(q_btnh, k_bskh, v_bskh, mask_bts, path: KernelPath, causal: bool = False):
    """Grouped-query softmax attention -> [b, t, n, h] in q's dtype; scores and softmax in
    float32. `mask_bts`: True = attend. `causal` promises that mask_bts already includes the
    causal mask of aligned positions (query i is key i): a hint cuDNN uses to skip the masked
    blocks, never a change of the result."""
    if path == "cpu":
        return _attention_einsum(q_btnh, k_bskh, v_bskh, mask_bts)
    impl = _dpa_implementation(q_btnh, k_bskh, causal)
    return jax.nn.dot_product_attention(
        q_btnh,
        k_bskh,
        v_bskh,
        mask=mask_bts[:, None],
        is_causal=impl == "cudnn",
        implementation=impl,
    )


def _attention_einsum(q_btnh, k_bskh, v_bskh, mask_bts):
    b, t, n, h = q_btnh.shape
    k = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(b, t, k, n // k, h)
    # [b, k, t, g, s]: the dot's natural output order (batch, lhs free, rhs free), so no
    # transpose needs materialising before the mask and softmax
    scores_bktgs = jnp.einsum(
        "btkgh,bskh->bktgs", q_btkgh, k_bskh, preferred_element_type=jnp.float32
    ) / np.float32(math.sqrt(h))
    scores_bktgs = jnp.where(mask_bts[:, None, :, None], scores_bktgs, MASK_VALUE)
    probs_bktgs = jax.nn.softmax(scores_bktgs, axis=-1).astype(v_bskh.dtype)
    out_btkgh = jnp.einsum("bktgs,bskh->btkgh", probs_bktgs, v_bskh)
    return out_btkgh.reshape(b, t, n, h)


def _on_cuda() -> bool:
    if jax.default_backend() != "gpu":
        return False
    return "cuda" in jax.devices()[0].client.platform_version.lower()


def _dpa_implementation(q_btnh, k_bskh, causal: bool) -> Literal["cudnn", "xla"]:
    """cuDNN flash attention where jax's cuDNN kernel takes the call (CUDA, bf16/fp16, head
    dim a multiple of 8 up to 128, even lengths: its bias-with-training rule), for causal
    self-attention over aligned positions; XLA otherwise (CPU, TPU, decode, float32)."""
    t, h = q_btnh.shape[1], q_btnh.shape[3]
    s = k_bskh.shape[1]
    eligible = (
        causal
        and t == s
        and t % 2 == 0
        and q_btnh.dtype in (jnp.bfloat16, jnp.float16)
        and h % 8 == 0
        and h <= 128
    )
    return "cudnn" if eligible and _on_cuda() else "xla"


# ----------------------------------------------------------------------------- KV cache


def cache_from_prefill(kv_lbtkh, cache_len: int, dtype, path: KernelPath, *, values: bool):
    """Every layer's prefill keys (or values) [l, b, t, k, h] -> a tuple of per-layer cache
    arrays with `cache_len` slots in `dtype` (slots [0, t) filled, zeros after)."""
    if path == "cpu":  # keys [b, k, h, s], values [b, k, s, h]
        axes, slot_axis = ((0, 1, 3, 2, 4), 3) if values else ((0, 1, 3, 4, 2), 4)
        kv_l = jnp.transpose(kv_lbtkh, axes)
    else:  # [b, s, k, h]
        kv_l, slot_axis = kv_lbtkh, 2
    kv_l = kv_l.astype(dtype)
    pad = [(0, 0)] * kv_l.ndim
    pad[slot_axis] = (0, cache_len - kv_lbtkh.shape[2])
    kv_l = jnp.pad(kv_l, pad)
    return tuple(kv_l[i] for i in range(kv_l.shape[0]))


def cache_in(cache, dtype):
    """A KV cache (any tree of cache arrays) stored in `dtype` (rollout.kv_cache_dtype; None:
    as it is, the compute dtype). The sampler casts after the prefill, before the rows of a
    group share it, so only the prompts' cache passes through the compute dtype."""
    return cache if dtype is None else jax.tree.map(lambda x: x.astype(dtype), cache)


def cache_slots(keys, path: KernelPath) -> int:
    """Number of slots of one layer's key cache."""
    return keys.shape[3] if path == "cpu" else keys.shape[1]


def decode_attention(q_b1nh, k_b1kh, v_b1kh, keys, values, slot, mask_bs, path: KernelPath):
    """Write one token's key/value at cache `slot` (dynamic_update_slice: in place in a loop
    carry; a [b] array of slots, one per row, is a scatter: the sampler's decode slots), then
    attend its query over the first s = mask_bs.shape[1] slots where mask_bs -> (out_b1nh in
    q's dtype, keys, values). Each path's math is its `attention`'s (float32 softmax,
    probabilities cast to the compute dtype, q's, before the value dot), so in bf16 the sampler
    rounds as the trainer's forward does; a cache stored in a narrower dtype
    (rollout.kv_cache_dtype) is read up to q's dtype (its values rounded when written). The
    portable path is `attend_live` with each row's key length slot + 1: on CUDA cuDNN reads
    only the slots written so far (the masked prompt padding aside); elsewhere XLA's masked
    softmax over the s slots, the same numbers."""
    zero, slot = jnp.zeros((), jnp.int32), jnp.asarray(slot, jnp.int32)
    s = mask_bs.shape[1]
    rows_b = jnp.arange(q_b1nh.shape[0])  # with one slot per row (slot [b]): a scatter
    if path == "portable":
        k_new, v_new = k_b1kh.astype(keys.dtype), v_b1kh.astype(values.dtype)
        if slot.ndim:
            keys = keys.at[rows_b, slot].set(k_new[:, 0])
            values = values.at[rows_b, slot].set(v_new[:, 0])
        else:
            keys = jax.lax.dynamic_update_slice(keys, k_new, (zero, slot, zero, zero))
            values = jax.lax.dynamic_update_slice(values, v_new, (zero, slot, zero, zero))
        lengths_b = jnp.broadcast_to(slot + 1, (q_b1nh.shape[0],))
        # a cache stored narrower than the compute dtype (rollout.kv_cache_dtype) is read up
        k_live, v_live = keys[:, :s].astype(q_b1nh.dtype), values[:, :s].astype(q_b1nh.dtype)
        impl = _decode_implementation(k_live)
        out_b1nh = attend_live(q_b1nh, k_live, v_live, mask_bs, lengths_b, impl)
        return out_b1nh.astype(q_b1nh.dtype), keys, values

    b, _, n, h = q_b1nh.shape
    k_heads = keys.shape[1]
    if slot.ndim:
        keys = keys.at[rows_b, :, :, slot].set(k_b1kh[:, 0].astype(keys.dtype))
        values = values.at[rows_b, :, slot].set(v_b1kh[:, 0].astype(values.dtype))
    else:
        k_bkh1 = jnp.transpose(k_b1kh, (0, 2, 3, 1)).astype(keys.dtype)
        keys = jax.lax.dynamic_update_slice(keys, k_bkh1, (zero, zero, zero, slot))
        v_bk1h = jnp.swapaxes(v_b1kh, 1, 2).astype(values.dtype)
        values = jax.lax.dynamic_update_slice(values, v_bk1h, (zero, zero, slot, zero))
    q_bkgh = q_b1nh.reshape(b, k_heads, n // k_heads, h)
    compute = q_b1nh.dtype  # a narrower cache (rollout.kv_cache_dtype) is read up to it
    scores_bkgs = jnp.einsum(
        "bkgh,bkhs->bkgs",
        q_bkgh,
        keys[..., :s].astype(compute),
        preferred_element_type=jnp.float32,
    )
    sqrt_h = np.float32(math.sqrt(h))
    scores_bkgs = jnp.where(mask_bs[:, None, None], scores_bkgs / sqrt_h, MASK_VALUE)
    probs_bkgs = jax.nn.softmax(scores_bkgs, axis=-1).astype(compute)
    out_bkgh = jnp.einsum("bkgs,bksh->bkgh", probs_bkgs, values[:, :, :s].astype(compute))
    return out_bkgh.astype(q_b1nh.dtype).reshape(b, 1, n, h), keys, values


def attend_live(q_b1nh, k_bskh, v_bskh, mask_bs, lengths_b, implementation):
    """One query per row over the cache's live part: slots [0, lengths_b) where mask_bs (the
    caller promises mask_bs is False from lengths_b on) -> [b, 1, n, h] in q's dtype. The
    portable decode attention: `jax.nn.dot_product_attention` with per-row key/value lengths,
    so cuDNN (`implementation="cudnn"`) reads only each row's first lengths_b slots; "xla"
    (or None) computes the same masked softmax over all s slots."""
    b = q_b1nh.shape[0]
    return jax.nn.dot_product_attention(
        q_b1nh,
        k_bskh,
        v_bskh,
        mask=mask_bs[:, None, None, :],
        query_seq_lengths=jnp.ones((b,), jnp.int32),
        key_value_seq_lengths=lengths_b.astype(jnp.int32),
        implementation=implementation,
    )


def _decode_implementation(keys_bskh) -> Literal["cudnn", "xla"]:
    """cuDNN for the portable decode attention where its kernel takes the call (CUDA, a
    bf16/fp16 cache, head dim a multiple of 8 up to 128); XLA otherwise (CPU, TPU, float32)."""
    h = keys_bskh.shape[-1]
    eligible = keys_bskh.dtype in (jnp.bfloat16, jnp.float16) and h % 8 == 0 and h <= 128
    return "cudnn" if eligible and _on_cuda() else "xla"


# ----------------------------------------------------------------------------- RoPE


def rope_cos_sin(inv_freq_h2: np.ndarray, positions_bt, num_positions, path: KernelPath):
    """(cos, sin) [b, t, h/2] float32 of the float32 angle `position * inv_freq`. On the CPU
    path with `num_positions` (every position < it): looked up in tables computed in NumPy at
    trace time (float64 cos/sin rounded once), compile-time constants that cost nothing at run
    time, where XLA:CPU otherwise re-evaluates cos/sin inside every fusion that uses them, once
    per head (a quarter of the tiny benchmark's prefill). Otherwise computed at run time."""
    if path == "portable" or num_positions is None:
        angle_bth2 = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_h2)
        return jnp.cos(angle_bth2), jnp.sin(angle_bth2)
    angle_ph2 = np.arange(num_positions, dtype=np.float32)[:, None] * inv_freq_h2[None]
    angle_ph2 = angle_ph2.astype(np.float64)
    cos_ph2 = jnp.asarray(np.cos(angle_ph2).astype(np.float32))
    sin_ph2 = jnp.asarray(np.sin(angle_ph2).astype(np.float32))
    return cos_ph2[positions_bt], sin_ph2[positions_bt]


# ----------------------------------------------------------------------------- sampling


@jax.custom_vjp
def from_bits(bits, like):
    """`like` (a 16-bit float array) rebuilt from `bits`, its uint16 view (`uint16_views`); the
    gradient flows to `like`. XLA:CPU slices a bfloat16 array in float32, so a scan over a
    bfloat16 stack works on a float32 copy of the whole stack, made before the loop: of the
    stacked bfloat16 weights (a float32 copy of the parameters per step), and of the remat
    residual (each layer's bfloat16 input, stacked by the forward scan and sliced by the
    backward). An integer view is sliced and stacked as it is stored. The "cpu" path only
    (other backends slice 16-bit floats natively); the values are the same bits."""
    return jax.lax.bitcast_convert_type(bits, like.dtype)


def _from_bits_fwd(bits, like):
    return from_bits(bits, like), bits.shape


def _from_bits_bwd(shape, g):
    return np.zeros(shape, jax.dtypes.float0), g


from_bits.defvjp(_from_bits_fwd, _from_bits_bwd)


def uint16_views(tree: dict, path: KernelPath) -> dict:
    """On the "cpu" path, the uint16 views of the 16-bit float arrays of `tree` by name (for
    `from_bits`); {} on "portable"."""
    if path != "cpu":
        return {}
    return {
        name: jax.lax.bitcast_convert_type(w, jnp.uint16)
        for name, w in tree.items()
        if jnp.dtype(w.dtype).itemsize == 2 and jnp.issubdtype(w.dtype, jnp.floating)
    }


def argmax(x_bv, path: KernelPath):
    """First index of the row maximum -> [b] int32 (jnp.argmax's ties on both paths). CPU: a
    max then a min-index reduce, faster on XLA:CPU than jnp.argmax's variadic reduce."""
    if path == "portable":
        return jnp.argmax(x_bv, axis=-1).astype(jnp.int32)
    iota_bv = jax.lax.broadcasted_iota(jnp.int32, x_bv.shape, 1)
    at_max_bv = x_bv == jnp.max(x_bv, axis=-1, keepdims=True)
    return jnp.min(jnp.where(at_max_bv, iota_bv, x_bv.shape[-1]), axis=-1)


def gumbel_noise(keys_b, v: int, path: KernelPath):
    """[b, v] float32 Gumbel noise, row b from keys_b[b]: exactly
    `jax.vmap(lambda k: jax.random.gumbel(k, (v,)))(keys_b)` on both paths (the portable path
    calls it; the CPU path needs threefry2x32 keys and writes the hash out, faster there)."""
    if path == "portable":
        return jax.vmap(lambda key: jax.random.gumbel(key, (v,), jnp.float32))(keys_b)
    if str(jax.random.key_impl(keys_b)) != "threefry2x32":
        raise ValueError(
            f"sampling keys: need threefry2x32 keys, got {jax.random.key_impl(keys_b)}"
        )
    data_b2 = jax.random.key_data(keys_b)
    counts_v = jax.lax.iota(np.uint32, v)  # the low word of JAX's 64-bit counter; high = 0
    bits1_bv, bits2_bv = _threefry2x32(
        data_b2[:, :1], data_b2[:, 1:], jnp.zeros_like(counts_v)[None], counts_v[None]
    )
    mantissa_bv = jax.lax.shift_right_logical(bits1_bv ^ bits2_bv, np.uint32(9))
    one_bits = np.array(1.0, np.float32).view(np.uint32)
    floats_bv = jax.lax.bitcast_convert_type(mantissa_bv | one_bits, jnp.float32) - 1.0
    tiny = np.float32(np.finfo(np.float32).tiny)
    uniform_bv = jnp.maximum(tiny, floats_bv * (np.float32(1.0) - tiny) + tiny)
    return -jnp.log(-jnp.log(uniform_bv))


def _threefry2x32(k1, k2, x1, x2):
    """Threefry-2x32, 20 rounds (Salmon et al. 2011), as plain uint32 jnp ops: the hash behind
    `jax.random`. JAX's own CPU lowering runs it as a 5-trip while loop (a dozen thunks per
    trip); written out, XLA fuses it into one loop over the elements. Bit-identical (tested)."""
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in rotations[i % 2]:
            x1 = x1 + x2
            x2 = jax.lax.shift_left(x2, np.uint32(r)) | jax.lax.shift_right_logical(
                x2, np.uint32(32 - r)
            )
            x2 = x1 ^ x2
        x1 = x1 + ks[(i + 1) % 3]
        x2 = x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x1, x2
