"""TRL's argument names for `jgrpo.GRPOTrainer`: `GRPOConfig` and LoRA configs -> jgrpo keys.

`GRPOConfig(**kwargs)` takes the names of TRL's `GRPOConfig` (and of the transformers
`TrainingArguments` it extends) that have a jgrpo meaning; `jgrpo_keys` turns the given ones
into jgrpo's dotted keys (docs/trl.md has the table). An argument left out keeps jgrpo's value
(the base config's, else jgrpo's default), never TRL's default, so the same run reads the same
from YAML and from Python. A TRL argument jgrpo does not support is a ConfigError naming it.
`lora_keys` reads a `peft.LoraConfig` by its attributes (peft is never imported) or takes
jgrpo's own LoRAConfig. Imports neither jax nor torch."""

from __future__ import annotations

from typing import Any

from jgrpo.config import ConfigError, LoRAConfig

_DIRECT = {
    "learning_rate": "optim.learning_rate",
    "weight_decay": "optim.weight_decay",
    "adam_beta1": "optim.b1",
    "adam_beta2": "optim.b2",
    "adam_epsilon": "optim.eps",
    "warmup_steps": "optim.warmup_steps",
    "num_generations": "grpo.num_generations_per_prompt",
    "num_generations_eval": "grpo.val_num_generations",
    "seed": "grpo.seed",
    "max_completion_length": "rollout.max_new_tokens",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "beta": "loss.reference_policy_kl_penalty",
    "epsilon": "loss.ratio_clip_min",
    "epsilon_high": "loss.ratio_clip_max",
    "mask_truncated_completions": "loss.overlong_filtering",
    "shuffle_dataset": "data.shuffle",
    "save_total_limit": "checkpoint.keep_last",
    "eval_on_start": "grpo.val_at_start",
}
"""TRL names whose value is jgrpo's key's value as is."""
_BATCH = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "generation_batch_size",
    "steps_per_generation",
)
_OTHER = (
    "output_dir",
    "max_steps",
    "save_steps",
    "eval_steps",
    "eval_strategy",
    "loss_type",
    "scale_rewards",
    "importance_sampling_level",
    "lr_scheduler_type",
    "max_grad_norm",
    "top_k",
    "bf16",
    "gradient_checkpointing",
    "report_to",
    "reward_weights",
    "num_iterations",
    "use_vllm",
    "remove_unused_columns",
)
SUPPORTED = (*_DIRECT, *_BATCH, *_OTHER)
"""Every TRL argument name GRPOConfig accepts."""
_UNSUPPORTED = {
    "max_prompt_length": "jgrpo never truncates prompts (they are padded to a multiple of "
    "rollout.prompt_bucket); TRL removed it in v0.28",
    "num_train_epochs": "jgrpo counts steps: give max_steps",
    "logging_steps": "jgrpo logs every step's metrics (metrics.jsonl, TensorBoard); leave it out",
    "fp16": "jgrpo computes in float32 or bfloat16 (bf16=True)",
    "delta": "jgrpo's clip is PPO's (epsilon, epsilon_high); there is no two-sided delta bound",
}
"""TRL arguments with a known reason jgrpo does not take them."""
_LOSS_TYPES = {"dapo": "token_mean", "grpo": "seq_mean", "dr_grpo": "seq_sum_norm"}
_SCHEDULES = {
    "constant": "constant",
    "constant_with_warmup": "constant",
    "linear": "linear",
    "cosine": "cosine",
}


def _warmup(given: dict) -> dict[str, Any]:
    """Hugging Face's schedulers warm up from 0 (update k of W at k/W of the peak): so does the
    mapped run (optim.warmup_start_ratio 0), whenever it warms up."""
    return {"optim.warmup_start_ratio": 0.0} if given.get("warmup_steps") else {}


