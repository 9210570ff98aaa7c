"""Accelerator check: the whole GRPO step of the Qwen2.5-0.5B and 1.5B recipes, decode
tokens/s at batch 256 against the bandwidth roofline, train-step MFU, peak memory against
inspect-step's estimate and bf16 logprob agreement, on random models of the recipes' shapes,
with nothing downloaded. One JSON out, with the targets of docs/performance.md checked.

    bash tools/gpu_check.sh [--out FILE]      # one H100/H200-class GPU, <= 8 minutes
    bash tools/gpu_check.sh --tiny            # tiny shapes on CPU in seconds (a test runs it)

Per recipe (configs/qwen25_0.5b_gsm8k.yaml, configs/qwen25_1.5b_gsm8k.yaml; tiny:
configs/tiny.yaml), on a random model of its shape (model.path = a folder holding only the
model's config.json), one device, in this order:
- `train`: inspect-step's estimate of the step, then the recipe's train step on a random batch
  of its B x T (compile, then `RECIPE_STEPS` timed steps): median `step_s`, `mfu` = analytic
  model matmul flops (`jgrpo.inspect_step.analytic_flops`, remat recompute excluded) / step_s
  / the chip's dense bf16 peak (`PEAK_BF16`; null when the chip is not in the table, e.g. CPU);
  the device's peak memory right after (`memory_stats`, null on CPU) / the estimate
  (`memory_vs_estimate`; the process's peak: the 1.5B recipe runs after the 0.5B one);
- `generate`: the recipe's rollout (its B rows in groups sharing a prompt, prompt_bucket-long
  prompts, max_new_tokens each: eos ignored, the worst case) from the step's parameters, timed
  after a compile; `grpo_step_s` = generate s + train step_s (reward, detokenize and host work
  aside: small next to them);
- `token_mult_prob_error`: one train step on that generated batch: the trainer's bf16 logprobs
  of the sampled tokens against the sampler's (1.0 = identical);
- `decode`: the sampler at `DECODE` rows (256) x prompt x new tokens, timed after a compile:
  tokens/s against `roofline_tokens_per_s` = rows / (the bytes a decode step must read: every
  weight in the compute dtype plus the mean live KV cache) x the chip's memory bandwidth
  (`HBM_BYTES_PER_S`; null when unknown).
`checks`: each target of docs/performance.md with its value and `ok` (null where the target's
device is not this one). On a device with less than `SMALL_DEVICE_BYTES` (a T4, e.g. Colab's)
the recipe is configs/qwen25_0.5b_gsm8k_lora_t4.yaml alone, without the batch-256 decode.
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

import jax
import numpy as np
from flax import nnx

from jgrpo import sampling, sharding, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import load_config
from jgrpo.inspect_step import analytic_flops, inspect_step
from jgrpo.models import Transformer, policy_config
from jgrpo.models.adapters import join_lora
from jgrpo.rollout.engine import assemble_batch
from jgrpo.xla_flags import set_gpu_flags

PEAK_BF16 = {  # dense (no sparsity) bf16 tensor-core peak, FLOP/s
    "H200": 989e12,  # same SXM tensor cores as H100
    "H100": 989e12,  # H100 SXM; the PCIe card is 756e12
    "A100": 312e12,
}
HBM_BYTES_PER_S = {  # memory bandwidth, bytes/s
    "H200": 4.8e12,
    "H100": 3.35e12,  # SXM; the PCIe card is 2.0e12
    "A100": 2.0e12,  # 80 GB SXM
}

ROOT = Path(__file__).resolve().parents[1]
HF_QWEN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rms_norm_eps": 1e-06}
HF_QWEN25 = {**HF_QWEN, "max_position_embeddings": 32768, "rope_theta": 1000000.0}
HF_QWEN25_0_5B = {  # Qwen2.5-0.5B's config.json hyperparameters
    **HF_QWEN25,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}
HF_QWEN25_1_5B = {  # Qwen2.5-1.5B's
    **HF_QWEN25,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}
RECIPES = {
    "qwen2.5-0.5b": (ROOT / "configs" / "qwen25_0.5b_gsm8k.yaml", HF_QWEN25_0_5B),
    "qwen2.5-1.5b": (ROOT / "configs" / "qwen25_1.5b_gsm8k.yaml", HF_QWEN25_1_5B),
}
"""The recipes checked, in order, and their models' config.json."""
RECIPE = RECIPES["qwen2.5-0.5b"]
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
DECODE = {"rows": 256, "prompt_len": 64, "new_tokens": 512}
TINY_DECODE = {"rows": 8, "prompt_len": 8, "new_tokens": 8}
TARGETS = {  # docs/performance.md, "Targets": (recipe, value, at least / at most, bound)
    "0.5b_decode_tokens_per_s": ("qwen2.5-0.5b", "decode_tokens_per_s", ">=", 120_000),
    "1.5b_decode_tokens_per_s": ("qwen2.5-1.5b", "decode_tokens_per_s", ">=", 60_000),
    "1.5b_train_mfu": ("qwen2.5-1.5b", "mfu", ">=", 0.35),
    "1.5b_grpo_step_s": ("qwen2.5-1.5b", "grpo_step_s", "<=", 20.0),
}
TARGET_DEVICE = "H200"
"""The targets are for one H200 (batch 256 for decode)."""


