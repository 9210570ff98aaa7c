"""Benchmark the train step: what skipping forwards buys, side by side in one run.

Times the compiled step (median over repeats, compile excluded) on a tiny random Qwen2 for
(ref + prev), (prev only: beta = 0) and (neither: force_on_policy_ratio, beta = 0), and prints
each time with its ratio to the full step. Medians, because these machines are noisy.

    python tools/bench_step.py [--rows 32] [--seq 64] [--repeats 10]

`--lora` instead measures a LoRA step beside a full step on a real model (default SmolLM2-135M,
`model.path=smollm2`), both with the KL penalty on (beta = 0.05): step time and per-device bytes
of the parameters (trainable + frozen), the optimizer state, the separate reference copy, and
the compiled step's arguments and temporaries (XLA's memory analysis).

    python tools/bench_step.py --lora [--model smollm2] [--rank 8] [--rows 8] [--seq 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from jgrpo import sharding, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import load_config
from jgrpo.models import Transformer, TransformerConfig
from jgrpo.models.tiny import tiny_model_fields

MODEL = TransformerConfig(**tiny_model_fields(width=128, vocab_size=256, num_layers=4))
VARIANTS = {
    "ref + prev": ["loss.reference_policy_kl_penalty=0.05"],
    "prev only": [],
    "neither (on-policy)": ["loss.force_on_policy_ratio=true"],
}


def make_batch(rows: int, seq: int, groups: int):
    rng = np.random.RandomState(0)
    token_mask = np.zeros((rows, seq), np.float32)
    token_mask[:, seq // 4 :] = 1
    return {
        "input_ids": rng.randint(1, MODEL.vocab_size, (rows, seq)).astype(np.int32),
        "attention_mask": np.ones((rows, seq), np.float32),
        "token_mask": token_mask,
        "generation_logprobs": -rng.rand(rows, seq).astype(np.float32),
        "rewards": rng.randint(0, 2, rows).astype(np.float32),
        "group_ids": np.repeat(np.arange(groups), rows // groups).astype(np.int32),
        "sample_mask": np.ones(rows, np.float32),
    }


def time_variant(overrides, rows, seq, repeats):
    cfg = load_config(
        None,
        [
            f"grpo.num_prompts_per_step={rows // 8}",
            "grpo.num_generations_per_prompt=8",
            "grpo.sequence_packing=false",  # the padded step on full rows: nothing would pack
            "mesh.data=1",
        ]
        + overrides,
    )
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    model = Transformer(MODEL, rngs=nnx.Rngs(0), init_scale=0.1)
    built = step_setup.build_step(cfg, model, mesh=mesh)
    fn, state, ref, hp = built.step_fn, built.state, built.ref_params, built.hparams
    batch = TrainBatch(**make_batch(rows, seq, rows // 8)).shard(mesh)
    start = time.perf_counter()
    state, metrics = fn(state, batch, hp, ref)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = fn(state, batch, hp, ref)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times), compile_s


def _mib(nbytes) -> float:
    return nbytes / 2**20


def measure_lora_vs_full(model_path, rank, rows, seq, repeats):
    """{variant: {ms, param/opt/ref/argument/temp MiB per device}} of a full and a LoRA step."""
    from jgrpo.inspect_step import bytes_per_device
    from jgrpo.models import load_policy

    out = {}
    for name, extra in (("full", []), (f"lora r={rank}", [f"model.lora.rank={rank}"])):
        cfg = load_config(
            None,
            [
                f"model.path={model_path}",
                f"grpo.num_prompts_per_step={rows // 8}",
                "grpo.num_generations_per_prompt=8",
                "loss.reference_policy_kl_penalty=0.05",
                "grpo.sequence_packing=false",  # the padded step on full rows
                "mesh.data=1",
                *extra,
            ],
        )
        model = load_policy(cfg.model, seed=0)
        mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
        built = step_setup.build_step(cfg, model, mesh=mesh)
        vocab = model.cfg.vocab_size
        host = make_batch(rows, seq, rows // 8)
        host["input_ids"] = host["input_ids"] % vocab
        batch = TrainBatch(**host).shard(mesh)
        state, hp, ref, frozen = built.state, built.hparams, built.ref_params, built.frozen
        memory = built.step_fn.lower(state, batch, hp, ref, frozen).compile().memory_analysis()
        state, metrics = built.step_fn(state, batch, hp, ref, frozen)  # compile + warm up
        jax.block_until_ready(metrics)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            state, metrics = built.step_fn(state, batch, hp, ref, frozen)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        out[name] = {
            "ms": statistics.median(times) * 1e3,
            "trainable": sum(x.size for x in jax.tree.leaves(state.params)),
            "param_mib": _mib(bytes_per_device((state.params, frozen))),
            "opt_mib": _mib(bytes_per_device(state.opt_state)),
            "ref_mib": _mib(bytes_per_device(ref)),
            "argument_mib": _mib(memory.argument_size_in_bytes),
            "temp_mib": _mib(memory.temp_size_in_bytes),
        }
        del model, built, state, ref, frozen
    return out


def main_lora(args) -> None:
    results = measure_lora_vs_full(args.model, args.rank, args.rows, args.seq, args.repeats)
    print(
        f"train step (beta = 0.05), {args.model}, {args.rows} rows x {args.seq} tokens, "
        f"median of {args.repeats}; MiB per device"
    )
    cols = ("ms", "trainable", "param_mib", "opt_mib", "ref_mib", "argument_mib", "temp_mib")
    print(f"{'variant':12s}" + "".join(f"{c:>14s}" for c in cols))
    for name, row in results.items():
        print(f"{name:12s}" + "".join(f"{row[c]:14.1f}" for c in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--lora", action="store_true", help="a LoRA step beside a full step")
    ap.add_argument("--model", default="smollm2", help="--lora: model.path")
    ap.add_argument("--rank", type=int, default=8, help="--lora: model.lora.rank")
    args = ap.parse_args()
    if args.lora:
        return main_lora(args)
    results = {
        name: time_variant(o, args.rows, args.seq, args.repeats) for name, o in VARIANTS.items()
    }
    base = results["ref + prev"][0]
    print(f"train step, {args.rows} rows x {args.seq} tokens, median of {args.repeats}")
    print(f"{'variant':22s}{'step ms':>10s}{'vs full':>10s}{'compile s':>12s}")
    for name, (median, compile_s) in results.items():
        print(f"{name:22s}{median * 1e3:10.1f}{median / base:10.2f}{compile_s:12.1f}")


if __name__ == "__main__":
    main()
