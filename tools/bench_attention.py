"""Train-forward attention kernels: the cpu path vs the portable path (jgrpo.models.kernels).

Times the jitted training forward (`Transformer.__call__` -> logits) and its gradient (of the
mean token logprob, what a policy loss differentiates) on random-weight models, once per kernel
path, on JAX's default backend. The two paths differ in attention (einsum over [b,k,t,g,s]
scores vs jax.nn.dot_product_attention) and in RoPE (trace-time tables vs run-time cos/sin).
Rounds interleave the paths (per round: 2 warm + `--calls` timed calls each), so drift on a
shared machine hits both alike; reported: medians over every timed call, and their ratio.

Configs: tiny = the sampler benchmark's tiny Qwen2 shape (d 64, 2 layers, 4 heads / 2 kv
heads), 16 rows x 64 tokens; smollm2 = SmolLM2-135M's shape (d 576, 30 layers, 9 / 3 heads,
vocab 49152), 16 rows x 64 tokens (random weights, nothing downloaded).

    python tools/bench_attention.py                  # both configs, 5 rounds
    python tools/bench_attention.py --config tiny --rounds 9
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jgrpo.losses import token_logprobs
from jgrpo.models import Transformer, TransformerConfig
from jgrpo.models.tiny import tiny_model_fields

CONFIGS = {
    "tiny": TransformerConfig(**tiny_model_fields(width=64, vocab_size=100)),
    "smollm2": TransformerConfig(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
    ),
}


def make_batch(cfg, rows, tokens, seed=0):
    """Left-padded prompts (up to 8 pad tokens) + completions right-padded after a random end."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, cfg.vocab_size, (rows, tokens)).astype(np.int32)
    mask = np.ones((rows, tokens), bool)
    for row in range(rows):
        mask[row, : rng.randint(0, 8)] = False
        mask[row, rng.randint(tokens // 2, tokens + 1) :] = False
    return jnp.asarray(ids), jnp.asarray(mask)


def bench_config(name, rows, tokens, rounds, calls):
    cfg = CONFIGS[name]
    base = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(base)
    ids, mask = make_batch(cfg, rows, tokens)

    def forward(state, graphdef):
        return nnx.merge(graphdef, state)(ids, attention_mask_bt=mask)

    def loss(state, graphdef):
        lp_bt = token_logprobs(forward(state, graphdef), ids, 1.0)
        return jnp.sum(lp_bt * mask) / jnp.sum(mask)

    fns = {}
    for path in ("cpu", "portable"):
        model = nnx.merge(graphdef, state)
        model.cfg = dataclasses.replace(cfg, kernels=path)
        gdef = nnx.graphdef(model)
        fns["forward", path] = jax.jit(forward, static_argnums=1), gdef
        fns["grad", path] = jax.jit(jax.grad(loss), static_argnums=1), gdef

    times = {key: [] for key in fns}
    for fn, gdef in fns.values():
        jax.block_until_ready(fn(state, gdef))  # compile
    for _ in range(rounds):
        for key, (fn, gdef) in fns.items():
            for _ in range(2):
                jax.block_until_ready(fn(state, gdef))
            for _ in range(calls):
                start = time.perf_counter()
                jax.block_until_ready(fn(state, gdef))
                times[key].append(time.perf_counter() - start)

    print(
        f"\n== {name}: {rows} rows x {tokens} tokens, float32, jax {jax.default_backend()}; "
        f"{rounds} rounds x {calls} calls"
    )
    print(f"{'ms (median [q1, q3])':22s}{'cpu':>22s}{'portable':>22s}{'portable/cpu':>14s}")
    for what in ("forward", "grad"):
        cells = []
        for path in ("cpu", "portable"):
            q1, med, q3 = (1e3 * x for x in statistics.quantiles(times[what, path], n=4))
            cells.append(f"{med:8.2f} [{q1:.2f}, {q3:.2f}]")
        ratio = statistics.median(times[what, "portable"]) / statistics.median(times[what, "cpu"])
        print(f"{what:22s}{cells[0]:>22s}{cells[1]:>22s}{ratio:14.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=["tiny", "smollm2", "all"], default="all")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=None, help="timed calls per round")
    args = parser.parse_args(argv)
    if args.config in ("tiny", "all"):
        bench_config("tiny", 16, 64, args.rounds, args.calls or 10)
    if args.config in ("smollm2", "all"):
        bench_config("smollm2", 16, 64, args.rounds, args.calls or 2)


if __name__ == "__main__":
    main()
