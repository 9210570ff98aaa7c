"""The jitted train step: compiled-graph proofs, invariances (microbatches, meshes), learning."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROLLOUT_BATCH_BUCKET, TINY_MODEL_FIELDS, make_rollout_batch
from flax import nnx

from jgrpo import inspect_step, losses, sharding, step, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import ConfigError, load_config
from jgrpo.models import Transformer, TransformerConfig

MODEL = TransformerConfig(**TINY_MODEL_FIELDS)
BASE = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "optim.learning_rate=1e-3",
    "rollout.temperature=0.9",
    ROLLOUT_BATCH_BUCKET,
    "grpo.sequence_packing=false",  # the padded-row step (test_packing.py: packed = padded)
]


def build(overrides=(), mesh_shape=(1, 1, 1), seed=0):
    """(jitted step, state, ref_params, hparams, batch on mesh, mesh, graphdef, flags)."""
    cfg = load_config(None, BASE + list(overrides))
    n = int(np.prod(mesh_shape))
    mesh_cfg = dataclasses.replace(
        cfg.mesh, data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2]
    )
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:n])
    model = Transformer(MODEL, rngs=nnx.Rngs(seed), init_scale=0.2)
    built = step_setup.build_step(cfg.replace(mesh=mesh_cfg), model, mesh=mesh)
    # a reference policy that differs from the initial one, so the KL terms are not 0
    ref_params = jax.tree.map(lambda x: x * 0.9, built.state.params)
    batch = TrainBatch(**make_rollout_batch(0)).shard(mesh)
    return (
        built.step_fn,
        built.state,
        ref_params,
        built.hparams,
        batch,
        mesh,
        built.graphdef,
        built.flags,
    )


def compiled(overrides):
    fn, state, ref, hp, batch, *_ = build(overrides)
    exe = fn.lower(state, batch, hp, ref).compile()
    text = exe.as_text()
    traced = inspect_step.forwards_in_jaxpr(jax.make_jaxpr(fn)(state, batch, hp, ref))
    assert traced == inspect_step.forwards_in_hlo(text), "a forward was traced, then eliminated"
    return exe.cost_analysis()["flops"], text.count(" dot("), inspect_step.forwards_in_hlo(text)


def standalone_forward_cost():
    _, state, _, hp, batch, _, graphdef, flags = build()
    exe = (
        jax.jit(
            lambda p, b: step.frozen_logprobs(
                "x", graphdef, p, b, hp.temperature, 1, first_scored=flags.first_scored
            )
        )
        .lower(state.params, batch)
        .compile()
    )
    return exe.cost_analysis()["flops"], exe.as_text().count(" dot(")


def test_skipped_forwards_are_absent_from_the_compiled_program():
    full = compiled(["loss.reference_policy_kl_penalty=0.1"])
    no_prev = compiled(["loss.reference_policy_kl_penalty=0.1", "loss.force_on_policy_ratio=true"])
    neither = compiled(["loss.force_on_policy_ratio=true"])
    assert full[2] == ["ref", "prev", "policy"]
    assert no_prev[2] == ["ref", "policy"]
    assert neither[2] == ["policy"]
    # each skipped forward removes one standalone forward's flops (up to the few elementwise
    # loss terms that read it) and exactly its dots
    fwd_flops, fwd_dots = standalone_forward_cost()
    assert full[0] - no_prev[0] == pytest.approx(fwd_flops, rel=0.01)
    assert no_prev[0] - neither[0] == pytest.approx(fwd_flops, rel=0.01)
    assert fwd_dots > 0
    assert full[1] - no_prev[1] == fwd_dots
    assert no_prev[1] - neither[1] == fwd_dots
    # the policy forward + backward costs more than one frozen forward: the remainder is real
    assert neither[0] > 2 * fwd_flops


def test_float_hyperparameters_do_not_recompile():
    fn, state, ref, hp, batch, *_ = build(["loss.reference_policy_kl_penalty=0.1"])
    state, _ = fn(state, batch, hp, ref)
    for key, value in [("ratio_clip_min", 0.1), ("reference_policy_kl_penalty", 0.3)]:
        hp = hp.replace(loss={**hp.loss, key: jnp.float32(value)})
        state, _ = fn(state, batch, hp, ref)
    optimizer = hp.optimizer.replace(learning_rate=jnp.float32(5e-4))
    hp = hp.replace(optimizer=optimizer, temperature=jnp.float32(0.7))
    state, metrics = fn(state, batch, hp, ref)
    assert fn.top_level._cache_size() == 1  # the jit that top-level calls run
    assert float(metrics["train/learning_rate"]) == pytest.approx(5e-4)


def prepared(state, batch, hp, ref, flags, graphdef):
    """step.prepare_batch under jit, as the step runs it (eagerly it dispatches op by op, on
    8 devices most of a test's time)."""
    fn = functools.partial(step.prepare_batch, flags=flags, graphdef=graphdef)
    return jax.jit(fn)(state, batch, hp, ref)


def grads_for(num_microbatches, overrides=()):
    fn, state, ref, hp, batch, mesh, graphdef, flags = build(
        [f"grpo.num_microbatches={num_microbatches}", *overrides]
    )
    data, _ = prepared(state, batch, hp, ref, flags, graphdef)
    grads, metrics = jax.jit(
        lambda p, d: step.accumulate_gradients(p, d, hp, flags=flags, graphdef=graphdef)
    )(state.params, data)
    return jax.tree.map(np.asarray, grads), {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["loss.reference_policy_kl_penalty=0.1"], marks=pytest.mark.heavy),
        pytest.param(
            ["loss.aggregation=seq_mean", "loss.sequence_level_importance_ratios=true"],
            marks=pytest.mark.heavy,
        ),
        pytest.param(
            ["loss.aggregation=seq_sum_norm", "loss.use_importance_sampling_correction=true"],
            marks=pytest.mark.heavy,
        ),
        [
            "loss.aggregation=seq_mean",
            "loss.sequence_level_importance_ratios=true",
            "loss.use_importance_sampling_correction=true",
            "loss.truncated_importance_sampling_type=tis",
            "loss.truncated_importance_sampling_ratio=1.5",
            "loss.truncated_importance_sampling_ratio_min=0.5",  # the row weights are ~e^-10
        ],
    ],
)
def test_microbatch_count_does_not_change_loss_or_gradients(overrides):
    ref_grads, ref_metrics = grads_for(1, overrides)
    assert max(np.abs(g).max() for g in jax.tree.leaves(ref_grads)) > 1e-3
    for k in (2, 4):
        grads, metrics = grads_for(k, overrides)
        for key in ("loss/total", "loss/pg", "loss/kl", "ratio/max", "ratio/min"):
            assert metrics[key] == pytest.approx(ref_metrics[key], abs=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads, ref_grads)


