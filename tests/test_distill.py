"""On-policy distillation (jgrpo.distillation): the teacher's per-token term in the advantage
against float64 NumPy (logprobs from the models' full logits, not the step's chunked head),
with the real gradient it drives; packed = unpacked (a LoRA student on a 2 x 2 x 2 mesh); the
teacher forward's absence from the compiled program when distillation is off; the tokenizer
check (exit 2 from the CLI); a teacher equal to the policy; pure distillation on the prompts task
(no verifier, no reward function); heavy: a run on Ray workers equals the local run.

The batches (test_packing.host_batch) hold multi-turn holes in the token mask, a row out of the
loss and a padding row: the term must grade the loss tokens m alone."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL_FIELDS
from flax import nnx
from test_packing import BASE, MODEL, assert_same, host_batch, randomize_adapters

from jgrpo import cli, distillation, inspect_step, sharding, step, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import ConfigError, load_config
from jgrpo.models import Transformer, TransformerConfig
from jgrpo.models.adapters import attach_lora
from jgrpo.models.lora import MODULES, LoRASpec

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
TEACHER = TransformerConfig(**TINY_MODEL_FIELDS | {"num_layers": 3})
"""A deeper teacher than the policy (3 layers), the same vocabulary."""
COEF = 0.7
DISTILL = ["distillation.teacher=builtin:tiny-qwen2", f"distillation.coef={COEF}"]
"""The step never reads the teacher's name: build_step takes the teacher model itself."""


def build(overrides=(), *, teacher=None, packed=False, mesh_shape=(1, 1, 1), lora=False):
    """(StepSetup, policy model, teacher model); `teacher` None: a random TEACHER."""
    adapters = ["model.lora.rank=4", "model.lora.alpha=8.0"] if lora else []
    cfg = load_config(
        None, [*BASE, *DISTILL, *adapters, *overrides, f"grpo.sequence_packing={packed}"]
    )
    data, fsdp, tensor = mesh_shape
    mesh_cfg = dataclasses.replace(cfg.mesh, data=data, fsdp=fsdp, tensor=tensor)
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[: data * fsdp * tensor])
    model = Transformer(MODEL, rngs=nnx.Rngs(0), init_scale=0.2)
    if lora:
        spec = LoRASpec(rank=4, alpha=8.0, target_modules=tuple(MODULES))
        model = attach_lora(model, spec, jax.random.key(0))
        randomize_adapters(model)
    if teacher is None:
        teacher = Transformer(TEACHER, rngs=nnx.Rngs(1), init_scale=0.2)
    built = step_setup.build_step(cfg.replace(mesh=mesh_cfg), model, mesh=mesh, teacher=teacher)
    return built, model, teacher


def step_math(built, host):
    """(ScoredBatch, prepare_batch's metrics, the minibatch's float32 gradients, loss metrics)
    of one step on the host batch."""
    flags, graphdef, hp = built.flags, built.graphdef, built.hparams

    @jax.jit
    def run(state, batch, frozen, teacher):
        full = state._replace(params=step.with_frozen(state.params, frozen))
        data, metrics = step.prepare_batch(
            full, batch, hp, None, teacher, flags=flags, graphdef=graphdef
        )
        grads, loss_metrics = step.accumulate_gradients(
            state.params, data, hp, flags=flags, graphdef=graphdef, frozen=frozen
        )
        return data, metrics, grads, loss_metrics

    return run(built.state, built.device_batch(host), built.frozen, built.teacher)


def logprobs64(model, host, temperature):
    """[B, T] float64 log softmax(logits / temperature) of each next token, from the model's
    full [B, T, V] logits."""
    logits = np.asarray(model(host.input_ids, None, host.attention_mask), np.float64)
    z = logits[:, :-1] / temperature
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, np.asarray(host.input_ids)[:, 1:, None], -1)[..., 0]
    return np.pad(picked, ((0, 0), (1, 0)))


