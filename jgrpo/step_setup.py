"""`build_step`: what a run needs to call the train step, built from a config and a model.

`build_step(cfg, model, mesh=None, trainable=None, teacher=None) -> StepSetup`: the mesh ->
parameter shardings (from the model's logical axes) -> the optimizer (jgrpo.optimizer) and its
state shardings -> the initial `TrainState`, the reference params, the frozen tree, the
teacher's params (distillation: sharded by its own logical axes, like the reference) and the
jitted step (`step.make_train_step`) with its `StepHparams`. `model` may be concrete (its arrays are
placed on the mesh) or abstract (`nnx.eval_shape`: the state is then `jax.ShapeDtypeStruct`s
carrying their shardings, for lowering without allocating anything). `trainable` (an nnx
filter) splits the model into the trained `state.params` and `frozen`. `check_batch_split`
refuses, before anything is built, a batch whose chunks do not split over the devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jgrpo import distillation, packing, sharding
from jgrpo.batch import TrainBatch
from jgrpo.config import Config, ConfigError
from jgrpo.models.moe_transformer import MoETransformer
from jgrpo.optimizer import as_float32, make_optimizer, opt_state_shardings
from jgrpo.step import StepFlags, StepHparams, TrainState, make_train_step


def check_batch_split(cfg: Config, num_devices: int) -> None:
    """Every minibatch/microbatch chunk must split evenly over the batch-sharded devices."""
    data, fsdp, _, _ = sharding.resolve_mesh_shape(cfg.mesh, num_devices)
    _check_rows_split(cfg, data * fsdp)
    check_context(cfg)


def check_context(cfg: Config) -> None:
    """mesh.context > 1: every row (or packed row) splits into 2 x context chunks of whole
    attention blocks, each device's tokens into whole logprob chunks."""
    c = cfg.mesh.context
    if c == 1:
        return
    ro = cfg.rollout
    t = (
        cfg.grpo.sequence_packing and cfg.grpo.packing_budget
    ) or ro.prompt_bucket + ro.max_new_tokens
    chunk = t // (2 * c)
    block = min(cfg.model.attention_block_size or chunk, chunk)
    per = t // c
    lp = min(cfg.model.logprob_chunk_size or per, per)
    if t % (2 * c) or chunk % block or per % lp:
        m = cfg.model
        raise ConfigError(
            f"mesh.context={c}: rows of {t} tokens must split into {2 * c} equal chunks of "
            f"whole attention blocks (model.attention_block_size: {m.attention_block_size}) and "
            f"{c} equal parts of whole logprob chunks (model.logprob_chunk_size: "
            f"{m.logprob_chunk_size})"
        )


def _check_rows_split(cfg: Config, batch_devices: int) -> None:
    g = cfg.grpo
    rows = g.batch_size // (g.num_minibatches * g.num_microbatches)
    if rows % batch_devices:
        raise ConfigError(
            f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {g.batch_size} rows "
            f"split into {g.num_minibatches} minibatches x {g.num_microbatches} microbatches "
            f"leaves {rows} rows per chunk, not divisible by mesh.data x mesh.fsdp = "
            f"{batch_devices}"
        )


def init_train_state(params, tx, state_shardings: TrainState | None = None) -> TrainState:
    """Fresh optimizer state (float32 moments; placed with explicit shardings when given) and
    step 0."""
    init = lambda p: tx.init(as_float32(p))
    if state_shardings is None:
        return TrainState(params, jax.jit(init)(params), jnp.zeros((), jnp.int32))
    opt_state = jax.jit(init, out_shardings=state_shardings.opt_state)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), state_shardings.step)
    return TrainState(params, opt_state, step)


def _is_abstract(tree) -> bool:
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def _with_shardings(tree, shardings):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _reference_copy(params, dtype):
    """The reference policy's params: a copy in the compute dtype (never the donated buffers)."""
    return jax.tree.map(lambda x: x.astype(dtype) if x.dtype != dtype else x.copy(), params)


