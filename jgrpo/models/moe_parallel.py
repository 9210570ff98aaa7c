"""Expert parallelism: an MoE block's experts split over a mesh axis (docs/moe.md).

`experts_sharded(ep, experts, x_btd, ids_btk, gates_btk, gate_edf, up_edf, down_efd)` runs
the dropless expert function `experts` (moe.experts_grouped | moe.experts_dense) inside a
`jax.shard_map` over `ep.mesh` (`sharding.ExpertParallel`: the specs and axes come from there;
this module names no mesh axis). Per device, with n = |ep.axis| and E / n local experts:

1. all-gather the tokens x, their expert ids and gates over ep.axis (the n devices' rows;
   under mesh.context > 1 the rows' tokens stay split over context: per-token work);
2. run the local experts on the (token, choice) pairs routed to them: other pairs get the
   out-of-range id E / n (dropped by the dense path's scatter, left in no group by the
   grouped path's ragged_dot) and gate 0;
3. psum over `ep.partial_axes` (the expert width f split over tensor), then psum_scatter over
   ep.axis: each device gets back the summed outputs of its own rows.
Gradients follow from shard_map's transposes (the gather's is a reduce-scatter and back)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def experts_sharded(ep, experts, x_btd, ids_btk, gates_btk, gate_edf, up_edf, down_efd):
    """The expert part of the MoE block on `ep` (a `sharding.ExpertParallel`) -> y_btd, equal
    to `experts` on all tokens and experts at once."""
    axis = ep.axis

    def local(x_btd, ids_btk, gates_btk, gate_edf, up_edf, down_efd):
        x_btd = jax.lax.all_gather(x_btd, axis, axis=0, tiled=True)
        ids_btk = jax.lax.all_gather(ids_btk, axis, axis=0, tiled=True)
        gates_btk = jax.lax.all_gather(gates_btk, axis, axis=0, tiled=True)
        b, t, d = x_btd.shape
        e_local = gate_edf.shape[0]
        local_ids = ids_btk - jax.lax.axis_index(axis) * e_local
        mine = (local_ids >= 0) & (local_ids < e_local)
        y_td = experts(
            x_btd.reshape(b * t, d),
            jnp.where(mine, local_ids, e_local).reshape(b * t, -1),
            jnp.where(mine, gates_btk, 0.0).reshape(b * t, -1),
            gate_edf,
            up_edf,
            down_efd,
        )
        if ep.partial_axes:
            y_td = jax.lax.psum(y_td, ep.partial_axes)
        y_td = jax.lax.psum_scatter(y_td, axis, scatter_dimension=0, tiled=True)
        return y_td.reshape(b // jax.lax.axis_size(axis), t, -1)

    tokens = ep.tokens
    return jax.shard_map(
        local,
        mesh=ep.mesh,
        in_specs=(tokens, tokens, tokens, ep.w_in, ep.w_in, ep.w_out),
        out_specs=tokens,
    )(x_btd, ids_btk, gates_btk, gate_edf, up_edf, down_efd)
