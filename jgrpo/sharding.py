"""The device mesh and the logical -> mesh axis rules; the only file that names mesh axes.

Mesh axes: `data` (batch only), `fsdp` (batch and parameters: each device holds 1/fsdp of every
large matrix), `tensor` (heads, mlp, vocab). Parameters carry logical names (see
models/transformer.py); one rules table maps them to mesh axes and `mesh.rules` overrides
entries. Batches are split over data x fsdp on their leading axis. Multi-host batches enter
through `jax.make_array_from_process_local_data`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jgrpo.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

DEFAULT_RULES: dict[str, str | None] = {
    "layers": None,
    "embed": "fsdp",
    "vocab": "tensor",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "norm": None,
    "lora_rank": None,  # LoRA adapter rank: small, never sharded (models/lora.py)
}


def resolve_mesh_shape(mesh_cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    sizes = [mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ConfigError(f"mesh: {known} devices in fixed axes do not divide {num_devices}")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ConfigError(
            f"mesh: data x fsdp x tensor = {math.prod(sizes)} but {num_devices} devices are visible"
        )
    return tuple(sizes)


def make_mesh(mesh_cfg: MeshConfig, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    shape = resolve_mesh_shape(mesh_cfg, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def make_rules(mesh_cfg: MeshConfig) -> dict[str, str | None]:
    rules = dict(DEFAULT_RULES)
    for logical, axis in mesh_cfg.rules:
        if logical not in rules:
            raise ConfigError(
                f"mesh.rules: unknown logical axis {logical!r}; allowed: {', '.join(rules)}"
            )
        if axis is not None and axis not in MESH_AXES:
            raise ConfigError(
                f"mesh.rules: {logical!r} -> {axis!r}; mesh axes are {', '.join(MESH_AXES)} or null"
            )
        rules[logical] = axis
    return rules


def logical_to_spec(name: str, shape, axes, rules, mesh: Mesh) -> PartitionSpec:
    spec = []
    for dim, logical in zip(shape, axes):
        axis = rules.get(logical)
        size = mesh.shape[axis] if axis is not None else 1
        if size > 1 and dim % size:
            raise ConfigError(
                f"mesh: parameter {name} dim {logical}={dim} is not divisible by mesh.{axis}={size}"
            )
        spec.append(axis if size > 1 else None)
    return PartitionSpec(*spec)


def param_shardings(model_state: nnx.State, mesh: Mesh, rules) -> dict:
    """NamedShardings (as a pure dict, like the params) from each Param's logical axes."""
    flat = {}
    for path, var in nnx.to_flat_state(model_state):
        name = "/".join(map(str, path))
        value = var.get_raw_value()
        spec = logical_to_spec(name, value.shape, var.get_metadata()["logical_axes"], rules, mesh)
        flat[path] = NamedSharding(mesh, spec)
    return unflatten(flat)


def unflatten(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Place a host batch (this process's rows) on the mesh, split over data x fsdp."""
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        sharding = batch_sharding(mesh, value.ndim)
        global_shape = (value.shape[0] * jax.process_count(), *value.shape[1:])
        out[key] = jax.make_array_from_process_local_data(sharding, value, global_shape)
    return out


def shard_params(params: dict, shardings: dict) -> dict:
    return jax.tree.map(jax.device_put, params, shardings)
