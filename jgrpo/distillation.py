"""On-policy distillation (docs/distillation.md): a frozen teacher grades every sampled token.

Inside the train step (under StepFlags.distill, `jax.named_scope("forward_teacher")`), with lt
the teacher's and lo the policy's logprob of each sampled token (lo: the prev forward, before
the update), m the loss tokens and lambda = distillation.coef (traced):

    A_bt <- A_bt + lambda * (lt_bt - sg(lo_bt)) * m_bt
    distill/reverse_kl = sum m (lo - lt) / sum m

The term is a reward, so lo carries no gradient (Thinking Machines' on-policy distillation: the
per-token reverse KL is the negative advantage); it is added after the group-normalised reward
advantage, so with no reward it is the whole advantage. `check_teacher` compares the teacher's
tokenizer with the policy's before any weights load (ConfigError: exit 2); `load_teacher`
builds it in distillation.dtype.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jgrpo.config import Config, ConfigError, LoRAConfig, ModelConfig
from jgrpo.models.sources import check_model_path, resolve_model_path

Array = jax.Array


# ----------------------------------------------------------------------------- the term


@struct.dataclass
class Teacher:
    """The train step's `teacher` argument: what its forward and term need."""

    params: Any
    """The teacher's parameters, placed on the mesh (`step_setup.place_frozen_model`)."""
    coef: jax.Array
    """distillation.coef as a float32 scalar (traced: a new value never recompiles)."""
    graphdef: Any = struct.field(pytree_node=False)
    """The teacher's graph, constrained like the policy's (static: part of the program)."""


def add_teacher_term(forward, teacher: Teacher, prev_bt, batch, sample_mask_b, advantages_bt):
    """(advantages + the teacher's term, distill/reverse_kl) inside the train step. `forward`:
    the step's frozen forward over `batch` (`step.frozen_logprobs`, bound to it); `prev_bt`
    the prev forward's logprobs (lo); the loss tokens m: token_mask on the rows with a group
    (id >= 0) and sample_mask_b > 0 (after logprob-error masking)."""
    if prev_bt is None:
        raise ValueError("distillation needs the prev forward's logprobs (StepFlags)")
    teacher_bt = forward("teacher", graphdef=teacher.graphdef, params=teacher.params)
    m_bt = batch.token_mask * ((batch.group_ids >= 0) & (sample_mask_b > 0))[:, None]
    term_bt = teacher_advantages(teacher_bt, prev_bt, m_bt, teacher.coef)
    return advantages_bt + term_bt, reverse_kl(teacher_bt, prev_bt, m_bt)


def teacher_advantages(teacher_bt: Array, policy_bt: Array, mask_bt: Array, coef) -> Array:
    """[B, T] float32 coef x (lt - sg(lo)) on the loss tokens m, 0 elsewhere (`where`, so a
    padding position's value never reaches the advantage)."""
    diff_bt = teacher_bt.astype(jnp.float32) - jax.lax.stop_gradient(policy_bt).astype(jnp.float32)
    return jnp.asarray(coef, jnp.float32) * jnp.where(mask_bt > 0, diff_bt, 0.0)


def reverse_kl(teacher_bt: Array, policy_bt: Array, mask_bt: Array) -> Array:
    """Mean over the loss tokens of lo - lt: the per-token estimate of KL(pi || p_teacher) on
    the policy's own samples (0.0 with no loss token)."""
    m_bt = mask_bt > 0
    total = jnp.sum(jnp.where(m_bt, policy_bt - teacher_bt, 0.0))
    return (total / jnp.maximum(jnp.sum(m_bt), 1)).astype(jnp.float32)


# ----------------------------------------------------------------------------- the teacher


def is_pure(cfg: Config) -> bool:
    """Pure distillation: a teacher and no reward term (no verifier or
    data.task_reward_weight 0, no reward_functions, environment or agent). No term scores any
    row, so the None rule of jgrpo.tasks would give every row sample_mask 0; the rollout keeps
    them all instead: the teacher grades every row."""
    from jgrpo.tasks.task import has_reward

    return cfg.distillation.teacher is not None and not has_reward(cfg.data)


def loss_rows(cfg: Config, scored_b) -> np.ndarray:
    """[B] float32 sample_mask of a rollout from the task's `scored_b` (rows some reward term
    scored: the None rule): every row under pure distillation (`is_pure`)."""
    scored_b = np.asarray(scored_b, np.float32)
    return np.ones_like(scored_b) if is_pure(cfg) else scored_b


def teacher_model_config(cfg: Config) -> ModelConfig:
    """The teacher as a `model` section: distillation.teacher in distillation.dtype (auto:
    model.compute_dtype's resolution) for storage and compute, without LoRA; the policy's
    logprob chunk and kernels."""
    d = cfg.distillation
    dtype = d.dtype
    if dtype == "auto":
        dtype = cfg.model.resolved_compute_dtype(jax.default_backend())
    return dataclasses.replace(
        cfg.model, path=d.teacher, dtype=dtype, compute_dtype=dtype, lora=LoRAConfig()
    )


def check_teacher(cfg: Config) -> Path | None:
    """distillation.teacher's folder (None when off), checked like model.path, with the same
    tokenizer as the policy's; raises ConfigError naming distillation.teacher otherwise."""
    spec = cfg.distillation.teacher
    if spec is None:
        return None
    length = cfg.rollout.prompt_bucket + cfg.rollout.max_new_tokens
    try:
        check_model_path(spec, length)
        folder = resolve_model_path(spec)
    except ConfigError as e:
        raise ConfigError(f"distillation.teacher: {str(e).removeprefix('model.path: ')}") from None
    check_same_tokenizer(resolve_model_path(cfg.model.path), folder)
    return folder


def check_same_tokenizer(policy_folder: Path, teacher_folder: Path) -> None:
    """The teacher reads the policy's token ids: both tokenizers must map every token to the
    same id, and the teacher's embedding must cover the policy's (ConfigError otherwise)."""
    import transformers

    from jgrpo.models.preflight import read_hf_config

    load = lambda f: transformers.AutoTokenizer.from_pretrained(str(f)).get_vocab()  # noqa: E731
    policy, teacher = load(policy_folder), load(teacher_folder)
    if policy != teacher:
        token = min(t for t in policy.keys() | teacher.keys() if policy.get(t) != teacher.get(t))
        raise ConfigError(
            f"distillation.teacher: its tokenizer ({len(teacher)} tokens) differs from "
            f"model.path's ({len(policy)} tokens; {token!r} is id {teacher.get(token)} vs "
            f"{policy.get(token)}): the teacher scores the policy's token ids, so both must "
            "share one tokenizer"
        )
    v_policy = read_hf_config(Path(policy_folder))["vocab_size"]
    v_teacher = read_hf_config(Path(teacher_folder))["vocab_size"]
    if v_teacher < v_policy:
        raise ConfigError(
            f"distillation.teacher: its vocab_size {v_teacher} is smaller than model.path's "
            f"{v_policy}: the policy could sample ids the teacher has no logits for"
        )


def load_teacher(cfg: Config, *, abstract: bool = False):
    """The teacher Transformer of distillation.teacher (`teacher_model_config`); `abstract`:
    an `nnx.eval_shape` model (config.json alone, nothing allocated)."""
    from jgrpo.models import load_policy

    return load_policy(teacher_model_config(cfg), abstract=abstract, adapters=False)
