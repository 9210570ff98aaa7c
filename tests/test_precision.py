"""Precision, rematerialisation and the chunked logprob path: bfloat16 runs train, the chunked
LM head equals losses.token_logprobs of the full logits, remat changes no number."""

import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY_MODEL_FIELDS, make_rollout_batch
from flax import nnx

from jgrpo import losses, optimizer, sharding, step, step_setup, train
from jgrpo.config import ConfigError, MeshConfig, load_config
from jgrpo.metrics import read_metrics
from jgrpo.models import Transformer, TransformerConfig

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
QUIET = ["grpo.val_at_start=false", "grpo.val_at_end=false", "logging.tensorboard=false"]

MODEL = TransformerConfig(**TINY_MODEL_FIELDS)


def dtypes(tree) -> set[str]:
    return {str(x.dtype) for x in jax.tree.leaves(tree)}


def moments(opt_state) -> list:
    """The Adam mu/nu trees inside the optax chain's state."""
    found = []

    def visit(node):
        if hasattr(node, "mu") and hasattr(node, "nu"):
            found.extend([node.mu, node.nu])
        elif isinstance(node, tuple):
            for child in node:
                visit(child)

    visit(opt_state.inner_state)
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, param_dtype",
    [
        ("model.dtype=bfloat16", "bfloat16"),
        pytest.param("model.compute_dtype=bfloat16", "float32", marks=pytest.mark.heavy),
    ],
)
def test_tiny_config_trains_in_bfloat16(tmp_path, override, param_dtype):
    cfg = load_config(TINY, [*QUIET, override, "grpo.max_num_steps=3"])
    t = train.setup(cfg, tmp_path / "probe", resume=False)
    try:
        graph_cfg = t.backend.engine.model_cfg
        assert (graph_cfg.dtype, graph_cfg.param_dtype) == ("bfloat16", param_dtype)
        assert dtypes(t.state.params) == {param_dtype}  # master weights as configured
        mu_nu = moments(t.state.opt_state)
        assert len(mu_nu) == 2 and dtypes(mu_nu) == {"float32"}  # moments always float32
        assert dtypes(t.setup.ref_params or {}) <= {"bfloat16"}
    finally:
        t.backend.close()
        t.checkpointer.close()

    train.run(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["loss/total"] is not None and math.isfinite(r["loss/total"]), r
        assert r["train/skipped_updates"] == 0.0
        # a step whose groups all tie has zero advantages, hence a zero gradient: finite is the
        # claim here
        assert math.isfinite(r["train/grad_norm"])
        # the sampler's prefill + decode and the trainer's forward are different programs of
        # the same bf16 math, both compiled with kernels.COMPILER_OPTIONS (bf16 rounded as
        # written): their logprobs of the sampled tokens agree to float32 noise (1.0000117
        # measured; 1.011 on the test model when XLA may keep bf16 in float32 in fusions)
        assert 1.0 <= r["logprob/token_mult_prob_error"] < 1.001


@pytest.mark.heavy  # make test: the portable path's parity in test_model, test_sampling
def test_portable_kernels_train_the_tiny_config_on_cpu(tmp_path):
    """model.kernels=portable runs the GPU/TPU code path (jax.nn.dot_product_attention, the
    [b, s, k, h] cache, jax.random) on CPU, in the sampler and the trainer alike."""
    cfg = load_config(TINY, [*QUIET, "model.kernels=portable", "grpo.max_num_steps=2"])
    t = train.setup(cfg, tmp_path / "probe", resume=False)
    try:
        assert t.backend.engine.model_cfg.kernels == "portable"
    finally:
        t.backend.close()
        t.checkpointer.close()
    train.run(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss/total"]) and r["train/skipped_updates"] == 0.0
        assert 1.0 <= r["logprob/token_mult_prob_error"] < 1.001  # float32: the same numbers


def test_model_kernels_is_validated():
    with pytest.raises(ConfigError, match=r"model\.kernels: 'gpu' is not allowed"):
        load_config(TINY, ["model.kernels=gpu"])


def chunked_vs_reference(model, batch, temperature, chunk, first=1):
    """token_logprobs (chunks of `chunk` positions, scoring columns >= `first`) vs the full
    logits' losses.token_logprobs with the columns before `first` zeroed: (lp, grads) each."""
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    cfg = model.cfg.__class__(**{**vars(model.cfg), "logprob_chunk_size": chunk})
    scored_t = jnp.arange(ids.shape[1]) >= first
    tm = jnp.asarray(batch["token_mask"]) * scored_t

    def chunked(p):
        m = nnx.merge(nnx.graphdef(Transformer(cfg, rngs=nnx.Rngs(0))), p)
        lp = m.token_logprobs(ids, mask, temperature, first_scored=first)
        return jnp.sum(lp * tm), lp

    def reference(p):
        m = nnx.merge(graphdef, p)
        lp = losses.token_logprobs(m(ids, attention_mask_bt=mask), ids, temperature)
        lp = jnp.where(scored_t, lp, 0.0)
        return jnp.sum(lp * tm), lp

    (_, lp), g = jax.jit(jax.value_and_grad(chunked, has_aux=True))(params)
    (_, lp_ref), g_ref = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
    return (lp, g), (lp_ref, g_ref)


@pytest.mark.parametrize(
    "chunk, first",
    [pytest.param(*c, marks=pytest.mark.heavy) for c in [(1, 1), (4, 1), (5, 1), (14, 1), (0, 1)]]
    + [pytest.param(*c, marks=pytest.mark.heavy) for c in [(2, 13), (0, 14)]]
    + [(4, 5), (0, 5)],
)
def test_chunked_logprobs_match_the_full_logits_reference(chunk, first):
    """Any chunking, scoring every column (first 1) or only those from the completion's first
    column (5, as the trainer does), the last one (13) or none (14): the full-logits numbers."""
    model = Transformer(MODEL, rngs=nnx.Rngs(1), init_scale=0.3)
    batch = make_rollout_batch(3)  # T = 14: chunks of 4 and 5 leave a ragged last chunk
    (lp, g), (lp_ref, g_ref) = chunked_vs_reference(model, batch, 0.7, chunk, first)
    assert lp.dtype == jnp.float32 and lp.shape == batch["input_ids"].shape
    if first < 14:  # logprobs are O(1): the comparison means something
        assert float(jnp.abs(lp_ref).max()) > 1.0
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lp_ref), atol=2e-6, rtol=1e-6)
    assert np.all(np.asarray(lp)[:, :first] == 0.0)
    # the head gradient is summed chunk by chunk instead of in one dot: float32 rounding of
    # a different summation order, relative to the gradient's scale
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=2e-6 * float(np.abs(b).max()), rtol=1e-5)


