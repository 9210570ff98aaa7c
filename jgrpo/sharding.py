"""The device mesh and the logical -> mesh axis rules; the only file that names mesh axes.

Mesh axes: `data` (batch only), `fsdp` (batch and parameters: each device holds 1/fsdp of every
large matrix; also MoE experts: `ExpertParallel`), `context` (a row's tokens in the train step:
`ContextParallel`), `tensor` (heads, mlp, vocab). Parameters
carry logical names (see models/transformer.py); one rules table maps them to mesh axes and
`mesh.rules` overrides entries. Batches are split over data x fsdp on their leading axis.
Multi-host batches enter through `jax.make_array_from_process_local_data`.

Pods (several processes): the data axis runs over hosts first. Each host's devices form
`data / num_processes` contiguous rows of the mesh whenever fsdp x tensor divides the devices of
one host (`mesh_utils.create_hybrid_device_mesh` with the process as the granule: fsdp and
tensor collectives stay on a host's fast links, only the gradient all-reduce over data crosses
hosts). A larger fsdp x tensor spans hosts in process order. `host_local` then views one host's
replica of the parameters (no copy) on a mesh of that host's devices only, for per-host sampling.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jgrpo.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "context", "tensor")
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
    # MoE experts (models/moe_transformer.py): expert parallelism over fsdp (`expert_parallel`:
    # each device holds E / fsdp whole experts; the block gathers its tokens over fsdp)
    "expert": "fsdp",
}


def resolve_mesh_shape(mesh_cfg: MeshConfig, num_devices: int) -> tuple[int, int, int, int]:
    """(data, fsdp, context, tensor) with a -1 resolved to the remaining devices."""
    sizes = [mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.context, mesh_cfg.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ConfigError(f"mesh: {known} devices in fixed axes do not divide {num_devices}")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ConfigError(
            f"mesh: data x fsdp x context x tensor = {math.prod(sizes)} but {num_devices} devices "
            "are visible"
        )
    return tuple(sizes)


def make_mesh(mesh_cfg: MeshConfig, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    shape = resolve_mesh_shape(mesh_cfg, len(devices))
    auto = (AxisType.Auto,) * len(MESH_AXES)
    processes = sorted({d.process_index for d in devices})
    if len(processes) == 1:
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    data, fsdp, context, tensor = shape
    per_host = len(devices) // len(processes)
    if per_host % (fsdp * context * tensor) == 0 and data % len(processes) == 0:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_hybrid_device_mesh(
            (data // len(processes), fsdp, context, tensor),
            (len(processes), 1, 1, 1),
            devices=devices,
            process_is_granule=True,
        )
    else:  # a replica spans hosts: fsdp/context/tensor groups run over hosts in process order
        grid = np.asarray(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=auto)


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
    """The PartitionSpec of a parameter from its logical axes. A mesh axis splits only the first
    dim that maps to it (an expert weight [e, d, f]: experts over fsdp, so d stays whole)."""
    spec, used = [], set()
    for dim, logical in zip(shape, axes):
        axis = rules.get(logical)
        size = mesh.shape[axis] if axis is not None and axis not in used else 1
        if size > 1 and dim % size:
            raise ConfigError(
                f"mesh: parameter {name} dim {logical}={dim} is not divisible by mesh.{axis}={size}"
            )
        spec.append(axis if size > 1 else None)
        used.add(axis)
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


def batch_shards(mesh: Mesh) -> int:
    """How many parts a batch's rows are split into (data x fsdp)."""
    return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


class ExpertParallel(NamedTuple):
    """How an MoE block runs its experts on the trainer's mesh (`models/moe_parallel.py`).

    The experts are split over `axis` (fsdp), which also splits the batch rows. Inside a
    `shard_map` each device gathers the tokens (and their routing) of its `axis` group, runs
    its own E / |axis| experts on the pairs routed to them, and reduce-scatters the outputs
    back to the devices that own the tokens; the other batch axis (data) is never gathered,
    nor `context` (with mesh.context > 1 each device exchanges its own slice of the rows'
    tokens: the block is per token)."""

    mesh: Mesh
    axis: str
    """The mesh axis the experts and the token exchange run over."""
    tokens: PartitionSpec
    """Per-token arrays [b, t, ...]: rows over data x fsdp, tokens over context (when
    mesh.context > 1: the permuted rows of `ContextParallel`)."""
    w_in: PartitionSpec
    """expert_gate / expert_up of one layer [e, d, f], as stored."""
    w_out: PartitionSpec
    """expert_down of one layer [e, f, d], as stored."""
    partial_axes: tuple[str, ...]
    """Axes that split the expert width f: each device's outputs are partial sums over them."""


