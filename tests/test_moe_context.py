"""Context parallelism of MoE models (mesh.context > 1, models/context.py + moe_parallel.py):
rows split over context give the unsplit model's numbers, float32, 8 fake devices.

make test: one MoE layer, 16-token rows on fsdp 2 (experts split) x context 2, recorded ids
replayed: logprobs, chosen and mismatched experts per token, router losses and every gradient
equal the 1-device forward's. Heavy: the whole step (metrics and gradients to 1e-5) on meshes
mixing context 2/4 with data, fsdp (expert parallelism) and tensor, padded and packed rows;
router replay and record_routing on a sampler's rollout; the compiled step gathers no router
output; the routers' top-k is lax.top_k's."""

import dataclasses
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL_FIELDS
from flax import nnx
from test_context_parallel import KL, SPLIT, assert_same, padded_rows, row_gathers, scored
from test_packing import BASE, batch_math, host_batch
from test_router_replay import rollout, run_step

from jgrpo import sharding, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import MeshConfig, load_config
from jgrpo.models import from_pretrained
from jgrpo.models import moe as moe_lib
from jgrpo.models.adapters import join_lora
from jgrpo.models.moe_transformer import MoETransformer, MoETransformerConfig

SPEC = moe_lib.MoESpec(num_experts=8, top_k=2, expert_size=16, sparse_layers=(True, True))
MOE = {**TINY_MODEL_FIELDS, "family": "qwen3_moe", "num_layers": 2}


def tiny_moe(layers=2, seed=1, **fields) -> MoETransformer:
    spec = dataclasses.replace(SPEC, sparse_layers=(True,) * layers, aux_loss_coef=0.01)
    cfg = MoETransformerConfig(**{**MOE, "num_layers": layers, **fields}, moe=spec)
    return MoETransformer(cfg, rngs=nnx.Rngs(seed), init_scale=0.2)


def host_weight(path, x):
    """A random weight of x's shape drawn on the host (norm weights around 1)."""
    name = jax.tree_util.keystr(path)
    w = np.random.RandomState(zlib.crc32(name.encode())).normal(0.0, 0.2, x.shape)
    w = w + ("norm" in name)
    return jnp.asarray(w, x.dtype)


def routed_forward(fields, ids, mask, recorded, mesh_cfg=None):
    """(logprobs, chosen ids [l, b, t, k], mismatch [b, t], aux, z, gradients of the scored
    mean logprob + aux + z) of one replaying forward, rows whole (mesh_cfg None: one device)
    or split over mesh_cfg's context axis (experts over its fsdp axis)."""
    model = nnx.eval_shape(lambda: tiny_moe(1, **fields))
    graphdef = nnx.graphdef(model)
    state = jax.tree_util.tree_map_with_path(host_weight, nnx.state(model))  # nothing compiles
    if mesh_cfg is not None:
        n = mesh_cfg.data * mesh_cfg.fsdp * mesh_cfg.context * mesh_cfg.tensor
        mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:n])
        rules = sharding.make_rules(mesh_cfg)
        cp = sharding.context_parallel(mesh, rules, 4, 2)
        ep = sharding.expert_parallel(mesh, rules)
        graphdef = step_setup.constrained_graphdef(model, cp.activations, None, ep, cp)
        sampler = join_lora(graphdef, state)  # the trainer's model, as the sampler gets it
        assert sampler.context_parallel is None and sampler.expert_parallel is None

    def total(state):
        lp, out = nnx.merge(graphdef, state).token_logprobs_routed(
            ids, mask, 0.9, first_scored=3, expert_ids=recorded
        )
        aux, z = moe_lib.aux_losses(out.stats, SPEC.num_experts)
        loss = jnp.sum(jnp.where(scored(mask), lp, 0.0)) / scored(mask).sum() + aux + z
        return loss, (lp, out.expert_ids, out.mismatch, aux, z)

    (_, out), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(state)
    return jax.tree.map(np.asarray, (out, nnx.to_pure_dict(grads)))


