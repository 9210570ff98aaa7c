"""The one config tree of a jgrpo run: frozen dataclasses, YAML + dotted overrides, validation.

Every section is a ``@dataclass(frozen=True, kw_only=True)`` whose fields carry a one-line
docstring directly under them (read back by :func:`field_docs` for ``--show-config``).
Defaults are right for a real run; tiny sizes live in ``configs/tiny*.yaml``.

Loading goes ``load_config(path, overrides)`` -> ``from_dict`` (types, unknown keys, choices)
-> ``validate`` (cross-field rules of docs/losses.md). Every failure raises :class:`ConfigError`
with one line naming the dotted key and what is allowed; nothing heavy is imported here, so
the CLI can reject bad input before any model or worker starts.

Derived values (``skip_prev``, ``skip_ref``, batch sizes) are properties, never fields.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import math
import textwrap
import types
import typing
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml


class ConfigError(ValueError):
    """Invalid configuration: the message is one line naming the dotted key."""


_FROZEN = dict(frozen=True, kw_only=True)


LoRATarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclasses.dataclass(**_FROZEN)
class LoRAConfig:
    """LoRA: train low-rank adapters of the projections; the base stays frozen (and is the
    reference policy: the forward without adapters)."""

    rank: int = 0
    """r: adapter rank (0 = off: full fine-tuning)."""
    alpha: float = 16.0
    """Adapter updates are scaled by alpha / rank (PEFT's lora_alpha)."""
    target_modules: tuple[LoRATarget, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    """Projections (PEFT/HF module names) that get adapters; default all attention and MLP."""


@dataclasses.dataclass(**_FROZEN)
class ModelConfig:
    """The policy model (and its reference copy)."""

    path: str = "builtin:tiny-qwen2"
    """HF folder, `smollm2` (converted SmolLM2-135M-Instruct) or `builtin:tiny-qwen2`."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter (master weight) dtype: float32 = 4 bytes/param, bfloat16 (pure bf16) = 2."""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Activation/matmul dtype; auto = bfloat16 on GPU/TPU or with dtype bfloat16, else float32."""
    remat: Literal["none", "full", "dots"] = "full"
    """Layer recompute in the backward: full keeps layer inputs only, dots also matmul outputs."""
    logprob_chunk_size: int = 128
    """Tokens (along T) per LM-head + log-softmax chunk: memory rows x chunk x vocab x 4 bytes."""
    kernels: Literal["auto", "cpu", "portable"] = "auto"
    """Platform kernels (jgrpo.models.kernels): auto = cpu on the CPU backend, else portable."""
    lora: LoRAConfig = LoRAConfig()
    """LoRA adapters (rank 0 = off); adapters are float32, the base keeps model.dtype."""

    def resolved_compute_dtype(self, platform: str) -> str:
        """The compute dtype on `platform` (jax.default_backend(): cpu | gpu | tpu | ...)."""
        if self.compute_dtype != "auto":
            return self.compute_dtype
        if self.dtype == "bfloat16" or platform != "cpu":
            return "bfloat16"
        return "float32"


@dataclasses.dataclass(**_FROZEN)
class RewardFunctionConfig:
    """One weighted reward term (see `jgrpo.tasks.rewards` for the signature and None rule)."""

    function: Union[str, Callable[..., Any]]
    """`module:function` (or, from Python, the function): fn(prompts, completions, **columns)."""
    weight: float = 1.0
    """Multiplier of this term in the total reward."""
    name: Optional[str] = None
    """Metric name (`reward/<name>/mean`); None = the function's name."""
    per_sample: bool = False
    """Old form: fn(prompt, completion, example) -> float, called once per sample."""

    @property
    def label(self) -> str:
        """The metric name: `name`, else the function's __name__ (the part after `:`)."""
        if self.name:
            return self.name
        if isinstance(self.function, str):
            return self.function.rpartition(":")[2].rpartition(".")[2]
        return getattr(self.function, "__name__", type(self.function).__name__)


@dataclasses.dataclass(**_FROZEN)
class DataConfig:
    """The task: where prompts come from and how completions are scored."""

    task: Literal["arithmetic", "countdown", "gsm8k", "prompts"] = "arithmetic"
    """Built-in task, or `prompts`: your dataset's prompt column scored by reward_functions."""
    train_path: Optional[str] = None
    """A JSONL/JSON/Parquet/CSV file, datasets folder or cached HF dataset id; None = generated."""
    val_path: Optional[str] = None
    """Held-out set in the same formats; None = a seeded synthetic set or a split of train."""
    prompt_key: str = "prompt"
    """Task prompts: column holding a prompt string or a list of chat messages."""
    num_val_examples: int = 200
    """Held-out examples used for validation accuracy."""
    question_key: str = "question"
    """Field of a record holding the question (gsm8k / file data)."""
    answer_key: str = "answer"
    """Field of a record holding the reference answer."""
    num_terms: int = 2
    """Arithmetic: operands per expression."""
    max_operand: int = 99
    """Arithmetic: operands are drawn from [0, max_operand]."""
    operators: str = "+-"
    """Arithmetic: characters drawn as operators, a subset of `+-*`."""
    countdown_num_numbers: int = 3
    """Countdown: how many source numbers per puzzle."""
    use_chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template when it has one."""
    system_prompt: Optional[str] = None
    """Optional system message for chat prompts."""
    reward_functions: tuple[RewardFunctionConfig, ...] = ()
    """Extra weighted reward terms added to the task's own verifier reward."""
    task_reward_weight: float = 1.0
    """Weight of the built-in task verifier's reward (0 = only custom rewards)."""
    reward_timeout_s: float = 5.0
    """A reward call running past this scores 0 and is counted in metrics."""
    reward_import_timeout_s: float = 60.0
    """Importing the reward functions at start-up may take this long (then a ConfigError)."""
    shuffle: bool = True
    """Reshuffle training examples every epoch (seeded by grpo.seed)."""


@dataclasses.dataclass(**_FROZEN)
class AdvantageConfig:
    """How rewards become advantages (docs/losses.md, Advantages)."""

    estimator: Literal["grpo", "dr_grpo", "reinforce_plus_plus"] = "grpo"
    """grpo: group baseline (+ std); dr_grpo: no std; reinforce_plus_plus: global whitening."""
    normalize_rewards: bool = True
    """grpo: divide by the Bessel std + 1e-6 (leave-one-out: the others' std; 0 = no division)."""
    use_leave_one_out_baseline: bool = False
    """Baseline is the mean of the other group members instead of the whole group."""
    advantage_clip_low: Optional[float] = None
    """Lower clamp on advantages (None = off)."""
    advantage_clip_high: Optional[float] = None
    """Upper clamp on advantages (None = off)."""


@dataclasses.dataclass(**_FROZEN)
class GRPOConfig:
    """The outer GRPO loop."""

    num_prompts_per_step: int = 32
    """P: prompts per rollout batch."""
    num_generations_per_prompt: int = 8
    """G: completions per prompt (group size)."""
    max_num_steps: int = 100
    """Training steps (one rollout batch each)."""
    num_minibatches: int = 1
    """Optimizer steps per rollout batch (>1 = off-policy updates against prev logprobs)."""
    num_microbatches: int = 1
    """Gradient-accumulation chunks per optimizer step (does not change the math)."""
    val_period: int = 10
    """Validate every this many steps (0 = off)."""
    val_at_start: bool = True
    """Validate before the first step."""
    val_at_end: bool = True
    """Validate after the last step."""
    val_pass_k: int = 1
    """k of pass@k at validation (1 = greedy accuracy)."""
    seed: int = 42
    """Seeds data order, sampling and init."""
    seq_logprob_error_threshold: Optional[float] = None
    """Mask rows whose sequence logprob error e_b exceeds this (None = off)."""
    skip_reference_policy_logprobs_calculation: bool = False
    """Explicitly skip the reference forward (requires loss.reference_policy_kl_penalty == 0)."""
    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage estimator."""

    @property
    def batch_size(self) -> int:
        """B = P x G rows per rollout batch."""
        return self.num_prompts_per_step * self.num_generations_per_prompt


@dataclasses.dataclass(**_FROZEN)
class LossConfig:
    """The clipped policy-gradient loss (docs/losses.md; NeMo-RL ClippedPGLossFn names)."""

    ratio_clip_min: float = 0.2
    """eps_low: r is clipped below at 1 - ratio_clip_min."""
    ratio_clip_max: float = 0.2
    """eps_high: r is clipped above at 1 + ratio_clip_max."""
    ratio_clip_c: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages (None = off)."""
    disable_ppo_ratio: bool = False
    """REINFORCE: the surrogate is -A * logprob, no ratio."""
    force_on_policy_ratio: bool = False
    """Ratio = exp(lp - stop_grad(lp)); the prev forward is dropped from the step."""
    sequence_level_importance_ratios: bool = False
    """GSPO: one ratio per row from the mean token log-ratio (and a per-row IS weight)."""
    aggregation: Literal["token_mean", "seq_mean", "seq_sum_norm"] = "token_mean"
    """token_mean: / N_tok; seq_mean: per-row mean then / N_seq; seq_sum_norm: / (N_seq * S_max)."""
    generation_budget: Optional[int] = None
    """S_max of seq_sum_norm (null = rollout.max_new_tokens, filled in by the train step)."""
    reference_policy_kl_penalty: float = 0.0
    """beta: weight of the KL penalty to the reference (0 = no reference forward)."""
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    kl_input_clamp_value: Optional[float] = 20.0
    """Clamp of x = lr - lp before the estimator (None = off)."""
    kl_output_clamp_value: Optional[float] = 10.0
    """Clamp of the per-token KL value (None = off)."""
    use_on_policy_kl_approximation: bool = False
    """Weight the KL by exp(lp - lg) (with gradient) before the output clamp, not by 1."""
    use_kl_in_reward: bool = False
    """reinforce_plus_plus: subtract beta * KL from the token rewards; loss beta becomes 0."""
    use_importance_sampling_correction: bool = False
    """Weight tokens by exp(lo - lg) against the sampler's logprobs (required in async mode)."""
    truncated_importance_sampling_type: Optional[Literal["tis", "icepop", "seq-mask-tis"]] = None
    """Truncation of the IS weight (None = none)."""
    truncated_importance_sampling_ratio: Optional[float] = None
    """Upper bound of the IS weight for truncation."""
    truncated_importance_sampling_ratio_min: Optional[float] = None
    """Lower bound of the IS weight for truncation (None = 0)."""


@dataclasses.dataclass(**_FROZEN)
class OptimConfig:
    """AdamW with a schedule and global-norm clipping."""

    learning_rate: float = 1e-6
    """Peak learning rate."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warmup, over grpo.max_num_steps * grpo.num_minibatches updates."""
    warmup_steps: int = 0
    """Linear warmup updates."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    b1: float = 0.9
    """Adam beta1."""
    b2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    max_grad_norm: Optional[float] = 1.0
    """Global gradient-norm clip (None = off)."""


@dataclasses.dataclass(**_FROZEN)
class RolloutConfig:
    """Generation: sampler settings and where it runs."""

    backend: Literal["local", "ray"] = "local"
    """local: in-process sampler on the trainer's params; ray: RolloutWorker actors."""
    num_workers: int = 1
    """Ray: RolloutWorker actors."""
    max_staleness: int = 0
    """0 = sync (on-policy); k >= 1 = async, batches at most k weight versions old."""
    ray_address: Optional[str] = None
    """Ray cluster to join (None = start a quiet local one)."""
    max_worker_failures: int = 3
    """Ray: worker restarts allowed before the run stops (after a checkpoint)."""
    num_cpus_per_worker: Optional[float] = None
    """Ray: CPUs reserved per RolloutWorker (None = the cluster's CPUs shared out)."""
    num_gpus_per_worker: Optional[float] = None
    """Ray: GPUs per RolloutWorker, fractional allowed (None = the cluster's GPUs shared out)."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy); training logits are divided by it too."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: Optional[int] = None
    """Keep the k most likely tokens (None = off)."""
    max_new_tokens: int = 256
    """Completion length cap; rows hitting it are truncated."""
    prompt_bucket: int = 32
    """Prompt lengths are padded up to a multiple of this (fewer recompiles)."""


@dataclasses.dataclass(**_FROZEN)
class MeshConfig:
    """Device mesh and the logical -> mesh axis rules."""

    data: int = -1
    """Data-parallel axis size (-1 = the remaining devices)."""
    fsdp: int = 1
    """Fully-sharded axis size: parameters and optimizer state are split over it."""
    tensor: int = 1
    """Tensor-parallel axis size (heads, mlp, vocab)."""
    rules: tuple[tuple[str, Optional[str]], ...] = ()
    """Overrides of the logical-axis rules, e.g. [[embed, null]]."""


@dataclasses.dataclass(**_FROZEN)
class CheckpointConfig:
    """Orbax checkpoints of the whole run state."""

    save_period: int = 0
    """Save every this many steps (0 = off)."""
    keep_last: int = 3
    """Checkpoints kept; older ones are deleted."""
    export_hf: bool = False
    """Also write the policy as an HF folder RUN_DIR/hf/step_<N>/ at each checkpoint."""


@dataclasses.dataclass(**_FROZEN)
class LoggingConfig:
    """Metric sinks."""

    tensorboard: bool = True
    """Write TensorBoard events to RUN_DIR/tb."""
    wandb: bool = False
    """Log to Weights & Biases (only when installed)."""
    wandb_project: str = "jgrpo"
    """W&B project name."""
    progress_bar: bool = True
    """Show a progress bar on stderr."""
    plot: bool = True
    """Write PNG curves at the end of the run."""
    num_samples: int = 4
    """Prompt/completion/reward rows per step to RUN_DIR/samples.jsonl and TB/W&B (0 = off)."""


@dataclasses.dataclass(**_FROZEN)
class Config:
    """A whole jgrpo run."""

    model: ModelConfig = ModelConfig()
    """Policy model."""
    data: DataConfig = DataConfig()
    """Task and rewards."""
    grpo: GRPOConfig = GRPOConfig()
    """GRPO loop."""
    loss: LossConfig = LossConfig()
    """Policy loss."""
    optim: OptimConfig = OptimConfig()
    """Optimizer."""
    rollout: RolloutConfig = RolloutConfig()
    """Generation."""
    mesh: MeshConfig = MeshConfig()
    """Devices."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoints."""
    logging: LoggingConfig = LoggingConfig()
    """Metric sinks."""

    @property
    def skip_prev(self) -> bool:
        """The prev-logprob forward is absent (docs/losses.md: the threshold needs real lo)."""
        return self.loss.force_on_policy_ratio and self.grpo.seq_logprob_error_threshold is None

    @property
    def skip_ref(self) -> bool:
        """The reference forward is absent: no KL penalty (or an explicit skip)."""
        return (
            self.loss.reference_policy_kl_penalty == 0.0
            or self.grpo.skip_reference_policy_logprobs_calculation
        )

    def replace(self, **kw) -> Config:
        return dataclasses.replace(self, **kw)


# ----------------------------------------------------------------------------- building


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _closest(key: str, allowed: list[str]) -> str:
    match = difflib.get_close_matches(key, allowed, n=1, cutoff=0.5)
    return f"did you mean `{match[0]}`?" if match else f"allowed: {', '.join(sorted(allowed))}"


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp`, converting YAML scalars where lossless."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: invalid value {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, choices))}"
            )
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(tp, type) and isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be finite, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if tp is Callable or origin is Callable:
        if not callable(value):
            raise ConfigError(f"{key}: expected a function, got {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} at {key}")


def from_dict(cls, data: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key `{dotted}`; {_closest(str(key), names)}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    for f in dataclasses.fields(cls):
        if f.name not in kwargs and f.default is dataclasses.MISSING:
            if f.default_factory is dataclasses.MISSING:
                dotted = f"{prefix}.{f.name}" if prefix else f.name
                raise ConfigError(f"{dotted}: required key is missing")
    return cls(**kwargs)


def to_dict(cfg: Any) -> Any:
    """Plain nested dict/list form of a config (what is saved with every run)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    if callable(cfg):  # a reward function given from Python: saved as its import path
        return f"{getattr(cfg, '__module__', '?')}:{getattr(cfg, '__qualname__', repr(cfg))}"
    return cfg


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override `{item}`: expected dotted.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override `{item}`: expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"override `{key}`: cannot parse value {raw!r}") from None
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set `a.b.c=value` items (values parsed as YAML) into a nested dict copy."""
    data = yaml.safe_load(yaml.safe_dump(data)) or {}
    for item in overrides:
        parts, value = _parse_override(item)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override `{item}`: `{'.'.join(parts[: i + 1])}` is not a section"
                )
            node = child
        node[parts[-1]] = value
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that rejects a key repeated in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: the base class reports it
                    break
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path, what: str = "config file") -> Any:
    """Parse YAML file `path` strictly: UTF-8, no duplicate keys; ConfigError naming the file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a folder, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{what} {str(path)!r} cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what} {str(path)!r} is not UTF-8 text (byte {e.start}); is it a binary file?"
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None)
        detail = f": {problem}" if problem and "duplicate key" in problem else ""
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML{where}{detail}") from None


def read_json(path: str | Path, key: str, kind: type | None = dict) -> Any:
    """Parse the small JSON file `path` (a model or dataset metadata file); ConfigError
    `key: 'path' ...` when it is unreadable, not UTF-8, not JSON or (with `kind`) not a `kind`."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{key}: {str(path)!r} cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {str(path)!r} is not UTF-8 text (a binary file?)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{key}: {str(path)!r} is not valid JSON (line {e.lineno}: {e.msg})"
        ) from None
    if kind is not None and not isinstance(data, kind):
        what = {dict: "a JSON object", list: "a JSON list"}.get(kind, kind.__name__)
        raise ConfigError(f"{key}: {str(path)!r} must hold {what}, got {type(data).__name__}")
    return data


def load_config(path: Optional[str | Path] = None, overrides: list[str] = ()) -> Config:
    """Read YAML `path` (None = defaults), apply dotted overrides, build and validate."""
    data: dict = {}
    if path is not None:
        data = read_yaml(path)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r}: expected a mapping at the top level")
    data = apply_overrides(data, list(overrides))
    cfg = from_dict(Config, data)
    validate(cfg)
    return cfg


# ----------------------------------------------------------------------------- validation


MAX_SEED = 2**32 - 1
"""grpo.seed: numpy and jax seeds are 32-bit."""
MAX_OPERAND = 10**9
"""data.max_operand: arithmetic prompts stay short and exact in int64."""
MAX_SEQUENCE = 2**17
"""rollout.prompt_bucket, rollout.max_new_tokens and their sum (131072 tokens)."""
MAX_BATCH_ROWS = 2**16
"""P x G rows of one rollout batch."""
MAX_BATCH_TOKENS = 2**27
"""P x G x (prompt_bucket + max_new_tokens): 0.5 GiB per int32 array of the batch."""
MAX_VAL_EXAMPLES = 100_000
"""data.num_val_examples."""


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def validate(cfg: Config) -> Config:
    """Cross-field rules of docs/losses.md and range checks; raises ConfigError."""
    g, loss, adv, ro, opt = cfg.grpo, cfg.loss, cfg.grpo.advantage, cfg.rollout, cfg.optim
    for key, value in [
        ("grpo.num_prompts_per_step", g.num_prompts_per_step),
        ("grpo.num_generations_per_prompt", g.num_generations_per_prompt),
        ("grpo.max_num_steps", g.max_num_steps),
        ("grpo.num_minibatches", g.num_minibatches),
        ("grpo.num_microbatches", g.num_microbatches),
        ("grpo.val_pass_k", g.val_pass_k),
        ("rollout.num_workers", ro.num_workers),
        ("rollout.max_new_tokens", ro.max_new_tokens),
        ("rollout.prompt_bucket", ro.prompt_bucket),
        ("checkpoint.keep_last", cfg.checkpoint.keep_last),
        ("data.num_val_examples", cfg.data.num_val_examples),
        ("data.num_terms", cfg.data.num_terms),
        ("data.countdown_num_numbers", cfg.data.countdown_num_numbers),
        ("model.logprob_chunk_size", cfg.model.logprob_chunk_size),
    ]:
        _require(value >= 1, f"{key}: must be >= 1, got {value}")
    for key, value in [
        ("grpo.val_period", g.val_period),
        ("checkpoint.save_period", cfg.checkpoint.save_period),
        ("rollout.max_staleness", ro.max_staleness),
        ("rollout.max_worker_failures", ro.max_worker_failures),
        ("optim.warmup_steps", opt.warmup_steps),
        ("data.max_operand", cfg.data.max_operand),
    ]:
        _require(value >= 0, f"{key}: must be >= 0, got {value}")
    # upper bounds: values past these are typos that would exhaust memory or time, not runs
    for key, value, high in [
        ("grpo.seed", g.seed, MAX_SEED),
        ("data.max_operand", cfg.data.max_operand, MAX_OPERAND),
        ("data.num_terms", cfg.data.num_terms, 64),
        ("data.countdown_num_numbers", cfg.data.countdown_num_numbers, 16),
        ("data.num_val_examples", cfg.data.num_val_examples, MAX_VAL_EXAMPLES),
        ("rollout.prompt_bucket", ro.prompt_bucket, MAX_SEQUENCE),
        ("rollout.max_new_tokens", ro.max_new_tokens, MAX_SEQUENCE),
        ("grpo.num_prompts_per_step", g.num_prompts_per_step, MAX_BATCH_ROWS),
        ("grpo.num_generations_per_prompt", g.num_generations_per_prompt, MAX_BATCH_ROWS),
        ("grpo.val_pass_k", g.val_pass_k, 1024),
        ("rollout.num_workers", ro.num_workers, 4096),
    ]:
        _require(value <= high, f"{key}: must be <= {high}, got {value}")
    _require(g.seed >= 0, f"grpo.seed: must be >= 0, got {g.seed}")
    seq = ro.prompt_bucket + ro.max_new_tokens
    _require(
        seq <= MAX_SEQUENCE,
        f"rollout.prompt_bucket + rollout.max_new_tokens: must be <= {MAX_SEQUENCE}, got {seq}",
    )
    _require(
        g.batch_size <= MAX_BATCH_ROWS,
        f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt: must be <= "
        f"{MAX_BATCH_ROWS} rows, got {g.batch_size}",
    )
    _require(
        g.batch_size * seq <= MAX_BATCH_TOKENS,
        f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt x (rollout.prompt_bucket "
        f"+ rollout.max_new_tokens): must be <= {MAX_BATCH_TOKENS} tokens, got "
        f"{g.batch_size * seq}",
    )
    _require(
        set(cfg.data.operators) <= set("+-*") and cfg.data.operators != "",
        f"data.operators: {cfg.data.operators!r} must be a non-empty subset of '+-*'",
    )
    _require(cfg.data.reward_timeout_s > 0, "data.reward_timeout_s: must be > 0")
    _require(cfg.data.reward_import_timeout_s > 0, "data.reward_import_timeout_s: must be > 0")
    _require(cfg.logging.num_samples >= 0, "logging.num_samples: must be >= 0")
    labels: set[str] = set()
    for i, rf in enumerate(cfg.data.reward_functions):
        if isinstance(rf.function, str):
            _require(
                ":" in rf.function and all(rf.function.split(":", 1)),
                f"data.reward_functions[{i}].function: {rf.function!r} must look like "
                "module:function",
            )
        _require(
            rf.label not in labels,
            f"data.reward_functions[{i}].name: {rf.label!r} names two reward functions; "
            "set a distinct name",
        )
        labels.add(rf.label)
    _require(
        g.batch_size % g.num_minibatches == 0,
        f"grpo.num_minibatches: {g.num_minibatches} must divide the rollout batch "
        f"P x G = {g.batch_size}",
    )
    _require(
        (g.batch_size // g.num_minibatches) % g.num_microbatches == 0,
        f"grpo.num_microbatches: {g.num_microbatches} must divide the minibatch of "
        f"{g.batch_size // g.num_minibatches} rows",
    )
    _require(
        g.num_generations_per_prompt >= 2 or adv.estimator == "reinforce_plus_plus",
        "grpo.num_generations_per_prompt: group baselines need at least 2 generations",
    )
    _require(
        g.val_pass_k == 1 or ro.temperature > 0,
        "grpo.val_pass_k: pass@k with k > 1 needs rollout.temperature > 0",
    )
    if g.seq_logprob_error_threshold is not None:
        _require(
            g.seq_logprob_error_threshold >= 1.0,
            "grpo.seq_logprob_error_threshold: must be >= 1.0 (e_b >= 1 always) or null",
        )

    # loss ranges
    _require(0 <= loss.ratio_clip_min < 1, "loss.ratio_clip_min: must lie in [0, 1)")
    _require(loss.ratio_clip_max >= 0, "loss.ratio_clip_max: must be >= 0")
    _require(
        loss.ratio_clip_c is None or loss.ratio_clip_c > 1,
        "loss.ratio_clip_c: the dual-clip constant must be > 1 (or null)",
    )
    _require(
        loss.reference_policy_kl_penalty >= 0, "loss.reference_policy_kl_penalty: must be >= 0"
    )
    for key in ("kl_input_clamp_value", "kl_output_clamp_value"):
        value = getattr(loss, key)
        _require(value is None or value > 0, f"loss.{key}: must be > 0 (or null)")
    _require(
        loss.generation_budget is None or loss.generation_budget >= 1,
        f"loss.generation_budget: must be >= 1 (or null), got {loss.generation_budget}",
    )
    _require(
        not (loss.disable_ppo_ratio and loss.force_on_policy_ratio),
        "loss.disable_ppo_ratio and loss.force_on_policy_ratio: choose at most one",
    )
    _require(
        not (loss.sequence_level_importance_ratios and loss.aggregation == "token_mean"),
        "loss.sequence_level_importance_ratios (GSPO): needs loss.aggregation seq_mean or "
        "seq_sum_norm, not token_mean",
    )
    _require(
        not (loss.sequence_level_importance_ratios and loss.force_on_policy_ratio),
        "loss.sequence_level_importance_ratios: incompatible with loss.force_on_policy_ratio",
    )
    _require(
        not (
            loss.sequence_level_importance_ratios
            and loss.truncated_importance_sampling_type == "seq-mask-tis"
        ),
        "loss.truncated_importance_sampling_type: seq-mask-tis is incompatible with "
        "loss.sequence_level_importance_ratios (GSPO truncates its per-row weight with tis or "
        "icepop)",
    )
    if loss.truncated_importance_sampling_type is not None:
        _require(
            loss.use_importance_sampling_correction,
            "loss.truncated_importance_sampling_type: needs "
            "loss.use_importance_sampling_correction=true",
        )
        _require(
            loss.truncated_importance_sampling_ratio is not None,
            "loss.truncated_importance_sampling_ratio: required when "
            "loss.truncated_importance_sampling_type is set",
        )
    hi, lo = loss.truncated_importance_sampling_ratio, loss.truncated_importance_sampling_ratio_min
    _require(hi is None or hi > 0, "loss.truncated_importance_sampling_ratio: must be > 0")
    _require(lo is None or lo >= 0, "loss.truncated_importance_sampling_ratio_min: must be >= 0")
    _require(
        hi is None or lo is None or lo <= hi,
        f"loss.truncated_importance_sampling_ratio_min ({lo}) must be <= "
        f"loss.truncated_importance_sampling_ratio ({hi})",
    )

    # advantages
    clo, chi = adv.advantage_clip_low, adv.advantage_clip_high
    _require(
        clo is None or chi is None or clo < chi,
        f"grpo.advantage.advantage_clip_low ({clo}) must be < advantage_clip_high ({chi})",
    )
    if loss.use_kl_in_reward:
        _require(
            adv.estimator == "reinforce_plus_plus",
            f"loss.use_kl_in_reward: only grpo.advantage.estimator=reinforce_plus_plus uses "
            f"it; {adv.estimator!r} would silently drop the KL",
        )
        _require(
            loss.reference_policy_kl_penalty > 0,
            "loss.use_kl_in_reward: needs loss.reference_policy_kl_penalty > 0",
        )
        _require(
            not cfg.skip_prev,
            "loss.use_kl_in_reward: incompatible with loss.force_on_policy_ratio (the prev "
            "forward is skipped, the KL would use a placeholder)",
        )

    # the skip flags
    if g.skip_reference_policy_logprobs_calculation:
        _require(
            loss.reference_policy_kl_penalty == 0,
            "grpo.skip_reference_policy_logprobs_calculation: requires "
            "loss.reference_policy_kl_penalty == 0",
        )
    if loss.force_on_policy_ratio:
        _require(
            g.num_minibatches == 1,
            "loss.force_on_policy_ratio: requires exactly one optimizer step per rollout "
            f"batch (grpo.num_minibatches=1, got {g.num_minibatches})",
        )
        _require(
            ro.max_staleness == 0,
            "loss.force_on_policy_ratio: incompatible with rollout.max_staleness > 0",
        )
        if g.seq_logprob_error_threshold is not None:
            warnings.warn(
                "loss.force_on_policy_ratio with grpo.seq_logprob_error_threshold: the threshold "
                "needs real prev logprobs, so the prev forward is computed anyway",
                stacklevel=2,
            )

    # rollout
    for key in ("num_cpus_per_worker", "num_gpus_per_worker"):
        value = getattr(ro, key)
        _require(value is None or value >= 0, f"rollout.{key}: must be >= 0 (or null)")
    _require(ro.temperature >= 0, "rollout.temperature: must be >= 0")
    _require(0 < ro.top_p <= 1, "rollout.top_p: must lie in (0, 1]")
    _require(ro.top_k is None or ro.top_k >= 1, "rollout.top_k: must be >= 1 (or null)")
    if ro.max_staleness > 0:
        _require(
            loss.use_importance_sampling_correction,
            "rollout.max_staleness > 0 (async): requires "
            "loss.use_importance_sampling_correction=true",
        )
    _require(
        ro.backend == "ray" or ro.max_staleness == 0,
        "rollout.max_staleness > 0: async generation needs rollout.backend=ray",
    )
    _require(
        ro.backend == "ray" or ro.num_workers == 1,
        "rollout.num_workers: > 1 needs rollout.backend=ray",
    )

    # optimizer
    _require(opt.learning_rate > 0, "optim.learning_rate: must be > 0")
    _require(0 <= opt.b1 < 1 and 0 <= opt.b2 < 1, "optim.b1 / optim.b2: must lie in [0, 1)")
    _require(opt.eps > 0, "optim.eps: must be > 0")
    _require(opt.weight_decay >= 0, "optim.weight_decay: must be >= 0")
    _require(
        opt.max_grad_norm is None or opt.max_grad_norm > 0,
        "optim.max_grad_norm: must be > 0 (or null)",
    )

    # LoRA
    lo = cfg.model.lora
    _require(lo.rank >= 0, f"model.lora.rank: must be >= 0 (0 = off), got {lo.rank}")
    _require(lo.alpha > 0, f"model.lora.alpha: must be > 0, got {lo.alpha}")
    _require(
        lo.rank == 0 or len(lo.target_modules) > 0,
        "model.lora.target_modules: needs at least one module when model.lora.rank > 0",
    )
    _require(
        len(set(lo.target_modules)) == len(lo.target_modules),
        f"model.lora.target_modules: {list(lo.target_modules)} names a module twice",
    )

    # mesh
    for key in ("data", "fsdp", "tensor"):
        value = getattr(cfg.mesh, key)
        _require(value == -1 or value >= 1, f"mesh.{key}: must be >= 1 or -1, got {value}")
    _require(
        [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor].count(-1) <= 1,
        "mesh: at most one of mesh.data / mesh.fsdp / mesh.tensor may be -1",
    )
    return cfg


# ----------------------------------------------------------------------------- resume

RESUME_MAY_CHANGE = (
    "grpo.max_num_steps",
    "grpo.val_period",
    "grpo.val_at_start",
    "grpo.val_at_end",
    "grpo.num_microbatches",
    "data.reward_timeout_s",
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


# ----------------------------------------------------------------------------- docs


def field_docs(cls) -> dict[str, str]:
    """The one-line docstrings under each field of dataclass `cls`, by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = nxt.value.value.strip()
    return docs


def format_config(cfg: Any, indent: int = 0) -> str:
    """YAML-like text of the resolved tree with each field's doc as a comment."""
    lines = []
    docs = field_docs(type(cfg))
    pad = "  " * indent
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        doc = docs.get(f.name, "")
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{f.name}:  # {doc}")
            lines.append(format_config(value, indent + 1))
        else:
            text = yaml.safe_dump(to_dict(value), default_flow_style=True).strip()
            text = text.removesuffix("...").strip()
            lines.append(f"{pad}{f.name}: {text}  # {doc}")
    return "\n".join(lines)
