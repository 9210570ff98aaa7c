"""The one jitted GRPO train step, specialised on static flags, and the one function that
builds it.

API (what train, inspect-step, export, the tests and the tools use):
- `build_step(cfg, model, mesh=None, trainable=None) -> StepSetup`: mesh -> parameter
  shardings (from the
  model's logical axes) -> optimizer and its state shardings -> the initial `TrainState`, the
  reference params and the jitted step. `model` may be concrete (its arrays are placed on the
  mesh) or abstract (`nnx.eval_shape`: the state is `jax.ShapeDtypeStruct`s carrying their
  shardings, for lowering without allocating anything).
- `setup.step_fn(state, batch, hparams, ref_params, frozen=None) -> (state, metrics)`: jitted
  (a `TopLevelStep`: top-level calls and `.lower` compile with the sampler's XLA options),
  donates `state`, pins the output state's shardings (step two never recompiles). `batch` is a
  `jgrpo.batch.TrainBatch` (`setup.abstract_batch()` gives its abstract form);
  `setup.abstract_args()` all five abstract arguments.
- `TrainState(params, opt_state, step)`: `params` is the TRAINABLE tree. `frozen` is the tree of
  parameters that are not trained (None when everything trains): it is merged with the trainable
  one (`with_frozen`) for every forward, is never differentiated or updated, and is passed like
  `ref_params`; `build_step(..., trainable=FILTER)` splits a model so (`setup.frozen`).
  `ref_params` has the trainable tree's structure (the initial values; stored in the compute
  dtype, which is exactly what the forward would cast them to).

`StepFlags` (frozen, hashable) decides the program: which logprob forwards exist, the loss and
advantage structure (bools, choices, None-ness), and the minibatch/microbatch split. Float
hyperparameters (clip eps, beta, clamps, IS bounds, advantage clips, learning rate, weight decay,
max grad norm, temperature, logprob-error threshold) travel as traced scalars in `hparams`, so
sweeping them never recompiles.

The optimizer is an optax chain, `optax.inject_hyperparams` of (clip_by_global_norm ->
adamw with an optax schedule): the peak learning rate, weight decay and max norm are arrays in
its state, which the step overwrites with `hparams`' values before each update (so a resumed
run uses the config's values). Moments are float32 whatever the parameter dtype (the optimizer
is initialised on float32 views and fed float32 gradients); updates are applied in float32 and
cast to the parameter dtype.

Inside one call, in order (docs/losses.md, the logprob forwards and the static flags):
  1. reference forward (only when compute_ref_logprobs: beta != 0),
  2. prev forward on the current params (only when compute_prev_logprobs: not skip_prev),
  3. seq-logprob-error masking, advantages (after 1-2: reinforce++ may use the KL in the reward),
  4. a scan over minibatches (one optimizer update each), each accumulating float32 gradients
     over microbatches in a scan (`scan_chunks`: one chunk runs the body inline); losses are
     normalised by the minibatch's GLOBAL token and
     sequence counts, so the result does not depend on the microbatch count or the mesh;
     the optax update; a non-finite loss or gradient skips the update (params and optimizer
     state kept) and is counted in train/skipped_updates.
A skipped forward is absent from the compiled program: each forward runs under a
`jax.named_scope("forward_<name>")`, which `forwards_in_hlo` reads back from compiled HLO.

Rows are split into minibatches and microbatches by interleaving (row i goes to chunk i mod K),
which keeps every chunk spread over the batch-sharded devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jgrpo import losses, sharding
from jgrpo.batch import TrainBatch
from jgrpo.config import AdvantageConfig, Config, ConfigError, LossConfig
from jgrpo.models import kernels

FORWARDS = ("ref", "prev", "policy")
OPTIMIZER_HYPERPARAMS = ("learning_rate", "weight_decay", "max_grad_norm")
"""The `hparams` keys that live in the optimizer state (optax.inject_hyperparams)."""


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
    total_updates: int = 1
    lora: bool = False
    """LoRA run: the trainable tree is the adapters, the reference is the base (the model's
    forward with the adapters skipped) and no reference copy exists."""
    first_scored: int = 1
    """The first batch column that may hold a generated token (rollout.prompt_bucket: every
    prompt is left-padded to a multiple of it). The forwards compute no logits left of it;
    `TrainBatch.check_scored_from` rejects a batch with a generated token there."""

    @classmethod
    def from_config(cls, cfg: Config) -> StepFlags:
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
            total_updates=cfg.grpo.max_num_steps * cfg.grpo.num_minibatches,
            lora=cfg.model.lora.rank > 0,
            first_scored=cfg.rollout.prompt_bucket,
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


def check_batch_split(cfg: Config, num_devices: int) -> None:
    """Every minibatch/microbatch chunk must split evenly over the batch-sharded devices."""
    data, fsdp, _ = sharding.resolve_mesh_shape(cfg.mesh, num_devices)
    _check_rows_split(cfg, data * fsdp)


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


def make_hparams(cfg: Config) -> dict:
    """The traced float hyperparameters of a step, as float32 scalars."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return {
        "loss": {k: f32(v) for k, v in split_floats(cfg.loss)[1].items()},
        "advantage": {k: f32(v) for k, v in split_floats(cfg.grpo.advantage)[1].items()},
        "learning_rate": f32(cfg.optim.learning_rate),
        "weight_decay": f32(cfg.optim.weight_decay),
        "max_grad_norm": f32(cfg.optim.max_grad_norm or 0.0),
        "temperature": f32(cfg.rollout.temperature),
        "seq_logprob_error_threshold": f32(cfg.grpo.seq_logprob_error_threshold or 0.0),
    }


