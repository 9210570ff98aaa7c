"""The one jitted GRPO train step, specialised on static flags (`jgrpo.step_setup` builds it).

- `make_train_step(flags, graphdef, tx, state_shardings)` -> `step_fn(state, batch, hparams,
  ref_params, frozen=None, teacher=None) -> (state, metrics)`, a `TopLevelStep` (compiled with
  the sampler's XLA options) that donates `state` and pins the output state's shardings.
- `StepFlags` (static; `objective="sft"`: `jgrpo.sft`'s loss) decides the program; floats
  travel traced in `StepHparams` (a sweep never recompiles). `batch`: a TrainBatch, or under
  grpo.sequence_packing a `jgrpo.packing.PackedBatch` (the forwards run over its packed rows,
  read back to rows); `prepare_batch` makes the `ScoredBatch` the loss reads. `frozen` (None:
  all trains) joins `TrainState.params` in every forward (jgrpo.forwards), never updated.
- In one call (docs/losses.md): the reference, prev and teacher forwards (when their flags say
  so, each under `jax.named_scope("forward_<name>")`), logprob-error masking, advantages, then a
  scan over minibatches (one optimizer update each) of float32 gradients accumulated over
  microbatches, normalised by the minibatch's global counts; a non-finite loss or gradient
  skips the update. Rows (packed rows) go to chunks by interleaving (i to chunk i mod K).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jgrpo import distillation, losses, packing, replay
from jgrpo.batch import TrainBatch
from jgrpo.config import AdvantageConfig, Config, LossConfig
from jgrpo.forwards import (  # noqa: F401 (sequence_logprobs: the step's forward, re-exported)
    chunk_rows,
    frozen_logprobs,
    policy_logprobs_routed,
    scan_chunks,
    sequence_logprobs,
    unchunk_rows,
    with_frozen,
)
from jgrpo.models import kernels
from jgrpo.models import moe as moe_lib
from jgrpo.optimizer import (
    OptimizerHparams,
    make_schedule,
    set_hyperparams,
    total_updates,
)
from jgrpo.sft_loss import sft_loss

FORWARDS = ("ref", "prev", "teacher", "policy")
"""The step's named forwards: each runs under `jax.named_scope(f"forward_{name}")`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepFlags:
    """Everything that changes the compiled program (bool/int/str/None-ness only)."""

    compute_prev_logprobs: bool
    compute_ref_logprobs: bool
    loss: LossConfig
    """The loss structure; its float fields are zeroed (their values live in hparams)."""
    advantage: AdvantageConfig
    """The advantage structure; float fields zeroed likewise."""
    num_minibatches: int = 1
    num_microbatches: int = 1
    use_logprob_error_threshold: bool = False
    clip_grad_norm: bool = True
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    """optim.min_lr_ratio (a compile-time constant of the schedule, like warmup_steps)."""
    warmup_start_ratio: float | None = None
    """optim.warmup_start_ratio (likewise)."""
    total_updates: int = 1
    lora: bool = False
    """LoRA run: the trainable tree is the adapters, the reference is the base (the model's
    forward with the adapters skipped) and no reference copy exists."""
    first_scored: int = 1
    """The first batch column that may hold a generated token (rollout.prompt_bucket: every
    prompt is left-padded to a multiple of it). The forwards compute no logits left of it;
    `TrainBatch.check_scored_from` rejects a batch with a generated token there."""
    sequence_packing: bool = False
    """The batch is a `jgrpo.packing.PackedBatch`: every forward runs over its packed rows."""
    objective: Literal["grpo", "sft"] = "grpo"
    """The loss: grpo (`losses.policy_loss` on the advantages) or sft (`sft_loss.sft_loss`, the
    mean NLL of the token_mask tokens; no advantages, no frozen forwards: `jgrpo.sft`)."""
    record_routing: bool = False
    """The batch carries the sampler's expert ids (`TrainBatch.expert_ids`, an MoE model under
    model.moe.router_replay or record_routing): the policy forward logs moe/routing_mismatch."""
    router_replay: bool = False
    """The prev and policy forwards route the recorded tokens with the sampler's experts
    (model.moe.router_replay; the reference forward routes by its own router)."""
    distill: bool = False
    """The teacher forward and its term of the advantage (`teacher`: jgrpo.distillation)."""
    distill_top_k: int = 0
    """distillation.loss top_k: k (the teacher's top-k KL joins the loss, not the advantage)."""

    @classmethod
    def from_config(
        cls, cfg: Config, objective: Literal["grpo", "sft"] = "grpo", moe_model: bool = False
    ) -> StepFlags:
        """`moe_model`: the policy is an MoE model (model.moe's routing flags apply)."""
        moe = cfg.model.moe
        return cls(
            compute_prev_logprobs=not cfg.skip_prev,
            compute_ref_logprobs=not cfg.skip_ref,
            loss=split_floats(with_generation_budget(cfg))[0],
            advantage=split_floats(cfg.grpo.advantage)[0],
            num_minibatches=cfg.grpo.num_minibatches,
            num_microbatches=cfg.grpo.num_microbatches,
            use_logprob_error_threshold=cfg.grpo.seq_logprob_error_threshold is not None,
            clip_grad_norm=cfg.optim.max_grad_norm is not None,
            schedule=cfg.optim.schedule,
            warmup_steps=cfg.optim.warmup_steps,
            min_lr_ratio=cfg.optim.min_lr_ratio,
            warmup_start_ratio=cfg.optim.warmup_start_ratio,
            total_updates=total_updates(cfg),
            lora=cfg.model.lora.rank > 0,
            first_scored=cfg.rollout.prompt_bucket,
            sequence_packing=cfg.grpo.sequence_packing,
            objective=objective,
            record_routing=moe_model and (moe.router_replay or moe.record_routing),
            router_replay=moe_model and moe.router_replay,
            distill=cfg.distillation.teacher is not None and objective == "grpo",
            distill_top_k=cfg.distillation.top_k if cfg.distillation.loss == "top_k" else 0,
        )


