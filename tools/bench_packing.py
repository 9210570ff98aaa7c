"""Packed sequences (`grpo.sequence_packing`) vs today's padded rows, side by side in one run.

Workloads: P prompts x 8 generations, 64-token prompts, completions capped at `--cap` tokens;
`skewed`: lengths log-normal with median cap / 8, a few at the cap
(`jgrpo.inspect_step.completion_lengths`); `uniform`: every row at the cap (nothing to pack:
packing must cost nothing). Shapes: `tiny`, the random Qwen2 of tools/bench.py (d 128,
2 layers, vocab 264), 16 prompts; `smollm2`, SmolLM2-135M-Instruct's weights (30 layers, d 576,
vocab 49152), 2 prompts in 2 microbatches by default (`--smollm2-prompts`: one padded step
of 16 rows of 320 tokens takes minutes on 2 cores).

Per (shape, workload), in interleaved rounds: the sampler (`jgrpo.sampling.generate`, EOS off)
draws every row to the cap, as today's sampler decodes until its longest row stops; the rows
are cut to the drawn lengths; the train step runs on them unpacked and packed (host packing and
the batch's transfer included in both). The whole GRPO step is the sampler + the train step of
the same round. Medians; the train step's matmul flops of both layouts from their shapes
(`inspect_step.analytic_flops`) beside them.

    python tools/bench_packing.py [--shapes tiny,smollm2] [--cap 256] [--rounds 3]
        [--workloads skewed,uniform] [--smollm2-prompts 2] [--smollm2-microbatches 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jgrpo import step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import load_config
from jgrpo.inspect_step import analytic_flops, chunk_padded, completion_lengths
from jgrpo.models import Transformer, TransformerConfig, load_policy
from jgrpo.models.tiny import tiny_model_fields
from jgrpo.sampling import SamplingParams, generate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: bench
ROOT = Path(__file__).resolve().parents[1]
PROMPT = 64
"""Prompt tokens of every row (one prompt bucket)."""
GENERATIONS = 8
SHAPES = {
    # name: (extra config overrides, prompts, microbatches)
    "tiny": (["model.logprob_chunk_size=128"], 16, 1),
    "smollm2": (["model.remat=full", "model.logprob_chunk_size=32"], 2, 2),
}
WORKLOADS = ("skewed", "uniform")


def make_model(shape: str):
    if shape == "tiny":
        fields = tiny_model_fields(width=128, vocab_size=264)
        return Transformer(TransformerConfig(**fields), rngs=nnx.Rngs(0), init_scale=0.1)
    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), ["model.path=smollm2"])
    return load_policy(cfg.model)


def step_config(shape: str, prompts: int, cap: int, packed: bool, microbatches: int):
    overrides, _, _ = SHAPES[shape]
    return load_config(
        str(ROOT / "configs" / "tiny.yaml"),
        [
            *overrides,
            f"grpo.num_prompts_per_step={prompts}",
            f"grpo.num_generations_per_prompt={GENERATIONS}",
            f"grpo.num_microbatches={microbatches}",
            f"rollout.prompt_bucket={PROMPT}",
            f"rollout.max_new_tokens={cap}",
            "mesh.data=1",
            f"grpo.sequence_packing={packed}",
        ],
    )


def rollout_batch(generation, lengths_b, group: int, seed: int) -> TrainBatch:
    """The sampler's rows cut to `lengths_b` generated tokens (the rest padding)."""
    b, cap = generation.tokens.shape
    cols = np.arange(cap)
    generated = cols < np.asarray(lengths_b)[:, None]
    prompt_real = np.arange(generation.prompt_tokens.shape[1]) >= (
        generation.prompt_tokens.shape[1] - generation.prompt_lengths[:, None]
    )
    rng = np.random.RandomState(seed)
    return TrainBatch(
        input_ids=np.concatenate(
            [generation.prompt_tokens, np.where(generated, generation.tokens, 0)], axis=1
        ).astype(np.int32),
        attention_mask=np.concatenate([prompt_real, generated], axis=1).astype(np.float32),
        token_mask=np.concatenate([np.zeros_like(prompt_real), generated], 1).astype(np.float32),
        generation_logprobs=np.concatenate(
            [np.zeros(prompt_real.shape), np.where(generated, generation.logprobs, 0.0)], 1
        ).astype(np.float32),
        rewards=rng.randint(0, 2, b).astype(np.float32),
        group_ids=(np.arange(b) // group).astype(np.int32),
        sample_mask=np.ones(b, np.float32),
    )


class Trainer:
    """The padded and the packed jitted step stepping ONE train state (each step donates it
    and hands it to the next call): one copy of the parameters and optimizer state."""

    def __init__(self, cfgs: dict, model):
        graphdef, state = nnx.split(model)  # its own copy: the steps donate it
        own = nnx.merge(graphdef, jax.tree.map(lambda x: x.copy(), state))
        self.built = {
            name: step_setup.build_step(cfg, own, mesh=None) for name, cfg in cfgs.items()
        }
        self.state = next(iter(self.built.values())).state
        self.built = {k: dataclasses.replace(b, state=None) for k, b in self.built.items()}

    def __call__(self, name: str, host: TrainBatch) -> float:
        """Seconds of one step of `name`: host batch in (packed when configured), metrics out."""
        b = self.built[name]
        start = time.perf_counter()
        batch = b.device_batch(host)
        self.state, metrics = b.step_fn(self.state, batch, b.hparams, b.ref_params, b.frozen)
        float(metrics["loss/total"])  # waits for the step
        return time.perf_counter() - start


def bench_shape(
    shape: str, cap: int, rounds: int, prompts: int, microbatches: int, workloads=WORKLOADS
) -> dict:
    model = make_model(shape)
    trainer = Trainer(
        {
            name: step_config(shape, prompts, cap, packed, microbatches)
            for name, packed in (("padded", False), ("packed", True))
        },
        model,
    )
    cfg = trainer.built["packed"].cfg
    rows = prompts * GENERATIONS
    params = SamplingParams(
        max_new_tokens=cap, temperature=1.0, prompt_bucket=PROMPT, ignore_eos=True
    )
    rng = np.random.RandomState(0)
    vocab = model.cfg.vocab_size
    prompt_ids = [list(rng.randint(1, vocab, PROMPT)) for _ in range(prompts)]
    prompt_rows = [p for p in prompt_ids for _ in range(GENERATIONS)]
    out = {}
    for workload in workloads:
        lengths_b = completion_lengths(workload, rows, cap, seed=0)
        records = {"sampler": [], "padded": [], "packed": []}
        first = {}
        for r in range(rounds + 1):  # round 0: compile and warm, not timed
            start = time.perf_counter()
            generation = generate(model, prompt_rows, params, jax.random.key(r))
            sampler_s = time.perf_counter() - start
            host = rollout_batch(generation, lengths_b, GENERATIONS, seed=r)
            order = ("padded", "packed") if r % 2 else ("packed", "padded")
            times = {name: trainer(name, host) for name in order}
            if r == 0:
                first = {"sampler": sampler_s, **times}
                continue
            records["sampler"].append(sampler_s)
            for name in order:
                records[name].append(times[name])
        med = {k: statistics.median(v) for k, v in records.items()}
        whole = {
            name: statistics.median(s + t for s, t in zip(records["sampler"], records[name]))
            for name in ("padded", "packed")
        }
        layout = trainer.built["packed"].device_batch(host).layout
        packed_rows, width = layout.input_ids.shape
        head = packed_rows * chunk_padded(cap, model.cfg.logprob_chunk_size)
        flops_packed = analytic_flops(cfg, model.cfg, [width] * packed_rows, head)["step"]
        out[workload] = {
            "completion_length_median": float(np.median(lengths_b)),
            "completion_length_mean": float(np.mean(lengths_b)),
            "rows": rows,
            "tokens_real": int((PROMPT + lengths_b).sum()),
            "tokens_padded": rows * (PROMPT + cap),
            "tokens_packed": packed_rows * width,
            "packed_rows": packed_rows,
            "train_flops_padded": analytic_flops(cfg, model.cfg)["step"],
            "train_flops_packed": flops_packed,
            "sampler_s": med["sampler"],
            "train_padded_s": med["padded"],
            "train_packed_s": med["packed"],
            "train_speedup": med["padded"] / med["packed"],
            "step_padded_s": whole["padded"],
            "step_packed_s": whole["packed"],
            "step_speedup": whole["padded"] / whole["packed"],
            "first_call_s": first,
            "round_s": records,
            "rounds": rounds,
        }
    out["model"] = {
        "layers": model.cfg.num_layers,
        "hidden": model.cfg.hidden_size,
        "vocab": model.cfg.vocab_size,
        "prompts": prompts,
        "generations": GENERATIONS,
        "prompt_tokens": PROMPT,
        "cap": cap,
        "microbatches": microbatches,
        "rounds": rounds,
    }
    return out


def print_report(report: dict) -> None:
    for shape, r in report.items():
        m = r["model"]
        print(
            f"\n== packed vs padded, {shape} ({m['layers']} layers, d {m['hidden']}, vocab "
            f"{m['vocab']}): {m['prompts']} prompts x {m['generations']}, {m['prompt_tokens']}"
            f"-token prompts, cap {m['cap']}; medians of {m['rounds']} rounds, s"
        )
        print(f"{'':30s}{'skewed':>12s}{'uniform':>12s}")
        rows = (
            ("completion length median", "completion_length_median", "{:.0f}"),
            ("tokens real", "tokens_real", "{:d}"),
            ("tokens padded (today)", "tokens_padded", "{:d}"),
            ("tokens packed", "tokens_packed", "{:d}"),
            ("train GFLOP padded", "train_flops_padded", "{:.1f}"),
            ("train GFLOP packed", "train_flops_packed", "{:.1f}"),
            ("train step padded", "train_padded_s", "{:.3f}"),
            ("train step packed", "train_packed_s", "{:.3f}"),
            ("train speedup", "train_speedup", "{:.2f}x"),
            ("sampler (same for both)", "sampler_s", "{:.3f}"),
            ("GRPO step padded", "step_padded_s", "{:.3f}"),
            ("GRPO step packed", "step_packed_s", "{:.3f}"),
            ("GRPO step speedup", "step_speedup", "{:.2f}x"),
        )
        for label, key, form in rows:
            cells = []
            for w in WORKLOADS:
                if w not in r:
                    cells.append("-")
                    continue
                value = r[w][key]
                value = value / 1e9 if "flops" in key else value
                cells.append(form.format(value))
            print(f"{label:30s}" + "".join(f"{c:>12s}" for c in cells))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tiny,smollm2", help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--cap", type=int, default=256, help="completion length cap (new tokens)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm)")
    ap.add_argument("--smollm2-prompts", type=int, default=SHAPES["smollm2"][1])
    ap.add_argument("--smollm2-microbatches", type=int, default=SHAPES["smollm2"][2])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of these")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    import bench  # tools/bench.py: this machine's limits, measured as `make bench` does

    start_load = os.getloadavg()[0]
    limits = bench.machine_limits(5)
    report = {}
    for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        prompts = args.smollm2_prompts if shape == "smollm2" else SHAPES[shape][1]
        micro = args.smollm2_microbatches if shape == "smollm2" else SHAPES[shape][2]
        workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
        report[shape] = bench_shape(shape, args.cap, args.rounds, prompts, micro, workloads)
    print(
        f"machine: {len(os.sched_getaffinity(0))} cores, float32 matmul "
        f"{limits['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s, memory read "
        f"{limits['memory_read_bytes_per_s'] / 1e9:.1f} GB/s; load average "
        f"{start_load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    )
    print_report(report)
    if args.out:
        meta = {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **limits}
        Path(args.out).write_text(json.dumps({"machine": meta, **report}, indent=2))
    return report


if __name__ == "__main__":
    main()
