"""GGUF (llama.cpp) Llama checkpoints -> Hugging Face folders, with numpy only.

Owns :func:`convert_gguf`: read a GGUF file with the `gguf` package, dequantise every tensor
(`gguf.quants.dequantize`, float32), undo llama.cpp's q/k row permutation, and write a folder
that `transformers.AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load offline:
config.json (LlamaForCausalLM, as transformers 5 writes it, `rope_parameters`),
generation_config.json (bos / eos / pad ids), model.safetensors (HF tensor names; no
`lm_head.weight` when the GGUF has no `output`), tokenizer.json (byte-level BPE rebuilt from
`tokenizer.ggml.{tokens,merges}`), tokenizer_config.json (special tokens + the chat template)
and chat_template.jinja. No torch and no transformers. The folder is built next to `out` and
renamed into place (:func:`jgrpo.files.atomic_folder`), so an interrupted conversion
never leaves a half folder that looks complete.

Scope: `general.architecture == "llama"` with a GPT-2 style byte-level BPE vocabulary
(`tokenizer.ggml.model == "gpt2"`); anything else raises ValueError naming the field."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from jgrpo.files import atomic_folder, write_json

# llama.cpp tensor names -> HF Llama names ({i} is the layer index).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# `tokenizer.ggml.pre` -> how llama.cpp splits text before BPE, as `tokenizers` pre-tokenizers.
# GPT-2's regex, optionally preceded by an isolating split of every digit (\p{N}); this is what
# SmolLM2's own tokenizer.json says (Digits(individual_digits) + ByteLevel).
_GPT2_PRE = ("default", "gpt-2", "gpt2")
_DIGITS_GPT2_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_DTYPES = ("float32", "bfloat16", "float16")


def convert_gguf(
    src: str | Path, out: str | Path, dtype: str = "float32", *, overwrite: bool = False
) -> Path:
    """Convert GGUF Llama file `src` into HF folder `out` (weights stored as `dtype`).

    Raises FileExistsError if `out` exists and not `overwrite`; ValueError for GGUF files
    outside the supported scope (the message names the GGUF field).
    """
    import gguf

    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {_DTYPES}")
    if Path(out).exists() and not overwrite:  # before reading a possibly large file
        raise FileExistsError(f"{out} already exists")
    try:
        reader = gguf.GGUFReader(str(src))
        meta = _read_metadata(reader)
    except Exception as e:  # the gguf reader raises anything from struct/numpy on bad bytes
        raise ValueError(f"{src}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{src}: general.architecture={arch!r}, only 'llama' is supported")
    try:
        config = _llama_config(meta, reader, dtype)
        tensors = _hf_tensors(reader, config, dtype)
        tokenizer_json, tokenizer_config, chat_template = _tokenizer_files(meta)
    except ValueError as e:
        raise ValueError(f"{src}: {e}") from None
    except Exception as e:  # damaged tensor data or metadata of the wrong type
        raise ValueError(f"{src}: damaged GGUF file ({type(e).__name__}: {e})") from None
    generation_config = {
        k: config[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config.get(k) is not None
    }

    import safetensors.numpy

    with atomic_folder(out, overwrite=overwrite) as tmp:
        safetensors.numpy.save_file(
            tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"}
        )
        write_json(tmp / "config.json", config)
        write_json(tmp / "generation_config.json", generation_config)
        (tmp / "tokenizer.json").write_text(tokenizer_json)
        write_json(tmp / "tokenizer_config.json", tokenizer_config)
        if chat_template is not None:
            (tmp / "chat_template.jinja").write_text(chat_template)
    return Path(out)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)` on q (n_head) or k (n_head_kv) rows.

    llama.cpp's convert_hf_to_gguf.py stores q/k with each head's rotary halves interleaved:
    `w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)`; this is its inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- metadata


def _read_metadata(reader) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def _float32_repr(x: float) -> float:
    # GGUF stores float32 (1e-5 reads back as 9.99999974e-06); keep the shortest float32 repr.
    return float(str(np.float32(x)))


def _llama_config(meta: dict[str, Any], reader, dtype: str) -> dict[str, Any]:
    def get(key: str, default: Any = KeyError) -> Any:
        if f"llama.{key}" in meta:
            return meta[f"llama.{key}"]
        if default is KeyError:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        return default

    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"GGUF llama.rope.scaling.type={scaling!r} is not supported")
    hidden, n_head = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_head))
    rotary = int(get("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ValueError(
            f"GGUF llama.rope.dimension_count={rotary} != head dim {head_dim}: "
            "partial rotary is not supported"
        )
    names = {t.name for t in reader.tensors}
    vocab = int(get("vocab_size", len(meta["tokenizer.ggml.tokens"])))
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": any(n.endswith("attn_q.bias") for n in names),
        "attention_dropout": 0.0,
        "bos_token_id": None if ids["bos"] is None else int(ids["bos"]),
        "dtype": dtype,
        "eos_token_id": None if ids["eos"] is None else int(ids["eos"]),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(get("feed_forward_length")),
        "max_position_embeddings": int(get("context_length")),
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": n_head,
        "num_hidden_layers": int(get("block_count")),
        "num_key_value_heads": int(get("attention.head_count_kv", n_head)),
        "pad_token_id": None if ids["padding"] is None else int(ids["padding"]),
        "pretraining_tp": 1,
        "rms_norm_eps": _float32_repr(get("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {
            "rope_theta": _float32_repr(get("rope.freq_base", 10000.0)),
            "rope_type": "default",
        },
        "tie_word_embeddings": "output.weight" not in names,
        "use_cache": True,
        "vocab_size": vocab,
    }


# ----------------------------------------------------------------------------- tensors


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no HF Llama counterpart (unsupported)")
    return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"


def _hf_tensors(reader, config: dict[str, Any], dtype: str) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    if dtype == "bfloat16":
        import ml_dtypes  # numpy has no bfloat16; ml_dtypes comes with jax

        np_dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        np_dtype = np.dtype(dtype)
    tensors = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        # dequantize returns numpy (row-major) shape, i.e. HF's (out, in) for matrices
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if ".attn_q." in t.name:
            w = unpermute_qk(w, config["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = unpermute_qk(w, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(w.astype(np_dtype))
    emb = tensors["model.embed_tokens.weight"]
    if emb.shape[0] != config["vocab_size"]:
        raise ValueError(
            f"GGUF token_embd has {emb.shape[0]} rows, vocab_size is {config['vocab_size']}"
        )
    return tensors


# ----------------------------------------------------------------------------- tokenizer


def _tokenizer_files(meta: dict[str, Any]) -> tuple[str, dict[str, Any], str | None]:
    """(tokenizer.json text, tokenizer_config dict, chat template or None)."""
    from gguf.constants import TokenType
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer.ggml.model={kind!r}: only byte-level BPE ('gpt2') is supported"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = Tokenizer(bpe)

    pre = meta.get("tokenizer.ggml.pre", "default")
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    if pre in _GPT2_PRE:
        splits = [pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True)]
    elif pre in _DIGITS_GPT2_PRE:
        splits = [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True),
        ]
    elif pre in ("llama-bpe", "llama3"):
        splits = [
            pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False),
        ]
    else:
        raise ValueError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported")
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()

    def token_of(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    bos = token_of("bos")
    post = [processors.ByteLevel(trim_offsets=False)]
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        post.append(
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
            )
        )
    tok.post_processor = processors.Sequence(post) if len(post) > 1 else post[0]

    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if int(ty) == TokenType.CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types)
            if int(ty) == TokenType.USER_DEFINED
        ]
    )

    tokenizer_config: dict[str, Any] = {
        "backend": "tokenizers",
        "tokenizer_class": "TokenizersBackend",
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        value = token_of(key)
        if value is not None:
            tokenizer_config[f"{name}_token"] = value
    chat_template = meta.get("tokenizer.chat_template")
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    return tok.to_str(pretty=True), dict(sorted(tokenizer_config.items())), chat_template
