"""The Python API for notebooks and scripts: `jgrpo.GRPOTrainer(...).train()`.

    trainer = jgrpo.GRPOTrainer(
        "configs/tiny.yaml",                               # a path, a dict or a jgrpo Config
        train_dataset=[{"prompt": "Say hi"}],              # list of dicts or datasets.Dataset
        reward_funcs=brevity,                              # callables, "module:function", models
        run_dir="runs/notebook", overrides=["data.task=prompts"])   # dotted, as on the CLI
    result = trainer.train()      # result.history, result.metrics, result.model_dir (final/)

Or TRL's shape: `GRPOTrainer(model=..., reward_funcs=..., args=jgrpo.GRPOConfig(...),
train_dataset=..., peft_config=...)` (`jgrpo.trl_config`, docs/trl.md). It runs the CLI's loop
(`jgrpo.train.run`), validated like the CLI; the keys apply in the order config, args, model,
peft_config, overrides; reward functions, tools, environment and agent join data.* before
`validate`; a train_dataset makes data.task `prompts` unless the config names a task."""

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


def _set_keys(data: dict, keys: dict[str, Any]) -> dict:
    """`data` with each dotted key set to its value (sections copied, never mutated)."""
    data = dict(data)
    for dotted, value in keys.items():
        *path, leaf = dotted.split(".")
        node = data
        for part in path:
            node[part] = dict(node.get(part) or {})
            node = node[part]
        node[leaf] = value
    return data


def _model_path(model: Any) -> str:
    """`model=` takes what model.path takes: a folder, hub id, `smollm2`, `builtin:...`."""
    if isinstance(model, (str, Path)):
        return str(model)
    raise ConfigError(
        f"model: expected what model.path takes (an HF folder, a hub id, smollm2, "
        f"builtin:tiny-qwen2), got {type(model).__name__}; jgrpo loads the model itself"
    )


def _trl_keys(data: dict, args, model, peft_config, train_dataset) -> dict[str, Any]:
    """The dotted keys of TRL's arguments (jgrpo.trl_config)."""
    from jgrpo.trl_config import GRPOConfig, jgrpo_keys, lora_keys

    keys: dict[str, Any] = {}
    if args is not None:
        if not isinstance(args, GRPOConfig):
            raise ConfigError(f"args: expected a jgrpo.GRPOConfig, got {type(args).__name__}")
        keys |= jgrpo_keys(args, dict(data.get("grpo") or {}))
    if model is not None:
        keys["model.path"] = _model_path(model)
    if peft_config is not None:
        keys |= lora_keys(peft_config)
    if train_dataset is not None and "task" not in (data.get("data") or {}):
        keys["data.task"] = "prompts"
    return keys


def _weighted(items: list[dict], weights) -> list[dict]:
    """GRPOConfig.reward_weights: one weight per reward function, given once."""
    if weights is None:
        return items
    if len(weights) != len(items):
        raise ConfigError(
            f"GRPOConfig.reward_weights: {len(weights)} weights for {len(items)} reward functions"
        )
    for i, item in enumerate(items):
        if "weight" in item:
            raise ConfigError(f"reward_funcs[{i}]: a weight here and in GRPOConfig.reward_weights")
    return [{**item, "weight": w} for item, w in zip(items, weights)]


def build_config(
    config: Union[str, Path, dict, Config, None],
    overrides: Sequence[str] = (),
    reward_funcs: Optional[Sequence[RewardFunc] | RewardFunc] = None,
    tools: Sequence[Union[str, Callable[..., Any]]] = (),
    environment: Union[str, type, None] = None,
    agent: Union[str, Callable[..., Any], None] = None,
    *,
    args=None,
    model=None,
    peft_config=None,
    train_dataset=None,
) -> Config:
    """The validated Config of a path / dict / Config, then TRL's `args` (a jgrpo.GRPOConfig),
    `model` and `peft_config`, then overrides; plus reward functions, tools (appended to
    data.tools), an environment class (data.environment) and an agent (data.agent)."""
    if config is None or isinstance(config, (str, Path)):
        data = read_config(config)  # validated below, with the functions
    elif isinstance(config, Config):
        data = _raw(config)
    elif isinstance(config, dict):
        data = dict(config)
    else:
        raise ConfigError(
            f"config: expected a YAML path, a dict or a jgrpo Config, got {type(config).__name__}"
        )
    data = _set_keys(data, _trl_keys(data, args, model, peft_config, train_dataset))
    if overrides:
        data = apply_overrides(data, list(overrides))
    extra = _weighted(_reward_items(reward_funcs), getattr(args, "reward_weights", None))
    if extra or tools or environment is not None or agent is not None:
        section = dict(data.get("data") or {})
        section["reward_functions"] = list(section.get("reward_functions") or []) + extra
        section["tools"] = list(section.get("tools") or []) + list(tools)
        if environment is not None:
            section["environment"] = environment
        if agent is not None:
            section["agent"] = agent
        data = {**data, "data": section}
    cfg = validate(from_dict(Config, data))
    from jgrpo.tasks.task import check_rewards_given

    check_rewards_given(cfg.data, cfg.distillation.teacher is not None)
    return cfg


