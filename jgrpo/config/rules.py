"""The rules a config must meet beyond its types: the bounds and the cross-field rules.

``validate(cfg)`` runs the bounds (tables of dotted keys below), then one small function per
section, each named for the section it checks (``check_data``, ``check_grpo``, ``check_loss``,
...; then the feature checks ``check_dapo``, ``check_evaluation``), in a fixed order so
that a config with several faults always reports the same first one. The cross-field rules
are those of docs/losses.md. Every failure raises ``ConfigError`` with one line naming the
dotted key and what is allowed; ``validate`` returns the config unchanged.
"""

from __future__ import annotations

import math
import warnings

from jgrpo.config.bounds import (
    MAX_BATCH_ROWS,
    MAX_BATCH_TOKENS,
    MAX_SEED,
    MAX_SEQUENCE,
    MAX_VAL_EXAMPLES,
    check_bounds,
)
from jgrpo.config.bounds import require as _require
from jgrpo.config.sections import (
    Config,
    DataConfig,
    LoggingConfig,
    LoRAConfig,
    LossConfig,
    MeshConfig,
    OptimConfig,
    ValSetConfig,
)


def validate(cfg: Config) -> Config:
    """Cross-field rules of docs/losses.md and range checks; raises ConfigError."""
    check_bounds(cfg)
    check_data(cfg.data)
    check_reward_models(cfg)
    check_logging(cfg.logging)
    check_grpo(cfg)
    check_loss(cfg.loss)
    check_advantage(cfg)
    check_skip_flags(cfg)
    check_rollout(cfg)
    check_optim(cfg.optim)
    check_lora(cfg.model.lora)
    check_moe(cfg)
    check_mesh(cfg.mesh)
    check_dapo(cfg)
    check_evaluation(cfg)
    check_turns(cfg)
    check_distillation(cfg)
    check_sft(cfg)
    return cfg


def check_data(data: DataConfig) -> None:
    """data: arithmetic operators, reward timeouts, reward function paths and names."""
    _require(
        set(data.operators) <= set("+-*") and data.operators != "",
        f"data.operators: {data.operators!r} must be a non-empty subset of '+-*'",
    )
    _require(data.reward_timeout_s > 0, "data.reward_timeout_s: must be > 0")
    _require(data.tool_timeout_s > 0, "data.tool_timeout_s: must be > 0")
    _require(
        data.min_operand <= data.max_operand,
        f"data.min_operand: {data.min_operand} must be <= data.max_operand {data.max_operand}",
    )
    _require(data.reward_import_timeout_s > 0, "data.reward_import_timeout_s: must be > 0")
    f = data.val_fraction
    _require(f is None or 0 < f < 1, f"data.val_fraction: must lie in (0, 1), got {f}")
    _require(
        f is None or data.val_path is None,
        "data.val_fraction: give data.val_path or data.val_fraction, not both",
    )
    check_reward_names(data.reward_functions, "data.reward_functions")


def check_reward_names(terms, key: str) -> None:
    """Reward terms (data.reward_functions, a validation set's): `module:function` strings and
    distinct metric names."""
    labels: set[str] = set()
    for i, rf in enumerate(terms):
        if isinstance(rf.function, str):
            _require(
                ":" in rf.function and all(rf.function.split(":", 1)),
                f"{key}[{i}].function: {rf.function!r} must look like module:function",
            )
        _require(
            rf.label not in labels,
            f"{key}[{i}].name: {rf.label!r} names two reward functions; set a distinct name",
        )
        labels.add(rf.label)


def check_reward_models(cfg: Config) -> None:
    """data.reward_functions: each term is a function or a model; a model's own fields are in
    range."""
    for i, rf in enumerate(cfg.data.reward_functions):
        key = f"data.reward_functions[{i}]"
        _require(
            (rf.function is None) != (rf.model is None),
            f"{key}: give exactly one of function (module:function) or model (a reward model)",
        )
        if rf.model is None:
            continue
        _require(not rf.per_sample, f"{key}.per_sample: applies to functions, not to a model")
        _require(rf.batch_tokens >= 1, f"{key}.batch_tokens: must be >= 1, got {rf.batch_tokens}")
        if rf.max_length is not None:
            _require(rf.max_length >= 1, f"{key}.max_length: must be >= 1, got {rf.max_length}")
            _require(
                rf.max_length <= rf.batch_tokens,
                f"{key}.max_length: {rf.max_length} exceeds batch_tokens {rf.batch_tokens} "
                "(one text must fit one forward)",
            )


