"""GRPO losses in pure jnp: token logprobs, advantages, the clipped policy loss, KL, IS weights.

Owns the numbers of REFERENCE.md: "Ratio", "Surrogate", "Importance-sampling correction",
"KL penalty to the reference", "Advantages" and the loss-side "Metrics". Nothing here holds
state or imports flax/optax; every function is jittable. The train step (jgrpo/step.py) calls
:func:`token_logprobs`, :func:`policy_loss` and :func:`combine_metrics`; the rollout side calls
:func:`compute_advantages` / :func:`compute_token_advantages`.

Shape legend: ``_b`` batch rows, ``_t`` tokens (T = the static padded length, S_max),
``_v`` vocab. Per-token arrays are aligned with the tokens they score: ``lp_bt[:, t]`` is
log p(tokens_bt[:, t] | tokens before it). Symbols: lp current, lo prev ("old"), lg sampler
(generation), lr reference logprobs; A advantages; tm token mask, sm sample mask, m = tm * sm;
N_tok, N_seq the GLOBAL counts of the optimizer step (so microbatch losses and metrics add up).

Structural vs traced: inside the jitted step the float fields of LossConfig are traced scalars.
Python branches here look only at bool/str fields, at None-ness of Optional fields and at which
keys `batch` holds; never at a float value.

Decisions and deviations from NeMo-RL (ClippedPGLossFn, calculate_kl, the estimators):
- Groups come from explicit group ids (FIX), triviality is decided by equality of the group's
  float32 rewards (max == min, FIX), a single-member group gets A = 0; both for all estimators
  (for reinforce_plus_plus: before the global whitening, which then shifts every row alike).
- The normalising std is the group's Bessel std also under the leave-one-out baseline.
- KL weight v = exp(lp - sg(lp)) (value 1) keeps the score-function gradient, so the k3 gradient
  is beta (k3 + 1 - e^x) m / N_tok (NeMo's detached estimator gives beta (1 - e^x) m / N_tok);
  where the input clamp bit, v is detached and the token gives no KL gradient.
- use_on_policy_kl_approximation multiplies the clamped per-token KL by rho = sg(nan_to_num(
  exp(lp - lg))) as NeMo does (lg falls back to lo when generation logprobs are absent, giving
  exp(lp - lo)).
- use_kl_in_reward: the KL is measured (kl/penalty) but loss/kl is 0 (it lives in A instead).
- `tis` clamps w to [min or 0, max] (NeMo: max only). The IS weight is always token-level
  (NeMo's GSPO branch uses a sequence-level product weight).
- prev_logprobs absent from `batch` is the same as force_on_policy_ratio: lo := sg(lp)
  everywhere (ratio 1, unclipped, gradient of lp kept).
- generation_logprobs absent: lg := lo, hence IS weight 1 and healthy placeholders (below).
- Masked positions of every per-token input are replaced before any exp/log, so garbage in
  padding can neither leak into values nor produce nan gradients (double-where rule).
"""

from __future__ import annotations

from typing import Literal, Optional

import jax
import jax.numpy as jnp

from jgrpo.config import AdvantageConfig, LossConfig

Array = jax.Array
_f32 = jnp.float32
_sg = jax.lax.stop_gradient


# ----------------------------------------------------------------------------- logprobs


def token_logprobs(logits_btv: Array, tokens_bt: Array, temperature) -> Array:
    """[B, T] float32 logprob of tokens_bt[:, t] under softmax(logits_btv[:, t-1] / temperature).

    Column 0 has no predecessor and is 0.0. A temperature <= 0 (greedy sampling) is treated as
    1.0: greedy generation has no sampling distribution to match.
    """
    temperature = jnp.asarray(temperature, _f32)
    temperature = jnp.where(temperature > 0, temperature, 1.0)
    logits_btv = logits_btv[:, :-1].astype(_f32) / temperature
    next_bt = tokens_bt[:, 1:]
    picked_bt = jnp.take_along_axis(logits_btv, next_bt[..., None], axis=-1)[..., 0]
    lp_bt = picked_bt - jax.nn.logsumexp(logits_btv, axis=-1)
    return jnp.pad(lp_bt, ((0, 0), (1, 0)))


