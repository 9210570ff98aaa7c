"""The Python API for notebooks and scripts: `jgrpo.GRPOTrainer(...).train()`.

    trainer = jgrpo.GRPOTrainer(
        "configs/tiny.yaml",                               # a path, a dict or a jgrpo Config
        train_dataset=[{"prompt": "Say hi"}],              # list of dicts or datasets.Dataset
        reward_funcs=brevity,                              # callables, "module:function", models
        run_dir="runs/notebook",
        overrides=["data.task=prompts"],                   # dotted overrides, as on the CLI
    )
    result = trainer.train()      # result.history, result.metrics, result.model_dir (final/)

It runs the CLI's loop (`jgrpo.train.run`), validated like the CLI: `reward_funcs` (weight 1,
`(function, weight)` pairs, RewardFunctionConfig items; a string without `:` is a reward model),
`tools=[fn]` and `environment=Class` join data.* before `validate`; Python datasets replace
data.train_path / data.val_path; notebook functions reach child processes by cloudpickle."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

from jgrpo.config import (
    Config,
    ConfigError,
    RewardFunctionConfig,
    apply_overrides,
    from_dict,
    read_config,
    validate,
)

RewardFunc = Union[str, Callable[..., Any], tuple, RewardFunctionConfig]


@dataclasses.dataclass
class TrainResult:
    """What `GRPOTrainer.train` returns."""

    history: list[dict]
    """Validation records [{step, val/accuracy, val/reward_mean, ...}]."""
    model_dir: Path
    """RUN_DIR/final/: the trained policy as an HF folder (transformers loads it)."""
    run_dir: Path
    """The run folder (metrics.jsonl, samples.jsonl, config.yaml, tb/, plots/)."""
    metrics: list[dict]
    """Every line of RUN_DIR/metrics.jsonl (per-step training metrics)."""


def _raw(cfg: Any) -> Any:
    """A Config as plain nested dicts/lists, functions kept (for the CLI's type checks)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: _raw(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [_raw(v) for v in cfg]
    return cfg


def _term(rf) -> dict:
    """A string names a reward model (a folder or hub id) unless it is `module:function`."""
    if isinstance(rf, str) and (":" not in rf or Path(rf).expanduser().is_dir()):
        return {"model": rf}
    return {"function": rf}


def _reward_items(reward_funcs) -> list[dict]:
    if reward_funcs is None:
        return []
    if callable(reward_funcs) or isinstance(reward_funcs, (str, RewardFunctionConfig)):
        reward_funcs = [reward_funcs]
    items = []
    for i, rf in enumerate(reward_funcs):
        if isinstance(rf, RewardFunctionConfig):
            items.append(_raw(rf))
        elif isinstance(rf, tuple) and len(rf) == 2:
            items.append({**_term(rf[0]), "weight": rf[1]})
        elif callable(rf) or isinstance(rf, str):
            items.append(_term(rf))
        else:
            raise ConfigError(
                f"reward_funcs[{i}]: expected a function, 'module:function', a (function, "
                f"weight) pair or a RewardFunctionConfig, got {type(rf).__name__}"
            )
    return items


def build_config(
    config: Union[str, Path, dict, Config, None],
    overrides: Sequence[str] = (),
    reward_funcs: Optional[Sequence[RewardFunc] | RewardFunc] = None,
    tools: Sequence[Union[str, Callable[..., Any]]] = (),
    environment: Union[str, type, None] = None,
) -> Config:
    """The validated Config of a path / dict / Config plus overrides, reward functions, tools
    (appended to data.tools) and an environment class (data.environment)."""
    if config is None or isinstance(config, (str, Path)):
        data = read_config(config, list(overrides))  # validated below, with the functions
    elif isinstance(config, Config):
        data = apply_overrides(_raw(config), list(overrides)) if overrides else _raw(config)
    elif isinstance(config, dict):
        data = apply_overrides(config, list(overrides)) if overrides else dict(config)
    else:
        raise ConfigError(
            f"config: expected a YAML path, a dict or a jgrpo Config, got {type(config).__name__}"
        )
    extra = _reward_items(reward_funcs)
    if extra or tools or environment is not None:
        section = dict(data.get("data") or {})
        section["reward_functions"] = list(section.get("reward_functions") or []) + extra
        section["tools"] = list(section.get("tools") or []) + list(tools)
        if environment is not None:
            section["environment"] = environment
        data = {**data, "data": section}
    cfg = validate(from_dict(Config, data))
    from jgrpo.tasks.task import check_rewards_given

    check_rewards_given(cfg.data)
    return cfg


class GRPOTrainer:
    """Train a policy with GRPO from Python; see the module docstring."""

    def __init__(
        self,
        config: Union[str, Path, dict, Config, None] = None,
        *,
        train_dataset=None,
        eval_dataset=None,
        reward_funcs: Optional[Sequence[RewardFunc] | RewardFunc] = None,
        run_dir: Union[str, Path, None] = None,
        overrides: Sequence[str] = (),
        tools: Sequence[Union[str, Callable[..., Any]]] = (),
        environment: Union[str, type, None] = None,
    ):
        self.config = build_config(config, overrides, reward_funcs, tools, environment)
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.run_dir = Path(run_dir or Path("runs") / time.strftime("run-%Y%m%d-%H%M%S"))

    def train(self, resume: bool = False) -> TrainResult:
        """Run the GRPO loop (`resume=True` continues from the newest checkpoint)."""
        from jgrpo.metrics import read_metrics
        from jgrpo.train import FINAL_DIR, run

        history = run(
            self.config,
            self.run_dir,
            resume=resume,
            train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset,
        )
        return TrainResult(
            history=history,
            model_dir=self.run_dir / FINAL_DIR,
            run_dir=self.run_dir,
            metrics=read_metrics(self.run_dir),
        )
