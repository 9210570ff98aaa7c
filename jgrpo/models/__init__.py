"""The policy model: a Flax NNX decoder (Llama / Qwen2 / Qwen3) with HF weights in and out.

Public API: `from_pretrained(path, dtype="float32", param_dtype=None, **options)`,
`save_pretrained(model, path)`, `read_hf_config(path, ...)`, `model_options(model_cfg)` (a run
config's `model` section -> those keyword arguments), `Transformer`, `TransformerConfig`,
`KVCache`.
"""

import importlib

_EXPORTS = {
    "ModelFormatError": "hf",
    "config_from_hf": "hf",
    "config_to_hf": "hf",
    "from_pretrained": "hf",
    "model_options": "hf",
    "read_hf_config": "hf",
    "save_pretrained": "hf",
    "KVCache": "transformer",
    "RopeScaling": "transformer",
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