def kl_estimator(x: Array, kind: Literal["k1", "k2", "k3"]) -> Array:
    """Schulman's estimators of KL(p || q) at x = log q - log p of a sample from p."""
    match kind:
        case "k1":
            return -x
        case "k2":
            return 0.5 * x * x
        case "k3":
            return jnp.exp(x) - 1.0 - x
    raise ValueError(f"kl kind must be 'k1', 'k2' or 'k3', got {kind!r}")


def seq_logprob_error(prev_bt: Array, gen_bt: Array, mask_bt: Array) -> Array:
    """[B] e_b = sum_t exp(|lg - lo|) m / sum_t m (>= 1 on rows with tokens, 0 on empty rows).

    A row with a nan at a masked-in token gets +inf, so any threshold masks it out.
    """
    valid_bt = mask_bt > 0
    err_bt = jnp.where(valid_bt, jnp.exp(jnp.abs(gen_bt - prev_bt)), 0.0)
    err_b = jnp.sum(err_bt, axis=-1) / jnp.maximum(jnp.sum(mask_bt, axis=-1), 1)
    return jnp.where(jnp.isnan(err_b), jnp.inf, err_b).astype(_f32)


# ----------------------------------------------------------------------------- advantages


def _group_stats(r_b, gid_b, valid_b):
    """Per-row view of the group: count, sum of d = r - group min, Bessel std, triviality.

    Working on d (exact in float32 for close rewards, Sterbenz) keeps a 1e-4 reward gap from
    drowning in the rounding of a mean of values near 1.
    """
    n = r_b.shape[0]
    seg = lambda x: jax.ops.segment_sum(x, gid_b, num_segments=n)[gid_b]
    v_b = valid_b.astype(_f32)
    hi_b = jax.ops.segment_max(jnp.where(valid_b, r_b, -jnp.inf), gid_b, num_segments=n)[gid_b]
    lo_b = jax.ops.segment_min(jnp.where(valid_b, r_b, jnp.inf), gid_b, num_segments=n)[gid_b]
    d_b = jnp.where(valid_b, r_b - lo_b, 0.0)
    cnt_b, sum_b = seg(v_b), seg(d_b)
    mean_b = sum_b / jnp.maximum(cnt_b, 1)
    var_b = seg(jnp.square(d_b - mean_b) * v_b) / jnp.maximum(cnt_b - 1, 1)
    # FIX: exact float32 equality, not std > 0, decides triviality
    trivial_b = (hi_b == lo_b) | (cnt_b < 2) | ~valid_b
    return d_b, cnt_b, sum_b, jnp.sqrt(var_b), trivial_b


def _centered_advantages(r_b, gid_b, valid_b, cfg: AdvantageConfig) -> Array:
    """[B] group-relative advantage before any global step; the estimator dispatch."""
    d_b, cnt_b, sum_b, std_b, trivial_b = _group_stats(r_b, gid_b, valid_b)
    if cfg.use_leave_one_out_baseline:
        base_b = (sum_b - d_b) / jnp.maximum(cnt_b - 1, 1)
    else:
        base_b = sum_b / jnp.maximum(cnt_b, 1)
    adv_b = d_b - base_b
    match cfg.estimator:
        case "grpo":
            if cfg.normalize_rewards:
                adv_b = adv_b / (std_b + 1e-6)
        case "dr_grpo" | "reinforce_plus_plus":
            pass
        case _:
            raise ValueError(f"unknown advantage estimator {cfg.estimator!r}")
    return jnp.where(trivial_b, 0.0, adv_b)


def _whiten(x, w):
    """Global whitening with population variance over weights w: (x - mu) rsqrt(max(var, 1e-8))."""
    n = jnp.maximum(jnp.sum(w), 1)
    mu = jnp.sum(x * w) / n
    var = jnp.sum(jnp.square(x - mu) * w) / n
    return (x - mu) * jax.lax.rsqrt(jnp.maximum(var, 1e-8)) * w


def _clip_advantages(adv, cfg: AdvantageConfig):
    if cfg.advantage_clip_low is not None:
        adv = jnp.maximum(adv, cfg.advantage_clip_low)
    if cfg.advantage_clip_high is not None:
        adv = jnp.minimum(adv, cfg.advantage_clip_high)
    return adv


