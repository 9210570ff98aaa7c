"""Accelerator check: train-step MFU, sampler throughput, memory and bf16 logprob agreement on
random Qwen2.5-0.5B- and 1.5B-shaped models, with nothing downloaded. JSON out.

    bash tools/gpu_check.sh [--out FILE]      # one H100/H200-class GPU, <= 12 minutes
    bash tools/gpu_check.sh --tiny            # tiny shapes on CPU in seconds (the test runs it)

Per shape it reports: sampler tokens/s (B rows x N new tokens, eos ignored, compile excluded);
the median train-step time on-policy (loss.force_on_policy_ratio: no prev forward) and
off-policy (the prev forward runs); MFU = analytic model matmul flops of the step
(`jgrpo.inspect_step.analytic_flops`, remat recompute excluded: model flops, not hardware
flops) / step time / the chip's dense bf16 peak (`PEAK_BF16`, named in the output; null when
the chip is not in the table, e.g. on CPU); the device's peak memory (`memory_stats`, null on
CPU); and `logprob/token_mult_prob_error` of the trainer's bf16 logprobs against the sampler's
on the sampled batch (1.0 = identical). First, `recipe`: configs/qwen25_0.5b_gsm8k.yaml's
train step (tiny: configs/tiny.yaml's) on a random model of its shape and a random batch of
its B x T for a few steps: step time, MFU, the device's peak memory against inspect-step's
`peak_bytes_per_device_estimate` of the same step (`memory_vs_estimate`, null on CPU). On a
device with less than `SMALL_DEVICE_BYTES` of memory (a T4, e.g. Colab's) the recipe is
configs/qwen25_0.5b_gsm8k_lora_t4.yaml and the bf16 shapes, sized for an 80G device, are skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jgrpo import sampling, sharding, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import load_config
from jgrpo.inspect_step import analytic_flops, inspect_step
from jgrpo.models import Transformer, TransformerConfig, model_options, policy_config
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
ROOT = Path(__file__).resolve().parents[1]
HF_QWEN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rms_norm_eps": 1e-06}
HF_QWEN25_0_5B = {  # Qwen2.5-0.5B's config.json hyperparameters
    **HF_QWEN,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}
RECIPE = (ROOT / "configs" / "qwen25_0.5b_gsm8k.yaml", HF_QWEN25_0_5B)
"""The recipe run first, and its model's config.json."""
T4_RECIPE = (ROOT / "configs" / "qwen25_0.5b_gsm8k_lora_t4.yaml", HF_QWEN25_0_5B)
"""The recipe of a device under SMALL_DEVICE_BYTES (the notebook's GPU path)."""
SMALL_DEVICE_BYTES = 40 * 10**9
TINY_RECIPE = (
    ROOT / "configs" / "tiny.yaml",
    {
        **HF_QWEN,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "vocab_size": 256,
    },
)
RECIPE_STEPS = 3
SIZES = {"prompts": 8, "generations": 8, "prompt_len": 64, "new_tokens": 512, "repeats": 3}
TINY_SIZES = {"prompts": 2, "generations": 4, "prompt_len": 8, "new_tokens": 8, "repeats": 2}


def peak_of(device) -> tuple[str | None, float | None]:
    kind = getattr(device, "device_kind", "")
    for name, peak in PEAK_BF16.items():
        if name in kind:
            return name, peak
    return None, None


