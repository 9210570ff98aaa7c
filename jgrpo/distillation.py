"""On-policy distillation (docs/distillation.md): a frozen teacher grades every sampled token.

Inside the train step (StepFlags.distill, `jax.named_scope("forward_teacher")`), with lt the
teacher's and lo the policy's logprob of each sampled token (lo: the prev forward, before the
update), m the loss tokens and lambda = distillation.coef (traced), by distillation.loss:

    sampled_token: A_bt <- A_bt + lambda * (lt_bt - sg(lo_bt)) * m_bt   (a reward: Thinking
        Machines' on-policy distillation; added after the group-normalised reward advantage)
    top_k: loss += lambda * sum m KL_k(teacher, policy) / N_tok   (NeMo-RL's: `add_topk_loss`
        over the teacher's k likeliest ids, its forward's `TopKTargets`; the advantage as is)
    distill/reverse_kl = sum m (lo - lt) / sum m   (both)

`check_teacher` compares the teacher's tokenizer with the policy's before any weights load
(ConfigError: exit 2); `load_teacher` builds it in distillation.dtype.
"""

from __future__ import annotations

import dataclasses
import functools
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
    forward_weight: Any = None
    """distillation.loss top_k: the forward KL's weight w (kl_type forward 1, reverse 0, mixed
    distillation.mixed_kl_weight; float32, traced); None under sampled_token."""


@struct.dataclass
class TopKTargets:
    """What the top-k loss reads of the teacher, by row (split into minibatches and
    microbatches with the batch): `ScoredBatch.teacher_topk`."""

    logprobs: Array
    """[B, T, k] float32 the teacher's logprobs (full vocabulary) of its k likeliest tokens."""
    ids: Array
    """[B, T, k] int32 those tokens' ids (0 off the scored columns)."""
    forward_bt: Array
    """[B, T] w x m: the forward KL's weight on each loss token (m as `add_teacher_term`)."""
    reverse_bt: Array
    """[B, T] (1 - w) x m: the reverse KL's."""
    coef_b: Array
    """[B] distillation.coef on every row (traced)."""


def add_teacher_term(
    forward, teacher: Teacher, prev_bt, batch, sample_mask_b, advantages_bt, top_k: int = 0
):
    """(advantages, {distill/reverse_kl}, TopKTargets or None) inside the train step.
    `forward`: the step's frozen forward over `batch` (`step.frozen_logprobs`, bound to it);
    `prev_bt` the prev forward's logprobs (lo); the loss tokens m: token_mask on the rows with
    a group (id >= 0) and sample_mask_b > 0 (after logprob-error masking). `top_k` 0: the
    teacher's term joins the advantages; k > 0: they are returned as they came, with the
    teacher's top-k targets for `add_topk_loss`."""
    if prev_bt is None:
        raise ValueError("distillation needs the prev forward's logprobs (StepFlags)")
    m_bt = batch.token_mask * ((batch.group_ids >= 0) & (sample_mask_b > 0))[:, None]
    run = functools.partial(forward, "teacher", graphdef=teacher.graphdef, params=teacher.params)
    if top_k == 0:
        teacher_bt = run()
        term_bt = teacher_advantages(teacher_bt, prev_bt, m_bt, teacher.coef)
        return (
            advantages_bt + term_bt,
            {"distill/reverse_kl": reverse_kl(teacher_bt, prev_bt, m_bt)},
            None,
        )
    teacher_bt, (lp_btk, ids_btk) = run(top_k=top_k)
    w = jnp.asarray(teacher.forward_weight, jnp.float32)
    coef_b = jnp.broadcast_to(jnp.asarray(teacher.coef, jnp.float32), sample_mask_b.shape)
    m_bt = m_bt.astype(jnp.float32)
    targets = TopKTargets(lp_btk, ids_btk.astype(jnp.int32), w * m_bt, (1.0 - w) * m_bt, coef_b)
    return advantages_bt, {"distill/reverse_kl": reverse_kl(teacher_bt, prev_bt, m_bt)}, targets