def _run_dir(run_dir, args, args_name: str, prefix: str) -> Path:
    """The trainer's run folder: run_dir, or args.output_dir (not both), else a dated one."""
    output_dir = getattr(args, "output_dir", None)
    if run_dir is not None and output_dir is not None:
        raise ConfigError(f"run_dir: give run_dir or {args_name}.output_dir, not both")
    run_dir = run_dir or output_dir
    return Path(run_dir or Path("runs") / time.strftime(f"{prefix}-%Y%m%d-%H%M%S"))


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
        agent: Union[str, Callable[..., Any], None] = None,
        model=None,
        args=None,
        peft_config=None,
        **unsupported: Any,
    ):
        for name in unsupported:
            raise ConfigError(f"GRPOTrainer: {name} is not supported (docs/trl.md)")
        from jgrpo.tasks.child import add_user_folders

        # as the CLI: `module:function` also imports from the working folder and the config's
        add_user_folders(config if isinstance(config, (str, Path)) else None)
        self.config = build_config(
            config,
            overrides,
            reward_funcs,
            tools,
            environment,
            agent,
            args=args,
            model=model,
            peft_config=peft_config,
            train_dataset=train_dataset,
        )
        self.args = args
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.run_dir = _run_dir(run_dir, args, "GRPOConfig", "run")

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


def build_sft_config(
    config: Union[str, Path, dict, Config, None],
    overrides: Sequence[str] = (),
    *,
    args=None,
    model=None,
    peft_config=None,
) -> Config:
    """The validated Config of `jgrpo.SFTTrainer`: a path / dict / Config, then TRL's `args`
    (a jgrpo.SFTConfig), `model` and `peft_config`, then overrides."""
    from jgrpo.trl_config import SFTConfig, lora_keys, sft_keys

    if config is None or isinstance(config, (str, Path)):
        data = read_config(config)
    elif isinstance(config, Config):
        data = _raw(config)
    elif isinstance(config, dict):
        data = dict(config)
    else:
        raise ConfigError(
            f"config: expected a YAML path, a dict or a jgrpo Config, got {type(config).__name__}"
        )
    keys: dict[str, Any] = {}
    if args is not None:
        if not isinstance(args, SFTConfig):
            raise ConfigError(f"args: expected a jgrpo.SFTConfig, got {type(args).__name__}")
        keys |= sft_keys(args)
    if model is not None:
        keys["model.path"] = _model_path(model)
    if peft_config is not None:
        keys |= lora_keys(peft_config)
    data = _set_keys(data, keys)
    if overrides:
        data = apply_overrides(data, list(overrides))
    return validate(from_dict(Config, data))


class SFTTrainer:
    """Supervised fine-tuning from Python, in TRL's shape (docs/sft.md):

        trainer = jgrpo.SFTTrainer(model="builtin:tiny-qwen2-chat", train_dataset=records,
                                   args=jgrpo.SFTConfig(max_steps=10, learning_rate=1e-3))
        result = trainer.train()      # result.history, result.metrics, result.model_dir

    `config` (a YAML path, dict or Config) is the base; `args` (jgrpo.SFTConfig, TRL's names),
    `model` (what model.path takes), `peft_config` (LoRA) and `overrides` (dotted keys) apply
    in that order. `train_dataset` / `eval_dataset` (list of dicts or datasets.Dataset of
    `messages` or prompt/completion records) replace sft.train_path / sft.val_path. It runs the
    CLI's `jgrpo sft` loop (`jgrpo.sft.run`)."""

    def __init__(
        self,
        config: Union[str, Path, dict, Config, None] = None,
        *,
        model=None,
        train_dataset=None,
        eval_dataset=None,
        args=None,
        peft_config=None,
        run_dir: Union[str, Path, None] = None,
        overrides: Sequence[str] = (),
        **unsupported: Any,
    ):
        for name in unsupported:
            raise ConfigError(f"SFTTrainer: {name} is not supported (docs/sft.md)")
        self.config = build_sft_config(
            config, overrides, args=args, model=model, peft_config=peft_config
        )
        self.args = args
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.run_dir = _run_dir(run_dir, args, "SFTConfig", "sft")

    def train(self, resume: bool = False) -> TrainResult:
        """Run the SFT loop (`resume=True` continues from the newest checkpoint)."""
        from jgrpo.export import FINAL_DIR
        from jgrpo.metrics import read_metrics
        from jgrpo.sft import run

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
