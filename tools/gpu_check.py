"""Accelerator check: train-step MFU, sampler throughput, memory and bf16 logprob agreement on
random Qwen2.5-0.5B- and 1.5B-shaped models, with nothing downloaded. JSON out.

    bash tools/gpu_check.sh [--out FILE]      # one H100/H200-class GPU, <= 8 minutes
    bash tools/gpu_check.sh --tiny            # tiny shapes on CPU in seconds (the test runs it)

Per shape it reports: sampler tokens/s (B rows x N new tokens, eos ignored, compile excluded);
the median train-step time on-policy (loss.force_on_policy_ratio: no prev forward) and
off-policy (the prev forward runs); MFU = analytic model matmul flops of the step
(`jgrpo.inspect_step.analytic_flops`, remat recompute excluded: model flops, not hardware
flops) / step time / the chip's dense bf16 peak (`PEAK_BF16`, named in the output; null when
the chip is not in the table, e.g. on CPU); the device's peak memory (`memory_stats`, null on
CPU); and `logprob/token_mult_prob_error` of the trainer's bf16 logprobs against the sampler's
on the sampled batch (1.0 = identical).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

from jgrpo import sampling, sharding, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import load_config
from jgrpo.inspect_step import analytic_flops
from jgrpo.models import Transformer, TransformerConfig, model_options
from jgrpo.models.tiny import tiny_model_fields
from jgrpo.rollout.engine import assemble_batch

PEAK_BF16 = {  # dense (no sparsity) bf16 tensor-core peak, FLOP/s
    "H200": 989e12,  # same SXM tensor cores as H100
    "H100": 989e12,  # H100 SXM; the PCIe card is 756e12
    "A100": 312e12,
}

QWEN = dict(family="qwen2", attention_bias=True, tie_word_embeddings=True, rope_theta=1e6)
SHAPES = {
    "qwen2.5-0.5b": TransformerConfig(
        **QWEN,
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
    ),
    "qwen2.5-1.5b": TransformerConfig(
        **QWEN,
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
    ),
}
TINY_SHAPE = TransformerConfig(**{**tiny_model_fields(width=64, vocab_size=256), **QWEN})
SIZES = {"prompts": 8, "generations": 8, "prompt_len": 64, "new_tokens": 512, "repeats": 3}
TINY_SIZES = {"prompts": 2, "generations": 4, "prompt_len": 8, "new_tokens": 8, "repeats": 2}


def peak_of(device) -> tuple[str | None, float | None]:
    kind = getattr(device, "device_kind", "")
    for name, peak in PEAK_BF16.items():
        if name in kind:
            return name, peak
    return None, None


def peak_memory(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else int(stats.get("peak_bytes_in_use", 0))


def run_config(sizes: dict, overrides: list[str]):
    return load_config(
        None,
        [
            f"grpo.num_prompts_per_step={sizes['prompts']}",
            f"grpo.num_generations_per_prompt={sizes['generations']}",
            f"rollout.prompt_bucket={sizes['prompt_len']}",
            f"rollout.max_new_tokens={sizes['new_tokens']}",
            "model.compute_dtype=bfloat16",
            "mesh.data=1",
            "optim.learning_rate=1e-6",
            *overrides,
        ],
    )


def model_for(model_cfg: TransformerConfig, cfg) -> Transformer:
    """A random model of shape `model_cfg` under the run's options (jgrpo.models.model_options:
    run_config's model.compute_dtype=bfloat16, model.dtype, remat, logprob chunk, kernels)."""
    options = model_options(cfg.model)
    return Transformer(TransformerConfig(**{**vars(model_cfg), **options}), rngs=nnx.Rngs(0))


def check_shape(name: str, model_cfg: TransformerConfig, sizes: dict) -> dict:
    devices = jax.devices()[:1]
    device = devices[0]
    rows = sizes["prompts"] * sizes["generations"]
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(1, model_cfg.vocab_size, sizes["prompt_len"])) for _ in range(rows)]
    out = {"rows": rows, "prompt_len": sizes["prompt_len"], "new_tokens": sizes["new_tokens"]}

    cfg = run_config(sizes, [])
    model = model_for(model_cfg, cfg)
    params = sampling.SamplingParams(
        max_new_tokens=sizes["new_tokens"],
        temperature=1.0,
        prompt_bucket=sizes["prompt_len"],
        ignore_eos=True,
    )
    key = jax.random.key(0)
    start = time.perf_counter()
    gen = sampling.generate(model, prompts, params, key)
    out["sampler_compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    gen = sampling.generate(model, prompts, params, jax.random.fold_in(key, 1))
    seconds = time.perf_counter() - start
    out["sampler_tokens_per_s"] = float(gen.lengths.sum()) / seconds
    group_ids = np.repeat(np.arange(sizes["prompts"]), sizes["generations"])
    rewards = rng.rand(rows).astype(np.float32)
    host = TrainBatch.from_mapping(assemble_batch(gen, group_ids, rewards, 0))
    del model

    _, peak = peak_of(device)
    for variant, overrides in {
        "on_policy": ["loss.force_on_policy_ratio=true"],
        "off_policy": [],
    }.items():
        cfg = run_config(sizes, overrides)
        mesh = sharding.make_mesh(cfg.mesh, devices)
        built = step_setup.build_step(cfg, model_for(model_cfg, cfg), mesh=mesh)
        batch = host.shard(mesh)
        state = built.state
        start = time.perf_counter()
        state, metrics = built.step_fn(state, batch, built.hparams, built.ref_params)
        jax.block_until_ready(metrics)
        compile_s = time.perf_counter() - start
        times = []
        for _ in range(sizes["repeats"]):
            start = time.perf_counter()
            state, metrics = built.step_fn(state, batch, built.hparams, built.ref_params)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        model_flops = analytic_flops(cfg, built.model_cfg)["model"]
        out[variant] = {
            "step_s": median,
            "compile_s": compile_s,
            "model_flops": model_flops,
            "mfu": None if peak is None else model_flops / median / peak,
            "token_mult_prob_error": float(metrics["logprob/token_mult_prob_error"]),
            "loss": float(metrics["loss/total"]),
        }
        del state, built, batch
    out["peak_memory_bytes"] = peak_memory(device)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, seconds on CPU")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    device = jax.devices()[0]
    peak_name, peak = peak_of(device)
    shapes = {"tiny": TINY_SHAPE} if args.tiny else SHAPES
    sizes = TINY_SIZES if args.tiny else SIZES
    report = {
        "device": getattr(device, "device_kind", str(device)),
        "platform": device.platform,
        "peak_bf16_flops": peak,
        "peak_name": None if peak is None else f"{peak_name} dense bf16 {peak / 1e12:.0f} TFLOP/s",
        "shapes": {},
    }
    start = time.perf_counter()
    for name, model_cfg in shapes.items():
        report["shapes"][name] = check_shape(name, model_cfg, sizes)
    report["total_s"] = time.perf_counter() - start
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