def check_names(kind: str, given: dict, supported, unsupported: dict, doc: str) -> None:
    """ConfigError naming the first argument of `given` that `kind` (GRPOConfig / SFTConfig)
    does not take: one of `unsupported` (with its reason) or not among `supported`."""
    trainer = kind.replace("Config", "Trainer")
    for name in given:
        if name in unsupported:
            raise ConfigError(f"{kind}: {name} is not supported: {unsupported[name]}")
        if name not in supported:
            raise ConfigError(
                f"{kind}: {name} is not a TRL argument jgrpo supports ({doc} lists those it "
                f"maps; give jgrpo keys as {trainer}(overrides=[...]))"
            )


class GRPOConfig:
    """TRL-named training arguments (see the module docstring and docs/trl.md); read back any
    given one as an attribute (None when not given)."""

    def __init__(self, **kwargs: Any):
        check_names("GRPOConfig", kwargs, SUPPORTED, _UNSUPPORTED, "docs/trl.md")
        object.__setattr__(self, "given", dict(kwargs))
        """The arguments passed, by TRL name."""
        jgrpo_keys(self, {})  # every value error now, where the user wrote it

    def __setattr__(self, name: str, value: Any) -> None:
        """`args.max_steps = 10` after construction: checked like a keyword argument."""
        self.__init__(**{**self.given, name: value})

    def __getattr__(self, name: str) -> Any:
        if name in SUPPORTED:
            return self.__dict__["given"].get(name)
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"GRPOConfig({', '.join(f'{k}={v!r}' for k, v in self.given.items())})"


def _fail(name: str, value: Any, why: str) -> None:
    raise ConfigError(f"GRPOConfig.{name}: {value!r} {why}")


def _batch_keys(given: dict, generations: int) -> dict[str, Any]:
    """TRL's batch arithmetic (one process: per_device_train_batch_size rows per micro-step on
    all devices together): rows per generation = generation_batch_size, or
    per_device_train_batch_size x steps_per_generation (default gradient_accumulation_steps);
    an optimizer step is gradient_accumulation_steps micro-steps."""
    if not any(k in given for k in _BATCH):
        return {}
    per_step = given.get("per_device_train_batch_size", 8)  # TRL's defaults, once any is given
    accumulate = given.get("gradient_accumulation_steps", 1)
    rows, steps = given.get("generation_batch_size"), given.get("steps_per_generation")
    for name, value in [("per_device_train_batch_size", per_step), *given.items()]:
        if name in _BATCH and value is not None and (not isinstance(value, int) or value < 1):
            _fail(name, value, "must be a positive integer")
    if rows is not None and steps is not None:
        _fail("generation_batch_size", rows, "and steps_per_generation: give one of them")
    if rows is None:
        steps = steps or accumulate
        rows = per_step * steps
    elif rows % per_step:
        _fail(
            "generation_batch_size",
            rows,
            f"must be a multiple of per_device_train_batch_size {per_step}",
        )
    else:
        steps = rows // per_step
    if rows % generations:
        _fail("generation_batch_size", rows, f"must be a multiple of num_generations {generations}")
    if steps % accumulate:
        _fail(
            "steps_per_generation",
            steps,
            f"must be a multiple of gradient_accumulation_steps {accumulate} (an optimizer step "
            "never spans two rollout batches)",
        )
    return {
        "grpo.num_prompts_per_step": rows // generations,
        "grpo.num_minibatches": steps // accumulate,
        "grpo.num_microbatches": accumulate,
    }


def _per_rollout(name: str, value: Any, num_minibatches: int) -> int:
    """TRL counts optimizer steps, jgrpo rollout batches of num_minibatches optimizer steps."""
    if not isinstance(value, int) or value < 0 or value % num_minibatches:
        _fail(name, value, f"must be a multiple of {num_minibatches} optimizer steps per batch")
    return value // num_minibatches


