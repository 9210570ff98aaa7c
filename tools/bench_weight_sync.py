"""Weight sync to Ray rollout workers: the publish + pull of one step, per leaf vs packed.

    python tools/bench_weight_sync.py [--rounds 5] [--dtype float32|bfloat16] [--tiny]

A random SmolLM2-135M-shaped parameter tree (`--tiny`: the tiny test model) on this process's
default device, a local Ray cluster (one CPU). Two arms, interleaved per round, medians:
- per leaf (what `RayRollout.publish` runs): `jax.device_get(tree)` (one device->host copy
  per leaf, all started before any is waited for), one `ray.put` of the whole tree; the pull:
  `ray.get` + `jax.device_put(tree)` (one host->device copy per leaf);
- packed (the alternative measured, not adopted: docs/performance.md): every leaf bitcast to
  bytes and concatenated into one array on the device, one device->host copy, `ray.put`; the
  pull: `ray.get`, one host->device copy, split on the device.
publish = the trainer's `perf/weight_sync_s`; pull = a worker's `rollout/weight_pull_s` (here
pulled by the driver from the same node's object store, as a worker on the trainer's node is).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import ray
from flax import nnx

from jgrpo.models import Transformer, TransformerConfig
from jgrpo.models.tiny import tiny_model_fields


@dataclasses.dataclass(frozen=True)
class Packed:
    """A parameter tree as one host uint8 array, and where each leaf lies in it."""

    data: np.ndarray
    treedef: Any
    leaves: tuple  # (shape, dtype name) per leaf, in order


@jax.jit
def _concat_bytes(leaves):
    return jnp.concatenate([jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1) for x in leaves])


def pack_weights(tree) -> Packed:
    leaves, treedef = jax.tree.flatten(tree)
    layout = tuple((tuple(x.shape), jnp.dtype(x.dtype).name) for x in leaves)
    return Packed(np.asarray(jax.device_get(_concat_bytes(leaves))), treedef, layout)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _split_bytes(data, treedef, layout):
    leaves, offset = [], 0
    for shape, dtype in layout:
        itemsize = jnp.dtype(dtype).itemsize
        size = math.prod(shape) * itemsize
        chunk = jax.lax.slice_in_dim(data, offset, offset + size)
        chunk = chunk.reshape(shape if itemsize == 1 else (*shape, itemsize))
        leaves.append(jax.lax.bitcast_convert_type(chunk, jnp.dtype(dtype)))
        offset += size
    return jax.tree.unflatten(treedef, leaves)


def unpack_weights(packed: Packed):
    return _split_bytes(jax.device_put(packed.data), packed.treedef, packed.leaves)


SMOLLM2 = dict(
    family="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    tie_word_embeddings=True,
)


def per_leaf(params):
    start = time.perf_counter()
    ref = ray.put(jax.device_get(params))
    published = time.perf_counter()
    jax.block_until_ready(jax.device_put(ray.get(ref)))
    return published - start, time.perf_counter() - published


def packed(params):
    start = time.perf_counter()
    ref = ray.put(pack_weights(params))
    published = time.perf_counter()
    jax.block_until_ready(unpack_weights(ray.get(ref)))
    return published - start, time.perf_counter() - published


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32", help="the parameters' stored dtype")
    ap.add_argument("--tiny", action="store_true", help="the tiny test model instead")
    args = ap.parse_args(argv)
    fields = tiny_model_fields() if args.tiny else SMOLLM2
    cfg = TransformerConfig(**fields, param_dtype=args.dtype)
    params = nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    leaves = jax.tree.leaves(params)
    mib = sum(x.nbytes for x in leaves) / 2**20
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    arms = {"per leaf": per_leaf, "packed": packed}
    times = {name: ([], []) for name in arms}
    for fn in arms.values():
        fn(params)  # compiles the pack/split, warms the object store
    for _ in range(args.rounds):
        for name, fn in arms.items():
            publish, pull = fn(params)
            times[name][0].append(publish)
            times[name][1].append(pull)
    ray.shutdown()
    print(
        f"{'tiny' if args.tiny else 'SmolLM2-135M'}-shaped {args.dtype}: {len(leaves)} leaves, "
        f"{mib:.0f} MiB, {jax.default_backend()}, {args.rounds} rounds (medians, s)"
    )
    med = {name: [statistics.median(t) for t in pair] for name, pair in times.items()}
    for name, (publish, pull) in med.items():
        print(f"{name:>9}: publish {publish:.4f}  pull {pull:.4f}  total {publish + pull:.4f}")
    before, after = (sum(med[n]) for n in arms)
    print(
        f"packed / per leaf: publish {med['packed'][0] / med['per leaf'][0]:.2f}x, "
        f"total {after / before:.2f}x"
    )


if __name__ == "__main__":
    main()