def device_memory(device) -> int | None:
    """The device's memory for JAX (`bytes_limit`); None where it reports none (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats or "bytes_limit" not in stats else int(stats["bytes_limit"])


def small_device(memory: int | None) -> bool:
    """Too small for the 80G recipe and the bf16 shapes: the T4 recipe alone."""
    return memory is not None and memory < SMALL_DEVICE_BYTES


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


def random_batch(cfg, vocab_size: int, seed: int = 0) -> TrainBatch:
    """A [B, prompt_bucket + max_new_tokens] batch of random tokens: prompts fill the first
    prompt_bucket columns, completions (token_mask 1) the rest; random rewards per group."""
    g, ro = cfg.grpo, cfg.rollout
    rows, prompt, new = g.batch_size, ro.prompt_bucket, ro.max_new_tokens
    rng = np.random.RandomState(seed)
    token_mask = np.zeros((rows, prompt + new), np.float32)
    token_mask[:, prompt:] = 1.0
    return TrainBatch.from_mapping(
        {
            "input_ids": rng.randint(1, vocab_size, (rows, prompt + new)).astype(np.int32),
            "attention_mask": np.ones((rows, prompt + new), np.float32),
            "token_mask": token_mask,
            "generation_logprobs": np.where(token_mask > 0, -2.0, 0.0).astype(np.float32),
            "rewards": rng.rand(rows).astype(np.float32),
            "group_ids": np.repeat(
                np.arange(g.num_prompts_per_step), g.num_generations_per_prompt
            ).astype(np.int32),
            "sample_mask": np.ones(rows, np.float32),
        }
    )


def compare_memory(measured: int | None, estimate: int) -> float | None:
    """measured / estimated peak bytes (None when the device reports no memory stats)."""
    return None if measured is None else measured / estimate


def check_recipe(config: Path, hf_config: dict, steps: int = RECIPE_STEPS) -> dict:
    """The recipe's train step on a random model of its shape (model.path = a folder holding
    only `hf_config`), one device: inspect-step's estimate, then `steps` timed steps after a
    compile. Run it first: the device's peak memory is the process's."""
    if jax.device_count() != 1:  # inspect-step sizes the mesh of every visible device
        return {
            "skipped": f"{jax.device_count()} devices visible; needs one (CUDA_VISIBLE_DEVICES=0)"
        }
    device = jax.devices()[0]
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(hf_config))
        cfg = load_config(config, [f"model.path={folder}", "mesh.data=1", "mesh.fsdp=1"])
        estimate = inspect_step(cfg)
        model_cfg = policy_config(cfg.model)
    mesh = sharding.make_mesh(cfg.mesh, [device])
    built = step_setup.build_step(cfg, Transformer(model_cfg, rngs=nnx.Rngs(0)), mesh=mesh)
    batch = built.device_batch(random_batch(cfg, model_cfg.vocab_size))  # packed by default
    state, times = built.state, []
    args = (built.hparams, built.ref_params, built.frozen)  # frozen: a LoRA recipe's base
    for _ in range(steps + 1):  # the first call compiles
        start = time.perf_counter()
        state, metrics = built.step_fn(state, batch, *args)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    median = statistics.median(times[1:])
    _, peak = peak_of(device)
    model_flops = analytic_flops(cfg, built.model_cfg)["model"]
    measured = peak_memory(device)
    out = {
        "config": str(config.relative_to(ROOT)),
        "rows": cfg.grpo.batch_size,
        "tokens": cfg.rollout.prompt_bucket + cfg.rollout.max_new_tokens,
        "step_s": median,
        "compile_s": times[0],
        "model_flops": model_flops,
        "mfu": None if peak is None else model_flops / median / peak,
        "loss": float(metrics["loss/total"]),
        "peak_memory_bytes": measured,
        "estimate_peak_bytes": estimate["peak_bytes_per_device_estimate"],
        "estimate_temp_bytes": estimate["temp_bytes_per_device"],
        "memory_vs_estimate": compare_memory(measured, estimate["peak_bytes_per_device_estimate"]),
    }
    del state, built, batch
    return out


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
        batch = built.device_batch(host)  # packed by default
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
    small = small_device(device_memory(device)) and not args.tiny
    shapes = {"tiny": TINY_SHAPE} if args.tiny else SHAPES
    sizes = TINY_SIZES if args.tiny else SIZES
    recipe = TINY_RECIPE if args.tiny else (T4_RECIPE if small else RECIPE)
    report = {
        "device": getattr(device, "device_kind", str(device)),
        "platform": device.platform,
        "device_memory_bytes": device_memory(device),
        "peak_bf16_flops": peak,
        "peak_name": None if peak is None else f"{peak_name} dense bf16 {peak / 1e12:.0f} TFLOP/s",
        "shapes": {},
    }
    start = time.perf_counter()
    report["recipe"] = check_recipe(*recipe)
    for name, model_cfg in shapes.items():
        if small:
            report["shapes"][name] = {"skipped": "sized for an 80G device"}
            continue
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
