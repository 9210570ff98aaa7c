"""GRPO losses in pure jnp: token logprobs, advantages, the clipped policy loss, KL, IS weights.

Owns the numbers that docs/losses.md writes out (its last section lists every deliberate
difference from NeMo-RL): the ratio, the surrogate and its aggregations, the importance-sampling
correction, the KL penalty, the advantages and the loss-side metrics. Nothing here holds state
or imports flax/optax; every function is jittable. The train step calls `token_logprobs`,
`policy_loss`, `combine_metrics`, `seq_error_metrics`, `kl_in_reward` and
`compute_token_advantages`; `compute_advantages` is the per-row form.
Shape legend: ``_b`` batch rows, ``_t`` tokens, ``_v`` vocab; ``lp_bt[:, t]`` is
log p(tokens_bt[:, t] | tokens before it). Symbols: lp current, lo prev, lg sampler, lr
reference logprobs; A advantages; tm token mask, sm sample mask, m = tm * sm; N_tok, N_seq the
GLOBAL counts of the optimizer step. Inside the jitted step float LossConfig fields are traced:
Python branches look only at bool/str/int fields, None-ness and which keys `batch` holds.
Absent prev_logprobs means lo := sg(lp); absent generation_logprobs means lg := lo. Masked
positions are replaced before any exp/log (no nan gradients from padding)."""

from __future__ import annotations

from typing import Literal, Optional

import jax
import jax.numpy as jnp

from jgrpo.config import AdvantageConfig, LossConfig
from jgrpo.models import moe as moe_lib

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