class TrainState(NamedTuple):
    params: Any
    """The trainable parameters: a pure nested dict of arrays (nnx.to_pure_dict layout)."""
    opt_state: Any
    step: jax.Array
    """Optimizer updates applied so far (int32 scalar; drives the schedule)."""


def with_generation_budget(cfg: Config) -> LossConfig:
    """cfg.loss with generation_budget (S_max of seq_sum_norm) = rollout.max_new_tokens if unset."""
    budget = cfg.loss.generation_budget
    budget = cfg.rollout.max_new_tokens if budget is None else budget
    return dataclasses.replace(cfg.loss, generation_budget=budget)


def split_floats(section) -> tuple[Any, dict[str, float]]:
    """(section with float fields zeroed, {field: float}) — None-valued fields stay structural."""
    floats = {
        f.name: getattr(section, f.name)
        for f in dataclasses.fields(section)
        if isinstance(getattr(section, f.name), float)
    }
    return dataclasses.replace(section, **dict.fromkeys(floats, 0.0)), floats


@struct.dataclass
class StepHparams:
    """The step's traced float hyperparameters (float32 scalars): a new value is a new
    argument, never a new program (`hparams.replace(...)` to sweep one)."""

    loss: dict[str, jax.Array]
    """LossConfig's float fields by name (`StepFlags.loss` holds them zeroed)."""
    advantage: dict[str, jax.Array]
    """AdvantageConfig's float fields by name (`StepFlags.advantage` holds them zeroed)."""
    optimizer: OptimizerHparams
    """Peak learning rate, weight decay, max grad norm (set into the optimizer state)."""
    temperature: jax.Array
    """rollout.temperature: the logprobs are of logits / temperature, as sampled."""
    seq_logprob_error_threshold: jax.Array
    """grpo.seq_logprob_error_threshold (0 and unused when unset)."""
    router_aux_loss_coef: Optional[jax.Array] = None
    """model.moe.router_aux_loss_coef (None: the MoE model's HF config value)."""
    router_z_loss_coef: Optional[jax.Array] = None
    """model.moe.router_z_loss_coef (MoE models only)."""

    @classmethod
    def from_config(cls, cfg: Config) -> StepHparams:
        f32 = lambda x: jnp.asarray(x, jnp.float32)
        aux = cfg.model.moe.router_aux_loss_coef
        return cls(
            loss={k: f32(v) for k, v in split_floats(cfg.loss)[1].items()},
            advantage={k: f32(v) for k, v in split_floats(cfg.grpo.advantage)[1].items()},
            optimizer=OptimizerHparams.from_config(cfg.optim),
            temperature=f32(cfg.rollout.temperature),
            seq_logprob_error_threshold=f32(cfg.grpo.seq_logprob_error_threshold or 0.0),
            router_aux_loss_coef=None if aux is None else f32(aux),
            router_z_loss_coef=f32(cfg.model.moe.router_z_loss_coef),
        )

    def loss_config(self, flags: StepFlags) -> LossConfig:
        """flags.loss with its float fields set to these (traced) values."""
        return dataclasses.replace(flags.loss, **self.loss)

    def advantage_config(self, flags: StepFlags) -> AdvantageConfig:
        """flags.advantage with its float fields set to these (traced) values."""
        return dataclasses.replace(flags.advantage, **self.advantage)


