"""Router replay (docs/moe.md "Router replay"): the sampler records each fed token's experts,
they travel with the rollout, and the train step routes those tokens with them."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jgrpo import step, step_setup, train
from jgrpo.batch import TrainBatch, left_pad
from jgrpo.config import ConfigError, load_config
from jgrpo.metrics import read_metrics
from jgrpo.models import from_pretrained
from jgrpo.rollout.engine import assemble_batch
from jgrpo.rollout.results import REWARD_FAILURE_KEYS, RolloutResult, concat_results
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
            "grpo.seq_logprob_error_threshold=2.0",  # the prev forward runs (and replays)
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


@pytest.mark.heavy  # two more step compiles (make test: the float32 proof above)
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


@pytest.mark.heavy  # three sampler programs
@pytest.mark.parametrize(
    "mode",
    [dict(decode_slots=3), dict(compact_decode=True), dict(decode_slots=3, compact_decode=True)],
)
def test_recorded_experts_are_the_trainer_routing_in_every_decode_loop(tiny_moe, mode):
    """float32, decode slots, the compacting loop and both (every row at once: the float32
    test above): the recorded experts of every fed token (prompt and completion) are the
    trainer forward's own choice, -1 on prompt padding, each row's last token and after it."""
    gen, batch = rollout(tiny_moe, group=1, **mode)
    ids, mask = batch["input_ids"], batch["attention_mask"] > 0
    _, routed = tiny_moe.token_logprobs_routed(jnp.asarray(ids), jnp.asarray(mask))
    own = np.moveaxis(np.asarray(routed.expert_ids), 0, 2)  # [B, T, l, k]
    recorded = gen.expert_ids[..., 0, 0] >= 0
    p = gen.prompt_tokens.shape[1]
    fed = mask.copy()
    fed[np.arange(len(ids)), p + gen.lengths - 1] = False  # the last token is never fed
    np.testing.assert_array_equal(recorded, fed)
    np.testing.assert_array_equal(np.sort(gen.expert_ids[recorded], -1), np.sort(own[recorded], -1))


def test_replay_off_leaves_no_trace_in_the_step():
    """Static flags: without router_replay / record_routing nothing of them is in the step's
    program (no int16 ids, no top-k set comparison); router_replay adds both."""
    from jgrpo.models import load_policy

    def jaxpr(*overrides):
        cfg = load_config(
            None,
            [
                "model.path=builtin:tiny-qwen3-moe",
                "grpo.num_prompts_per_step=4",
                "grpo.num_generations_per_prompt=2",
                "rollout.prompt_bucket=8",
                "rollout.max_new_tokens=8",
                "grpo.seq_logprob_error_threshold=2.0",
                *overrides,
            ],
        )
        built = step_setup.build_step(cfg, load_policy(cfg.model, abstract=True))
        return str(jax.make_jaxpr(built.step_fn)(*built.abstract_args()))

    off, replay = jaxpr(), jaxpr("model.moe.router_replay=true")
    assert "i16[" not in off  # no recorded ids
    assert "i16[" in replay
    assert replay.count(" sort[") > off.count(" sort[")  # the top-k set comparison


def test_recorded_ids_widen_with_minus_one_and_join():
    """Rollout batches of two prompt widths join (concat_results) with the narrower one's
    expert ids left-padded by -1 (not recorded), the other [B, T] arrays by 0."""
    ids = np.arange(2 * 3 * 2 * 2, dtype=np.int16).reshape(2, 3, 2, 2)
    np.testing.assert_array_equal(left_pad("expert_ids", ids, 2)[:, :2], -1)
    np.testing.assert_array_equal(left_pad("expert_ids", ids, 2)[:, 2:], ids)
    np.testing.assert_array_equal(left_pad("token_mask", np.ones((2, 3)), 1)[:, 0], 0)

    def result(t):
        b = 2
        batch = {
            "input_ids": np.ones((b, t), np.int32),
            "attention_mask": np.ones((b, t), np.float32),
            "token_mask": np.ones((b, t), np.float32),
            "generation_logprobs": np.zeros((b, t), np.float32),
            "expert_ids": np.zeros((b, t, 2, 2), np.int16),
            "rewards": np.zeros(b, np.float32),
            "group_ids": np.zeros(b, np.int32),
            "sample_mask": np.ones(b, np.float32),
            "weight_version": np.zeros(b, np.int32),
            "lengths": np.ones(b, np.int32),
            "truncated": np.zeros(b, bool),
        }
        return RolloutResult(batch, dict.fromkeys(REWARD_FAILURE_KEYS, 0.0), [])

    joined = concat_results([result(3), result(5)], [0, 1]).batch
    assert joined["expert_ids"].shape == (4, 5, 2, 2)
    np.testing.assert_array_equal(joined["expert_ids"][:2, :2], -1)
    TrainBatch.from_mapping(joined)  # checked: [B, T, l, k] int16


def test_recorded_routing_refuses_multi_turn_rollouts():
    with pytest.raises(ConfigError, match="model.moe.router_replay: recorded routing"):
        load_config(
            None,
            ["model.moe.router_replay=true", "data.task=calculator", "rollout.max_turns=2"],
        )


TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
TINY_RUN = [
    "model.path=builtin:tiny-qwen3-moe",
    "grpo.max_num_steps=2",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "logging.tensorboard=false",
    "model.moe.router_replay=true",
]


@pytest.mark.heavy  # a 2-step run, packed
def test_train_with_replay_and_packing(tmp_path):
    """`jgrpo train` with router_replay and sequence packing (the ids packed with their
    tokens): float32 mismatch 0, the sampler's logprobs, gradients flow."""
    cfg = load_config(TINY, [*TINY_RUN, "grpo.sequence_packing=true"])
    train.run(cfg, tmp_path / "run")
    for row in read_metrics(tmp_path / "run"):
        assert row["moe/routing_mismatch"] == 0.0
        assert row["logprob/token_mult_prob_error"] <= 1.001
        assert row["train/grad_norm"] > 1e-4


@pytest.mark.heavy  # Ray workers sample (about a minute)
def test_ray_workers_carry_the_recorded_experts(tmp_path, ray_cluster):
    """rollout.backend: ray: the workers record the experts and the batch brings them to the
    step (a batch without them would be refused): mismatch 0 in float32."""
    cfg = load_config(TINY, [*TINY_RUN, "rollout.backend=ray", "rollout.num_workers=2"])
    train.run(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["moe/routing_mismatch"] == 0.0
        assert row["logprob/token_mult_prob_error"] <= 1.001