def clamped_kl(x_bt: Array, cfg: LossConfig, weight_bt: Optional[Array] = None) -> Array:
    """NeMo-RL's calculate_kl: clamp(w * k(clamp(x, +-in)), +-out), x = log q - log p.

    Where the input clamp bites, w is detached (and x's gradient is 0), so the token gives no
    gradient at all; where the output clamp bites, the value is the clamp and the gradient 0.
    Clamps set to None are off; w = None is the weight 1 without gradient.
    """
    if cfg.kl_input_clamp_value is not None:
        c = cfg.kl_input_clamp_value
        if weight_bt is not None:
            weight_bt = jnp.where(jnp.abs(x_bt) > c, _sg(weight_bt), weight_bt)
        x_bt = jnp.clip(x_bt, -c, c)
    kl_bt = kl_estimator(x_bt, cfg.reference_policy_kl_type)
    if weight_bt is not None:
        kl_bt = weight_bt * kl_bt
    if cfg.kl_output_clamp_value is not None:
        kl_bt = jnp.clip(kl_bt, -cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
    return kl_bt


def kl_in_reward(prev_bt: Array, ref_bt: Array, cfg: LossConfig) -> Array:
    """[B, T] beta * clamped_kl(lr - lo): the per-token KL that use_kl_in_reward subtracts from
    the reinforce_plus_plus token rewards (the same estimator and clamps as the penalty)."""
    return cfg.reference_policy_kl_penalty * clamped_kl(ref_bt - prev_bt, cfg)


def seq_logprob_error(prev_bt: Array, gen_bt: Array, mask_bt: Array) -> Array:
    """[B] e_b = sum_t exp(|lg - lo|) m / sum_t m (>= 1 on rows with tokens, 0 on empty rows).

    A row with a nan at a masked-in token gets +inf, so any threshold masks it out.
    """
    valid_bt = mask_bt > 0
    err_bt = jnp.where(valid_bt, jnp.exp(jnp.abs(gen_bt - prev_bt)), 0.0)
    err_b = jnp.sum(err_bt, axis=-1) / jnp.maximum(jnp.sum(mask_bt, axis=-1), 1)
    return jnp.where(jnp.isnan(err_b), jnp.inf, err_b).astype(_f32)


SEQ_ERROR_METRICS = tuple(
    f"logprob/seq_error{part}_{stat}" for part in ("", "_kept") for stat in ("max", "mean", "min")
)
"""The per-sequence logprob-error metric keys of :func:`seq_error_metrics`."""


def seq_error_metrics(
    prev_bt: Array, gen_bt: Array, token_mask_bt: Array, sample_mask_b: Array, kept_b: Array
) -> dict:
    """Statistics of e_b (:func:`seq_logprob_error`) over a whole rollout batch.

    `logprob/seq_error_{max,mean,min}`: over every row with sample_mask > 0 and at least one
    token, BEFORE logprob-error masking (so the max shows the outliers that the threshold
    drops); `logprob/seq_error_kept_{max,mean,min}`: over those rows that are also `kept_b`
    (sample_mask after the threshold). The mean divides by the rows counted; with no such row
    every statistic is 0.0 (e_b >= 1, so 0.0 reads as "nothing measured").
    """
    sm_b = jnp.asarray(sample_mask_b, _f32)
    mask_bt = jnp.asarray(token_mask_bt, _f32) * sm_b[:, None]
    err_b = seq_logprob_error(prev_bt, gen_bt, mask_bt)
    has_b = (sm_b > 0) & (jnp.sum(mask_bt, axis=-1) > 0)
    out = {}
    for part, rows_b in (("", has_b), ("_kept", has_b & (jnp.asarray(kept_b) > 0))):
        count = jnp.sum(rows_b)
        stats = {
            "max": jnp.max(jnp.where(rows_b, err_b, -jnp.inf)),
            "mean": jnp.sum(jnp.where(rows_b, err_b, 0.0)) / jnp.maximum(count, 1),
            "min": jnp.min(jnp.where(rows_b, err_b, jnp.inf)),
        }
        for stat, value in stats.items():
            out[f"logprob/seq_error{part}_{stat}"] = jnp.where(count > 0, value, 0.0).astype(_f32)
    return out


# ----------------------------------------------------------------------------- advantages


def group_index(group_ids_b: Array) -> Array:
    """[B] int32 dense group index in [0, B): rows with equal ids share an index (any int32 ids,
    in any order; grouping is by id, never by position)."""
    gid_b = jnp.asarray(group_ids_b, jnp.int32)
    n = gid_b.shape[0]
    _, inv_b = jnp.unique(gid_b, size=n, fill_value=jnp.iinfo(jnp.int32).min, return_inverse=True)
    return inv_b.reshape(n).astype(jnp.int32)


def _group_stats(r_b, idx_b, sample_b) -> dict:
    """Per-row view of the row's group over its sample rows (every row with group id >= 0).

    d = r - group min (exact in float32 for close rewards, Sterbenz) keeps a 1e-4 reward gap
    from drowning in the rounding of a mean of values near 1. Returns d, the count n and sum S
    of the group, its Bessel std, its leave-one-out Bessel std (std of the OTHER members: 0
    where they are all exactly equal, always so for n = 2) and triviality (all rewards exactly
    equal as float32, or fewer than 2 samples).
    """
    n = r_b.shape[0]
    seg_sum = lambda x: jax.ops.segment_sum(x, idx_b, num_segments=n)[idx_b]
    seg_max = lambda x: jax.ops.segment_max(x, idx_b, num_segments=n)[idx_b]
    v_b = sample_b.astype(_f32)
    hi_b = seg_max(jnp.where(sample_b, r_b, -jnp.inf))
    lo_b = -seg_max(jnp.where(sample_b, -r_b, -jnp.inf))
    d_b = jnp.where(sample_b, r_b - lo_b, 0.0)
    cnt_b, sum_b = seg_sum(v_b), seg_sum(d_b)
    c_b = jnp.where(sample_b, d_b - sum_b / jnp.maximum(cnt_b, 1), 0.0)  # two-pass centring
    q_b = seg_sum(jnp.square(c_b))
    std_b = jnp.sqrt(q_b / jnp.maximum(cnt_b - 1, 1))
    # leave-one-out: remove row i from the centred sum of squares (Welford downdate) ...
    q_loo_b = jnp.maximum(q_b - jnp.square(c_b) * cnt_b / jnp.maximum(cnt_b - 1, 1), 0.0)
    std_loo_b = jnp.sqrt(q_loo_b / jnp.maximum(cnt_b - 2, 1))
    # ... and decide "the others are all equal" exactly, from their extremes, not from rounding
    n_hi_b = seg_sum((sample_b & (r_b == hi_b)).astype(_f32))
    n_lo_b = seg_sum((sample_b & (r_b == lo_b)).astype(_f32))
    second_hi_b = seg_max(jnp.where(sample_b & (r_b < hi_b), r_b, -jnp.inf))
    second_lo_b = -seg_max(jnp.where(sample_b & (r_b > lo_b), -r_b, -jnp.inf))
    others_hi_b = jnp.where((r_b < hi_b) | (n_hi_b >= 2), hi_b, second_hi_b)
    others_lo_b = jnp.where((r_b > lo_b) | (n_lo_b >= 2), lo_b, second_lo_b)
    std_loo_b = jnp.where((others_hi_b == others_lo_b) | (cnt_b < 3), 0.0, std_loo_b)
    # FIX: exact float32 equality, not std > 0, decides triviality
    trivial_b = (hi_b == lo_b) | (cnt_b < 2) | ~sample_b
    return dict(d=d_b, cnt=cnt_b, sum=sum_b, std=std_b, std_loo=std_loo_b, trivial=trivial_b)


def _centered_advantages(r_b, group_ids_b, sample_b, cfg: AdvantageConfig) -> Array:
    """[B] group-relative advantage before any global step; the estimator dispatch."""
    st = _group_stats(r_b, group_index(group_ids_b), sample_b)
    d_b, cnt_b, sum_b = st["d"], st["cnt"], st["sum"]
    if cfg.use_leave_one_out_baseline:
        base_b, std_b = (sum_b - d_b) / jnp.maximum(cnt_b - 1, 1), st["std_loo"]
    else:
        base_b, std_b = sum_b / jnp.maximum(cnt_b, 1), st["std"]
    adv_b = d_b - base_b
    match cfg.estimator:
        case "grpo":
            if cfg.normalize_rewards:  # no division where the std is 0 (NeMo: std > 0 only)
                adv_b = jnp.where(std_b > 0, adv_b / (std_b + 1e-6), adv_b)
        case "dr_grpo" | "reinforce_plus_plus":
            pass
        case _:
            raise ValueError(f"unknown advantage estimator {cfg.estimator!r}")
    return jnp.where(st["trivial"], 0.0, adv_b)


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


def _row_sets(group_ids_b, sample_mask_b):
    """(sample_b, loss_b): rows holding a sample (group id >= 0; they form the group statistics)
    and rows that take part in the loss (a sample with sample_mask > 0)."""
    sample_b = jnp.asarray(group_ids_b, jnp.int32) >= 0
    if sample_mask_b is None:
        return sample_b, sample_b
    return sample_b, sample_b & (jnp.asarray(sample_mask_b) > 0)


def compute_advantages(
    rewards: Array, group_ids: Array, cfg: AdvantageConfig, sample_mask: Optional[Array] = None
) -> Array:
    """[B] float32 advantages (docs/losses.md "Advantages").

    group_ids [B] int32: rows with the same id >= 0 form a group, whatever the ids are (7 and 3
    work as well as 0 and 1); a row with an id < 0 is padding that holds no sample: it is in no
    group statistic and gets A = 0. sample_mask [B]: rows with 0 take no part in the loss (A = 0,
    and reinforce_plus_plus leaves them out of its whitening) but their rewards still count in
    their group's statistics: they are samples of the policy. Rewards are cast to float32 first;
    "all exactly equal" means equal as float32. reinforce_plus_plus here whitens over loss ROWS
    (equal to the token whitening of :func:`compute_token_advantages` only when all rows have
    the same length; the train path uses that one).
    """
    r_b = jnp.asarray(rewards, _f32)
    sample_b, loss_b = _row_sets(group_ids, sample_mask)
    adv_b = _centered_advantages(r_b, group_ids, sample_b, cfg)
    if cfg.estimator == "reinforce_plus_plus":
        adv_b = _whiten(adv_b, loss_b.astype(_f32))
    return jnp.where(loss_b, _clip_advantages(adv_b, cfg), 0.0)


def compute_token_advantages(
    rewards_b: Array,
    group_ids_b: Array,
    token_mask_bt: Array,
    cfg: AdvantageConfig,
    *,
    kl_bt: Optional[Array] = None,
    sample_mask_b: Optional[Array] = None,
) -> Array:
    """[B, T] float32 advantages, 0 outside m = token_mask * sample_mask (and on padding rows).

    Groups and sample_mask as in :func:`compute_advantages`.
    grpo / dr_grpo: the [B] advantage broadcast over the mask (kl_bt must be None).
    reinforce_plus_plus (NeMo-RL's rule): a_bt = (r_b - group mean_b) - kl_bt, the KL taken
    per token with no returns-to-go sum, then whitened over all masked tokens of the batch
    (population variance, rsqrt(max(var, 1e-8))), then clipped. kl_bt (use_kl_in_reward) is
    supplied already scaled: :func:`kl_in_reward`.
    """
    sample_b, loss_b = _row_sets(group_ids_b, sample_mask_b)
    m_bt = jnp.asarray(token_mask_bt, _f32) * loss_b.astype(_f32)[:, None]
    if cfg.estimator != "reinforce_plus_plus":
        if kl_bt is not None:
            raise ValueError("kl_bt (use_kl_in_reward) is only used by reinforce_plus_plus")
        return compute_advantages(rewards_b, group_ids_b, cfg, sample_mask_b)[:, None] * m_bt
    r_b = jnp.asarray(rewards_b, _f32)
    adv_b = _centered_advantages(r_b, group_ids_b, sample_b, cfg)
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

    def aggregate(self, x_bt, cfg: LossConfig):
        """The loss aggregation (docs/losses.md "Surrogate"); the one dispatch on aggregation."""
        match cfg.aggregation:
            case "token_mean":
                return self.tok_sum(x_bt) / self.n_tok
            case "seq_mean":
                return self.seq_mean(self.row_mean(x_bt))
            case "seq_sum_norm":
                return self.tok_sum(x_bt) / (self.n_seq * generation_budget(cfg))
        raise ValueError(f"unknown loss aggregation {cfg.aggregation!r}")


def generation_budget(cfg: LossConfig) -> int:
    """S_max of seq_sum_norm: cfg.generation_budget, a constant of the run (the train step sets
    it from rollout.max_new_tokens). Never the padded row width, which moves with the prompt
    bucket; so a config without it is an error, not a fallback."""
    if cfg.generation_budget is None:
        raise ValueError(
            "loss.aggregation=seq_sum_norm needs LossConfig.generation_budget (the run's "
            "rollout.max_new_tokens; jgrpo.step.StepFlags.from_config fills it in)"
        )
    return cfg.generation_budget


def _ratios(lp_bt, lo_bt, masks: _Masks, cfg: LossConfig, on_policy: bool):
    """(r, r^) of docs/losses.md "Ratio"; the one dispatch on the ratio mode."""
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


def _finite_exp(log_w):
    """exp(log_w) where that is finite, else 0 (NeMo's nan_to_num(exp(.)), nan-safe gradient)."""
    ok = jnp.isfinite(jnp.exp(_sg(log_w)))
    return jnp.where(ok, jnp.exp(jnp.where(ok, log_w, 0.0)), 0.0)


def _truncate(w, masks: _Masks, cfg: LossConfig):
    """(truncated w, kept flags) for tis / icepop; w is [B, T] or, under GSPO, [B]."""
    hi = cfg.truncated_importance_sampling_ratio
    lo = cfg.truncated_importance_sampling_ratio_min
    lo = 0.0 if lo is None else lo
    keep = (w >= lo) & (w <= hi)
    if cfg.truncated_importance_sampling_type == "tis":
        return jnp.clip(w, lo, hi), keep
    return jnp.where(keep, w, 0.0), keep  # icepop


def _is_weights(lo_bt, lg_bt, masks: _Masks, cfg: LossConfig):
    """(w_bt, oob, mean w) of docs/losses.md "Importance-sampling correction" (no gradient).

    Token level: w = exp(lo - lg). GSPO (sequence_level_importance_ratios): one weight per row,
    w_b = exp(sum_t (lo - lg) m), and tis / icepop truncate w_b; the mean weight is then over
    rows, oob the share of TOKENS in out-of-bounds rows (NeMo-RL's normalisation)."""
    kind = cfg.truncated_importance_sampling_type
    log_w_bt = jnp.where(masks.valid_bt, lo_bt - lg_bt, 0.0)
    if cfg.sequence_level_importance_ratios:
        if kind == "seq-mask-tis":
            raise ValueError(
                "truncated_importance_sampling_type='seq-mask-tis' masks rows by their token "
                "weights; it is incompatible with sequence_level_importance_ratios"
            )
        w_b = _sg(_finite_exp(jnp.sum(log_w_bt, axis=-1)))
        oob = jnp.zeros((), _f32)
        if kind is not None:
            w_b, keep_b = _truncate(w_b, masks, cfg)
            oob = masks.tok_mean(jnp.broadcast_to(1.0 - keep_b[:, None], lo_bt.shape))
        return jnp.broadcast_to(w_b[:, None], lo_bt.shape), oob, masks.seq_mean(w_b)
    w_bt = _sg(_finite_exp(lo_bt - lg_bt))
    oob = jnp.zeros((), _f32)
    match kind:
        case None:
            pass
        case "tis" | "icepop":
            w_bt, keep_bt = _truncate(w_bt, masks, cfg)
            oob = masks.tok_mean(1.0 - keep_bt)
        case "seq-mask-tis":
            hi = cfg.truncated_importance_sampling_ratio
            lo = cfg.truncated_importance_sampling_ratio_min
            lo = 0.0 if lo is None else lo
            safe_bt = jnp.nan_to_num(log_w_bt, nan=0.0, posinf=0.0, neginf=0.0)
            geo_b = _sg(jnp.exp(masks.row_mean(safe_bt)))
            keep_b = (geo_b >= lo) & (geo_b <= hi)
            w_bt, oob = w_bt * keep_b[:, None], masks.seq_mean(1.0 - keep_b)
        case _:
            raise ValueError(f"unknown truncated_importance_sampling_type {kind!r}")
    return w_bt, oob, masks.tok_mean(w_bt)


def _kl_to_reference(lp_bt, lr_bt, lg_bt, cfg: LossConfig):
    """Unscaled per-token KL with gradient: clamped_kl(lr - lp, weight w).

    w = exp(lp - sg(lp)) (value 1, keeps the score-function gradient) or, with
    use_on_policy_kl_approximation, w = exp(lp - lg) with its gradient; the output clamp acts
    on w * k (NeMo-RL's order)."""
    if cfg.use_on_policy_kl_approximation:
        w_bt = _finite_exp(lp_bt - lg_bt)
    else:
        w_bt = jnp.exp(lp_bt - _sg(lp_bt))
    return clamped_kl(lr_bt - lp_bt, cfg, w_bt)


def _mismatch_metrics(lo_bt, lg_bt, masks: _Masks, kind) -> dict:
    """Train-vs-sampler token metrics of docs/losses.md "Metrics" (no gradient)."""
    lo_bt, lg_bt = _sg(lo_bt), _sg(lg_bt)
    mix_bt = jnp.logaddexp(lo_bt, lg_bt) - jnp.log(2.0)
    k3 = lambda d: jnp.exp(d) - d - 1.0
    js_bt = 0.5 * k3(lo_bt - mix_bt) + 0.5 * k3(lg_bt - mix_bt)
    return {
        "logprob/token_mult_prob_error": masks.tok_mean(jnp.exp(jnp.abs(lg_bt - lo_bt))),
        "logprob/gen_kl_error": masks.tok_mean(kl_estimator(lo_bt - lg_bt, kind)),
        "logprob/policy_kl_error": masks.tok_mean(kl_estimator(lg_bt - lo_bt, kind)),
        "logprob/js_divergence_error": masks.tok_mean(js_bt),
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
    """(loss, metrics): loss_pg + loss_kl of docs/losses.md for one microbatch.

    curr_logprobs [B, T] (differentiable lp). batch: advantages [B, T], token_mask [B, T],
    sample_mask [B], and optionally prev_logprobs, generation_logprobs, reference_logprobs
    [B, T]. num_valid_tokens / num_valid_seqs are the GLOBAL counts N_tok / N_seq (sum of m,
    sum of sm over the whole optimizer step), so the losses and the metrics of microbatches
    add up to the full-batch ones (see :func:`combine_metrics`). aggregation=seq_sum_norm
    needs cfg.generation_budget (ValueError otherwise).

    Metrics (all keys on every call). Keys ending in `_min` / `_max` are this microbatch's
    extreme over its valid tokens (+inf / -inf when it has none) and combine by min/max;
    every other key is already divided by the global counts and combines by sum:
      loss/total, loss/pg, loss/kl; kl/penalty (KL without beta, aggregated like the loss);
      logprob/{token_mult_prob_error, gen_kl_error, policy_kl_error, js_divergence_error}
      (token means); is/sampling_importance_ratio (mean of the truncated w: over tokens, or
      under GSPO over rows), is/oob_ratio (share of tokens outside [min, max] — under GSPO of
      tokens in rows whose w_b is outside — or for seq-mask-tis the share of rows; 0 without
      truncation); ratio/{mean,min,max,clamped_mean,clamped_min,clamped_max} of r and r^,
      ratio/clip_fraction (tokens with r^ != r), ratio/dual_clip_fraction;
      policy/approx_entropy (-token mean of rho lp, rho = exp(lp - lg)); batch/num_valid_tokens,
      batch/num_valid_seqs (this microbatch's sums of m and sm). The per-sequence errors
      logprob/seq_error_* need the whole batch: :func:`seq_error_metrics`.
    Placeholders: without generation_logprobs lg := lo, so token_mult_prob_error is 1.0,
    gen_kl/policy_kl/js errors 0.0, sampling_importance_ratio 1.0 and oob_ratio 0.0; without
    prev_logprobs lo := sg(lp) (ratios all 1.0); without reference_logprobs loss/kl and
    kl/penalty are 0.0. Under disable_ppo_ratio the ratio/* metrics report exp(lp - lo) (the
    surrogate itself uses lp and no clip).
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
        w_bt, oob, mean_w = _is_weights(lo_bt, lg_bt, masks, cfg)
    else:
        w_bt, oob = jnp.ones_like(lp_bt), jnp.zeros((), _f32)
        per_row = cfg.sequence_level_importance_ratios
        mean_w = masks.seq_mean(jnp.ones_like(masks.sm_b)) if per_row else masks.tok_mean(w_bt)
    if cfg.use_importance_sampling_correction:
        pg_bt = w_bt * pg_bt
    loss_pg = masks.aggregate(pg_bt, cfg)

    if "reference_logprobs" in batch:
        lr_bt = jnp.where(valid_bt, batch["reference_logprobs"], lp_bt)
        kl = masks.aggregate(_kl_to_reference(lp_bt, lr_bt, lg_bt, cfg), cfg)
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
        "is/sampling_importance_ratio": mean_w,
        "is/oob_ratio": oob,
        **_ratio_metrics(r_bt, rc_bt, dual_bt, masks),
        "policy/approx_entropy": -masks.tok_mean(rho_bt * _sg(lp_bt)),
        "batch/num_valid_tokens": jnp.sum(masks.m_bt),
        "batch/num_valid_seqs": jnp.sum(masks.sm_b),
    }
    return loss, {k: _sg(jnp.asarray(v, _f32)) for k, v in metrics.items()}


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


def add_router_losses(loss, metrics, routed, spec, *, aux_coef, z_coef, num_microbatches: int):
    """loss + the router terms of an MoE forward (`routed`: MoEOutput, `spec`: MoESpec; both
    None for a dense model: unchanged): aux_coef (None = spec.aux_loss_coef, the HF config's)
    x load-balancing loss + z_coef x router z-loss (jgrpo.models.moe.aux_losses), and the moe/
    metrics. Each microbatch adds 1/M of its own terms (the step sums microbatches), so a
    minibatch's terms and metrics are means over its microbatches (maxima: the max)."""
    if routed is None:
        return loss, metrics
    aux, z = moe_lib.aux_losses(routed.stats, spec.num_experts)
    aux_coef = jnp.asarray(spec.aux_loss_coef if aux_coef is None else aux_coef, jnp.float32)
    router = (aux_coef * aux + (0.0 if z_coef is None else z_coef) * z) / num_microbatches
    stats = moe_lib.moe_metrics(routed.stats, spec.num_experts)
    metrics = metrics | {
        k: v if k.endswith("_max") else v / num_microbatches for k, v in stats.items()
    }
    metrics["moe/router_loss"] = router
    metrics["loss/total"] = metrics["loss/total"] + router
    return loss + router, metrics