MESHES = [(1, 1, 1), (8, 1, 1), (2, 4, 1), (2, 2, 2)]


def one_step_on(mesh_shape):
    fn, state, ref, hp, batch, mesh, graphdef, flags = build(
        ["loss.reference_policy_kl_penalty=0.1", "grpo.num_minibatches=2"], mesh_shape
    )
    data, _ = prepared(state, batch, hp, ref, flags, graphdef)
    grads, _ = jax.jit(
        lambda p, d: step.accumulate_gradients(p, d, hp, flags=flags, graphdef=graphdef)
    )(state.params, data)
    shard_shapes = {
        k: v.addressable_shards[0].data.shape for k, v in state.params["layers"].items()
    }
    new_state, metrics = fn(state, batch, hp, ref)
    return (
        float(metrics["loss/total"]),
        jax.tree.map(np.asarray, grads),
        jax.tree.map(np.asarray, new_state.params),
        shard_shapes,
        new_state,
    )


@pytest.fixture(scope="module")
def one_device_step():
    """one_step_on the 1-device mesh: the reference every mesh is compared with."""
    return one_step_on(MESHES[0])


@pytest.mark.parametrize(
    "shape",
    [pytest.param(shape, marks=pytest.mark.heavy) for shape in MESHES[1:-1]] + [MESHES[-1]],
    ids=lambda shape: "x".join(map(str, shape)),
)
def test_meshes_agree_and_really_shard(shape, one_device_step):
    """One step on a mesh = the 1-device step (make test: data x fsdp x tensor = 2 x 2 x 2,
    every axis at once; make test-all: every mesh of MESHES)."""
    loss0, grads0, params0, _, _ = one_device_step
    loss, grads, params, shards, new_state = one_step_on(shape)
    assert loss == pytest.approx(loss0, abs=1e-5), shape
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), grads, grads0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), params, params0)
    _, fsdp, tensor = shape
    # q: [layers, embed, heads, head_dim] -> embed over fsdp, heads over tensor
    assert shards["q"] == (2, 32 // fsdp, 4 // tensor, 8), shape
    assert shards["gate"] == (2, 32 // fsdp, 64 // tensor), shape
    # the output state keeps the param shardings (step two would not recompile)
    q = new_state.params["layers"]["q"]
    assert q.addressable_shards[0].data.shape == shards["q"]


def test_nonfinite_update_is_skipped(rollout_batch):
    fn, state, ref, hp, _, mesh, *_ = build()
    bad = dict(rollout_batch, rewards=rollout_batch["rewards"] * np.nan)
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = fn(state, TrainBatch(**bad).shard(mesh), hp, ref)
    assert float(metrics["train/skipped_updates"]) == 1.0
    assert int(state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before)


def test_metric_keys_identical_across_flags():
    key_sets = []
    for overrides in (
        [],
        ["loss.force_on_policy_ratio=true"],
        ["loss.reference_policy_kl_penalty=0.05", "grpo.seq_logprob_error_threshold=2.0"],
        ["grpo.num_minibatches=2", "grpo.num_microbatches=2"],
    ):
        fn, state, ref, hp, batch, *_ = build(overrides)
        _, metrics = fn(state, batch, hp, ref)
        key_sets.append(set(metrics))
        assert all(np.isfinite(float(v)) for v in metrics.values()), overrides
    assert all(keys == key_sets[0] for keys in key_sets)
    assert {
        "loss/total",
        "kl/penalty",
        "logprob/token_mult_prob_error",
        "reward/mean",
        "train/grad_norm",
        "train/learning_rate",
        "ratio/clip_fraction",
    } <= key_sets[0]


def test_steps_raise_logprob_of_positive_advantage_completions():
    fn, state, ref, hp, batch, mesh, graphdef, flags = build(["optim.learning_rate=3e-3"])
    host = make_rollout_batch(0)
    mask = host["token_mask"]
    positive = np.zeros(len(host["rewards"]), bool)
    for g in np.unique(host["group_ids"]):
        rows = host["group_ids"] == g
        positive |= rows & (host["rewards"] > host["rewards"][rows].mean())
    assert positive.any()

    def mean_logprob(params):
        lp_bt = step.sequence_logprobs(
            graphdef, params, batch.input_ids, batch.attention_mask, hp.temperature
        )
        lp = np.asarray(lp_bt)
        return (lp * mask)[positive].sum() / mask[positive].sum()

    start = mean_logprob(state.params)
    for _ in range(5):
        state, _ = fn(state, batch, hp, ref)
    assert mean_logprob(state.params) > start + 0.1


def widen_prompts(batch, extra):
    """The same rows with `extra` more left-padding columns (a larger prompt bucket)."""
    pad = lambda x, value=0: np.pad(x, ((0, 0), (extra, 0)), constant_values=value)
    out = dict(batch)
    for key in ("input_ids", "attention_mask", "token_mask"):
        out[key] = pad(batch[key])
    out["generation_logprobs"] = pad(batch["generation_logprobs"], -3.0)
    return out


def test_seq_sum_norm_does_not_depend_on_the_prompt_bucket():
    overrides = ["loss.aggregation=seq_sum_norm", "loss.reference_policy_kl_penalty=0.1"]

    def grads_at(extra):
        fn, state, ref, hp, _, mesh, graphdef, flags = build(overrides)
        assert flags.loss.generation_budget == 256  # rollout.max_new_tokens, not the width
        batch = TrainBatch(**widen_prompts(make_rollout_batch(0), extra)).shard(mesh)
        data, _ = prepared(state, batch, hp, ref, flags, graphdef)
        grads, metrics = jax.jit(
            lambda p, d: step.accumulate_gradients(p, d, hp, flags=flags, graphdef=graphdef)
        )(state.params, data)
        return jax.tree.map(np.asarray, grads), float(metrics["loss/total"])

    (g0, l0), (g1, l1) = grads_at(0), grads_at(19)
    assert l1 == pytest.approx(l0, rel=1e-5)
    assert max(np.abs(g).max() for g in jax.tree.leaves(g0)) > 1e-5
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-8), g1, g0)


