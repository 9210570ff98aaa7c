"""The whole GRPO step, today's against decode slots or compaction + packing, side by side.

today = the sampler as one batch of every row, decoding until its longest row stops, then the
train step on padded rows (`grpo.sequence_packing=false`); new = the sampler with
`rollout.decode_slots` S (default rows / 4: the best count of tools/bench_sampler.py --slots
on 128 rows) then the packed train step (`grpo.sequence_packing=true`); compact = the sampler
with `rollout.compact_decode` (one batch narrowing as rows stop) then the packed train step;
default = the run config's defaults since issue 35: compaction with shared prompt prefill
(`rollout.shared_prefill`: each prompt prefilled once for its 8 rows) then the packed train step,
against today's = the defaults before it (`--samplers default`).

Workloads: P prompts x 8 generations, 64-token prompts, completions capped at `--cap`. The rows
really stop, by tools/bench_sampler.py's mechanism (its `uniform_draw_model`: random weights,
an all-zero LM head, so every token is drawn uniformly; `skewed_stops`: the first k ids stop a
row): `skewed`, lengths geometric with median ~cap / 8 (the cap truncates the tail);
`uniform`, no stop ids, every row runs to the cap. The samplers get the same key, so they draw
the same tokens (checked: `same tokens`) and both train steps get the same lengths. Shapes:
`tiny`, the random Qwen2 of tools/bench.py (d 128, 2 layers, vocab 264), 16 prompts; `smollm2`,
SmolLM2-135M's shape (30 layers, d 576, vocab 49152; random weights, untied for the zero head:
+28M LM-head parameters in the step) with `model.remat=full`, `--smollm2-prompts` prompts
(default 2) in `--smollm2-microbatches` microbatches (its steps take minutes on 2 cores).

Per (shape, workload), in interleaved rounds (round 0 compiles and is not timed; the order of
the three samplers and of the two train steps alternates by round): the samplers, then both
train steps on that round's rows (host packing and the batch's transfer included). Medians over
rounds of each phase and of each side's whole step (sampler + train step of the same round).
Flops from the shapes: the train step's executed matmul flops of each layout
(`inspect_step.analytic_flops`), the sampler's useful ones (`bench_limits.generation_flops` of each
row's own length; the padding a sampler decodes is not counted), as GFLOP/s beside the float32
matmul limit `bench_limits.machine_limits` measures in the same run.

    python tools/bench_packing.py [--shapes tiny,smollm2] [--cap 256] [--rounds 3]
        [--workloads skewed,uniform] [--slots S] [--samplers slots,compact]
        [--smollm2-prompts 2] [--smollm2-microbatches 2]
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
from jgrpo.inspect_step import analytic_flops, chunk_padded
from jgrpo.models import TransformerConfig, policy_config
from jgrpo.models.policy import model_options
from jgrpo.models.tiny import tiny_model_fields
from jgrpo.sampling import SamplingParams, generate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: bench, bench_sampler
from bench_sampler import skewed_stops, uniform_draw_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = 64
"""Prompt tokens of every row (one prompt bucket)."""
GENERATIONS = 8
SHAPES = {
    # name: (extra config overrides, prompts, microbatches)
    "tiny": (["model.logprob_chunk_size=128"], 16, 1),
    "smollm2": (["model.path=smollm2", "model.remat=full", "model.logprob_chunk_size=32"], 2, 2),
}
WORKLOADS = ("skewed", "uniform")
SAMPLERS = ("one_batch", "slots", "compact", "default")
"""today's one batch of every row; `rollout.decode_slots` S; `rollout.compact_decode`;
compaction + `rollout.shared_prefill` (the config's defaults)."""
SIDES = {
    "today": ("one_batch", "padded"),
    "new": ("slots", "packed"),
    "compact": ("compact", "packed"),
    "default": ("default", "packed"),
}
"""Each side's whole step: (its sampler, its train step)."""


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


def make_model(shape: str, cfg):
    """`shape`'s model under the step config's model options (remat, logprob chunk, dtype),
    with random weights and an all-zero LM head (bench_sampler.uniform_draw_model)."""
    if shape == "tiny":
        arch = TransformerConfig(
            **tiny_model_fields(width=128, vocab_size=264), **model_options(cfg.model)
        )
    else:
        arch = policy_config(cfg.model)
    return uniform_draw_model(arch)


def rollout_batch(generation, group: int, seed: int) -> TrainBatch:
    """The sampler's rows as the trainer gets them: prompt + each row's own generated tokens
    (`generation.lengths`, the stop included), padding after; rewards drawn from `seed`."""
    b, cap = generation.tokens.shape
    generated = np.arange(cap) < generation.lengths[:, None]
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


def sampler_flops(model_cfg, lengths_b) -> float:
    """Useful matmul flops of sampling: each row's prefill and its own generated tokens."""
    from bench_limits import generation_flops

    return float(sum(generation_flops(model_cfg, 1, PROMPT, int(n)) for n in lengths_b))


def bench_shape(
    shape: str,
    cap: int,
    rounds: int,
    prompts: int,
    microbatches: int,
    workloads=WORKLOADS,
    slots: int | None = None,
    samplers=SAMPLERS,
) -> dict:
    """One shape's table; `samplers`: one_batch (today's, always run) and any of the others."""
    samplers = ("one_batch", *(s for s in SAMPLERS[1:] if s in samplers))
    sides = {k: v for k, v in SIDES.items() if v[0] in samplers}
    rows = prompts * GENERATIONS
    slots = slots or max(1, rows // 4)
    cfgs = {
        name: step_config(shape, prompts, cap, packed, microbatches)
        for name, packed in (("padded", False), ("packed", True))
    }
    model = make_model(shape, cfgs["packed"])
    trainer = Trainer(cfgs, model)
    m = model.cfg
    rng = np.random.RandomState(0)
    out = {}
    for workload in workloads:
        stops = skewed_stops(m.vocab_size, cap) if workload == "skewed" else ()
        prompt_ids = [
            list(rng.randint(len(stops) + 1, m.vocab_size, PROMPT)) for _ in range(prompts)
        ]
        prompt_rows = [p for p in prompt_ids for _ in range(GENERATIONS)]
        params = {
            name: SamplingParams(
                max_new_tokens=cap,
                temperature=1.0,
                stop_token_ids=stops,
                ignore_eos=True,
                pad_id=0,
                prompt_bucket=PROMPT,
                decode_slots=slots if name == "slots" else None,
                compact_decode=name in ("compact", "default"),
            )
            for name in samplers
        }
        group = {name: GENERATIONS if name == "default" else 1 for name in samplers}
        per_round = []
        first = {}
        for r in range(rounds + 1):  # round 0: compile and warm, not timed
            times, gens = {}, {}
            for name in samplers[:: 1 if r % 2 else -1]:
                start = time.perf_counter()
                key = jax.random.key(r)
                gens[name] = generate(model, prompt_rows, params[name], key, group_size=group[name])
                times[name] = time.perf_counter() - start
            gen = gens["one_batch"]
            host = rollout_batch(gen, GENERATIONS, seed=r)
            for name in ("padded", "packed")[:: 1 if r % 2 else -1]:
                times[name] = trainer(name, host)
            if r == 0:
                first = times
                continue
            layout = trainer.built["packed"].device_batch(host).layout
            packed_rows, width = layout.input_ids.shape
            head = packed_rows * chunk_padded(cap, m.logprob_chunk_size)
            per_round.append(
                {
                    "same_tokens": all(
                        np.array_equal(gen.tokens, g.tokens)
                        and np.array_equal(gen.lengths, g.lengths)
                        for g in gens.values()
                    ),
                    "length_median": float(np.median(gen.lengths)),
                    "length_mean": float(np.mean(gen.lengths)),
                    "length_max": int(gen.lengths.max()),
                    "tokens_generated": int(gen.lengths.sum()),
                    **{f"decode_steps_{k}": g.num_decode_steps for k, g in gens.items()},
                    "tokens_real": int(PROMPT * rows + gen.lengths.sum()),
                    "tokens_packed": packed_rows * width,
                    "packed_rows": packed_rows,
                    "sampler_flops": sampler_flops(m, gen.lengths),
                    "train_flops_packed": analytic_flops(
                        cfgs["packed"], m, [width] * packed_rows, head
                    )["step"],
                    **{f"{k}_s": t for k, t in times.items()},
                }
            )
        flops_padded = analytic_flops(cfgs["padded"], m)["step"]
        for rec in per_round:
            rec["train_flops_padded"] = flops_padded
            for side, (sampler, train) in sides.items():
                rec[f"step_{side}_s"] = rec[f"{sampler}_s"] + rec[f"{train}_s"]
                rec[f"step_{side}_flops"] = rec["sampler_flops"] + rec[f"train_flops_{train}"]

        res = {
            "rows": rows,
            "slots": slots,
            "stop_ids": len(stops),
            "same_tokens_every_round": all(rec["same_tokens"] for rec in per_round),
            "tokens_padded": rows * (PROMPT + cap),
            **{k: med_of(per_round, k) for k in per_round[0] if k != "same_tokens"},
        }
        for name in samplers:
            tokens_per_s = med_ratio(per_round, "tokens_generated", f"{name}_s")
            res[f"sampler_tokens_per_s_{name}"] = tokens_per_s
            flops = med_ratio(per_round, "sampler_flops", f"{name}_s") / 1e9
            res[f"sampler_gflops_per_s_{name}"] = flops
        res["train_speedup"] = res["padded_s"] / res["packed_s"]
        for side, (sampler, _) in sides.items():
            if side == "today":
                continue
            suffix = "" if side == "new" else f"_{side}"
            res[f"sampler_speedup{suffix}"] = res["one_batch_s"] / res[f"{sampler}_s"]
            res[f"step_speedup{suffix}"] = res["step_today_s"] / res[f"step_{side}_s"]
            paired = med_ratio(per_round, "step_today_s", f"step_{side}_s")
            res[f"step_speedup{suffix}_paired"] = paired
            flops = med_ratio(per_round, f"step_{side}_flops", f"step_{side}_s") / 1e9
            res[f"step_gflops_per_s_{side}"] = flops
        res["train_gflops_per_s_padded"] = (
            med_ratio(per_round, "train_flops_padded", "padded_s") / 1e9
        )
        res["train_gflops_per_s_packed"] = (
            med_ratio(per_round, "train_flops_packed", "packed_s") / 1e9
        )
        res["step_gflops_per_s_today"] = (
            med_ratio(per_round, "step_today_flops", "step_today_s") / 1e9
        )
        res["first_call_s"] = first
        res["rounds"] = per_round
        out[workload] = res
    out["model"] = {
        "layers": m.num_layers,
        "hidden": m.hidden_size,
        "vocab": m.vocab_size,
        "remat": m.remat,
        "prompts": prompts,
        "generations": GENERATIONS,
        "prompt_tokens": PROMPT,
        "cap": cap,
        "slots": slots,
        "microbatches": microbatches,
        "rounds": rounds,
    }
    return out


def med_of(per_round: list[dict], key: str) -> float:
    return statistics.median(rec[key] for rec in per_round)


def med_ratio(per_round: list[dict], num: str, den: str) -> float:
    """Median over rounds of num / den paired by round."""
    return statistics.median(rec[num] / rec[den] for rec in per_round)


TABLE = (
    # label, key, format (GFLOP keys are in flops)
    ("completion length median", "length_median", "{:.0f}"),
    ("completion length max", "length_max", "{:.0f}"),
    ("same tokens (every round)", "same_tokens_every_round", "{}"),
    ("decode steps, one batch", "decode_steps_one_batch", "{:.0f}"),
    ("decode steps, slots", "decode_steps_slots", "{:.0f}"),
    ("decode steps, compact", "decode_steps_compact", "{:.0f}"),
    ("decode steps, default", "decode_steps_default", "{:.0f}"),
    ("sampler one batch, s", "one_batch_s", "{:.3f}"),
    ("sampler slots, s", "slots_s", "{:.3f}"),
    ("sampler compact, s", "compact_s", "{:.3f}"),
    ("sampler default, s", "default_s", "{:.3f}"),
    ("sampler speedup, slots", "sampler_speedup", "{:.2f}x"),
    ("sampler speedup, compact", "sampler_speedup_compact", "{:.2f}x"),
    ("sampler speedup, default", "sampler_speedup_default", "{:.2f}x"),
    ("sampler tok/s one batch", "sampler_tokens_per_s_one_batch", "{:.0f}"),
    ("sampler tok/s slots", "sampler_tokens_per_s_slots", "{:.0f}"),
    ("sampler tok/s compact", "sampler_tokens_per_s_compact", "{:.0f}"),
    ("sampler tok/s default", "sampler_tokens_per_s_default", "{:.0f}"),
    ("tokens padded / packed", None, None),
    ("train padded, s", "padded_s", "{:.3f}"),
    ("train packed, s", "packed_s", "{:.3f}"),
    ("train speedup", "train_speedup", "{:.2f}x"),
    ("GRPO step today, s", "step_today_s", "{:.3f}"),
    ("GRPO step new, s", "step_new_s", "{:.3f}"),
    ("GRPO step compact, s", "step_compact_s", "{:.3f}"),
    ("GRPO step default, s", "step_default_s", "{:.3f}"),
    ("GRPO step speedup", "step_speedup", "{:.2f}x"),
    ("  paired by round", "step_speedup_paired", "{:.2f}x"),
    ("GRPO step speedup, compact", "step_speedup_compact", "{:.2f}x"),
    ("  paired by round", "step_speedup_compact_paired", "{:.2f}x"),
    ("GRPO step speedup, default", "step_speedup_default", "{:.2f}x"),
    ("  paired by round", "step_speedup_default_paired", "{:.2f}x"),
    ("GFLOP/s sampler 1 batch", "sampler_gflops_per_s_one_batch", "{:.1f}"),
    ("GFLOP/s sampler slots", "sampler_gflops_per_s_slots", "{:.1f}"),
    ("GFLOP/s sampler compact", "sampler_gflops_per_s_compact", "{:.1f}"),
    ("GFLOP/s sampler default", "sampler_gflops_per_s_default", "{:.1f}"),
    ("GFLOP/s train padded", "train_gflops_per_s_padded", "{:.1f}"),
    ("GFLOP/s train packed", "train_gflops_per_s_packed", "{:.1f}"),
    ("GFLOP/s step today", "step_gflops_per_s_today", "{:.1f}"),
    ("GFLOP/s step new", "step_gflops_per_s_new", "{:.1f}"),
    ("GFLOP/s step compact", "step_gflops_per_s_compact", "{:.1f}"),
    ("GFLOP/s step default", "step_gflops_per_s_default", "{:.1f}"),
)


def print_report(report: dict) -> None:
    for shape, r in report.items():
        m = r["model"]
        print(
            f"\n== whole GRPO step, today (one batch + padded) vs new ({m['slots']} decode slots"
            f" + packed), compact (compact decode + packed) and default (compact decode + "
            f"shared prefill + packed), {shape} ({m['layers']} layers, "
            f"d {m['hidden']}, vocab {m['vocab']}, "
            f"remat {m['remat']}): {m['prompts']} prompts x {m['generations']}, "
            f"{m['prompt_tokens']}-token prompts, cap {m['cap']}, {m['microbatches']} "
            f"microbatches; medians of {m['rounds']} rounds"
        )
        present = [w for w in WORKLOADS if w in r]
        print(f"{'':30s}" + "".join(f"{w:>16s}" for w in present))
        for label, key, form in TABLE:
            if key is None:
                cells = [f"{r[w]['tokens_padded']}/{r[w]['tokens_packed']:.0f}" for w in present]
            elif key not in r[present[0]]:
                continue  # a sampler this run left out
            else:
                cells = [form.format(r[w][key]) for w in present]
            print(f"{label:30s}" + "".join(f"{c:>16s}" for c in cells))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tiny,smollm2", help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--cap", type=int, default=256, help="completion length cap (new tokens)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm)")
    ap.add_argument("--slots", type=int, default=None, help="decode slots (default rows / 4)")
    ap.add_argument(
        "--samplers",
        default=",".join(SAMPLERS[1:3]),
        help="besides one_batch: slots,compact,default",
    )
    ap.add_argument("--smollm2-prompts", type=int, default=SHAPES["smollm2"][1])
    ap.add_argument("--smollm2-microbatches", type=int, default=SHAPES["smollm2"][2])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of these")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    samplers = [s.strip() for s in args.samplers.split(",") if s.strip()]
    if set(shapes) - set(SHAPES) or set(workloads) - set(WORKLOADS):
        ap.error(f"--shapes from {sorted(SHAPES)}, --workloads from {list(WORKLOADS)}")
    if set(samplers) - set(SAMPLERS):
        ap.error(f"--samplers from {list(SAMPLERS)}")
    from bench_limits import machine_limits  # this machine's limits, as `make bench` measures

    start_load = os.getloadavg()
    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    limits = machine_limits(5)
    report = {}
    for shape in shapes:
        prompts = args.smollm2_prompts if shape == "smollm2" else SHAPES[shape][1]
        micro = args.smollm2_microbatches if shape == "smollm2" else SHAPES[shape][2]
        report[shape] = bench_shape(
            shape, args.cap, args.rounds, prompts, micro, workloads, args.slots, samplers
        )
    end_load = os.getloadavg()
    print(
        f"\n{start} - {time.strftime('%H:%M UTC', time.gmtime())}; machine: "
        f"{len(os.sched_getaffinity(0))} cores, float32 matmul "
        f"{limits['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s, memory read "
        f"{limits['memory_read_bytes_per_s'] / 1e9:.1f} GB/s; load average (1, 5, 15 min) "
        f"{'/'.join(f'{x:.1f}' for x in start_load)} at the start, "
        f"{'/'.join(f'{x:.1f}' for x in end_load)} at the end"
    )
    print_report(report)
    if args.out:
        meta = {
            "time_utc": start,
            "load_start": start_load,
            "load_end": end_load,
            **limits,
        }
        Path(args.out).write_text(json.dumps({"machine": meta, **report}, indent=2))
    return report


if __name__ == "__main__":
    main()