def compute_advantages(
    rewards: Array, group_ids: Array, cfg: AdvantageConfig, sample_mask: Optional[Array] = None
) -> Array:
    """[B] float32 advantages of REFERENCE.md "Advantages".

    rewards [B] float, group_ids [B] int in [0, B) (explicit group ids), sample_mask [B] (rows
    with 0 are left out of every group statistic and get A = 0). Rewards are cast to float32
    first; "all exactly equal" means equal as float32. reinforce_plus_plus here whitens over
    valid ROWS (equal to the token whitening of :func:`compute_token_advantages` only when all
    rows have the same length; the train path should use that one).
    """
    r_b = jnp.asarray(rewards, _f32)
    gid_b = jnp.asarray(group_ids, jnp.int32)
    valid_b = jnp.ones(r_b.shape, bool) if sample_mask is None else jnp.asarray(sample_mask) > 0
    adv_b = _centered_advantages(r_b, gid_b, valid_b, cfg)
    if cfg.estimator == "reinforce_plus_plus":
        adv_b = _whiten(adv_b, valid_b.astype(_f32))
    return jnp.where(valid_b, _clip_advantages(adv_b, cfg), 0.0)


def compute_token_advantages(
    rewards_b: Array,
    group_ids_b: Array,
    token_mask_bt: Array,
    cfg: AdvantageConfig,
    *,
    kl_bt: Optional[Array] = None,
    sample_mask_b: Optional[Array] = None,
) -> Array:
    """[B, T] float32 advantages, 0 outside m = token_mask * sample_mask.

    grpo / dr_grpo: the [B] advantage broadcast over the mask (kl_bt must be None).
    reinforce_plus_plus (NeMo-RL's rule): a_bt = (r_b - group baseline_b) - kl_bt, the KL taken
    per token with no returns-to-go sum, then whitened over all masked tokens of the batch
    (population variance, rsqrt(max(var, 1e-8))), then clipped. kl_bt (use_kl_in_reward) is
    supplied already scaled: beta * kl_estimator(lr - lo, kind).
    """
    m_bt = jnp.asarray(token_mask_bt, _f32)
    if sample_mask_b is not None:
        m_bt = m_bt * jnp.asarray(sample_mask_b, _f32)[:, None]
    if cfg.estimator != "reinforce_plus_plus":
        if kl_bt is not None:
            raise ValueError("kl_bt (use_kl_in_reward) is only used by reinforce_plus_plus")
        return compute_advantages(rewards_b, group_ids_b, cfg, sample_mask_b)[:, None] * m_bt
    r_b = jnp.asarray(rewards_b, _f32)
    valid_b = jnp.sum(m_bt, axis=-1) > 0 if sample_mask_b is None else sample_mask_b > 0
    adv_b = _centered_advantages(r_b, jnp.asarray(group_ids_b, jnp.int32), valid_b, cfg)
    adv_bt = jnp.broadcast_to(adv_b[:, None], m_bt.shape)
    if kl_bt is not None:
        adv_bt = adv_bt - jnp.where(m_bt > 0, kl_bt, 0.0)
    return _clip_advantages(_whiten(adv_bt, m_bt), cfg) * m_bt


# ----------------------------------------------------------------------------- policy loss


class _Masks:
    """The masks and global normalisers every reduction of one policy_loss call shares."""

    def __init__(self, tm_bt, sm_b, num_valid_tokens, num_valid_seqs):
        self.sm_b = jnp.asarray(sm_b, _f32)
        self.m_bt = jnp.asarray(tm_bt, _f32) * self.sm_b[:, None]
        self.valid_bt = self.m_bt > 0
        self.len_b = jnp.sum(self.m_bt, axis=-1)
        self.n_tok = jnp.maximum(jnp.asarray(num_valid_tokens, _f32), 1)
        self.n_seq = jnp.maximum(jnp.asarray(num_valid_seqs, _f32), 1)

    def tok_sum(self, x_bt):
        return jnp.sum(jnp.where(self.valid_bt, x_bt, 0.0))

    def tok_mean(self, x_bt):
        """Share of the global token mean (sums to it across microbatches)."""
        return self.tok_sum(x_bt) / self.n_tok

    def row_mean(self, x_bt):
        """[B] mean over the row's valid tokens (0 on empty rows)."""
        return jnp.sum(jnp.where(self.valid_bt, x_bt, 0.0), -1) / jnp.maximum(self.len_b, 1)

    def seq_mean(self, x_b):
        return jnp.sum(jnp.where(self.sm_b > 0, x_b, 0.0)) / self.n_seq

    def tok_min(self, x_bt):
        return jnp.min(jnp.where(self.valid_bt, x_bt, jnp.inf))

    def tok_max(self, x_bt):
        return jnp.max(jnp.where(self.valid_bt, x_bt, -jnp.inf))

    def aggregate(self, x_bt, kind: str):
        """The loss aggregation (REFERENCE "Surrogate"); the one dispatch on cfg.aggregation."""
        match kind:
            case "token_mean":
                return self.tok_sum(x_bt) / self.n_tok
            case "seq_mean":
                return self.seq_mean(self.row_mean(x_bt))
            case "seq_sum_norm":
                return self.tok_sum(x_bt) / (self.n_seq * x_bt.shape[-1])
        raise ValueError(f"unknown loss aggregation {kind!r}")


