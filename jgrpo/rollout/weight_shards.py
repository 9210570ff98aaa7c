"""The pod's weight-shard plan: which process sends which shard of the trainer's parameters.

Pure jax + numpy, no ray (the Ray backend moves what this plans). `plan_shards` gives each
distinct shard of a globally sharded tree exactly one sender among the processes that hold it,
balanced by bytes, from the shardings alone (every process derives the same plan with no
communication); `local_shards` copies off the devices only this process's planned shards, and
`assemble_shards` joins every process's part into the full host-numpy tree on a worker.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import numpy as np


def _index_key(index: tuple, shape) -> tuple:
    """A hashable, normalised form of a shard's index (a tuple of slices)."""
    return tuple(sl.indices(dim)[:2] for sl, dim in zip(index, shape))


def plan_shards(tree, process_of=None) -> list[dict[tuple, int]]:
    """Per leaf of `tree` (globally sharded jax.Arrays): {shard index: the process that sends it}.

    Each distinct shard (replicas de-duplicated) is sent by exactly one process that holds it;
    a shard held by several processes (replicated leaves; every shard in the hybrid mesh, where
    each host holds a whole replica) goes to the holder that has sent the fewest bytes so far,
    so the pod's hosts share the sending evenly. Every process computes the same plan from the
    global shardings alone (no communication). `process_of(device)` defaults to
    `device.process_index` (tests pass a fake pod)."""
    process_of = process_of or (lambda d: d.process_index)
    sent: dict[int, int] = {}
    plan = []
    for x in jax.tree.leaves(tree):
        holders: dict[tuple, set[int]] = {}
        for device, index in x.sharding.devices_indices_map(x.shape).items():
            holders.setdefault(_index_key(index, x.shape), set()).add(process_of(device))
        owners = {}
        for key in sorted(holders):
            size = math.prod(hi - lo for lo, hi in key) * x.dtype.itemsize
            owner = min(holders[key], key=lambda p: (sent.get(p, 0), p))
            sent[owner] = sent.get(owner, 0) + size
            owners[key] = owner
        plan.append(owners)
    return plan


def local_shards(tree, process: Optional[int] = None, process_of=None) -> dict[str, Any]:
    """The shards of `tree` that `process` (default: this one) sends under `plan_shards`, as host
    numpy: {"treedef", "leaves": [(shape, dtype, [(index, array), ...]), ...]}. Only those
    shards are copied off the devices; `assemble_shards` joins every process's part."""
    process = jax.process_index() if process is None else process
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for x, owners in zip(leaves, plan_shards(tree, process_of)):
        mine = {key for key, owner in owners.items() if owner == process}
        pieces = {}
        for shard in x.addressable_shards:
            key = _index_key(shard.index, x.shape)
            if key in mine and key not in pieces:
                pieces[key] = np.asarray(shard.data)
        if pieces.keys() != mine:
            raise ValueError(f"local_shards: process {process} does not hold its shards")
        out.append((tuple(x.shape), x.dtype, sorted(pieces.items())))
    return {"treedef": treedef, "leaves": out}


def assemble_shards(parts: list[dict[str, Any]]):
    """The full host-numpy tree from every process's `local_shards` (each cell written once)."""
    treedef = parts[0]["treedef"]
    leaves = []
    for i, (shape, dtype, _) in enumerate(parts[0]["leaves"]):
        full = np.empty(shape, dtype)
        filled = 0
        for part in parts:
            for key, data in part["leaves"][i][2]:
                full[tuple(slice(lo, hi) for lo, hi in key)] = data
                filled += data.size
        if filled != full.size:
            raise ValueError(f"assemble_shards: leaf {i} {shape}: {filled} of {full.size} values")
        leaves.append(full)
    return jax.tree.unflatten(treedef, leaves)
