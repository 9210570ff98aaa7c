"""`make bench`: where a GRPO step's time goes, against this machine's own limits.

One run measures, side by side:
  machine    the large-matmul FLOP/s (float32 2048^3 under jax) and the memory read bandwidth
             (a jitted sum over 512 MiB): the two limits every phase is compared with;
  steps      real GRPO steps through the trainer (`jgrpo.train.setup` + `train_one_step`, the
             code `jgrpo train` runs) on the tiny size and on SmolLM2-135M, on-policy
             (loss.force_on_policy_ratio: no prev-logprob forward) and off-policy (with it),
             the variants interleaved in rounds; per phase: generation (sampler / detokenize /
             reward), train (the one jitted step: logprob forwards + update), weight sync;
             the prev-logprob forward's cost = train(off) - train(on); compiled flops of each
             train step (every loop trip counted, `jgrpo inspect-step`'s count) and the
             generation's analytic flops, as FLOP/s and as a fraction of the matmul limit;
  phases     the SmolLM2 size's on-policy train step split into programs compiled and timed
             alone (forward, backward, optimizer, the LM head; tools/bench_step.py --phases),
             each against the matmul limit (--smoke: the tiny size's);
  sampler    jgrpo.sampling.generate vs transformers' generate (tools/bench_sampler.py), with
             decode's bytes/s (weights + KV cache read per token step) vs the bandwidth limit;
  slots      the sampler's decode slots (`rollout.decode_slots`) vs one batch of every row, with
             and without shared prefill, on skewed and uniform completion lengths
             (tools/bench_sampler.py --slots);
  packing    the whole GRPO step, today's (the sampler as one batch of every row + the padded
             train step) vs decode slots (`rollout.decode_slots`) + `grpo.sequence_packing`,
             each phase and the whole step, on a skewed and a uniform length workload
             (tools/bench_packing.py);
  moe        the whole train step of the tiny MoE model with grouped experts vs the same model
             with every expert computed densely, interleaved (tools/bench_moe.py);
  compile    the tiny config's first step in a fresh process: cold compilation cache vs warm
             (`jgrpo.compile_cache`), and the steady step after it.

Medians everywhere (these machines are noisy). A table is printed; everything is saved as JSON
in --out (default runs/bench/) as <UTC time>.json and latest.json.

    python tools/bench.py                 # the full table (run times: docs/performance.md)
    python tools/bench.py --sizes tiny    # tiny only
    python tools/bench.py --smoke         # tiny sizes, one round: what the tests run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: bench_sampler, bench_packing

from bench_limits import generation_flops, machine_limits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TREE = Path(__import__("jgrpo").__file__).resolve().parents[1]
"""The jgrpo being measured (PYTHONPATH may point at another checkout, e.g. an older commit
for a before/after): its configs/tiny.yaml and CLI are used."""
TINY_MODEL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
"""The tiny size's random Qwen2 (the builtin tiny model's char tokenizer, vocab 264)."""
SIZES = {
    # name: (model.path or "tiny", prompts, generations, prompt bucket, new tokens)
    "tiny": ("tiny", 4, 4, 32, 32),
    "smollm2": ("smollm2", 4, 4, 32, 32),
}
STEPS_PER_ROUND = {"tiny": 3, "smollm2": 2}
"""Timed steps per variant and round (--steps overrides). Tiny steps also run one untimed
step after each switch of variant (caches, threads); a SmolLM2 step is long enough to need none."""
VARIANTS = {"on-policy": ["loss.force_on_policy_ratio=true"], "off-policy": []}


# ------------------------------------------------------------------------ GRPO steps
def config_for(size: str, variant: str, model_path: str):
    from jgrpo.config import load_config

    _, prompts, gens, bucket, new = SIZES[size]
    return load_config(
        str(TREE / "configs" / "tiny.yaml"),
        [
            f"model.path={model_path}",
            f"grpo.num_prompts_per_step={prompts}",
            f"grpo.num_generations_per_prompt={gens}",
            "grpo.max_num_steps=100000",  # the bench steps until it has its medians
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            f"rollout.prompt_bucket={bucket}",
            f"rollout.max_new_tokens={new}",
            "logging.tensorboard=false",
            "mesh.data=1",
            *VARIANTS[variant],
        ],
    )


class Stepper:
    """A trainer for one (size, variant), stepped one GRPO step at a time like `train.run`."""

    def __init__(self, cfg, run_dir: Path):
        from jgrpo import train

        self.train, self.cfg = train, cfg
        self.t = train.setup(cfg, run_dir, resume=False)
        self.t.backend.publish(self.t.state.params, 0)
        self.step, self.data_states = 0, {}
        self._request(0)

    def _request(self, s: int) -> None:
        self.data_states[s] = self.t.task.train.state()
        prompts = self.t.task.train.next_prompts(self.cfg.grpo.num_prompts_per_step)
        self.t.backend.request(s, prompts)

    def __call__(self) -> dict:
        metrics = self.train.train_one_step(self.t, self.step, self.data_states)
        self.step += 1
        return metrics

    def close(self) -> None:
        self.t.task.close()
        self.t.backend.close()
        self.t.checkpointer.close()


PHASES = {
    "step": "perf/step_s",
    "generation": "perf/generation_s",
    "  sample": "perf/sample_s",
    "  detokenize": "perf/detokenize_s",
    "  reward": "perf/reward_s",
    "train": "perf/train_s",
    "weight sync": "perf/weight_sync_s",
}


def bench_steps(size: str, rounds: int, steps_per_round: int, workdir: Path, limits: dict):
    from jgrpo.inspect_step import inspect_step

    path = SIZES[size][0]
    if path == "tiny":
        from jgrpo.models.tiny import build_tiny_model

        path = str(build_tiny_model(workdir / "tiny-model", overwrite=True, **TINY_MODEL))
    steppers, flops = {}, {}
    for variant in VARIANTS:
        cfg = config_for(size, variant, path)
        flops[variant] = inspect_step(cfg)["flops"]
        steppers[variant] = Stepper(cfg, workdir / f"{size}-{variant}")
    first = {v: fn() for v, fn in steppers.items()}  # compile + warm (not timed below)
    records = {v: [] for v in steppers}
    for _ in range(rounds):
        for variant, fn in steppers.items():
            if size == "tiny":
                fn()  # one untimed step after each switch: caches, threads
            records[variant] += [fn() for _ in range(steps_per_round)]
    engine = steppers["on-policy"].t.backend.engine
    model_cfg = engine.model_cfg
    _, prompts, gens, bucket, new = SIZES[size]
    out = {}
    for variant, rows in records.items():
        med = {phase: _median([r.get(key) for r in rows]) for phase, key in PHASES.items()}
        # the trainer's own host work between the phases: next prompts, row statistics
        med["other (host)"] = _median(
            [
                r["perf/step_s"]
                - r["perf/generation_s"]
                - r["perf/train_s"]
                - r.get("perf/weight_sync_s", 0.0)
                for r in rows
            ]
        )
        train_flops = flops[variant]
        gen_flops = generation_flops(model_cfg, prompts * gens, bucket, new)
        out[variant] = {
            "phases_s": med,
            "first_step_s": first[variant]["perf/step_s"],
            "train_flops": train_flops,
            "train_flops_per_s": _ratio(train_flops, med["train"]),
            "train_vs_matmul_limit": _ratio(
                _ratio(train_flops, med["train"]), limits["matmul_flops_per_s"]
            ),
            "generation_flops": gen_flops,
            "generation_vs_matmul_limit": _ratio(
                _ratio(gen_flops, med["  sample"] or med["generation"]),
                limits["matmul_flops_per_s"],
            ),
            "loss": rows[-1]["loss/total"],
            "length_mean": statistics.mean(r["length/mean"] for r in rows),
        }
    on, off = out["on-policy"]["phases_s"]["train"], out["off-policy"]["phases_s"]["train"]
    out["prev_logprob_forward_s"] = off - on
    out["model"] = {
        "path": SIZES[size][0],
        "layers": model_cfg.num_layers,
        "hidden": model_cfg.hidden_size,
        "vocab": model_cfg.vocab_size,
        "rows": prompts * gens,
        "prompt_bucket": bucket,
        "new_tokens": new,
    }
    for fn in steppers.values():
        fn.close()
    return out


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a, b):
    return None if a is None or not b else a / b


# ------------------------------------------------------------------------ sampler
def bench_sampler_vs_transformers(quick: bool, with_smollm2: bool, limits: dict) -> dict:
    import bench_sampler
    import torch

    torch.set_num_threads(bench_sampler.THREADS)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        bench_sampler.tiny_hf_model(folder)
        # quick: 10 timed calls a side and length, so t(32) - t(1) (the decode steps, about a
        # millisecond here) stands out of a loaded machine's noise
        rounds, block, warm = (2, 5, 1) if quick else (5, 10, 3)
        results["A tiny"] = bench_sampler.bench(
            "A tiny qwen2", folder, 16, 32, 32, rounds, 0.0, 100, block, warm, "auto"
        )
    if with_smollm2:
        from jgrpo.models.sources import resolve_model_path

        results["B SmolLM2-135M"] = bench_sampler.bench(
            "B SmolLM2-135M", resolve_model_path("smollm2"), 16, 32, 64, 2, 0.0, 5000, 2, 1, "auto"
        )
    out = {}
    for name, r in results.items():
        m, rows = r["model_cfg"], r["rows"]
        weights = _weight_bytes(m)
        slots = r["prompt_len"] + r["new_tokens"]
        cache = r["batch"] * slots * 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4
        decode_ms = rows["jgrpo"]["decode_ms"]  # None: below the timer's noise
        out[name] = {
            "jgrpo_tokens_per_s": rows["jgrpo"]["tok_s"],
            "transformers_tokens_per_s": rows["transformers"]["tok_s"],
            "speedup": rows["jgrpo"]["tok_s"] / rows["transformers"]["tok_s"],
            "decode_ms_per_token_step": decode_ms,
            "decode_bytes_per_step": weights + cache,
            "decode_vs_bandwidth_limit": None
            if decode_ms is None
            else (weights + cache) / (decode_ms / 1e3) / limits["memory_read_bytes_per_s"],
            "compile_s": rows["jgrpo"]["compile"],
        }
    return out


def _weight_bytes(m) -> int:
    """float32 bytes read per decode step: every layer's matrices and the LM head (the
    embedding lookup reads a row per token: negligible)."""
    layer = (
        m.hidden_size * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
        + m.num_heads * m.head_dim * m.hidden_size
        + 3 * m.hidden_size * m.intermediate_size
    )
    return 4 * (m.num_layers * layer + m.hidden_size * m.vocab_size)


# ------------------------------------------------------------------------ decode slots
def bench_slots_section(smoke: bool, with_smollm2: bool) -> dict:
    """tools/bench_sampler.py's decode-slot tables (printed as measured) -> {shape: {"workload
    shared=yes|no slots=S|all": row}} (smoke: the tiny shape's quick pair)."""
    import bench_sampler

    tables = bench_sampler.bench_all_slots(smoke, with_smollm2)
    return {
        shape: {
            f"{w} shared={'yes' if shared else 'no'} slots={slots or 'all'}": row
            for (w, shared, slots), row in rows.items()
        }
        for shape, rows in tables.items()
    }


