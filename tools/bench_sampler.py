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

Decode slots (`--slots`; `make bench` runs it too): `rollout.decode_slots` against one batch of
every row (today's default program), with and without shared prefill, on a skewed and a uniform
workload of 16 prompts x 8 rows with 64-token prompts, sampling at temperature 1. The model has
the shape of A (vocabulary 512) or of SmolLM2-135M, random weights and an all-zero LM head, so
every token is drawn uniformly: skewed = the first k = round(V (1 - 2^(-8/N))) ids stop a row
(geometric lengths, median N / 8, the cap truncates the tail); uniform = no stop, N tokens per
row. Tokens/s counts the tokens generated (stop included), so padding never counts.

    python tools/bench_sampler.py            # A (7 rounds) and B (2 rounds)
    python tools/bench_sampler.py --quick    # A only, 3 rounds
    python tools/bench_sampler.py --kernels portable   # the GPU/TPU kernel path (on any backend)
    python tools/bench_sampler.py --slots [--quick]    # the decode-slot tables instead
    python tools/bench_sampler.py --slots --config B   # SmolLM2-135M's decode-slot table only
    python tools/bench_sampler.py --top-p              # one decode step's top-p draw

Top-p (`--top-p`): one decode step's draw (`jgrpo.draws.sample_token`, temperature 1, top_p
0.9) of 16 rows over SmolLM2's 49,152-entry and Qwen2.5's 151,936-entry vocabularies, the
portable (GPU/TPU) path's threshold (top 16 checked, else bisection) against bisection for
every row (the CPU path's, and the portable path's before), interleaved, medians: on peaked
rows (Zipf-like logits, a language model's shape: the 16 largest hold the nucleus) and flat
rows (every row falls back to bisection).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from jgrpo.config import ModelConfig
from jgrpo.models import Transformer, TransformerConfig, load_policy, policy_config
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
            # None: t(N) <= t(1), the decode steps drowned in the timer's noise (a loaded machine)
            decode_ms=1e3 * (full - prefill) / (new_tokens - 1) if full > prefill else None,
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
        cells = [f"{'noise':>14s}" if r[key] is None else fmt.format(r[key]) for r in (o, t)]
        ratio = (
            ""
            if higher is None or None in (o[key], t[key])
            else f"{(o[key] / t[key] if higher else t[key] / o[key]):9.1f}x"
        )
        print(f"{label:28s}" + "".join(cells) + f"{ratio:>10s}")
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


# ------------------------------------------------------------------------ decode slots
SLOT_PROMPTS, SLOT_GROUP, SLOT_PROMPT_LEN = 16, 8, 64
"""The slot workloads: 16 prompts x 8 rows (one GRPO step's groups), 64-token prompts."""
TINY_SHAPE = TransformerConfig(
    family="qwen2",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    attention_bias=True,
    max_position_embeddings=1024,
)
"""Config A's shape (d 64, 2 layers, 4 heads, 2 kv heads) with a 512-token vocabulary, so the
stop set of the skewed workload gives a median of N / 8 closely."""


def uniform_draw_model(shape: TransformerConfig, seed: int = 0) -> Transformer:
    """A model of `shape` (untied) with random weights and an all-zero LM head: every logit is
    0 in every context, so each token is drawn uniformly; its forward costs what any weights
    cost (dense matmuls)."""
    model = Transformer(
        dataclasses.replace(shape, tie_word_embeddings=False, lora=None), rngs=nnx.Rngs(seed)
    )
    model.lm_head[...] = jnp.zeros_like(model.lm_head[...])
    return model


def skewed_stops(vocab: int, new_tokens: int) -> tuple[int, ...]:
    """Ids 1..k, k = round(V (1 - 2^(-8/N))): under uniform draws a row stops at each token
    with probability k / V, so its length is geometric with median ~N / 8 (0 is the pad)."""
    k = max(1, round(vocab * (1 - 0.5 ** (8 / new_tokens))))
    return tuple(range(1, k + 1))


def bench_slots(name, shape, new_tokens, variants, rounds, block=1, warm=0, kernels="auto"):
    """variants: (workload "skewed" | "uniform", shared prefill, decode_slots | "compact") triples;
    the one with (workload, False, None) is today's default program, its workload's reference.
    -> {variant: row of the table}; prints the table."""
    model = uniform_draw_model(dataclasses.replace(shape, kernels=kernels))
    stops = skewed_stops(shape.vocab_size, new_tokens)
    rng = np.random.RandomState(0)
    prompts = [
        rng.randint(len(stops) + 1, shape.vocab_size, SLOT_PROMPT_LEN).tolist()
        for _ in range(SLOT_PROMPTS)
    ]
    rows = [p for p in prompts for _ in range(SLOT_GROUP)]
    key = jax.random.key(0)

    def call(workload, shared, slots):
        params = SamplingParams(
            max_new_tokens=new_tokens,
            temperature=1.0,
            stop_token_ids=stops if workload == "skewed" else (),
            ignore_eos=True,
            pad_id=0,
            prompt_bucket=SLOT_PROMPT_LEN,
            decode_slots=None if slots == "compact" else slots,
            compact_decode=slots == "compact",
        )
        group = SLOT_GROUP if shared else 1
        return lambda: generate(model, rows, params, key, group_size=group)

    timings = timed_round_robin({v: call(*v) for v in variants}, rounds, block, warm)
    out = {}
    for (workload, shared, slots), (first, median, gen) in timings.items():
        today = timings.get((workload, False, None))
        tokens = int(gen.lengths.sum())
        out[(workload, shared, slots)] = dict(
            tokens_per_s=tokens / median,
            median_s=median,
            tokens=tokens,
            decode_steps=gen.num_decode_steps,
            vs_today=None if today is None else today[1] / median,
            compile_s=first - median,
            same_tokens=None
            if today is None
            else bool(np.array_equal(gen.tokens, today[2].tokens)),
            median_length=float(np.median(gen.lengths)),
            max_length=int(gen.lengths.max()),
        )
    print(
        f"\n== decode slots, {name} (d {shape.hidden_size}, {shape.num_layers} layers, vocab "
        f"{shape.vocab_size}): {SLOT_PROMPTS} prompts x {SLOT_GROUP} rows, {SLOT_PROMPT_LEN}-token "
        f"prompts, cap {new_tokens}, T=1; jax {jax.default_backend()} (kernels "
        f"{resolve_kernels(kernels)}); medians"
    )
    print(
        f"{'workload':10s}{'shared':>8s}{'slots':>9s}{'tok/s':>10s}{'s':>9s}{'steps':>7s}"
        f"{'vs today':>10s}{'compile s':>11s}{'same tokens':>13s}{'median/max len':>16s}"
    )
    for (workload, shared, slots), r in out.items():
        ratio = "-" if r["vs_today"] is None else f"{r['vs_today']:.2f}x"
        same = "-" if r["same_tokens"] is None else ("yes" if r["same_tokens"] else "NO")
        print(
            f"{workload:10s}{'yes' if shared else 'no':>8s}{str(slots or 'all'):>9s}"
            f"{r['tokens_per_s']:10.0f}{r['median_s']:9.3f}{r['decode_steps']:7d}{ratio:>10s}"
            f"{r['compile_s']:11.1f}{same:>13s}"
            f"{r['median_length']:>9.0f} / {r['max_length']:<4d}"
        )
    return out


SLOT_COUNTS = {"tiny": (None, "compact", 64, 32, 16), "smollm2": (None, "compact", 32)}
"""Slot counts per shape (None = every row: today's program; "compact": every row, the batch
narrowing as rows stop, `rollout.compact_decode`)."""


def slot_variants(size: str, quick: bool = False) -> list[tuple[str, bool, int | str | None]]:
    """The (workload, shared prefill, slots) of a shape's table: every slot count with and
    without shared prefill on the skewed workload, without on the uniform one (SmolLM2: the
    uniform rows take minutes each; quick: today's, compact and 32 slots, skewed, no sharing)."""
    if quick:
        return [("skewed", False, None), ("skewed", False, "compact"), ("skewed", False, 32)]
    skewed = [("skewed", sh, slots) for sh in (False, True) for slots in SLOT_COUNTS[size]]
    uniform = [("uniform", False, slots) for slots in SLOT_COUNTS[size]]
    if size == "tiny":
        uniform += [("uniform", True, slots) for slots in SLOT_COUNTS[size]]
    return skewed + uniform


def smollm2_shape() -> TransformerConfig:
    """SmolLM2-135M's architecture (its config.json; float32)."""
    return policy_config(ModelConfig(path="smollm2", compute_dtype="float32", remat="none"))


def bench_all_slots(
    quick: bool, with_smollm2: bool, kernels: str = "auto", with_tiny: bool = True
) -> dict:
    """The decode-slot tables of the tiny shape (cap 256; quick: 32) and SmolLM2-135M's (cap
    64, to keep its uniform rows short) -> {shape: {variant: row}}."""
    results = {}
    tiny_rounds, tiny_block = (1, 1) if quick else (3, 3)
    if with_tiny:
        results["tiny"] = bench_slots(
            "tiny",
            TINY_SHAPE,
            32 if quick else 256,
            slot_variants("tiny", quick),
            tiny_rounds,
            tiny_block,
            1,
            kernels,
        )
    if with_smollm2:
        results["smollm2"] = bench_slots(
            "SmolLM2-135M", smollm2_shape(), 64, slot_variants("smollm2"), 2, 1, 0, kernels
        )
    return results


def bench_top_p(rounds: int, calls: int = 20):
    """`--top-p`: the draw's median time per call, sort-free threshold vs bisection only."""
    from jgrpo import draws

    def bisection_only(x_bv, top_p, path):
        probs_bv = jax.nn.softmax(x_bv, axis=-1)
        return draws._bisect_threshold(x_bv, draws._order_keys(x_bv), probs_bv, top_p)

    def make_draw(threshold):
        def draw(x_bv, keys_b):
            saved, draws._nucleus_threshold = draws._nucleus_threshold, threshold
            try:  # traced once: the jit keeps the threshold it traced with
                return draws.sample_token(x_bv, keys_b, 1.0, 0.9, None, True, path="portable")
            finally:
                draws._nucleus_threshold = saved

        return jax.jit(draw)

    arms = {
        "top16+check": make_draw(draws._nucleus_threshold),
        "bisection": make_draw(bisection_only),
    }
    rng = np.random.RandomState(0)
    keys_b = jax.random.split(jax.random.key(0), 16)
    print(f"\n== top-p draw, 16 rows, top_p 0.9, {rounds} rounds x {calls} calls (ms per draw)")
    for v in (49152, 151936):
        ranks_bv = np.argsort(rng.rand(16, v), axis=-1) + 1
        rows = {
            "peaked": jnp.asarray(-2.0 * np.log(ranks_bv), jnp.float32),
            "flat": jnp.asarray(rng.randn(16, v) * 0.5, jnp.float32),
        }
        for kind, x_bv in rows.items():
            times = {name: [] for name in arms}
            for fn in arms.values():
                jax.block_until_ready(fn(x_bv, keys_b))  # compile
            for _ in range(rounds):
                for name, fn in arms.items():
                    start = time.perf_counter()
                    for _ in range(calls):
                        jax.block_until_ready(fn(x_bv, keys_b))
                    times[name].append((time.perf_counter() - start) / calls)
            new, old = (statistics.median(times[n]) * 1e3 for n in arms)
            print(
                f"V {v:>6} {kind:>6}: top16+check {new:7.2f}  bisection {old:7.2f}  "
                f"ratio {old / new:5.2f}x"
            )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="config A only, 3 rounds")
    parser.add_argument("--config", choices=["A", "B", "all"], default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument(
        "--kernels", choices=KERNEL_CHOICES, default="auto", help="jgrpo.models.kernels path"
    )
    parser.add_argument("--slots", action="store_true", help="the decode-slot table instead")
    parser.add_argument("--top-p", action="store_true", help="the top-p draw timing instead")
    args = parser.parse_args(argv)
    if args.top_p:
        bench_top_p(args.rounds or 5)
        return
    config = args.config or ("A" if args.quick else "all")
    if args.slots:
        from bench_limits import machine_limits  # tools/: the limits `make bench` reports

        limits = machine_limits(3 if args.quick else 10)
        print(
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores: "
            f"matmul {limits['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s, memory read "
            f"{limits['memory_read_bytes_per_s'] / 1e9:.1f} GB/s"
        )
        bench_all_slots(args.quick, config in ("B", "all"), args.kernels, config in ("A", "all"))
        return
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
