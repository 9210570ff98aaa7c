"""The schema of a jgrpo run: the frozen, documented dataclass sections and ConfigError.

Every section is a ``@dataclass(frozen=True, kw_only=True)`` whose fields carry a one-line
docstring directly under them (read back by ``jgrpo.config.field_docs`` for
``--show-config``). Defaults are right for a real run; tiny sizes live in
``configs/tiny*.yaml``. Derived values (``skip_prev``, ``skip_ref``, batch sizes) are
properties, never fields. Cross-field rules live in ``jgrpo.config.rules``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Optional, Union

from jgrpo.config.model_sections import FROZEN as _FROZEN
from jgrpo.config.model_sections import LoRAConfig as LoRAConfig  # the model section, re-exported
from jgrpo.config.model_sections import LoRATarget as LoRATarget
from jgrpo.config.model_sections import ModelConfig as ModelConfig
from jgrpo.config.model_sections import MoEConfig as MoEConfig


class ConfigError(ValueError):
    """Invalid configuration: the message is one line naming the dotted key."""


@dataclasses.dataclass(**_FROZEN)
class RewardFunctionConfig:
    """One weighted reward term: a function (see `jgrpo.tasks.rewards` for the signature and
    None rule) or a sequence-classification reward model (`jgrpo.models.reward_model`).

    In YAML a bare string `module:function` is short for `{function: module:function}`."""

    STRING_FORM: ClassVar[str] = "function"
    """The field a bare string sets."""

    function: Union[str, Callable[..., Any], None] = None
    """`module:function` (or, from Python, the function): fn(prompts, completions, **columns)."""
    model: Optional[str] = None
    """Instead of function: a reward model, an HF *ForSequenceClassification folder or hub id."""
    weight: float = 1.0
    """Multiplier of this term in the total reward."""
    name: Optional[str] = None
    """Metric name (`reward/<name>/mean`); None = the function's (or model folder's) name."""
    per_sample: bool = False
    """Old form: fn(prompt, completion, example) -> float, called once per sample."""
    batch_tokens: int = 16384
    """Reward model: tokens per forward (rows x padded length), texts sorted by length."""
    max_length: Optional[int] = None
    """Reward model: texts keep their first max_length tokens (None = max_position_embeddings)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Reward model: parameter and compute dtype; auto = model.compute_dtype's resolution."""
    chat_template: bool = True
    """Reward model: chat-message prompts go through its own chat template (else plain text)."""

    @property
    def label(self) -> str:
        """The metric name: `name`, else the function's __name__ (the part after `:`), else
        the reward model's folder or repo name."""
        if self.name:
            return self.name
        if self.model is not None:
            return self.model.rstrip("/").rpartition("/")[2]
        if isinstance(self.function, str):
            return self.function.rpartition(":")[2].rpartition(".")[2]
        return getattr(self.function, "__name__", type(self.function).__name__)


TaskName = Literal["arithmetic", "calculator", "countdown", "gsm8k", "prompts"]


@dataclasses.dataclass(**_FROZEN)
class ValSetConfig:
    """One named held-out set of data.val_sets, with its own prompts and scoring (docs/dapo.md).

    YAML `{name: path}` is short for `{name: {path: path}}`. A key left unset (null) takes
    data's value, except the scoring keys `reward_functions` and `task_reward_weight`: a set
    whose `task` differs from data.task is scored by its own task alone (no reward functions,
    verifier weight 1) unless it gives them."""

    SHORT_FORM: ClassVar[str] = "path"
    """The field a bare value `{name: value}` sets."""

    name: str
    """The metric prefix val/<name>/: letters, digits, _ and - (not `val`)."""
    path: str
    """A JSONL/JSON/Parquet/CSV file, datasets folder or HF dataset id (as data.val_path)."""
    task: Optional[TaskName] = None
    """The set's prompts and verifier (null = data.task)."""
    reward_functions: Optional[tuple[RewardFunctionConfig, ...]] = None
    """The set's reward terms (null = data.reward_functions on data.task, none on another)."""
    task_reward_weight: Optional[float] = None
    """Weight of the set's verifier reward (null = data's on data.task, 1 on another)."""
    num_examples: Optional[int] = None
    """The set's first records used (null = data.num_val_examples)."""
    dataset_config: Optional[str] = None
    """Config (subset) of a hub dataset id (null = data.dataset_config)."""
    prompt_key: Optional[str] = None
    """Task prompts: the prompt column (null = data.prompt_key)."""
    question_key: Optional[str] = None
    """Field holding the question (null = data.question_key)."""
    answer_key: Optional[str] = None
    """Field holding the reference answer (null = data.answer_key)."""

    def data_config(self, data: DataConfig) -> DataConfig:
        """The DataConfig this set is read, prompted and scored with: data's, overridden by
        the set's keys; its held-out records are `path`, it has no training data."""
        own_task = self.task is None or self.task == data.task
        inherited_rewards = data.reward_functions if own_task else ()
        inherited_weight = data.task_reward_weight if own_task else 1.0
        keys = ("task", "dataset_config", "prompt_key", "question_key", "answer_key")
        given = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        return dataclasses.replace(
            data,
            **given,
            train_path=None,
            val_path=self.path,
            val_fraction=None,
            num_val_examples=data.num_val_examples
            if self.num_examples is None
            else self.num_examples,
            reward_functions=inherited_rewards
            if self.reward_functions is None
            else self.reward_functions,
            task_reward_weight=inherited_weight
            if self.task_reward_weight is None
            else self.task_reward_weight,
            val_sets=(),
        )


