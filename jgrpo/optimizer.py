"""The train step's optimizer: an optax chain, its schedule, its traced hyperparameters.

`make_optimizer(cfg)` is `optax.inject_hyperparams` of (clip_by_global_norm -> adamw with
`make_schedule`'s multiplier of the peak learning rate). The peak learning rate, weight decay
and max norm are float32 arrays in its state, which the step overwrites with its
`OptimizerHparams` (`set_hyperparams`) before each update, so sweeping them never recompiles
and a resumed run uses the config's values. Moments are float32 whatever the parameter dtype
(the state is initialised on float32 views, `as_float32`, and fed float32 gradients).
`opt_state_shardings`: param-shaped leaves follow their param, scalars are replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jgrpo.config import Config, OptimConfig


@struct.dataclass
class OptimizerHparams:
    """The optimizer's traced hyperparameters (float32 scalars)."""

    learning_rate: jax.Array
    """Peak learning rate (optim.learning_rate); the schedule multiplies it."""
    weight_decay: jax.Array
    """AdamW's decoupled weight decay (optim.weight_decay)."""
    max_grad_norm: jax.Array
    """Global-norm clip (optim.max_grad_norm); 0 and unused when that is None (no clip)."""

    @classmethod
    def from_config(cls, optim: OptimConfig) -> OptimizerHparams:
        f32 = lambda x: jnp.asarray(x, jnp.float32)
        return cls(
            learning_rate=f32(optim.learning_rate),
            weight_decay=f32(optim.weight_decay),
            max_grad_norm=f32(optim.max_grad_norm or 0.0),
        )


def total_updates(cfg: Config) -> int:
    """Optimizer updates in the whole run: one per minibatch of every step."""
    return cfg.grpo.max_num_steps * cfg.grpo.num_minibatches


def make_schedule(
    kind: str,
    warmup_steps: int,
    total_updates: int,
    min_ratio: float = 0.0,
    warmup_start: float | None = None,
) -> optax.Schedule:
    """Multiplier of the peak learning rate after `count` updates: a linear warmup over
    warmup_steps updates, then constant / linear / cosine decay to `min_ratio`
    (optim.min_lr_ratio) at total_updates (optax schedules). The warmup (optim.warmup_start_ratio
    = `warmup_start`): None gives update k the multiplier (k+1)/warmup_steps, so no update is
    spent at rate 0 and update warmup_steps-1 is at the peak; a number s gives
    s + (1-s) k/warmup_steps, at the peak from update warmup_steps (s = 0: Hugging Face's and
    optax's warmup; s > 0: torch's LinearLR with start_factor s)."""
    warm, decay_steps = warmup_steps, max(total_updates - warmup_steps, 1)
    decay = {
        "constant": optax.constant_schedule(1.0),
        "linear": optax.linear_schedule(1.0, min_ratio, decay_steps),
        "cosine": optax.cosine_decay_schedule(1.0, decay_steps, alpha=min_ratio),
    }[kind]
    if warm == 0:
        return decay
    if warmup_start is not None:
        warmup = optax.linear_schedule(warmup_start, 1.0, warm)
    elif warm > 1:
        warmup = optax.linear_schedule(1.0 / warm, 1.0, warm - 1)
    else:
        warmup = lambda _: 1.0
    return optax.join_schedules([warmup, decay], [warm])


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """inject_hyperparams(clip_by_global_norm -> adamw(peak lr x schedule)), float32 moments."""
    o = cfg.optim
    schedule = make_schedule(
        o.schedule, o.warmup_steps, total_updates(cfg), o.min_lr_ratio, o.warmup_start_ratio
    )

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


def set_hyperparams(opt_state, hparams: OptimizerHparams):
    """The optimizer state with its injected hyperparameters taken from `hparams`."""
    hyper = {k: jnp.asarray(getattr(hparams, k), v.dtype) for k, v in opt_state.hyperparams.items()}
    return opt_state._replace(hyperparams=hyper)


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
