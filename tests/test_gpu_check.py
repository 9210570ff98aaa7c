"""tools/gpu_check.sh --tiny runs end to end on CPU, so the GPU check cannot rot."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.heavy
def test_gpu_check_tiny_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
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
    tiny = report["shapes"]["tiny"]
    assert tiny["sampler_tokens_per_s"] > 0
    for variant in ("on_policy", "off_policy"):
        r = tiny[variant]
        assert r["step_s"] > 0 and r["mfu"] is None and math.isfinite(r["loss"])
        # the trainer's bf16 logprobs of the sampled tokens agree with the sampler's
        assert 1.0 <= r["token_mult_prob_error"] < 1.05
    # the prev forward is an extra forward: off-policy model flops exceed on-policy ones
    assert tiny["off_policy"]["model_flops"] > tiny["on_policy"]["model_flops"]
