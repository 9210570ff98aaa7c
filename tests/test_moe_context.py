"""Context parallelism of MoE models (mesh.context > 1, models/context.py + moe_parallel.py):
rows split over context give the unsplit model's numbers, float32, 8 fake devices.

make test: one MoE layer, 16-token rows on fsdp 2 (experts split) x context 2, recorded ids
replayed: logprobs, chosen and mismatched experts per token, router losses and every gradient
equal the 1-device forward's. Heavy: the whole step (metrics and gradients to 1e-5) on meshes
mixing context 2/4 with data, fsdp (expert parallelism) and tensor, padded and packed rows;
router replay and record_routing on a sampler's rollout."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_MODEL_FIELDS
from flax import nnx
from test_context_parallel import assert_same, padded_rows, scored
from test_packing import BASE, batch_math, host_batch

from jgrpo import sharding, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import MeshConfig, load_config
from jgrpo.models import moe as moe_lib
from jgrpo.models.moe_transformer import MoETransformer, MoETransformerConfig

SPEC = moe_lib.MoESpec(num_experts=8, top_k=2, expert_size=16, sparse_layers=(True, True))
MOE = {**TINY_MODEL_FIELDS, "family": "qwen3_moe", "num_layers": 2}


def tiny_moe(layers=2, seed=1, **fields) -> MoETransformer:
    spec = dataclasses.replace(SPEC, sparse_layers=(True,) * layers, aux_loss_coef=0.01)
    cfg = MoETransformerConfig(**{**MOE, "num_layers": layers, **fields}, moe=spec)
    return MoETransformer(cfg, rngs=nnx.Rngs(seed), init_scale=0.2)


def routed_forward(fields, ids, mask, recorded, mesh_cfg=None):
    """(logprobs, chosen ids [l, b, t, k], mismatch [b, t], aux, z, gradients of the scored
    mean logprob + aux + z) of one replaying forward, rows whole (mesh_cfg None: one device)
    or split over mesh_cfg's context axis (experts over its fsdp axis)."""
    model = tiny_moe(1, **fields)
    graphdef, state = nnx.split(model)
    if mesh_cfg is not None:
        n = mesh_cfg.data * mesh_cfg.fsdp * mesh_cfg.context * mesh_cfg.tensor
        mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:n])
        rules = sharding.make_rules(mesh_cfg)
        cp = sharding.context_parallel(mesh, rules, 4, 2)
        ep = sharding.expert_parallel(mesh, rules)
        graphdef = step_setup.constrained_graphdef(model, cp.activations, None, ep, cp)

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
