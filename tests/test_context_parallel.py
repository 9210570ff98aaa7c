"""Context parallelism (mesh.context): a row's tokens split over devices give the unsplit step.

The reference is the 1-device step of the tiny model with materialised attention; the split
steps run blockwise attention in 3-token blocks (several blocks per chunk, so the diagonal
skipping of off-diagonal chunks is exercised) and 3-token logprob chunks, on 8 fake devices.
Same gradients and metrics to 1e-5 (nonzero gradients), padded and packed rows, with the
reference and prev forwards, LoRA, and meshes mixing context with data, fsdp and tensor."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL_FIELDS
from flax import nnx
from test_packing import BASE, batch_math, host_batch, randomize_adapters

from jgrpo import sharding, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import ConfigError, MeshConfig, load_config
from jgrpo.models import Transformer, TransformerConfig
from jgrpo.models.adapters import attach_lora
from jgrpo.models.context import unzigzag, zigzag
from jgrpo.models.lora import MODULES, LoRASpec

MODEL = TransformerConfig(**TINY_MODEL_FIELDS)  # materialised attention: the reference
SPLIT = ["model.attention_block_size=3", "model.logprob_chunk_size=3"]
KL = ["loss.reference_policy_kl_penalty=0.1", "grpo.num_minibatches=2"]


def build(packed, mesh_shape=(1, 1, 1, 1), lora=False, overrides=()):
    data, fsdp, context, tensor = mesh_shape
    adapters = ["model.lora.rank=4", "model.lora.alpha=8.0"] if lora else []
    split = SPLIT if context > 1 else []
    cfg = load_config(
        None, [*BASE, *KL, *split, *adapters, *overrides, f"grpo.sequence_packing={packed}"]
    )
    mesh_cfg = MeshConfig(data=data, fsdp=fsdp, context=context, tensor=tensor)
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[: data * fsdp * context * tensor])
    fields = dict(attention_block_size=3, logprob_chunk_size=3) if context > 1 else {}
    model = Transformer(dataclasses.replace(MODEL, **fields), rngs=nnx.Rngs(0), init_scale=0.2)
    if lora:
        model = attach_lora(
            model, LoRASpec(rank=4, alpha=8.0, target_modules=tuple(MODULES)), jax.random.key(0)
        )
        randomize_adapters(model)
    return step_setup.build_step(cfg.replace(mesh=mesh_cfg), model, mesh=mesh)


def step_math(packed, mesh_shape=(1, 1, 1, 1), lora=False):
    built = build(packed, mesh_shape, lora)
    ref = None if lora else jax.tree.map(lambda x: x * 0.9, built.state.params)
    return batch_math(built, TrainBatch(**host_batch(0)), ref)


def assert_same(split, whole):
    (g1, m1), (g0, m0) = split, whole
    assert set(m1) == set(m0)
    for key in sorted(m0):
        np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-5, err_msg=key)
    assert max(np.abs(g).max() for g in jax.tree.leaves(g0)) > 1e-3  # a real gradient
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g1, g0)


def test_context_split_step_equals_the_one_device_step():
    """make test's proof: packed rows on data 2 x fsdp 2 x context 2 = the 1-device step."""
    assert_same(step_math(True, (2, 2, 2, 1)), step_math(True))


MESHES = [(1, 1, 2, 1), (1, 1, 4, 1), (2, 1, 4, 1), (1, 2, 4, 1), (1, 2, 2, 2)]


@pytest.mark.heavy
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_context_meshes_agree(shape, packed):
    assert_same(step_math(packed, shape), step_math(packed))


@pytest.mark.heavy
def test_context_with_lora():
    assert_same(step_math(True, (1, 2, 2, 1), lora=True), step_math(True, lora=True))