def _ratios(lp_bt, lo_bt, masks: _Masks, cfg: LossConfig, on_policy: bool):
    """(r, r^) of REFERENCE "Ratio"; the one dispatch on the ratio mode."""
    if cfg.disable_ppo_ratio:
        return lp_bt, lp_bt
    if on_policy:
        r_bt = jnp.exp(lp_bt - _sg(lp_bt))
        return r_bt, r_bt
    log_r_bt = lp_bt - lo_bt
    if cfg.sequence_level_importance_ratios:
        log_r_bt = jnp.broadcast_to(masks.row_mean(log_r_bt)[:, None], lp_bt.shape)
    r_bt = jnp.exp(log_r_bt)
    return r_bt, jnp.clip(r_bt, 1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)


def _surrogate(adv_bt, r_bt, rc_bt, cfg: LossConfig):
    """Per-token L = max(-A r, -A r^), with the dual clip min(L, -A c) where A < 0."""
    loss_bt = jnp.maximum(-adv_bt * r_bt, -adv_bt * rc_bt)
    dual_bt = jnp.zeros(loss_bt.shape, bool)
    if cfg.ratio_clip_c is not None:
        cap_bt = -adv_bt * cfg.ratio_clip_c
        dual_bt = (adv_bt < 0) & (cap_bt < loss_bt)
        loss_bt = jnp.where(dual_bt, cap_bt, loss_bt)
    return loss_bt, dual_bt


def _is_weights(lo_bt, lg_bt, masks: _Masks, cfg: LossConfig):
    """(w_bt, oob): truncated IS weight exp(lo - lg) (no gradient) and its out-of-bounds share."""
    w_bt = _sg(jnp.nan_to_num(jnp.exp(lo_bt - lg_bt), nan=0.0, posinf=0.0, neginf=0.0))
    kind = cfg.truncated_importance_sampling_type
    if kind is None:
        return w_bt, jnp.zeros((), _f32)
    hi = cfg.truncated_importance_sampling_ratio
    lo = cfg.truncated_importance_sampling_ratio_min
    lo = 0.0 if lo is None else lo
    match kind:
        case "tis":
            keep_bt = (w_bt >= lo) & (w_bt <= hi)
            return jnp.clip(w_bt, lo, hi), masks.tok_mean(1.0 - keep_bt)
        case "icepop":
            keep_bt = (w_bt >= lo) & (w_bt <= hi)
            return jnp.where(keep_bt, w_bt, 0.0), masks.tok_mean(1.0 - keep_bt)
        case "seq-mask-tis":
            log_w_bt = jnp.nan_to_num(lo_bt - lg_bt, nan=0.0, posinf=0.0, neginf=0.0)
            geo_b = _sg(jnp.exp(masks.row_mean(log_w_bt)))
            keep_b = (geo_b >= lo) & (geo_b <= hi)
            return w_bt * keep_b[:, None], masks.seq_mean(1.0 - keep_b)
    raise ValueError(f"unknown truncated_importance_sampling_type {kind!r}")