def test_generation_budget_comes_from_the_rollout_and_is_validated():
    cfg = load_config(None, ["rollout.max_new_tokens=17", "loss.aggregation=seq_sum_norm"])
    assert step.StepFlags.from_config(cfg).loss.generation_budget == 17
    cfg = load_config(None, ["rollout.max_new_tokens=17", "loss.generation_budget=40"])
    assert step.StepFlags.from_config(cfg).loss.generation_budget == 40
    with pytest.raises(ConfigError, match="loss.generation_budget"):
        load_config(None, ["loss.generation_budget=0"])


def test_kl_in_reward_is_clamped_in_the_step():
    beta, c_in, c_out = 0.5, 0.05, 0.002
    fn, state, ref, hp, batch, mesh, graphdef, flags = build(
        [
            "grpo.advantage.estimator=reinforce_plus_plus",
            "loss.use_kl_in_reward=true",
            f"loss.reference_policy_kl_penalty={beta}",
            f"loss.kl_input_clamp_value={c_in}",
            f"loss.kl_output_clamp_value={c_out}",
        ]
    )
    data, _ = prepared(state, batch, hp, ref, flags, graphdef)
    lo, lr = (np.asarray(x, np.float64) for x in (data.prev_logprobs, data.reference_logprobs))
    x = np.clip(lr - lo, -c_in, c_in)
    kl = beta * np.clip(np.exp(x) - 1 - x, -c_out, c_out)
    m = np.asarray(batch["token_mask"]) > 0
    assert (np.abs(lr - lo)[m] > c_in).any()  # the clamps bite on this batch
    host = make_rollout_batch(0)
    want = losses.compute_token_advantages(
        host["rewards"],
        host["group_ids"],
        host["token_mask"],
        flags.advantage,
        kl_bt=jnp.asarray(kl, jnp.float32),
        sample_mask_b=host["sample_mask"],
    )
    np.testing.assert_allclose(np.asarray(data.advantages), want, rtol=1e-5, atol=1e-6)


