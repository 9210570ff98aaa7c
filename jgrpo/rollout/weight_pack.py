"""One batched transfer per weight publish: every leaf of a parameter tree packed into one flat
byte array on the device, copied to the host in one transfer, put as one Ray object, and on a
worker copied to its device in one transfer and split there.

Pure jax + numpy, no ray (jgrpo.rollout.ray_backend moves what this packs). `pack_weights(tree)
-> PackedWeights` (host numpy bytes + the layout), `unpack_weights(packed)` -> the tree on the
default device. Bit for bit: a leaf is its bytes (`lax.bitcast_convert_type`), never converted.
The pack holds one transient extra copy of the tree on the device while it is made (the single
device-to-host copy then replaces one copy per leaf).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """Where each leaf lies in the flat bytes (hashable: a jit static argument)."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]
    """(shape, dtype name) per leaf, in tree order; leaf i's bytes follow leaf i - 1's."""

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) * jnp.dtype(d).itemsize for s, d in self.leaves)


@dataclasses.dataclass(frozen=True)
class PackedWeights:
    """A parameter tree as one uint8 array (host numpy) and its layout."""

    data: np.ndarray
    layout: WeightLayout

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def _as_bytes(x):
    if x.dtype == jnp.bool_:
        raise ValueError("pack_weights: boolean leaves are not weights")
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


@jax.jit
def _concat_bytes(leaves):
    return jnp.concatenate([_as_bytes(x) for x in leaves])


def pack_weights(tree) -> PackedWeights:
    """Every leaf of `tree` (jax or numpy arrays) as one host uint8 array: one concatenation on
    the device, one device-to-host copy."""
    leaves, treedef = jax.tree.flatten(tree)
    layout = WeightLayout(treedef, tuple((tuple(x.shape), jnp.dtype(x.dtype).name) for x in leaves))
    return PackedWeights(np.asarray(jax.device_get(_concat_bytes(leaves))), layout)


@functools.partial(jax.jit, static_argnums=1)
def _split_bytes(data, layout: WeightLayout):
    leaves, offset = [], 0
    for (shape, dtype), size in zip(layout.leaves, layout.sizes):
        chunk = jax.lax.slice_in_dim(data, offset, offset + size)
        itemsize = jnp.dtype(dtype).itemsize
        chunk = chunk.reshape(shape if itemsize == 1 else (*shape, itemsize))
        leaves.append(jax.lax.bitcast_convert_type(chunk, jnp.dtype(dtype)))
        offset += size
    return jax.tree.unflatten(layout.treedef, leaves)


def unpack_weights(packed: PackedWeights):
    """The tree of `pack_weights`, on the default device: one host-to-device copy of the bytes,
    split there."""
    return _split_bytes(jax.device_put(packed.data), packed.layout)
