"""This machine's limits and the sampler's flop count, shared by the benchmarks in tools/.

    machine_limits(repeats)   the float32 large-matmul FLOP/s (2048^3 under jax) and the memory
                              read bandwidth (a jitted sum over 512 MiB), medians of `repeats`
    generation_flops(...)     the matmul flops of sampling, the numerator of a sampler's FLOP/s

tools/bench.py (`make bench`) and every tools/bench_*.py compare their phases with these, so
they live below all of them (imports flow one way: no benchmark imports bench.py for them).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_time(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile, warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_limits(repeats: int) -> dict:
    n = 2048
    a = jnp.asarray(np.random.RandomState(0).rand(n, n), jnp.float32)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul_s = median_time(lambda: matmul(a, a), repeats)
    big = jnp.ones((2**27,), jnp.float32)  # 512 MiB
    total = jax.jit(jnp.sum)
    read_s = median_time(lambda: total(big), repeats)
    return {
        "matmul_flops_per_s": 2 * n**3 / matmul_s,
        "memory_read_bytes_per_s": big.nbytes / read_s,
    }


def generation_flops(model_cfg, rows: int, prompt: int, new: int) -> float:
    """Matmul flops of sampling `new` tokens for `rows` rows after a `prompt`-token prefill:
    each token's projections, MLP and LM head (2 x their weights), plus attention over the
    cache (4 x heads x head_dim x positions attended, per layer)."""
    m = model_cfg
    per_token = 2 * (
        m.num_layers
        * (
            m.hidden_size * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
            + m.num_heads * m.head_dim * m.hidden_size
            + 3 * m.hidden_size * m.intermediate_size
        )
        + m.hidden_size * m.vocab_size
    )
    attention = 4 * m.num_layers * m.num_heads * m.head_dim
    prefill = prompt * per_token + attention * prompt * (prompt + 1) / 2
    decode = sum(per_token + attention * (prompt + i) for i in range(1, new))
    return float(rows * (prefill + decode))
