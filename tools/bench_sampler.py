"""Sampler throughput: jgrpo.sampling.generate vs transformers' generate, side by side.

Both sides run the same weights, prompts and settings (greedy by default, `--temperature T`
samples with that temperature on both); EOS is disabled on both (jgrpo `ignore_eos`,
transformers `min_new_tokens=N`) so each generates exactly N tokens per row. transformers runs
PyTorch on CPU in float32 with as many threads as this process may use (XLA's CPU client uses
the same cores); jgrpo runs on JAX's default backend (say which below).

Reported per side: medians of the timed calls after one first call (whose extra time is
reported as compile time), tokens/s = B * N / median, prefill time (an N = 1 call: prefill +
one sample) and decode time per token = (t(N) - t(1)) / (N - 1). The timed calls of both sides
are interleaved in `--rounds` rounds (jgrpo N, transformers N, jgrpo 1, transformers 1; in a
round each gets untimed warm calls, then timed calls: 3 + 10 on A, 1 + 2 on B), so slow drift
on a noisy machine hits both sides alike instead of skewing the ratio.

Configs: A = tiny random Qwen2 (d 64, 2 layers, 4 heads, 2 kv heads, vocab 100), 16 rows x
32-token prompts, 32 new tokens; B = SmolLM2-135M (16 rows x 32-token prompts, 64 new tokens)
when `jgrpo.models.sources.resolve_model_path("smollm2")` is available.

    python tools/bench_sampler.py            # A (7 rounds) and B (2 rounds)
    python tools/bench_sampler.py --quick    # A only, 3 rounds
    python tools/bench_sampler.py --kernels portable   # the GPU/TPU kernel path (on any backend)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import numpy as np
import torch
import transformers

from jgrpo.config import ModelConfig
from jgrpo.models import load_policy
from jgrpo.models.kernels import KERNEL_CHOICES, resolve_kernels
from jgrpo.sampling import SamplingParams, generate

THREADS = len(os.sched_getaffinity(0))


def tiny_hf_model(folder):
    cfg = transformers.Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=None,  # no EOS: both sides generate N tokens with identical greedy picks
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)  # logits O(1)
    model.save_pretrained(folder)


def timed_round_robin(fns, rounds, block, warm):
    """fns: {name: callable} -> {name: (first call s, median of timed calls s, result)}.

    After each one's first call, `rounds` rounds go over all of them; in a round each gets
    `warm` untimed calls (just after a switch the other side's threads still spin on the cores
    and its data fills the caches, which slows the first call after a switch)
    and then `block` timed calls. Slow drift on a shared machine hits both sides alike."""
    first, times, out = {}, {name: [] for name in fns}, {}
    for name, fn in fns.items():
        start = time.perf_counter()
        out[name] = fn()
        first[name] = time.perf_counter() - start
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(warm):
                fn()
            for _ in range(block):
                start = time.perf_counter()
                out[name] = fn()
                times[name].append(time.perf_counter() - start)
    return {name: (first[name], statistics.median(times[name]), out[name]) for name in fns}


def bench(
    name, folder, batch, prompt_len, new_tokens, rounds, temperature, vocab_hi, block, warm, kernels
):
    rng = np.random.RandomState(0)
    prompts = [rng.randint(2, vocab_hi, prompt_len).tolist() for _ in range(batch)]
    # float32 like the transformers side; remat is a training option (none: from_pretrained's)
    model = load_policy(
        ModelConfig(path=str(folder), compute_dtype="float32", remat="none", kernels=kernels)
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    key = jax.random.key(0)  # an input like the prompts: made once

    def ours(n):
        params = SamplingParams(
            max_new_tokens=n, temperature=temperature, ignore_eos=True, prompt_bucket=prompt_len
        )
        return lambda: generate(model, prompts, params, key)

    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def theirs(n):
        kw = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
        if temperature == 0:
            kw = dict(do_sample=False)

        def run():
            with torch.no_grad():
                return hf.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=0,
                    **kw,
                )

        return run

    sides = (("jgrpo", ours), ("transformers", theirs))
    fns = {(side, n): make(n) for n in (new_tokens, 1) for side, make in sides}
    timings = timed_round_robin(fns, rounds, block, warm)
    rows = {}
    for side, _ in sides:
        first, full, out = timings[side, new_tokens]
        first1, prefill, _ = timings[side, 1]
        rows[side] = dict(
            tok_s=batch * new_tokens / full,
            full=full,
            prefill=prefill,
            decode_ms=1e3 * (full - prefill) / (new_tokens - 1),
            compile=(first - full) + (first1 - prefill),
            out=out,
        )
    gen, hf_out = rows["jgrpo"]["out"], rows["transformers"]["out"]
    assert gen.tokens.shape == (batch, new_tokens) and gen.num_decode_steps == new_tokens - 1
    assert hf_out.shape[1] == prompt_len + new_tokens, "transformers stopped early"

    mode = "greedy" if temperature == 0 else f"sampling T={temperature}"
    print(
        f"\n== {name}: {batch} rows x {prompt_len}-token prompts, {new_tokens} new tokens, "
        f"{mode}; jax {jax.default_backend()} ({jax.devices()[0].device_kind}, kernels "
        f"{resolve_kernels(kernels)}), "
        f"torch cpu {torch.get_num_threads()} threads"
    )
    print(f"{'':28s}{'jgrpo':>14s}{'transformers':>14s}{'ratio':>10s}")
    o, t = rows["jgrpo"], rows["transformers"]
    for label, key, fmt, higher in (
        ("tokens/s (median)", "tok_s", "{:14.0f}", True),
        ("generate s (median)", "full", "{:14.4f}", False),
        ("prefill s (N=1, median)", "prefill", "{:14.4f}", False),
        ("decode ms/token (median)", "decode_ms", "{:14.3f}", False),
        ("compile s (first calls)", "compile", "{:14.2f}", None),
    ):
        ratio = (
            "" if higher is None else f"{(o[key] / t[key] if higher else t[key] / o[key]):9.1f}x"
        )
        print(f"{label:28s}" + fmt.format(o[key]) + fmt.format(t[key]) + f"{ratio:>10s}")
    if temperature == 0:
        same = (gen.tokens == hf_out[:, prompt_len:].numpy()).all(axis=1)
        print(f"greedy rows identical to transformers: {int(same.sum())}/{batch}")
    for row in rows.values():
        del row["out"]
    return {
        "rows": rows,
        "model_cfg": model.cfg,
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="config A only, 3 rounds")
    parser.add_argument("--config", choices=["A", "B", "all"], default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument(
        "--kernels", choices=KERNEL_CHOICES, default="auto", help="jgrpo.models.kernels path"
    )
    args = parser.parse_args(argv)
    config = args.config or ("A" if args.quick else "all")
    rounds = args.rounds or (3 if args.quick else 7)
    torch.set_num_threads(THREADS)
    kernels = args.kernels

    if config in ("A", "all"):
        with tempfile.TemporaryDirectory() as folder:
            tiny_hf_model(folder)
            bench("A tiny qwen2", folder, 16, 32, 32, rounds, args.temperature, 100, 10, 3, kernels)
    if config in ("B", "all"):
        try:
            from jgrpo.models.sources import resolve_model_path

            folder = resolve_model_path("smollm2")
        except Exception as e:  # noqa: BLE001 - any failure means "not available here"
            print(f"\n== B SmolLM2-135M: skipped ({type(e).__name__}: {e})")
            return
        rounds_b = max(1, rounds // 3)
        bench("B SmolLM2-135M", folder, 16, 32, 64, rounds_b, args.temperature, 5000, 2, 1, kernels)


if __name__ == "__main__":
    main()