def expert_parallel(mesh: Mesh, rules) -> Optional[ExpertParallel]:
    """The `ExpertParallel` of `mesh` under `rules`, or None when the experts are not split
    over fsdp (rules map `expert` elsewhere, or mesh.fsdp is 1): the block's plain path, its
    weights then laid out by propagation."""
    axis = rules.get("expert")
    if axis != "fsdp" or mesh.shape[axis] == 1:
        return None
    whole = (math.prod(mesh.shape.values()),) * 3  # divisible: param_shardings checks the real
    w_in = logical_to_spec("expert_gate", whole, ("expert", "embed", "mlp"), rules, mesh)
    w_out = logical_to_spec("expert_down", whole, ("expert", "mlp", "embed"), rules, mesh)
    partial = tuple(a for a in MESH_AXES if a != axis and a in (w_in[2], w_out[1]))
    if w_in[1] is not None or w_out[2] is not None:
        raise ConfigError("mesh.rules: expert parallelism needs the experts' `embed` dim whole")
    context = "context" if mesh.shape.get("context", 1) > 1 else None
    tokens = PartitionSpec(BATCH_AXES, context, None)
    return ExpertParallel(mesh, axis, tokens, w_in, w_out, partial)


class ContextParallel(NamedTuple):
    """How the train step splits a row's tokens over the `context` axis (models/context.py).

    A row of t tokens is cut into 2C chunks and permuted zig-zag (device i of the C holds
    chunks i and 2C-1-i); the layers' [b, t, d] activations are split over `axis` on t. Inside
    a `shard_map` each device all-gathers the keys and values of its rows over `axis` and runs
    blockwise attention for its own query chunks."""

    mesh: Mesh
    axis: str
    """The mesh axis a row's tokens are split over."""
    size: int
    """Devices on that axis (C)."""
    activations: NamedSharding
    """[b, t, d] activations of permuted rows: rows over data x fsdp, tokens over context."""
    qkv: PartitionSpec
    """[b, t, heads, h] queries, keys and values: heads over tensor where both head counts
    divide (else whole)."""
    tokens: PartitionSpec
    """[b, t] per-token arrays (valid keys, segment ids) of permuted rows."""


def context_parallel(mesh: Mesh, rules, num_heads: int, num_kv_heads: int):
    """The `ContextParallel` of `mesh`, or None when it has no context axis over 1 device."""
    size = mesh.shape.get("context", 1)
    if size == 1:
        return None
    heads = rules.get("heads")
    split = mesh.shape.get(heads, 1) if heads is not None else 1
    if heads != rules.get("kv_heads") or num_heads % split or num_kv_heads % split:
        heads = None
    tokens = PartitionSpec(BATCH_AXES, "context")
    qkv = PartitionSpec(BATCH_AXES, "context", heads, None)
    acts = NamedSharding(mesh, PartitionSpec(BATCH_AXES, "context", None))
    return ContextParallel(mesh, "context", size, acts, qkv, tokens)


