"""The one config tree of a jgrpo run, as a package that imports no jax.

- ``sections``: the frozen, documented dataclasses (``Config`` and its sections; the model
  section in ``model_sections``) and ``ConfigError``;
- ``loading``: YAML reading, dotted overrides, coercion (``from_dict``), ``to_dict``,
  ``field_docs``, ``format_config`` and ``load_config``;
- ``bounds``: the ``MAX_*`` limits and the tables of keys' ranges (``check_bounds``);
- ``rules``: ``validate`` (the bounds, then one check per section);
- ``resume``: ``RESUME_MAY_CHANGE`` and ``check_resume_compatible``.

Everything is re-exported here: ``from jgrpo.config import X`` is the way in. Every failure
raises ``ConfigError`` with one line naming the dotted key and what is allowed, before any
model or worker starts.
"""

from jgrpo.config.bounds import (
    MAX_BATCH_ROWS,
    MAX_BATCH_TOKENS,
    MAX_OPERAND,
    MAX_SEED,
    MAX_SEQUENCE,
    MAX_VAL_EXAMPLES,
)
from jgrpo.config.loading import (
    apply_overrides,
    field_docs,
    format_config,
    from_dict,
    load_config,
    read_config,
    read_json,
    read_yaml,
    to_dict,
)
from jgrpo.config.resume import RESUME_MAY_CHANGE, check_resume_compatible
from jgrpo.config.rules import validate
from jgrpo.config.sections import (
    AdvantageConfig,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DistillationConfig,
    GRPOConfig,
    LoggingConfig,
    LoRAConfig,
    LoRATarget,
    LossConfig,
    MeshConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    OverlongBufferConfig,
    RewardFunctionConfig,
    RolloutConfig,
    SFTConfig,
    ValSetConfig,
)

__all__ = [
    "MAX_BATCH_ROWS",
    "MAX_BATCH_TOKENS",
    "MAX_OPERAND",
    "MAX_SEED",
    "MAX_SEQUENCE",
    "MAX_VAL_EXAMPLES",
    "RESUME_MAY_CHANGE",
    "AdvantageConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistillationConfig",
    "GRPOConfig",
    "LoRAConfig",
    "LoRATarget",
    "LoggingConfig",
    "LossConfig",
    "MeshConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "RewardFunctionConfig",
    "RolloutConfig",
    "SFTConfig",
    "ValSetConfig",
    "apply_overrides",
    "check_resume_compatible",
    "field_docs",
    "format_config",
    "from_dict",
    "load_config",
    "read_json",
    "read_config",
    "read_yaml",
    "to_dict",
    "validate",
]
