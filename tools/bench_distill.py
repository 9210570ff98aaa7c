"""Benchmark the distillation teacher's forward inside the train step, side by side in one run.

Inside one compiled step no clock can take the teacher forward apart, so this compiles three
programs over the same batch and times them interleaved (one call of each per round, medians):
the step without a teacher, the step with one, and the teacher forward alone. The teacher's cost
in the step is the difference of the first two; the third is its standalone time. Random tiny
Qwen2s of `make distill`'s shape (d 128, 2 layers; the teacher deeper with --teacher-layers).

    python tools/bench_distill.py [--rows 256] [--seq 14] [--teacher-layers 2] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from jgrpo import sharding, step, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import load_config
from jgrpo.models import Transformer, TransformerConfig
from jgrpo.models.tiny import tiny_model_fields


def model_config(layers: int) -> TransformerConfig:
    return TransformerConfig(**tiny_model_fields(width=128, vocab_size=256, num_layers=layers))


def make_batch(rows: int, seq: int, vocab: int) -> TrainBatch:
    rng = np.random.RandomState(0)
    token_mask = np.zeros((rows, seq), np.float32)
    token_mask[:, seq // 2 :] = 1
    return TrainBatch(
        input_ids=rng.randint(1, vocab, (rows, seq)).astype(np.int32),
        attention_mask=np.ones((rows, seq), np.float32),
        token_mask=token_mask,
        generation_logprobs=-rng.rand(rows, seq).astype(np.float32),
        rewards=rng.randint(0, 2, rows).astype(np.float32),
        group_ids=np.repeat(np.arange(rows // 8), 8).astype(np.int32),
        sample_mask=np.ones(rows, np.float32),
    )


def build(rows: int, seq: int, teacher_layers: int | None):
    """(a call of the step, its StepSetup) with or without a teacher."""
    overrides = [
        f"grpo.num_prompts_per_step={rows // 8}",
        "grpo.num_generations_per_prompt=8",
        f"rollout.prompt_bucket={seq // 2}",
        f"rollout.max_new_tokens={seq - seq // 2}",
        "mesh.data=1",
    ]
    if teacher_layers is not None:
        overrides.append("distillation.teacher=builtin:tiny-qwen2")  # the model is given below
    cfg = load_config(None, overrides)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    model = Transformer(model_config(2), rngs=nnx.Rngs(0), init_scale=0.1)
    teacher = None
    if teacher_layers is not None:
        teacher = Transformer(model_config(teacher_layers), rngs=nnx.Rngs(1), init_scale=0.1)
    built = step_setup.build_step(cfg, model, mesh=mesh, teacher=teacher)
    batch = built.device_batch(make_batch(rows, seq, model.cfg.vocab_size))
    box = {"state": built.state}

    def call():
        box["state"], metrics = built.step_fn(
            box["state"], batch, built.hparams, None, None, built.teacher
        )
        return metrics

    return call, built, batch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--seq", type=int, default=14)
    ap.add_argument("--teacher-layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args(argv)
    plain, _, _ = build(args.rows, args.seq, None)
    distill, built, batch = build(args.rows, args.seq, args.teacher_layers)
    t = built.teacher
    forward = jax.jit(
        lambda params, b: step.frozen_logprobs(
            "teacher", t.graphdef, params, b, built.hparams.temperature, 1, first_scored=1
        )
    )
    calls = {
        "step": plain,
        "step + teacher": distill,
        "teacher forward": lambda: forward(t.params, batch),
    }
    for call in calls.values():  # compile and warm up
        jax.block_until_ready(call())
    times = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    print(
        f"{args.rows} rows x {args.seq} tokens, student 2 layers, teacher {args.teacher_layers}"
        f" layers (d 128); median of {args.rounds} interleaved rounds on "
        f"{jax.devices()[0].platform}"
    )
    for name, ms in med.items():
        print(f"  {name:16s} {ms:8.1f} ms")
    extra = med["step + teacher"] - med["step"]
    print(f"  teacher in step  {extra:8.1f} ms ({extra / med['step + teacher']:.0%} of the step)")


if __name__ == "__main__":
    main()
