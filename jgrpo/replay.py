"""Router replay in the train step (MoE models; docs/moe.md "Router replay").

The batch's `expert_ids` [B, T, l_moe, k] (-1: not recorded) are the experts the sampler
routed each fed token to. `check_batch` refuses a batch that does not match the step's static
`record_routing`; `layer_major` gives the model's [l_moe, B, T, k] layout; `with_mismatch`
adds moe/routing_mismatch to a microbatch's metrics: the (recorded completion token, MoE
layer) pairs whose trainer top-k set differs from the recorded one (`MoEOutput.mismatch`),
over the minibatch's recorded tokens x layers, so microbatches add up; `packed_mismatch`
reads a packed forward's per-position counts back to the rows."""

from __future__ import annotations

import jax.numpy as jnp

from jgrpo import packing


def check_batch(batch, record_routing: bool) -> None:
    """ValueError unless the (unpacked) batch carries expert_ids exactly when the step records."""
    if (batch.expert_ids is not None) != record_routing:
        raise ValueError(
            f"train step: record_routing={record_routing} (model.moe.router_replay / "
            f"record_routing on an MoE model) takes a batch "
            f"{'with' if record_routing else 'without'} expert_ids"
        )


def layer_major(expert_ids_btlk):
    """A batch's recorded expert ids [B, T, l_moe, k] -> the model's [l_moe, B, T, k]."""
    return None if expert_ids_btlk is None else jnp.moveaxis(expert_ids_btlk, 2, 0)


def recorded_tokens(token_mask_bt, expert_ids_btlk):
    """float32 [B, T]: the completion tokens (token_mask) whose experts the sampler recorded
    (every generated token it fed back: all but each row's last)."""
    return token_mask_bt * (expert_ids_btlk[:, :, 0, 0] >= 0).astype(jnp.float32)


def with_mismatch(loss_and_metrics, mismatch_bt, recorded_bt, num_recorded, spec):
    """(loss, metrics) with moe/routing_mismatch of one microbatch: `mismatch_bt` [B, T] the
    MoE layers whose choice differs per token, counted where `recorded_bt`, over the
    minibatch's `num_recorded` tokens x spec.num_sparse layers."""
    loss, metrics = loss_and_metrics
    count = jnp.sum(mismatch_bt.astype(jnp.float32) * recorded_bt)
    pairs = jnp.maximum(num_recorded * spec.num_sparse, 1.0)
    return loss, metrics | {"moe/routing_mismatch": count / pairs}


def packed_mismatch(mismatch_rw, scored_rh, row_b, slot_b, token_mask_bt):
    """A packed forward's [R, W] mismatch counts -> [B, T]: each scored token's, read at its
    packed position (`packing.unpack_logprobs`)."""
    mismatch_rh = jnp.take_along_axis(mismatch_rw, scored_rh, axis=1).astype(jnp.float32)
    return packing.unpack_logprobs(mismatch_rh, row_b, slot_b, token_mask_bt)