def topk_kl(student_btk: Array, teacher_btk: Array) -> tuple[Array, Array]:
    """(forward KL(t || s), reverse KL(s || t)) [B, T] float32 at each position, both
    distributions renormalised over the teacher's top-k ids: log_softmax over the k of the
    student's logits and of the teacher's logprobs there (NeMo-RL's default,
    zero_outside_topk false; the teacher carries no gradient)."""
    s = jax.nn.log_softmax(student_btk.astype(jnp.float32), axis=-1)
    t = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_btk).astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(t) * (t - s), axis=-1), jnp.sum(jnp.exp(s) * (s - t), axis=-1)


def add_topk_loss(out, student_btk: Array, targets: TopKTargets, n_tok):
    """`out` = (loss, metrics) of a microbatch + coef x the mixed KL, token-summed and divided
    by the minibatch's n_tok (so the microbatches sum to its token mean, as the policy loss):
    loss/total includes it; distill/topk_kl is the KL alone. `student_btk`: the policy's
    logits / temperature at targets.ids (`Transformer.token_logprobs`' topk_ids)."""
    loss, metrics = out
    forward_bt, reverse_bt = topk_kl(student_btk, targets.logprobs)
    kl_bt = targets.forward_bt * forward_bt + targets.reverse_bt * reverse_bt
    n = jnp.maximum(n_tok, 1.0)
    term = jnp.sum(targets.coef_b[:, None] * kl_bt) / n
    metrics = metrics | {"loss/total": metrics["loss/total"] + term}
    return loss + term, metrics | {"distill/topk_kl": jnp.sum(kl_bt) / n}


def pack_ids(ids_btk: Array, row_b, slot_b, token_mask_bt, shape_rh) -> Array:
    """[B, T, k] -> [R, H, k]: each token_mask token's ids to its packed slot (the inverse of
    `packing.unpack_logprobs`; 0 in the slots no token fills)."""
    scored_bt = token_mask_bt > 0
    slot_bt = slot_b[:, None] + jnp.cumsum(scored_bt, axis=1, dtype=jnp.int32) - 1
    r_bt = jnp.where(scored_bt, row_b[:, None], shape_rh[0])  # out of range: dropped
    out = jnp.zeros((*shape_rh, ids_btk.shape[-1]), ids_btk.dtype)
    return out.at[r_bt, jnp.where(scored_bt, slot_bt, 0)].set(ids_btk, mode="drop")


def rows_only(targets: TopKTargets, in_b) -> TopKTargets:
    """The targets with their weights zeroed off the rows `in_b` (a packed microbatch's)."""
    keep = in_b.astype(jnp.float32)[:, None]
    return targets.replace(
        forward_bt=targets.forward_bt * keep, reverse_bt=targets.reverse_bt * keep
    )


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


def forward_weight(cfg: Config, vocab_size: int, teacher_vocab: int) -> float | None:
    """Teacher.forward_weight of distillation.kl_type (None under loss sampled_token);
    ConfigError when distillation.top_k exceeds the policy's vocab_size, or the teacher's
    differs (its top ids must be ids of the policy's logits)."""
    d = cfg.distillation
    if d.loss == "sampled_token":
        return None
    if teacher_vocab != vocab_size:
        raise ConfigError(
            f"distillation.loss: top_k needs the teacher's vocab_size ({teacher_vocab}) equal "
            f"to the policy's ({vocab_size}): the teacher's top ids index the policy's logits"
        )
    if d.top_k > vocab_size:
        raise ConfigError(
            f"distillation.top_k: must be <= the vocabulary ({vocab_size} tokens), got {d.top_k}"
        )
    return {"forward": 1.0, "reverse": 0.0, "mixed": d.mixed_kl_weight}[d.kl_type]


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
    from jgrpo.models.preflight import read_hf_config

    vocab = lambda f: read_hf_config(Path(f))["vocab_size"]  # noqa: E731
    forward_weight(cfg, vocab(resolve_model_path(cfg.model.path)), vocab(folder))  # top_k
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
