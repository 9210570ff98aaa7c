"""The MoE decoder (Qwen3-MoE, GLM-4.5 MoE) vs transformers' PyTorch forward (float32, 1e-4
max abs), HF folders in and out, the routing pieces against plain NumPy, router replay, the
sampler's prefill + decode against the full forward."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import make_random_hf_model, with_kernels

from jgrpo.models import ModelFormatError, from_pretrained, save_pretrained
from jgrpo.models import moe as moe_lib

TOL = 1e-4
BASE = dict(
    hidden_size=64,
    num_attention_heads=4,
    head_dim=16,
    intermediate_size=96,
    moe_intermediate_size=32,
    vocab_size=128,
    max_position_embeddings=256,
)
CASES = {
    # dense layer 1 between MoE layers, renormalised top-k
    "qwen3_moe_mlp_only": (
        "qwen3_moe",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    # every second layer sparse, raw softmax gates, top-1, MQA, tied embeddings
    "qwen3_moe_sparse_step": (
        "qwen3_moe",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=1,
            num_experts=4,
            num_experts_per_tok=1,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
        ),
    ),
    # sigmoid + bias + 2 of 4 groups + scaling + 2 shared experts, one dense layer first,
    # half-rotary heads, qkv biases and qk norm
    "glm4_moe_groups": (
        "glm4_moe",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            attention_bias=True,
            use_qk_norm=True,
        ),
    ),
    # one group, no dense layer, unnormalised gates, a quarter of head_dim rotary
    "glm4_moe_plain": (
        "glm4_moe",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=0,
            norm_topk_prob=False,
            partial_rotary_factor=0.25,
        ),
    ),
}
CONFIG_CLASSES = {"qwen3_moe": transformers.Qwen3MoeConfig, "glm4_moe": transformers.Glm4MoeConfig}


def make_hf_model(family, extra, seed=0):
    """A random HF MoE model with O(1) logits and (GLM) a nonzero selection bias."""
    extra = dict(extra)
    if "partial_rotary_factor" in extra:
        factor = extra.pop("partial_rotary_factor")
        extra["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0)
        extra["rope_parameters"]["partial_rotary_factor"] = factor
    cfg = CONFIG_CLASSES[family](**BASE, **extra, attn_implementation="eager")
    model = make_random_hf_model(cfg, seed)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def hf_pair(request, tmp_path_factory):
    family, extra = CASES[request.param]
    hf_model = make_hf_model(family, extra)
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder)
    return request.param, hf_model, folder


def hf_logits(model, ids, mask=None, positions=None):
    kwargs = {}
    if mask is not None:
        kwargs["attention_mask"] = torch.tensor(mask)
    if positions is not None:
        kwargs["position_ids"] = torch.tensor(positions)
    with torch.no_grad():
        return model(torch.tensor(ids), **kwargs).logits.numpy()


@pytest.mark.parametrize("kernels", ["cpu", pytest.param("portable", marks=pytest.mark.heavy)])
def test_logits_match_transformers(hf_pair, kernels):
    """Both kernel paths (cpu: dense experts; portable: sorted tokens + ragged_dot)."""
    _, hf_model, folder = hf_pair
    model = with_kernels(from_pretrained(folder), kernels)
    ids = np.random.RandomState(1).randint(0, 128, (3, 12))
    ref = hf_logits(hf_model, ids)
    out = np.asarray(model(jnp.asarray(ids)))
    assert np.abs(ref).max() > 0.5, "logits must be O(1) for the comparison to mean anything"
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)


def test_padded_batch_matches_transformers(hf_pair):
    _, hf_model, folder = hf_pair
    model = from_pretrained(folder)
    ids = np.random.RandomState(2).randint(0, 128, (3, 10))
    mask = np.ones((3, 10), np.int64)
    mask[0, :4] = 0
    mask[1, 7:] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ref = hf_logits(hf_model, ids, mask, positions)
    out = np.asarray(model(jnp.asarray(ids), attention_mask_bt=jnp.asarray(mask)))
    valid = mask.astype(bool)
    np.testing.assert_allclose(out[valid], ref[valid], atol=TOL, rtol=0)


def test_each_routing_feature_changes_the_logits(tmp_path):
    """The parity above is not vacuous: turning off any one GLM routing feature (groups, the
    selection bias, scaling, shared experts) moves the logits far past the tolerance."""
    family, extra = CASES["glm4_moe_groups"]
    hf_model = make_hf_model(family, extra)
    hf_model.save_pretrained(tmp_path)
    ids = jnp.asarray(np.random.RandomState(1).randint(0, 128, (3, 12)))
    base = from_pretrained(tmp_path)
    ref = np.asarray(base(ids))
    spec = base.cfg.moe
    import dataclasses

    from flax import nnx

    variants = {
        "all groups": dict(topk_groups=spec.num_groups),
        "scaling 1": dict(routed_scaling=1.0),
        "no shared": dict(shared_size=0),
    }
    for name, change in variants.items():
        other = nnx.merge(*nnx.split(base))
        other.cfg = dataclasses.replace(base.cfg, moe=dataclasses.replace(spec, **change))
        assert np.abs(np.asarray(other(ids)) - ref).max() > 1e-2, name
    other = nnx.merge(*nnx.split(base))
    other.moe["router_bias"][...] = jnp.zeros_like(other.moe["router_bias"][...])
    assert np.abs(np.asarray(other(ids)) - ref).max() > 1e-2, "no bias"


def test_save_pretrained_roundtrip(hf_pair, tmp_path):
    name, hf_model, folder = hf_pair
    model = from_pretrained(folder)
    out = save_pretrained(model, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == CASES[name][0]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    ids = np.random.RandomState(4).randint(0, 128, (2, 9))
    np.testing.assert_allclose(hf_logits(reloaded, ids), hf_logits(hf_model, ids), atol=TOL)
    again = from_pretrained(out)
    from flax import nnx

    for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(again, nnx.Param))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fused_expert_layout_loads(hf_pair, tmp_path):
    """transformers 5's in-memory layout (gate_up_proj [e, 2f, d]) loads like the per-expert
    one (save_original_format=False writes it)."""
    _, hf_model, folder = hf_pair
    hf_model.save_pretrained(tmp_path, save_original_format=False)
    from jgrpo.models.hf import read_hf_weights

    assert any(n.endswith("experts.gate_up_proj") for n in read_hf_weights(tmp_path))
    ids = jnp.asarray(np.random.RandomState(5).randint(0, 128, (2, 7)))
    a, b = from_pretrained(folder)(ids), from_pretrained(tmp_path)(ids)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kernels", ["cpu", pytest.param("portable", marks=pytest.mark.heavy)])
def test_cached_decode_matches_full_forward(hf_pair, kernels):
    """Prefill a left-padded prompt, then decode token by token: the logits of one forward,
    and the decode step's expert ids are the forward's routing of those tokens."""
    _, _, folder = hf_pair
    model = with_kernels(from_pretrained(folder), kernels)
    rng = np.random.RandomState(3)
    prompt_len, total = 5, 9
    ids = rng.randint(0, 128, (2, total))
    mask = np.ones((2, total), bool)
    mask[0, :2] = False
    full = np.asarray(model(jnp.asarray(ids), attention_mask_bt=jnp.asarray(mask)))
    _, routed = model.token_logprobs_routed(jnp.asarray(ids), jnp.asarray(mask))
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    kv_mask = jnp.asarray(mask)
    logits, cache = model.prefill(
        jnp.asarray(ids[:, :prompt_len]),
        jnp.asarray(positions[:, :prompt_len]),
        kv_mask[:, :prompt_len],
        total,
    )
    np.testing.assert_allclose(logits, full[:, prompt_len - 1], atol=1e-5, rtol=0)
    layers = model.layer_weights()
    step = jax.jit(model.decode_step_routed)
    for t in range(prompt_len, total):
        logits, cache, ids_lbk = step(
            layers, jnp.asarray(ids[:, t]), jnp.asarray(positions[:, t]), kv_mask, cache, t
        )
        np.testing.assert_allclose(np.asarray(logits), full[:, t], atol=1e-5, rtol=0)
        np.testing.assert_array_equal(np.asarray(ids_lbk), np.asarray(routed.expert_ids[:, :, t]))


# ----------------------------------------------------------------------------- the block


def numpy_route(x_td, w_de, bias_e, spec):
    """The router of transformers' Qwen3MoeTopKRouter / Glm4MoeTopkRouter in float64 NumPy."""
    logits = x_td.astype(np.float64) @ w_de.astype(np.float64)
    if spec.router == "softmax":
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        ids = np.argsort(-p, axis=-1, kind="stable")[:, : spec.top_k]
        g = np.take_along_axis(p, ids, -1)
        return ids, g / g.sum(-1, keepdims=True) if spec.norm_topk_prob else g
    s = 1 / (1 + np.exp(-logits))
    choice = s + bias_e
    t, e = s.shape
    groups = np.sort(choice.reshape(t, spec.num_groups, -1), -1)[..., -2:].sum(-1)
    kept = np.argsort(-groups, -1, kind="stable")[:, : spec.topk_groups]
    masked = np.full_like(choice, -np.inf)
    for i in range(t):
        for grp in kept[i]:
            sl = slice(grp * (e // spec.num_groups), (grp + 1) * (e // spec.num_groups))
            masked[i, sl] = choice[i, sl]
    ids = np.argsort(-masked, axis=-1, kind="stable")[:, : spec.top_k]
    g = np.take_along_axis(s, ids, -1)
    if spec.norm_topk_prob:
        g = g / (g.sum(-1, keepdims=True) + 1e-20)
    return ids, g * spec.routed_scaling


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_route_matches_numpy(router):
    rng = np.random.RandomState(0)
    spec = moe_lib.MoESpec(
        num_experts=8,
        top_k=3,
        expert_size=4,
        router=router,
        num_groups=4 if router == "sigmoid" else 1,
        topk_groups=2 if router == "sigmoid" else 1,
        routed_scaling=2.0 if router == "sigmoid" else 1.0,
    )
    x, w, bias = rng.randn(20, 16), rng.randn(16, 8) * 0.5, rng.randn(8) * 0.3
    ids_ref, gates_ref = numpy_route(x, w, bias, spec)
    r = moe_lib.route(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), bias, spec)
    np.testing.assert_array_equal(np.sort(np.asarray(r.expert_ids_tk), -1), np.sort(ids_ref, -1))
    order = np.argsort(np.asarray(r.expert_ids_tk), -1)
    got = np.take_along_axis(np.asarray(r.gates_tk), order, -1)
    want = np.take_along_axis(gates_ref, np.argsort(ids_ref, -1), -1)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_grouped_and_dense_experts_agree_with_a_loop():
    """Both expert paths vs a per-token loop over the chosen experts (float64 NumPy),
    gradients of both paths equal."""
    rng = np.random.RandomState(1)
    t, d, f, e, k = 12, 8, 6, 5, 2
    x = rng.randn(t, d)
    gate, up, down = rng.randn(e, d, f) * 0.4, rng.randn(e, d, f) * 0.4, rng.randn(e, f, d) * 0.4
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
    gates = rng.rand(t, k)
    silu = lambda z: z / (1 + np.exp(-z))
    ref = np.zeros((t, d))
    for i in range(t):
        for j in range(k):
            ex = ids[i, j]
            ref[i] += gates[i, j] * ((silu(x[i] @ gate[ex]) * (x[i] @ up[ex])) @ down[ex])
    args = [jnp.asarray(a, jnp.float32) for a in (x, ids, gates, gate, up, down)]
    args[1] = args[1].astype(jnp.int32)
    for fn in (moe_lib.experts_grouped, moe_lib.experts_dense):
        np.testing.assert_allclose(np.asarray(fn(*args)), ref, atol=1e-4)
    grads = [
        jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) ** 2), argnums=(0, 2, 3, 5))(*args)
        for fn in (moe_lib.experts_grouped, moe_lib.experts_dense)
    ]
    for a, b in zip(*grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


def test_dense_experts_hold_no_per_expert_output():
    """The dense path's forward and gradient never hold a [t, e, d] array (each expert's output
    before mixing): their compiled temporaries stay below one of them, with d >> f."""
    t, d, f, e, k = 256, 512, 8, 16, 2
    x = jnp.ones((t, d))
    ids = jnp.tile(jnp.arange(k, dtype=jnp.int32), (t, 1))
    gates = jnp.full((t, k), 0.5)
    w_in, w_out = jnp.ones((e, d, f)), jnp.ones((e, f, d))
    loss = lambda *a: jnp.sum(moe_lib.experts_dense(*a) ** 2)  # noqa: E731
    grad = jax.jit(jax.grad(loss, argnums=(0, 3, 4, 5)))
    memory = grad.lower(x, ids, gates, w_in, w_in, w_out).compile().memory_analysis()
    assert memory.temp_size_in_bytes < t * e * d * 4


def test_router_replay_keeps_gates_differentiable():
    """Replaying the router's own choice gives the same output; replaying another choice
    uses those experts; either way the router weight gets a gradient."""
    rng = np.random.RandomState(2)
    spec = moe_lib.MoESpec(num_experts=4, top_k=2, expert_size=4, sparse_layers=(True,))
    p = {
        "router": jnp.asarray(rng.randn(8, 4), jnp.float32),
        "expert_gate": jnp.asarray(rng.randn(4, 8, 4), jnp.float32),
        "expert_up": jnp.asarray(rng.randn(4, 8, 4), jnp.float32),
        "expert_down": jnp.asarray(rng.randn(4, 4, 8), jnp.float32),
    }
    x = jnp.asarray(rng.randn(1, 6, 8), jnp.float32)
    y, routing = moe_lib.moe_mlp(p, x, spec, "cpu")
    ids = routing.expert_ids_tk.reshape(1, 6, 2)
    y_replay, _ = moe_lib.moe_mlp(p, x, spec, "cpu", ids)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_replay))
    other = (ids + 1) % 4
    _, r_other = moe_lib.moe_mlp(p, x, spec, "cpu", other)
    np.testing.assert_array_equal(np.asarray(r_other.expert_ids_tk), np.asarray(other[0]))

    def loss(router):
        return jnp.sum(moe_lib.moe_mlp({**p, "router": router}, x, spec, "cpu", other)[0] ** 2)

    assert np.abs(np.asarray(jax.grad(loss)(p["router"]))).max() > 1e-3


