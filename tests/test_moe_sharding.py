"""Expert parallelism (models/moe_parallel.py): the tiny MoE's train step on one device equals
the step on 8 devices in meshes whose fsdp axis splits the experts, on both expert paths; the
compiled step exchanges tokens (not expert weights) over fsdp; a 2-process pod equals one
process."""

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest
from conftest import ROLLOUT_BATCH_BUCKET, TINY_MODEL_FIELDS, make_rollout_batch
from flax import nnx
from jax.sharding import PartitionSpec as P

from jgrpo import sharding, step, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import MeshConfig, load_config
from jgrpo.models import moe as moe_lib
from jgrpo.models.adapters import join_lora
from jgrpo.models.moe_transformer import MoETransformer, MoETransformerConfig

SPEC = moe_lib.MoESpec(num_experts=8, top_k=2, expert_size=16, sparse_layers=(True, True))
BASE = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "optim.learning_rate=1e-3",
    "rollout.temperature=0.9",
    "loss.reference_policy_kl_penalty=0.1",
    "model.moe.router_z_loss_coef=0.01",
    ROLLOUT_BATCH_BUCKET,
]


def tiny_moe(kernels: str) -> MoETransformer:
    fields = {**TINY_MODEL_FIELDS, "family": "qwen3_moe", "kernels": kernels}
    cfg = MoETransformerConfig(**fields, moe=dataclasses.replace(SPEC, aux_loss_coef=0.01))
    return MoETransformer(cfg, rngs=nnx.Rngs(0), init_scale=0.2)


def build(kernels: str, mesh_shape):
    cfg = load_config(None, BASE)
    mesh_cfg = dataclasses.replace(
        cfg.mesh, data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2]
    )
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[: int(np.prod(mesh_shape))])
    built = step_setup.build_step(cfg.replace(mesh=mesh_cfg), tiny_moe(kernels), mesh=mesh)
    batch = built.device_batch(TrainBatch(**make_rollout_batch(0)))
    return built, batch


def grads_on(kernels: str, mesh_shape):
    """(metrics, gradients, expert_gate's shard shape) of one step's gradient pass."""
    built, batch = build(kernels, mesh_shape)
    state, hp, flags, graphdef = built.state, built.hparams, built.flags, built.graphdef
    ref = jax.tree.map(lambda x: x * 0.9, state.params)  # a KL term that is not 0
    prepare = functools.partial(step.prepare_batch, flags=flags, graphdef=graphdef)
    data, _ = jax.jit(prepare)(state, batch, hp, ref)
    grads, metrics = jax.jit(
        lambda p, d: step.accumulate_gradients(p, d, hp, flags=flags, graphdef=graphdef)
    )(state.params, data)
    shard = state.params["moe"]["expert_gate"].addressable_shards[0].data.shape
    return (
        {k: float(v) for k, v in metrics.items()},
        jax.tree.map(np.asarray, grads),
        shard,
    )


def test_expert_parallel_only_when_experts_split_over_fsdp():
    """The block's shard_map runs when `expert` maps to fsdp and mesh.fsdp > 1; the expert
    weights' specs are their stored ones (experts over fsdp, d whole, f over tensor)."""

    def ep(rules=(), **shape):
        mesh_cfg = MeshConfig(**shape, rules=rules)
        mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:8])
        return sharding.expert_parallel(mesh, sharding.make_rules(mesh_cfg))

    assert ep(data=8) is None
    assert ep(data=2, fsdp=4, rules=(("expert", None),)) is None
    got = ep(data=2, fsdp=2, tensor=2)
    assert (got.axis, got.partial_axes) == ("fsdp", ("tensor",))
    assert (got.w_in, got.w_out) == (P("fsdp", None, "tensor"), P("fsdp", "tensor", None))
    assert got.tokens == P(("data", "fsdp"), None, None)
    assert ep(fsdp=2, context=4).tokens == P(("data", "fsdp"), "context", None)  # rows' tokens
    assert ep(fsdp=8).partial_axes == ()


MESHES = [(2, 4, 1), (1, 8, 1), (2, 2, 2)]
FAST = {("cpu", (2, 2, 2)), ("portable", (1, 8, 1))}
"""make test's cases: every mesh axis at once on the dense path, one expert per device on the
grouped path; the others are heavy."""


@pytest.fixture(scope="module")
def one_device():
    """The 1-device step (dense path, every expert here): what every mesh is compared with."""
    return grads_on("cpu", (1, 1, 1))


