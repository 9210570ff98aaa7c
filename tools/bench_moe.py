"""MoE expert paths: `grouped` (sort + jax.lax.ragged_dot) vs `dense` (every expert on every
token), jgrpo.models.moe, on JAX's default backend: the jitted forward and its gradient (x and
the expert weights), median ms over interleaved rounds; the max difference of the outputs.

Shapes (tokens t, d, expert f, experts e, top k): small 256x64x32, 8 experts, top-2; mid
1024x256x128, 16 experts, top-4; decode 16x256x128, 16 experts, top-4 (one decode step).

    python tools/bench_moe.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from jgrpo.models import moe

SHAPES = {
    "small": (256, 64, 32, 8, 2),
    "mid": (1024, 256, 128, 16, 4),
    "decode": (16, 256, 128, 16, 4),
}


def _inputs(t, d, f, e, k):
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (t, d))
    gate, up = (jax.random.normal(kk, (e, d, f)) * 0.1 for kk in ks[1:3])
    down = jax.random.normal(ks[3], (e, f, d)) * 0.1
    ids = jax.vmap(lambda kk: jax.random.permutation(kk, e)[:k])(jax.random.split(ks[4], t))
    return x, ids, jnp.full((t, k), 1.0 / k), gate, up, down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    paths = {"grouped": moe.experts_grouped, "dense": moe.experts_dense}
    print(f"backend {jax.default_backend()}")
    for name, shape in SHAPES.items():
        inputs = _inputs(*shape)
        fns = {}
        for path, fn in paths.items():
            grad = jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) ** 2), argnums=(0, 3, 4, 5))
            fns[path] = (jax.jit(fn), jax.jit(grad))
        times = {(p, w): [] for p in paths for w in ("fwd", "grad")}
        for _ in range(args.rounds):
            for path, (fwd, grad) in fns.items():
                for which, f in (("fwd", fwd), ("grad", grad)):
                    jax.block_until_ready(f(*inputs))
                    for _ in range(args.calls):
                        start = time.perf_counter()
                        jax.block_until_ready(f(*inputs))
                        times[(path, which)].append(1e3 * (time.perf_counter() - start))
        diff = jnp.abs(fns["grouped"][0](*inputs) - fns["dense"][0](*inputs)).max()
        cells = " ".join(f"{p} {w} {statistics.median(v):.3f} ms" for (p, w), v in times.items())
        print(f"{name} {shape}: {cells}; max diff {float(diff):.2e}")


if __name__ == "__main__":
    main()