def grpo_advantages64(rewards, group_ids):
    """[B] float64 (r - group mean) / (Bessel std + 1e-6) over each group's rows (id >= 0,
    whatever their sample_mask); 0 in an all-equal group and on padding rows."""
    adv = np.zeros(len(rewards))
    for g in np.unique(group_ids[group_ids >= 0]):
        r = rewards[group_ids == g].astype(np.float64)
        if np.all(r == r[0]):
            continue
        adv[group_ids == g] = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    return adv


def loss_tokens(host):
    return host.token_mask * ((host.sample_mask > 0) & (host.group_ids >= 0))[:, None]


@pytest.mark.parametrize(
    "pure",
    [
        # make test: pure_distillation (the same path; the reward part is test_losses')
        pytest.param(False, id="with_rewards", marks=pytest.mark.heavy),
        pytest.param(True, id="pure_distillation"),
    ],
)
def test_teacher_term_joins_the_advantage_as_float64_numpy_says(pure):
    """A = group-normalised reward advantage + coef x (lt - lo) on the loss tokens; the step's
    gradient is the policy gradient of exactly those advantages, and nonzero (pure
    distillation: from the teacher's term alone)."""
    built, model, teacher = build()
    host = TrainBatch(**host_batch())
    if pure:  # no reward: every group all-equal, the reward advantage 0
        host = dataclasses.replace(host, rewards=np.zeros_like(host.rewards))
    data, metrics, grads, _ = step_math(built, host)

    temp, m = float(built.hparams.temperature), loss_tokens(host)
    lt, lo = logprobs64(teacher, host, temp), logprobs64(model, host, temp)
    term = COEF * (lt - lo) * m
    want = grpo_advantages64(host.rewards, host.group_ids)[:, None] * m + term
    assert np.abs(term).max() > 0.1 and (pure or np.abs(want - term).max() > 0.5)
    np.testing.assert_allclose(np.asarray(data.advantages), want, rtol=1e-5, atol=1e-5)
    kl = ((lo - lt) * m).sum() / m.sum()
    np.testing.assert_allclose(float(metrics["distill/reverse_kl"]), kl, rtol=1e-5, atol=1e-6)

    # the same loss with the float64 advantages substituted: the same gradient, and a real one
    hp, flags, graphdef = built.hparams, built.flags, built.graphdef
    ref = data.replace(advantages=jnp.asarray(want, jnp.float32))
    ref_grads, _ = jax.jit(
        lambda p, d: step.accumulate_gradients(p, d, hp, flags=flags, graphdef=graphdef)
    )(built.state.params, ref)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-3
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, ref_grads
    )


@pytest.mark.heavy  # make test: the teacher forward's packing is frozen_logprobs' (test_packing)
def test_packed_distillation_equals_unpacked_for_a_lora_student_on_a_mesh():
    """The teacher forward over packed rows, read back to rows, on a 2 x 2 x 2 mesh (the teacher
    sharded by its logical axes like the reference), two microbatches, a LoRA student: every
    metric and the gradients within 1e-6 of the unpacked step."""
    out = []
    for packed in (False, True):
        built, *_ = build(
            ["grpo.num_microbatches=2"], packed=packed, mesh_shape=(2, 2, 2), lora=True
        )
        _, metrics, grads, loss_metrics = step_math(built, TrainBatch(**host_batch()))
        metrics = {k: float(v) for k, v in (metrics | loss_metrics).items()}
        out.append((jax.tree.map(np.asarray, grads), metrics))
    assert abs(out[0][1]["distill/reverse_kl"]) > 0.05
    assert_same(out[1], out[0])


def teacher_forward_cost():
    """Flops and dots of the teacher forward alone, over the same batch."""
    built, *_ = build()
    batch = built.device_batch(TrainBatch(**host_batch()))
    fn = lambda p, b: step.frozen_logprobs(  # noqa: E731
        "x", built.teacher.graphdef, p, b, built.hparams.temperature, 1, first_scored=5
    )
    exe = jax.jit(fn).lower(built.teacher.params, batch).compile()
    return exe.cost_analysis()["flops"], exe.as_text().count(" dot(")