@struct.dataclass
class ScoredBatch:
    """A batch as the loss reads it: what `prepare_batch` makes of a TrainBatch. [B, T]
    per-token arrays aligned with the tokens they score, [B] per-row."""

    input_ids: jax.Array
    attention_mask: jax.Array
    token_mask: jax.Array
    generation_logprobs: jax.Array
    sample_mask: jax.Array
    """The TrainBatch's, with the rows over the logprob-error threshold set to 0."""
    advantages: jax.Array
    """[B, T] float32 per-token advantages."""
    prev_logprobs: Optional[jax.Array] = None
    """The prev forward's logprobs (None when compute_prev_logprobs is off)."""
    reference_logprobs: Optional[jax.Array] = None
    """The reference forward's logprobs (None when compute_ref_logprobs is off)."""
    layout: Optional[packing.PackedLayout] = None
    """The packed rows every forward runs over (None: the rows themselves)."""
    expert_ids: Optional[jax.Array] = None
    """[B, T, l_moe, k] the sampler's recorded experts (flags.record_routing), else None."""
    teacher_topk: Optional[distillation.TopKTargets] = None
    """The teacher's top-k targets (flags.distill_top_k), else None."""

    def loss_inputs(self) -> dict[str, jax.Array]:
        """The arrays `losses.policy_loss` reads, by name (absent forwards left out)."""
        skip = ("layout", "expert_ids", "teacher_topk")
        fields = (f.name for f in dataclasses.fields(self) if f.name not in skip)
        return {k: getattr(self, k) for k in fields if getattr(self, k) is not None}


# ----------------------------------------------------------------------------- pieces


def reduce_minibatch_metrics(stacked: dict) -> dict:
    """Minibatch metrics [M] -> one value: min/max keys by min/max, the rest by mean."""
    out = losses.combine_metrics(stacked)
    count = next(iter(stacked.values())).shape[0]
    return {
        k: v if k.endswith(("_min", "/min", "_max", "/max")) else v / count for k, v in out.items()
    }


