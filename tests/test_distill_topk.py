"""distillation.loss top_k (jgrpo.distillation.add_topk_loss): coef x the KL between the
teacher's and the policy's distributions renormalised over the teacher's top-k ids, added to
the loss, against float64 NumPy from the models' full [B, T, V] logits (not the step's chunked
head) with the gradient of the same loss written in plain JAX; a torch transcription of
NeMo-RL's DistillationLossFn (heavy); packed = unpacked (heavy); the top-k path adds no forward
and no matmul to the sampled-token program (heavy); bad config -> one ConfigError line.

NeMo-RL's own unit values (tests/unit/algorithms/test_loss_functions.py) come from CUDA
`torch.randn` under seed 42 (a CUDA generator: not reproducible on CPU), so the torch test
transcribes its formula instead."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_distill import COEF, build, compiled_step, logprobs64, loss_tokens, step_math
from test_packing import MODEL, assert_same, host_batch

from jgrpo import distillation
from jgrpo.batch import TrainBatch
from jgrpo.config import ConfigError, load_config
from jgrpo.models import Transformer

K, W = 5, 0.3
TOPK = ["distillation.loss=top_k", f"distillation.top_k={K}", f"distillation.mixed_kl_weight={W}"]


def log_softmax64(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def topk_kl64(teacher_logits, student_logits, k, w):
    """[B, T-1] float64 w x KL(t || s) + (1 - w) x KL(s || t) of the teacher's top-k ids at
    each position, both renormalised over them; and those ids [B, T-1, k]."""
    ids = np.argsort(-teacher_logits, axis=-1, kind="stable")[..., :k]
    t = log_softmax64(np.take_along_axis(teacher_logits, ids, -1))
    s = log_softmax64(np.take_along_axis(student_logits, ids, -1))
    fwd, rev = (np.exp(t) * (t - s)).sum(-1), (np.exp(s) * (s - t)).sum(-1)
    return w * fwd + (1 - w) * rev, ids


@pytest.mark.heavy  # make test: the float64 KL and the chunked head below (the same math)
def test_topk_step_and_its_gradient_equal_float64_numpy():
    """Pure distillation (no reward: the advantage 0) under loss top_k: the teacher's top-k
    ids, distill/topk_kl and the loss/total it adds equal float64 NumPy over the loss tokens m
    (multi-turn holes, a masked row and a padding row excluded); the gradient is the policy
    loss's (0 here: no reward, no KL penalty) plus that of the same KL written in plain JAX on
    full logits, and nonzero; the advantage is left alone; distill/reverse_kl still logged."""
    built, model, teacher = build(TOPK)
    host = TrainBatch(**host_batch())
    host = dataclasses.replace(host, rewards=np.zeros_like(host.rewards))
    data, metrics, grads, loss_metrics = step_math(built, host)

    temp, m = float(built.hparams.temperature), loss_tokens(host)

    def full(mdl):  # [B, T, V] float64 logits of the whole rows
        return np.asarray(mdl(host.input_ids, None, host.attention_mask), np.float64)

    kl, ids = topk_kl64(full(teacher)[:, :-1] / temp, full(model)[:, :-1] / temp, K, W)
    m1 = m[:, 1:]  # column t is scored from position t - 1
    got_ids = np.asarray(data.teacher_topk.ids)[:, 1:]
    np.testing.assert_array_equal(got_ids[m1 > 0], ids[m1 > 0])
    n_tok = (host.token_mask * host.sample_mask[:, None]).sum()
    want_kl = (kl * m1).sum() / n_tok
    assert want_kl > 0.05
    np.testing.assert_allclose(float(loss_metrics["distill/topk_kl"]), want_kl, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(data.advantages), 0.0)
    lt, lo = logprobs64(teacher, host, temp), logprobs64(model, host, temp)
    np.testing.assert_allclose(
        float(metrics["distill/reverse_kl"]), ((lo - lt) * m).sum() / m.sum(), rtol=1e-5
    )

    # no reward, no KL penalty: the policy loss is 0 with no gradient, the loss is the KL's
    np.testing.assert_allclose(float(loss_metrics["loss/total"]), COEF * want_kl, rtol=1e-5)
    graphdef = built.graphdef
    t64 = log_softmax64(np.take_along_axis(full(teacher)[:, :-1] / temp, ids, -1))
    t32, ids32, m32 = (jnp.asarray(x, jnp.float32) for x in (t64, ids, m1))

    def kl_loss(params):  # the same KL in plain JAX, through the model's full logits
        logits = nnx.merge(graphdef, params)(host.input_ids, None, host.attention_mask)
        s = jax.nn.log_softmax(
            jnp.take_along_axis(logits[:, :-1] / temp, ids32.astype(jnp.int32), -1), -1
        )
        kl = W * jnp.sum(jnp.exp(t32) * (t32 - s), -1) + (1 - W) * jnp.sum(
            jnp.exp(s) * (s - t32), -1
        )
        return COEF * jnp.sum(kl * m32) / n_tok

    kl_grads = jax.jit(jax.grad(kl_loss))(built.state.params)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(kl_grads)) > 1e-3
    check = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)  # noqa: E731
    jax.tree.map(check, grads, kl_grads)


def test_topk_kl_its_gradient_and_the_chunked_head_equal_float64_numpy():
    """make test's proof. (1) Hand-built teacher and student logits: add_topk_loss's value and
    its gradient in the student's logits equal float64 NumPy (closed forms: forward KL's
    q - t, reverse KL's q (log q - log t - KL), over the top-k ids; 0 elsewhere), nonzero, for
    forward, reverse and mixed. (2) The model's chunked head (3 chunks, first_scored 5): the
    teacher's top-k logprobs and ids, and the student's logits / temperature at given ids,
    equal NumPy over the full [B, T, V] logits."""
    rng = np.random.RandomState(0)
    b, t, v, k = 2, 6, 12, 4
    teacher, student = rng.normal(0, 2, (b, t, v)), rng.normal(0, 2, (b, t, v))
    mask = (rng.rand(b, t) > 0.3).astype(np.float64)
    t_full = log_softmax64(teacher)
    ids = np.argsort(-t_full, axis=-1, kind="stable")[..., :k]
    lt = log_softmax64(np.take_along_axis(t_full, ids, -1))
    ls = log_softmax64(np.take_along_axis(student, ids, -1))
    q, p = np.exp(ls), np.exp(lt)
    fwd, rev = (p * (lt - ls)).sum(-1), (q * (ls - lt)).sum(-1)
    g_fwd, g_rev = q - p, q * (ls - lt - rev[..., None])  # d KL / d student logit at the ids
    n = mask.sum()
    targets = lambda w: distillation.TopKTargets(  # noqa: E731
        jnp.asarray(np.take_along_axis(t_full, ids, -1), jnp.float32),
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(w * mask, jnp.float32),
        jnp.asarray((1 - w) * mask, jnp.float32),
        jnp.full((b,), COEF, jnp.float32),
    )
    for w in (1.0, 0.0, W):

        def loss(s, w=w):
            out = (jnp.float32(0.0), {"loss/total": jnp.float32(0.0)})
            picked = jnp.take_along_axis(s, jnp.asarray(ids), -1)
            return distillation.add_topk_loss(out, picked, targets(w), jnp.float32(n))

        (got, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(student))
        kl = ((w * fwd + (1 - w) * rev) * mask).sum() / n
        np.testing.assert_allclose(float(got), COEF * kl, rtol=1e-5)
        np.testing.assert_allclose(float(metrics["distill/topk_kl"]), kl, rtol=1e-5)
        want = np.zeros((b, t, v))
        g = COEF * (w * g_fwd + (1 - w) * g_rev) * mask[..., None] / n
        np.put_along_axis(want, ids, g, -1)
        assert np.abs(want).max() > 1e-3
        np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-4, atol=1e-7)

    cfg = dataclasses.replace(MODEL, logprob_chunk_size=4)  # 16 scored columns: 4 chunks
    model = Transformer(cfg, rngs=nnx.Rngs(0), init_scale=0.2)
    host = TrainBatch(**host_batch())
    temp, first = 0.9, 8
    logits = np.asarray(model(host.input_ids, None, host.attention_mask), np.float64)[:, :-1]
    logits = logits / temp
    full = log_softmax64(logits)
    want_ids = np.argsort(-full, axis=-1, kind="stable")[..., :k]
    run = jax.jit(
        lambda ids, mask, topk_ids: (
            model.token_logprobs(ids, mask, temp, first_scored=first, top_k=k),
            model.token_logprobs(ids, mask, temp, first_scored=first, topk_ids=topk_ids),
        )
    )
    topk_ids = np.pad(want_ids, ((0, 0), (1, 0), (0, 0)))  # by column: t from position t - 1
    (lp, (top, got_ids)), (lp2, picked) = run(host.input_ids, host.attention_mask, topk_ids)
    np.testing.assert_array_equal(np.asarray(lp), np.asarray(lp2))
    np.testing.assert_array_equal(np.asarray(got_ids)[:, first:], want_ids[:, first - 1 :])
    assert not np.asarray(got_ids)[:, :first].any()
    want_top = np.take_along_axis(full, want_ids, -1)[:, first - 1 :]
    np.testing.assert_allclose(np.asarray(top)[:, first:], want_top, rtol=1e-5, atol=1e-5)
    want_picked = np.take_along_axis(logits, want_ids, -1)[:, first - 1 :]
    np.testing.assert_allclose(np.asarray(picked)[:, first:], want_picked, rtol=1e-5, atol=1e-5)


def test_bad_topk_config_is_one_config_error_naming_the_key():
    """top_k < 1, top_k over the vocabulary, a teacher with another vocab_size, a mixed weight
    outside [0, 1], loss top_k without a teacher, context parallelism: ConfigError naming the
    key."""
    teacher = ["distillation.teacher=smollm2", "distillation.loss=top_k"]
    for overrides, key in [
        ([*teacher, "distillation.top_k=0"], "distillation.top_k: must be >= 1"),
        ([*teacher, "distillation.mixed_kl_weight=1.5"], "distillation.mixed_kl_weight: must"),
        (["distillation.loss=top_k"], "distillation.loss: top_k needs distillation.teacher"),
        ([*teacher, "mesh.context=2"], "distillation.loss: top_k does not run under context"),
    ]:
        with pytest.raises(ConfigError, match=f"^{key}"):
            load_config(None, overrides)
    cfg = load_config(None, [*teacher, "distillation.top_k=9"])
    assert distillation.forward_weight(cfg, 9, 9) == 0.5
    with pytest.raises(ConfigError, match=r"^distillation.top_k: must be <= the vocabulary \(8"):
        distillation.forward_weight(cfg, 8, 8)
    with pytest.raises(ConfigError, match=r"^distillation.loss: top_k needs the teacher's vocab"):
        distillation.forward_weight(cfg, 9, 10)
    kinds = {"forward": 1.0, "reverse": 0.0}
    for kind, w in kinds.items():
        c = cfg.replace(distillation=dataclasses.replace(cfg.distillation, kl_type=kind))
        assert distillation.forward_weight(c, 9, 9) == w


@pytest.mark.heavy  # make test: the float64 test (the same math)
@pytest.mark.parametrize("kind", ["forward", "reverse", "mixed"])
def test_topk_kl_equals_a_torch_transcription_of_nemo_rls_loss(kind):
    """jgrpo's top-k KL (distillation.topk_kl / add_topk_loss on gathered logits) equals
    NeMo-RL's DistillationLossFn (zero_outside_topk false) transcribed in torch: the teacher's
    top-k *logits* and the student's logits at those ids, each log_softmax'ed over the k,
    the per-token KL masked-mean over token_mask x sample_mask; and its gradient."""
    torch = pytest.importorskip("torch")
    rng = np.random.RandomState(0)
    b, t, v, k = 3, 7, 50, 8
    teacher = rng.normal(0, 2, (b, t, v))
    student = rng.normal(0, 2, (b, t, v))
    mask = (rng.rand(b, t) > 0.3).astype(np.float64)
    w = {"forward": 1.0, "reverse": 0.0, "mixed": 0.3}[kind]

    # NeMo-RL (nemo_rl/algorithms/loss/loss_functions.py, distributed/model_utils.py), float64
    s_logits = torch.tensor(student, requires_grad=True)
    t_vals, t_ids = torch.topk(torch.tensor(teacher), k, dim=-1)
    s_lp = torch.log_softmax(s_logits.gather(-1, t_ids), -1)
    t_lp = torch.log_softmax(t_vals, -1)
    fwd = (t_lp.exp() * (t_lp - s_lp)).sum(-1)
    rev = (s_lp.exp() * (s_lp - t_lp)).sum(-1)
    per_token = {"forward": fwd, "reverse": rev, "mixed": w * fwd + (1 - w) * rev}[kind]
    m = torch.tensor(mask)
    want = (per_token * m).sum() / m.sum()
    want.backward()

    # jgrpo: the teacher's full-vocab logprobs at its top ids (shift-invariant: the same)
    t_lp_full = jax.nn.log_softmax(jnp.asarray(teacher, jnp.float32), -1)
    t_top, ids = jax.lax.top_k(t_lp_full, k)
    np.testing.assert_array_equal(np.asarray(ids), t_ids.numpy())
    m32 = jnp.asarray(mask, jnp.float32)
    targets = distillation.TopKTargets(
        t_top, ids, w * m32, (1 - w) * m32, jnp.full((b,), 1.0, jnp.float32)
    )

    def loss(s):
        picked = jnp.take_along_axis(s, ids, -1)
        out = (jnp.float32(0.0), {"loss/total": jnp.float32(0.0)})
        return distillation.add_topk_loss(out, picked, targets, jnp.sum(m32))[0]

    got, grad = jax.value_and_grad(loss)(jnp.asarray(student, jnp.float32))
    np.testing.assert_allclose(float(got), want.item(), rtol=1e-5)
    assert np.abs(s_logits.grad.numpy()).max() > 1e-3
    np.testing.assert_allclose(np.asarray(grad), s_logits.grad.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.heavy  # make test: the float64 test (the packed teacher forward is test_distill's)
def test_packed_topk_distillation_equals_unpacked():
    """Packed rows, two microbatches: every metric (distill/topk_kl included) and the gradient
    within 1e-6 of the padded-row step."""
    out = []
    for packed in (False, True):
        built, *_ = build([*TOPK, "grpo.num_microbatches=2"], packed=packed)
        _, metrics, grads, loss_metrics = step_math(built, TrainBatch(**host_batch()))
        metrics = {k: float(v) for k, v in (metrics | loss_metrics).items()}
        out.append((jax.tree.map(np.asarray, grads), metrics))
    assert out[0][1]["distill/topk_kl"] > 0.05
    assert_same(out[1], out[0])


@pytest.mark.heavy  # make test: test_distill's absence proof (the same teacher forward)
def test_topk_adds_no_forward_and_no_matmul():
    """loss top_k compiles the same forwards as sampled_token (prev, teacher, policy) and the
    same matmuls: the top-k and the gather ride in the teacher's and the policy's head chunks."""
    sampled = compiled_step([], True)
    topk = compiled_step(TOPK, True)
    assert topk[2] == sampled[2] == ["prev", "teacher", "policy"]
    assert topk[1] == sampled[1]
