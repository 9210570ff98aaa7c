"""The policy model: a Flax NNX decoder (Llama / Qwen2 / Qwen3) with HF weights in and out.

Public API: `from_pretrained(path, dtype="float32", param_dtype=None, **options)`,
`save_pretrained(model, path)`, `read_hf_config(path, ...)`, `model_options(model_cfg)` (a run
config's `model` section -> those keyword arguments), `Transformer`, `TransformerConfig`,
`KVCache`.
"""

from jgrpo.models.hf import (
    ModelFormatError,
    config_from_hf,
    config_to_hf,
    from_pretrained,
    model_options,
    read_hf_config,
    save_pretrained,
)
from jgrpo.models.transformer import (
    KVCache,
    RopeScaling,
    Transformer,
    TransformerConfig,
)

__all__ = [
    "KVCache",
    "ModelFormatError",
    "RopeScaling",
    "Transformer",
    "TransformerConfig",
    "config_from_hf",
    "config_to_hf",
    "from_pretrained",
    "model_options",
    "read_hf_config",
    "save_pretrained",
]
