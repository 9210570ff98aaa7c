"""jgrpo.losses against independent references: REFERENCE.md hand values, float64 NumPy
reimplementations, analytic gradients, microbatch invariance, jit with traced floats, edge cases."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo.config import AdvantageConfig, LossConfig
from jgrpo.losses import (
    combine_metrics,
    compute_advantages,
    compute_token_advantages,
    kl_estimator,
    policy_loss,
    seq_logprob_error,
    token_logprobs,
)

ATOL, RTOL = 1e-6, 1e-5

EXPECTED_KEYS = {
    "loss/total",
    "loss/pg",
    "loss/kl",
    "kl/penalty",
    "logprob/token_mult_prob_error",
    "logprob/gen_kl_error",
    "logprob/policy_kl_error",
    "logprob/js_divergence_error",
    "logprob/seq_error_mean",
    "logprob/seq_error_min",
    "logprob/seq_error_max",
    "is/sampling_importance_ratio",
    "is/oob_ratio",
    "ratio/mean",
    "ratio/min",
    "ratio/max",
    "ratio/clamped_mean",
    "ratio/clamped_min",
    "ratio/clamped_max",
    "ratio/clip_fraction",
    "ratio/dual_clip_fraction",
    "policy/approx_entropy",
    "batch/num_valid_tokens",
    "batch/num_valid_seqs",
}


# ----------------------------------------------------------------------------- fixtures


def make_batch(seed=0, b=6, t=7, spread=0.5):
    """Random float64 batch: prompt columns masked, random lengths, one row sample-masked,
    finite garbage in the padding."""
    rng = np.random.default_rng(seed)
    lp = -np.abs(rng.normal(1.0, 0.7, (b, t)))
    lo = lp + spread * rng.normal(size=(b, t))
    lg = lo + spread * rng.normal(size=(b, t))
    lr = lp + 1.5 * rng.normal(size=(b, t))
    adv = np.repeat(rng.normal(size=(b, 1)), t, 1) + 0.3 * rng.normal(size=(b, t))
    tm = np.zeros((b, t))
    for i in range(b):
        start = 1 + i % 2
        tm[i, start : start + 2 + (3 * i) % (t - 2)] = 1.0
    sm = np.ones(b)
    sm[b // 2] = 0.0
    batch = dict(
        prev_logprobs=lo,
        generation_logprobs=lg,
        reference_logprobs=lr,
        advantages=adv,
        token_mask=tm,
        sample_mask=sm,
    )
    return lp, batch


def counts(batch):
    m = batch["token_mask"] * batch["sample_mask"][:, None]
    return float(m.sum()), float(batch["sample_mask"].sum())


def run_loss(lp, batch, cfg):
    n_tok, n_seq = counts(batch)
    jb = {k: jnp.asarray(v, jnp.float32) for k, v in batch.items()}
    loss, metrics = policy_loss(jnp.asarray(lp, jnp.float32), jb, cfg, n_tok, n_seq)
    return float(loss), {
        k: float(v) for k, v in combine_metrics({k: v[None] for k, v in metrics.items()}).items()
    }


# ----------------------------------------------------------------------------- NumPy reference


def np_kl(x, kind):
    return {"k1": -x, "k2": 0.5 * x**2, "k3": np.exp(x) - 1.0 - x}[kind]


def np_nan_to_zero(x):
    return np.where(np.isfinite(x), x, 0.0)


def np_policy_loss(lp, batch, cfg):
    """float64 reimplementation of REFERENCE.md, written from the equations."""
    n_tok, n_seq = counts(batch)
    tm, sm, a = batch["token_mask"], batch["sample_mask"], batch["advantages"]
    m = tm * sm[:, None]
    t = lp.shape[1]
    on_policy = cfg.force_on_policy_ratio or "prev_logprobs" not in batch
    lo = lp if on_policy else batch["prev_logprobs"]
    lg = batch.get("generation_logprobs", lo)
    row_mean = lambda x: (x * m).sum(1) / np.maximum(m.sum(1), 1)

    def agg(x):
        if cfg.aggregation == "token_mean":
            return (x * m).sum() / n_tok
        if cfg.aggregation == "seq_mean":
            return (sm * row_mean(x)).sum() / n_seq
        return (x * m).sum() / (n_seq * t)

    if cfg.disable_ppo_ratio:
        r = rc = lp
    elif on_policy:
        r = rc = np.ones_like(lp)
    else:
        log_r = lp - lo
        if cfg.sequence_level_importance_ratios:
            log_r = np.repeat(row_mean(log_r)[:, None], t, 1)
        r = np.exp(log_r)
        rc = np.clip(r, 1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)
    surr = np.maximum(-a * r, -a * rc)
    if cfg.ratio_clip_c is not None:
        surr = np.where(a < 0, np.minimum(surr, -a * cfg.ratio_clip_c), surr)

    with np.errstate(over="ignore", invalid="ignore"):
        w = np_nan_to_zero(np.exp(lo - lg))
        log_w = np_nan_to_zero(lo - lg)
    hi = cfg.truncated_importance_sampling_ratio
    lo_b = cfg.truncated_importance_sampling_ratio_min or 0.0
    kind, oob = cfg.truncated_importance_sampling_type, 0.0
    if "generation_logprobs" in batch and kind == "tis":
        oob = (m * ((w < lo_b) | (w > hi))).sum() / n_tok
        w = np.clip(w, lo_b, hi)
    elif "generation_logprobs" in batch and kind == "icepop":
        keep = (w >= lo_b) & (w <= hi)
        oob = (m * ~keep).sum() / n_tok
        w = w * keep
    elif "generation_logprobs" in batch and kind == "seq-mask-tis":
        geo = np.exp(row_mean(log_w))
        keep = (geo >= lo_b) & (geo <= hi)
        oob = (sm * ~keep).sum() / n_seq
        w = w * keep[:, None]
    loss_pg = agg(w * surr if cfg.use_importance_sampling_correction else surr)

    kl = 0.0
    if "reference_logprobs" in batch:
        x = batch["reference_logprobs"] - lp
        if cfg.kl_input_clamp_value is not None:
            x = np.clip(x, -cfg.kl_input_clamp_value, cfg.kl_input_clamp_value)
        k = np_kl(x, cfg.reference_policy_kl_type)
        if cfg.kl_output_clamp_value is not None:
            k = np.clip(k, -cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
        if cfg.use_on_policy_kl_approximation:
            with np.errstate(over="ignore"):
                k = k * np_nan_to_zero(np.exp(lp - lg))
        kl = agg(k)
    beta = 0.0 if cfg.use_kl_in_reward else cfg.reference_policy_kl_penalty
    if cfg.disable_ppo_ratio:
        r = rc = np.exp(lp - lo)
    tmean = lambda x: (x * m).sum() / n_tok
    mix = np.log(0.5 * np.exp(lo) + 0.5 * np.exp(lg))
    k3 = lambda d: np.exp(d) - d - 1
    on = m > 0
    return {
        "loss/total": loss_pg + beta * kl,
        "loss/pg": loss_pg,
        "loss/kl": beta * kl,
        "kl/penalty": kl,
        "logprob/token_mult_prob_error": tmean(np.exp(np.abs(lg - lo))),
        "logprob/gen_kl_error": tmean(np_kl(lo - lg, cfg.reference_policy_kl_type)),
        "logprob/policy_kl_error": tmean(np_kl(lg - lo, cfg.reference_policy_kl_type)),
        "logprob/js_divergence_error": tmean(0.5 * k3(lo - mix) + 0.5 * k3(lg - mix)),
        "is/sampling_importance_ratio": tmean(w),
        "is/oob_ratio": oob,
        "ratio/mean": tmean(r),
        "ratio/min": r[on].min(),
        "ratio/max": r[on].max(),
        "ratio/clamped_mean": tmean(rc),
        "ratio/clamped_min": rc[on].min(),
        "ratio/clamped_max": rc[on].max(),
        "ratio/clip_fraction": tmean(r != rc),
        "policy/approx_entropy": -tmean(np.exp(lp - lg) * lp),
    }


def assert_matches_reference(lp, batch, cfg):
    loss, metrics = run_loss(lp, batch, cfg)
    ref = np_policy_loss(lp, batch, cfg)
    np.testing.assert_allclose(loss, ref["loss/total"], rtol=RTOL, atol=ATOL)
    for key, want in ref.items():
        np.testing.assert_allclose(metrics[key], want, rtol=RTOL, atol=ATOL, err_msg=key)
    return metrics


# ----------------------------------------------------------------------------- hand values


def hand_batch(lp, adv):
    return dict(
        prev_logprobs=np.array([[0.0, -1.0, -1.0, -1.0]]),
        advantages=np.array([[0.0, *adv]]),
        token_mask=np.array([[0.0, 1.0, 1.0, 1.0]]),
        sample_mask=np.ones(1),
    ), np.array([[0.0, *lp]])


def test_hand_checked_ppo_clip():
    batch, lp = hand_batch(np.log([0.5, 1.0, 1.5]) - 1.0, [1.0, -1.0, 2.0])
    loss, _ = run_loss(lp, batch, LossConfig())
    np.testing.assert_allclose(loss, -1.9 / 3, atol=1e-6)
    assert round(loss, 4) == -0.6333


@pytest.mark.parametrize("prev", [-1.0, -3.0, 0.7])
def test_hand_checked_force_on_policy_any_lo(prev):
    batch, lp = hand_batch(np.log([0.5, 1.0, 1.5]) - 1.0, [1.0, -1.0, 2.0])
    batch["prev_logprobs"] = np.full((1, 4), prev)
    loss, _ = run_loss(lp, batch, LossConfig(force_on_policy_ratio=True))
    assert round(loss, 4) == -0.6667
    del batch["prev_logprobs"]  # the skipped prev forward gives the same loss
    assert run_loss(lp, batch, LossConfig())[0] == loss


def test_hand_checked_reinforce():
    batch, lp = hand_batch([-0.5, -1.0, -1.5], [1.0, -1.0, 2.0])
    loss, _ = run_loss(lp, batch, LossConfig(disable_ppo_ratio=True))
    np.testing.assert_allclose(loss, 2.5 / 3, atol=1e-6)
    assert round(loss, 4) == 0.8333


# ----------------------------------------------------------------------------- NumPy parity

PARITY_CFGS = {
    "ppo": LossConfig(),
    "asym_clip": LossConfig(ratio_clip_min=0.1, ratio_clip_max=0.28),
    "dual_clip": LossConfig(ratio_clip_c=1.5),
    "gspo_seq_mean": LossConfig(sequence_level_importance_ratios=True, aggregation="seq_mean"),
    "gspo_sum_norm": LossConfig(sequence_level_importance_ratios=True, aggregation="seq_sum_norm"),
    "seq_mean": LossConfig(aggregation="seq_mean"),
    "seq_sum_norm": LossConfig(aggregation="seq_sum_norm"),
    "reinforce": LossConfig(disable_ppo_ratio=True),
    "force": LossConfig(force_on_policy_ratio=True),
    "is_plain": LossConfig(use_importance_sampling_correction=True),
    "tis": LossConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.3,
        truncated_importance_sampling_ratio_min=0.8,
    ),
    "icepop": LossConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.5,
        truncated_importance_sampling_ratio_min=0.7,
    ),
    "seq_mask_tis": LossConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.2,
        truncated_importance_sampling_ratio_min=0.9,
    ),
    "kl_in_reward": LossConfig(reference_policy_kl_penalty=0.1, use_kl_in_reward=True),
}


@pytest.mark.parametrize("name", PARITY_CFGS)
def test_policy_loss_matches_numpy(name):
    cfg = PARITY_CFGS[name]
    for seed in range(3):
        lp, batch = make_batch(seed, spread=0.6)
        metrics = assert_matches_reference(lp, batch, cfg)
    # each feature must actually act on this data, or the parity would prove nothing
    if name == "dual_clip":
        assert metrics["ratio/dual_clip_fraction"] > 0
    if name in ("ppo", "asym_clip", "gspo_seq_mean"):
        assert 0 < metrics["ratio/clip_fraction"] < 1
    if name in ("tis", "icepop", "seq_mask_tis"):
        assert 0 < metrics["is/oob_ratio"] < 1


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("clamps", [(None, None), (20.0, 10.0), (1.0, 0.8)])
@pytest.mark.parametrize("on_policy_approx", [False, True])
def test_kl_penalty_matches_numpy(kind, clamps, on_policy_approx):
    cfg = LossConfig(
        reference_policy_kl_penalty=0.3,
        reference_policy_kl_type=kind,
        kl_input_clamp_value=clamps[0],
        kl_output_clamp_value=clamps[1],
        use_on_policy_kl_approximation=on_policy_approx,
    )
    lp, batch = make_batch(1)
    metrics = assert_matches_reference(lp, batch, cfg)
    assert metrics["kl/penalty"] != 0
    np.testing.assert_allclose(metrics["loss/kl"], 0.3 * metrics["kl/penalty"], rtol=1e-6)
    if clamps[0] == 1.0:  # the clamps bite on this data
        m = batch["token_mask"] * batch["sample_mask"][:, None] > 0
        assert (np.abs(batch["reference_logprobs"] - lp)[m] > 1.0).any()


def test_missing_optional_inputs_match_numpy_and_placeholders():
    lp, full = make_batch(2)
    cfg = LossConfig(
        reference_policy_kl_penalty=0.2,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.1,
    )
    for drop in ["prev_logprobs", "generation_logprobs", "reference_logprobs"]:
        batch = {k: v for k, v in full.items() if k != drop}
        metrics = assert_matches_reference(lp, batch, cfg)
        if drop == "generation_logprobs":
            np.testing.assert_allclose(metrics["logprob/token_mult_prob_error"], 1.0, rtol=1e-6)
            np.testing.assert_allclose(metrics["is/sampling_importance_ratio"], 1.0, rtol=1e-6)
            for key in ["seq_error_mean", "seq_error_min", "seq_error_max"]:
                np.testing.assert_allclose(metrics[f"logprob/{key}"], 1.0, rtol=1e-6)
            for key in ["gen_kl_error", "policy_kl_error", "js_divergence_error"]:
                assert metrics[f"logprob/{key}"] == 0.0
            assert metrics["is/oob_ratio"] == 0.0
        if drop == "reference_logprobs":
            assert metrics["loss/kl"] == 0.0 and metrics["kl/penalty"] == 0.0
        if drop == "prev_logprobs":
            assert metrics["ratio/min"] == metrics["ratio/max"] == 1.0


def test_seq_error_metrics_match_numpy():
    lp, batch = make_batch(4)
    _, metrics = run_loss(lp, batch, LossConfig())
    m = batch["token_mask"] * batch["sample_mask"][:, None]
    e = (np.exp(np.abs(batch["generation_logprobs"] - batch["prev_logprobs"])) * m).sum(1)
    e = e / np.maximum(m.sum(1), 1)
    valid = batch["sample_mask"] > 0
    np.testing.assert_allclose(metrics["logprob/seq_error_mean"], e[valid].mean(), rtol=RTOL)
    np.testing.assert_allclose(metrics["logprob/seq_error_min"], e[valid].min(), rtol=RTOL)
    np.testing.assert_allclose(metrics["logprob/seq_error_max"], e[valid].max(), rtol=RTOL)


# ----------------------------------------------------------------------------- gradients


def grad_lp(lp, batch, cfg):
    n_tok, n_seq = counts(batch)
    jb = {k: jnp.asarray(v, jnp.float32) for k, v in batch.items()}
    f = lambda x: policy_loss(x, jb, cfg, n_tok, n_seq)[0]
    return np.asarray(jax.grad(f)(jnp.asarray(lp, jnp.float32)), np.float64)


@pytest.mark.parametrize("in_clamp", [None, 1.0])
def test_k3_gradient_contract(in_clamp):
    lp, batch = make_batch(3)
    batch["advantages"] = np.zeros_like(lp)  # isolate loss_kl
    beta = 0.25
    cfg = LossConfig(
        reference_policy_kl_penalty=beta, kl_input_clamp_value=in_clamp, kl_output_clamp_value=None
    )
    x = batch["reference_logprobs"] - lp
    m = batch["token_mask"] * batch["sample_mask"][:, None]
    want = beta * (np_kl(x, "k3") + 1 - np.exp(x)) * m / counts(batch)[0]
    if in_clamp is not None:
        bit = np.abs(x) > in_clamp
        assert (bit & (m > 0)).any() and (~bit & (m > 0)).any()
        want = np.where(bit, 0.0, want)
    np.testing.assert_allclose(grad_lp(lp, batch, cfg), want, rtol=RTOL, atol=ATOL)


def test_force_on_policy_gradient_is_plain_policy_gradient():
    lp, batch = make_batch(5)
    m = batch["token_mask"] * batch["sample_mask"][:, None]
    want = -batch["advantages"] * m / counts(batch)[0]
    cfg = LossConfig(force_on_policy_ratio=True)
    g1 = grad_lp(lp, batch, cfg)
    batch["prev_logprobs"] = batch["prev_logprobs"] + 5.0  # lo is never read
    g2 = grad_lp(lp, batch, cfg)
    np.testing.assert_allclose(g1, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(g1, g2)
    np.testing.assert_allclose(run_loss(lp, batch, cfg)[0], (want * 1).sum(), rtol=RTOL)


def test_ppo_gradient_matches_analytic():
    lp, batch = make_batch(6, spread=0.4)
    a, m = batch["advantages"], batch["token_mask"] * batch["sample_mask"][:, None]
    r = np.exp(lp - batch["prev_logprobs"])
    rc = np.clip(r, 0.8, 1.2)
    unclipped_active = -a * r >= -a * rc  # the max picks the unclipped branch
    want = np.where(unclipped_active & (r == rc) | (-a * r > -a * rc), -a * r, 0.0)
    want = want * m / counts(batch)[0]
    assert (want == 0)[m > 0].any() and (want != 0)[m > 0].any()
    np.testing.assert_allclose(grad_lp(lp, batch, LossConfig()), want, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- invariance

INVARIANCE_CFGS = [
    LossConfig(reference_policy_kl_penalty=0.1),
    LossConfig(aggregation="seq_mean", reference_policy_kl_penalty=0.1, ratio_clip_c=1.5),
    LossConfig(aggregation="seq_sum_norm", sequence_level_importance_ratios=True),
    LossConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.5,
        truncated_importance_sampling_ratio_min=0.7,
    ),
    LossConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.2,
        truncated_importance_sampling_ratio_min=0.9,
        reference_policy_kl_penalty=0.1,
        use_on_policy_kl_approximation=True,
    ),
]


@pytest.mark.parametrize("cfg", INVARIANCE_CFGS)
def test_microbatch_invariance(cfg):
    rng = np.random.default_rng(7)
    base, batch = make_batch(7, b=8, t=6)
    batch["sample_mask"][:2] = 0.0  # with 4 microbatches the first one holds no valid row
    feat = jnp.asarray(rng.normal(size=(8, 6, 3)) * 0.2, jnp.float32)
    theta = jnp.asarray([0.3, -0.2, 0.1], jnp.float32)
    n_tok, n_seq = counts(batch)
    jb = {k: jnp.asarray(v, jnp.float32) for k, v in batch.items()}

    def micro(theta, sl):
        lp = jnp.asarray(base, jnp.float32)[sl] + feat[sl] @ theta
        return policy_loss(lp, {k: v[sl] for k, v in jb.items()}, cfg, n_tok, n_seq)

    results = {}
    for num in (1, 2, 4):
        size = 8 // num
        outs = [
            jax.value_and_grad(micro, has_aux=True)(theta, slice(i * size, (i + 1) * size))
            for i in range(num)
        ]
        loss = sum(float(l) for (l, _), _ in outs)
        grad = sum(np.asarray(g, np.float64) for _, g in outs)
        stacked = {k: jnp.stack([aux[k] for (_, aux), _ in outs]) for k in outs[0][0][1]}
        metrics = {k: float(v) for k, v in combine_metrics(stacked).items()}
        results[num] = loss, grad, metrics
    loss1, grad1, met1 = results[1]
    assert all(np.isfinite(list(met1.values())))
    for num in (2, 4):
        loss, grad, metrics = results[num]
        np.testing.assert_allclose(loss, loss1, atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(grad, grad1, atol=1e-6, rtol=1e-6)
        for key in met1:
            np.testing.assert_allclose(metrics[key], met1[key], atol=1e-6, rtol=1e-6, err_msg=key)


def test_combine_metrics_rules():
    stacked = {
        "a/min": jnp.array([3.0, jnp.inf, 1.0]),
        "ratio/clamped_max": jnp.array([-jnp.inf] * 3),
        "x/seq_error_min": jnp.array([jnp.inf, jnp.inf]),
        "loss/pg": jnp.array([0.5, 0.25]),
    }
    out = combine_metrics(stacked)
    assert float(out["a/min"]) == 1.0
    assert float(out["ratio/clamped_max"]) == 0.0
    assert float(out["x/seq_error_min"]) == 0.0
    assert float(out["loss/pg"]) == 0.75


# ----------------------------------------------------------------------------- jit, keys, edges


@pytest.mark.parametrize("cfg", [PARITY_CFGS["dual_clip"], PARITY_CFGS["tis"], INVARIANCE_CFGS[4]])
def test_jit_with_traced_float_cfg_equals_eager(cfg):
    lp, batch = make_batch(8)
    n_tok, n_seq = counts(batch)
    jb = {k: jnp.asarray(v, jnp.float32) for k, v in batch.items()}
    floats = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if isinstance(getattr(cfg, f.name), float)
    }

    @jax.jit
    def step(lp, batch, floats):
        return policy_loss(lp, batch, dataclasses.replace(cfg, **floats), n_tok, n_seq)

    lp = jnp.asarray(lp, jnp.float32)
    jit_loss, jit_metrics = step(lp, jb, {k: jnp.float32(v) for k, v in floats.items()})
    loss, metrics = policy_loss(lp, jb, cfg, n_tok, n_seq)
    np.testing.assert_allclose(jit_loss, loss, rtol=1e-6, atol=1e-7)
    for key in metrics:
        np.testing.assert_allclose(jit_metrics[key], metrics[key], rtol=1e-6, atol=1e-7)


def test_metric_keys_identical_across_flags():
    lp, full = make_batch(9)
    cfgs = list(PARITY_CFGS.values()) + INVARIANCE_CFGS
    for cfg in cfgs:
        for drop in [None, "prev_logprobs", "generation_logprobs", "reference_logprobs"]:
            batch = {k: v for k, v in full.items() if k != drop}
            _, metrics = run_loss(lp, batch, cfg)
            assert set(metrics) == EXPECTED_KEYS


def test_all_zero_mask_gives_exact_zero():
    lp, batch = make_batch(10)
    batch["token_mask"] = np.zeros_like(lp)
    for cfg in [INVARIANCE_CFGS[1], INVARIANCE_CFGS[4], PARITY_CFGS["tis"]]:
        jb = {k: jnp.asarray(v, jnp.float32) for k, v in batch.items()}
        f = lambda x, jb=jb, cfg=cfg: policy_loss(x, jb, cfg, 0, 0)
        (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp, jnp.float32))
        assert float(loss) == 0.0
        assert not np.asarray(grad).any()
        combined = combine_metrics({k: v[None] for k, v in metrics.items()})
        assert all(np.isfinite(float(v)) for v in combined.values())


@pytest.mark.parametrize(
    "cfg", [INVARIANCE_CFGS[3], INVARIANCE_CFGS[4], PARITY_CFGS["tis"], PARITY_CFGS["is_plain"]]
)
def test_nonfinite_generation_logprobs_give_finite_loss(cfg):
    lp, batch = make_batch(11)
    valid = np.argwhere(batch["token_mask"] * batch["sample_mask"][:, None] > 0)
    for (i, j), bad in zip(valid[:3], [np.nan, np.inf, -np.inf]):
        batch["generation_logprobs"][i, j] = bad
    pad = batch["token_mask"] == 0
    for key in ["prev_logprobs", "reference_logprobs", "advantages"]:
        batch[key][pad] = np.nan  # garbage in padding must not leak either
    lp_bad = np.where(pad, np.inf, lp)
    cfg = dataclasses.replace(cfg, reference_policy_kl_penalty=0.1)
    loss, _ = run_loss(lp_bad, batch, cfg)
    assert np.isfinite(loss)
    assert np.isfinite(grad_lp(lp_bad, batch, cfg)).all()
    with np.errstate(all="ignore"):
        clean = {k: np.where(pad, 0.0, v) if v.shape == lp.shape else v for k, v in batch.items()}
        ref = np_policy_loss(np.where(pad, 0.0, lp), clean, cfg)["loss/total"]
    np.testing.assert_allclose(loss, ref, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- small functions


def test_token_logprobs_matches_numpy():
    rng = np.random.default_rng(12)
    logits = rng.normal(size=(2, 5, 11)) * 3
    tokens = rng.integers(0, 11, (2, 5))
    out = np.asarray(token_logprobs(jnp.asarray(logits, jnp.bfloat16), tokens, 0.7))
    x = np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float64) / 0.7
    logp = (
        x
        - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - x.max(-1, keepdims=True)
    )
    want = np.zeros((2, 5))
    for b in range(2):
        for t in range(1, 5):
            want[b, t] = logp[b, t - 1, tokens[b, t]]
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL)


def test_kl_estimator_values():
    x = np.linspace(-3, 3, 13)
    for kind in ["k1", "k2", "k3"]:
        got = np.asarray(kl_estimator(jnp.asarray(x, jnp.float32), kind))
        np.testing.assert_allclose(got, np_kl(x, kind), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError):
        kl_estimator(jnp.zeros(2), "k4")


def test_seq_logprob_error():
    prev = np.array([[0.0, -1.0, -2.0, 0.0], [0.0, -1.0, -1.0, -1.0], [0.0] * 4])
    gen = np.array([[5.0, -1.5, -1.0, 9.0], [0.0, -1.0, np.nan, -1.0], [0.0] * 4])
    mask = np.array([[0, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]], np.float32)
    got = np.asarray(seq_logprob_error(prev, gen, mask))
    np.testing.assert_allclose(got[0], (np.exp(0.5) + np.exp(1.0)) / 2, rtol=1e-6)
    assert got[1] == np.inf and got[2] == 0.0


# ----------------------------------------------------------------------------- advantages


def np_advantages(r, g, cfg, valid=None):
    r = np.asarray(r, np.float32).astype(np.float64)
    valid = np.ones(len(r), bool) if valid is None else np.asarray(valid) > 0
    out = np.zeros(len(r))
    for gid in set(g):
        idx = [i for i in range(len(r)) if g[i] == gid and valid[i]]
        vals = r[idx]
        if len(idx) < 2 or vals.max() == vals.min():
            continue
        for i in idx:
            base = (
                (vals.sum() - r[i]) / (len(idx) - 1)
                if cfg.use_leave_one_out_baseline
                else vals.mean()
            )
            out[i] = r[i] - base
            if cfg.estimator == "grpo" and cfg.normalize_rewards:
                out[i] /= vals.std(ddof=1) + 1e-6
    if cfg.estimator == "reinforce_plus_plus":
        mu = out[valid].mean()
        out = np.where(valid, (out - mu) / np.sqrt(max(out[valid].var(), 1e-8)), 0.0)
    lo, hi = cfg.advantage_clip_low, cfg.advantage_clip_high
    lo = -np.inf if lo is None else lo
    hi = np.inf if hi is None else hi
    return np.where(valid, np.clip(out, lo, hi), 0.0)


def test_advantage_reference_vectors():
    got = compute_advantages(
        jnp.array([2.0, 2.0, 1.0, 3.0]), jnp.array([0, 0, 1, 1]), AdvantageConfig()
    )
    np.testing.assert_allclose(got, [0, 0, -0.7071, 0.7071], atol=1e-4)
    np.testing.assert_allclose(got[2:], [-1 / (2**0.5 + 1e-6), 1 / (2**0.5 + 1e-6)], rtol=1e-6)
    loo = AdvantageConfig(use_leave_one_out_baseline=True, normalize_rewards=False)
    got = compute_advantages(jnp.array([1.0, 2.0, 3.0]), jnp.array([0, 0, 0]), loo)
    np.testing.assert_allclose(got, np.array([1.0, 2.0, 3.0]) - [2.5, 2.0, 1.5], atol=1e-6)


@pytest.mark.parametrize(
    "cfg",
    [
        AdvantageConfig(),
        AdvantageConfig(use_leave_one_out_baseline=True),
        AdvantageConfig(estimator="dr_grpo"),
        AdvantageConfig(estimator="dr_grpo", use_leave_one_out_baseline=True),
        AdvantageConfig(advantage_clip_low=-0.5, advantage_clip_high=0.8),
        AdvantageConfig(estimator="reinforce_plus_plus"),
    ],
)
def test_advantages_match_numpy(cfg):
    rng = np.random.default_rng(13)
    r = rng.normal(size=12)
    g = np.array([7, 3, 7, 3, 0, 0, 7, 11, 3, 5, 5, 5])  # arbitrary ids in [0, B), one singleton
    r[9:] = 0.5  # an all-equal group
    valid = np.ones(12)
    valid[[1, 6]] = 0
    want = np_advantages(r, g, cfg, valid)
    fn = jax.jit(compute_advantages, static_argnums=2)
    got = np.asarray(fn(jnp.asarray(r, jnp.float32), jnp.asarray(g), cfg, jnp.asarray(valid)))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert got[1] == 0.0 and got[6] == 0.0  # sample-masked rows
    if cfg.estimator != "reinforce_plus_plus":  # its global whitening shifts every row
        assert got[7] == 0.0 and (got[9:] == 0.0).all()


def test_equal_rewards_give_exact_zero_despite_fp32_residue():
    # 0.1 + 0.2 != 0.3 in float64 but they are the same float32: "exactly equal" means equal
    # as the float32 the advantages are computed in. 0.9 * 3 leaves a fp32 residue in the mean.
    r64 = np.array([0.1 + 0.2, 0.3, 0.3, 0.1 + 0.2, 0.9, 0.9, 0.9, 0.3, 0.3 + 1e-4])
    g = np.array([0, 0, 0, 0, 4, 4, 4, 8, 8])
    assert r64[0] != r64[1] and np.float32(r64[0]) == np.float32(r64[1])
    r32 = np.full(3, 0.9, np.float32)
    naive_mean = np.float32(np.float32(r32[0] + r32[1]) + r32[2]) / np.float32(3)
    assert r32[0] - naive_mean != 0  # what a std > 0 test would have scaled up
    for cfg in [
        AdvantageConfig(),
        AdvantageConfig(use_leave_one_out_baseline=True),
        AdvantageConfig(estimator="dr_grpo"),
    ]:
        got = np.asarray(compute_advantages(jnp.asarray(r64), jnp.asarray(g), cfg))
        assert (got[:7] == 0.0).all()
        assert (np.abs(got[7:]) > 0).all()  # a real 1e-4 difference is signal, not residue
        np.testing.assert_allclose(got, np_advantages(r64, g, cfg), rtol=RTOL, atol=ATOL)


def test_token_advantages_grpo_broadcast():
    r, g = jnp.array([1.0, 0.0, 2.0, 2.0]), jnp.array([0, 0, 1, 1])
    mask = np.array([[0, 1, 1], [1, 1, 0], [0, 0, 1], [1, 1, 1]], np.float32)
    got = compute_token_advantages(r, g, mask, AdvantageConfig())
    np.testing.assert_allclose(got, compute_advantages(r, g, AdvantageConfig())[:, None] * mask)
    with pytest.raises(ValueError):
        compute_token_advantages(r, g, mask, AdvantageConfig(), kl_bt=jnp.zeros((4, 3)))


@pytest.mark.parametrize("with_kl", [False, True])
def test_token_advantages_reinforce_pp_matches_numpy(with_kl):
    rng = np.random.default_rng(14)
    r = rng.normal(size=6)
    g = np.array([0, 0, 2, 2, 4, 4])
    mask = (rng.random((6, 5)) > 0.3).astype(np.float64)
    kl = 0.05 * rng.random((6, 5))
    cfg = AdvantageConfig(estimator="reinforce_plus_plus", advantage_clip_high=1.5)
    got = compute_token_advantages(
        jnp.asarray(r, jnp.float32),
        jnp.asarray(g),
        mask,
        cfg,
        kl_bt=jnp.asarray(kl, jnp.float32) if with_kl else None,
    )
    mean = np.array([r[g == gi].mean() for gi in g])
    a = (r - mean)[:, None] - (kl if with_kl else 0.0)
    mu = (a * mask).sum() / mask.sum()
    var = ((a - mu) ** 2 * mask).sum() / mask.sum()
    want = np.minimum((a - mu) / np.sqrt(max(var, 1e-8)), 1.5) * mask
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