def batch_statistics(batch: TrainBatch, advantages_bt, kept_b) -> dict:
    """Reward metrics over the rollout's sample rows (group id >= 0, whatever their sample_mask,
    as the group statistics of the advantages); advantage metrics over the rows kept for the
    loss (`kept_b`: sample_mask after logprob-error masking)."""
    rewards_b = batch.rewards.astype(jnp.float32)
    sample_b = batch.group_ids >= 0
    s_b = sample_b.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(s_b), 1.0)
    mean = jnp.sum(rewards_b * s_b) / n
    tm_bt = batch.token_mask * (kept_b * s_b)[:, None]
    n_tok = jnp.maximum(jnp.sum(tm_bt), 1.0)
    adv_mean = jnp.sum(advantages_bt * tm_bt) / n_tok
    valid_bt = tm_bt > 0
    any_token = jnp.any(valid_bt)  # every row masked: report 0, not +-inf
    adv_min = jnp.min(jnp.where(valid_bt, advantages_bt, jnp.inf))
    adv_max = jnp.max(jnp.where(valid_bt, advantages_bt, -jnp.inf))
    b, idx_b = rewards_b.shape[0], losses.group_index(batch.group_ids)
    gmax = jax.ops.segment_max(jnp.where(sample_b, rewards_b, -jnp.inf), idx_b, b)
    gmin = jax.ops.segment_min(jnp.where(sample_b, rewards_b, jnp.inf), idx_b, b)
    present = jax.ops.segment_sum(s_b, idx_b, b) > 0
    return {
        "reward/mean": mean,
        "reward/std": jnp.sqrt(jnp.sum(s_b * (rewards_b - mean) ** 2) / n),
        "advantage/mean": adv_mean,
        "advantage/std": jnp.sqrt(jnp.sum(tm_bt * (advantages_bt - adv_mean) ** 2) / n_tok),
        "advantage/min": jnp.where(any_token, adv_min, 0.0),
        "advantage/max": jnp.where(any_token, adv_max, 0.0),
        "reward/frac_groups_all_equal": jnp.sum(present & (gmax == gmin))
        / jnp.maximum(jnp.sum(present), 1),
    }


# ----------------------------------------------------------------------------- the step


def prepare_batch(
    state, batch: TrainBatch, hparams: StepHparams, ref_params, teacher=None, *, flags, graphdef
) -> tuple[ScoredBatch, dict]:
    """Steps 1-3: the frozen forwards, logprob-error masking and advantages. `batch` is a
    TrainBatch, or a `packing.PackedBatch` under flags.sequence_packing: its forwards run over
    the packed rows and everything after them over its rows, as unpacked."""
    if isinstance(batch, packing.PackedBatch) != flags.sequence_packing:
        raise ValueError(
            f"train step: grpo.sequence_packing={flags.sequence_packing} takes a "
            f"{'PackedBatch' if flags.sequence_packing else 'TrainBatch'}, got "
            f"{type(batch).__name__}"
        )
    batch, layout = (batch.rows, batch.layout) if flags.sequence_packing else (batch, None)
    if flags.objective == "sft":  # teacher forcing: no frozen forward, no advantages
        zeros_bt = jnp.zeros_like(batch.token_mask)
        data = ScoredBatch(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            token_mask=batch.token_mask,
            generation_logprobs=zeros_bt,
            sample_mask=batch.sample_mask,
            advantages=zeros_bt,
            layout=layout,
        )
        return data, {}
    replay.check_batch(batch, flags.record_routing)
    temp, chunks = hparams.temperature, flags.num_microbatches * flags.num_minibatches
    metrics = {"logprob/num_masked_seqs_by_logprob_error": jnp.zeros((), jnp.float32)}
    forward = functools.partial(
        frozen_logprobs,
        graphdef=graphdef,
        batch=batch,
        temperature=temp,
        num_chunks=chunks,
        first_scored=flags.first_scored,
        layout=layout,
    )
    ref_bt = prev_bt = None
    if flags.compute_ref_logprobs:
        # LoRA: the reference is the base, the policy's own arrays with the adapters skipped
        ref, use_lora = (state.params, False) if flags.lora else (ref_params, True)
        ref_bt = forward("ref", params=ref, use_lora=use_lora)
    if flags.compute_prev_logprobs:
        prev_bt = forward("prev", params=state.params, replay_ids=flags.router_replay)
    sample_mask_b = batch.sample_mask
    if flags.use_logprob_error_threshold:
        mask_bt = batch.token_mask * batch.sample_mask[:, None]
        e_b = losses.seq_logprob_error(prev_bt, batch.generation_logprobs, mask_bt)
        keep_b = e_b <= hparams.seq_logprob_error_threshold
        dropped_b = (batch.sample_mask > 0) & ~keep_b
        metrics["logprob/num_masked_seqs_by_logprob_error"] = jnp.sum(dropped_b).astype(jnp.float32)
        sample_mask_b = jnp.where(keep_b, batch.sample_mask, 0.0)
    if flags.compute_prev_logprobs:  # before and after the threshold, over the whole batch
        metrics |= losses.seq_error_metrics(
            prev_bt,
            batch.generation_logprobs,
            batch.token_mask,
            batch.sample_mask,
            sample_mask_b,
        )
    else:  # skipped prev forward: 0.0 placeholders (e_b >= 1, so 0.0 is never a measurement)
        metrics |= dict.fromkeys(losses.SEQ_ERROR_METRICS, jnp.zeros((), jnp.float32))
    kl_bt = None
    if flags.loss.use_kl_in_reward:
        kl_bt = losses.kl_in_reward(prev_bt, ref_bt, hparams.loss_config(flags))
    advantages_bt = losses.compute_token_advantages(
        batch.rewards,
        batch.group_ids,
        batch.token_mask,
        hparams.advantage_config(flags),
        kl_bt=kl_bt,
        sample_mask_b=sample_mask_b,
    )
    topk = None
    if flags.distill:  # `teacher`: a distillation.Teacher
        advantages_bt, distill_metrics, topk = distillation.add_teacher_term(
            forward, teacher, prev_bt, batch, sample_mask_b, advantages_bt, flags.distill_top_k
        )
        metrics |= distill_metrics
    metrics.update(batch_statistics(batch, advantages_bt, sample_mask_b))
    data = ScoredBatch(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        token_mask=batch.token_mask,
        generation_logprobs=batch.generation_logprobs,
        sample_mask=sample_mask_b,
        advantages=advantages_bt,
        prev_logprobs=prev_bt,
        reference_logprobs=ref_bt,
        layout=layout,
        expert_ids=batch.expert_ids,
        teacher_topk=topk,
    )
    return data, metrics


