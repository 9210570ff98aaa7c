"""On-policy distillation: a frozen teacher grades every token the policy sampled.

Owns `distillation.*` (docs/distillation.md). The teacher forward itself runs inside the one
jitted train step (`jgrpo.step.prepare_batch`, under `jax.named_scope("forward_teacher")`, only
when `StepFlags.distill`); this module holds what the step computes from it and how the teacher
is found and loaded:

    d_bt = lambda * (lt_bt - sg(lo_bt)) * m_bt              A_bt <- A_bt + d_bt
    distill/reverse_kl = sum_bt m_bt (lo_bt - lt_bt) / sum_bt m_bt

lt: the teacher's logprob of the sampled token; lo: the policy's, before this step's update
(the prev forward, the same program and numerics as the teacher's, so a teacher equal to the
policy gives exactly 0); m = token_mask x the loss rows (multi-turn: the model's own tokens
only); lambda = distillation.coef, traced. d is a reward, not a loss: lo carries no gradient
(stop_gradient; the gradient flows through the policy-gradient surrogate's lp alone), as in
Thinking Machines' on-policy distillation, where the per-token reverse KL log pi - log p_teacher
of each sampled token is the (negative) advantage. It is added after the group-normalised
reward advantage (and its clip), so with no reward (data.task_reward_weight 0, no
reward_functions) every group is all-equal and the advantage is d alone: pure distillation.

`check_teacher(cfg)` resolves distillation.teacher and compares its tokenizer with the policy's
before any weights load (ConfigError: the CLI's exit 2); `load_teacher(cfg)` builds it in
distillation.dtype (storage and compute: no master weights, it never trains).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from jgrpo.config import Config, ConfigError, LoRAConfig, ModelConfig
from jgrpo.models.sources import check_model_path, resolve_model_path

Array = jax.Array


# ----------------------------------------------------------------------------- the term


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