def check_logging(logging: LoggingConfig) -> None:
    """logging: the sample rows per step."""
    _require(logging.num_samples >= 0, "logging.num_samples: must be >= 0")


def check_grpo(cfg: Config) -> None:
    """grpo: the batch splits, group size, pass@k, the packing budget and the logprob-error
    threshold."""
    g = cfg.grpo
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
        g.num_generations_per_prompt >= 2 or g.advantage.estimator == "reinforce_plus_plus",
        "grpo.num_generations_per_prompt: group baselines need at least 2 generations",
    )
    if g.packing_budget is not None:
        _require(
            g.sequence_packing,
            "grpo.packing_budget: set, but grpo.sequence_packing is false (nothing is packed)",
        )
        least = cfg.rollout.prompt_bucket + cfg.rollout.max_new_tokens
        _require(
            least <= g.packing_budget <= MAX_SEQUENCE,
            f"grpo.packing_budget: must lie in [rollout.prompt_bucket + rollout.max_new_tokens "
            f"= {least}, {MAX_SEQUENCE}], got {g.packing_budget}",
        )
    if g.seq_logprob_error_threshold is not None:
        _require(
            g.seq_logprob_error_threshold >= 1.0,
            "grpo.seq_logprob_error_threshold: must be >= 1.0 (e_b >= 1 always) or null",
        )


def check_loss(loss: LossConfig) -> None:
    """loss: clip and KL ranges, the ratio modes that exclude each other, truncated IS."""
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
    check_truncated_importance_sampling(loss)


def check_truncated_importance_sampling(loss: LossConfig) -> None:
    """loss.truncated_importance_sampling_*: needs IS correction and a ratio; min <= max."""
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


def check_advantage(cfg: Config) -> None:
    """grpo.advantage: the clip order, and what loss.use_kl_in_reward needs."""
    adv, loss = cfg.grpo.advantage, cfg.loss
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


def check_skip_flags(cfg: Config) -> None:
    """The skipped forwards: the reference skip and loss.force_on_policy_ratio."""
    g, loss = cfg.grpo, cfg.loss
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
            cfg.rollout.max_staleness == 0,
            "loss.force_on_policy_ratio: incompatible with rollout.max_staleness > 0",
        )
        if g.seq_logprob_error_threshold is not None:
            warnings.warn(
                "loss.force_on_policy_ratio with grpo.seq_logprob_error_threshold: the threshold "
                "needs real prev logprobs, so the prev forward is computed anyway",
                stacklevel=3,  # the caller of validate
            )
        if cfg.distillation.teacher is not None:
            warnings.warn(
                "loss.force_on_policy_ratio with distillation.teacher: the distillation term "
                "needs the policy's logprobs before the update, so the prev forward is computed "
                "anyway",
                stacklevel=3,
            )


