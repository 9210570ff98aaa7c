"""Router replay (docs/moe.md "Router replay"): the sampler records each fed token's experts,
they travel with the rollout, and the train step routes those tokens with them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jgrpo import step, step_setup
from jgrpo.batch import TrainBatch, left_pad
from jgrpo.config import load_config
from jgrpo.models import from_pretrained
from jgrpo.rollout.engine import assemble_batch, concat_results, RolloutResult
from jgrpo.sampling import SamplingParams, generate

PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2, 8], [11, 12], [3, 3, 3, 3]]
STOPS = tuple(range(100, 140))  # rows end at different lengths


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from jgrpo.models.tiny import build_tiny_moe_model

    return from_pretrained(build_tiny_moe_model(tmp_path_factory.mktemp("moe") / "tiny"))


def rollout(model, group=2, **params):
    """A float32 rollout batch of PROMPTS x group on `model`, experts recorded."""
    prompts = [p for p in PROMPTS for _ in range(group)]
    sampling = SamplingParams(
        max_new_tokens=8,
        prompt_bucket=8,
        stop_token_ids=STOPS,
        record_experts=True,
        **params,
    )
    gen = generate(model, prompts, sampling, jax.random.key(1), group_size=group)
    rows = [i for i in range(len(PROMPTS)) for _ in range(group)]
    rewards = np.random.RandomState(0).rand(len(rows)).astype(np.float32)
    return gen, assemble_batch(gen, rows, rewards, version=0)


def run_step(model, batch, overrides=(), replace_ids=None):
    """The train step's metrics and gradients (one minibatch, no update) on `batch` (a rollout
    dict) -> (metrics, grads, StepSetup)."""
    cfg = load_config(
        None,
        [
            "model.path=builtin:tiny-qwen3-moe",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=2",
            "rollout.prompt_bucket=8",
            "rollout.max_new_tokens=8",
            "loss.reference_policy_kl_penalty=0.1",
            "grpo.seq_logprob_error_threshold=2.0",
            *overrides,
        ],
    )
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))  # the step donates its state
    built = step_setup.build_step(cfg, model)
    batch = dict(batch)
    if not built.flags.record_routing:
        batch.pop("expert_ids")
    elif replace_ids is not None:
        batch["expert_ids"] = replace_ids(batch["expert_ids"])
    device_batch = built.device_batch(TrainBatch.from_mapping(batch))

    @jax.jit
    def metrics_and_grads(state, batch, hparams, ref):
        kw = dict(flags=built.flags, graphdef=built.graphdef)
        data, metrics = step.prepare_batch(state, batch, hparams, ref, **kw)
        grads, loss_metrics = step.accumulate_gradients(state.params, data, hparams, **kw)
        return metrics | loss_metrics, grads

    metrics, grads = metrics_and_grads(built.state, device_batch, built.hparams, built.ref_params)
    return metrics, grads, built


def test_replay_in_float32_changes_no_number(tiny_moe):
    """float32: the trainer routes every generated token as the sampler did (mismatch 0), so
    replaying the sampler's experts gives the same losses, metrics and gradients."""
    gen, batch = rollout(tiny_moe)
    assert gen.expert_ids.dtype == np.int16
    assert (batch["expert_ids"][..., 0, 0] >= 0).sum() > 10
    plain, grads, _ = run_step(tiny_moe, batch)
    replay, grads_r, built = run_step(tiny_moe, batch, ["model.moe.router_replay=true"])
    assert built.flags.router_replay and built.flags.record_routing
    assert float(replay["moe/routing_mismatch"]) == 0.0
    assert "moe/routing_mismatch" not in plain
    assert float(replay["logprob/token_mult_prob_error"]) <= 1.001
    for key, value in plain.items():
        np.testing.assert_allclose(
            float(replay[key]), float(value), rtol=1e-6, atol=1e-7, err_msg=key
        )
    assert float(optax_norm(grads["moe"]["router"])) > 1e-4
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-8)


def optax_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def test_replayed_other_experts_route_and_train_the_router(tiny_moe):
    """Recorded ids that are not the router's choice: every recorded (token, layer) counts as
    a mismatch; replaying them changes the logprobs, and the router still gets gradients."""
    _, batch = rollout(tiny_moe)
    shift = lambda ids: np.where(ids >= 0, (ids + 1) % 8, ids).astype(np.int16)  # noqa: E731
    plain, grads, _ = run_step(tiny_moe, batch, ["model.moe.record_routing=true"], shift)
    replay, grads_r, _ = run_step(tiny_moe, batch, ["model.moe.router_replay=true"], shift)
    assert float(plain["moe/routing_mismatch"]) == 1.0
    assert float(replay["moe/routing_mismatch"]) == 1.0
    assert float(replay["logprob/token_mult_prob_error"]) > 1.01
    assert float(plain["logprob/token_mult_prob_error"]) <= 1.001
    router, router_r = grads["moe"]["router"], grads_r["moe"]["router"]
    assert float(optax_norm(router_r)) > 1e-4
    assert float(optax_norm(router_r - router)) > 1e-4
