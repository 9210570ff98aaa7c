"""MoE train step: grouped experts (sort + jax.lax.ragged_dot, work ~ t*k experts) vs the same
model with every expert computed densely (work ~ t*E), jgrpo.models.moe, on JAX's default
backend.

`step`: the whole jitted GRPO train step (`step_setup.build_step`: the ref, prev and policy
forwards, the backward and the update) of `builtin:tiny-qwen3-moe` (2 MoE layers, 8 experts,
top-2) on one device, the two expert paths built from the same weights and batch, timed in
interleaved rounds (grouped, dense, grouped, ...; each round `--calls` calls of each, compile
excluded); median ms per step, and the largest difference of the parameters after one step
from the same state. The path is chosen by pointing the kernel path in use at the other expert
implementation (`moe.EXPERT_PATHS`, read at trace time) while each step compiles: attention
and everything else stay the same program.
`block`: the expert block alone (`experts_grouped` / `experts_dense`), forward and gradient,
on three shapes (tokens t, d, expert f, experts e, top k): small 256x64x32, 8 experts, top-2;
mid 1024x256x128, 16 experts, top-4; decode 16x256x128, 16 experts, top-4.

    python tools/bench_moe.py [--rows 32] [--seq 128] [--rounds 5] [--calls 3] [--no-block]
    python tools/bench_moe.py --smoke     # 8 rows x 32 tokens, 1 round, no block: the test's
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.models import moe

SHAPES = {
    "small": (256, 64, 32, 8, 2),
    "mid": (1024, 256, 128, 16, 4),
    "decode": (16, 256, 128, 16, 4),
}
PATHS = ("grouped", "dense")


@contextlib.contextmanager
def expert_path(name: str):
    """Every kernel path runs the `name` experts while this is open (traces made inside keep it)."""
    saved = dict(moe.EXPERT_PATHS)
    moe.EXPERT_PATHS.update({k: name for k in saved})
    try:
        yield
    finally:
        moe.EXPERT_PATHS.update(saved)


def _host_batch(rows: int, seq: int, vocab: int, group: int) -> dict:
    rng = np.random.RandomState(0)
    token_mask = np.zeros((rows, seq), np.float32)
    token_mask[:, seq // 4 :] = 1
    return {
        "input_ids": rng.randint(1, vocab, (rows, seq)).astype(np.int32),
        "attention_mask": np.ones((rows, seq), np.float32),
        "token_mask": token_mask,
        "generation_logprobs": -rng.rand(rows, seq).astype(np.float32),
        "rewards": rng.randint(0, 2, rows).astype(np.float32),
        "group_ids": (np.arange(rows) // group).astype(np.int32),
        "sample_mask": np.ones(rows, np.float32),
    }


def bench_step(rows: int, seq: int, rounds: int, calls: int) -> dict:
    """{path: median ms of the whole train step, ...} for the tiny MoE model (module docstring)."""
    from jgrpo import sharding, step_setup
    from jgrpo.batch import TrainBatch
    from jgrpo.config import load_config
    from jgrpo.models import load_policy

    group = 4
    cfg = load_config(
        None,
        [
            "model.path=builtin:tiny-qwen3-moe",
            "model.dtype=float32",
            f"grpo.num_prompts_per_step={rows // group}",
            f"grpo.num_generations_per_prompt={group}",
            "loss.reference_policy_kl_penalty=0.05",
            "grpo.sequence_packing=false",  # the padded step on full rows
            "mesh.data=1",
        ],
    )
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    model = load_policy(cfg.model, seed=0)
    host = _host_batch(rows, seq, model.cfg.vocab_size, group)
    batch = TrainBatch(**host).shard(mesh)
    runs, updated, texts = {}, {}, {}
    for path in PATHS:
        # a fresh jitted step per path (jit caches its trace), and its own copy of the state
        # (the step donates, and so deletes, its input)
        built = step_setup.build_step(cfg, model, mesh=mesh)
        args = [jax.tree.map(jnp.array, built.state), batch, built.hparams, built.ref_params]
        args.append(built.frozen)
        with expert_path(path):
            compiled = built.step_fn.lower(*args).compile()
        runs[path], texts[path] = (compiled, args), compiled.as_text()
    if texts["grouped"] == texts["dense"]:
        raise RuntimeError("bench_moe: both expert paths compiled to the same program")
    for path in PATHS:  # the first step of each from the same state: the same update
        compiled, args = runs[path]
        args[0], _ = compiled(*args)
        updated[path] = jax.tree.leaves(args[0].params)
    leaves = zip(updated["grouped"], updated["dense"])
    params_diff = max(float(jnp.abs(a - b).max()) for a, b in leaves)  # before donation
    times = {path: [] for path in PATHS}
    for _ in range(rounds):
        for path in PATHS:
            compiled, args = runs[path]
            for _ in range(calls):
                start = time.perf_counter()
                args[0], metrics = compiled(*args)
                jax.block_until_ready(metrics)
                times[path].append(1e3 * (time.perf_counter() - start))
    grouped, dense = (statistics.median(times[p]) for p in PATHS)
    return {
        "model": "builtin:tiny-qwen3-moe",
        "rows": rows,
        "seq": seq,
        "rounds": rounds,
        "calls": calls,
        "grouped_ms": grouped,
        "dense_ms": dense,
        "dense_vs_grouped": dense / grouped,
        "params_max_diff": params_diff,
    }


def _inputs(t, d, f, e, k):
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (t, d))
    gate, up = (jax.random.normal(kk, (e, d, f)) * 0.1 for kk in ks[1:3])
    down = jax.random.normal(ks[3], (e, f, d)) * 0.1
    ids = jax.vmap(lambda kk: jax.random.permutation(kk, e)[:k])(jax.random.split(ks[4], t))
    return x, ids, jnp.full((t, k), 1.0 / k), gate, up, down


def bench_block(rounds: int, calls: int) -> dict:
    """{shape: {"<path> fwd" / "<path> grad": median ms, "max_diff": ...}} of the expert block."""
    paths = {"grouped": moe.experts_grouped, "dense": moe.experts_dense}
    out = {}
    for name, shape in SHAPES.items():
        inputs = _inputs(*shape)
        fns = {}
        for path, fn in paths.items():
            grad = jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) ** 2), argnums=(0, 3, 4, 5))
            fns[path] = (jax.jit(fn), jax.jit(grad))
        times = {f"{p} {w}": [] for p in paths for w in ("fwd", "grad")}
        for _ in range(rounds):
            for path, (fwd, grad) in fns.items():
                for which, f in (("fwd", fwd), ("grad", grad)):
                    jax.block_until_ready(f(*inputs))
                    for _ in range(calls):
                        start = time.perf_counter()
                        jax.block_until_ready(f(*inputs))
                        times[f"{path} {which}"].append(1e3 * (time.perf_counter() - start))
        diff = jnp.abs(fns["grouped"][0](*inputs) - fns["dense"][0](*inputs)).max()
        out[name] = {k: statistics.median(v) for k, v in times.items()}
        out[name]["max_diff"] = float(diff)
    return out


def run(rows=32, seq=128, rounds=5, calls=3, block=True) -> dict:
    """The report: {"backend", "step": bench_step(...), "block": bench_block(...) or absent}."""
    report = {"backend": jax.default_backend(), "step": bench_step(rows, seq, rounds, calls)}
    if block:
        report["block"] = bench_block(rounds, calls)
    return report


def print_report(report: dict) -> None:
    s = report["step"]
    head = f"{s['model']}, {s['rows']} rows x {s['seq']} tokens ({report['backend']})"
    print(f"== MoE train step, {head}")
    print(
        f"grouped experts {s['grouped_ms']:.1f} ms  every expert dense {s['dense_ms']:.1f} ms  "
        f"dense / grouped {s['dense_vs_grouped']:.2f}  (median of {s['rounds']} interleaved rounds "
        f"x {s['calls']} calls; params after one step differ by {s['params_max_diff']:.1e})"
    )
    for name, row in report.get("block", {}).items():
        cells = " ".join(f"{k} {v:.3f} ms" for k, v in row.items() if k != "max_diff")
        print(f"block {name} {SHAPES[name]}: {cells}; max diff {row['max_diff']:.2e}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--no-block", action="store_true", help="skip the expert-block table")
    ap.add_argument("--smoke", action="store_true", help="8 rows x 32 tokens, 1 round, no block")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.seq, args.rounds, args.calls, args.no_block = 8, 32, 1, 1, True
    report = run(args.rows, args.seq, args.rounds, args.calls, not args.no_block)
    print_report(report)
    return report


if __name__ == "__main__":
    main()
