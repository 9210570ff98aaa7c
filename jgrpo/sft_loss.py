"""The SFT loss (`jgrpo sft`, docs/sft.md) in pure jnp: the train step calls it under
`StepFlags.objective == "sft"` in place of `losses.policy_loss`. Shape legend as in losses.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
_f32 = jnp.float32


def sft_loss(
    curr_logprobs: Array, token_mask: Array, sample_mask: Array, num_valid_tokens
) -> tuple[Array, dict]:
    """(loss, metrics) of supervised fine-tuning for one microbatch (docs/sft.md): the negative
    log-likelihood of the target tokens, summed over m = tm * sm and divided by the GLOBAL
    N_tok = sum of m over the optimizer step, so microbatches add up to the step's mean over
    every target token of the batch (TRL SFTTrainer's default normaliser, `num_items_in_batch`:
    a long conversation weighs by its tokens, not as one row).

    curr_logprobs [B, T] (lp at temperature 1); token_mask [B, T] (1 on target tokens);
    sample_mask [B]. Metrics (all sum over microbatches, see `combine_metrics`): loss/total,
    loss/nll (the same value), batch/num_valid_tokens, batch/num_valid_seqs (this
    microbatch's sums of m and of sm)."""
    m_bt = jnp.asarray(token_mask, _f32) * jnp.asarray(sample_mask, _f32)[:, None]
    lp_bt = jnp.where(m_bt > 0, jnp.asarray(curr_logprobs, _f32), 0.0)
    loss = -jnp.sum(lp_bt * m_bt) / jnp.maximum(jnp.asarray(num_valid_tokens, _f32), 1.0)
    metrics = {
        "loss/total": loss,
        "loss/nll": loss,
        "batch/num_valid_tokens": jnp.sum(m_bt),
        "batch/num_valid_seqs": jnp.sum(jnp.asarray(sample_mask, _f32)),
    }
    return loss, metrics