def microbatch_loss(data: ScoredBatch, hparams: StepHparams, *, flags, graphdef, frozen=None):
    """(loss_fn(params, x) -> (loss, metrics), xs): the loss of one microbatch and the chunks
    the microbatch scan runs over, normalised by the minibatch's global N_tok and N_seq.
    Rows: chunks of rows (row i to chunk i mod K). Packed (`data.layout`): chunks of packed
    rows; chunk k's logprobs are read back to the minibatch's rows (`unpack_logprobs`), the
    rows of other chunks masked out (sample_mask 0 for this chunk), so losses.policy_loss
    reads the same row-layout arrays either way."""
    loss_cfg = hparams.loss_config(flags)
    m_bt = data.token_mask * data.sample_mask[:, None]
    n_tok, n_seq = jnp.sum(m_bt), jnp.sum(data.sample_mask)
    policy_logprobs = functools.partial(
        policy_logprobs_routed,
        graphdef,
        temperature=hparams.temperature,
        replay_ids=flags.router_replay,
    )

    def objective(lp_bt, inputs):
        if flags.objective == "sft":
            return sft_loss(lp_bt, inputs["token_mask"], inputs["sample_mask"], n_tok)
        return losses.policy_loss(lp_bt, inputs, loss_cfg, n_tok, n_seq)

    if flags.record_routing:  # moe/routing_mismatch over the minibatch's recorded tokens
        recorded_bt = replay.recorded_tokens(data.token_mask, data.expert_ids)
        n_rec = jnp.sum(recorded_bt)

    router_losses = functools.partial(
        moe_lib.add_router_losses,
        aux_coef=hparams.router_aux_loss_coef,
        z_coef=hparams.router_z_loss_coef,
        num_microbatches=flags.num_microbatches,
    )

    def objective_topk(lp_bt, inputs, topk, n_tok):  # + the top-k KL (flags.distill_top_k)
        if topk is None:
            return objective(lp_bt, inputs)
        lp_bt, student_btk = lp_bt
        return distillation.add_topk_loss(objective(lp_bt, inputs), student_btk, topk, n_tok)

    def rows_loss(params, mb: ScoredBatch):
        topk = mb.teacher_topk
        with jax.named_scope("forward_policy"):
            full = with_frozen(params, frozen)
            lp_bt, routed, spec = policy_logprobs(
                full,
                mb.input_ids,
                mb.attention_mask,
                first_scored=flags.first_scored,
                expert_ids=mb.expert_ids,
                topk_ids=None if topk is None else topk.ids,
            )
        out = router_losses(*objective_topk(lp_bt, mb.loss_inputs(), topk, n_tok), routed, spec)
        if flags.record_routing:
            mine_bt = replay.recorded_tokens(mb.token_mask, mb.expert_ids)
            out = replay.with_mismatch(out, routed.mismatch, mine_bt, n_rec, spec)
        return out

    if data.layout is None:
        return rows_loss, chunk_rows(data, flags.num_microbatches)
    k_b, local_b = packing.microbatch_of(
        data.layout.row, flags.num_minibatches, flags.num_microbatches
    )

    def packed_loss(params, xs):
        ((ids_rw, *packed), experts_rwlk), k = xs
        in_b = k_b == k  # the rows this chunk holds
        tm_bt = data.token_mask * in_b[:, None]
        rows_b = jnp.where(in_b, local_b, 0)
        topk = data.teacher_topk
        if topk is not None:  # its ids to this chunk's packed slots, its weights to its rows
            ids = distillation.pack_ids(topk.ids, rows_b, data.layout.slot, tm_bt, packed[2].shape)
            topk = distillation.rows_only(topk, in_b)
        with jax.named_scope("forward_policy"):
            lp_rh, routed, spec = policy_logprobs(
                with_frozen(params, frozen),
                ids_rw,
                None,
                packed=packed,
                expert_ids=experts_rwlk,
                topk_ids=None if topk is None else ids,
            )
        unpack = functools.partial(
            packing.unpack_logprobs, row_b=rows_b, slot_b=data.layout.slot, token_mask_bt=tm_bt
        )
        lp_bt = jax.tree.map(unpack, lp_rh)
        inputs = data.loss_inputs() | {"sample_mask": data.sample_mask * in_b}
        out = router_losses(*objective_topk(lp_bt, inputs, topk, n_tok), routed, spec)
        if flags.record_routing:
            where = (packed[2], rows_b, data.layout.slot, tm_bt)
            mismatch_bt = replay.packed_mismatch(routed.mismatch, *where)
            out = replay.with_mismatch(out, mismatch_bt, recorded_bt * in_b[:, None], n_rec, spec)
        return out

    chunks = jnp.arange(flags.num_microbatches, dtype=jnp.int32)
    tokens = (data.layout.tokens(), data.layout.expert_ids)
    return packed_loss, (chunk_rows(tokens, flags.num_microbatches), chunks)