def compiled_step(overrides, distill):
    """(flops, dots, forwards in the HLO) of the whole step, after checking the jaxpr's
    forwards are the HLO's (nothing traced, then eliminated)."""
    if distill:
        built, *_ = build(overrides)
    else:
        cfg = load_config(None, [*BASE, *overrides])
        model = Transformer(MODEL, rngs=nnx.Rngs(0), init_scale=0.2)
        built = step_setup.build_step(
            cfg, model, mesh=sharding.make_mesh(cfg.mesh, jax.devices()[:1])
        )
    args = (built.state, built.device_batch(TrainBatch(**host_batch())), built.hparams, None)
    args += (built.frozen, built.teacher)
    exe = built.step_fn.lower(*args).compile()
    text = exe.as_text()
    traced = inspect_step.forwards_in_jaxpr(jax.make_jaxpr(built.step_fn)(*args))
    assert traced == inspect_step.forwards_in_hlo(text)
    return exe.cost_analysis()["flops"], text.count(" dot("), inspect_step.forwards_in_hlo(text)


def test_teacher_forward_is_absent_when_distillation_is_off():
    """With distillation the step holds exactly one more forward, the teacher's: its flops (up
    to the few elementwise terms that read it) and its dots; without, no trace of it."""
    on = compiled_step([], True)
    off = compiled_step([], False)
    assert on[2] == ["prev", "teacher", "policy"]
    assert off[2] == ["prev", "policy"]
    flops, dots = teacher_forward_cost()
    assert dots > 0 and on[1] - off[1] == dots
    assert on[0] - off[0] == pytest.approx(flops, rel=0.01)


@pytest.mark.heavy  # make test: the float64 test (the same term, any teacher)
def test_a_teacher_equal_to_the_policy_gives_zero():
    """Teacher = policy (the same weights, another copy): reverse KL exactly 0; without reward
    (pure distillation) every advantage is 0, and so are the loss and the gradient."""
    twin = Transformer(MODEL, rngs=nnx.Rngs(0), init_scale=0.2)
    built, *_ = build(teacher=twin)
    host = TrainBatch(**host_batch())
    host = dataclasses.replace(host, rewards=np.ones_like(host.rewards))
    state, metrics = built.step_fn(
        built.state, built.device_batch(host), built.hparams, None, None, built.teacher
    )
    assert float(metrics["distill/reverse_kl"]) == 0.0
    for key in ("advantage/min", "advantage/max", "loss/total", "train/grad_norm"):
        assert float(metrics[key]) == 0.0, key


