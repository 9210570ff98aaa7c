"""The numeric bounds of a config: the limits, the tables of dotted keys that must be >= 1,
>= 0 or at most a limit, and ``check_bounds``, the first check ``rules.validate`` runs.
``require`` is the one-line failure every rule raises (``ConfigError``).
"""

from __future__ import annotations

import functools
from typing import Any

from jgrpo.config.sections import Config, ConfigError

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

AT_LEAST_ONE = (
    "grpo.num_prompts_per_step",
    "grpo.num_generations_per_prompt",
    "grpo.max_num_steps",
    "grpo.num_minibatches",
    "grpo.num_microbatches",
    "rollout.num_workers",
    "rollout.max_new_tokens",
    "rollout.prompt_bucket",
    "checkpoint.keep_last",
    "data.num_val_examples",
    "data.num_terms",
    "data.countdown_num_numbers",
    "data.tool_processes",
    "rollout.max_turns",
    "model.logprob_chunk_size",
    "sft.batch_size",
    "sft.max_num_steps",
    "sft.num_microbatches",
)
"""Integer keys that must be >= 1."""
AT_LEAST_ZERO = (
    "grpo.val_period",
    "checkpoint.save_period",
    "rollout.max_staleness",
    "rollout.max_worker_failures",
    "optim.warmup_steps",
    "data.max_operand",
    "data.min_operand",
    "model.attention_block_size",
    "sft.val_period",
)
"""Integer keys that must be >= 0 (0 = off for the periods)."""
AT_MOST = (
    ("grpo.seed", MAX_SEED),
    ("data.max_operand", MAX_OPERAND),
    ("data.num_terms", 64),
    ("data.countdown_num_numbers", 16),
    ("data.num_val_examples", MAX_VAL_EXAMPLES),
    ("rollout.prompt_bucket", MAX_SEQUENCE),
    ("rollout.max_new_tokens", MAX_SEQUENCE),
    ("grpo.num_prompts_per_step", MAX_BATCH_ROWS),
    ("grpo.num_generations_per_prompt", MAX_BATCH_ROWS),
    ("rollout.num_workers", 4096),
    ("rollout.max_turns", 1024),
    ("data.tool_processes", 256),
)
"""Upper bounds: values past these are typos that would exhaust memory or time, not runs."""


def require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def get(cfg: Config, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), cfg)


def check_bounds(cfg: Config) -> None:
    """The tables above, then the seed and the batch's rows and tokens."""
    for key in AT_LEAST_ONE:
        value = get(cfg, key)
        require(value >= 1, f"{key}: must be >= 1, got {value}")
    for key in AT_LEAST_ZERO:
        value = get(cfg, key)
        require(value >= 0, f"{key}: must be >= 0, got {value}")
    for key, high in AT_MOST:
        value = get(cfg, key)
        require(value <= high, f"{key}: must be <= {high}, got {value}")
    g, ro = cfg.grpo, cfg.rollout
    require(g.seed >= 0, f"grpo.seed: must be >= 0, got {g.seed}")
    seq = ro.prompt_bucket + ro.max_new_tokens
    require(
        seq <= MAX_SEQUENCE,
        f"rollout.prompt_bucket + rollout.max_new_tokens: must be <= {MAX_SEQUENCE}, got {seq}",
    )
    require(
        g.batch_size <= MAX_BATCH_ROWS,
        f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt: must be <= "
        f"{MAX_BATCH_ROWS} rows, got {g.batch_size}",
    )
    require(
        g.batch_size * seq <= MAX_BATCH_TOKENS,
        f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt x (rollout.prompt_bucket "
        f"+ rollout.max_new_tokens): must be <= {MAX_BATCH_TOKENS} tokens, got "
        f"{g.batch_size * seq}",
    )
