"""The policy model: a Flax NNX decoder (Llama / Qwen2 / Qwen3) with HF weights in and out.

Public API: `from_pretrained(path, dtype="float32")`, `save_pretrained(model, path)`,
`Transformer`, `TransformerConfig`, `KVCache`.
"""

import importlib

_EXPORTS = {
    "ModelFormatError": "hf",
    "config_from_hf": "hf",
    "config_to_hf": "hf",
    "from_pretrained": "hf",
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


__all__ = [
    "KVCache",
    "ModelFormatError",
    "RopeScaling",
    "Transformer",
    "TransformerConfig",
    "config_from_hf",
    "config_to_hf",
    "from_pretrained",
    "save_pretrained",
]
