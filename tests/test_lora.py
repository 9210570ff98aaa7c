"""LoRA: the adapted forward vs PEFT on transformers' PyTorch model (float32, 1e-4), the merged
export vs transformers, adapters off = the base exactly, sampler (merged) = training forward."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from conftest import TINY_MODEL_FIELDS, assert_hf_logits, make_random_hf_model
from flax import nnx

from jgrpo.models import from_pretrained, save_pretrained
from jgrpo.models.adapters import (
    attach_lora,
    load_peft,
    merge_lora,
    save_peft,
    split_lora,
)
from jgrpo.models.lora import MODULES, LoRASpec

TOL = 1e-4
BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=128,
    max_position_embeddings=256,
    attn_implementation="eager",
)
FAMILIES = {
    "llama": transformers.LlamaConfig(**BASE, tie_word_embeddings=False),
    "qwen2": transformers.Qwen2Config(**BASE, tie_word_embeddings=True),
    # the biases of every targeted projection (q/k/v/o, gate/up/down) under the adapters
    "llama_biases": transformers.LlamaConfig(**BASE, attention_bias=True, mlp_bias=True),
}
ALL = tuple(MODULES)


def randomize_adapters(model, seed=0, std=0.1):
    """Nonzero B (fresh adapters have B = 0, which would make every comparison trivial)."""
    rng = np.random.RandomState(seed)
    for p in model.lora.values():
        p[...] = jnp.asarray(rng.normal(0, std, p[...].shape), jnp.float32)


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf_base(request, tmp_path_factory):
    hf_model = make_random_hf_model(FAMILIES[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder)
    return folder


def lora_model(folder, targets=ALL, rank=4, alpha=8.0, seed=0):
    spec = LoRASpec(rank=rank, alpha=alpha, target_modules=targets)
    model = attach_lora(from_pretrained(folder), spec, jax.random.key(seed))
    randomize_adapters(model, seed)
    return model


def torch_logits(model, ids, mask=None):
    kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask)}
    with torch.no_grad():
        return model(torch.tensor(ids), **kwargs).logits.numpy()


IDS = np.random.RandomState(1).randint(0, 128, (3, 12))


@jax.jit
def forward(model, ids, mask=None):
    return model(ids, attention_mask_bt=mask)


def test_fresh_adapters_leave_the_model_unchanged(hf_base):
    base = from_pretrained(hf_base)
    model = attach_lora(base, LoRASpec(rank=4, alpha=8.0, target_modules=ALL), jax.random.key(0))
    a = model.lora["q_lora_a"][...]
    assert a.shape == (2, 64, 4) and float(jnp.abs(a).max()) > 0  # A random, B zero
    assert model.lora["o_lora_a"][...].shape == (2, 4, 16, 4)
    assert model.lora["down_lora_b"][...].shape == (2, 4, 64)
    np.testing.assert_array_equal(forward(model, IDS), forward(base, IDS))


def test_peft_export_loads_in_peft_with_equal_logits(hf_base, tmp_path):
    model = lora_model(hf_base)
    ours = np.asarray(forward(model, IDS))
    folder = save_peft(model, tmp_path / "adapter", base_model_name_or_path=str(hf_base))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_base, attn_implementation="eager")
    base_logits = torch_logits(hf, IDS)
    peft_model = peft.PeftModel.from_pretrained(hf, folder).eval()
    ref = torch_logits(peft_model, IDS)
    assert np.abs(ref - base_logits).max() > 0.1, "the adapters must change the logits"
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)
    # and back: the PEFT folder re-read gives the same adapters, bit for bit
    again = load_peft(from_pretrained(hf_base), folder)
    for name, p in model.lora.items():
        np.testing.assert_array_equal(again.lora[name][...], p[...])


def test_merged_export_matches_transformers(hf_base, tmp_path):
    model = lora_model(hf_base, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
    mask = np.ones(IDS.shape, np.int64)
    mask[0, :3] = 0
    ours = np.asarray(forward(model, IDS, mask))
    out = save_pretrained(merge_lora(model), tmp_path / "merged", source=hf_base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    ref = torch_logits(hf, IDS, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=TOL, rtol=0)


def test_adapters_off_is_the_base_exactly(hf_base):
    base = from_pretrained(hf_base)
    model = lora_model(hf_base)
    fwd = jax.jit(lambda m, ids: m(ids, use_lora=False))
    np.testing.assert_array_equal(fwd(model, IDS), forward(base, IDS))
    assert np.abs(np.asarray(forward(model, IDS) - forward(base, IDS))).max() > 0.1


def test_split_trees_hold_adapters_and_base(hf_base):
    model = lora_model(hf_base, targets=("q_proj", "up_proj"))
    graphdef, trainable, frozen = split_lora(model)
    assert set(trainable) == {"lora"} and set(trainable["lora"]) == {
        "q_lora_a",
        "q_lora_b",
        "up_lora_a",
        "up_lora_b",
    }
    assert "lora" not in frozen and "q" in frozen["layers"]
    again = nnx.merge(graphdef, frozen, trainable)
    np.testing.assert_array_equal(forward(again, IDS), forward(model, IDS))


def test_sampler_weights_are_merged(hf_base):
    """Prefill + decode on the merged inference weights = the unmerged training forward."""
    model = lora_model(hf_base)
    total, prompt_len = 10, 6
    ids = jnp.asarray(IDS[:2, :total])
    full = np.asarray(forward(model, ids))
    mask = jnp.ones((2, total), bool)
    positions = jnp.broadcast_to(jnp.arange(total), (2, total))
    prefill = jax.jit(lambda m, *a: m.prefill(*a, total))
    logits, cache = prefill(
        model, ids[:, :prompt_len], positions[:, :prompt_len], mask[:, :prompt_len]
    )
    np.testing.assert_allclose(logits, full[:, prompt_len - 1], atol=1e-5, rtol=0)
    layers = jax.jit(lambda m: m.layer_weights())(model)
    assert not any("lora" in k for k in layers[0])
    step = jax.jit(lambda m, *a: m.decode_step(*a))
    for t in range(prompt_len, total):
        logits, cache = step(model, layers, ids[:, t], positions[:, t], mask, cache, t)
        np.testing.assert_allclose(logits, full[:, t], atol=1e-5, rtol=0)


@pytest.mark.heavy
def test_ray_ships_the_base_once_and_adapters_each_step(tmp_path, ray_cluster):
    """The Ray backend puts base + adapters on the first publish, adapters alone after it, and
    samples what the local backend samples from base | adapters (both versions)."""
    from jgrpo.config import load_config
    from jgrpo.models import load_policy
    from jgrpo.models.tiny import build_tiny_model
    from jgrpo.rollout import LocalRollout, build_engine, make_backend
    from jgrpo.tasks import make_task

    folder = build_tiny_model(tmp_path / "m")
    cfg = load_config(
        None,
        [
            f"model.path={folder}",
            "model.lora.rank=4",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "rollout.max_new_tokens=8",
            "rollout.prompt_bucket=16",
            "rollout.backend=ray",
            "rollout.num_workers=1",
        ],
    )
    engine, graphdef = build_engine(cfg, folder)
    versions = []
    for v in range(2):
        model = attach_lora(
            load_policy(cfg.model, folder, adapters=False),
            LoRASpec(rank=4, alpha=16.0, target_modules=ALL),
            jax.random.key(0),
        )
        randomize_adapters(model, seed=v, std=0.3)
        versions.append(split_lora(model))
    assert nnx.graphdef(nnx.merge(*versions[0])) == graphdef  # the workers' graph is the trainer's
    _, _, frozen = versions[0]
    adapter_mb = sum(x.nbytes for x in jax.tree.leaves(versions[0][1])) / 2**20
    base_mb = sum(x.nbytes for x in jax.tree.leaves(frozen)) / 2**20
    local = LocalRollout(engine, graphdef, cfg.grpo.seed, 4, frozen)
    backend = make_backend(cfg, engine, graphdef, folder, frozen)
    try:
        stream = make_task(cfg.data, cfg.grpo.seed).train
        for step, (_, trainable, _) in enumerate(versions):
            metrics = backend.publish(trainable, step)
            want_mb = adapter_mb + (base_mb if step == 0 else 0.0)
            assert metrics["rollout/weight_mb"] == pytest.approx(want_mb, rel=1e-9)
            local.publish(trainable, step)
            examples = stream.next_prompts(2)
            backend.request(step, examples)
            local.request(step, examples)
            got, want = backend.collect(step), local.collect(step)
            for key in ("input_ids", "token_mask", "rewards"):
                np.testing.assert_array_equal(got.batch[key], want.batch[key], err_msg=key)
        assert base_mb > 10 * adapter_mb
    finally:
        backend.close()


# ----------------------------------------------------------------------------- training

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
QUIET = ["grpo.val_at_start=false", "grpo.val_at_end=false", "logging.tensorboard=false"]
LORA8 = ["model.lora.rank=8", "loss.reference_policy_kl_penalty=0.05"]
UNPACKED = "grpo.sequence_packing=false"
"""The padded-row step, for tests that hand the step a TrainBatch (packing: test_packing.py)."""


def run_steps(t, num_steps):
    """The loop of train.run on a set-up Trainer (no logging, no checkpoints)."""
    from jgrpo import train

    data_states = {}
    t.backend.publish(t.state.params, 0)
    t.backend.request(0, t.task.train.next_prompts(t.cfg.grpo.num_prompts_per_step))
    return [train.train_one_step(t, s, data_states) for s in range(num_steps)]


@pytest.mark.slow
def test_tiny_lora_trains_adapters_alone_and_keeps_the_base(tmp_path):
    from jgrpo import train
    from jgrpo.config import load_config
    from jgrpo.models.sources import resolve_model_path

    cfg = load_config(TINY, [*QUIET, *LORA8, "grpo.max_num_steps=5"])
    t = train.setup(cfg, tmp_path / "run", resume=False)
    assert set(t.state.params) == {"lora"}
    base = from_pretrained(resolve_model_path(cfg.model.path))
    base_params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(base)))
    adapters_before = jax.tree.map(np.asarray, t.state.params)
    rows = run_steps(t, 5)
    assert all(np.isfinite(r["loss/total"]) and r["train/skipped_updates"] == 0 for r in rows)
    # the base: bit-identical before and after (and the very arrays of model.path)
    for a, b in zip(jax.tree.leaves(base_params), jax.tree.leaves(t.setup.frozen), strict=True):
        np.testing.assert_array_equal(np.asarray(b), a)
    # the adapters trained: every B moved off zero
    for name, b_before in adapters_before["lora"].items():
        if name.endswith("_lora_b"):
            assert not np.any(b_before)
            assert np.abs(np.asarray(t.state.params["lora"][name])).max() > 0, name
    # trainable parameters and Adam moments: the adapters alone
    mc = base.cfg
    d, f, h = mc.hidden_size, mc.intermediate_size, mc.head_dim
    qo, kv = mc.num_heads * h, mc.num_kv_heads * h
    per_layer = 8 * ((d + qo) * 2 + (d + kv) * 2 + (d + f) * 3)
    n_adapter = mc.num_layers * per_layer
    assert sum(x.size for x in jax.tree.leaves(t.state.params)) == n_adapter
    moments = [x for x in jax.tree.leaves(t.state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * n_adapter
    assert all(x.dtype == jnp.float32 for x in moments)


@pytest.mark.heavy  # make test: bf16 training in test_precision, LoRA in float32
def test_lora_over_a_bfloat16_base_trains(tmp_path):
    """Pure-bf16 base (model.dtype=bfloat16) with float32 adapters: the base stays bf16 and
    unchanged, the adapters and their Adam moments are float32, and the steps are finite."""
    from jgrpo import train
    from jgrpo.config import load_config

    cfg = load_config(TINY, [*QUIET, *LORA8, "model.dtype=bfloat16", "grpo.max_num_steps=2"])
    t = train.setup(cfg, tmp_path / "run", resume=False)
    try:
        assert {str(x.dtype) for x in jax.tree.leaves(t.setup.frozen)} == {"bfloat16"}
        assert {str(x.dtype) for x in jax.tree.leaves(t.state.params)} == {"float32"}
        base_before = jax.tree.map(np.asarray, t.setup.frozen)
        rows = run_steps(t, 2)
        for r in rows:
            assert np.isfinite(r["loss/total"]) and r["train/skipped_updates"] == 0
            assert np.isfinite(r["train/grad_norm"])
            assert 1.0 <= r["logprob/token_mult_prob_error"] < 1.001  # bf16 sampler vs trainer
        for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(t.setup.frozen), strict=True):
            np.testing.assert_array_equal(np.asarray(b), a)
        moments = [x for x in jax.tree.leaves(t.state.opt_state) if x.ndim > 0]
        assert moments and all(x.dtype == jnp.float32 for x in moments)
    finally:
        t.backend.close()
        t.checkpointer.close()


@pytest.mark.heavy  # make test: test_reference_logprobs_are_the_base_logprobs_exactly
def test_lora_step_holds_no_reference_copy():
    """inspect-step: with LoRA, beta != 0 adds no argument bytes to the compiled step (the
    reference is the base itself); without LoRA it adds the full reference copy."""
    from jgrpo.config import load_config
    from jgrpo.inspect_step import inspect_step

    def report(*overrides):
        return inspect_step(load_config(TINY, ["mesh.data=1", "mesh.fsdp=8", *overrides]))

    lora_kl, lora = report(*LORA8), report("model.lora.rank=8")
    full_kl, full = report("loss.reference_policy_kl_penalty=0.05"), report()
    assert lora_kl["ref_param_bytes_per_device"] == 0 and full["ref_param_bytes_per_device"] == 0
    assert full_kl["ref_param_bytes_per_device"] == full_kl["trainable_param_bytes_per_device"]
    # (jit drops unused arguments: beta == 0 leaves the KL's scalar hyperparameters unread)
    scalars = 64
    extra = lora_kl["argument_bytes_per_device"] - lora["argument_bytes_per_device"]
    assert 0 <= extra < scalars
    extra = full_kl["argument_bytes_per_device"] - full["argument_bytes_per_device"]
    assert 0 <= extra - full_kl["ref_param_bytes_per_device"] < scalars
    assert full_kl["ref_param_bytes_per_device"] > 100 * scalars
    assert "ref" in lora_kl["forwards"] and "ref" not in lora["forwards"]
    # the analytic count models LoRA too (adapter matmuls, no frozen-weight gradients, the
    # reference forward without adapters): it matches the count read from the compiled HLO
    for r in (lora_kl, lora, full_kl, full):
        assert r["flops"] == pytest.approx(r["flops_analytic"], rel=0.01)
    assert lora["flops"] < full["flops"]  # no weight gradients of the base
    # sizes: every parameter is held, only the adapters train and have optimizer state
    assert lora["num_params"] == full["num_params"] + lora["num_trainable_params"]
    assert 0 < lora["num_trainable_params"] < full["num_params"] / 4
    adapter_bytes = lora["trainable_param_bytes_per_device"]
    assert lora["param_bytes_per_device"] == full["param_bytes_per_device"] + adapter_bytes
    assert 2 * adapter_bytes <= lora["opt_state_bytes_per_device"] < 2 * adapter_bytes + 64


def test_reference_logprobs_are_the_base_logprobs_exactly(rollout_batch):
    """The step's reference forward (the LoRA model, adapters skipped) = the base model's."""
    from conftest import ROLLOUT_BATCH_BUCKET

    from jgrpo import sharding, step, step_setup
    from jgrpo.batch import TrainBatch
    from jgrpo.config import load_config
    from jgrpo.models import load_policy

    cfg = load_config(TINY, [*LORA8, "mesh.data=1", ROLLOUT_BATCH_BUCKET, UNPACKED])
    base = load_policy(cfg.model, adapters=False)
    model = attach_lora(base, LoRASpec(rank=8, alpha=16.0, target_modules=ALL), jax.random.key(0))
    randomize_adapters(model, std=0.3)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    built = step_setup.build_step(cfg, model, mesh=mesh)
    batch = TrainBatch(**rollout_batch)
    batch = batch.replace(input_ids=batch.input_ids % base.cfg.vocab_size)
    hp = built.hparams

    @jax.jit
    def prepared(params, frozen, batch):
        state = built.state._replace(params=step.with_frozen(params, frozen))
        return step.prepare_batch(
            state, batch, hp, None, flags=built.flags, graphdef=built.graphdef
        )

    data, _ = prepared(built.state.params, built.frozen, batch)
    base_graphdef, base_state = nnx.split(base)
    first = built.flags.first_scored  # the step computes no logits for the prompt columns
    want = jax.jit(step.sequence_logprobs, static_argnums=(5, 6))(
        base_graphdef,
        nnx.to_pure_dict(base_state),
        batch.input_ids,
        batch.attention_mask,
        hp.temperature,
        True,
        first,
    )
    assert first == 5 and not np.asarray(want[:, :first]).any()
    np.testing.assert_array_equal(data.reference_logprobs, want)
    # and the policy (prev) forward does use the adapters
    assert np.abs(np.asarray(data.prev_logprobs - want)).max() > 1e-2


LORA_RUN = [*QUIET, *LORA8, "grpo.max_num_steps=3", "checkpoint.save_period=10"]
"""Three LoRA steps; the one checkpoint is the last step's."""


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """The run folder of LORA_RUN (shared: the export test reads it, the resume test compares
    with it)."""
    from jgrpo import train
    from jgrpo.config import load_config

    run_dir = tmp_path_factory.mktemp("lora") / "run"
    train.run(load_config(TINY, LORA_RUN), run_dir)
    return run_dir