# ----------------------------------------------------------------------------- optimizer


def make_schedule(flags: StepFlags) -> optax.Schedule:
    """Multiplier of the peak learning rate after `count` updates: linear warmup from
    1/warmup_steps to 1 over warmup_steps updates, then constant / linear / cosine decay to 0
    at total_updates (optax schedules)."""
    warm, decay_steps = flags.warmup_steps, max(flags.total_updates - flags.warmup_steps, 1)
    decay = {
        "constant": optax.constant_schedule(1.0),
        "linear": optax.linear_schedule(1.0, 0.0, decay_steps),
        "cosine": optax.cosine_decay_schedule(1.0, decay_steps),
    }[flags.schedule]
    if warm == 0:
        return decay
    warmup = optax.linear_schedule(1.0 / warm, 1.0, warm - 1) if warm > 1 else (lambda _: 1.0)
    return optax.join_schedules([warmup, decay], [warm])


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """inject_hyperparams(clip_by_global_norm -> adamw(peak lr x schedule)), float32 moments."""
    o, schedule = cfg.optim, make_schedule(StepFlags.from_config(cfg))

    def chain(learning_rate, weight_decay, max_grad_norm=None):
        adamw = optax.adamw(
            lambda count: learning_rate * schedule(count),
            b1=o.b1,
            b2=o.b2,
            eps=o.eps,
            weight_decay=weight_decay,
            mu_dtype=jnp.float32,
        )
        if max_grad_norm is None:
            return adamw
        return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)

    hyper = {"learning_rate": o.learning_rate, "weight_decay": o.weight_decay}
    if o.max_grad_norm is not None:
        hyper["max_grad_norm"] = o.max_grad_norm
    return optax.inject_hyperparams(chain, hyperparam_dtype=jnp.float32)(**hyper)


def as_float32(tree):
    """Floating leaves as float32 (what the optimizer is initialised on and fed)."""
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def set_hyperparams(opt_state, hparams: dict):
    """The optimizer state with its injected hyperparameters taken from `hparams`."""
    hyper = {k: jnp.asarray(hparams[k], v.dtype) for k, v in opt_state.hyperparams.items()}
    return opt_state._replace(hyperparams=hyper)


# ----------------------------------------------------------------------------- pieces


def scan_chunks(f, carry, xs_k):
    """`jax.lax.scan(f, carry, xs_k)` over the leading (chunk) axis, or, for one chunk, the body
    called once: XLA keeps a one-trip while loop as a loop (nothing fuses across its boundary),
    which cost the tiny train step ~8% on CPU. Same values either way."""
    if jax.tree.leaves(xs_k)[0].shape[0] != 1:
        return jax.lax.scan(f, carry, xs_k)
    carry, y = f(carry, jax.tree.map(lambda x: x[0], xs_k))
    return carry, jax.tree.map(lambda x: x[None], y)


def chunk_rows(tree, num_chunks: int):
    """[B, ...] -> [K, B/K, ...] with row i in chunk i mod K (keeps batch sharding intact)."""

    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // num_chunks, num_chunks, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, tree)


def unchunk_rows(x_k):
    """Inverse of chunk_rows for one array."""
    return jnp.swapaxes(x_k, 0, 1).reshape(-1, *x_k.shape[2:])


