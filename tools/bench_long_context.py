"""Long rows: blockwise attention (jgrpo.models.blockwise) vs the materialised attention.

For each row length, one layer's causal attention (the tiny MoE/Qwen shape's 4 heads / 2 kv
heads of 16 dims, 1 row) forward + backward, jitted: XLA's temporaries of the compiled program
(`memory_analysis().temp_size_in_bytes`, what grows with t) and the median wall time of calls
interleaved between the two paths. Then the tiny model's gradient of a row of `--model-tokens`
tokens with the blockwise path, its temporaries and time: the "8k-token row on CPU" check.

    python tools/bench_long_context.py                       # 1k 2k 4k 8k, block 512
    python tools/bench_long_context.py --lengths 2048 --calls 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.models import kernels
from jgrpo.models.blockwise import RowMask, blockwise_attention


def _attention_grad(path: str, block: int):
    def loss(q, k, v, valid):
        if path == "blockwise":
            out = blockwise_attention(q, k, v, valid, block=block)
        else:
            out = kernels.attention(q, k, v, RowMask(valid).dense(), "cpu")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _median_s(fn, args, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_table(lengths, block: int, calls: int, heads=4, kv_heads=2, head_dim=16):
    rng = np.random.default_rng(0)
    rows = []
    for t in lengths:
        q = jnp.asarray(rng.normal(size=(1, t, heads, head_dim)), jnp.float32)
        k = jnp.asarray(rng.normal(size=(1, t, kv_heads, head_dim)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(1, t, kv_heads, head_dim)), jnp.float32)
        args = (q, k, v, jnp.ones((1, t), bool))
        row = {"tokens": t}
        fns = {}
        for path in ("materialised", "blockwise"):
            compiled = _attention_grad(path, block).lower(*args).compile()
            row[f"{path}_temp_mib"] = compiled.memory_analysis().temp_size_in_bytes / 2**20
            fns[path] = compiled
            jax.block_until_ready(compiled(*args))  # warm
        samples = {p: [] for p in fns}
        for _ in range(calls):  # interleaved: drift on a shared machine hits both alike
            for path, fn in fns.items():
                samples[path].append(_median_s(fn, args, 1))
        for path in fns:
            row[f"{path}_s"] = statistics.median(samples[path])
        row["time_ratio"] = row["blockwise_s"] / row["materialised_s"]
        rows.append(row)
        print(
            f"t={t:6d}  temporaries: materialised {row['materialised_temp_mib']:9.1f} MiB, "
            f"blockwise {row['blockwise_temp_mib']:7.1f} MiB   time: materialised "
            f"{row['materialised_s'] * 1e3:8.1f} ms, blockwise {row['blockwise_s'] * 1e3:8.1f} ms "
            f"(x{row['time_ratio']:.2f})",
            flush=True,
        )
    return rows


def model_row(tokens: int, block: int, calls: int) -> dict:
    """The tiny Qwen2 model's gradient of one row's summed token logprobs at `tokens`."""
    from flax import nnx

    from jgrpo.models import Transformer, TransformerConfig
    from jgrpo.models.tiny import tiny_model_fields

    fields = tiny_model_fields() | {"max_position_embeddings": tokens, "remat": "full"}
    cfg = TransformerConfig(**fields, attention_block_size=block)
    graph, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 60, size=(1, tokens)), jnp.int32)

    def loss(params):
        return jnp.sum(nnx.merge(graph, params).token_logprobs(ids))

    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    jax.block_until_ready(compiled(params))
    seconds = _median_s(compiled, (params,), calls)
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
    print(f"tiny model, 1 row of {tokens} tokens: grad {seconds:.2f} s, temporaries {temp:.1f} MiB")
    return {"tokens": tokens, "grad_s": seconds, "temp_mib": temp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--model-tokens", type=int, default=8192)
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.default_backend()}, block {args.block}")
    attention_table(args.lengths, args.block, args.calls)
    if args.model_tokens:
        model_row(args.model_tokens, args.block, max(1, args.calls // 2))


if __name__ == "__main__":
    main()