def accumulate_gradients(
    params,
    data: ScoredBatch,
    hparams: StepHparams,
    *,
    flags,
    graphdef,
    frozen=None,
    grad_shardings=None,
):
    """Sum of microbatch gradients of the minibatch loss (normalised by its global counts),
    accumulated in float32 whatever the parameter dtype. `grad_shardings` (the params')
    pins every gradient to its parameter's sharding: left to propagation, XLA kept whole
    (unsharded) float32 gradients on every device."""
    pin = lambda g: (
        g if grad_shardings is None else jax.lax.with_sharding_constraint(g, grad_shardings)
    )
    loss_fn, xs = microbatch_loss(data, hparams, flags=flags, graphdef=graphdef, frozen=frozen)

    def micro(grads, mb):
        (_, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
        g = pin(jax.tree.map(lambda x: x.astype(jnp.float32), g))
        return jax.tree.map(jnp.add, grads, g), metrics

    zeros = pin(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    grads, metrics_k = scan_chunks(micro, zeros, xs)
    return grads, losses.combine_metrics(metrics_k)


def optimizer_update(
    state, data, hparams, *, flags, graphdef, tx, frozen=None, grad_shardings=None
):
    """Step 4 for one minibatch: accumulate microbatch gradients, the optax update (or skip)."""
    grads, metrics = accumulate_gradients(
        state.params,
        data,
        hparams,
        flags=flags,
        graphdef=graphdef,
        frozen=frozen,
        grad_shardings=grad_shardings,
    )
    grad_norm = optax.tree.norm(grads)
    schedule = make_schedule(
        flags.schedule,
        flags.warmup_steps,
        flags.total_updates,
        flags.min_lr_ratio,
        flags.warmup_start_ratio,
    )
    opt_state = set_hyperparams(state.opt_state, hparams.optimizer)
    updates, opt_state = tx.update(grads, opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss/total"])
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = TrainState(
        keep(params, state.params), keep(opt_state, state.opt_state), state.step + finite
    )
    metrics |= {
        "train/grad_norm": grad_norm,
        "train/learning_rate": hparams.optimizer.learning_rate * schedule(state.step),
        "train/skipped_updates": 1.0 - finite.astype(jnp.float32),
    }
    return new_state, metrics


def train_step(
    state, batch, hparams, ref_params, frozen, teacher, *, flags, graphdef, tx, grad_shardings=None
):
    """One GRPO step -> (new state, metrics). `ref_params`: the trainable tree's structure (None:
    no separate reference forward); `teacher`: a `distillation.Teacher` (None: no distillation)."""
    full_state = state._replace(params=with_frozen(state.params, frozen))
    ref = with_frozen(ref_params, frozen)
    data, metrics = prepare_batch(
        full_state, batch, hparams, ref, teacher, flags=flags, graphdef=graphdef
    )

    def update(s, mb):
        return optimizer_update(
            s,
            mb,
            hparams,
            flags=flags,
            graphdef=graphdef,
            tx=tx,
            frozen=frozen,
            grad_shardings=grad_shardings,
        )

    state, metrics_m = scan_chunks(update, state, chunk_rows(data, flags.num_minibatches))
    return state, metrics | reduce_minibatch_metrics(metrics_m)


def make_train_step(flags: StepFlags, graphdef, tx, state_shardings=None):
    """jit(train_step) for these flags (a `TopLevelStep`: compiled with the sampler's XLA
    options); donates the state; pins the output state shardings."""

    grad_shardings = None if state_shardings is None else state_shardings.params
    step = functools.partial(
        train_step, flags=flags, graphdef=graphdef, tx=tx, grad_shardings=grad_shardings
    )

    def fn(state, batch, hparams, ref_params, frozen=None, teacher=None):
        return step(state, batch, hparams, ref_params, frozen, teacher)

    out_shardings = None if state_shardings is None else (state_shardings, None)
    return TopLevelStep(fn, donate_argnums=0, out_shardings=out_shardings)


class TopLevelStep:
    """`jax.jit(fn, **jit_kwargs)` whose top-level calls and `lower` compile with
    `kernels.COMPILER_OPTIONS`: bfloat16 rounded after every op as written, as in the sampler's
    programs, so the trainer's and the sampler's logprobs of the same tokens round alike (see
    models/kernels.py). jax accepts `compiler_options` on a top-level jit only, and the step is
    also traced inside other traces (`jax.make_jaxpr` in inspect-step and the tests, an outer
    jit): called with tracers, it is the plain jit (its program is then the outer one's, under
    the outer one's options)."""

    def __init__(self, fn, **jit_kwargs):
        self.nested = jax.jit(fn, **jit_kwargs)
        self.top_level = jax.jit(fn, compiler_options=kernels.COMPILER_OPTIONS, **jit_kwargs)

    def __call__(self, *args):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            return self.nested(*args)
        return self.top_level(*args)

    def lower(self, *args):
        return self.top_level.lower(*args)