# ------------------------------------------------------------------------ packing
def bench_packing_section(sizes, args, rounds: int) -> dict:
    """tools/bench_packing.py's whole-step table on these sizes (smoke: tiny, a 128-token cap,
    one round)."""
    import bench_packing

    if args.smoke:
        return {"tiny": bench_packing.bench_shape("tiny", 128, 1, 16, 1)}
    out = {}
    for size in sizes:
        _, prompts, micro = bench_packing.SHAPES[size]
        out[size] = bench_packing.bench_shape(size, args.packing_cap, rounds, prompts, micro)
    return out


# ------------------------------------------------------------------------ compile
def bench_compile(workdir: Path) -> dict:
    """The tiny config's first two steps in fresh processes sharing one fresh cache."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(workdir / "xla-cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TREE), env.get("PYTHONPATH")]))
    out = {}
    for label in ("cold", "warm"):
        run_dir = workdir / f"compile-{label}"
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "jgrpo.cli", "train", "--config", "configs/tiny.yaml"]
            + ["--run-dir", str(run_dir), "grpo.max_num_steps=2", "grpo.val_at_start=false"]
            + ["grpo.val_at_end=false", "logging.tensorboard=false"],
            cwd=TREE,
            env=env,
            check=True,
            capture_output=True,
        )
        wall = time.perf_counter() - start
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        out[label] = {
            "process_wall_s": wall,
            "first_step_s": lines[0]["perf/step_s"],
            "second_step_s": lines[1]["perf/step_s"],
        }
    return out


# ------------------------------------------------------------------------ report
def fmt(value, scale=1.0, digits=1, suffix=""):
    if value is None:
        return "-"
    return f"{value * scale:.{digits}f}{suffix}"


def print_report(report: dict) -> None:
    lim = report["machine"]
    print(
        f"\nmachine: {report['cpu']}, {report['cores']} cores, jax {report['jax']} "
        f"({report['backend']}); limits measured now: float32 matmul "
        f"{lim['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s, memory read "
        f"{lim['memory_read_bytes_per_s'] / 1e9:.1f} GB/s"
    )
    for size, r in report["steps"].items():
        m = r["model"]
        print(
            f"\n== GRPO step, {size} ({m['path']}: {m['layers']} layers, d {m['hidden']}, "
            f"vocab {m['vocab']}; {m['rows']} rows x ({m['prompt_bucket']} + "
            f"{m['new_tokens']}) tokens); medians, ms"
        )
        print(f"{'phase':28s}{'on-policy':>12s}{'off-policy':>12s}")
        for phase in (*PHASES, "other (host)"):
            cells = [fmt(r[v]["phases_s"][phase], 1e3) for v in VARIANTS]
            print(f"{phase:28s}" + "".join(f"{c:>12s}" for c in cells))
        rows = (
            ("prev logprob forward", None),
            ("train GFLOP (compiled)", "train_flops"),
            ("train GFLOP/s", "train_flops_per_s"),
            ("train / matmul limit", "train_vs_matmul_limit"),
            ("sample / matmul limit", "generation_vs_matmul_limit"),
            ("first step (compile) s", "first_step_s"),
        )
        for label, key in rows:
            if key is None:
                cells = ["", fmt(r["prev_logprob_forward_s"], 1e3)]
            elif key.endswith("limit"):
                cells = [fmt(r[v][key], 100, 0, "%") for v in VARIANTS]
            elif "flops" in key:
                cells = [fmt(r[v][key], 1e-9, 2) for v in VARIANTS]
            else:
                cells = [fmt(r[v][key], 1, 2) for v in VARIANTS]
            print(f"{label:28s}" + "".join(f"{c:>12s}" for c in cells))
    if report.get("phases"):
        import bench_step

        phases = {k: v for k, v in report["phases"].items() if k != "model"}
        bench_step.print_phases(
            phases,
            f"\n== train step phases, {report['phases']['model']}, 16 rows x (32 + 32) tokens, "
            "on-policy, each program alone; medians, ms",
        )
    if report.get("sampler"):
        print("\n== sampler vs transformers generate (greedy, EOS off)")
        print(
            f"{'config':18s}{'jgrpo tok/s':>13s}{'hf tok/s':>11s}{'ratio':>8s}"
            f"{'decode ms/step':>16s}{'vs bandwidth':>14s}"
        )
        for name, s in report["sampler"].items():
            print(
                f"{name:18s}{s['jgrpo_tokens_per_s']:13.0f}{s['transformers_tokens_per_s']:11.0f}"
                f"{s['speedup']:7.1f}x{fmt(s['decode_ms_per_token_step'], 1, 2):>16s}"
                f"{fmt(s['decode_vs_bandwidth_limit'], 100, 0, '%'):>14s}"
            )
    if report.get("packing"):
        import bench_packing

        bench_packing.print_report(report["packing"])
    if report.get("moe"):
        import bench_moe

        print()
        bench_moe.print_report(report["moe"])
    if report.get("compile"):
        c = report["compile"]
        print("\n== tiny config (configs/tiny.yaml) in a fresh process; seconds")
        print(f"{'':28s}{'cold cache':>12s}{'warm cache':>12s}")
        for label, key in (
            ("first step (compiles)", "first_step_s"),
            ("second step", "second_step_s"),
            ("process wall", "process_wall_s"),
        ):
            print(f"{label:28s}{c['cold'][key]:12.2f}{c['warm'][key]:12.2f}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,smollm2", help="comma list of " + ",".join(SIZES))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the variants")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"timed steps per variant per round {STEPS_PER_ROUND}",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny only, 1 round, quick sampler")
    ap.add_argument("--no-sampler", action="store_true", help="skip the sampler comparison")
    ap.add_argument("--no-phases", action="store_true", help="skip the train-step phase table")
    ap.add_argument("--no-slots", action="store_true", help="skip the decode-slot tables")
    ap.add_argument("--no-compile", action="store_true", help="skip the compile-time runs")
    ap.add_argument("--no-packing", action="store_true", help="skip the whole-step table")
    ap.add_argument("--no-moe", action="store_true", help="skip the MoE expert-path table")
    ap.add_argument("--packing-cap", type=int, default=256, help="packing: completion cap")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench"), help="folder for the JSON")
    ap.add_argument("--label", default="", help="a name saved with the results")
    args = ap.parse_args(argv)
    sizes = ["tiny"] if args.smoke else [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown:
        ap.error(f"--sizes: unknown {unknown}; allowed {sorted(SIZES)}")
    rounds = 1 if args.smoke else args.rounds
    steps = {s: 2 if args.smoke else args.steps or STEPS_PER_ROUND[s] for s in sizes}
    report = {
        "label": args.label,
        "jgrpo_tree": str(TREE),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": platform.processor() or platform.machine(),
        "cores": len(os.sched_getaffinity(0)),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "machine": machine_limits(3 if args.smoke else 10),
        "steps": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            report["steps"][size] = bench_steps(
                size, rounds, steps[size], Path(tmp), report["machine"]
            )
        if not args.no_phases:
            import bench_step

            model_path = "smollm2" if "smollm2" in sizes else "builtin:tiny-qwen2"
            cfg = bench_step.phases_config(model_path, 16, 32, 32)
            report["phases"] = {
                "model": model_path,
                **bench_step.measure_phases(
                    cfg,
                    1 if args.smoke else 2,
                    report["machine"]["matmul_flops_per_s"],
                    rounds=1 if args.smoke else 3,
                ),
            }
        if not args.no_sampler:
            try:
                report["sampler"] = bench_sampler_vs_transformers(
                    args.smoke, "smollm2" in sizes, report["machine"]
                )
            except ImportError as e:  # an older checkout on PYTHONPATH lacks what it needs
                if TREE == ROOT:
                    raise
                print(f"\nsampler comparison skipped: tools/bench_sampler.py needs {e.name}")
                report["sampler_skipped"] = f"{type(e).__name__}: {e}"
        if not args.no_slots:
            report["decode_slots"] = bench_slots_section(args.smoke, "smollm2" in sizes)
        if not args.no_packing:
            report["packing"] = bench_packing_section(sizes, args, rounds)
        if not args.no_moe:
            import bench_moe

            small = dict(rows=8, seq=32, rounds=1, calls=1) if args.smoke else {"rounds": rounds}
            report["moe"] = bench_moe.run(**small, block=False)
        if not args.no_compile:
            report["compile"] = bench_compile(Path(tmp))
    print_report(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2, default=str)
    stamp = report["time_utc"].replace(":", "")
    (out / f"{stamp}.json").write_text(text)
    (out / "latest.json").write_text(text)
    print(f"\nsaved {out / 'latest.json'}")
    return report


if __name__ == "__main__":
    main()
