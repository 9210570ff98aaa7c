"""MoE models through the whole trainer: `builtin:tiny-glm4-moe` against transformers' PyTorch
forward; the packed MoE train step against the unpacked one (losses, router terms, moe/ metrics
and gradients); `jgrpo train` on both tiny MoE built-ins (full and LoRA, resume, export); LoRA
targets an MoE model cannot take stop the CLI with exit 2; the Ray rollout backend on both."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import assert_hf_logits
from test_packing import BASE as PACK_BASE
from test_packing import assert_same, batch_math, host_batch

from jgrpo import sharding, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import load_config
from jgrpo.metrics import read_metrics
from jgrpo.models import from_pretrained
from jgrpo.models.tiny import build_tiny_glm4_moe_model, build_tiny_moe_model

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
BUILDERS = {"tiny-qwen3-moe": build_tiny_moe_model, "tiny-glm4-moe": build_tiny_glm4_moe_model}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> the HF folder of each MoE built-in (built here, not in the user's cache)."""
    root = tmp_path_factory.mktemp("moe_builtins")
    return {name: build(root / name) for name, build in BUILDERS.items()}


def test_tiny_glm4_moe_is_glm_routing_and_matches_transformers(folders):
    """builtin:tiny-glm4-moe is a GLM-4.5-style MoE (a dense first layer, sigmoid router with
    selection bias, 2 of 4 groups, routed scaling, a shared expert, half-rotary heads) whose
    float32 logits are transformers' PyTorch forward's (1e-4)."""
    folder = folders["tiny-glm4-moe"]
    model = from_pretrained(folder)
    spec = model.cfg.moe
    assert model.cfg.family == "glm4_moe" and spec.router == "sigmoid"
    assert spec.sparse_layers == (False, True) and (spec.num_groups, spec.topk_groups) == (4, 2)
    assert spec.shared_size == 32 and spec.routed_scaling == 2.5
    assert model.cfg.rope_dim == model.cfg.head_dim // 2 and model.cfg.attention_bias
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    ids = np.random.RandomState(5).randint(4, 260, (2, 11))
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    assert want.std() > 0.5  # O(1) logits: a wrong piece shows
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), want, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- packing

ROUTER = ["model.moe.router_aux_loss_coef=0.05", "model.moe.router_z_loss_coef=0.01"]


def moe_step_math(folder, packed, overrides=(), mesh_shape=(1, 1, 1)):
    """test_packing.step_math on an MoE built-in: (first minibatch's gradients, metrics)."""
    cfg = load_config(None, [*PACK_BASE, *ROUTER, *overrides, f"grpo.sequence_packing={packed}"])
    data, fsdp, tensor = mesh_shape
    mesh_cfg = dataclasses.replace(cfg.mesh, data=data, fsdp=fsdp, tensor=tensor)
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[: data * fsdp * tensor])
    built = step_setup.build_step(cfg.replace(mesh=mesh_cfg), from_pretrained(folder), mesh=mesh)
    ref = jax.tree.map(lambda x: x * 0.9, built.state.params)
    return batch_math(built, TrainBatch(**host_batch()), ref)


def assert_moe_same(packed, unpacked):
    """Every metric (moe/ ones included) and every gradient (the router's and the experts'
    nonzero) of the packed step equal the unpacked step's (test_packing.assert_same)."""
    grads, metrics = unpacked
    assert metrics["moe/aux_loss"] > 0 and metrics["moe/z_loss"] > 0
    assert np.abs(grads["moe"]["router"]).max() > 1e-4
    assert np.abs(grads["moe"]["expert_down"]).max() > 1e-4
    assert_same(packed, unpacked)


@pytest.mark.parametrize(
    "name", ["tiny-qwen3-moe", pytest.param("tiny-glm4-moe", marks=pytest.mark.heavy)]
)
def test_packed_moe_step_equals_the_unpacked_step(folders, name):
    """The packed step of an MoE model equals the unpacked one (1e-6): padding is never routed
    into the router terms (both count the real tokens), and the router's and experts'
    gradients agree; two minibatches, each packing its own rows."""
    overrides = ["grpo.num_minibatches=2", "loss.reference_policy_kl_penalty=0.1"]
    unpacked = moe_step_math(folders[name], False, overrides)
    assert_moe_same(moe_step_math(folders[name], True, overrides), unpacked)


@pytest.mark.heavy  # make test: test_packed_moe_step_equals_the_unpacked_step (one device)
def test_packed_moe_step_with_expert_parallelism(folders):
    """Packed = unpacked on data 2 x fsdp 4: the experts split over fsdp, the packed rows'
    tokens gathered over it (models/moe_parallel.py)."""
    folder = folders["tiny-qwen3-moe"]
    unpacked = moe_step_math(folder, False, (), (2, 4, 1))
    assert_moe_same(moe_step_math(folder, True, (), (2, 4, 1)), unpacked)


# ----------------------------------------------------------------------------- jgrpo train