@pytest.mark.parametrize(
    "chunk, tied",
    [
        (4, True),
        (0, False),
        *(pytest.param(*c, marks=pytest.mark.heavy) for c in [(4, False), (0, True)]),
    ],
)
def test_vocab_parallel_logprobs_match_the_full_logits_reference(tied, chunk):
    """The trainer's layout (fsdp=8: rows split, the head split over the vocab inside the
    chunks, `sharding.LogitShardings`) gives the unsharded full-logits numbers, value and
    gradient, and never gathers the head whole."""
    # vocab 128: a size no other dimension has (the HLO check below reads shapes)
    fields = {"tie_word_embeddings": tied, "logprob_chunk_size": chunk, "vocab_size": 128}
    cfg = TransformerConfig(**{**vars(MODEL), **fields})
    model = Transformer(cfg, rngs=nnx.Rngs(1), init_scale=0.3)
    mesh_cfg = MeshConfig(data=1, fsdp=8, tensor=1)
    mesh = sharding.make_mesh(mesh_cfg)
    shardings = sharding.param_shardings(nnx.state(model), mesh, sharding.make_rules(mesh_cfg))
    head = shardings["embed" if tied else "lm_head"]
    logits = sharding.logit_shardings(mesh, head, cfg.vocab_size)
    assert logits.head_vd is not None  # 128 divides 8: the vocab-parallel layout is in use
    graphdef = step_setup.constrained_graphdef(model, sharding.batch_sharding(mesh, 3), logits)
    params = nnx.to_pure_dict(nnx.state(model))
    batch = make_rollout_batch(3)  # 16 rows (2 per device), T = 14
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    tm = jnp.asarray(batch["token_mask"])

    def sharded(p):
        lp = nnx.merge(graphdef, p).token_logprobs(ids, mask, 0.7)
        return jnp.sum(lp * tm), lp

    # the reference runs the layers with the same rows per device, so only the head's layout
    # differs (dots of other shapes round differently in float32: not what is tested here)
    ref_graphdef = step_setup.constrained_graphdef(model, sharding.batch_sharding(mesh, 3), None)

    def reference(p):
        m = nnx.merge(ref_graphdef, p)
        lp = losses.token_logprobs(m(ids, attention_mask_bt=mask), ids, 0.7)
        return jnp.sum(lp * tm), lp

    # gradients pinned to their parameters' shardings, as the train step pins them
    rep = sharding.replicated(mesh)
    fn = jax.jit(jax.value_and_grad(sharded, has_aux=True), out_shardings=((rep, rep), shardings))
    on_mesh = sharding.shard_params(params, shardings)
    hlo = fn.lower(on_mesh).compile().as_text()
    (_, lp), g = fn(on_mesh)
    ref_fn = jax.jit(jax.value_and_grad(reference, has_aux=True), out_shardings=((rep, rep), rep))
    (_, lp_ref), g_ref = ref_fn(
        sharding.shard_params(params, jax.tree.map(lambda _: rep, shardings))
    )
    assert float(jnp.abs(lp_ref).max()) > 1.0
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lp_ref), atol=2e-6, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=2e-6 * float(np.abs(b).max()), rtol=1e-5)
    # per device the program holds 1/8 of the head, never all of it ([v, d] or [d, v])
    v, d = cfg.vocab_size, cfg.hidden_size
    assert f"[{v},{d}]" not in hlo and f"[{d},{v}]" not in hlo
    assert f"[{v // 8},{d}]" in hlo or f"[{d},{v // 8}]" in hlo


