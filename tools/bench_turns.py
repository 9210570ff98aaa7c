"""Continuing a multi-turn rollout: re-prefill the conversation, or keep the KV cache?

The workload is a turn loop with fixed shapes: B rows, a P-token prompt, T turns of G generated
tokens (greedy, EOS ignored) each answered by an R-token reply. Two ways to run turn t >= 2:

- re-prefill (what jgrpo.rollout.turns does): one `sampling.generate` call whose prompt is the
  whole conversation so far: one prefill forward over it, then G decode steps;
- kept cache (a prototype, here only): the KV cache of turn t - 1 stays on the device, sized for
  the whole conversation from turn 1; turn t feeds the previous turn's last token and the R
  reply ids through the decode step one at a time (teacher forcing), then decodes G tokens, each
  step attending only the slots filled so far (rounded up to 16, as the sampler's segments).
  Feeding the reply in one forward against the cache would need a prefill-with-past kernel the
  model does not have.

Both sides run the same model and kernels, jitted, with the same G decode steps per turn; what
differs is prefill(conversation) vs (R + 1) decode steps. Reported: per configuration, the
median time of turns 2..T (each side's calls interleaved in rounds, after one compile call),
and the machine's limits (tools/bench_limits.py's `machine_limits`).

    python tools/bench_turns.py            # tiny (d 64) and SmolLM2-135M, 3 turns
    python tools/bench_turns.py --quick    # tiny only, fewer rounds
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.config import ModelConfig
from jgrpo.models import load_policy
from jgrpo.models.kernels import cache_slots, resolve_kernels
from jgrpo.models.tiny import build_tiny_model
from jgrpo.sampling import SamplingParams, generate

ALIGN = 16


def round_up(x: int, m: int = ALIGN) -> int:
    return -(-x // m) * m


# ----------------------------------------------------------------------------- kept cache


@functools.partial(jax.jit, static_argnames=("cache_len", "new"))
def kept_first_turn(model, prompt_bt, *, cache_len, new):
    """Turn 1: prefill into a cache of `cache_len` slots, then `new` greedy decode steps."""
    b, p = prompt_bt.shape
    positions = jnp.broadcast_to(jnp.arange(p), (b, p))
    mask = jnp.ones((b, p), bool)
    layers = model.layer_weights()
    logits, cache = model.prefill(prompt_bt, positions, mask, cache_len, last_layer=layers[-1])
    return _decode(model, layers, cache, logits, p, new, round_up(p + new))


@functools.partial(jax.jit, static_argnames=("start", "new", "attend"), donate_argnums=(1,))
def kept_next_turn(model, cache, feed_bf, *, start, new, attend):
    """Turn t: feed `feed_bf` (the last generated token, then the reply) from slot `start`,
    then `new` greedy decode steps; attention reads slots [0, attend)."""
    layers = model.layer_weights()
    b, f = feed_bf.shape
    kv_mask = _slots_mask(model, cache, b)

    def feed(j, carry):
        _, cache = carry
        token = jax.lax.dynamic_index_in_dim(feed_bf, j, axis=1, keepdims=False)
        pos = jnp.full((b,), start + j, jnp.int32)
        return model.decode_step(layers, token, pos, kv_mask, cache, start + j, attend)

    logits0 = jnp.zeros((b, model.cfg.vocab_size), jnp.float32)
    logits, cache = jax.lax.fori_loop(0, f, feed, (logits0, cache))
    return _decode(model, layers, cache, logits, start + f, new, attend)


def _slots_mask(model, cache, b):
    return jnp.ones((b, cache_slots(cache.keys[0], resolve_kernels(model.cfg.kernels))), bool)


def _decode(model, layers, cache, logits, first_slot, new, attend):
    b = logits.shape[0]
    kv_mask = _slots_mask(model, cache, b)
    tokens = jnp.zeros((b, new), jnp.int32)

    def step(i, carry):
        logits, cache, tokens = carry
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tokens = tokens.at[:, i].set(token)
        pos = jnp.full((b,), first_slot + i, jnp.int32)
        logits, cache = model.decode_step(
            layers, token, pos, kv_mask, cache, first_slot + i, attend
        )
        return logits, cache, tokens

    # the last token's forward feeds the next turn (kept_next_turn feeds it): new - 1 steps
    logits, cache, tokens = jax.lax.fori_loop(0, new - 1, step, (logits, cache, tokens))
    tokens = tokens.at[:, new - 1].set(jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return tokens, cache


def kept_conversation(model, prompts, replies, turns, new):
    """Every turn's time (s) with the kept cache; tokens of the last turn."""
    b, p = prompts.shape
    r = replies.shape[1]
    cache_len = round_up(p + turns * (new + r + 1))
    times = []
    start = time.perf_counter()
    tokens, cache = kept_first_turn(model, jnp.asarray(prompts), cache_len=cache_len, new=new)
    jax.block_until_ready(tokens)
    times.append(time.perf_counter() - start)
    slot = p + new - 1  # the last generated token is not in the cache yet
    for _ in range(1, turns):
        feed = np.concatenate([np.asarray(tokens)[:, -1:], replies], axis=1)
        attend = round_up(slot + feed.shape[1] + new)
        start = time.perf_counter()
        tokens, cache = kept_next_turn(
            model, cache, jnp.asarray(feed), start=slot, new=new, attend=attend
        )
        jax.block_until_ready(tokens)
        times.append(time.perf_counter() - start)
        slot += feed.shape[1] + new - 1
    return times, np.asarray(tokens)


