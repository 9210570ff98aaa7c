"""`make bench` (tools/bench.py) at smoke size, so the benchmark cannot rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_tool(*argv) -> subprocess.CompletedProcess:
    """`python tools/...` as a user runs it (one CPU device), checked for exit code 0."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.heavy
def test_bench_smoke_prints_the_table_and_saves_json(tmp_path):
    out = run_tool("tools/bench.py", "--smoke", "--no-compile", "--out", str(tmp_path))
    for line in (
        "== GRPO step, tiny",
        "train / matmul limit",
        "prev logprob forward",
        "A tiny",
        "== whole GRPO step, today (one batch + padded) vs new",
        "GRPO step speedup",
    ):
        assert line in out.stdout, out.stdout
    report = json.loads((tmp_path / "latest.json").read_text())
    assert report["machine"]["matmul_flops_per_s"] > 1e9
    assert report["machine"]["memory_read_bytes_per_s"] > 1e8
    tiny = report["steps"]["tiny"]
    on, off = tiny["on-policy"], tiny["off-policy"]
    # the prev forward is in the off-policy program only: one more forward's flops
    assert off["train_flops"] > on["train_flops"] > 0
    for variant in (on, off):
        phases = variant["phases_s"]
        assert phases["train"] > 0 and phases["generation"] >= phases["  sample"] > 0
        assert 0 < variant["train_vs_matmul_limit"] < 2
    skewed, uniform = report["packing"]["tiny"]["skewed"], report["packing"]["tiny"]["uniform"]
    assert skewed["tokens_packed"] < skewed["tokens_padded"] == uniform["tokens_packed"]
    # rows really stop: the skewed ones early, the uniform ones at the cap; both samplers the same
    assert skewed["length_median"] < skewed["length_max"] <= 128 == uniform["length_median"]
    assert skewed["same_tokens_every_round"] and uniform["same_tokens_every_round"]
    assert skewed["packed_s"] > 0 and uniform["step_today_s"] > uniform["one_batch_s"]
    slots = report["decode_slots"]["tiny"]["skewed shared=no slots=32"]
    assert "== decode slots, tiny" in out.stdout, out.stdout
    assert slots["same_tokens"] is True and slots["tokens_per_s"] > 0
    sampler = report["sampler"]["A tiny"]
    assert sampler["jgrpo_tokens_per_s"] > 0 and sampler["decode_bytes_per_step"] > 0
    # decode = (t(32 tokens) - t(1)) / 31, timed: None where a loaded machine's noise hid it
    decode_ms, decode_limit = (
        sampler["decode_ms_per_token_step"],
        sampler["decode_vs_bandwidth_limit"],
    )
    assert (decode_ms is None) == (decode_limit is None)
    assert decode_ms is None or (decode_ms > 0 and decode_limit > 0)
    moe = report["moe"]["step"]  # tools/bench_moe.py at its smallest setting
    assert "== MoE train step, builtin:tiny-qwen3-moe" in out.stdout
    assert moe["grouped_ms"] > 0 and moe["dense_ms"] > 0
    assert len(list(tmp_path.glob("*.json"))) == 2  # <UTC time>.json and latest.json


def test_moe_bench_smoke_times_both_expert_paths_of_the_whole_step(capsys):
    """tools/bench_moe.py --smoke (its smallest setting): the whole train step of the tiny MoE
    model, grouped experts and every expert dense, from one state to the same update."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_moe
    finally:
        sys.path.remove(str(ROOT / "tools"))
    report = bench_moe.main(["--smoke"])
    out = capsys.readouterr().out
    assert "== MoE train step, builtin:tiny-qwen3-moe, 8 rows x 32 tokens" in out, out
    assert set(report) == {"backend", "step"}
    step = report["step"]
    assert set(step) == {
        "model", "rows", "seq", "rounds", "calls", "grouped_ms", "dense_ms",
        "dense_vs_grouped", "params_max_diff",
    }  # fmt: skip
    assert (step["rows"], step["seq"], step["rounds"], step["calls"]) == (8, 32, 1, 1)
    assert step["grouped_ms"] > 0 and step["dense_ms"] > 0
    assert step["dense_vs_grouped"] == step["dense_ms"] / step["grouped_ms"]
    assert step["params_max_diff"] < 1e-5  # float32: the two paths give the same update


@pytest.mark.heavy  # the tool's pieces run in make test: test_reward_model and test_ray
def test_reward_model_bench_smoke_prints_each_variant(tmp_path):
    args = ["--variants", "local", "--steps", "1", "--rounds", "1", "--rm-width", "64"]
    out = run_tool("tools/bench_reward_model.py", *args, "--rm-layers", "1")
    rows = {
        line.split()[0] + (" RM" if "+ RM" in line else ""): line.split()[-5:]
        for line in out.stdout.splitlines()
        if line.startswith("local")
    }
    assert set(rows) == {"local", "local RM"}, out.stdout
    assert float(rows["local"][-1]) == 0.0 < float(rows["local RM"][-1])  # reward model ms
    assert all(float(v) > 0 for v in rows["local RM"])


@pytest.mark.heavy  # ~14 s of CPU (torch + transformers loads); the tool checks it at each run
def test_peer_bench_folders_make_every_logit_the_target_in_jgrpo(tmp_path):
    """tools/bench_peers.py's crafted folders: constant embedding rows make the last hidden
    state the same at every position, so the untied LM head it solves for gives the target
    logits (0, the EOS at log(p (V-1) / (1-p)) or -30) in jgrpo's own forward too, at every
    position of any prompt, not only in the transformers forward it was solved in."""
    import math

    import numpy as np

    from jgrpo.models import from_pretrained
    from jgrpo.models.tiny import build_tiny_model

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_peers
    finally:
        sys.path.remove(str(ROOT / "tools"))
    source = build_tiny_model(tmp_path / "src", num_hidden_layers=1, hidden_size=32)
    ids = np.random.RandomState(1).randint(3, 256, (3, 19)).astype(np.int32)
    for workload in ("skewed", "uniform"):
        crafted = bench_peers.craft_folder(source, tmp_path / workload, workload)
        model = from_pretrained(tmp_path / workload)
        logits = np.asarray(model(ids), np.float64)
        vocab = logits.shape[-1]
        p = bench_peers.STOP_PROBABILITY
        eos_logit = math.log(p * (vocab - 1) / (1 - p)) if workload == "skewed" else -30.0
        assert crafted["eos_logit"] == pytest.approx(eos_logit)
        config = json.loads((tmp_path / workload / "config.json").read_text())
        eos, never = crafted["eos"], [config["pad_token_id"], config["bos_token_id"]]
        assert eos not in never and not config["tie_word_embeddings"]
        np.testing.assert_allclose(logits[..., eos], eos_logit, atol=1e-4)
        np.testing.assert_allclose(logits[..., never], -30.0, atol=1e-4)  # never drawn
        np.testing.assert_allclose(np.delete(logits, [eos, *never], axis=-1), 0.0, atol=1e-4)
