"""The policy model: a Flax NNX decoder (Llama / Qwen2 / Qwen3, MoE: Qwen3-MoE / GLM-4.5) with
HF weights in and out.

Public API: `load_policy(model_cfg, ...)` (a run config's `model` section -> the policy: the
one way train, export and the tools build a model), `policy_config`, `policy_folder`,
`model_options`; `from_pretrained(path, dtype="float32", param_dtype=None, **options)` (the
low-level HF reader), `save_pretrained(model, path)`, `read_hf_config(path, ...)`,
`Transformer`, `TransformerConfig`, `KVCache`.
"""

import importlib

_EXPORTS = {
    "ModelFormatError": "hf",
    "config_from_hf": "hf",
    "config_to_hf": "hf",
    "from_pretrained": "hf",
    "load_policy": "policy",
    "model_class": "hf",
    "MoETransformer": "moe_transformer",
    "MoETransformerConfig": "moe_transformer",
    "model_options": "policy",
    "policy_config": "policy",
    "policy_folder": "policy",
    "read_hf_config": "hf",
    "save_pretrained": "hf",
    "KVCache": "transformer",
    "RopeScaling": "rope",
    "Transformer": "transformer",
    "TransformerConfig": "transformer",
}


def __getattr__(name: str):
    # Lazy (PEP 562): `jgrpo.models.sources` and `.preflight` check model folders before any
    # model work, so importing the package must not import jax.
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"jgrpo.models.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'jgrpo.models' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
