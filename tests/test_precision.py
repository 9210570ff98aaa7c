"""Precision, rematerialisation and the chunked logprob path: bfloat16 runs train, the chunked
LM head equals losses.token_logprobs of the full logits, remat changes no number."""

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL_FIELDS, make_rollout_batch
from flax import nnx

from jgrpo import losses, step, train
from jgrpo.config import load_config
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
    [("model.dtype=bfloat16", "bfloat16"), ("model.compute_dtype=bfloat16", "float32")],
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
        assert r["loss"] is not None and math.isfinite(r["loss"]), r
        assert r["train/skipped_updates"] == 0.0
        # a step whose groups all tie has zero advantages, hence a zero gradient: finite is the
        # claim here
        assert math.isfinite(r["train/grad_norm"])


def chunked_vs_reference(model, batch, temperature, chunk):
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    cfg = model.cfg.__class__(**{**vars(model.cfg), "logprob_chunk_size": chunk})
    tm = jnp.asarray(batch["token_mask"])

    def chunked(p):
        m = nnx.merge(nnx.graphdef(Transformer(cfg, rngs=nnx.Rngs(0))), p)
        lp = m.token_logprobs(ids, mask, temperature)
        return jnp.sum(lp * tm), lp

    def reference(p):
        m = nnx.merge(graphdef, p)
        lp = losses.token_logprobs(m(ids, attention_mask_bt=mask), ids, temperature)
        return jnp.sum(lp * tm), lp

    (_, lp), g = jax.jit(jax.value_and_grad(chunked, has_aux=True))(params)
    (_, lp_ref), g_ref = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
    return (lp, g), (lp_ref, g_ref)


@pytest.mark.parametrize("chunk", [1, 4, 5, 14, 0])
def test_chunked_logprobs_match_the_full_logits_reference(chunk):
    model = Transformer(MODEL, rngs=nnx.Rngs(1), init_scale=0.3)
    batch = make_rollout_batch(3)  # T = 14: chunks of 4 and 5 leave a ragged last chunk
    (lp, g), (lp_ref, g_ref) = chunked_vs_reference(model, batch, 0.7, chunk)
    assert lp.dtype == jnp.float32 and lp.shape == batch["input_ids"].shape
    assert float(jnp.abs(lp_ref).max()) > 1.0  # logprobs are O(1): the comparison means something
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lp_ref), atol=2e-6, rtol=1e-6)
    assert np.all(np.asarray(lp)[:, 0] == 0.0)
    # the head gradient is summed chunk by chunk instead of in one dot: float32 rounding of
    # a different summation order, relative to the gradient's scale
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=2e-6 * float(np.abs(b).max()), rtol=1e-5)


@pytest.mark.parametrize("remat", ["full", "dots"])
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
    """Warmup from 1/w to 1 over w updates, then decay to 0 at total_updates (hand values)."""
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
        values = [float(step.make_schedule(flags)(i)) for i in range(11)]
        np.testing.assert_allclose(values, expected, atol=1e-6, err_msg=schedule)
