"""The rules of the `sft:` section (`jgrpo sft`, docs/sft.md), run by `rules.validate`."""

from __future__ import annotations

from jgrpo.config.rules import (
    MAX_BATCH_ROWS,
    MAX_BATCH_TOKENS,
    MAX_SEED,
    MAX_SEQUENCE,
    _require,
)
from jgrpo.config.sections import Config


def check_sft(cfg: Config) -> None:
    """sft: the row length, the batch and its split, the seed, the packing budget."""
    s = cfg.sft
    for key in ("batch_size", "max_num_steps", "num_microbatches"):
        _require(getattr(s, key) >= 1, f"sft.{key}: must be >= 1, got {getattr(s, key)}")
    _require(s.val_period >= 0, f"sft.val_period: must be >= 0, got {s.val_period}")
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