def test_seq_error_metrics_are_reported_before_and_after_the_threshold():
    fn, state, ref, hp, batch, mesh, graphdef, flags = build(
        ["grpo.seq_logprob_error_threshold=100.0"]
    )
    data, _ = prepared(state, batch, hp, ref, flags, graphdef)
    host = make_rollout_batch(0)
    lo, lg = np.asarray(data.prev_logprobs, np.float64), host["generation_logprobs"]
    m = host["token_mask"] * host["sample_mask"][:, None]
    e = (np.exp(np.abs(lg - lo)) * m).sum(1) / m.sum(1)
    threshold = float(np.median(e))
    hp = hp.replace(seq_logprob_error_threshold=jnp.float32(threshold))
    data, metrics = prepared(state, batch, hp, ref, flags, graphdef)
    kept = e <= threshold
    assert 0 < kept.sum() < len(e)
    assert float(metrics["logprob/num_masked_seqs_by_logprob_error"]) == (~kept).sum()
    np.testing.assert_array_equal(np.asarray(data.sample_mask), kept.astype(np.float32))
    for part, rows in [("", np.ones_like(kept)), ("_kept", kept)]:
        for stat, fn_ in [("max", np.max), ("mean", np.mean), ("min", np.min)]:
            key = f"logprob/seq_error{part}_{stat}"
            np.testing.assert_allclose(float(metrics[key]), fn_(e[rows]), rtol=1e-5, err_msg=key)


def test_frozen_split_trains_only_the_trainable_tree():
    """build_step(trainable=...): the frozen tree joins every forward but never changes; the
    first step's loss equals the unsplit model's (same forward)."""
    cfg = load_config(None, [*BASE, "mesh.data=1"])
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    batch = TrainBatch(**make_rollout_batch(0)).shard(mesh)
    losses_ = {}
    for name, trainable in {"all": None, "layers": nnx.PathContains("layers")}.items():
        model = Transformer(MODEL, rngs=nnx.Rngs(0), init_scale=0.2)
        built = step_setup.build_step(cfg, model, mesh=mesh, trainable=trainable)
        before = jax.tree.map(np.asarray, (built.state.params, built.frozen))
        state, metrics = built.step_fn(built.state, batch, built.hparams, None, built.frozen)
        losses_[name] = float(metrics["loss/total"])
        if name == "layers":
            assert set(state.params) == {"layers"}
            assert set(built.frozen) == {"embed", "final_norm", "lm_head"}
            jax.tree.map(np.testing.assert_array_equal, built.frozen, before[1])
            moved = jax.tree.map(
                lambda a, b: np.abs(np.asarray(a) - b).max(), state.params, before[0]
            )
            assert min(jax.tree.leaves(moved)) > 0
    assert losses_["layers"] == pytest.approx(losses_["all"], abs=1e-6)


def test_a_generated_token_left_of_the_prompt_bucket_is_rejected():
    """The step computes no logprob left of rollout.prompt_bucket (StepFlags.first_scored): a
    batch with a generated token there stops with a line naming the column and the key."""
    host = make_rollout_batch(0)  # completions from column 5 on
    assert TrainBatch(**host).check_scored_from(5) is not None
    host["token_mask"][3, 4] = 1.0
    with pytest.raises(ValueError, match=r"column 4, left of rollout.prompt_bucket = 5"):
        TrainBatch(**host).check_scored_from(5)
