"""Does reward-model scoring serialise the GRPO step? Step phases with and without one.

Trains the tiny config (configs/tiny.yaml: arithmetic, 4 prompts x 4 generations) with the
task's verifier, a CPU-bound reward function (--fn-ms of work per batch, in the reward child
process) and, in the "+ RM" variants, a random Qwen2 reward model (--rm-width, --rm-layers;
built here from jgrpo's tiny model plus a score head, char tokenizer), under three schedules
(--policy-width / --policy-layers: a bigger random policy than builtin:tiny-qwen2):
local (sync, in the trainer), Ray sync (rollout.max_staleness 0) and Ray async (1). Variants
run one after another (an async worker must not generate while another variant is timed), in
--rounds rounds of --steps steps; the first step of each round is not timed. Prints medians of
the trainer's phases (perf/step_s; perf/generation_s = the trainer waiting in `collect`;
perf/train_s) and the rollout's reward phase (perf/reward_s, of which perf/reward_model_s),
with the machine's float32 matmul and memory-read limits (tools/bench.py) measured first.

    python tools/bench_reward_model.py [--variants local,ray-sync,ray-async] [--steps 6]
    PYTHONPATH=/other/checkout python tools/bench_reward_model.py --variants local
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench import TREE, Stepper
from bench_limits import machine_limits

RAY = ["rollout.backend=ray", "rollout.num_workers=1", "rollout.num_cpus_per_worker=1"]
SCHEDULES = {
    "local": [],
    "ray-sync": RAY,
    "ray-async": [
        *RAY,
        "rollout.max_staleness=1",
        "loss.use_importance_sampling_correction=true",
    ],
}
KEYS = {
    "step": "perf/step_s",
    "wait for batch": "perf/generation_s",
    "train": "perf/train_s",
    "reward phase": "perf/reward_s",
    "reward model": "perf/reward_model_s",
}
FUNCTION = '''import time


def busy(prompts, completions, **columns):
    """CPU work for FN_MS milliseconds per call, then a length reward."""
    end = time.perf_counter() + FN_MS / 1000.0
    while time.perf_counter() < end:
        pass
    return [len(c) / 8.0 for c in completions]
'''


def build_policy(out: Path, width: int, layers: int, seed: int = 0) -> Path:
    """jgrpo's tiny random Qwen2 (char tokenizer) at this width and depth."""
    from jgrpo.models.tiny import build_tiny_model

    heads = max(width // 64, 2)
    return build_tiny_model(
        out,
        seed=seed,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        intermediate_size=2 * width,
    )


def build_reward_model(out: Path, width: int, layers: int) -> Path:
    """`build_policy`'s model of this size, turned into a one-label sequence classifier."""
    import safetensors.numpy

    build_policy(out, width, layers, seed=1)
    config = json.loads((out / "config.json").read_text())
    config |= {"architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "score"}}
    (out / "config.json").write_text(json.dumps(config))
    tensors = safetensors.numpy.load_file(out / "model.safetensors")
    rng = np.random.default_rng(2)
    tensors["score.weight"] = (rng.standard_normal((1, width)) / np.sqrt(width)).astype(np.float32)
    safetensors.numpy.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


class AheadStepper(Stepper):
    """bench.Stepper that also requests the rollout.max_staleness steps after step 0."""

    def __init__(self, cfg, run_dir: Path):
        super().__init__(cfg, run_dir)
        for s in range(1, 1 + cfg.rollout.max_staleness):
            self._request(s)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="local,ray-sync,ray-async")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fn-ms", type=float, default=40.0)
    ap.add_argument("--rm-width", type=int, default=256)
    ap.add_argument("--rm-layers", type=int, default=4)
    ap.add_argument("--policy-width", type=int, default=0, help="0: builtin:tiny-qwen2")
    ap.add_argument("--policy-layers", type=int, default=4)
    args = ap.parse_args(argv)
    from jgrpo.config import load_config

    limits = machine_limits(3)
    work = Path(tempfile.mkdtemp(prefix="bench-rm-"))
    (work / "busy_reward.py").write_text(FUNCTION.replace("FN_MS", repr(args.fn_ms)))
    sys.path.insert(0, str(work))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work), os.getenv("PYTHONPATH")]))
    rm = build_reward_model(work / "rm", args.rm_width, args.rm_layers)
    policy = []
    if args.policy_width:  # a bigger random policy: a longer train step
        policy = [
            f"model.path={build_policy(work / 'policy', args.policy_width, args.policy_layers)}"
        ]
    if any(v.startswith("ray") for v in args.variants.split(",")):
        from jgrpo.rollout.ray_backend import init_ray

        init_ray(num_cpus=16)  # one cluster: every variant's worker (1 XLA thread) at once
    function = "{function: 'busy_reward:busy', weight: 0.1}"
    steppers = {}
    for schedule in args.variants.split(","):
        for with_rm in (False, True):
            terms = [function] + ([f"{{model: '{rm}', name: judge}}"] if with_rm else [])
            overrides = [
                "logging.tensorboard=false",
                "mesh.data=1",
                f"grpo.max_num_steps={args.rounds * (args.steps + 1) + 4}",
                f"data.reward_functions=[{', '.join(terms)}]",
                *SCHEDULES[schedule],
                *policy,
            ]
            name = f"{schedule}{' + RM' if with_rm else ''}"
            cfg = load_config(str(TREE / "configs" / "tiny.yaml"), overrides)
            steppers[name] = AheadStepper(cfg, work / name.replace(" ", ""))
            steppers[name]()  # compiles
    rows = {name: [] for name in steppers}
    try:
        for _ in range(args.rounds):
            for name, stepper in steppers.items():
                stepper()  # not timed: another variant ran meanwhile
                rows[name] += [stepper() for _ in range(args.steps)]
    finally:
        for stepper in steppers.values():
            stepper.close()
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average": os.getloadavg(),
        "machine": limits,
        "args": vars(args),
        "medians_ms": {
            name: {
                label: 1e3 * statistics.median(r.get(key) or 0.0 for r in got)
                for label, key in KEYS.items()
            }
            for name, got in rows.items()
        },
    }
    print(
        f"\n{report['date']}, load average {report['load_average'][0]:.1f}; float32 matmul "
        f"{limits['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s, memory read "
        f"{limits['memory_read_bytes_per_s'] / 1e9:.0f} GB/s; medians (ms) of "
        f"{args.rounds} x {args.steps} steps"
    )
    print(f"{'':18s}" + "".join(f"{label:>16s}" for label in KEYS))
    for name, med in report["medians_ms"].items():
        print(f"{name:18s}" + "".join(f"{med[label]:16.1f}" for label in KEYS))
    return report


if __name__ == "__main__":
    main()
