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


def _bisection_only(x_bv, top_p, path=None):
    """The top-p threshold as the sampler found it before: bisection for every row."""
    from jgrpo import draws

    probs_bv = jax.nn.softmax(x_bv, axis=-1)
    return draws._bisect_threshold(x_bv, draws._order_keys(x_bv), probs_bv, top_p)


def _logit_rows(rng, b, v):
    """Rows whose nuclei span 1 token to most of the vocabulary: peaked (Zipf-like, as a
    language model's), flat, and with ties at the top."""
    ranks = np.argsort(rng.rand(b, v), axis=-1) + 1
    slope = rng.choice([0.3, 1.0, 2.0, 4.0, 8.0], size=(b, 1))
    x = -slope * np.log(ranks) + 0.05 * rng.randn(b, v)
    x[rng.rand(b) < 0.2] = rng.randn(v) * 0.1  # flat rows
    tied = rng.rand(b) < 0.2
    x[tied] = np.round(x[tied], 1)  # ties, also among the 16 largest
    return x.astype(np.float32)


def test_nucleus_threshold_without_sort_is_the_bisection_exactly():
    """The portable path's top-16 + check + fallback threshold equals the bisection's for
    every row (bit for bit) over 8 batches of mixed rows, and each of its three branches runs
    (no row wrong, a few rows bisected, every row bisected); checked against a float64
    reference (the largest value whose mass reaches top_p)."""
    from jgrpo import draws

    threshold = jax.jit(draws._nucleus_threshold, static_argnums=2)
    reference = jax.jit(_bisection_only)
    rng = np.random.RandomState(0)
    branches = set()
    b, v = 16, 512
    for trial in range(8):
        x = _logit_rows(rng, b, v)
        if trial % 4 == 0:  # every row peaked: the top 16 hold every nucleus
            x = (-6.0 * np.log(np.argsort(rng.rand(b, v), -1) + 1)).astype(np.float32)
        top_p = np.float32(rng.choice([0.1, 0.5, 0.9, 0.95, 0.999]))
        for temperature in (0.7, 1.0, 1.5):
            scaled = jnp.asarray(x) / np.float32(temperature)
            got = np.asarray(threshold(scaled, top_p, "portable"))
            np.testing.assert_array_equal(got, np.asarray(reference(scaled, top_p)))
            # independent check: float64 sort, the largest value whose mass reaches top_p
            s = np.asarray(scaled, np.float64)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            for row in range(b):
                mass = np.array([p[row][s[row] >= t].sum() for t in got[row]])
                assert mass[0] >= top_p - 1e-6
                above = s[row][s[row] > got[row, 0]]
                if above.size:
                    assert p[row][s[row] >= above.min()].sum() < top_p + 1e-6
            # which branch ran: rows the top 16 cannot settle
            top16 = np.sort(s, -1)[:, ::-1][:, :16]
            wrong = (p[:, None] * (s[:, None] >= top16[:, :, None])).sum(-1).max(-1) < top_p
            branches.add(0 if not wrong.any() else (1 if wrong.sum() <= max(1, b // 8) else 2))
    assert branches == {0, 1, 2}


@pytest.mark.heavy  # the fast proof: test_nucleus_threshold_without_sort_is_the_bisection_exactly
def test_top_p_draws_the_tokens_of_the_bisection(monkeypatch):
    """The portable path's sample_token (top-16 threshold) draws exactly the tokens (and
    logprobs) it drew with the bisection for every row, for the same keys, over seeds,
    temperatures and top_p."""
    path = "portable"
    from jgrpo import draws

    rng = np.random.RandomState(1)
    x = jnp.asarray(_logit_rows(rng, 32, 1024))
    runs = []
    for impl in (draws._nucleus_threshold, _bisection_only):
        monkeypatch.setattr(draws, "_nucleus_threshold", impl)
        draw = jax.jit(draws.sample_token, static_argnames=("top_k", "nucleus", "path"))
        out = []
        for seed in range(2):
            keys = jax.random.split(jax.random.key(seed), 32)
            for temperature in (0.6, 1.0):
                for top_p in (0.3, 0.9, 0.99):
                    t, lp, flp = draw(
                        x, keys, np.float32(temperature), np.float32(top_p), None, True, path=path
                    )
                    out.append(np.stack([np.asarray(t, np.float32), lp, flp]))
        runs.append(np.stack(out))
    np.testing.assert_array_equal(runs[0], runs[1])


WEIGHT_WORK = {"convert_element_type", "transpose", "reshape", "concatenate", "slice", "copy"}


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


@pytest.mark.parametrize("path", ["cpu", "portable"])
def test_decode_loops_do_no_per_step_weight_work(path):
    """In the one-batch decode loops (every row, or compacting as rows stop), the while body
    uses the weights only as they enter it: no cast, transpose, reshape, slice or concat
    of an array of a weight's shape (layer_weights() and head_weights() are taken once per
    call, before the loop); the tied LM head's transpose among them (it was in the body)."""
    from flax import nnx

    from jgrpo import sampling
    from jgrpo.models import Transformer, TransformerConfig
    from jgrpo.models.tiny import tiny_model_fields

    fields = {**tiny_model_fields(width=64, vocab_size=256), "family": "qwen2"}
    fields |= {"attention_bias": True, "tie_word_embeddings": True, "kernels": path}
    cfg = TransformerConfig(**fields | {"dtype": "bfloat16", "param_dtype": "float32"})
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))  # shapes only
    shapes = {model.embed.value.shape}  # and each layer's weight matrices, as decode takes them
    layers = jax.eval_shape(lambda m: m.layer_weights(), model)
    shapes |= {w.shape for layer in layers for w in layer.values() if w.ndim >= 2}
    shapes |= {s[::-1] for s in shapes if len(s) == 2}
    ids, lengths = sampling.pad_prompts([[1, 2, 3], [4, 5], [6]], 8, 0)  # 3 rows: no clash
    # not the decode-slot loop: its body prefills refilled slots, and prefill casts each
    # stacked layer as it scans them (docs/performance.md, "Ready for the GPU")
    loops = {"one batch": {"compact_decode": False}, "compact": {"compact_decode": True}}
    for name, extra in loops.items():
        params = sampling.SamplingParams(max_new_tokens=8, top_p=0.9, prompt_bucket=8, **extra)
        spec = sampling.make_decode_spec(cfg, params)
        run = lambda m, ids, lengths, rows, spec=spec: sampling._generate_padded(
            m, ids, lengths, jax.random.key(0), 1.0, 0.9, rows, spec=spec
        )
        jaxpr = jax.make_jaxpr(run)(model, ids, lengths, np.arange(3, dtype=np.int32))
        bodies = [
            e.params["body_jaxpr"].jaxpr for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "while"
        ]
        assert bodies, name
        work = [
            (e.primitive.name, v.aval.shape)
            for body in bodies
            for e in _eqns(body)
            if e.primitive.name in WEIGHT_WORK
            for v in e.invars
            if hasattr(v, "aval") and getattr(v.aval, "shape", None) in shapes
        ]
        assert not work, (name, work)


def test_xla_gpu_flags_only_on_gpu_and_as_documented(monkeypatch):
    """The launcher's XLA flags: nothing changes on this CPU machine (nor where JAX_PLATFORMS
    names no GPU), on GPU the set docs/performance.md lists is added, and a flag the user set
    keeps the user's value."""
    import re
    from pathlib import Path

    from jgrpo import xla_flags

    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert not xla_flags.gpu_visible(env) and xla_flags.set_gpu_flags(env) == ()
    assert env == {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert not xla_flags.gpu_visible({"JAX_PLATFORMS": "cpu"})
    # a GPU process whose backend has not started yet
    monkeypatch.setattr(xla_flags, "_backend_started", lambda: False)
    env = {"XLA_FLAGS": "--xla_gpu_triton_gemm_any=false"}
    added = xla_flags.set_gpu_flags(env, gpu=True)
    assert added == ("--xla_gpu_enable_latency_hiding_scheduler=true",)
    assert env["XLA_FLAGS"].split() == ["--xla_gpu_triton_gemm_any=false", *added]
    env = {}
    assert xla_flags.set_gpu_flags(env, gpu=True) == xla_flags.GPU_FLAGS
    assert env["XLA_FLAGS"].split() == list(xla_flags.GPU_FLAGS)
    # docs/performance.md's GPU section lists exactly this set
    page = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    section = page.split("### XLA flags on GPU", 1)[1].split("\n#", 1)[0]
    assert set(re.findall(r"`(--xla_gpu_[a-z_]+=\w+)`", section)) == set(xla_flags.GPU_FLAGS)


@pytest.mark.heavy  # make test: test_xla_gpu_flags_only_on_gpu_and_as_documented
def test_xla_gpu_flags_exist_in_this_jaxlib():
    """XLA aborts on a flag it does not know: a process started with GPU_FLAGS runs (the flags
    are registered on every backend), so a jaxlib that renamed one fails here, not on a GPU."""
    import os
    import subprocess
    import sys

    from jgrpo import xla_flags

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(xla_flags.GPU_FLAGS)}
    code = "import jax, jax.numpy as jnp; print(int(jnp.ones(3).sum()))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "3", proc.stderr[-2000:]