def test_split_moe_rows_give_the_unsplit_forward_and_replay():
    """1 MoE layer, 16-token rows on fsdp 2 x context 2 (experts split over fsdp, 2-token
    blocks): replaying recorded ids (some not the router's choice, some not recorded) gives
    the 1-device logprobs, chosen ids, per-token mismatch, router losses and gradients."""
    ids, mask = padded_rows(16)
    rng = np.random.RandomState(0)  # recorded ids, most not the router's, some not recorded
    first = rng.randint(0, 8, (1, 4, 16, 1))
    recorded = np.concatenate([first, (first + rng.randint(1, 8, first.shape)) % 8], -1)
    recorded[:, :, np.arange(16) % 3 == 1] = -1
    recorded = jnp.asarray(recorded)
    (lp0, ids0, mis0, aux0, z0), g0 = routed_forward({}, ids, mask, recorded)
    split = dict(attention_block_size=2, logprob_chunk_size=4)
    mesh_cfg = MeshConfig(data=1, fsdp=2, context=2)
    (lp1, ids1, mis1, aux1, z1), g1 = routed_forward(split, ids, mask, recorded, mesh_cfg)
    np.testing.assert_allclose(lp1[scored(mask)], lp0[scored(mask)], atol=1e-5)
    real = np.asarray(mask, bool)  # a padding slot sees no key: its hidden state is the path's
    np.testing.assert_array_equal(ids1[:, real], ids0[:, real])
    np.testing.assert_array_equal(mis1[real], mis0[real])
    assert 0 < mis0[real].sum() < real.sum()
    np.testing.assert_allclose([aux1, z1], [aux0, z0], rtol=1e-5)
    assert np.abs(g0["moe"]["router"]).max() > 1e-3
    assert max(np.abs(g).max() for g in jax.tree.leaves(g0)) > 1e-3
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g1, g0)


# ----------------------------------------------------------------------------- the step

ROUTER = ["model.moe.router_aux_loss_coef=0.05", "model.moe.router_z_loss_coef=0.01"]


def moe_step_math(packed, mesh_shape=(1, 1, 1, 1)):
    """test_packing.step_math on the 2-layer tiny MoE: (first minibatch's gradients, metrics)."""
    built = moe_build(packed, mesh_shape)
    ref = jax.tree.map(lambda x: x * 0.9, built.state.params)
    return batch_math(built, TrainBatch(**host_batch(0)), ref)


def moe_build(packed, mesh_shape):
    data, fsdp, context, tensor = mesh_shape
    split = SPLIT if context > 1 else []
    overrides = [*BASE, *KL, *ROUTER, *split, f"grpo.sequence_packing={packed}"]
    cfg = load_config(None, overrides)
    mesh_cfg = MeshConfig(data=data, fsdp=fsdp, context=context, tensor=tensor)
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[: data * fsdp * context * tensor])
    fields = dict(attention_block_size=3, logprob_chunk_size=3) if context > 1 else {}
    return step_setup.build_step(cfg.replace(mesh=mesh_cfg), tiny_moe(seed=0, **fields), mesh=mesh)


MESHES = [(1, 1, 2, 1), (2, 2, 2, 1), (1, 2, 4, 1), (1, 2, 2, 2), (1, 4, 2, 1)]


@pytest.mark.heavy
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_moe_context_meshes_agree(shape, packed):
    """The MoE step with rows split over context (experts over fsdp where it is > 1, their
    width over tensor) = the 1-device step: every metric (the moe/ ones: router losses over
    all the batch's tokens) and every gradient, the router's nonzero."""
    grads, metrics = whole = moe_step_math(packed)
    assert metrics["moe/aux_loss"] > 0 and metrics["moe/z_loss"] > 0
    assert np.abs(grads["moe"]["router"]).max() > 1e-4
    assert_same(moe_step_math(packed, shape), whole)