def chip_of(device) -> str | None:
    kind = getattr(device, "device_kind", "")
    return next((name for name in PEAK_BF16 if name in kind), None)


def peak_of(device) -> tuple[str | None, float | None]:
    chip = chip_of(device)
    return chip, PEAK_BF16.get(chip)


def device_memory(device) -> int | None:
    """The device's memory for JAX (`bytes_limit`); None where it reports none (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats or "bytes_limit" not in stats else int(stats["bytes_limit"])


def small_device(memory: int | None) -> bool:
    """Too small for the 80G recipes and the batch-256 decode: the T4 recipe alone."""
    return memory is not None and memory < SMALL_DEVICE_BYTES


def peak_memory(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else int(stats.get("peak_bytes_in_use", 0))


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


def decode_step_bytes(model_cfg, num_params: int, rows: int, prompt: int, new: int) -> float:
    """Bytes one decode step must read, on average over the N steps: every weight in the
    compute dtype and each row's live KV cache (P + N/2 slots, every layer's keys and values)."""
    itemsize = model_cfg.jnp_dtype.itemsize
    kv_per_slot = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim
    return (num_params + rows * (prompt + new / 2) * kv_per_slot) * itemsize


def roofline_tokens_per_s(step_bytes: float, rows: int, bandwidth: float | None):
    """Decode tokens/s if each step took its bytes / the memory bandwidth (None: unknown)."""
    return None if bandwidth is None else rows * bandwidth / step_bytes


def timed_generate(model, prompts, params, group_size: int) -> tuple[object, float, float]:
    """(generation, compile + first call s, second call s) of `sampling.generate`."""
    key = jax.random.key(0)
    start = time.perf_counter()
    sampling.generate(model, prompts, params, key, group_size=group_size)
    first = time.perf_counter() - start
    start = time.perf_counter()
    gen = sampling.generate(
        model, prompts, params, jax.random.fold_in(key, 1), group_size=group_size
    )
    return gen, first, time.perf_counter() - start


def check_recipe(
    config: Path, hf_config: dict, steps: int = RECIPE_STEPS, decode: dict | None = None
) -> dict:
    """The recipe's GRPO step on a random model of its shape, one device (module docstring):
    train step, generation, logprob agreement, and (`decode` given) the batch-256 decode."""
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
    step_s = statistics.median(times[1:])
    measured = peak_memory(device)
    chip, peak = peak_of(device)
    model_flops = analytic_flops(cfg, built.model_cfg)["model"]
    out = {
        "config": str(config.relative_to(ROOT)),
        "rows": cfg.grpo.batch_size,
        "tokens": cfg.rollout.prompt_bucket + cfg.rollout.max_new_tokens,
        "step_s": step_s,
        "compile_s": times[0],
        "model_flops": model_flops,
        "mfu": None if peak is None else model_flops / step_s / peak,
        "loss": float(metrics["loss/total"]),
        "peak_memory_bytes": measured,
        "estimate_peak_bytes": estimate["peak_bytes_per_device_estimate"],
        "estimate_temp_bytes": estimate["temp_bytes_per_device"],
        "memory_vs_estimate": compare_memory(measured, estimate["peak_bytes_per_device_estimate"]),
    }
    del batch

    # the recipe's rollout from the step's parameters, then one step on what it sampled
    g, ro = cfg.grpo, cfg.rollout
    model = (built.graphdef, nnx.state(join_lora(built.graphdef, state.params, built.frozen)))
    rng = np.random.RandomState(1)
    prompts = [list(rng.randint(1, model_cfg.vocab_size, ro.prompt_bucket))] * g.batch_size
    for u in range(g.num_prompts_per_step):  # one prompt per group
        prompt = list(rng.randint(1, model_cfg.vocab_size, ro.prompt_bucket))
        prompts[u * g.num_generations_per_prompt : (u + 1) * g.num_generations_per_prompt] = [
            prompt
        ] * g.num_generations_per_prompt
    params = sampling.SamplingParams.from_rollout_config(ro, ignore_eos=True)
    gen, first, seconds = timed_generate(model, prompts, params, g.num_generations_per_prompt)
    out["generate"] = {
        "rows": g.batch_size,
        "new_tokens": ro.max_new_tokens,
        "seconds": seconds,
        "compile_s": first - seconds,
        "tokens_per_s": float(gen.lengths.sum()) / seconds,
    }
    out["grpo_step_s"] = seconds + step_s
    if decode is not None:
        rows, p, n = decode["rows"], decode["prompt_len"], decode["new_tokens"]
        prompts = [list(rng.randint(1, model_cfg.vocab_size, p)) for _ in range(rows)]
        params = sampling.SamplingParams(
            max_new_tokens=n, temperature=1.0, prompt_bucket=p, ignore_eos=True
        )
        decoded, first, seconds = timed_generate(model, prompts, params, 1)
        num_params = sum(x.size for x in jax.tree.leaves(model[1]))
        step_bytes = decode_step_bytes(built.model_cfg, num_params, rows, p, n)
        roofline = roofline_tokens_per_s(step_bytes, rows, HBM_BYTES_PER_S.get(chip))
        tokens_per_s = float(decoded.lengths.sum()) / seconds
        out["decode"] = {
            **decode,
            "seconds": seconds,
            "compile_s": first - seconds,
            "tokens_per_s": tokens_per_s,
            "step_bytes": step_bytes,
            "roofline_tokens_per_s": roofline,
            "roofline_fraction": None if roofline is None else tokens_per_s / roofline,
        }
    # the recipe's rollout scored by the trainer
    group_ids = np.repeat(np.arange(g.num_prompts_per_step), g.num_generations_per_prompt)
    rewards = rng.rand(g.batch_size).astype(np.float32)
    sampled = built.device_batch(
        TrainBatch.from_mapping(assemble_batch(gen, group_ids, rewards, 0))
    )
    # last: the step donates the state, whose parameters the sampler's `model` holds
    state, metrics = built.step_fn(state, sampled, *args)  # packed as the timed steps were
    out["token_mult_prob_error"] = float(metrics["logprob/token_mult_prob_error"])

    del state, built, model
    return out


def check_targets(recipes: dict, chip: str | None) -> dict:
    """Each target of TARGETS: its value from the report, the bound, and `ok` (None where the
    value is missing or this is not the target's device)."""
    out = {}
    for name, (recipe, value, op, bound) in TARGETS.items():
        r = recipes.get(recipe, {})
        got = {
            "decode_tokens_per_s": r.get("decode", {}).get("tokens_per_s"),
            "mfu": r.get("mfu"),
            "grpo_step_s": r.get("grpo_step_s"),
        }[value]
        ok = None
        if got is not None and chip == TARGET_DEVICE:
            ok = got >= bound if op == ">=" else got <= bound
        out[name] = {"value": got, "target": f"{op} {bound} on one {TARGET_DEVICE}", "ok": ok}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny recipe, seconds on CPU")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    set_gpu_flags()  # as `jgrpo train` does, before the first device call starts XLA
    device = jax.devices()[0]
    chip, peak = peak_of(device)
    small = small_device(device_memory(device)) and not args.tiny
    if args.tiny:
        recipes, decode = {"tiny": TINY_RECIPE}, TINY_DECODE
    else:
        recipes, decode = (
            ({"qwen2.5-0.5b-lora-t4": T4_RECIPE}, None) if small else (RECIPES, DECODE)
        )
    report = {
        "device": getattr(device, "device_kind", str(device)),
        "platform": device.platform,
        "device_memory_bytes": device_memory(device),
        "peak_bf16_flops": peak,
        "peak_name": None if peak is None else f"{chip} dense bf16 {peak / 1e12:.0f} TFLOP/s",
        "hbm_bytes_per_s": HBM_BYTES_PER_S.get(chip),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "recipes": {},
    }
    start = time.perf_counter()
    for name, (config, hf_config) in recipes.items():
        report["recipes"][name] = check_recipe(config, hf_config, decode=decode)
    report["checks"] = check_targets(report["recipes"], chip)
    report["total_s"] = time.perf_counter() - start
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