def _report_keys(value: Any) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value or [])
    names = [] if names == ["none"] else names
    unknown = sorted(set(names) - {"tensorboard", "wandb"})
    if unknown:
        _fail("report_to", value, "may name tensorboard, wandb or none")
    return {"logging.tensorboard": "tensorboard" in names, "logging.wandb": "wandb" in names}


def jgrpo_keys(args: GRPOConfig, base: dict) -> dict[str, Any]:
    """{dotted jgrpo key: value} of the given arguments; `base`: the base config's grpo section
    (its num_generations_per_prompt and num_minibatches, unless the arguments set them)."""
    given = args.given
    keys: dict[str, Any] = {
        given_key: given[name] for name, given_key in _DIRECT.items() if name in given
    }
    if "epsilon" in given and "epsilon_high" not in given:
        keys["loss.ratio_clip_max"] = given["epsilon"]  # TRL: epsilon_high defaults to epsilon
    generations = given.get("num_generations", base.get("num_generations_per_prompt", 8))
    keys |= _batch_keys(given, generations if isinstance(generations, int) else 8)
    k = keys.get("grpo.num_minibatches", base.get("num_minibatches", 1))
    if given.get("max_steps") not in (None, -1):
        keys["grpo.max_num_steps"] = _per_rollout("max_steps", given["max_steps"], k)
    if "save_steps" in given:
        keys["checkpoint.save_period"] = _per_rollout("save_steps", given["save_steps"], k)
    strategy = given.get("eval_strategy")
    if strategy not in (None, "no", "steps"):
        _fail("eval_strategy", strategy, "must be 'no' or 'steps' (jgrpo counts steps, no epochs)")
    if strategy == "no":
        keys |= {"grpo.val_period": 0, "grpo.val_at_start": False, "grpo.val_at_end": False}
    if "eval_steps" in given:
        keys["grpo.val_period"] = _per_rollout("eval_steps", given["eval_steps"], k)
    if "loss_type" in given:
        if given["loss_type"] not in _LOSS_TYPES:
            _fail("loss_type", given["loss_type"], f"must be one of {sorted(_LOSS_TYPES)}")
        keys["loss.aggregation"] = _LOSS_TYPES[given["loss_type"]]
    if "scale_rewards" in given:
        scale = {True: "group", False: "none"}.get(given["scale_rewards"], given["scale_rewards"])
        if scale not in ("group", "none"):
            _fail("scale_rewards", given["scale_rewards"], "must be 'group' or 'none' (no 'batch')")
        keys["grpo.advantage.normalize_rewards"] = scale == "group"
    if "importance_sampling_level" in given:
        level = given["importance_sampling_level"]
        if level not in ("token", "sequence"):
            _fail("importance_sampling_level", level, "must be 'token' or 'sequence'")
        keys["loss.sequence_level_importance_ratios"] = level == "sequence"
    if "lr_scheduler_type" in given:
        if given["lr_scheduler_type"] not in _SCHEDULES:
            _fail(
                "lr_scheduler_type",
                given["lr_scheduler_type"],
                f"must be one of {list(_SCHEDULES)}",
            )
        keys["optim.schedule"] = _SCHEDULES[given["lr_scheduler_type"]]
    keys |= _warmup(given)
    if "max_grad_norm" in given:
        norm = given["max_grad_norm"]
        keys["optim.max_grad_norm"] = None if norm in (0, None) else norm  # TRL: 0 = off
    if "top_k" in given:
        keys["rollout.top_k"] = given["top_k"] or None  # TRL: 0 = off
    if "bf16" in given:
        keys["model.compute_dtype"] = "bfloat16" if given["bf16"] else "float32"
    if "gradient_checkpointing" in given:
        keys["model.remat"] = "full" if given["gradient_checkpointing"] else "none"
    if "report_to" in given:
        keys |= _report_keys(given["report_to"])
    if given.get("num_iterations", 1) != 1:
        _fail(
            "num_iterations",
            given["num_iterations"],
            "must be 1: jgrpo trains on each rollout "
            "batch once (more optimizer steps per batch: steps_per_generation)",
        )
    if given.get("use_vllm", False):
        _fail("use_vllm", True, "is not supported: jgrpo samples with its own JAX sampler")
    if given.get("remove_unused_columns", False):
        _fail("remove_unused_columns", True, "is not supported: every column reaches the rewards")
    if "reward_weights" in given and not isinstance(given["reward_weights"], (list, tuple)):
        _fail("reward_weights", given["reward_weights"], "must be a list, one weight a function")
    return keys


