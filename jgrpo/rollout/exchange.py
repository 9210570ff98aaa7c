"""Rows of a pod's rollout moved between hosts through the devices (dynamic sampling on a pod).

Every host feeds the train step its own rows of the global batch (`sharding.shard_batch`).
With dynamic sampling a row a host must feed may have been generated on another host, so
`exchange_rows` puts every host's generated rows on the mesh as one global pool (each host's
rows padded to a common count, split over the batch axes like a train batch), takes the picked
rows with one jitted gather whose output is split like a train batch (XLA moves the rows over
the devices' links: NCCL on GPU, gloo on CPU; the [B, T] arrays never pass through the
coordinator's key-value store), and returns this host's rows of the result as numpy, with
their positions in it: `shard_batch` of those rows puts them back where they are. XLA lowers
the gather to a masked local take and one all-reduce of the picked batch, so each device holds
the step's whole [B, T] batch for a moment (not the pool). One process: a numpy take.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jgrpo import distributed, sharding


def exchange_rows(
    local: Mapping[str, np.ndarray], source_b: np.ndarray, index_b: np.ndarray, mesh
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(rows, positions): this process's rows of the batch whose row i is row index_b[i] of
    process source_b[i]'s `local` arrays (all with the same leading count), and the i of each.

    Every process must call it with the same source_b / index_b (collective)."""
    index_b = np.asarray(index_b, np.int64)
    if not distributed.is_multiprocess():
        return {k: np.asarray(v)[index_b] for k, v in local.items()}, np.arange(len(index_b))
    local = {k: np.asarray(v) for k, v in local.items()}
    for key, value in local.items():
        if value.dtype.itemsize == 8:  # jax without x64 would narrow it silently
            raise TypeError(f"exchange_rows: {key} is {value.dtype}; 64-bit rows do not travel")
    moved = {k: v for k, v in local.items() if v.size}  # [B, 0] reward terms: nothing to move
    rows = len(next(iter(local.values())))
    most = max(int(n) for n in distributed.allgather(np.int64(rows)))
    parts = sharding.batch_shards(mesh)
    width = math.ceil(most / parts) * parts  # every host's pool padded to this many rows
    me = distributed.process_index()
    pool = {
        k: np.concatenate([v, np.zeros((width - rows, *v.shape[1:]), v.dtype)])
        for k, v in moved.items()
    }
    pool["origin"] = (me * width + np.arange(width)).astype(np.int32)
    take = (np.asarray(source_b, np.int64) * width + index_b).astype(np.int32)
    pool = sharding.shard_batch(pool, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    take = jax.make_array_from_process_local_data(replicated, take, take.shape)
    ndims = tuple(sorted((k, v.ndim) for k, v in moved.items()))
    out, positions = _gather_fn(mesh, ndims)(pool, take)
    result = {k: _local_rows(v) for k, v in out.items()}
    positions = _local_rows(positions)
    for key, value in local.items():
        if not value.size:
            result[key] = np.zeros((len(positions), *value.shape[1:]), value.dtype)
    return result, positions


@functools.lru_cache(maxsize=16)
def _gather_fn(mesh, ndims: tuple[tuple[str, int], ...]):
    """The jitted take of `exchange_rows` for arrays of these ranks (compiled per shape; on a
    pod every process starts a new program together: `distributed.align_first_runs`)."""

    def gather(pool, take_b):
        where = jnp.argsort(pool["origin"])[take_b]  # pool row of each origin id
        rows = {k: pool[k][where] for k, _ in ndims}
        return rows, jnp.arange(take_b.shape[0], dtype=jnp.int32)

    out = (
        {k: sharding.batch_sharding(mesh, n) for k, n in ndims},
        sharding.batch_sharding(mesh, 1),
    )
    return distributed.align_first_runs(jax.jit(gather, out_shardings=out))


def _local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a batch-split global array, in row order (replicas once)."""
    shards = {s.index[0].start or 0: s.data for s in x.addressable_shards}
    return np.concatenate([np.asarray(shards[start]) for start in sorted(shards)])