# ----------------------------------------------------------------------------- re-prefill


def reprefill_conversation(model, prompts, replies, turns, new):
    """Every turn's time (s) with jgrpo's sampler re-prefilling the conversation."""
    params = SamplingParams(
        max_new_tokens=new, temperature=0.0, ignore_eos=True, prompt_bucket=ALIGN
    )
    rows = [list(map(int, row)) for row in prompts]
    times = []
    key = jax.random.key(0)
    for _ in range(turns):
        start = time.perf_counter()
        gen = generate(model, rows, params, key)
        times.append(time.perf_counter() - start)
        rows = [row + gen.tokens[i].tolist() + replies[i].tolist() for i, row in enumerate(rows)]
    return times, gen.tokens


# ----------------------------------------------------------------------------- driver


def bench(model, rows, prompt, reply, new, turns, rounds):
    rng = np.random.RandomState(0)
    vocab = model.cfg.vocab_size
    prompts = rng.randint(5, min(vocab, 250), (rows, prompt)).astype(np.int32)
    replies = rng.randint(5, min(vocab, 250), (rows, reply)).astype(np.int32)
    sides = {
        "reprefill": lambda: reprefill_conversation(model, prompts, replies, turns, new),
        "kept_cache": lambda: kept_conversation(model, prompts, replies, turns, new),
    }
    first = {name: fn() for name, fn in sides.items()}  # compiles
    same = bool((first["reprefill"][1] == first["kept_cache"][1]).mean() > 0.9)
    later = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            times, _ = fn()
            later[name].append(sum(times[1:]))
    med = {name: statistics.median(v) for name, v in later.items()}
    return {
        "rows": rows,
        "prompt": prompt,
        "reply": reply,
        "new": new,
        "turns": turns,
        "rounds": rounds,
        "turns_2_to_T_s": med,
        "kept_over_reprefill": med["kept_cache"] / med["reprefill"],
        "same_greedy_tokens": same,
    }


def main(argv=None) -> dict:
    import sys

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny only, 3 rounds")
    ap.add_argument("--out", default=None, help="also write the report as JSON here")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_limits import machine_limits

    report = {"backend": jax.default_backend(), "machine": machine_limits(3 if args.quick else 5)}
    rounds = 3 if args.quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(Path(tmp) / "tiny", max_position_embeddings=1024)
        tiny = load_policy(ModelConfig(path=str(folder), compute_dtype="float32", remat="none"))
        report["tiny"] = [bench(tiny, 64, 64, r, 32, 3, rounds) for r in (32, 128)]
    if not args.quick:
        from jgrpo.models.sources import resolve_model_path

        path = resolve_model_path("smollm2")
        smol = load_policy(ModelConfig(path=str(path), compute_dtype="float32", remat="none"))
        report["smollm2"] = [bench(smol, 16, 64, r, 32, 3, max(2, rounds // 2)) for r in (32, 128)]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return report


if __name__ == "__main__":
    main()