def _kl_to_reference(lp_bt, lr_bt, lg_bt, cfg: LossConfig):
    """Unscaled per-token KL with gradient: clamp(v k(x), +-out) [* rho], x = clamp(lr - lp)."""
    x_bt = lr_bt - lp_bt
    v_bt = jnp.exp(lp_bt - _sg(lp_bt))  # value 1; keeps the score-function gradient
    if cfg.kl_input_clamp_value is not None:
        c = cfg.kl_input_clamp_value
        v_bt = jnp.where(jnp.abs(x_bt) > c, _sg(v_bt), v_bt)
        x_bt = jnp.clip(x_bt, -c, c)
    kl_bt = v_bt * kl_estimator(x_bt, cfg.reference_policy_kl_type)
    if cfg.kl_output_clamp_value is not None:
        kl_bt = jnp.clip(kl_bt, -cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
    if cfg.use_on_policy_kl_approximation:
        rho_bt = jnp.nan_to_num(jnp.exp(lp_bt - lg_bt), nan=0.0, posinf=0.0, neginf=0.0)
        kl_bt = kl_bt * _sg(rho_bt)
    return kl_bt


def _mismatch_metrics(lo_bt, lg_bt, masks: _Masks, kind) -> dict:
    """Train-vs-sampler logprob metrics of REFERENCE "Metrics" (no gradient)."""
    lo_bt, lg_bt = _sg(lo_bt), _sg(lg_bt)
    mix_bt = jnp.logaddexp(lo_bt, lg_bt) - jnp.log(2.0)
    k3 = lambda d: jnp.exp(d) - d - 1.0
    js_bt = 0.5 * k3(lo_bt - mix_bt) + 0.5 * k3(lg_bt - mix_bt)
    err_b = seq_logprob_error(lo_bt, lg_bt, masks.m_bt)
    has_b = (masks.sm_b > 0) & (masks.len_b > 0)
    return {
        "logprob/token_mult_prob_error": masks.tok_mean(jnp.exp(jnp.abs(lg_bt - lo_bt))),
        "logprob/gen_kl_error": masks.tok_mean(kl_estimator(lo_bt - lg_bt, kind)),
        "logprob/policy_kl_error": masks.tok_mean(kl_estimator(lg_bt - lo_bt, kind)),
        "logprob/js_divergence_error": masks.tok_mean(js_bt),
        "logprob/seq_error_mean": masks.seq_mean(err_b),
        "logprob/seq_error_min": jnp.min(jnp.where(has_b, err_b, jnp.inf)),
        "logprob/seq_error_max": jnp.max(jnp.where(has_b, err_b, -jnp.inf)),
    }


def _ratio_metrics(r_bt, rc_bt, dual_bt, masks: _Masks) -> dict:
    r_bt, rc_bt = _sg(r_bt), _sg(rc_bt)
    return {
        "ratio/mean": masks.tok_mean(r_bt),
        "ratio/min": masks.tok_min(r_bt),
        "ratio/max": masks.tok_max(r_bt),
        "ratio/clamped_mean": masks.tok_mean(rc_bt),
        "ratio/clamped_min": masks.tok_min(rc_bt),
        "ratio/clamped_max": masks.tok_max(rc_bt),
        "ratio/clip_fraction": masks.tok_mean((r_bt != rc_bt).astype(_f32)),
        "ratio/dual_clip_fraction": masks.tok_mean(dual_bt.astype(_f32)),
    }


def policy_loss(
    curr_logprobs: Array, batch: dict, cfg: LossConfig, num_valid_tokens, num_valid_seqs
) -> tuple[Array, dict]:
    """(loss, metrics): loss_pg + loss_kl of REFERENCE.md for one microbatch.

    curr_logprobs [B, T] (differentiable lp). batch: advantages [B, T], token_mask [B, T],
    sample_mask [B], and optionally prev_logprobs, generation_logprobs, reference_logprobs
    [B, T]. num_valid_tokens / num_valid_seqs are the GLOBAL counts N_tok / N_seq (sum of m,
    sum of sm over the whole optimizer step), so the losses and the metrics of microbatches
    add up to the full-batch ones (see :func:`combine_metrics`).

    Metrics (all keys on every call). Keys ending in `_min` / `_max` are this microbatch's
    extreme over its valid tokens/rows (+inf / -inf when it has none) and combine by min/max;
    every other key is already divided by the global counts and combines by sum:
      loss/total, loss/pg, loss/kl; kl/penalty (KL without beta, aggregated like the loss);
      logprob/{token_mult_prob_error, gen_kl_error, policy_kl_error, js_divergence_error}
      (token means), logprob/seq_error_{mean,min,max} (e_b over valid rows);
      is/sampling_importance_ratio (token mean of the truncated w), is/oob_ratio (share of
      tokens, or for seq-mask-tis of rows, outside [min, max]; 0 without truncation);
      ratio/{mean,min,max,clamped_mean,clamped_min,clamped_max} of r and r^, ratio/clip_fraction
      (tokens with r^ != r), ratio/dual_clip_fraction; policy/approx_entropy
      (-token mean of rho lp, rho = exp(lp - lg)); batch/num_valid_tokens, batch/num_valid_seqs
      (this microbatch's sums of m and sm).
    Placeholders: without generation_logprobs lg := lo, so token_mult_prob_error and
    seq_error_* are 1.0, gen_kl/policy_kl/js errors 0.0, sampling_importance_ratio 1.0 and
    oob_ratio 0.0; without prev_logprobs lo := sg(lp) (ratios all 1.0); without
    reference_logprobs loss/kl and kl/penalty are 0.0. Under disable_ppo_ratio the ratio/*
    metrics report exp(lp - lo) (the surrogate itself uses lp and no clip).
    """
    masks = _Masks(batch["token_mask"], batch["sample_mask"], num_valid_tokens, num_valid_seqs)
    valid_bt = masks.valid_bt
    # double-where: sanitise padding before exp/log so neither values nor gradients see it
    lp_bt = jnp.where(valid_bt, jnp.asarray(curr_logprobs, _f32), 0.0)
    on_policy = cfg.force_on_policy_ratio or "prev_logprobs" not in batch
    lo_bt = _sg(lp_bt) if on_policy else jnp.where(valid_bt, batch["prev_logprobs"], 0.0)
    has_gen = "generation_logprobs" in batch
    lg_bt = jnp.where(valid_bt, batch["generation_logprobs"], lo_bt) if has_gen else lo_bt
    adv_bt = jnp.where(valid_bt, jnp.asarray(batch["advantages"], _f32), 0.0)

    r_bt, rc_bt = _ratios(lp_bt, lo_bt, masks, cfg, on_policy)
    pg_bt, dual_bt = _surrogate(adv_bt, r_bt, rc_bt, cfg)
    if has_gen:
        w_bt, oob = _is_weights(lo_bt, lg_bt, masks, cfg)
    else:
        w_bt, oob = jnp.ones_like(lp_bt), jnp.zeros((), _f32)
    if cfg.use_importance_sampling_correction:
        pg_bt = w_bt * pg_bt
    loss_pg = masks.aggregate(pg_bt, cfg.aggregation)

    if "reference_logprobs" in batch:
        lr_bt = jnp.where(valid_bt, batch["reference_logprobs"], lp_bt)
        kl = masks.aggregate(_kl_to_reference(lp_bt, lr_bt, lg_bt, cfg), cfg.aggregation)
        beta = 0.0 if cfg.use_kl_in_reward else cfg.reference_policy_kl_penalty
        loss_kl = beta * kl
    else:
        kl = loss_kl = jnp.zeros((), _f32)
    loss = loss_pg + loss_kl

    if cfg.disable_ppo_ratio:
        r_bt = rc_bt = jnp.exp(lp_bt - lo_bt)
    rho_bt = jnp.nan_to_num(jnp.exp(_sg(lp_bt) - lg_bt), nan=0.0, posinf=0.0, neginf=0.0)
    metrics = {
        "loss/total": loss,
        "loss/pg": loss_pg,
        "loss/kl": loss_kl,
        "kl/penalty": kl,
        **_mismatch_metrics(lo_bt, lg_bt, masks, cfg.reference_policy_kl_type),
        "is/sampling_importance_ratio": masks.tok_mean(w_bt),
        "is/oob_ratio": oob,
        **_ratio_metrics(r_bt, rc_bt, dual_bt, masks),
        "policy/approx_entropy": -masks.tok_mean(rho_bt * _sg(lp_bt)),
        "batch/num_valid_tokens": jnp.sum(masks.m_bt),
        "batch/num_valid_seqs": jnp.sum(masks.sm_b),
    }
    return loss, {k: _sg(jnp.asarray(v, _f32)) for k, v in metrics.items()}


def combine_metrics(stacked: dict) -> dict:
    """Reduce per-microbatch metrics stacked on axis 0 ([M]) to the full-batch values.

    `_min` / `/min` keys by min, `_max` / `/max` by max (a value never filled, +-inf, becomes
    0.0), every other key by sum. Also use it with M = 1 to finalise a single call.
    """
    out = {}
    for key, value_m in stacked.items():
        value_m = jnp.asarray(value_m)
        if key.endswith(("_min", "/min")):
            value = jnp.min(value_m)
            out[key] = jnp.where(value == jnp.inf, 0.0, value)
        elif key.endswith(("_max", "/max")):
            value = jnp.max(value_m)
            out[key] = jnp.where(value == -jnp.inf, 0.0, value)
        else:
            out[key] = jnp.sum(value_m)
    return out