def test_a_teacher_with_another_tokenizer_exits_2_before_loading(tmp_path, capsys):
    """tiny-qwen2 (byte tokenizer) taught by tiny-qwen2-chat (ChatML tokens added): one line,
    exit 2; a teacher sharing the tokenizer (tiny-qwen3-moe) passes the check."""
    argv = ["train", "--config", str(TINY), "--run-dir", str(tmp_path / "run")]
    rc = cli.main([*argv, "distillation.teacher=builtin:tiny-qwen2-chat"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("jgrpo: error: distillation.teacher: its tokenizer")
    cfg = load_config(TINY, ["distillation.teacher=builtin:tiny-qwen3-moe"])
    assert distillation.check_teacher(cfg).name.startswith("tiny-qwen3-moe")
    with pytest.raises(ConfigError, match="distillation.teacher: unknown built-in model"):
        distillation.check_teacher(
            cfg.replace(distillation=dataclasses.replace(cfg.distillation, teacher="builtin:nope"))
        )
    with pytest.raises(ConfigError, match="distillation.coef: must be a finite number > 0"):
        load_config(TINY, ["distillation.teacher=smollm2", "distillation.coef=0"])


@pytest.mark.heavy  # make test: the step tests above (the rollout side is unchanged)
def test_a_distillation_run_on_ray_workers_logs_the_local_runs_metrics(tmp_path, ray_cluster):
    """Three steps of configs/tiny.yaml purely distilled (no verifier, no reward function: the
    `prompts` task) from builtin:tiny-qwen3-moe (an MoE teacher with the same tokenizer): the
    Ray backend's run logs the local run's metrics, the teacher's reverse KL included (nonzero:
    the teacher is another model); every completion token carries loss although no reward term
    scores a row."""
    from jgrpo import train
    from jgrpo.metrics import read_metrics

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{i}+{j}="}}\n' for i in range(9) for j in range(3)))
    overrides = [
        "logging.tensorboard=false",
        "grpo.max_num_steps=3",
        "distillation.teacher=builtin:tiny-qwen3-moe",
        "data.task=prompts",
        f"data.train_path={prompts}",
    ]
    rows = {}
    for backend in ("local", "ray"):
        cfg = load_config(TINY, [*overrides, f"rollout.backend={backend}"])
        train.run(cfg, tmp_path / backend)
        rows[backend] = read_metrics(tmp_path / backend)
    # no held-out set (the records are all for training): no validation row at step 0
    assert [r["step"] for r in rows["ray"]] == [r["step"] for r in rows["local"]] == [1, 2, 3]
    for got, want in zip(rows["ray"], rows["local"]):
        for key, value in want.items():
            if not (key.startswith("perf/") or key.endswith("_s")):
                assert got[key] == value, (want["step"], key, got[key], value)
    for r in rows["local"]:
        assert abs(r["distill/reverse_kl"]) > 0.1 and r["reward/mean"] == 0.0
        assert r["batch/num_valid_tokens"] == pytest.approx(16 * r["length/mean"])  # every row


def test_pure_distillation_keeps_every_row_in_the_loss():
    """No reward term scores any row (the None rule would mask them all): under pure
    distillation the rollout keeps every row; with a reward, or without a teacher, the task's
    mask stands."""
    scored = np.array([False, True, False])
    pure = load_config(TINY, ["distillation.teacher=smollm2", "data.task_reward_weight=0"])
    np.testing.assert_array_equal(distillation.loss_rows(pure, scored), [1.0, 1.0, 1.0])
    for overrides in (["distillation.teacher=smollm2"], ["data.task_reward_weight=0"]):
        cfg = load_config(TINY, overrides)
        assert not distillation.is_pure(cfg)
        np.testing.assert_array_equal(distillation.loss_rows(cfg, scored), [0.0, 1.0, 0.0])


def test_pure_distillation_needs_no_reward_on_the_prompts_task(tmp_path):
    """The `prompts` task has no verifier: without reward functions it needs a teacher (one
    line naming data.reward_functions otherwise); with one it is pure distillation, in the
    trainer's Task, its val sets and a Ray worker's (pickled) copy."""
    import pickle

    from jgrpo.tasks import make_task

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+2="}\n{"prompt": "3-1="}\n')
    data = ["data.task=prompts", f"data.train_path={prompts}"]
    with pytest.raises(ConfigError, match=r"^data.reward_functions: task 'prompts' has no built"):
        make_task(load_config(TINY, data).data, 0)
    cfg = load_config(TINY, [*data, "distillation.teacher=smollm2"])
    assert distillation.is_pure(cfg) and cfg.data.task_reward_weight == 1.0  # no verifier
    task = make_task(cfg.data, 0, distilled=True)
    assert task.distilled and task.reward_names == () and pickle.loads(pickle.dumps(task)).distilled
    assert sorted(e["row"]["prompt"] for e in task.train.next_prompts(2)) == ["1+2=", "3-1="]
    np.testing.assert_array_equal(distillation.loss_rows(cfg, np.zeros(2, bool)), [1.0, 1.0])