@pytest.mark.slow
def test_run_export_merged_and_peft_match_the_trained_policy(lora_run, tmp_path):
    """A LoRA run's checkpoint holds adapters + optimizer state only; `jgrpo export` merges
    them into the base (transformers loads it with our logits), `--adapter` writes PEFT."""
    from jgrpo.cli import main
    from jgrpo.config import load_config
    from jgrpo.export import load_checkpoint_model
    from jgrpo.models.sources import resolve_model_path

    cfg, run_dir = load_config(TINY, LORA_RUN), lora_run
    ckpt = run_dir / "checkpoints" / "3"
    structure = (ckpt / "structure" / "metadata").read_text()
    assert "lora" in structure and "'embed'" not in structure  # no base weights in it
    model, folder, _ = load_checkpoint_model(run_dir)
    assert model.cfg.lora is not None
    ids = IDS % model.cfg.vocab_size
    ours = np.asarray(forward(model, ids))
    assert main(["export", str(run_dir), str(tmp_path / "merged")]) == 0
    assert main(["export", str(run_dir), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert_hf_logits(tmp_path / "merged", model, ids, atol=TOL)
    base_hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.model.path))
    peft_model = peft.PeftModel.from_pretrained(base_hf, tmp_path / "adapter").eval()
    np.testing.assert_allclose(torch_logits(peft_model, ids), ours, atol=TOL, rtol=0)
    assert folder == resolve_model_path(cfg.model.path)


