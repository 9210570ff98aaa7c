"""Benchmark the train step: what skipping forwards buys, side by side in one run.

Times the compiled step (median over repeats, compile excluded) on a tiny random Qwen2 for
(ref + prev), (prev only: beta = 0) and (neither: force_on_policy_ratio, beta = 0), and prints
each time with its ratio to the full step. Medians, because these machines are noisy.

    python tools/bench_step.py [--rows 32] [--seq 64] [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from jgrpo import sharding, step
from jgrpo.batch import TrainBatch
from jgrpo.config import load_config
from jgrpo.models import Transformer, TransformerConfig

MODEL = TransformerConfig(
    family="qwen2",
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    attention_bias=True,
)
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
            "mesh.data=1",
        ]
        + overrides,
    )
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    built = step.build_step(cfg, Transformer(MODEL, rngs=nnx.Rngs(0), init_scale=0.1), mesh=mesh)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
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