def with_frozen(params, frozen):
    """The full parameter tree: the trainable `params` nested dict merged with the `frozen`
    one (None = nothing frozen). Their leaf paths are disjoint."""
    if frozen is None or params is None:
        return params
    out = dict(params)
    for key, value in frozen.items():
        out[key] = with_frozen(out[key], value) if key in out else value
    return out


def sequence_logprobs(graphdef, params, batch, temperature, use_lora=True, first_scored=1):
    """[B, T] float32 logprobs of batch["input_ids"] under the model (temperature-scaled),
    through `Transformer.token_logprobs` (chunked LM head: no [B, T, V] logits); 0 in the
    columns before `first_scored` (no logits computed there); use_lora=False skips the LoRA
    adapters (the base model)."""
    model = nnx.merge(graphdef, params)
    return model.token_logprobs(
        batch["input_ids"],
        batch["attention_mask"],
        temperature,
        use_lora=use_lora,
        first_scored=first_scored,
    )


def frozen_logprobs(
    name, graphdef, params, batch, temperature, num_chunks, use_lora=True, first_scored=1
):
    """A no-gradient forward over the whole batch in `num_chunks` chunks (bounded memory)."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}

    def forward(_, mb):
        return None, sequence_logprobs(graphdef, params, mb, temperature, use_lora, first_scored)

    with jax.named_scope(f"forward_{name}"):
        _, lp_kbt = scan_chunks(forward, None, chunk_rows(inputs, num_chunks))
    return jax.lax.stop_gradient(unchunk_rows(lp_kbt))


def reduce_minibatch_metrics(stacked: dict) -> dict:
    """Minibatch metrics [M] -> one value: min/max keys by min/max, the rest by mean."""
    out = losses.combine_metrics(stacked)
    count = next(iter(stacked.values())).shape[0]
    return {
        k: v if k.endswith(("_min", "/min", "_max", "/max")) else v / count for k, v in out.items()
    }


def batch_statistics(batch: dict, advantages_bt, kept_b) -> dict:
    """Reward metrics over the rollout's sample rows (group id >= 0, whatever their sample_mask,
    as the group statistics of the advantages); advantage metrics over the rows kept for the
    loss (`kept_b`: sample_mask after logprob-error masking)."""
    rewards_b = batch["rewards"].astype(jnp.float32)
    sample_b = batch["group_ids"] >= 0
    s_b = sample_b.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(s_b), 1.0)
    mean = jnp.sum(rewards_b * s_b) / n
    tm_bt = batch["token_mask"] * (kept_b * s_b)[:, None]
    n_tok = jnp.maximum(jnp.sum(tm_bt), 1.0)
    adv_mean = jnp.sum(advantages_bt * tm_bt) / n_tok
    valid_bt = tm_bt > 0
    any_token = jnp.any(valid_bt)  # every row masked: report 0, not +-inf
    adv_min = jnp.min(jnp.where(valid_bt, advantages_bt, jnp.inf))
    adv_max = jnp.max(jnp.where(valid_bt, advantages_bt, -jnp.inf))
    b, idx_b = rewards_b.shape[0], losses.group_index(batch["group_ids"])
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


def prepare_batch(state, batch, hparams, ref_params, *, flags, graphdef):
    """Steps 1-3: the frozen forwards, logprob-error masking and advantages."""
    temp, chunks = hparams["temperature"], flags.num_microbatches * flags.num_minibatches
    data = {k: v for k, v in batch.items() if k not in ("rewards", "group_ids")}
    metrics = {"logprob/num_masked_seqs_by_logprob_error": jnp.zeros((), jnp.float32)}
    if flags.compute_ref_logprobs:
        # LoRA: the reference is the base, the policy's own arrays with the adapters skipped
        ref, use_lora = (state.params, False) if flags.lora else (ref_params, True)
        data["reference_logprobs"] = frozen_logprobs(
            "ref", graphdef, ref, batch, temp, chunks, use_lora, first_scored=flags.first_scored
        )
    if flags.compute_prev_logprobs:
        data["prev_logprobs"] = frozen_logprobs(
            "prev", graphdef, state.params, batch, temp, chunks, first_scored=flags.first_scored
        )
    if flags.use_logprob_error_threshold:
        mask_bt = batch["token_mask"] * batch["sample_mask"][:, None]
        e_b = losses.seq_logprob_error(data["prev_logprobs"], batch["generation_logprobs"], mask_bt)
        keep_b = e_b <= hparams["seq_logprob_error_threshold"]
        dropped_b = (batch["sample_mask"] > 0) & ~keep_b
        metrics["logprob/num_masked_seqs_by_logprob_error"] = jnp.sum(dropped_b).astype(jnp.float32)
        data["sample_mask"] = jnp.where(keep_b, batch["sample_mask"], 0.0)
    if flags.compute_prev_logprobs:  # before and after the threshold, over the whole batch
        metrics |= losses.seq_error_metrics(
            data["prev_logprobs"],
            batch["generation_logprobs"],
            batch["token_mask"],
            batch["sample_mask"],
            data["sample_mask"],
        )
    else:  # skipped prev forward: 0.0 placeholders (e_b >= 1, so 0.0 is never a measurement)
        metrics |= dict.fromkeys(losses.SEQ_ERROR_METRICS, jnp.zeros((), jnp.float32))
    adv_cfg = dataclasses.replace(flags.advantage, **hparams["advantage"])
    kl_bt = None
    if flags.loss.use_kl_in_reward:
        loss_cfg = dataclasses.replace(flags.loss, **hparams["loss"])
        kl_bt = losses.kl_in_reward(data["prev_logprobs"], data["reference_logprobs"], loss_cfg)
    data["advantages"] = losses.compute_token_advantages(
        batch["rewards"],
        batch["group_ids"],
        batch["token_mask"],
        adv_cfg,
        kl_bt=kl_bt,
        sample_mask_b=data["sample_mask"],
    )
    metrics.update(batch_statistics(batch, data["advantages"], data["sample_mask"]))
    return data, metrics


def accumulate_gradients(
    params, data, hparams, *, flags, graphdef, frozen=None, grad_shardings=None
):
    """Sum of microbatch gradients of the minibatch loss (normalised by its global counts),
    accumulated in float32 whatever the parameter dtype. `grad_shardings` (the params')
    pins every gradient to its parameter's sharding: left to propagation, XLA kept whole
    (unsharded) float32 gradients, 8x the memory under fsdp=8."""
    pin = lambda g: (
        g if grad_shardings is None else jax.lax.with_sharding_constraint(g, grad_shardings)
    )
    loss_cfg = dataclasses.replace(flags.loss, **hparams["loss"])
    m_bt = data["token_mask"] * data["sample_mask"][:, None]
    n_tok, n_seq = jnp.sum(m_bt), jnp.sum(data["sample_mask"])

    def loss_fn(params, mb):
        with jax.named_scope("forward_policy"):
            full = with_frozen(params, frozen)
            lp_bt = sequence_logprobs(
                graphdef, full, mb, hparams["temperature"], first_scored=flags.first_scored
            )
        return losses.policy_loss(lp_bt, mb, loss_cfg, n_tok, n_seq)

    def micro(grads, mb):
        (_, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
        g = pin(jax.tree.map(lambda x: x.astype(jnp.float32), g))
        return jax.tree.map(jnp.add, grads, g), metrics

    zeros = pin(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    grads, metrics_k = scan_chunks(micro, zeros, chunk_rows(data, flags.num_microbatches))
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
    opt_state = set_hyperparams(state.opt_state, hparams)
    updates, opt_state = tx.update(grads, opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss/total"])
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = TrainState(
        keep(params, state.params), keep(opt_state, state.opt_state), state.step + finite
    )
    metrics |= {
        "train/grad_norm": grad_norm,
        "train/learning_rate": hparams["learning_rate"] * make_schedule(flags)(state.step),
        "train/skipped_updates": 1.0 - finite.astype(jnp.float32),
    }
    return new_state, metrics


def train_step(
    state, batch, hparams, ref_params, frozen=None, *, flags, graphdef, tx, grad_shardings=None
):
    """One GRPO step on a rollout batch -> (new state, metrics)."""
    full_state = state._replace(params=with_frozen(state.params, frozen))
    data, metrics = prepare_batch(
        full_state, batch, hparams, with_frozen(ref_params, frozen), flags=flags, graphdef=graphdef
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

    def fn(state, batch, hparams, ref_params, frozen=None):
        return train_step(
            state,
            batch,
            hparams,
            ref_params,
            frozen,
            flags=flags,
            graphdef=graphdef,
            tx=tx,
            grad_shardings=grad_shardings,
        )

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


def opt_state_shardings(tx, params_abstract, param_shardings, replicated):
    """Param-shaped optimizer leaves follow their param; scalars (count, hyperparameters) are
    replicated."""
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        jax.eval_shape(lambda p: tx.init(as_float32(p)), params_abstract),
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
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


# ----------------------------------------------------------------------------- the builder


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


def constrained_graphdef(model: nnx.Module, activation_sharding, logit_shardings):
    """The graph def of `model` with its [b, t, d] activations pinned to the batch sharding
    and its LM head laid out by `logit_shardings` (`sharding.LogitShardings`: vocab-parallel
    inside the logprob chunks, its gradient pinned to the head's own sharding).

    Left to propagation, XLA resolved fsdp's conflict (rows and the embed axis of every weight
    both split over `fsdp`) by gathering the ACTIVATIONS: every device then held whole
    microbatches (the 1.5B inspect-step showed [32, 1088, 8960] buffers per device, 8x the
    rows it owns). Pinned, it gathers the weights instead (FSDP). The LM head is the exception:
    gathered, it is the largest weight (a float32 copy per forward on XLA:CPU), so it stays
    split over the vocab and the chunk's rows are gathered instead (a chunk's activations are
    a few MB). Likewise the head's gradient: unpinned, each chunk's [d, V] float32 gradient and
    its accumulator stayed whole on every device (~6 GB of the 1.5B step's temporaries).
    `model` itself is left as it was (the sampler's graph stays unconstrained: its batches
    need not divide)."""
    before = model.activation_sharding, model.logit_shardings
    model.activation_sharding, model.logit_shardings = activation_sharding, logit_shardings
    try:
        return nnx.graphdef(model)
    finally:
        model.activation_sharding, model.logit_shardings = before


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
    hparams: dict
    step_fn: Callable

    def abstract_batch(self, rows: Optional[int] = None, tokens: Optional[int] = None):
        """The abstract, batch-sharded TrainBatch of a rollout (default: the config's B x T,
        T = rollout.prompt_bucket + rollout.max_new_tokens)."""
        rows = self.cfg.grpo.batch_size if rows is None else rows
        ro = self.cfg.rollout
        tokens = ro.prompt_bucket + ro.max_new_tokens if tokens is None else tokens
        return TrainBatch.abstract(rows, tokens, self.mesh)

    def abstract_args(self, batch=None) -> tuple:
        """(state, batch, hparams, ref_params, frozen) as abstract values, for `.lower`."""
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
        )


def build_step(cfg: Config, model: nnx.Module, *, mesh=None, trainable=None) -> StepSetup:
    """mesh -> shardings -> state -> jitted step for `model` (concrete or abstract) under `cfg`.

    `mesh` defaults to `sharding.make_mesh(cfg.mesh)` over every device. `trainable` is an nnx
    filter (e.g. `nnx.LoRAParam`, `nnx.PathContains("layers")`) of the parameters to train;
    the others become `frozen` (placed with their shardings, in their stored dtype). None =
    everything trains, or only the adapters of a LoRA model (`nnx.LoRAParam`)."""
    mesh = sharding.make_mesh(cfg.mesh) if mesh is None else mesh
    _check_rows_split(cfg, mesh.shape["data"] * mesh.shape["fsdp"])
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
    graphdef = constrained_graphdef(model, sharding.batch_sharding(mesh, 3), logits)
    tx = make_optimizer(cfg)
    rep = sharding.replicated(mesh)
    params_abstract = _with_shardings(jax.eval_shape(lambda p: p, params), p_shard)
    shardings = TrainState(p_shard, opt_state_shardings(tx, params_abstract, p_shard, rep), rep)
    flags = StepFlags.from_config(cfg)
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
        hparams=make_hparams(cfg),
        step_fn=make_train_step(flags, graphdef, tx, shardings),
    )


def forwards_in_hlo(hlo_text: str) -> list[str]:
    """Which named forwards a compiled program contains (read from op metadata)."""
    return [name for name in FORWARDS if f"forward_{name}" in hlo_text]


def forwards_in_jaxpr(closed_jaxpr) -> list[str]:
    """Which named forwards were traced at all (before any dead-code elimination).

    A forward computed and then ignored would vanish from compiled HLO through DCE; this walks
    the traced jaxpr, sub-jaxprs of scan/while/cond/pjit included, so it would still show."""
    scopes: set[str] = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            scopes.add(str(eqn.source_info.name_stack))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed_jaxpr.jaxpr)
    return [name for name in FORWARDS if any(f"forward_{name}" in s for s in scopes)]