@pytest.mark.parametrize("remat", ["full", pytest.param("dots", marks=pytest.mark.heavy)])
def test_remat_changes_no_number(remat):
    batch = make_rollout_batch(2)
    results = {}
    for policy in ("none", remat):
        cfg = TransformerConfig(**{**vars(MODEL), "remat": policy})
        model = Transformer(cfg, rngs=nnx.Rngs(4), init_scale=0.3)
        graphdef, params = nnx.split(model)

        def loss(p, graphdef=graphdef):
            lp = nnx.merge(graphdef, p).token_logprobs(
                jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
            )
            return jnp.sum(lp * batch["token_mask"])

        fn = jax.jit(jax.value_and_grad(loss))
        results[policy] = fn(nnx.to_pure_dict(params))
        if policy != "none":  # the remat really is in the program
            assert "remat" in str(jax.make_jaxpr(jax.grad(loss))(nnx.to_pure_dict(params)))
    (v0, g0), (v1, g1) = results["none"], results[remat]
    assert float(v1) == pytest.approx(float(v0), rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g1, g0)


def test_bfloat16_compute_keeps_float32_master_weights_and_logprobs():
    cfg = TransformerConfig(**{**vars(MODEL), "dtype": "bfloat16"})
    model = Transformer(cfg, rngs=nnx.Rngs(0), init_scale=0.3)
    assert dtypes(nnx.to_pure_dict(nnx.state(model))) == {"float32"}
    batch = make_rollout_batch(0)
    lp = model.token_logprobs(jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]))
    assert lp.dtype == jnp.float32
    full = Transformer(MODEL, rngs=nnx.Rngs(0), init_scale=0.3)  # same init, float32 compute
    lp32 = full.token_logprobs(
        jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    )
    diff = np.abs(np.asarray(lp) - np.asarray(lp32)) * batch["token_mask"]
    assert 0 < diff.max() < 0.25  # bfloat16 rounding: different, but close