@pytest.mark.heavy
def test_long_row_logprobs_equal_the_unsplit_row():
    """Two 512-token rows (padded at either end) on context 8, 16-token blocks: their
    logprobs equal the unsplit materialised forward's; and the parameters after one whole
    train step (jitted as a run runs it) on context 2 equal the 1-device step's."""
    t = 512
    model = Transformer(MODEL, rngs=nnx.Rngs(1), init_scale=0.2)
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(0, MODEL.vocab_size, (2, t)), jnp.int32)
    mask = np.ones((2, t), np.float32)
    mask[0, :7], mask[1, 480:] = 0, 0
    want = jax.jit(lambda m: m.token_logprobs(ids, mask, 0.9, first_scored=5))(model)
    mesh_cfg = MeshConfig(data=1, context=8)
    mesh = sharding.make_mesh(mesh_cfg, jax.devices())
    long = dataclasses.replace(MODEL, attention_block_size=16, logprob_chunk_size=32)
    split = Transformer(long, rngs=nnx.Rngs(1), init_scale=0.2)
    cp = sharding.context_parallel(mesh, sharding.make_rules(mesh_cfg), 4, 2)
    graphdef = step_setup.constrained_graphdef(split, cp.activations, None, None, cp)
    state = nnx.state(split)
    got = jax.jit(lambda s: nnx.merge(graphdef, s).token_logprobs(ids, mask, 0.9, first_scored=5))(
        state
    )
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)
    assert np.all(np.asarray(got)[:, :5] == 0)

    whole, parts = build(True), build(True, (1, 1, 2, 1))
    host = TrainBatch(**host_batch(0))
    ref = jax.tree.map(lambda x: x * 0.9, whole.state.params)
    new_whole, metrics_whole = whole.step_fn(
        whole.state, whole.device_batch(host), whole.hparams, ref
    )
    ref = jax.tree.map(lambda x: x * 0.9, parts.state.params)
    new_parts, metrics = parts.step_fn(parts.state, parts.device_batch(host), parts.hparams, ref)
    assert float(metrics["loss/total"]) == pytest.approx(
        float(metrics_whole["loss/total"]), abs=1e-5
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5),
        new_parts.params,
        new_whole.params,
    )


def test_zigzag_places_chunks_and_bad_rows_are_refused():
    """Device i of c holds chunks i and 2c-1-i; unzigzag inverts; a row that does not split
    stops the config with a one-line ConfigError naming mesh.context."""
    row = jnp.arange(16)[None]
    np.testing.assert_array_equal(
        np.asarray(zigzag(row, 2))[0], [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    )
    np.testing.assert_array_equal(np.asarray(unzigzag(zigzag(row, 4), 4)), np.asarray(row))
    cfg = load_config(None, [*BASE, "mesh.context=5"])
    with pytest.raises(ConfigError, match=r"mesh.context=5: rows of 24 tokens") as err:
        step_setup.check_context(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.heavy
def test_two_process_pod_with_context_matches_one_process(tmp_path):
    """`jgrpo train` (configs/tiny.yaml, 24-token rows) on data 4 x context 2: 2 processes x 4
    devices (each host's rows split over its own 2-device context groups) = 1 process x 8."""
    from test_distributed import COMPARED, OVERRIDES, REWARD, _launch, _log, _wait

    from jgrpo.metrics import read_metrics

    (tmp_path / "pod_rewards.py").write_text(REWARD)
    overrides = [o for o in OVERRIDES if not o.startswith("mesh.")]
    overrides += ["mesh.data=4", "mesh.fsdp=1", "mesh.context=2", "checkpoint.save_period=0"]
    one, pod = str(tmp_path / "one"), str(tmp_path / "pod")
    runs = {
        one: _launch(tmp_path, one, 1, overrides=overrides),
        pod: _launch(tmp_path, pod, 2, overrides=overrides),
    }
    for run_dir, procs in runs.items():
        assert set(_wait(procs)) == {0}, _log(tmp_path, run_dir, 0)[-3000:]
    want, got = read_metrics(one), read_metrics(pod)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 0.1 for r in want)
    for a, b in zip(got, want):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key)
