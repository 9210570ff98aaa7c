"""The resume rule: which keys a ``--resume`` may change against the run's saved config.

``RESUME_MAY_CHANGE`` lists them (how long, how often, where and how a run is logged or
placed); ``check_resume_compatible`` rebuilds the saved config (``from_dict`` + ``validate``)
and raises ``ConfigError`` naming every other key that differs, since those change the math of
the steps already trained.
"""

from __future__ import annotations

from typing import Any

from jgrpo.config.loading import from_dict, to_dict
from jgrpo.config.rules import validate
from jgrpo.config.sections import Config, ConfigError

RESUME_MAY_CHANGE = (
    "grpo.max_num_steps",
    "grpo.val_period",
    "grpo.val_at_start",
    "grpo.val_at_end",
    "grpo.val_num_generations",
    "grpo.val_pass_at",
    "rollout.val_temperature",
    "data.val_sets",
    "grpo.num_microbatches",
    "sft.max_num_steps",
    "sft.val_period",
    "sft.val_at_end",
    "sft.val_accuracy",
    "sft.num_microbatches",
    "data.reward_timeout_s",
    "data.reward_errors",
    "rollout.backend",
    "rollout.num_workers",
    "rollout.ray_address",
    "rollout.max_worker_failures",
    "rollout.num_cpus_per_worker",
    "rollout.num_gpus_per_worker",
    "mesh.*",
    "checkpoint.*",
    "logging.*",
)
"""Keys a `--resume` may change: how long, how often, where and how it is logged or placed.
Every other key changes the math of the steps already trained (model, data, seed, loss,
optimizer, sampling), so a resume with a different value is rejected."""


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out |= _flat(value, f"{prefix}{key}.")
        return out
    return {prefix.removesuffix("."): tree}


def _resume_may_change(key: str) -> bool:
    return any(
        key == k or (k.endswith(".*") and key.startswith(k.removesuffix("*")))
        for k in RESUME_MAY_CHANGE
    )


def check_resume_compatible(saved: Any, cfg: Config, source: str = "the saved config") -> None:
    """Raise ConfigError naming the keys where `cfg` differs from the run's saved config
    (`saved`: the dict of RUN_DIR/config.yaml) and a resume may not change them."""
    try:
        old = to_dict(validate(from_dict(Config, saved)))
    except ConfigError as e:
        raise ConfigError(f"--resume: {source} is not a valid config ({e})") from None
    old_flat, new_flat = _flat(old), _flat(to_dict(cfg))
    differ = [k for k in new_flat if old_flat.get(k) != new_flat[k]]
    fixed = [k for k in differ if not _resume_may_change(k)]
    if fixed:
        shown = "; ".join(f"{k}: {old_flat.get(k)!r} -> {new_flat[k]!r}" for k in fixed[:4])
        more = f" (+{len(fixed) - 4} more)" if len(fixed) > 4 else ""
        raise ConfigError(
            f"--resume: the config differs from {source} in keys a resume may not change: "
            f"{shown}{more}; a resume may change only {', '.join(RESUME_MAY_CHANGE)}"
        )