@pytest.mark.slow
def test_lora_resume_repeats_the_uninterrupted_run(lora_run, tmp_path, monkeypatch):
    """Checkpoint (adapters + optimizer state) at step 2, stop, resume (base re-read from
    model.path): the metrics equal those of the uninterrupted run."""
    from jgrpo import train
    from jgrpo.config import load_config
    from jgrpo.metrics import read_metrics
    from jgrpo.rollout import LocalRollout, RolloutFailure

    overrides, full_dir, broken_dir = LORA_RUN, lora_run, tmp_path / "broken"
    collect = LocalRollout.collect

    def failing_collect(self, step):
        if step == 2:
            raise RolloutFailure("stop here (test)")
        return collect(self, step)

    monkeypatch.setattr(LocalRollout, "collect", failing_collect)
    with pytest.raises(train.RunStopped):
        train.run(load_config(TINY, overrides), broken_dir)
    monkeypatch.setattr(LocalRollout, "collect", collect)
    train.run(load_config(TINY, overrides), broken_dir, resume=True)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]
    assert strip(read_metrics(broken_dir)) == strip(read_metrics(full_dir))


# ----------------------------------------------------------------------------- step invariances

STEP_MODEL = TINY_MODEL_FIELDS


def lora_step_on(mesh_shape, overrides):
    """(loss, first-minibatch adapter gradients, adapter change, q_lora_b shard shape) of one
    LoRA step on a mesh."""
    import dataclasses

    from conftest import ROLLOUT_BATCH_BUCKET, make_rollout_batch

    from jgrpo import sharding, step, step_setup
    from jgrpo.batch import TrainBatch
    from jgrpo.config import load_config
    from jgrpo.models import Transformer, TransformerConfig

    base = [
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "optim.learning_rate=1e-2",
        "model.lora.rank=8",
        "loss.reference_policy_kl_penalty=0.1",
        ROLLOUT_BATCH_BUCKET,
        UNPACKED,
    ]
    cfg = load_config(None, base + list(overrides))
    data, fsdp, tensor = mesh_shape
    mesh_cfg = dataclasses.replace(cfg.mesh, data=data, fsdp=fsdp, tensor=tensor)
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[: data * fsdp * tensor])
    model = Transformer(TransformerConfig(**STEP_MODEL), rngs=nnx.Rngs(0), init_scale=0.2)
    spec = LoRASpec(rank=8, alpha=16.0, target_modules=ALL)
    model = attach_lora(model, spec, jax.random.key(0))
    randomize_adapters(model, std=0.05)  # B != 0: the policy differs from the reference
    built = step_setup.build_step(cfg.replace(mesh=mesh_cfg), model, mesh=mesh)
    batch = TrainBatch(**make_rollout_batch(0)).shard(mesh)
    shard = built.state.params["lora"]["q_lora_b"].addressable_shards[0].data.shape
    flags, graphdef, hp = built.flags, built.graphdef, built.hparams

    @jax.jit
    def grads_of(params, frozen, batch):
        full = built.state._replace(params=step.with_frozen(params, frozen))
        data, _ = step.prepare_batch(full, batch, hp, None, flags=flags, graphdef=graphdef)
        first = jax.tree.map(lambda x: x[0], step.chunk_rows(data, flags.num_minibatches))
        return step.accumulate_gradients(
            params, first, hp, flags=flags, graphdef=graphdef, frozen=frozen
        )[0]

    grads = jax.tree.map(np.asarray, grads_of(built.state.params, built.frozen, batch))
    before = jax.tree.map(np.asarray, built.state.params)
    state, metrics = built.step_fn(built.state, batch, hp, None, built.frozen)
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(), state.params, before)
    return float(metrics["loss/total"]), grads, moved, shard


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["grpo.num_minibatches=2"], marks=pytest.mark.heavy),
        pytest.param(
            ["loss.aggregation=seq_mean", "loss.sequence_level_importance_ratios=true"],
            marks=pytest.mark.heavy,
        ),
        pytest.param(
            [
                "grpo.advantage.estimator=reinforce_plus_plus",
                "loss.use_kl_in_reward=true",
                "loss.use_importance_sampling_correction=true",
                "loss.truncated_importance_sampling_type=tis",
                "loss.truncated_importance_sampling_ratio=2.0",
            ],
            marks=pytest.mark.heavy,
        ),
    ],
)
# make test: test_step's 2x2x2 mesh test and the LoRA reference/training tests
def test_lora_step_is_mesh_and_microbatch_invariant(overrides):
    """Loss and adapter gradients of a step: 1 device, 1 microbatch = 8 devices (data 2 x
    fsdp 2 x tensor 2) with 2 microbatches; the adapters are sharded like the weights they
    adapt. (Gradients, not the updated adapters: Adam's first update is ~lr * sign(g), which
    turns float rounding of a near-zero gradient into an lr-sized difference.) make test runs
    the loss with the most parts (KL in the reward, importance sampling), make test-all all."""
    loss0, grads0, moved, shard0 = lora_step_on((1, 1, 1), overrides)
    loss, grads, _, shard = lora_step_on((2, 2, 2), [*overrides, "grpo.num_microbatches=2"])
    assert np.isfinite(loss0) and loss == pytest.approx(loss0, abs=1e-5)
    assert min(jax.tree.leaves(moved)) > 1e-3  # every adapter took a step (lr 1e-2)
    assert max(np.abs(g).max() for g in jax.tree.leaves(grads0)) > 1e-3
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), grads, grads0)
    assert shard0 == (2, 8, 4, 8) and shard == (2, 8, 2, 8)  # [l, r, heads / tensor, h]


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.lora.rank=-1", "model.lora.rank: must be >= 0"),
        ("model.lora.alpha=0", "model.lora.alpha: must be > 0"),
        ("model.lora.target_modules=[q_proj, qkv]", "model.lora.target_modules\\[1\\]: 'qkv'"),
        ("model.lora.target_modules=[q_proj, q_proj]", "names a module twice"),
    ],
)
def test_lora_config_errors_name_the_key(override, message):
    from jgrpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.lora.rank=8", override])
