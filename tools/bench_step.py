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

`--phases` splits the on-policy train step of a model (default SmolLM2-135M, 16 rows of a
32-token prompt + 32 completion tokens, `model.remat: dots` as the CPU configs) into programs
compiled and timed alone, each against this machine's float32 matmul limit (`bench_limits.py`'s
probe, measured in the same run): the policy forward (the logprobs the loss reads), forward +
backward (the microbatch gradients, `step.accumulate_gradients`), the whole step (+ the
optimizer update: its time = step - gradients), and the LM head + log-softmax alone (forward
and forward + backward over the completion positions). Flops are the compiled programs' matmul
flops, every loop trip counted (`inspect_step.hlo_dot_flops`); the backward's are gradients -
forward. `make bench` reports this table for its SmolLM2 size.

    python tools/bench_step.py --phases [--model smollm2] [--rows 16] [--prompt 32] [--new 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
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


def _flops(fn, args) -> float:
    from jgrpo.inspect_step import hlo_dot_flops

    return hlo_dot_flops(fn.lower(*args).compile().as_text())[0]


def phases_config(model_path: str, rows: int, prompt: int, new: int, extra=()):
    """The train step's config of `bench.py`'s sizes: on-policy, one device, unpacked rows."""
    return load_config(
        None,
        [
            f"model.path={model_path}",
            "model.remat=dots",
            f"grpo.num_prompts_per_step={rows // 4}",
            "grpo.num_generations_per_prompt=4",
            f"rollout.prompt_bucket={prompt}",
            f"rollout.max_new_tokens={new}",
            "loss.force_on_policy_ratio=true",
            "grpo.sequence_packing=false",  # rows as they are: every row is full here anyway
            "mesh.data=1",
            *extra,
        ],
    )


def measure_phases(cfg, repeats: int, matmul_limit: float, rounds: int = 3) -> dict:
    """{phase: {"s", "gflop", "fraction"}} of `cfg`'s step split into programs (module
    docstring); fraction = FLOP/s / matmul_limit (None for the optimizer: no matmuls)."""
    from jgrpo import step
    from jgrpo.models import load_policy

    model = load_policy(cfg.model, seed=0)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    built = step_setup.build_step(cfg, model, mesh=mesh)
    g, flags, hp = built.graphdef, built.flags, built.hparams
    rows, prompt = cfg.grpo.batch_size, cfg.rollout.prompt_bucket
    seq = prompt + cfg.rollout.max_new_tokens
    host = make_batch(rows, seq, rows // 4)
    host["input_ids"] = host["input_ids"] % model.cfg.vocab_size
    host["token_mask"][:] = 0
    host["token_mask"][:, prompt:] = 1
    batch = TrainBatch(**host).shard(mesh)
    params = jax.tree.map(jnp.copy, built.state.params)  # the whole step donates the state's

    @jax.jit
    def forward(params, batch):
        return step.sequence_logprobs(
            g, params, batch.input_ids, batch.attention_mask, hp.temperature, True, prompt
        )

    @jax.jit
    def gradients(params, batch):
        data, _ = step.prepare_batch(built.state, batch, hp, None, flags=flags, graphdef=g)
        return step.accumulate_gradients(params, data, hp, flags=flags, graphdef=g)

    # the LM head + log-softmax alone over the completion positions (as token_logprobs, one
    # chunk): hidden [n, d] x head [v, d] -> logprob of the target, and its gradient
    head = params["embed"] if model.cfg.tie_word_embeddings else params["lm_head"]
    head_vd = head if model.cfg.tie_word_embeddings else head.T
    n = rows * (seq - prompt)
    x_nd = jax.random.normal(jax.random.key(0), (n, model.cfg.hidden_size), jnp.float32)
    targets_n = jnp.asarray(host["input_ids"][:, prompt:].reshape(-1))

    def head_logprobs(x_nd, head_vd):
        logits_nv = jnp.dot(x_nd, head_vd.T, preferred_element_type=jnp.float32)
        picked_n = jnp.take_along_axis(logits_nv, targets_n[:, None], axis=-1)[:, 0]
        return picked_n - jax.nn.logsumexp(logits_nv, axis=-1)

    head_forward = jax.jit(head_logprobs)
    head_gradients = jax.jit(jax.grad(lambda x, h: jnp.sum(head_logprobs(x, h)), argnums=(0, 1)))
    fn, hparams, ref = built.step_fn, built.hparams, built.ref_params
    state = built.state

    def whole(batch):
        nonlocal state
        state, metrics = fn(state, batch, hparams, ref)
        return metrics

    programs = {
        "forward": (forward, (params, batch)),
        "forward + backward": (gradients, (params, batch)),
        "LM head forward": (head_forward, (x_nd, head_vd)),
        "LM head forward + backward": (head_gradients, (x_nd, head_vd)),
    }
    out = {name: {"gflop": _flops(f, args) / 1e9} for name, (f, args) in programs.items()}
    out["whole step"] = {"gflop": _flops(fn, (state, batch, hparams, ref)) / 1e9}
    programs["whole step"] = (whole, (batch,))
    # compiled and warmed first, then timed in interleaved rounds: load falls on all alike
    times = {name: [] for name in programs}
    for f, args in programs.values():
        jax.block_until_ready(f(*args))
    for _ in range(rounds):
        for name, (f, args) in programs.items():
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(f(*args))
                times[name].append(time.perf_counter() - start)
    for name in programs:
        out[name]["s"] = statistics.median(times[name])
    fwd, grads = out["forward"], out["forward + backward"]
    out["backward"] = {"s": grads["s"] - fwd["s"], "gflop": grads["gflop"] - fwd["gflop"]}
    out["optimizer + rest"] = {"s": out["whole step"]["s"] - grads["s"], "gflop": None}
    for row in out.values():
        timed = row["gflop"] and row["s"] > 0
        row["fraction"] = row["gflop"] * 1e9 / row["s"] / matmul_limit if timed else None
    return out


PHASE_ORDER = (
    "forward",
    "backward",
    "forward + backward",
    "optimizer + rest",
    "whole step",
    "LM head forward",
    "LM head forward + backward",
)


def print_phases(phases: dict, title: str) -> None:
    print(title)
    print(f"{'phase':30s}{'ms':>10s}{'GFLOP':>9s}{'of matmul limit':>17s}")
    for name in PHASE_ORDER:
        r = phases[name]
        gflop = "-" if r["gflop"] is None else f"{r['gflop']:.1f}"
        frac = "-" if r["fraction"] is None else f"{100 * r['fraction']:.0f}%"
        print(f"{name:30s}{r['s'] * 1e3:10.1f}{gflop:>9s}{frac:>17s}")


def main_phases(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_limits import machine_limits

    limit = machine_limits(5)["matmul_flops_per_s"]
    cfg = phases_config(args.model, args.rows, args.prompt, args.new)
    phases = measure_phases(cfg, args.repeats, limit)
    print_phases(
        phases,
        f"train step phases, {args.model}, {args.rows} rows x ({args.prompt} + {args.new}) "
        f"tokens, medians of 3 interleaved rounds x {args.repeats}; "
        f"matmul limit {limit / 1e9:.0f} GFLOP/s",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=None, help="default 32 (--phases: 16)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--lora", action="store_true", help="a LoRA step beside a full step")
    ap.add_argument("--phases", action="store_true", help="the step's phases vs the matmul limit")
    ap.add_argument("--prompt", type=int, default=32, help="--phases: prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="--phases: completion tokens")
    ap.add_argument("--model", default="smollm2", help="--lora, --phases: model.path")
    ap.add_argument("--rank", type=int, default=8, help="--lora: model.lora.rank")
    args = ap.parse_args()
    args.rows = args.rows or (16 if args.phases else 32)
    if args.lora:
        return main_lora(args)
    if args.phases:
        return main_phases(args)
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