@dataclasses.dataclass(**_FROZEN)
class DataConfig:
    """The task: where prompts come from and how completions are scored."""

    task: TaskName = "arithmetic"
    """Built-in task, or `prompts`: your dataset's prompt column scored by reward_functions."""
    train_path: Optional[str] = None
    """A JSONL/JSON/Parquet/CSV file, datasets folder or HF dataset id; None = generated."""
    val_path: Optional[str] = None
    """Held-out set in the same formats; None = none for your data, built-in tasks' own set."""
    val_fraction: Optional[float] = None
    """Hold out this fraction (0 < f < 1) of the training records, seeded (None = none)."""
    dataset_config: Optional[str] = None
    """Config (subset) of hub dataset ids, e.g. `main` of openai/gsm8k; None = their only one."""
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
    """Arithmetic, calculator: operands are drawn from [min_operand, max_operand]."""
    min_operand: int = 0
    """Arithmetic, calculator: the smallest operand."""
    operators: str = "+-"
    """Arithmetic: characters drawn as operators, a subset of `+-*`."""
    countdown_num_numbers: int = 3
    """Countdown: how many source numbers per puzzle."""
    use_chat_template: Optional[bool] = None
    """Wrap string prompts in the chat template (null: built-in tasks yes, prompts no, as TRL)."""
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
    reward_errors: Literal["log", "raise"] = "log"
    """A failing reward function: log (first traceback once, all counted, scores 0) or raise."""
    shuffle: bool = True
    """Reshuffle training examples every epoch (seeded by grpo.seed)."""
    val_sets: tuple[ValSetConfig, ...] = ()
    """More named held-out sets (val/<name>/...): {name: path} or {name: {path, task, ...}}."""
    tools: tuple[Union[str, Callable[..., Any]], ...] = ()
    """Tools the model may call: `module:function` (typed, with a docstring; or functions)."""
    environment: Union[str, Callable[..., Any], None] = None
    """`module:Class` with reset(**record) and step(text) (or a class); one per rollout row."""
    tool_timeout_s: float = 10.0
    """A tool call or environment step running past this fails (counted; an error message)."""
    tool_processes: int = 2
    """Child processes running tool calls and environment steps, rows split between them."""
    environment_args: tuple[tuple[str, Any], ...] = ()
    """`verifiers:<id>` environments: the taskset's config ({name: value}; `harness`: its own)."""
    agent: Union[str, Callable[..., Any], None] = None
    """`module:function`: an async agent(client, record) that runs each rollout (docs/agents.md)."""
    agent_timeout_s: float = 300.0
    """An agent's whole rollout running past this fails (counted; its rollout holds no sample)."""

    @property
    def wraps_string_prompts(self) -> bool:
        """String prompts go through the tokenizer's chat template (when it has one):
        data.use_chat_template, or when null, yes for the built-in tasks (an instruct model
        answers their bare questions best in chat form) and no for `prompts` (your strings are
        used verbatim, as TRL does; message lists always use the template) unless tools or an
        environment make the rollout a conversation."""
        if self.use_chat_template is not None:
            return self.use_chat_template
        return self.task != "prompts" or bool(self.tools) or self.environment is not None


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
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (Eq. 13), added to the reward as its own term."""

    length: int
    """L_cache: completions longer than rollout.max_new_tokens - length are penalised."""
    penalty: float = 1.0
    """reward += min(-(L - (Lmax - length)) / length * penalty, 0), Lmax = max_new_tokens."""


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
    val_num_generations: int = 1
    """n samples per held-out example at rollout.val_temperature (1 = off): mean@n, maj@n."""
    val_pass_at: tuple[int, ...] = (1,)
    """k values of the unbiased pass@k from the n samples (each k <= val_num_generations)."""
    seed: int = 42
    """Seeds data order, sampling and init."""
    seq_logprob_error_threshold: Optional[float] = None
    """Mask rows whose sequence logprob error e_b exceeds this (None = off)."""
    skip_reference_policy_logprobs_calculation: bool = False
    """Explicitly skip the reference forward (requires loss.reference_policy_kl_penalty == 0)."""
    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage estimator."""
    overlong_buffer: Optional[OverlongBufferConfig] = None
    """DAPO overlong reward shaping {length, penalty} (None = off; docs/dapo.md)."""
    use_dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop all-equal groups, generate more until P informative ones."""
    dynamic_sampling_max_gen_batches: int = 10
    """Generation batches per step at most (the first included) before giving up."""
    dynamic_sampling_on_exhausted: Literal["warn", "raise"] = "warn"
    """Past max_gen_batches: warn (one line) and train on the groups there are, or raise."""
    dynamic_sampling_filter: Literal["reward", "correct"] = "reward"
    """Informative = the unshaped reward (or the verifier's correct) is not all equal."""
    batch_multiplier: float = 1.0
    """Each generation batch draws ceil(P x batch_multiplier) prompts (dynamic sampling)."""
    sequence_packing: bool = True
    """Train on rows packed first-fit decreasing (same loss, less padding; docs/packing.md)."""
    packing_budget: Optional[int] = None
    """Tokens per packed row (None = the batch's row width: prompt width + max_new_tokens)."""

    @property
    def gen_prompts_per_batch(self) -> int:
        """Prompts per generation batch: P, or ceil(P x batch_multiplier) with dynamic sampling."""
        return math.ceil(self.num_prompts_per_step * self.batch_multiplier)

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
    overlong_filtering: bool = False
    """DAPO: truncated rows (no stop token) get sample_mask 0; they stay in the group stats."""


@dataclasses.dataclass(**_FROZEN)
class OptimConfig:
    """AdamW with a schedule and global-norm clipping."""

    learning_rate: float = 1e-6
    """Peak learning rate."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warmup, over grpo.max_num_steps * grpo.num_minibatches updates."""
    warmup_steps: int = 0
    """Linear warmup updates."""
    warmup_start_ratio: Optional[float] = None
    """Warmup starts at this fraction of the peak (0: HF, optax); None: update k at (k+1)/W."""
    min_lr_ratio: float = 0.0
    """Where linear and cosine decay end: this fraction of the peak learning rate (0 = 0)."""
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
    val_temperature: Optional[float] = None
    """Temperature of the n validation samples (None = rollout.temperature)."""
    max_new_tokens: int = 256
    """Completion length cap (multi-turn: every turn and reply together); hitting it truncates."""
    prompt_bucket: int = 32
    """Prompt lengths are padded up to a multiple of this (fewer recompiles)."""
    shared_prefill: bool = True
    """Prefill each prompt once for its G rows (float32: a few ulps off; docs/sampler.md)."""
    decode_slots: Optional[int] = None
    """Rows decoded at once per sampler call; a stopped row's slot takes the next (None = all)."""
    compact_decode: bool = True
    """Narrow the decode batch to 1/2, 1/4, 1/8 as rows stop (with decode_slots: the tail)."""
    kv_cache_dtype: Optional[str] = None
    """KV cache storage: float32, bfloat16 or float8_e4m3fn (null = the compute dtype)."""
    max_turns: int = 1
    """Assistant turns per rollout (> 1: tool calls / environment replies continue it)."""
    max_tool_response_tokens: Optional[int] = 256
    """A tool result longer than this many tokens is cut (counted; None = no limit)."""
    tool_call_format: Literal["hermes"] = "hermes"
    """How tool calls are written: hermes = <tool_call>{"name", "arguments"}</tool_call>."""


@dataclasses.dataclass(**_FROZEN)
class MeshConfig:
    """Device mesh and the logical -> mesh axis rules."""

    data: int = -1
    """Data-parallel axis size (-1 = the remaining devices)."""
    fsdp: int = 1
    """Fully-sharded axis size: parameters and optimizer state are split over it."""
    context: int = 1
    """Context-parallel axis size: the train step splits each row's tokens over it."""
    tensor: int = 1
    """Tensor-parallel axis size (heads, mlp, vocab)."""
    rules: tuple[tuple[str, Optional[str]], ...] = ()
    """Overrides of the logical-axis rules, e.g. [[embed, null]]."""


@dataclasses.dataclass(**_FROZEN)
class CheckpointConfig:
    """Orbax checkpoints of the whole run state."""

    save_period: int = 50
    """Save every this many steps and at the last step (0 = never: export, eval use final/)."""
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
    """Progress on stderr: a bar on a terminal, else a line each tenth of the run."""
    plot: bool = True
    """Write PNG curves at the end of the run."""
    num_samples: int = 4
    """Prompt/completion/reward rows per step to RUN_DIR/samples.jsonl and TB/W&B (0 = off)."""


@dataclasses.dataclass(**_FROZEN)
class DistillationConfig:
    """On-policy distillation (docs/distillation.md): a frozen teacher scores every token the
    policy sampled, and coef x (teacher logprob - policy logprob) joins that token's advantage
    (loss sampled_token), or coef x a KL over the teacher's top-k tokens joins the loss."""

    teacher: Optional[str] = None
    """HF folder, hub id, `smollm2` or `builtin:...` sharing model.path's tokenizer (None = off)."""
    coef: float = 1.0
    """lambda: the per-token term lambda x (log p_teacher - log p_policy) added to the advantage."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Teacher parameter and compute dtype; auto = model.compute_dtype's resolution."""
    loss: Literal["sampled_token", "top_k"] = "sampled_token"
    """sampled_token: the term above joins the advantage; top_k: coef x a top-k KL the loss."""
    top_k: int = 64
    """loss top_k: k, the teacher's likeliest tokens kept per position (1 <= k <= vocab)."""
    kl_type: Literal["forward", "reverse", "mixed"] = "mixed"
    """loss top_k: KL(teacher||policy), KL(policy||teacher) or w x forward + (1-w) x reverse."""
    mixed_kl_weight: float = 0.5
    """loss top_k, kl_type mixed: w, the forward KL's weight, in [0, 1]."""


@dataclasses.dataclass(**_FROZEN)
class SFTConfig:
    """Supervised fine-tuning (`jgrpo sft`, docs/sft.md): the mean negative log-likelihood of
    the assistant tokens, trained by the GRPO train step's machinery. model, optim, mesh,
    checkpoint and logging apply as they do to `jgrpo train`; data.* names the task whose tools
    and prompt rendering the records take, and whose held-out set gives greedy accuracy.

    Records (train_path, val_path): a .jsonl/.json/.parquet/.csv file, a save_to_disk folder
    or a hub dataset id (splits train and test/validation), each a chat `messages` list or a
    `prompt` and a `completion` (strings or message lists). With train_path None the records
    are the data task's reference answers (arithmetic, countdown, gsm8k, calculator), and with
    val_path None too, its held-out examples' references validate."""

    train_path: Optional[str] = None
    """Training records (file, save_to_disk folder, hub id); None = the task's references."""
    val_path: Optional[str] = None
    """Validation records (as train_path); None = none, or the task's held-out references."""
    dataset_config: Optional[str] = None
    """The hub dataset's configuration name (both paths), if it has several."""
    messages_key: str = "messages"
    """Column of a record's chat messages (role/content dicts; tool turns allowed)."""
    prompt_key: str = "prompt"
    """Column of a prompt/completion record's prompt."""
    completion_key: str = "completion"
    """Column of a prompt/completion record's completion (the target)."""
    max_seq_length: int = 1024
    """T: tokens per row. A longer record is an error naming it (nothing is truncated)."""
    batch_size: int = 32
    """Records per optimizer step (the loss is the mean over all their assistant tokens)."""
    max_num_steps: int = 100
    """Optimizer steps of the run (the schedule of optim.* spans them)."""
    num_microbatches: int = 1
    """Gradient accumulation: each step's rows in this many forward/backward chunks."""
    sequence_packing: bool = False
    """Pack the step's records into rows of sft.packing_budget tokens (docs/packing.md)."""
    packing_budget: Optional[int] = None
    """Tokens per packed row (None = sft.max_seq_length)."""
    seed: int = 0
    """Seed of the record order (shuffled per epoch) and of fresh LoRA adapters."""
    shuffle: bool = True
    """Reshuffle the records every epoch (false: file order, epoch after epoch)."""
    val_period: int = 50
    """Validate every this many steps (0 = only at the end, with sft.val_at_end)."""
    val_at_end: bool = True
    """Validate after the last step."""
    val_accuracy: Optional[bool] = None
    """Also greedy accuracy on data's held-out set; None = when the records are the task's."""


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
    distillation: DistillationConfig = DistillationConfig()
    """On-policy distillation from a teacher (off unless distillation.teacher is set)."""
    sft: SFTConfig = SFTConfig()
    """Supervised fine-tuning (`jgrpo sft`); `jgrpo train` ignores it."""

    @property
    def skip_prev(self) -> bool:
        """The prev-logprob forward is absent (docs/losses.md: the threshold and distillation
        need real lo)."""
        return (
            self.loss.force_on_policy_ratio
            and self.grpo.seq_logprob_error_threshold is None
            and self.distillation.teacher is None
        )

    @property
    def skip_ref(self) -> bool:
        """The reference forward is absent: no KL penalty (or an explicit skip)."""
        return (
            self.loss.reference_policy_kl_penalty == 0.0
            or self.grpo.skip_reference_policy_logprobs_calculation
        )

    def replace(self, **kw) -> Config:
        return dataclasses.replace(self, **kw)