@pytest.mark.parametrize(
    "kernels, shape",
    [
        pytest.param(k, s, marks=() if (k, s) in FAST else pytest.mark.heavy)
        for k in ("cpu", "portable")
        for s in MESHES
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v,
)
def test_expert_parallel_step_equals_one_device(kernels, shape, one_device):
    metrics0, grads0, _ = one_device
    metrics, grads, shard = grads_on(kernels, shape)
    assert all(np.abs(g).max() > 1e-4 for g in jax.tree.leaves(grads0["moe"]))
    for key in ("loss/total", "loss/pg", "loss/kl", "moe/aux_loss", "moe/z_loss"):
        assert metrics[key] == pytest.approx(metrics0[key], abs=1e-5), key
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), grads, grads0)
    _, fsdp, tensor = shape
    # expert_gate [layers, experts, d, f]: experts over fsdp, d whole, f over tensor
    assert shard == (2, 8 // fsdp, 32, 16 // tensor)


def _collectives(text: str, op: str) -> list[str]:
    """Result shapes of the `op` collectives in compiled HLO text (e.g. 'f32[16,14,32]')."""
    return re.findall(rf"= (\w+\[[\d,]*\])\{{[^}}]*\}} {op}\(", text)


def test_compiled_step_exchanges_tokens_not_experts():
    """fsdp = 8 (one expert per device): the compiled step gathers each layer's tokens
    [b, t, d] (rows of all 8 devices) with their ids and gates and reduce-scatters the expert
    outputs back to [b / 8, t, d]; no expert weight is ever gathered whole."""
    built, batch = build("portable", (1, 8, 1))
    assert nnx.merge(built.graphdef, built.state.params).expert_parallel.axis == "fsdp"
    # the trainer's model outside the step (the pod's sampler and export): every expert here
    assert join_lora(built.graphdef, built.state.params).expert_parallel is None
    text = built.step_fn.lower(*built.abstract_args(batch)).compile().as_text()
    gathered = _collectives(text, "all-gather")
    assert {"f32[16,14,32]", "s32[16,14,2]", "f32[16,14,2]"} <= set(gathered)
    assert "f32[2,14,32]" in _collectives(text, "reduce-scatter")
    whole = {"f32[8,32,16]", "f32[8,16,32]", "f32[2,8,32,16]", "f32[2,8,16,32]"}
    assert not whole & set(gathered), sorted(set(gathered))


POD_COMPARED = (
    "loss/pg",
    "loss/total",
    "train/grad_norm",
    "reward/mean",
    "advantage/std",
    "moe/aux_loss",
    "moe/z_loss",
    "moe/tokens_per_expert_max",
)
"""Metrics the pod and the one-process run must share (the trainer's and the sampler's)."""


@pytest.mark.heavy  # two `jgrpo train` runs of 3 steps: 1 process x 8 devices, 2 x 4
def test_two_process_pod_with_expert_parallelism_matches_one_process(tmp_path):
    """builtin:tiny-qwen3-moe on data 4 x fsdp 2 (fsdp within each host: its experts split
    over a host's devices pairwise, the tokens exchanged there), the local backend sampling
    with each host's replica: the pod's losses equal one process's."""
    from test_distributed import OVERRIDES, REWARD, _launch, _log, _wait

    from jgrpo.metrics import read_metrics

    (tmp_path / "pod_rewards.py").write_text(REWARD)
    overrides = [
        *OVERRIDES,
        "model.path=builtin:tiny-qwen3-moe",
        "model.moe.router_z_loss_coef=0.01",
    ]
    one, pod = str(tmp_path / "one"), str(tmp_path / "pod")
    procs = _launch(tmp_path, one, 1, overrides=overrides)
    procs += _launch(tmp_path, pod, 2, overrides=overrides)
    codes = _wait(procs, timeout=900)
    logs = [_log(tmp_path, one, 0), _log(tmp_path, pod, 0), _log(tmp_path, pod, 1)]
    assert codes == [0, 0, 0], "\n".join(log[-2000:] for log in logs)
    reference, rows = read_metrics(one), read_metrics(pod)
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == [1, 2, 3]
    for r, ref in zip(rows, reference):
        assert ref["train/grad_norm"] > 0.1 and ref["moe/router_loss"] > 0
        for key in POD_COMPARED:
            assert r[key] == pytest.approx(ref[key], abs=1e-5), (r["step"], key)