_PEFT_SUPPORTED = {  # attribute: the values jgrpo's adapters implement
    "lora_dropout": (0, 0.0, None),
    "bias": ("none", None),
    "use_rslora": (False, None),
    "use_dora": (False, None),
    "modules_to_save": (None,),
    "layers_to_transform": (None,),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "init_lora_weights": (True, None),
}


def lora_keys(peft_config: Any) -> dict[str, Any]:
    """{dotted key: value} of model.lora from jgrpo's LoRAConfig or a peft.LoraConfig (read by
    attribute: r, lora_alpha, target_modules; what jgrpo's adapters lack is a ConfigError)."""
    if isinstance(peft_config, LoRAConfig):
        return {
            "model.lora.rank": peft_config.rank,
            "model.lora.alpha": peft_config.alpha,
            "model.lora.target_modules": list(peft_config.target_modules),
        }
    if not hasattr(peft_config, "r") or not hasattr(peft_config, "lora_alpha"):
        raise ConfigError(
            f"peft_config: expected a peft.LoraConfig or jgrpo's LoRAConfig, got "
            f"{type(peft_config).__name__}"
        )
    for name, allowed in _PEFT_SUPPORTED.items():
        value = getattr(peft_config, name, None)
        if value not in allowed:
            raise ConfigError(f"peft_config.{name}: {value!r} is not supported by jgrpo's LoRA")
    keys = {"model.lora.rank": peft_config.r, "model.lora.alpha": float(peft_config.lora_alpha)}
    targets = getattr(peft_config, "target_modules", None)
    if isinstance(targets, str) and targets != "all-linear":
        raise ConfigError(f"peft_config.target_modules: {targets!r}: give names or 'all-linear'")
    if targets is None:
        raise ConfigError(
            "peft_config.target_modules: None (peft's per-model guess); name the projections "
            "(e.g. ['q_proj', 'v_proj']) or 'all-linear'"
        )
    every = LoRAConfig().target_modules
    if targets == "all-linear":
        targets = every
    # jgrpo's order, then any other name (model.lora.target_modules' check names it)
    ordered = [t for t in every if t in targets] + sorted(set(targets) - set(every))
    keys["model.lora.target_modules"] = ordered
    return keys


# ----------------------------------------------------------------------------- SFT

_SFT_DIRECT = {
    "learning_rate": "optim.learning_rate",
    "weight_decay": "optim.weight_decay",
    "adam_beta1": "optim.b1",
    "adam_beta2": "optim.b2",
    "adam_epsilon": "optim.eps",
    "warmup_steps": "optim.warmup_steps",
    "seed": "sft.seed",
    "max_length": "sft.max_seq_length",
    "max_steps": "sft.max_num_steps",
    "packing": "sft.sequence_packing",
    "save_steps": "checkpoint.save_period",
    "eval_steps": "sft.val_period",
    "save_total_limit": "checkpoint.keep_last",
}
"""TRL SFTConfig names whose value is jgrpo's key's value as is."""
_SFT_OTHER = (
    "output_dir",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "lr_scheduler_type",
    "max_grad_norm",
    "bf16",
    "gradient_checkpointing",
    "report_to",
    "eval_strategy",
    "assistant_only_loss",
    "completion_only_loss",
)
SFT_SUPPORTED = (*_SFT_DIRECT, *_SFT_OTHER)
"""Every TRL argument name SFTConfig accepts."""
_SFT_UNSUPPORTED = {
    "num_train_epochs": "jgrpo counts steps: give max_steps",
    "dataset_text_field": "jgrpo trains on messages or prompt/completion records (docs/sft.md)",
    "fp16": "jgrpo computes in float32 or bfloat16 (bf16=True)",
    "padding_free": "give packing=True (jgrpo packs rows without padding between them)",
    "loss_type": "jgrpo's SFT loss is the token-mean NLL (TRL's default 'nll')",
}