def test_aux_loss_matches_transformers():
    """`aux_losses`' balance term is transformers' load_balancing_loss_func (masked)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.RandomState(3)
    layers, t = 3, 10
    mask = (rng.rand(t) > 0.3).astype(np.int64)
    logits = [rng.randn(t, 6).astype(np.float32) for _ in range(layers)]
    stats = []
    for lg in logits:
        probs = jax.nn.softmax(jnp.asarray(lg), -1)
        _, ids = jax.lax.top_k(probs, 2)
        routing = moe_lib.Routing(ids, ids.astype(jnp.float32), probs, jnp.asarray(lg))
        s = moe_lib.router_stats(routing, jnp.asarray(mask), 6)
        stats.append(moe_lib.RouterStats(*(jnp.asarray(v)[None] for v in s)))
    aux, z = moe_lib.aux_losses(moe_lib.stack_stats(stats), 6)
    ref = load_balancing_loss_func(
        tuple(torch.tensor(lg) for lg in logits), 6, 2, torch.tensor(mask[None])
    )
    np.testing.assert_allclose(float(aux), float(ref), rtol=1e-5)
    lse = np.log(np.exp(np.stack(logits)).sum(-1)) ** 2
    np.testing.assert_allclose(float(z), (lse * mask).sum() / (layers * mask.sum()), rtol=1e-5)


def test_unsupported_moe_variants_name_the_key(tmp_path):
    from jgrpo.models.hf import config_from_hf

    family, extra = CASES["glm4_moe_groups"]
    hf = make_hf_model(family, extra).config.to_dict()
    for change, words in [
        ({"topk_group": 5}, "topk_group"),
        ({"n_group": 3}, "n_group"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ]:
        with pytest.raises(ModelFormatError, match=words):
            config_from_hf({**hf, **change})
    qwen = make_hf_model(*CASES["qwen3_moe_mlp_only"]).config.to_dict()
    with pytest.raises(ModelFormatError, match="attention_bias"):
        config_from_hf({**qwen, "attention_bias": True})


# ----------------------------------------------------------------------------- training


@pytest.mark.heavy  # two short runs of configs/tiny.yaml on builtin:tiny-qwen3-moe
@pytest.mark.parametrize("lora", [False, True])
def test_train_on_tiny_qwen3_moe(tmp_path, monkeypatch, lora):
    """`jgrpo train` on builtin:tiny-qwen3-moe (full or LoRA on attention): the sampler's
    logprobs are the trainer's (float32), gradients flow, the router terms and moe/ metrics
    are logged, and final/ loads in transformers with our logits."""
    from pathlib import Path

    from jgrpo import train
    from jgrpo.config import load_config
    from jgrpo.metrics import read_metrics

    (tmp_path / "length_reward.py").write_text(
        "def length(prompts, completions, **columns):\n"
        "    return [float(len(c) % 3) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    overrides = [
        "model.path=builtin:tiny-qwen3-moe",
        "grpo.max_num_steps=2",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "logging.tensorboard=false",
        "data.task_reward_weight=0.0",
        "data.reward_functions=[{function: 'length_reward:length'}]",
        "model.moe.router_z_loss_coef=0.01",
    ]
    if lora:
        overrides += ["model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj,o_proj]"]
    train.run(load_config(tiny, overrides), tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["logprob/token_mult_prob_error"] <= 1.001
        assert r["train/grad_norm"] > 1e-4
        assert 0 < r["moe/aux_loss"] and r["moe/router_entropy"] > 0
        assert r["moe/tokens_per_expert_max"] >= r["moe/tokens_per_expert_mean"] > 0
        assert r["moe/router_loss"] > 0
    final = tmp_path / "run" / "final"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(final, attn_implementation="eager")
    ids = np.random.RandomState(6).randint(0, 200, (2, 9))
    np.testing.assert_allclose(
        np.asarray(from_pretrained(final)(jnp.asarray(ids))), hf_logits(hf_model, ids), atol=TOL
    )