QUIET = [
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "logging.tensorboard=false",
    "data.task_reward_weight=0.0",
    "data.reward_functions=[{function: 'length_reward:length'}]",
    "model.moe.router_z_loss_coef=0.01",
    "model.moe.router_aux_loss_coef=0.01",
]
"""A length reward: the groups are informative (the untrained model solves nothing)."""
LORA = ["model.lora.rank=4", "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"]


@pytest.fixture
def length_reward(tmp_path, monkeypatch):
    (tmp_path / "length_reward.py").write_text(
        "def length(prompts, completions, **columns):\n"
        "    return [float(len(c) % 3) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))


def not_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def assert_trained(rows, steps):
    """Steps logged once each, with a real gradient, the sampler's logprobs equal to the
    trainer's (float32), and the router terms and moe/ metrics."""
    assert [r["step"] for r in rows] == list(steps)
    for r in rows:
        assert r["train/grad_norm"] > 1e-4
        assert r["logprob/token_mult_prob_error"] <= 1.001
        assert r["moe/aux_loss"] > 0 and r["moe/z_loss"] > 0 and r["moe/router_loss"] > 0
        assert r["moe/tokens_per_expert_max"] >= r["moe/tokens_per_expert_mean"] > 0


RUNS = {
    "glm_full": ["model.path=builtin:tiny-glm4-moe"],
    "glm_lora": ["model.path=builtin:tiny-glm4-moe", *LORA],
    "qwen3_lora_packed": [
        "model.path=builtin:tiny-qwen3-moe",
        *LORA,
        "grpo.sequence_packing=true",
        "grpo.packing_budget=48",
    ],
}


@pytest.mark.heavy  # 3 + 3 steps of configs/tiny.yaml per case
@pytest.mark.parametrize("case", RUNS)
def test_moe_run_resumes_and_exports(tmp_path, monkeypatch, length_reward, case):
    """`jgrpo train` (train.run) on an MoE built-in: full fine-tuning or LoRA on attention,
    packed or not. It trains (nonzero gradients, router terms, sampler = trainer logprobs); a
    run stopped at step 2 (its checkpoint) and resumed logs the uninterrupted run's metrics;
    the final policy exported (`final/`, `jgrpo export` with LoRA merged) loads in
    transformers with the trained policy's logits."""
    from jgrpo import train
    from jgrpo.cli import main
    from jgrpo.export import load_checkpoint_model
    from jgrpo.rollout import LocalRollout, RolloutFailure

    overrides = [*QUIET, *RUNS[case], "grpo.max_num_steps=3", "checkpoint.save_period=10"]
    full_dir, broken_dir = tmp_path / "full", tmp_path / "broken"
    train.run(load_config(TINY, overrides), full_dir)
    full = read_metrics(full_dir)
    assert_trained(full, [1, 2, 3])
    if "lora" in case:
        assert main(["export", str(full_dir), str(tmp_path / "merged")]) == 0
        exported = tmp_path / "merged"
    else:
        exported = full_dir / "final"
    ids = np.random.RandomState(6).randint(4, 260, (2, 9))
    assert_hf_logits(exported, load_checkpoint_model(full_dir)[0], ids)

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
    assert not_timing(read_metrics(broken_dir)) == not_timing(full)


def test_lora_on_experts_exits_2_before_loading(tmp_path, capsys, monkeypatch):
    """model.lora naming MLP or expert modules on an MoE model: the CLI exits 2 with one line
    naming them and what is allowed, before any model is built or loaded (the default
    target list includes the MLP modules)."""
    from jgrpo.cli import main

    monkeypatch.setenv("JGRPO_CACHE", str(tmp_path / "cache"))
    argv = ["train", "--config", TINY, "--run-dir", str(tmp_path / "run")]
    for path in ("builtin:tiny-glm4-moe", "builtin:tiny-qwen3-moe"):
        for targets in ([], ["model.lora.target_modules=[q_proj,gate_proj]"]):
            code = main([*argv, f"model.path={path}", "model.lora.rank=4", *targets])
            err = capsys.readouterr().err.strip().splitlines()
            assert code == 2 and len(err) == 1, err
            assert "gate_proj" in err[0] and "allowed: q_proj, k_proj, v_proj, o_proj" in err[0]
            assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


@pytest.mark.heavy  # Ray workers (test_ray's session cluster) + 2 x 2 steps per model
@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-glm4-moe"])
def test_moe_trains_on_ray_workers(tmp_path, length_reward, ray_cluster, name):
    """rollout.backend=ray (sync, one worker: the MoE sampler runs in the worker on the weights
    it pulls) trains both MoE built-ins and logs the local backend's numbers, step by step."""
    from jgrpo import train

    overrides = [*QUIET, f"model.path=builtin:{name}", "grpo.max_num_steps=2"]
    train.run(load_config(TINY, overrides), tmp_path / "local")
    ray_overrides = [*overrides, "rollout.backend=ray", "rollout.num_workers=1"]
    train.run(load_config(TINY, ray_overrides), tmp_path / "ray")
    local, ray = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "ray")
    assert_trained(local, [1, 2])
    for got, want in zip(ray, local, strict=True):
        for key, value in want.items():
            if not key.startswith(("perf/", "rollout/")) and not key.endswith("_s"):
                assert got[key] == value, (want["step"], key, got[key], value)
