"""tools/gpu_check.sh --tiny runs end to end on CPU, so the GPU check cannot rot."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.heavy  # make test: test_gpu_check_roofline_and_targets_by_hand
def test_gpu_check_tiny_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    # one CPU device, as on a one-GPU machine (not the suite's 8 fake ones)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(None)}
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), "--tiny", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["platform"] == "cpu" and report["peak_bf16_flops"] is None
    assert report["hbm_bytes_per_s"] is None
    assert "xla_gpu" not in report["xla_flags"]  # the GPU flags stay off on CPU
    # the recipe check: configs/tiny.yaml's step at its shape against inspect-step's estimate
    recipe = report["recipes"]["tiny"]
    assert recipe["config"] == "configs/tiny.yaml" and (recipe["rows"], recipe["tokens"]) == (
        16,
        24,
    )
    assert recipe["step_s"] > 0 and recipe["mfu"] is None and math.isfinite(recipe["loss"])
    assert recipe["estimate_peak_bytes"] > recipe["estimate_temp_bytes"] > 0
    assert recipe["peak_memory_bytes"] is None and recipe["memory_vs_estimate"] is None
    # the whole GRPO step: the recipe's rollout (16 rows x 8 new tokens) + its train step
    gen = recipe["generate"]
    assert (gen["rows"], gen["new_tokens"]) == (16, 8) and gen["tokens_per_s"] > 0
    assert recipe["grpo_step_s"] == pytest.approx(gen["seconds"] + recipe["step_s"])
    # the trainer's bf16 logprobs of the sampled tokens agree with the sampler's
    assert 1.0 <= recipe["token_mult_prob_error"] < 1.05
    decode = recipe["decode"]
    assert decode["rows"] == 8 and decode["tokens_per_s"] > 0 and decode["step_bytes"] > 0
    assert decode["roofline_tokens_per_s"] is None and decode["roofline_fraction"] is None
    assert set(report["checks"]) == set(gpu_check_module().TARGETS)
    assert all(c["ok"] is None for c in report["checks"].values())  # not an H200


def gpu_check_module():
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check

    return gpu_check


def test_gpu_check_roofline_and_targets_by_hand():
    """The decode roofline and the target checks against hand values: Qwen2.5-0.5B's shape,
    256 rows of 64 + 512 tokens on an H200 (4.8 TB/s); a report that meets every target on an
    H200, misses them, and is on another chip."""
    from jgrpo.models import TransformerConfig

    g = gpu_check_module()
    cfg = TransformerConfig(
        family="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        dtype="bfloat16",
    )
    # 494,032,768 bf16 weights; KV: 256 rows x (64 + 256) slots x 24 layers x 2 x 2 x 64 x 2 B
    step_bytes = g.decode_step_bytes(cfg, 494_032_768, 256, 64, 512)
    assert step_bytes == 2 * 494_032_768 + 256 * 320 * 24 * 2 * 2 * 64 * 2
    assert g.roofline_tokens_per_s(step_bytes, 256, 4.8e12) == pytest.approx(
        256 * 4.8e12 / 1_994_698_496
    )
    assert g.roofline_tokens_per_s(step_bytes, 256, None) is None
    good = {
        "qwen2.5-0.5b": {"decode": {"tokens_per_s": 130_000.0}},
        "qwen2.5-1.5b": {"decode": {"tokens_per_s": 61_000.0}, "mfu": 0.36, "grpo_step_s": 19.0},
    }
    bad = {
        "qwen2.5-0.5b": {"decode": {"tokens_per_s": 119_000.0}},
        "qwen2.5-1.5b": {"decode": {"tokens_per_s": 59_000.0}, "mfu": 0.34, "grpo_step_s": 21.0},
    }
    assert all(c["ok"] is True for c in g.check_targets(good, "H200").values())
    assert all(c["ok"] is False for c in g.check_targets(bad, "H200").values())
    assert all(c["ok"] is None for c in g.check_targets(good, "H100").values())
    assert g.check_targets({}, "H200")["1.5b_train_mfu"] == {
        "value": None,
        "target": ">= 0.35 on one H200",
        "ok": None,
    }


def test_gpu_check_compares_memory_and_builds_recipe_batches():
    """The CPU-side logic of the recipe check: the measured/estimated ratio, and a random batch
    of the recipe's shape that the step accepts (completions right of prompt_bucket)."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check

    from jgrpo.config import load_config

    assert gpu_check.compare_memory(None, 10) is None
    assert gpu_check.compare_memory(15, 10) == 1.5
    cfg = load_config(gpu_check.RECIPE[0], ["model.path=unused"])
    batch = gpu_check.random_batch(cfg, 151936)
    assert batch.shape == (cfg.grpo.batch_size, 256 + 512)
    batch.check_scored_from(cfg.rollout.prompt_bucket)
    assert batch.token_mask[:, :256].sum() == 0 and batch.token_mask[:, 256:].all()
    assert (batch.input_ids < 151936).all() and (batch.input_ids > 0).all()


def test_gpu_check_takes_the_t4_recipe_on_a_small_device():
    """Under 40 GB (a 16 GB T4, Colab's) the check runs the T4 LoRA recipe and skips the bf16
    shapes; 80 GB devices and devices that report no memory (CPU) run the 80 GB recipe."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check

    from jgrpo.config import load_config

    assert gpu_check.small_device(16 * 10**9) and not gpu_check.small_device(80 * 10**9)
    assert not gpu_check.small_device(None)
    cfg = load_config(gpu_check.T4_RECIPE[0], ["model.path=unused"])
    assert cfg.model.lora.rank == 16 and cfg.model.resolved_compute_dtype("gpu") == "float32"
    assert gpu_check.T4_RECIPE[1] == gpu_check.RECIPE[1]  # the same Qwen2.5-0.5B


@pytest.mark.heavy  # make test: test_gpu_check_takes_the_t4_recipe_on_a_small_device
def test_gpu_check_runs_a_lora_recipe_step_on_cpu():
    """check_recipe on the T4 recipe (LoRA: the frozen base joins the step) at its batch shape,
    with the tiny model's config.json in place of Qwen2.5-0.5B's, on one CPU device."""
    code = (
        "import json, sys; sys.path.insert(0, 'tools'); import gpu_check as g; "
        "print(json.dumps(g.check_recipe(g.T4_RECIPE[0], g.TINY_RECIPE[1], steps=1)))"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(None)}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    recipe = json.loads(proc.stdout.strip().splitlines()[-1])
    assert recipe["config"] == "configs/qwen25_0.5b_gsm8k_lora_t4.yaml"
    assert (recipe["rows"], recipe["tokens"]) == (32, 512)
    assert recipe["step_s"] > 0 and math.isfinite(recipe["loss"])
    assert recipe["estimate_peak_bytes"] > recipe["estimate_temp_bytes"] > 0
