"""Compile the train step of a config ahead of time, allocating nothing, and report its cost.

Everything is abstract (jax.ShapeDtypeStruct with shardings): a full-size model can be sized
for a mesh on a laptop. Reports XLA's flops, the dot ops of the compiled HLO (and the
`stablehlo.dot_general` ops of the lowered program, which survive on GPU where dots may become
custom calls), the named forwards present in the compiled program and in the traced one (before
dead-code elimination), and per-device bytes of parameters, optimizer state and temporaries.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jgrpo import sharding, step
from jgrpo.config import Config
from jgrpo.models import Transformer, config_from_hf
from jgrpo.models.preflight import read_hf_config
from jgrpo.models.sources import resolve_model_path


def model_config_of(cfg: Config):
    """The architecture of model.path; a folder holding only config.json is enough here."""
    folder = Path(cfg.model.path)
    if not (folder / "config.json").is_file():
        folder = resolve_model_path(cfg.model.path)
    return config_from_hf(read_hf_config(folder), dtype=cfg.model.dtype)


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def bytes_per_device(tree) -> int:
    """Bytes one device holds of an abstract sharded tree (the largest shard)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


def abstract_batch(cfg: Config, mesh) -> dict:
    b = cfg.grpo.batch_size
    t = cfg.rollout.prompt_bucket + cfg.rollout.max_new_tokens
    spec = {
        "input_ids": ((b, t), jnp.int32),
        "attention_mask": ((b, t), jnp.float32),
        "token_mask": ((b, t), jnp.float32),
        "generation_logprobs": ((b, t), jnp.float32),
        "rewards": ((b,), jnp.float32),
        "group_ids": ((b,), jnp.int32),
        "sample_mask": ((b,), jnp.float32),
    }
    return {
        k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(mesh, len(shape)))
        for k, (shape, dtype) in spec.items()
    }


def inspect_step(cfg: Config, compile: bool = True) -> dict:
    start = time.perf_counter()
    model_cfg = model_config_of(cfg)
    abstract_model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, model_state = nnx.split(abstract_model)
    step.check_batch_split(cfg, jax.device_count())
    mesh = sharding.make_mesh(cfg.mesh)
    p_shard = sharding.param_shardings(model_state, mesh, sharding.make_rules(cfg.mesh))
    params = _abstract(nnx.to_pure_dict(model_state), p_shard)
    tx = step.make_optimizer(cfg)
    rep = sharding.replicated(mesh)
    o_shard = step.opt_state_shardings(tx, params, p_shard, rep)
    opt_state = _abstract(jax.eval_shape(tx.init, params), o_shard)
    report = {
        "mesh": dict(mesh.shape),
        "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
        "param_bytes_per_device": bytes_per_device(params),
        "opt_state_bytes_per_device": bytes_per_device(opt_state),
    }
    if compile:
        flags = step.StepFlags.from_config(cfg)
        state = step.TrainState(
            params, opt_state, jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
        )
        shardings = step.TrainState(p_shard, o_shard, rep)
        fn = step.make_train_step(flags, graphdef, tx, shardings)
        ref = params if flags.compute_ref_logprobs else None
        args = (state, abstract_batch(cfg, mesh), step.make_hparams(cfg), ref)
        lowered = fn.lower(*args)
        compiled = lowered.compile()
        text = compiled.as_text()
        memory = compiled.memory_analysis()
        report |= {
            "flops": float(compiled.cost_analysis()["flops"]),
            "dot_ops": text.count(" dot("),
            "dot_general_ops_lowered": lowered.as_text().count("stablehlo.dot_general"),
            "forwards": step.forwards_in_hlo(text),
            "forwards_traced": step.forwards_in_jaxpr(jax.make_jaxpr(fn)(*args)),
            "temp_bytes_per_device": int(getattr(memory, "temp_size_in_bytes", 0)),
        }
    report["seconds"] = round(time.perf_counter() - start, 2)
    return report
