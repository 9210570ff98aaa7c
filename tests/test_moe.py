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


def cases(*quick):
    """Every case, those not in `quick` marked heavy (make test runs the quick ones)."""
    return [c if c in quick else pytest.param(c, marks=pytest.mark.heavy) for c in CASES]


@pytest.fixture(scope="module")
def hf_pair(request, tmp_path_factory):
    family, extra = CASES[request.param]
    hf_model = make_hf_model(family, extra)
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder)
    return request.param, hf_model, folder


def params_of(model) -> list[np.ndarray]:
    """Every parameter of `model` as numpy, in a fixed order."""
    from flax import nnx

    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def hf_logits(model, ids, mask=None, positions=None):
    kwargs = {}
    if mask is not None:
        kwargs["attention_mask"] = torch.tensor(mask)
    if positions is not None:
        kwargs["position_ids"] = torch.tensor(positions)
    with torch.no_grad():
        return model(torch.tensor(ids), **kwargs).logits.numpy()


@pytest.mark.parametrize("hf_pair", list(CASES), indirect=True)
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


@pytest.mark.parametrize("hf_pair", cases("glm4_moe_plain"), indirect=True)
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


@pytest.mark.parametrize("hf_pair", list(CASES), indirect=True)
def test_save_pretrained_roundtrip(hf_pair, tmp_path):
    name, hf_model, folder = hf_pair
    model = from_pretrained(folder)
    out = save_pretrained(model, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == CASES[name][0]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    ids = np.random.RandomState(4).randint(0, 128, (2, 9))
    np.testing.assert_allclose(hf_logits(reloaded, ids), hf_logits(hf_model, ids), atol=TOL)
    for a, b in zip(params_of(model), params_of(from_pretrained(out))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("hf_pair", cases("qwen3_moe_sparse_step"), indirect=True)
def test_fused_expert_layout_loads(hf_pair, tmp_path):
    """transformers 5's in-memory layout (gate_up_proj [e, 2f, d]) passes the pre-flight and
    loads like the per-expert one (save_original_format=False writes it)."""
    _, hf_model, folder = hf_pair
    hf_model.save_pretrained(tmp_path, save_original_format=False)
    from jgrpo.models.hf import read_hf_weights
    from jgrpo.models.preflight import check_hf_folder
    from jgrpo.models.tiny import save_char_tokenizer

    save_char_tokenizer(tmp_path)
    check_hf_folder(tmp_path)

    assert any(n.endswith("experts.gate_up_proj") for n in read_hf_weights(tmp_path))
    for a, b in zip(params_of(from_pretrained(folder)), params_of(from_pretrained(tmp_path))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("hf_pair", cases("glm4_moe_groups"), indirect=True)
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
    logits, cache, prompt_ids = model.prefill_routed(
        jnp.asarray(ids[:, :prompt_len]),
        jnp.asarray(positions[:, :prompt_len]),
        kv_mask[:, :prompt_len],
        total,
    )
    np.testing.assert_allclose(logits, full[:, prompt_len - 1], atol=1e-5, rtol=0)
    real = mask[:, :prompt_len]  # padded positions route whatever their zero rows give
    np.testing.assert_array_equal(
        np.asarray(prompt_ids)[:, real], np.asarray(routed.expert_ids[:, :, :prompt_len])[:, real]
    )
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
    np.testing.assert_array_equal(np.asarray(r_other.expert_ids_tk), np.asarray(other))

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


def test_preflight_checks_moe_folders(tmp_path):
    """The pre-flight knows the MoE tensors (a missing expert is named) and refuses an
    unsupported variant with one ConfigError line (the CLI's exit 2)."""
    from jgrpo.config import ConfigError
    from jgrpo.models.preflight import check_hf_folder, hf_tensor_shapes
    from jgrpo.models.tiny import build_tiny_moe_model, tiny_qwen3_moe_config

    folder = build_tiny_moe_model(tmp_path / "tiny")
    hf = check_hf_folder(folder)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in hf_tensor_shapes(hf)
    bad = {**tiny_qwen3_moe_config(), "num_experts_per_tok": 9}
    with pytest.raises(ConfigError, match="num_experts_per_tok 9"):
        hf_tensor_shapes(bad)
    glm = make_hf_model(*CASES["glm4_moe_groups"]).config.to_dict()
    with pytest.raises(ConfigError, match="topk_group"):
        hf_tensor_shapes({**glm, "topk_group": 7})


def test_lora_on_moe_is_attention_only():
    from jgrpo.config import ConfigError, LoRAConfig
    from jgrpo.models import lora
    from jgrpo.models.hf import config_from_hf
    from jgrpo.models.tiny import tiny_qwen3_moe_config

    cfg = config_from_hf(tiny_qwen3_moe_config())
    attn = LoRAConfig(rank=4, target_modules=("q_proj", "o_proj"))
    assert lora.with_lora(cfg, attn).lora.targets == ("q", "o")
    with pytest.raises(ConfigError, match="gate_proj"):
        lora.with_lora(cfg, LoRAConfig(rank=4))


@pytest.mark.parametrize(
    "source, mode",
    [
        ("tiny-qwen3-moe", "batch"),
        pytest.param("tiny-qwen3-moe", "slots", marks=pytest.mark.heavy),
        pytest.param("tiny-qwen3-moe", "compact", marks=pytest.mark.heavy),
        pytest.param("glm4_moe_groups", "batch", marks=pytest.mark.heavy),
        pytest.param("glm4_moe_groups", "slots", marks=pytest.mark.heavy),
    ],
)
def test_sampler_logprobs_are_the_trainer_forward(tmp_path, source, mode):
    """generate() on builtin:tiny-qwen3-moe and a random GLM (every row at once, decode slots,
    the compacting loop): float32 generation logprobs = the trainer's forward
    (token_mult_prob_error <= 1.001, 1e-4 per token)."""
    from jgrpo.models.tiny import build_tiny_moe_model
    from jgrpo.sampling import SamplingParams, generate

    if source == "tiny-qwen3-moe":
        model = from_pretrained(build_tiny_moe_model(tmp_path / "tiny"))
    else:
        make_hf_model(*CASES[source]).save_pretrained(tmp_path / "glm")
        model = from_pretrained(tmp_path / "glm")
    rng = np.random.RandomState(8)
    prompts = [list(rng.randint(4, 100, n)) for n in (5, 9, 3, 7, 1)]
    slots = dict(batch={}, slots=dict(decode_slots=2))
    slots["compact"] = dict(compact_decode=True)
    stops = tuple(range(100, 140))  # rows end at different lengths: slots refill, rows compact
    params = SamplingParams(max_new_tokens=10, prompt_bucket=8, stop_token_ids=stops, **slots[mode])
    gen = generate(model, prompts, params, jax.random.key(3))
    assert len(set(gen.lengths.tolist())) > 2
    p, n = gen.prompt_tokens.shape[1], gen.tokens.shape[1]
    prompt_mask = np.arange(p)[None] >= p - gen.prompt_lengths[:, None]
    completion_mask = np.arange(n)[None] < gen.lengths[:, None]
    ids = np.concatenate([gen.prompt_tokens, gen.tokens], axis=1)
    mask = np.concatenate([prompt_mask, completion_mask], axis=1)
    lp = np.asarray(model.token_logprobs(jnp.asarray(ids), jnp.asarray(mask)))[:, p:]
    err = float(np.mean(np.exp(np.abs(gen.logprobs - lp)[completion_mask])))
    assert err <= 1.001, err
    np.testing.assert_allclose(gen.logprobs[completion_mask], lp[completion_mask], atol=1e-4)


def test_router_losses_join_the_policy_loss():
    """moe_lib.add_router_losses: dense forwards pass through; an MoE forward adds
    (aux_coef x balance + z_coef x z) / M to the loss and loss/total, the HF coefficient when
    no override, and the moe/ metrics (means divided by M, maxima kept)."""
    from jgrpo.models.moe_transformer import MoEOutput

    rng = np.random.RandomState(4)
    logits = jnp.asarray(rng.randn(10, 4), jnp.float32)
    probs = jax.nn.softmax(logits, -1)
    ids = jax.lax.top_k(probs, 2)[1]
    routing = moe_lib.Routing(ids, jnp.ones((10, 2)), probs, logits)
    stats = moe_lib.router_stats(routing, jnp.ones(10), 4)
    routed = MoEOutput(ids[None], moe_lib.RouterStats(*(v[None] for v in stats)))
    spec = moe_lib.MoESpec(num_experts=4, top_k=2, expert_size=4, aux_loss_coef=0.5)
    aux, z = moe_lib.aux_losses(routed.stats, 4)
    metrics = {"loss/total": jnp.float32(1.0)}
    same = moe_lib.add_router_losses(
        1.0, metrics, None, None, aux_coef=None, z_coef=None, num_microbatches=2
    )
    assert same == (1.0, metrics)
    for aux_coef, want_coef in [(None, 0.5), (jnp.float32(0.0), 0.0), (jnp.float32(2.0), 2.0)]:
        loss, out = moe_lib.add_router_losses(
            1.0, metrics, routed, spec, aux_coef=aux_coef, z_coef=0.1, num_microbatches=2
        )
        want = 1.0 + (want_coef * float(aux) + 0.1 * float(z)) / 2
        np.testing.assert_allclose(float(loss), want, rtol=1e-6)
        np.testing.assert_allclose(float(out["loss/total"]), want, rtol=1e-6)
        np.testing.assert_allclose(float(out["moe/aux_loss"]), float(aux) / 2, rtol=1e-6)
        assert float(out["moe/tokens_per_expert_max"]) == float(jnp.max(stats.counts_le))


def test_real_size_shapes_allocate_nothing():
    """The sizes of Qwen3-30B-A3B (30.5B params, 48 MoE layers of 128 experts) and
    GLM-4.5-Air (106B: one dense layer, then 45 MoE layers with a shared expert and a
    selection bias) as abstract models: nothing is allocated (nnx.eval_shape)."""
    from flax import nnx

    from jgrpo.models.hf import config_from_hf, model_class

    qwen = dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    glm = dict(
        model_type="glm4_moe",
        vocab_size=151552,
        hidden_size=4096,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=46,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        n_routed_experts=128,
        num_experts_per_tok=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        attention_bias=True,
        partial_rotary_factor=0.5,
    )
    for hf in (qwen, glm):
        cfg = config_from_hf(hf)
        model = nnx.eval_shape(lambda cfg=cfg: model_class(cfg)(cfg, rngs=nnx.Rngs(0)))
        shapes = {"/".join(map(str, k)): v.shape for k, v in nnx.to_flat_state(nnx.state(model))}
        count = sum(int(np.prod(s)) for s in shapes.values())
        if hf is qwen:
            assert 30.4e9 < count < 30.6e9, count  # "30.5B" on the model card
            assert shapes["moe/expert_gate"] == (48, 128, 2048, 768)
            assert "dense_mlp/gate" not in shapes
        else:
            assert cfg.rotary_dim == 64 and cfg.moe.sparse_layers == (False,) + (True,) * 45
            assert shapes["dense_mlp/gate"] == (1, 4096, 10944)
            assert shapes["moe/router_bias"] == (45, 128)
            assert shapes["moe/shared_down"] == (45, 1408, 4096)
            assert 106e9 < count < 107e9, count  # GLM-4.5-Air: "106B", no MTP layer


def test_glm_multi_token_prediction_layers_are_skipped(tmp_path):
    """GLM-4.5 checkpoints carry their MTP layer as model.layers.{num_hidden_layers}.*: the
    forward never runs it (as in transformers), so the strict loader and pre-flight let it be;
    any other tensor nothing reads is still an error naming it."""
    import shutil

    from jgrpo.config import ConfigError
    from jgrpo.models.hf import read_hf_weights, write_safetensors
    from jgrpo.models.preflight import check_hf_folder
    from jgrpo.models.tiny import save_char_tokenizer

    family, extra = CASES["glm4_moe_plain"]
    make_hf_model(family, extra).save_pretrained(tmp_path / "base")
    tensors = {k: np.array(v) for k, v in read_hf_weights(tmp_path / "base").items()}
    n = extra["num_hidden_layers"]
    extras = {
        "mtp": {f"model.layers.{n}.eh_proj.weight": np.ones((64, 128), np.float32)},
        "stray": {"model.layers.0.mlp.gate.extra": np.ones((4,), np.float32)},
    }
    for name, more in extras.items():
        (tmp_path / name).mkdir()
        shutil.copy(tmp_path / "base" / "config.json", tmp_path / name)
        write_safetensors(tmp_path / name / "model.safetensors", tensors | more)
        save_char_tokenizer(tmp_path / name)
    check_hf_folder(tmp_path / "mtp")
    with pytest.raises(ConfigError, match="mlp.gate.extra"):
        check_hf_folder(tmp_path / "stray")
    for a, b in zip(
        params_of(from_pretrained(tmp_path / "base")), params_of(from_pretrained(tmp_path / "mtp"))
    ):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ModelFormatError, match="mlp.gate.extra"):
        from_pretrained(tmp_path / "stray")


def test_lora_on_moe_attention_changes_and_merges(tmp_path):
    """Adapters on an MoE model's attention: a nonzero B changes the logits, and the merged
    model (what the sampler and export run) gives the unmerged forward's logits."""
    from jgrpo.models import lora
    from jgrpo.models.adapters import attach_lora, merge_lora
    from jgrpo.models.tiny import build_tiny_moe_model

    base = from_pretrained(build_tiny_moe_model(tmp_path / "tiny"))
    spec = lora.LoRASpec(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj", "o_proj"))
    model = attach_lora(base, spec, jax.random.key(0))
    for name in ("q_lora_b", "v_lora_b", "o_lora_b"):
        b = model.lora[name]
        b[...] = 0.3 * jax.random.normal(jax.random.key(1), b[...].shape)
    ids = jnp.asarray(np.random.RandomState(7).randint(4, 200, (2, 8)))
    out = np.asarray(model(ids))
    assert np.abs(out - np.asarray(base(ids))).max() > 1e-2
    np.testing.assert_allclose(np.asarray(merge_lora(model)(ids)), out, atol=1e-4)
