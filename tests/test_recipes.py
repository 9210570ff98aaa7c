"""The accelerator recipes in configs/ fit their target device: `jgrpo inspect-step` at each
recipe's real shape (a model folder holding only the real model's config.json, written here
from its published hyperparameters; nothing is downloaded), on as many fake CPU devices as
the target mesh has, asserts params + optimizer + reference + temporaries (inspect-step's
peak estimate) + the sampler's KV cache share <= (1 - MARGIN) x the device's memory."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import xla_flags
from test_inspect_step import QWEN25_1_5B

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
MARGIN = 0.2
"""Left free on the device: the sampler's inference copy of the weights (compute dtype, fused
per layer), its decode temporaries and the allocator's fragmentation."""

QWEN25_0_5B = {
    **QWEN25_1_5B,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}
QWEN25_7B = {
    **QWEN25_1_5B,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
}

QWEN3_4B = {
    # Qwen/Qwen3-4B's config.json as published (transformers 4.51 keys)
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "initializer_range": 0.02,
    "intermediate_size": 9728,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_30B_A3B = {
    # Qwen/Qwen3-30B-A3B's config.json as published (transformers 4.51 keys)
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_235B_A22B = {
    # Qwen/Qwen3-235B-A22B's config.json: the same keys, these values differ
    **QWEN3_30B_A3B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_window_layers": 94,
    "moe_intermediate_size": 1536,
    "num_attention_heads": 64,
    "num_hidden_layers": 94,
}

RECIPES = {
    # config: (HF config.json, devices of the target mesh, device memory, parameter count)
    "qwen25_0.5b_gsm8k.yaml": (QWEN25_0_5B, 1, 80 * 10**9, 494_032_768),
    "qwen25_0.5b_gsm8k_lora.yaml": (QWEN25_0_5B, 1, 80 * 10**9, 494_032_768),
    "qwen25_1.5b_gsm8k.yaml": (QWEN25_1_5B, 1, 80 * 10**9, 1_543_714_304),
    "qwen25_1.5b_gsm8k_lora.yaml": (QWEN25_1_5B, 1, 80 * 10**9, 1_543_714_304),
    "qwen25_0.5b_gsm8k_lora_t4.yaml": (QWEN25_0_5B, 1, 16 * 10**9, 494_032_768),
    "qwen25_7b_gsm8k_pod.yaml": (QWEN25_7B, 32, 80 * 10**9, 7_615_616_512),
    "qwen3_30b_a3b_gsm8k_lora.yaml": (QWEN3_30B_A3B, 8, 80 * 10**9, 30_532_122_624),
    "qwen3_235b_a22b_pod.yaml": (QWEN3_235B_A22B, 128, 80 * 10**9, 235_093_634_560),
    # long reasoning rollouts: 1k prompt + 32k completion per row (docs/long-context.md)
    "qwen3_4b_32k_long.yaml": (QWEN3_4B, 8, 80 * 10**9, 4_022_468_096),
    # 128k-token rows on a pod, each split over a host's 8 devices (mesh.context)
    "qwen3_4b_128k_pod.yaml": (QWEN3_4B, 32, 80 * 10**9, 4_022_468_096),
}


def hf_param_counts(hf: dict) -> tuple[int, int]:
    """(total, active per token) parameters of a Qwen3-MoE config.json counted by hand from its
    tensors (q/k/v/o, q/k norms, two layer norms, router, experts; embedding, final norm, head):
    a token runs num_experts_per_tok of the num_experts experts and everything else."""
    d, h, n = hf["hidden_size"], hf["head_dim"], hf["num_attention_heads"]
    k = hf["num_key_value_heads"]
    e, top, f = hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]
    attention = d * n * h + 2 * d * k * h + n * h * d + 2 * h + 2 * d
    expert = 3 * d * f
    embed = hf["vocab_size"] * d * (1 if hf["tie_word_embeddings"] else 2) + d
    layers = hf["num_hidden_layers"]
    total = embed + layers * (attention + d * e + e * expert)
    return total, embed + layers * (attention + d * e + top * expert)


@pytest.mark.parametrize(
    "name, hf, fsdp, published",
    [
        # published totals (KerasHub's Qwen3-MoE presets), actives as Qwen names them (A3B, A22B)
        ("qwen3_30b_a3b_gsm8k_lora.yaml", QWEN3_30B_A3B, 8, (30_532_122_624, "3.3B")),
        ("qwen3_235b_a22b_pod.yaml", QWEN3_235B_A22B, 8, (235_093_634_560, "22B")),
    ],
)
def test_moe_recipe_counts_active_and_total_params(name, hf, fsdp, published, tmp_path):
    """inspect-step (sizes only, this process's 8 devices) counts a token's parameters: the
    published total, top_k of 128 experts active, the hand count of the HF tensors."""
    from jgrpo.config import load_config
    from jgrpo.inspect_step import inspect_step

    (tmp_path / "config.json").write_text(json.dumps(hf))
    overrides = [f"model.path={tmp_path}", f"mesh.fsdp={fsdp}", "mesh.tensor=1"]
    report = inspect_step(load_config(REPO / "configs" / name, overrides), compile=False)
    adapters = report["num_params"] - RECIPES[name][3]  # LoRA: run by every token
    assert adapters == (report["num_trainable_params"] if "lora" in name else 0)
    total, active = hf_param_counts(hf)
    assert total == published[0] == report["num_params"] - adapters
    assert report["num_active_params"] - adapters == active
    named = published[1][:-1]  # the name's digits, cut (not rounded) from the count
    step = 10.0 ** -len(named.partition(".")[2])
    assert float(named) <= active / 1e9 < float(named) + step
    assert active / total < 0.11


def recipe_sizing(name: str, folder: Path) -> dict:
    """`jgrpo inspect-step --json --device-memory` of configs/`name` (its device's size) with
    model.path = a config.json-only folder of its model, on the target mesh's device count (a
    subprocess: this process has 8 fake devices)."""
    hf_config, devices, memory, _ = RECIPES[name]
    (folder / "config.json").write_text(json.dumps(hf_config))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    env["XLA_FLAGS"] = xla_flags(devices)
    config = REPO / "configs" / name
    cmd = [sys.executable, "-m", "jgrpo.cli", "inspect-step", "--json", "--config", str(config)]
    cmd += ["--device-memory", f"{memory // 10**9}GB"]
    out = subprocess.run(
        [*cmd, f"model.path={folder}"], env=env, capture_output=True, text=True, timeout=1800
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def device_bytes(report: dict) -> int:
    """What one device holds while training: the step's peak (arguments: params, optimizer,
    reference, batch; outputs less donated aliases; temporaries) + its share of the KV cache
    (the recipes have no reward model)."""
    return report["peak_bytes_per_device_estimate"] + report["kv_cache_bytes_per_device"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    # make test: the T4 recipe (its own dtype and device); make test-all: every recipe
    [n if "t4" in n else pytest.param(n, marks=pytest.mark.heavy) for n in sorted(RECIPES)],
)
def test_recipe_fits_its_device(name, tmp_path):
    _, devices, memory, num_params = RECIPES[name]
    report = recipe_sizing(name, tmp_path)
    print(name, json.dumps(report))
    assert report["num_params"] == num_params + (
        report["num_trainable_params"] if "lora" in name else 0
    )
    assert math.prod(report["mesh"].values()) == devices
    held = (
        report["param_bytes_per_device"]
        + report["opt_state_bytes_per_device"]
        + report["ref_param_bytes_per_device"]
    )
    assert report["argument_bytes_per_device"] >= held
    assert report["temp_bytes_per_device"] > 0
    assert device_bytes(report) <= (1 - MARGIN) * memory
    # --device-memory's verdict counts the same bytes
    assert report["device_memory_bytes"] == memory and report["device_fits"] is True
    assert report["device_bytes_needed"] == device_bytes(report)
    if "32k" in name:  # one 33,792-token row per device per microbatch, blockwise attention
        assert report["mesh"]["fsdp"] == 8 and report["logprob_chunk_size"] == 512
    if "128k" in name:  # one 131,072-token row per host per microbatch, over its 8 devices
        assert report["mesh"] == {"data": 4, "fsdp": 1, "context": 8, "tensor": 1}
        # the sampler does not split rows over context: every device of a host holds the
        # whole cache of the host's decode slots (docs/long-context.md), not kv / (data x fsdp)
        whole = report["peak_bytes_per_device_estimate"] + report["kv_cache_bytes"]
        assert whole <= (1 - MARGIN) * memory
    if name.endswith("_t4.yaml"):  # no bfloat16 on a T4: float32 throughout
        assert report["compute_dtype"] == report["param_dtype"] == "float32"
    else:
        assert report["compute_dtype"] == "bfloat16"
