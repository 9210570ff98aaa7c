"""Context parallelism (mesh.context): a row's tokens split over devices give the unsplit step.

The reference is the tiny model on one device with materialised attention; the split runs use
blockwise attention with several blocks per chunk (so the diagonal skipping of off-diagonal
chunks is exercised) and several logprob chunks per device, on 8 fake devices. make test: the
logprobs and gradients of split rows (one layer, 16 tokens). Heavy: the whole step (metrics
and gradients to 1e-5, nonzero) on meshes mixing context 2/4 with data, fsdp and tensor,
padded and packed rows, the reference and prev forwards, LoRA; 512-token rows on context 8;
a 2-process pod."""

import dataclasses
import re

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


def logprobs_and_grads(fields, ids, mask, mesh_cfg=None):
    """(token_logprobs, gradient of their `scored` mean, as the loss's token mean) of the
    tiny model with `fields`, the rows whole (mesh_cfg None: one device) or split over
    mesh_cfg's context axis."""
    model = Transformer(dataclasses.replace(MODEL, **fields), rngs=nnx.Rngs(1), init_scale=0.2)
    graphdef, state = nnx.split(model)
    if mesh_cfg is not None:
        n = mesh_cfg.data * mesh_cfg.fsdp * mesh_cfg.context * mesh_cfg.tensor
        mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:n])
        cp = sharding.context_parallel(mesh, sharding.make_rules(mesh_cfg), 4, 2)
        graphdef = step_setup.constrained_graphdef(model, cp.activations, None, None, cp)

    def total(state):
        lp = nnx.merge(graphdef, state).token_logprobs(ids, mask, 0.9, first_scored=3)
        return jnp.sum(jnp.where(scored(mask), lp, 0.0)) / scored(mask).sum(), lp

    (_, lp), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(state)
    return np.asarray(lp), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


def padded_rows(t, seed=0):
    rng = np.random.RandomState(seed)
    ids = jnp.asarray(rng.randint(0, MODEL.vocab_size, (4, t)), jnp.int32)
    mask = np.ones((4, t), np.float32)
    mask[0, : t // 5], mask[1, t - t // 7 :], mask[3, : t // 3] = 0, 0, 0  # padded either end
    return ids, jnp.asarray(mask)


def scored(mask):
    """Columns whose token and the token before it are real: a padding slot's hidden state
    depends on the attention path (it sees no key), so a token scored from one is not
    compared (the step never scores one: left padding is in the prompt)."""
    mask = np.asarray(mask, bool)
    return mask & np.pad(mask[:, :-1], ((0, 0), (1, 0)))


def test_split_rows_give_the_unsplit_logprobs_and_gradients():
    """make test's proof: 1 layer, 16-token rows on data 2 x fsdp 2 x context 2 (4-token
    chunks of two 2-token blocks) = the unsplit materialised forward, value and gradient."""
    ids, mask = padded_rows(16)
    split = dict(num_layers=1, attention_block_size=2, logprob_chunk_size=4)
    lp0, g0 = logprobs_and_grads(dict(num_layers=1), ids, mask)
    mesh_cfg = MeshConfig(data=2, fsdp=2, context=2)
    lp1, g1 = logprobs_and_grads(split, ids, mask, mesh_cfg)
    np.testing.assert_allclose(lp1[scored(mask)], lp0[scored(mask)], atol=1e-5)
    assert max(np.abs(g).max() for g in jax.tree.leaves(g0)) > 1e-3
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g1, g0)


@pytest.mark.heavy
def test_context_split_step_equals_the_one_device_step():
    """Packed rows on data 2 x fsdp 2 x context 2 = the 1-device step; the context axis's
    shard_map is in the step's program only when mesh.context > 1."""
    assert_same(step_math(True, (2, 2, 2, 1)), step_math(True))
    for shape, present in (((2, 2, 2, 1), True), ((2, 4, 1, 1), False)):
        built = build(True, shape)
        jaxpr = str(jax.make_jaxpr(built.step_fn)(*built.abstract_args()[:4]))
        assert ("shard_map" in jaxpr) == present and ("all_gather" in jaxpr) == present


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
    """Four 512-token rows on context 8 (16-token blocks, 32-token logprob chunks): logprobs and
    gradients equal the unsplit materialised forward's; and one whole train step (jitted as a
    run runs it, state donated) on context 2 gives the 1-device step's loss and gradient norm."""
    ids, mask = padded_rows(512)
    lp0, g0 = logprobs_and_grads({}, ids, mask)
    split = dict(attention_block_size=16, logprob_chunk_size=32)
    lp1, g1 = logprobs_and_grads(split, ids, mask, MeshConfig(data=1, context=8))
    np.testing.assert_allclose(lp1[scored(mask)], lp0[scored(mask)], atol=1e-5)
    assert np.all(lp1[:, :3] == 0)
    assert max(np.abs(g).max() for g in jax.tree.leaves(g0)) > 1e-3
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g1, g0)

    whole, parts = build(True), build(True, (1, 1, 2, 1))
    host = TrainBatch(**host_batch(0))
    ref = jax.tree.map(lambda x: x * 0.9, whole.state.params)
    new_whole, metrics_whole = whole.step_fn(
        whole.state, whole.device_batch(host), whole.hparams, ref
    )
    ref = jax.tree.map(lambda x: x * 0.9, parts.state.params)
    new_parts, metrics = parts.step_fn(parts.state, parts.device_batch(host), parts.hparams, ref)
    for key in ("loss/total", "loss/pg", "train/grad_norm"):
        want = float(metrics_whole[key])
        assert float(metrics[key]) == pytest.approx(want, rel=1e-5, abs=1e-5), key
    assert float(metrics_whole["train/grad_norm"]) > 1e-3
    # the new parameters are not compared, nor the second minibatch's gradients to 1e-5
    # absolute: Adam's first update divides each gradient by its own size, so a gradient of
    # 1e-9 that differs by rounding moves its weight by up to lr, and the next gradients with it


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


def row_gathers(hlo: str, t: int) -> list[tuple[int, ...]]:
    """The result shapes of the all-gathers in compiled `hlo` that hold whole t-token rows
    (axis 1 = t): the attention's keys, values, valid keys and segment ids [b, t(, k, h)], and
    a [b, t, d] activation if a layer gathers one."""
    shapes = re.findall(r"= \w+\[([\d,]+)\]\{[\d,]*\} all-gather(?:-start)?\(", hlo)
    shapes = [tuple(int(n) for n in s.split(",")) for s in shapes]
    return [s for s in shapes if len(s) > 1 and s[1] == t]


@pytest.mark.heavy
def test_layers_gather_no_whole_row_activation():
    """On data 2 x fsdp 2 x context 2 the compiled step gathers whole rows only for the
    attention's keys, values and masks (rank 4 and 2): no layer gathers a [b, t, d] activation
    (a flattening of t split over context did, `transformer._project`)."""
    built = build(False, (2, 2, 2, 1))
    hlo = built.step_fn.lower(*built.abstract_args()).compile().as_text()
    ranks = {len(s) for s in row_gathers(hlo, host_batch(0)["input_ids"].shape[1])}
    assert ranks == {2, 4}
