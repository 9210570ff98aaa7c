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

RECIPES = {
    # config: (HF config.json, devices of the target mesh, device memory, parameter count)
    "qwen25_0.5b_gsm8k.yaml": (QWEN25_0_5B, 1, 80 * 10**9, 494_032_768),
    "qwen25_0.5b_gsm8k_lora.yaml": (QWEN25_0_5B, 1, 80 * 10**9, 494_032_768),
    "qwen25_1.5b_gsm8k.yaml": (QWEN25_1_5B, 1, 80 * 10**9, 1_543_714_304),
    "qwen25_1.5b_gsm8k_lora.yaml": (QWEN25_1_5B, 1, 80 * 10**9, 1_543_714_304),
    "qwen25_0.5b_gsm8k_lora_t4.yaml": (QWEN25_0_5B, 1, 16 * 10**9, 494_032_768),
    "qwen25_7b_gsm8k_pod.yaml": (QWEN25_7B, 32, 80 * 10**9, 7_615_616_512),
}


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
    if name.endswith("_t4.yaml"):  # no bfloat16 on a T4: float32 throughout
        assert report["compute_dtype"] == report["param_dtype"] == "float32"
    else:
        assert report["compute_dtype"] == "bfloat16"