def check_rollout(cfg: Config) -> None:
    """rollout: worker resources, sampling ranges, what async and many workers need."""
    ro = cfg.rollout
    for key in ("num_cpus_per_worker", "num_gpus_per_worker"):
        value = getattr(ro, key)
        _require(value is None or value >= 0, f"rollout.{key}: must be >= 0 (or null)")
    _require(ro.temperature >= 0, "rollout.temperature: must be >= 0")
    _require(0 < ro.top_p <= 1, "rollout.top_p: must lie in (0, 1]")
    _require(ro.top_k is None or ro.top_k >= 1, "rollout.top_k: must be >= 1 (or null)")
    _require(
        ro.decode_slots is None or ro.decode_slots >= 1,
        f"rollout.decode_slots: must be >= 1 (or null = every row), got {ro.decode_slots}",
    )
    kv_dtypes = ("float32", "bfloat16", "float8_e4m3fn")  # sampling.KV_CACHE_DTYPES
    _require(
        ro.kv_cache_dtype is None or ro.kv_cache_dtype in kv_dtypes,
        f"rollout.kv_cache_dtype: must be one of {', '.join(kv_dtypes)} (or null = the compute "
        f"dtype), got {ro.kv_cache_dtype!r}",
    )
    if ro.max_staleness > 0:
        _require(
            cfg.loss.use_importance_sampling_correction,
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


def check_optim(opt: OptimConfig) -> None:
    """optim: AdamW's ranges and the clip norm."""
    _require(opt.learning_rate > 0, "optim.learning_rate: must be > 0")
    _require(0 <= opt.b1 < 1 and 0 <= opt.b2 < 1, "optim.b1 / optim.b2: must lie in [0, 1)")
    _require(opt.eps > 0, "optim.eps: must be > 0")
    _require(opt.weight_decay >= 0, "optim.weight_decay: must be >= 0")
    _require(
        0 <= opt.min_lr_ratio <= 1,
        f"optim.min_lr_ratio: must lie in [0, 1], got {opt.min_lr_ratio}",
    )
    start = opt.warmup_start_ratio
    _require(
        start is None or (0 <= start <= 1 and opt.warmup_steps > 0),
        f"optim.warmup_start_ratio: must lie in [0, 1] with optim.warmup_steps > 0, got {start}"
        f" with warmup_steps {opt.warmup_steps}",
    )
    _require(
        opt.max_grad_norm is None or opt.max_grad_norm > 0,
        "optim.max_grad_norm: must be > 0 (or null)",
    )


def check_moe(cfg: Config) -> None:
    """model.moe: non-negative router loss weights; recorded routing (router replay) covers
    single-turn rollouts only."""
    moe = cfg.model.moe
    aux = moe.router_aux_loss_coef
    _require(aux is None or aux >= 0, f"model.moe.router_aux_loss_coef: must be >= 0, got {aux}")
    z = moe.router_z_loss_coef
    _require(z >= 0, f"model.moe.router_z_loss_coef: must be >= 0, got {z}")
    key = "router_replay" if moe.router_replay else "record_routing"
    _require(
        not (moe.router_replay or moe.record_routing) or not needs_chat_turns(cfg),
        f"model.moe.{key}: recorded routing covers single-turn rollouts only; allowed with "
        "rollout.max_turns: 1 and no data.tools, data.environment or calculator task",
    )


def check_lora(lora: LoRAConfig) -> None:
    """model.lora: rank, alpha and the target modules."""
    _require(lora.rank >= 0, f"model.lora.rank: must be >= 0 (0 = off), got {lora.rank}")
    _require(lora.alpha > 0, f"model.lora.alpha: must be > 0, got {lora.alpha}")
    _require(
        lora.rank == 0 or len(lora.target_modules) > 0,
        "model.lora.target_modules: needs at least one module when model.lora.rank > 0",
    )
    _require(
        len(set(lora.target_modules)) == len(lora.target_modules),
        f"model.lora.target_modules: {list(lora.target_modules)} names a module twice",
    )


def check_mesh(mesh: MeshConfig) -> None:
    """mesh: axis sizes, at most one of them -1."""
    _require(mesh.context >= 1, f"mesh.context: must be >= 1, got {mesh.context}")
    for key in ("data", "fsdp", "tensor"):
        value = getattr(mesh, key)
        _require(value == -1 or value >= 1, f"mesh.{key}: must be >= 1 or -1, got {value}")
    _require(
        [mesh.data, mesh.fsdp, mesh.tensor].count(-1) <= 1,
        "mesh: at most one of mesh.data / mesh.fsdp / mesh.tensor may be -1",
    )


def check_dapo(cfg: Config) -> None:
    """The DAPO keys: overlong buffer, dynamic sampling (docs/dapo.md)."""
    g, ro = cfg.grpo, cfg.rollout
    ob = g.overlong_buffer
    if ob is not None:
        _require(
            1 <= ob.length <= ro.max_new_tokens,
            f"grpo.overlong_buffer.length: must lie in [1, rollout.max_new_tokens = "
            f"{ro.max_new_tokens}], got {ob.length}",
        )
        _require(ob.penalty >= 0, f"grpo.overlong_buffer.penalty: must be >= 0, got {ob.penalty}")
    _require(
        1 <= g.dynamic_sampling_max_gen_batches <= 1024,
        "grpo.dynamic_sampling_max_gen_batches: must lie in [1, 1024], got "
        f"{g.dynamic_sampling_max_gen_batches}",
    )
    _require(
        g.batch_multiplier >= 1 and g.gen_prompts_per_batch <= MAX_BATCH_ROWS,
        f"grpo.batch_multiplier: must be >= 1 (and P x it <= {MAX_BATCH_ROWS}), got "
        f"{g.batch_multiplier}",
    )
    _require(
        g.use_dynamic_sampling or g.batch_multiplier == 1,
        "grpo.batch_multiplier: > 1 needs grpo.use_dynamic_sampling=true",
    )
    if g.use_dynamic_sampling:
        _require(
            g.dynamic_sampling_filter == "reward" or cfg.data.task != "prompts",
            "grpo.dynamic_sampling_filter: correct needs a task with a verifier, not prompts",
        )


def check_evaluation(cfg: Config) -> None:
    """n validation samples, the pass@k list, the named validation sets (docs/dapo.md)."""
    g, ro = cfg.grpo, cfg.rollout
    n = g.val_num_generations
    _require(1 <= n <= 1024, f"grpo.val_num_generations: must lie in [1, 1024], got {n}")
    for k in g.val_pass_at:
        _require(
            1 <= k <= n, f"grpo.val_pass_at: k = {k} must lie in [1, val_num_generations = {n}]"
        )
    t = ro.val_temperature
    _require(
        n == 1 or (t if t is not None else ro.temperature) > 0,
        "rollout.val_temperature: the val_num_generations samples need a temperature > 0",
    )
    names = [vs.name for vs in cfg.data.val_sets]
    for vs in cfg.data.val_sets:
        _require(
            vs.name.replace("_", "").replace("-", "").isalnum()
            and vs.name != "val"
            and names.count(vs.name) == 1,
            f"data.val_sets: name {vs.name!r} must be unique, not 'val', letters/digits/_/- only",
        )
        check_val_set(vs, cfg.data)


def check_val_set(vs: ValSetConfig, data: DataConfig) -> None:
    """One data.val_sets entry: a path, its example count, its own reward terms (functions:
    reward models are loaded for data.reward_functions only, so a set gets them by inheriting
    those), a reward for a task without a verifier."""
    key = f"data.val_sets.{vs.name}"
    _require(vs.path.strip() != "", f"{key}.path: must name a file, folder or dataset id")
    if vs.num_examples is not None:
        _require(
            1 <= vs.num_examples <= MAX_VAL_EXAMPLES,
            f"{key}.num_examples: must lie in [1, {MAX_VAL_EXAMPLES}], got {vs.num_examples}",
        )
    for i, rf in enumerate(vs.reward_functions or ()):
        _require(
            rf.function is not None and rf.model is None,
            f"{key}.reward_functions[{i}]: give a function (module:function); a set inherits "
            "data.reward_functions' reward models only when it has no reward_functions of its own",
        )
    check_reward_names(vs.reward_functions or (), f"{key}.reward_functions")
    resolved = vs.data_config(data)
    own_scoring = vs.reward_functions is not None or resolved.task != data.task
    if resolved.task == "prompts" and own_scoring:  # inherited terms: checked with data's
        _require(
            len(resolved.reward_functions) > 0,
            f"{key}.reward_functions: task 'prompts' has no verifier; give at least one",
        )


def needs_chat_turns(cfg: Config) -> bool:
    """The rollouts are conversations (several turns, tools or an environment): the model's
    chat template must end a turn with a token and give reply ids (checked before a load)."""
    data = cfg.data
    tools = bool(data.tools) or data.environment is not None or data.task == "calculator"
    tools = tools or data.agent is not None
    return cfg.rollout.max_turns > 1 or tools


def check_turns(cfg: Config) -> None:
    """Multi-turn rollouts (docs/multi-turn.md): what continues a turn, the reply cap, the
    tool and environment names."""
    data, ro = cfg.data, cfg.rollout
    for i, tool in enumerate(data.tools):
        if isinstance(tool, str):
            _require(
                ":" in tool and all(tool.split(":", 1)),
                f"data.tools[{i}]: {tool!r} must look like module:function",
            )
    if isinstance(data.environment, str):
        _require(
            ":" in data.environment and all(data.environment.split(":", 1)),
            f"data.environment: {data.environment!r} must look like module:Class "
            "(or verifiers:<taskset id>)",
        )
    verifiers = isinstance(data.environment, str) and data.environment.startswith("verifiers:")
    _require(
        verifiers or not data.environment_args,
        "data.environment_args: only for a data.environment `verifiers:<id>`",
    )
    _require(
        not verifiers or data.task == "prompts",
        f"data.task: a verifiers environment supplies the prompts; set data.task: prompts, "
        f"not {data.task!r}",
    )
    if data.agent is not None:
        if isinstance(data.agent, str):
            _require(
                ":" in data.agent and all(data.agent.split(":", 1)),
                f"data.agent: {data.agent!r} must look like module:function",
            )
        _require(
            not data.tools and data.environment is None,
            "data.agent: an agent runs its own tools and environment; give data.agent or "
            "data.tools / data.environment, not both",
        )
        _require(
            not cfg.grpo.use_dynamic_sampling,
            "data.agent: grpo.use_dynamic_sampling is not supported with agents (a rollout may "
            "make several rows); set it to false",
        )
        _require(
            data.agent_timeout_s > 0,
            f"data.agent_timeout_s: must be > 0, got {data.agent_timeout_s}",
        )
    _require(
        ro.max_turns == 1
        or data.agent is not None
        or data.tools
        or data.environment is not None
        or data.task == "calculator",
        f"rollout.max_turns: {ro.max_turns} turns need something to answer a turn: data.tools, "
        "data.environment or a task with tools (calculator)",
    )
    limit = ro.max_tool_response_tokens
    _require(
        limit is None or limit >= 1,
        f"rollout.max_tool_response_tokens: must be >= 1 (or null), got {limit}",
    )


def check_distillation(cfg: Config) -> None:
    """distillation: the teacher's name, a positive finite coef, the top-k loss's keys (the
    teacher's folder, tokenizer and vocab_size: `jgrpo.distillation.check_teacher`)."""
    d = cfg.distillation
    _require(d.top_k >= 1, f"distillation.top_k: must be >= 1, got {d.top_k}")
    _require(
        0.0 <= d.mixed_kl_weight <= 1.0,
        f"distillation.mixed_kl_weight: must lie in [0, 1], got {d.mixed_kl_weight}",
    )
    if d.teacher is None:
        _require(d.loss == "sampled_token", "distillation.loss: top_k needs distillation.teacher")
        return
    _require(d.teacher.strip() != "", "distillation.teacher: must name a model (or be null)")
    _require(
        d.loss == "sampled_token" or cfg.mesh.context == 1,
        "distillation.loss: top_k does not run under context parallelism (mesh.context > 1)",
    )
    _require(
        math.isfinite(d.coef) and d.coef > 0,
        f"distillation.coef: must be a finite number > 0, got {d.coef}",
    )


def check_sft(cfg: Config) -> None:
    """sft: the row length, the batch and its split, the seed, the packing budget."""
    s = cfg.sft
    _require(
        2 <= s.max_seq_length <= MAX_SEQUENCE,
        f"sft.max_seq_length: must lie in [2, {MAX_SEQUENCE}], got {s.max_seq_length}",
    )
    _require(
        s.batch_size <= MAX_BATCH_ROWS,
        f"sft.batch_size: must be <= {MAX_BATCH_ROWS}, got {s.batch_size}",
    )
    _require(
        s.batch_size * s.max_seq_length <= MAX_BATCH_TOKENS,
        f"sft.batch_size x sft.max_seq_length: must be <= {MAX_BATCH_TOKENS} tokens, got "
        f"{s.batch_size * s.max_seq_length}",
    )
    _require(
        s.batch_size % s.num_microbatches == 0,
        f"sft.num_microbatches: {s.num_microbatches} must divide sft.batch_size = {s.batch_size}",
    )
    _require(0 <= s.seed <= MAX_SEED, f"sft.seed: must lie in [0, {MAX_SEED}], got {s.seed}")
    if s.packing_budget is not None:
        _require(
            s.sequence_packing,
            "sft.packing_budget: set, but sft.sequence_packing is false (nothing is packed)",
        )
        _require(
            s.max_seq_length <= s.packing_budget <= MAX_SEQUENCE,
            f"sft.packing_budget: must lie in [sft.max_seq_length = {s.max_seq_length}, "
            f"{MAX_SEQUENCE}], got {s.packing_budget}",
        )
    for key in ("messages_key", "prompt_key", "completion_key"):
        _require(bool(getattr(s, key)), f"sft.{key}: must be a non-empty column name")