@pytest.mark.heavy
def test_routing_gathers_no_tokens():
    """The compiled step on fsdp 2 x context 4 gathers no router output (XLA's partitioner
    gathered every device's router probabilities for a top_k, and the activations for a
    merged b x t reshape of the block): the routing runs on each device's own tokens."""
    cfg = load_config(None, [*BASE, *KL, *ROUTER, *SPLIT])
    mesh_cfg = MeshConfig(data=1, fsdp=2, context=4)
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:8])
    model = tiny_moe(seed=0, attention_block_size=3, logprob_chunk_size=3)
    built = step_setup.build_step(cfg.replace(mesh=mesh_cfg), model, mesh=mesh)
    text = built.step_fn.lower(*built.abstract_args()).compile().as_text()
    gathers = [line for line in text.splitlines() if re.search(r"= \S+ all-gather\(", line)]
    assert gathers and not [g for g in gathers if re.search(r"top_k|argmax|routing", g)]


@pytest.fixture(scope="module")
def sampler_moe(tmp_path_factory):
    from jgrpo.models.tiny import build_tiny_moe_model

    return from_pretrained(build_tiny_moe_model(tmp_path_factory.mktemp("moe") / "tiny"))


@pytest.mark.heavy
@pytest.mark.parametrize(
    "flag, packed",
    [("router_replay", False), ("record_routing", False), ("router_replay", True)],
    ids=["replay", "record", "replay-packed"],
)
def test_recorded_routing_with_context_equals_the_unsplit_step(sampler_moe, flag, packed):
    """A sampler's rollout with its recorded experts, a third of them replaced by others: the
    step on data 2 x fsdp 2 x context 2 gives the data-8 step's metrics (moe/routing_mismatch
    strictly between 0 and 1) and gradients, replaying the ids or only comparing them, on
    rows or packed rows."""
    _, batch = rollout(sampler_moe)

    def shift(ids):
        moved = (np.arange(ids.shape[1]) % 3 == 0)[None, :, None, None] & (ids >= 0)
        return np.where(moved, (ids + 1) % 8, ids).astype(np.int16)

    on = [f"model.moe.{flag}=true", f"grpo.sequence_packing={packed}"]
    on += ["model.attention_block_size=2", "model.logprob_chunk_size=4"]
    whole, grads, _ = run_step(sampler_moe, batch, on, shift)
    mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.context=2"]
    split, grads_s, built = run_step(sampler_moe, batch, [*on, *mesh], shift)
    assert built.mesh.shape["context"] == 2 and (built.pack_spec is not None) == packed
    assert 0 < float(whole["moe/routing_mismatch"]) < 1
    assert set(split) == set(whole)
    for key, value in whole.items():
        np.testing.assert_allclose(split[key], value, rtol=1e-5, atol=1e-5, err_msg=key)
    assert np.abs(np.asarray(grads["moe"]["router"])).max() > 1e-4
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # noqa: E731
    jax.tree.map(close, grads_s, grads)


@pytest.mark.heavy  # make test: test_route_matches_numpy checks the routers' ids
def test_top_k_ids_are_lax_top_k():
    """The routers' top-k by argmax passes (no gather of split tokens) picks lax.top_k's ids
    in its order, ties (lower index first) and -inf entries included."""
    x = np.random.RandomState(0).randint(0, 4, (2, 5, 8)).astype(np.float32)
    x[0, 0, :5] = -np.inf
    for k in (1, 3):
        want = np.asarray(jax.lax.top_k(jnp.asarray(x), k)[1])
        np.testing.assert_array_equal(np.asarray(moe_lib.top_k_ids(jnp.asarray(x), k)), want)


@pytest.mark.heavy
def test_moe_layers_gather_no_whole_row_activation():
    """test_context_parallel's check on the MoE step (experts over fsdp): whole rows are
    gathered only for the attention's keys, values and masks."""
    built = moe_build(False, (2, 2, 2, 1))
    hlo = built.step_fn.lower(*built.abstract_args()).compile().as_text()
    ranks = {len(s) for s in row_gathers(hlo, host_batch(0)["input_ids"].shape[1])}
    assert ranks == {2, 4}
