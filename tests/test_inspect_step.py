"""inspect-step tells the truth at a real model shape: flops over every loop trip (1 and 2
microbatches agree; the analytic count agrees), per-device bytes, no [B, T, V] logits."""

import json
import math
from pathlib import Path

import pytest

from jgrpo.config import load_config
from jgrpo.inspect_step import hlo_dot_flops, inspect_step

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}


def test_hlo_dot_flops_counts_every_trip():
    """A scan of 3 matmuls and a map of 4: hand-counted flops, which XLA counts once per body."""
    import jax
    import jax.numpy as jnp

    def f(w_lab, x_ab):
        y_ab, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x_ab, w_lab)
        return jax.lax.map(lambda r: r @ r.T, y_ab.reshape(4, 2, -1))

    compiled = jax.jit(f).lower(jnp.ones((3, 16, 16)), jnp.ones((8, 16))).compile()
    flops, known = hlo_dot_flops(compiled.as_text())
    assert known
    assert flops == 3 * (2 * 8 * 16 * 16) + 4 * (2 * 2 * 2 * 16)
    assert compiled.cost_analysis()["flops"] < 0.6 * flops  # what it replaces


def temp_bytes_bound(
    report, microbatches, rows=16, tokens=64, chunk=32, fsdp=8, shape=SMOLLM2_135M
) -> int:
    """What the SmolLM2-shaped step below needs in temporaries per device, from its shapes.

    fsdp splits the rows and every weight 8 ways; bf16 compute, float32 master weights, remat
    full, `microbatches` microbatches of the `rows` rows. Terms (bytes, per device):
    - gradients and update: the float32 gradient accumulator, one microbatch's gradient and
      one tree of optimizer updates, each the size of the (float32) params: 3 x P;
    - one logprob chunk (vocab-parallel head: every row of the microbatch, 1/fsdp of the
      vocab): float32 logits [rows, chunk, V / fsdp], with up to 8 buffers of that size alive
      (the logits, their exponentials, the cotangent, bfloat16 casts and XLA:CPU's float32
      copies of bfloat16 dot operands);
    - one layer's weights gathered whole (FSDP), in float32 and a bfloat16 cast, in the
      forward and again for the backward's weight gradients before their reduce-scatter:
      2 x (4 + 2) bytes x layer params;
    - activations: the remat residuals (every layer's input, its rows of the microbatch, at
      most float32) and up to 16 float32 per-layer intermediates of the largest per-row
      width (MLP [t, f], attention scores [n, t, t]).
    A head gathered whole costs V x d x 4 bytes (113 MB here) per copy: the head gathered
    once per forward, as XLA:CPU did before the vocab-parallel head, exceeds this bound."""
    d, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    n, k, h, layers = (
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["head_dim"],
        shape["num_hidden_layers"],
    )
    mb_rows = rows // microbatches
    device_rows = mb_rows // fsdp
    grads = 3 * report["param_bytes_per_device"]
    logits = 8 * mb_rows * chunk * (v // fsdp) * 4
    layer_params = d * (n + 2 * k) * h + n * h * d + 3 * d * f + 2 * d
    weights = 2 * (4 + 2) * layer_params
    widest = max(tokens * f, n * tokens * tokens)
    activations = layers * device_rows * tokens * d * 4 + 16 * device_rows * widest * 4
    return grads + logits + weights + activations


def inspect_shape(folder, hf_config, overrides, microbatches):
    """inspect_step of a model folder holding only `hf_config`'s config.json, bf16 compute,
    remat full (the default), fsdp=8 on the 8 fake devices, reference KL on, plus `overrides`:
    {microbatch count: report}."""
    (folder / "config.json").write_text(json.dumps(hf_config))  # nothing else
    base = [
        f"model.path={folder}",
        "model.compute_dtype=bfloat16",
        "model.remat=full",
        "mesh.fsdp=8",
        "mesh.data=1",
        "loss.reference_policy_kl_penalty=0.1",
        *overrides,
    ]
    return {
        mb: inspect_step(load_config(TINY, [*base, f"grpo.num_microbatches={mb}"]))
        for mb in microbatches
    }


@pytest.mark.slow
def test_smollm2_shape_flops_and_memory_per_device(tmp_path):
    overrides = [
        "model.logprob_chunk_size=32",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=8",
        "rollout.prompt_bucket=16",
        "rollout.max_new_tokens=48",
    ]
    reports = inspect_shape(tmp_path, SMOLLM2_135M, overrides, (1, 2))
    one, two = reports[1], reports[2]
    assert one["num_params"] == 134_515_008  # SmolLM2-135M
    assert one["forwards"] == one["forwards_traced"] == ["ref", "prev", "policy"]
    # every trip counted: the microbatch count does not change the work
    assert one["flops_trip_counts_known"] and two["flops_trip_counts_known"]
    assert two["flops"] == pytest.approx(one["flops"], rel=0.02)
    assert one["flops"] == pytest.approx(one["flops_analytic"], rel=0.05)
    assert one["flops_xla_cost_analysis"] < 0.2 * one["flops"]  # XLA: each loop body once
    # float32 master weights split 8 ways (norms replicated), float32 Adam moments, bf16 ref
    assert 4 * 134_515_008 / 8 <= one["param_bytes_per_device"] < 4 * 134_515_008 / 7.9
    assert one["opt_state_bytes_per_device"] == pytest.approx(
        2 * one["param_bytes_per_device"], rel=0.001
    )
    assert one["ref_param_bytes_per_device"] == pytest.approx(
        one["param_bytes_per_device"] / 2, rel=0.001
    )
    # temporaries: within what the shapes need (`temp_bytes_bound`), and part of the peak
    for mb, report in reports.items():
        assert 0 < report["temp_bytes_per_device"] <= temp_bytes_bound(report, mb)
        assert report["temp_bytes_per_device"] < report["peak_bytes_per_device_estimate"]
    # the sampler's bf16 KV cache: rows x slots x (k and v) x layers x kv heads x head dim x 2
    assert one["kv_cache_bytes"] == 16 * 64 * 2 * 30 * 3 * 64 * 2
    assert one["kv_cache_bytes_per_device"] == one["kv_cache_bytes"] // 8
    assert math.isfinite(one["flops"]) and one["flops"] > 0


QWEN25_1_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}


@pytest.mark.heavy  # make test: the SmolLM2 shape
def test_qwen25_1_5b_shape_fits_4_gib_of_temporaries_per_device(tmp_path):
    """The real-size claim: Qwen2.5-1.5B, bf16 compute, fsdp=8, 32 prompts x 8 generations of
    64 + 1024 tokens, reference KL on, defaults otherwise (remat full, chunks of 128)."""
    overrides = [
        "grpo.num_prompts_per_step=32",
        "grpo.num_generations_per_prompt=8",
        "rollout.prompt_bucket=64",
        "rollout.max_new_tokens=1024",
    ]
    reports = inspect_shape(tmp_path, QWEN25_1_5B, overrides, (1, 8))
    one, eight = reports[1], reports[8]
    assert one["num_params"] == 1_543_714_304  # Qwen2.5-1.5B
    assert eight["forwards"] == ["ref", "prev", "policy"]
    assert eight["temp_bytes_per_device"] <= 4 * 2**30
    assert eight["flops_trip_counts_known"]
    assert eight["flops"] == pytest.approx(one["flops"], rel=0.02)