def constrained_graphdef(
    model: nnx.Module, activation_sharding, logit_shardings, expert_parallel=None, context=None
):
    """The graph def of `model` with its [b, t, d] activations pinned to the batch sharding
    and its LM head laid out by `logit_shardings` (`sharding.LogitShardings`: vocab-parallel
    inside the logprob chunks, its gradient pinned to the head's own sharding).

    Left to propagation, XLA resolved fsdp's conflict (rows and the embed axis of every weight
    both split over `fsdp`) by gathering the ACTIVATIONS: every device then held whole
    microbatches. Pinned, it gathers the weights instead (FSDP). The LM head is the exception:
    gathered, it is the largest weight (a float32 copy per forward on XLA:CPU), so it stays
    split over the vocab and the chunk's rows are gathered instead (a chunk's activations are
    small). Likewise the head's gradient: unpinned, each chunk's [d, V] float32 gradient and
    its accumulator stayed whole on every device.
    An MoE model also gets `expert_parallel` (`sharding.ExpertParallel` or None): its blocks
    then run their experts split over the mesh (models/moe_parallel.py); every model gets
    `context` (`sharding.ContextParallel` or None: rows split over context, models/context.py).
    `model` itself is left as it was (the sampler's graph stays unconstrained: its batches
    need not divide, and its MoE blocks run every expert)."""
    moe = isinstance(model, MoETransformer)
    before = model.activation_sharding, model.logit_shardings
    before_ep = model.expert_parallel if moe else None
    before_cp = model.context_parallel
    model.activation_sharding, model.logit_shardings = activation_sharding, logit_shardings
    model.context_parallel = context
    if moe:
        model.expert_parallel = expert_parallel
    try:
        return nnx.graphdef(model)
    finally:
        model.activation_sharding, model.logit_shardings = before
        model.context_parallel = before_cp
        if moe:
            model.expert_parallel = before_ep


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSetup:
    """What `build_step` builds. `state` is the initial state (donated by the first step)."""

    cfg: Config
    mesh: jax.sharding.Mesh
    graphdef: Any
    model_cfg: Any
    """The model's TransformerConfig."""
    flags: StepFlags
    tx: optax.GradientTransformation
    shardings: TrainState
    """Of the train state: params follow their logical axes, param-shaped optimizer leaves
    their param, scalars replicated."""
    state: TrainState
    ref_params: Any
    """Initial trainable params in the compute dtype when the reference forward runs, else
    None."""
    frozen: Any
    """Parameters that are not trained (None: the whole model trains)."""
    hparams: StepHparams
    step_fn: Callable
    pack_spec: Optional[packing.PackSpec] = None
    """How batches are packed (grpo.sequence_packing), else None."""
    teacher: Optional[distillation.Teacher] = None
    """The step's `teacher` argument: params on the mesh, coef, graph (None: no distillation)."""

    def abstract_batch(
        self,
        rows: Optional[int] = None,
        tokens: Optional[int] = None,
        packed_rows: Optional[int] = None,
    ):
        """The abstract, batch-sharded step input of a rollout (default: the config's B x T,
        T = rollout.prompt_bucket + rollout.max_new_tokens): a TrainBatch, or under
        grpo.sequence_packing a PackedBatch of `packed_rows` packed rows (default B: the
        most a batch packs into, one row each)."""
        rows = self.cfg.grpo.batch_size if rows is None else rows
        ro = self.cfg.rollout
        tokens = ro.prompt_bucket + ro.max_new_tokens if tokens is None else tokens
        routing = None  # recorded expert ids [.., l_moe, k] (flags.record_routing)
        if self.flags.record_routing:
            routing = (self.model_cfg.moe.num_sparse, self.model_cfg.moe.top_k)
        if self.pack_spec is None:
            return TrainBatch.abstract(rows, tokens, self.mesh, routing)
        width = self.pack_spec.width or tokens
        packed_rows = rows if packed_rows is None else packed_rows
        h = self.pack_spec.scored_width
        return packing.PackedBatch.abstract(rows, tokens, packed_rows, width, h, self.mesh, routing)

    def device_batch(self, batch: TrainBatch):
        """This process's host rows -> the step's input on the mesh: checked
        (`check_scored_from`), packed under grpo.sequence_packing (`packing.pack_batch`),
        sharded over data x fsdp."""
        batch = batch.check_scored_from(self.flags.first_scored)
        if self.pack_spec is not None:
            batch = packing.pack_batch(batch, self.pack_spec)
        return batch.shard(self.mesh)

    def abstract_args(self, batch=None) -> tuple:
        """(state, batch, hparams, ref_params, frozen, teacher) as abstract values, for
        `.lower`."""
        abstract = lambda tree: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
        )
        batch = self.abstract_batch() if batch is None else batch
        return (
            abstract(self.state),
            batch,
            self.hparams,
            abstract(self.ref_params),
            abstract(self.frozen),
            abstract(self.teacher),
        )


def place_frozen_model(model: nnx.Module, mesh, rules) -> tuple[Any, Any]:
    """(graphdef, params) of a model that only runs forwards in the step (the distillation
    teacher): params placed by their own logical axes (abstract ones get the shardings),
    the graph's activations and LM head constrained as the policy's are."""
    graphdef, state = nnx.split(model)
    shardings = sharding.param_shardings(state, mesh, rules)
    params = nnx.to_pure_dict(state)
    if _is_abstract(params):
        params = _with_shardings(params, shardings)
    else:
        params = sharding.shard_params(params, shardings)
    head = "embed" if model.cfg.tie_word_embeddings else "lm_head"
    logits = sharding.logit_shardings(mesh, shardings[head], model.cfg.vocab_size)
    ep = sharding.expert_parallel(mesh, rules)
    return constrained_graphdef(model, sharding.batch_sharding(mesh, 3), logits, ep), params