def test_schedule_values_by_hand():
    """Warmup from 1/w to 1 over w updates (or from optim.warmup_start_ratio), then decay to 0
    at total_updates (hand values; optax's own schedule for the warmup from 0)."""
    base = load_config(None, ["grpo.max_num_steps=10", "optim.warmup_steps=4"])
    for schedule, expected in {
        "constant": [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        "linear": [0.25, 0.5, 0.75, 1.0, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0],
        "cosine": [0.25, 0.5, 0.75, 1.0]
        + [0.5 * (1 + math.cos(math.pi * i / 6)) for i in range(7)],
    }.items():
        flags = step.StepFlags.from_config(
            base.replace(optim=base.optim.__class__(**{**vars(base.optim), "schedule": schedule}))
        )
        multiplier = optimizer.make_schedule(
            flags.schedule, flags.warmup_steps, flags.total_updates
        )
        values = [float(multiplier(i)) for i in range(11)]
        np.testing.assert_allclose(values, expected, atol=1e-6, err_msg=schedule)
        # a warmup from s (optim.warmup_start_ratio): s + (1 - s) k / 4, at the peak from k = 4
        for start, warm in {0.0: [0.0, 0.25, 0.5, 0.75], 0.2: [0.2, 0.4, 0.6, 0.8]}.items():
            multiplier = optimizer.make_schedule(
                flags.schedule, flags.warmup_steps, flags.total_updates, 0.0, start
            )
            values = [float(multiplier(i)) for i in range(11)]
            np.testing.assert_allclose(values, warm + expected[4:], atol=1e-6, err_msg=schedule)
    # from 0 it is optax's own warmup_cosine_decay_schedule (the demos' warm starts, min ratio 0.1)
    optax_schedule = optax.warmup_cosine_decay_schedule(0.0, 1.0, 4, 10, end_value=0.1)
    ours = optimizer.make_schedule("cosine", 4, 10, 0.1, 0.0)
    np.testing.assert_allclose([ours(i) for i in range(12)], [optax_schedule(i) for i in range(12)])
    for bad in (
        ["optim.warmup_start_ratio=0.5"],
        ["optim.warmup_steps=4", "optim.warmup_start_ratio=2"],
    ):
        with pytest.raises(
            ConfigError, match=r"^optim.warmup_start_ratio: must lie in \[0, 1\] with"
        ):
            load_config(None, bad)


@pytest.mark.parametrize("remat", [pytest.param("none", marks=pytest.mark.heavy), "full"])
def test_pure_bfloat16_layer_stack_is_sliced_as_stored_and_keeps_its_gradients(remat):
    """bfloat16 parameters reach the layer loop as their integer view (`kernels.from_bits`): no
    float32 copy of a stacked weight in the compiled program, and the gradients are those of
    the same values held in float32 and cast to bfloat16 in the loop (float32 master weights,
    bfloat16 compute: the same forward), up to bfloat16 rounding of the gradient itself. With
    remat, each layer's bfloat16 input (the residual the backward slices, for either parameter
    dtype) is stacked as its uint16 view, never as a float32 stack."""
    batch = make_rollout_batch(1)
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    grads = {}
    for param_dtype in ("bfloat16", "float32"):
        cfg = TransformerConfig(
            **{**vars(MODEL), "dtype": "bfloat16", "param_dtype": param_dtype, "remat": remat}
        )
        model = Transformer(cfg, rngs=nnx.Rngs(2), init_scale=0.3)
        graphdef, params = nnx.split(model)
        params = nnx.to_pure_dict(params)
        if param_dtype == "float32":  # exactly the bfloat16 run's values
            params = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)

        def loss(p, graphdef=graphdef):
            lp = nnx.merge(graphdef, p).token_logprobs(ids, mask)
            return jnp.sum(lp * batch["token_mask"])

        fn = jax.jit(jax.grad(loss))
        grads[param_dtype] = fn(params)
        hlo = fn.lower(params).compile().as_text()
        if remat != "none":  # every layer's input [l, b, t, d], as the backward reads it
            stack = f"[{cfg.num_layers},{ids.shape[0]},{ids.shape[1]},{cfg.hidden_size}]"
            assert f"u16{stack}" in hlo and f"f32{stack}" not in hlo
        if param_dtype == "bfloat16":  # no stacked layer weight converted whole to float32
            entry = hlo[hlo.index("\nENTRY") :]
            inputs = set(re.findall(r"%(\S*layers\S*) = bf16\[[\d,]*\]\S* parameter\(", entry))
            assert len(inputs) == len(params["layers"])
            upcasts = re.findall(r"= f32\[[\d,]*\]\S* (?:convert|fusion)\(%([^,)\s]+)\)", entry)
            assert not inputs & set(upcasts)
    for name in grads["float32"]["layers"]:
        g16 = np.asarray(grads["bfloat16"]["layers"][name], np.float32)
        g32 = np.asarray(grads["float32"]["layers"][name])
        assert np.abs(g16).max() > 0, name  # the gradient reaches the bfloat16 weights
        np.testing.assert_allclose(g16, g32, rtol=0.02, atol=0.02 * np.abs(g32).max())
