"""The GPU path's CPU-testable parts (issue 35, "Ready for the GPU"): the portable decode
attention's live-length contract and the switch that picks cuDNN only on CUDA, the exact top-p
threshold without a sort, no per-step weight work in the decode loop, the launcher's XLA GPU
flags."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo.models import kernels


def _decode_inputs(seed=0, b=3, s=32, n=4, k=2, h=8, dtype=jnp.float32):
    rng = np.random.RandomState(seed)
    q = jnp.asarray(rng.randn(b, 1, n, h), dtype)
    keys = jnp.asarray(rng.randn(b, s, k, h), dtype)
    values = jnp.asarray(rng.randn(b, s, k, h), dtype)
    starts = rng.randint(0, 8, b)  # left padding of each row's prompt
    lengths = rng.randint(12, s + 1, b)  # slots written so far (the token's slot + 1)
    mask = (np.arange(s)[None] >= starts[:, None]) & (np.arange(s)[None] < lengths[:, None])
    return q, keys, values, jnp.asarray(mask), jnp.asarray(lengths, jnp.int32)


def _numpy_attention(q, keys, values, mask):
    """float64 reference: grouped-query softmax attention of one query per row."""
    q, keys, values = (np.asarray(x, np.float64) for x in (q, keys, values))
    b, _, n, h = q.shape
    k = keys.shape[2]
    kv_heads = np.repeat(np.arange(k), n // k)
    scores = np.einsum("bnh,bsnh->bns", q[:, 0], keys[:, :, kv_heads]) / math.sqrt(h)
    scores = np.where(np.asarray(mask)[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bns,bsnh->bnh", probs, values[:, :, kv_heads])[:, None]


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_live_length_decode_attention_equals_masked_attention(implementation):
    """The GPU decode attention's function with XLA in place of cuDNN and the same lengths
    equals the masked attention the portable path ran before (bit for bit) and float64 NumPy."""
    q, keys, values, mask, lengths = _decode_inputs()
    live = jax.jit(kernels.attend_live, static_argnums=5)(
        q, keys, values, mask, lengths, implementation
    )
    masked = jax.nn.dot_product_attention(
        q, keys, values, mask=mask[:, None, None, :], implementation="xla"
    )
    np.testing.assert_array_equal(np.asarray(live), np.asarray(masked))
    np.testing.assert_allclose(live, _numpy_attention(q, keys, values, mask), atol=1e-6)


def test_decode_attention_portable_and_cpu_paths_agree_with_per_row_slots():
    """kernels.decode_attention writes each row's new key/value at its slot and attends up to
    it: the portable path (lengths = slot + 1) and the CPU path give the reference's output."""
    q, keys, values, mask, lengths = _decode_inputs(seed=1)
    rng = np.random.RandomState(2)
    k_new = jnp.asarray(rng.randn(3, 1, 2, 8), jnp.float32)
    v_new = jnp.asarray(rng.randn(3, 1, 2, 8), jnp.float32)
    slot = lengths - 1
    keys_ref = keys.at[jnp.arange(3), slot].set(k_new[:, 0])
    values_ref = values.at[jnp.arange(3), slot].set(v_new[:, 0])
    want = _numpy_attention(q, keys_ref, values_ref, mask)
    out, k_out, _ = kernels.decode_attention(q, k_new, v_new, keys, values, slot, mask, "portable")
    np.testing.assert_allclose(out, want, atol=1e-6)
    np.testing.assert_array_equal(k_out, keys_ref)
    cache = lambda x, values: kernels.cache_from_prefill(x[None], 32, x.dtype, "cpu", values=values)
    (k_cpu,), (v_cpu,) = cache(keys, False), cache(values, True)
    out_cpu, _, _ = kernels.decode_attention(q, k_new, v_new, k_cpu, v_cpu, slot, mask, "cpu")
    np.testing.assert_allclose(out_cpu, want, atol=1e-6)


def test_switch_picks_cudnn_decode_only_on_cuda(monkeypatch):
    """On this CPU backend the portable decode attention is XLA's (and the "cpu" path never
    calls it); on CUDA it is cuDNN's for a 16-bit cache with an eligible head dim."""
    bf16 = jnp.zeros((2, 16, 2, 64), jnp.bfloat16)
    assert jax.default_backend() == "cpu" and not kernels._on_cuda()
    assert kernels._decode_implementation(bf16) == "xla"
    assert kernels.resolve_kernels("auto") == "cpu"
    monkeypatch.setattr(kernels, "_on_cuda", lambda: True)
    assert kernels._decode_implementation(bf16) == "cudnn"
    assert kernels._decode_implementation(bf16.astype(jnp.float32)) == "xla"
    assert kernels._decode_implementation(jnp.zeros((2, 16, 2, 256), jnp.bfloat16)) == "xla"
    # the call the sampler's decode step makes on CUDA names cuDNN in its lowering
    q = jnp.zeros((2, 1, 4, 64), jnp.bfloat16)
    calls = []
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(
        jax.nn,
        "dot_product_attention",
        lambda *a, **kw: calls.append(kw) or real(*a, **{**kw, "implementation": "xla"}),
    )
    kernels.decode_attention(
        q, bf16[:, :1], bf16[:, :1], bf16, bf16, 3, jnp.ones((2, 16), bool), "portable"
    )
    assert calls[-1]["implementation"] == "cudnn"
    assert calls[-1]["key_value_seq_lengths"].tolist() == [4, 4]