def build_step(
    cfg: Config,
    model: nnx.Module,
    *,
    mesh=None,
    trainable=None,
    objective="grpo",
    teacher=None,
) -> StepSetup:
    """mesh -> shardings -> state -> jitted step for `model` (concrete or abstract) under `cfg`.

    `mesh` defaults to `sharding.make_mesh(cfg.mesh)` over every device. `trainable` is an nnx
    filter (e.g. `nnx.LoRAParam`, `nnx.PathContains("layers")`) of the parameters to train;
    the others become `frozen` (placed with their shardings, in their stored dtype). None =
    everything trains, or only the adapters of a LoRA model (`nnx.LoRAParam`). `objective`:
    the step's loss (`StepFlags.objective`; "sft" for `jgrpo.sft`). `teacher`: the distillation
    teacher (concrete or abstract, as `model`), required iff distillation.teacher is set."""
    mesh = sharding.make_mesh(cfg.mesh) if mesh is None else mesh
    _check_rows_split(cfg, mesh.shape["data"] * mesh.shape["fsdp"])
    check_context(cfg)
    rules = sharding.make_rules(cfg.mesh)
    frozen = None
    if (cfg.model.lora.rank > 0) != (model.cfg.lora is not None):
        raise ValueError("build_step: model.lora.rank and the model's LoRA adapters disagree")
    if model.cfg.lora is not None and trainable is None:  # LoRA: train the adapters alone
        trainable = nnx.LoRAParam
    if trainable is None:
        graphdef, model_state = nnx.split(model)
    else:
        graphdef, model_state, frozen_state = nnx.split(model, trainable, ...)
        f_shard = sharding.param_shardings(frozen_state, mesh, rules)
        frozen = nnx.to_pure_dict(frozen_state)
        if _is_abstract(frozen):
            frozen = _with_shardings(frozen, f_shard)
        else:
            frozen = sharding.shard_params(frozen, f_shard)
    p_shard = sharding.param_shardings(model_state, mesh, rules)
    params = nnx.to_pure_dict(model_state)
    abstract = _is_abstract(params)
    head = "embed" if model.cfg.tie_word_embeddings else "lm_head"
    head_sharding = sharding.param_shardings(nnx.state(model), mesh, rules)[head]
    logits = sharding.logit_shardings(mesh, head_sharding, model.cfg.vocab_size)
    ep = sharding.expert_parallel(mesh, rules)
    cp = sharding.context_parallel(mesh, rules, model.cfg.num_heads, model.cfg.num_kv_heads)
    acts = sharding.batch_sharding(mesh, 3) if cp is None else cp.activations
    graphdef = constrained_graphdef(model, acts, logits, ep, cp)
    tx = make_optimizer(cfg)
    rep = sharding.replicated(mesh)
    params_abstract = _with_shardings(jax.eval_shape(lambda p: p, params), p_shard)
    shardings = TrainState(p_shard, opt_state_shardings(tx, params_abstract, p_shard, rep), rep)
    flags = StepFlags.from_config(cfg, objective, moe_model=isinstance(model, MoETransformer))
    if flags.distill != (teacher is not None):
        raise ValueError("build_step: distillation.teacher and the teacher model disagree")
    if teacher is not None:
        t_graphdef, t_params = place_frozen_model(teacher, mesh, rules)
        coef = jax.device_put(jnp.float32(cfg.distillation.coef), sharding.replicated(mesh))
        w = distillation.forward_weight(cfg, model.cfg.vocab_size, teacher.cfg.vocab_size)
        w = None if w is None else jax.device_put(jnp.float32(w), sharding.replicated(mesh))
        teacher = distillation.Teacher(
            params=t_params, coef=coef, graphdef=t_graphdef, forward_weight=w
        )
    dtype, ref = model.cfg.jnp_dtype, None
    if abstract:
        opt_state = jax.eval_shape(lambda p: tx.init(as_float32(p)), params_abstract)
        state = TrainState(
            params_abstract,
            _with_shardings(opt_state, shardings.opt_state),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
        )
        if flags.compute_ref_logprobs and not flags.lora:
            ref = jax.eval_shape(lambda p: _reference_copy(p, dtype), params_abstract)
            ref = _with_shardings(ref, p_shard)
    else:
        state = init_train_state(sharding.shard_params(params, p_shard), tx, shardings)
        if flags.compute_ref_logprobs and not flags.lora:
            ref = _reference_copy(state.params, dtype)
    return StepSetup(
        cfg=cfg,
        mesh=mesh,
        graphdef=graphdef,
        model_cfg=model.cfg,
        flags=flags,
        tx=tx,
        shardings=shardings,
        state=state,
        ref_params=ref,
        frozen=frozen,
        hparams=StepHparams.from_config(cfg),
        step_fn=make_train_step(flags, graphdef, tx, shardings),
        pack_spec=packing.PackSpec.from_config(cfg, mesh.shape["data"] * mesh.shape["fsdp"])
        if cfg.grpo.sequence_packing
        else None,
        teacher=teacher,
    )