class LogitShardings(NamedTuple):
    """Where `Transformer.token_logprobs` (the trainer's chunked LM head) puts its pieces.

    Vocab-parallel head: inside the chunk loop the head [v, d] is split over the vocab on the
    parameter axes (fsdp x tensor) with d whole, each chunk's activations [b, c, d] are gathered
    over those axes (rows stay split over data), and each device computes the logits of its
    vocab slice for every row, [b, c, v / (fsdp x tensor)]; the log-sum-exp and the picked
    logit reduce over the vocab slices. The head is never gathered whole: moving it from its
    stored layout (d split) to this one is an all-to-all of 1/(fsdp x tensor) of it, and its
    gradient comes back the same way. Per device, the matmul flops and the chunk's logits are
    the same as a batch-split chunk's. The vocab-parallel fields are None when fsdp x tensor
    is 1 (the head is whole on every device already) or does not divide the vocab (the head is
    then gathered, as propagation decides)."""

    head: NamedSharding
    """The stored head parameter's own sharding (embed [v, d] when tied, else lm_head [d, v]):
    its gradient is pinned to it, so it is reduce-scattered there and accumulates sharded."""
    head_vd: Optional[NamedSharding]
    """The head [v, d] in the chunk loop: vocab over fsdp x tensor, d whole."""
    rows_bcd: Optional[NamedSharding]
    """A chunk's activations [b, c, d]: rows over data, whole over fsdp x tensor."""
    logits_bcv: Optional[NamedSharding]
    """A chunk's logits [b, c, v]: rows over data, vocab over fsdp x tensor."""
    out_bc: NamedSharding
    """A chunk's per-token results [b, c], back on the batch axes (data x fsdp)."""


def logit_shardings(mesh: Mesh, head: NamedSharding, vocab_size: int) -> LogitShardings:
    """The `LogitShardings` of a model with `vocab_size` whose stored head has sharding `head`."""
    vocab_axes = tuple(a for a in MESH_AXES if a != "data" and mesh.shape.get(a, 1) > 1)
    split = math.prod(mesh.shape[a] for a in vocab_axes)
    out_bc = batch_sharding(mesh, 2)
    if split == 1 or vocab_size % split:  # nothing to split, or no even split
        return LogitShardings(head, None, None, None, out_bc)
    return LogitShardings(
        head=head,
        head_vd=NamedSharding(mesh, PartitionSpec(vocab_axes, None)),
        rows_bcd=NamedSharding(mesh, PartitionSpec("data", None, None)),
        logits_bcv=NamedSharding(mesh, PartitionSpec("data", None, vocab_axes)),
        out_bc=out_bc,
    )


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


def host_mesh(mesh: Mesh) -> Mesh:
    """The rows of `mesh` that hold this process's devices, as a mesh of their own.

    Raises ConfigError when this process's devices are not whole rows of the data axis (a
    model replica spans hosts: mesh.fsdp x mesh.tensor > devices per host)."""
    me = jax.process_index()
    local = np.vectorize(lambda d: d.process_index == me)(mesh.devices)
    rows = [r for r in range(mesh.devices.shape[0]) if local[r].all()]
    if not rows or local.sum() != local[rows].sum():
        raise ConfigError(
            f"mesh: fsdp x context x tensor = {len(mesh.devices[0].flat)} spans more than "
            f"one host ({jax.local_device_count()} devices): rollout.backend=local samples per "
            "host and needs a whole model replica on each; lower mesh.fsdp/context/tensor or use "
            "rollout.backend=ray"
        )
    return Mesh(mesh.devices[rows], mesh.axis_names, axis_types=mesh.axis_types)


def host_local(tree: Any, local_mesh: Mesh) -> Any:
    """This host's replica of globally sharded arrays, on `local_mesh` (`host_mesh`); no copy.

    Each leaf keeps its PartitionSpec; a leaf sharded over `data` has no replica on one host
    (ConfigError). Single-process arrays are returned as they are."""
    if jax.process_count() == 1:
        return tree

    def view(x):
        spec = x.sharding.spec
        if any("data" in (p if isinstance(p, tuple) else (p,)) for p in spec if p is not None):
            raise ConfigError(
                "mesh.rules: a parameter sharded over `data` has no whole replica on one host; "
                "per-host sampling (rollout.backend=local) needs params off the data axis"
            )
        local = NamedSharding(local_mesh, spec)
        want = local.addressable_devices_indices_map(x.shape)
        have = x.sharding.addressable_devices_indices_map(x.shape)
        if any(have[d] != index for d, index in want.items()):
            raise ValueError(f"host_local: {spec} places shards differently on the host mesh")
        shards = {s.device: s.data for s in x.addressable_shards}
        return jax.make_array_from_single_device_arrays(x.shape, local, [shards[d] for d in want])

    return jax.tree.map(view, tree)