class SFTConfig:
    """TRL-named SFT arguments for `jgrpo.SFTTrainer` (docs/sft.md has the table); read back
    any given one as an attribute (None when not given). An argument left out keeps jgrpo's
    value, never TRL's default."""

    def __init__(self, **kwargs: Any):
        check_names("SFTConfig", kwargs, SFT_SUPPORTED, _SFT_UNSUPPORTED, "docs/sft.md")
        object.__setattr__(self, "given", dict(kwargs))
        sft_keys(self)  # every value error now, where the user wrote it

    def __getattr__(self, name: str) -> Any:
        if name in SFT_SUPPORTED:
            return self.__dict__["given"].get(name)
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"SFTConfig({', '.join(f'{k}={v!r}' for k, v in self.given.items())})"


def sft_keys(args: SFTConfig) -> dict[str, Any]:
    """{dotted jgrpo key: value} of the given SFT arguments (TRL's batch arithmetic: a step is
    per_device_train_batch_size x gradient_accumulation_steps records on all devices)."""
    given = args.given

    def fail(name: str, why: str, value: Any = None) -> None:
        raise ConfigError(f"SFTConfig.{name}: {given.get(name, value)!r} {why}")

    keys = {key: given[name] for name, key in _SFT_DIRECT.items() if name in given}
    if "per_device_train_batch_size" in given or "gradient_accumulation_steps" in given:
        per_step = given.get("per_device_train_batch_size", 8)
        accumulate = given.get("gradient_accumulation_steps", 1)
        for name, value in (
            ("per_device_train_batch_size", per_step),
            ("gradient_accumulation_steps", accumulate),
        ):
            if not isinstance(value, int) or value < 1:
                fail(name, "must be a positive integer", value)
        keys |= {"sft.batch_size": per_step * accumulate, "sft.num_microbatches": accumulate}
    for name in ("assistant_only_loss", "completion_only_loss"):
        if given.get(name) is False:
            fail(name, "is not supported: jgrpo trains on the assistant (completion) tokens only")
    if given.get("eval_strategy") not in (None, "no", "steps"):
        fail("eval_strategy", "must be 'no' or 'steps' (jgrpo counts steps, no epochs)")
    if given.get("eval_strategy") == "no":
        keys |= {"sft.val_period": 0, "sft.val_at_end": False}
    if "lr_scheduler_type" in given:
        if given["lr_scheduler_type"] not in _SCHEDULES:
            fail("lr_scheduler_type", f"must be one of {list(_SCHEDULES)}")
        keys["optim.schedule"] = _SCHEDULES[given["lr_scheduler_type"]]
    keys |= _warmup(given)
    if "max_grad_norm" in given:
        norm = given["max_grad_norm"]
        keys["optim.max_grad_norm"] = None if norm in (0, None) else norm
    if "bf16" in given:
        keys["model.compute_dtype"] = "bfloat16" if given["bf16"] else "float32"
    if "gradient_checkpointing" in given:
        keys["model.remat"] = "full" if given["gradient_checkpointing"] else "none"
    if "report_to" in given:
        names = [given["report_to"]] if isinstance(given["report_to"], str) else given["report_to"]
        names = [] if list(names or []) == ["none"] else list(names or [])
        if set(names) - {"tensorboard", "wandb"}:
            fail("report_to", "may name tensorboard, wandb or none")
        keys |= {"logging.tensorboard": "tensorboard" in names, "logging.wandb": "wandb" in names}
    return keys
