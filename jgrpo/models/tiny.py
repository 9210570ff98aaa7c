"""The built-in tiny models: a deterministic random Qwen2, two MoE models, and their
character-level tokenizer.

Owns what `builtin:tiny-qwen2` and `builtin:tiny-qwen2-chat` (ChatML and tool tokens, the
tool-aware template of jgrpo.models.chat_template) are made of and the tiny shapes tests and
tools build: :func:`tiny_model_fields` (TransformerConfig fields of the tiny shape),
:func:`tiny_qwen2_config` (its HF config.json), :func:`tiny_qwen2_weights` (seeded weights, HF
names), :func:`build_tiny_model` (the whole HF folder, written atomically), the MoE
built-ins `builtin:tiny-qwen3-moe` and `builtin:tiny-glm4-moe` (:func:`tiny_qwen3_moe_config`,
:func:`tiny_glm4_moe_config`, :func:`tiny_moe_weights` and their builders) and
:func:`char_tokenizer` / :func:`save_char_tokenizer` (one token per byte). The same (seed,
chat, overrides) give the same bytes; :data:`TINY_VERSION` names the bytes of the defaults (the
cache folders of the built-ins, jgrpo.models.sources, carry it). numpy and tokenizers only
(and jgrpo.models.moe_hf, numpy too): no jax, torch or transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from jgrpo.files import atomic_folder, write_json

TINY_VERSION = 2
"""Bump whenever build_tiny_model's output for the defaults changes (2: 2048 positions)."""

CHAR_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
"""Special tokens of the tiny model's tokenizer: ids 0..3; byte b is id 4 + b."""
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
"""`chat=True`: ChatML's special tokens, ids 260, 261 (<|im_end|> is the EOS)."""
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""`chat=True`: ids 262..265, added but not special (decoding keeps them), as in Qwen."""

# Init scales of the tiny model: large enough that logits are O(1) (std ~1), unlike the
# 0.02 of real inits that makes a random model's distribution uniform to 1e-3.
_EMBED_STD = 0.15  # logits = rmsnorm(h) @ E^T ~ sqrt(d) * std = 1.2 at d = 64
_BIAS_STD = 0.1
_NORM_JITTER = 0.05  # norm weights 1 + N(0, 0.05): parity tests see a mis-applied norm


def _byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable stand-in of each byte, indexed by byte value."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(moved)) for b in range(256)]


def _char_vocab(chat: bool = False) -> list[str]:
    extra = [*CHAT_TOKENS, *TOOL_TOKENS] if chat else []
    return [*CHAR_SPECIAL_TOKENS, *_byte_symbols(), *extra]


def char_tokenizer(chat: bool = False):
    """The tiny model's `tokenizers.Tokenizer`: one token per byte, so one per ASCII char.

    ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3, then byte b -> 4 + b (260 in all). Decoding
    round-trips any text exactly (NFC-normalised; ASCII is unchanged); nothing is added around
    the text. It is a byte-level BPE without merges on purpose: transformers 5 loads every
    `qwen2` folder as Qwen2Tokenizer, which rebuilds the pipeline from the vocab as byte-level
    BPE (NFC, split, ByteLevel); this tokenizer is exactly what that rebuild gives, so
    `tokenizers` and `AutoTokenizer` agree. (A WordLevel char vocab loses spaces there.)
    `chat=True` adds ChatML's and Qwen's tool tokens (CHAT_TOKENS, TOOL_TOKENS): each is one
    token wherever it appears, so the tokenization of a concatenation is the concatenation of
    the tokenizations (multi-turn reply ids rely on it).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate(_char_vocab(chat))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in CHAR_SPECIAL_TOKENS]
    )
    if chat:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_TOKENS])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok


def save_char_tokenizer(out: str | Path, *, model_max_length: int = 256, chat: bool = False):
    """Write tokenizer.json + tokenizer_config.json of :func:`char_tokenizer` into folder `out`.

    The config is what transformers 5's PreTrainedTokenizerFast.save_pretrained writes, so
    `AutoTokenizer.from_pretrained(out)` loads it. No chat template, unless `chat`: then the EOS
    is <|im_end|> and the config holds the tool-aware ChatML template
    (`jgrpo.models.chat_template.TOOL_CHAT_TEMPLATE`).
    """
    from jgrpo.models.chat_template import TOOL_CHAT_TEMPLATE

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(char_tokenizer(chat).to_str(pretty=True))
    chat_fields = {"chat_template": TOOL_CHAT_TEMPLATE} if chat else {}
    write_json(
        out / "tokenizer_config.json",
        {
            "backend": "tokenizers",
            "tokenizer_class": "TokenizersBackend",
            "bos_token": "<bos>",
            "eos_token": CHAT_TOKENS[1] if chat else "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            **chat_fields,
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


def tiny_qwen2_config(*, chat: bool = False, **overrides: Any) -> dict[str, Any]:
    """config.json of the tiny Qwen2 (as transformers 5 writes it), with field overrides.

    Overridable: hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    intermediate_size, vocab_size, max_position_embeddings, rope_theta, rms_norm_eps,
    tie_word_embeddings. `chat`: the vocabulary of `char_tokenizer(chat=True)`, EOS <|im_end|>.
    """
    size = len(_char_vocab(chat))
    fields: dict[str, Any] = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=-(-size // 8) * 8,
        max_position_embeddings=2048,  # the default lengths fit (a config need not shrink them)
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(f"tiny_qwen2_config: unknown fields {unknown}; allowed {sorted(fields)}")
    fields.update(overrides)
    if fields["vocab_size"] < size:
        raise ValueError(f"vocab_size {fields['vocab_size']} < tokenizer size {size}")
    if fields["hidden_size"] % fields["num_attention_heads"]:
        raise ValueError("hidden_size must be a multiple of num_attention_heads")
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    n_layers = fields["num_hidden_layers"]
    ids = {t: CHAR_SPECIAL_TOKENS.index(t) for t in ("<bos>", "<eos>", "<pad>")}
    if chat:
        ids["<eos>"] = _char_vocab(chat).index(CHAT_TOKENS[1])
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
    out: str | Path, seed: int = 0, *, overwrite: bool = False, chat: bool = False, **overrides
) -> Path:
    """Write a tiny random Qwen2 HF folder (config, weights, char tokenizer) to `out`.

    `overrides` are :func:`tiny_qwen2_config` fields (e.g. num_hidden_layers=4); `chat` gives
    it the ChatML tokenizer with the tool-aware template (`builtin:tiny-qwen2-chat`). The same
    (seed, chat, overrides) give the same bytes. Raises FileExistsError if `out` exists.
    """
    config = tiny_qwen2_config(chat=chat, **overrides)
    return write_tiny_folder(out, config, tiny_qwen2_weights(config, seed), overwrite, chat)


def write_tiny_folder(out, config: dict, weights: dict, overwrite: bool, chat: bool) -> Path:
    """An HF folder at `out`: config.json, generation_config.json, model.safetensors and the
    char tokenizer (`chat`: the ChatML one); written atomically (FileExistsError if `out`
    exists and not `overwrite`)."""
    import safetensors.numpy

    with atomic_folder(out, overwrite=overwrite) as tmp:
        write_json(tmp / "config.json", config)
        write_json(
            tmp / "generation_config.json",
            {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        )
        safetensors.numpy.save_file(
            weights, str(tmp / "model.safetensors"), metadata={"format": "pt"}
        )
        save_char_tokenizer(tmp, model_max_length=config["max_position_embeddings"], chat=chat)
    return Path(out)


def tiny_qwen3_moe_config() -> dict[str, Any]:
    """config.json of `builtin:tiny-qwen3-moe`: the tiny Qwen2's shape and char tokenizer as a
    Qwen3-MoE (q/k norms, no biases), both layers MoE: 8 experts of width 32, top-2,
    renormalised gates, router_aux_loss_coef 0.001."""
    base = tiny_qwen2_config()
    drop = ("max_window_layers", "sliding_window", "use_sliding_window", "layer_types")
    config = {k: v for k, v in base.items() if k not in drop}
    config.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        head_dim=base["hidden_size"] // base["num_attention_heads"],
        attention_bias=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
    )
    return config


def tiny_moe_weights(config: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic random float32 weights with HF names (per-expert layout) for the config
    of :func:`tiny_qwen3_moe_config` or :func:`tiny_glm4_moe_config`, scaled as
    :func:`tiny_qwen2_weights`'; the router N(0, 1/d) so routing is far from uniform, GLM's
    selection bias N(0, 0.3^2) so it changes choices. GLM adds q/k/v biases, a dense first
    layer, the bias and a shared expert; Qwen3-MoE draws in the same order as before them."""
    from jgrpo.models.moe_hf import sparse_layers

    rng = np.random.default_rng(seed)
    d, f = config["hidden_size"], config["moe_intermediate_size"]
    glm = config["model_type"] == "glm4_moe"
    e = config["n_routed_experts"] if glm else config["num_experts"]
    h = config["head_dim"]
    qd, kd = config["num_attention_heads"] * h, config["num_key_value_heads"] * h

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def matrix(n_out: int, n_in: int) -> np.ndarray:
        return normal((n_out, n_in), n_in**-0.5)

    def norm(n: int) -> np.ndarray:
        return (1.0 + normal((n,), _NORM_JITTER)).astype(np.float32)

    def swiglu(prefix: str, width: int) -> None:
        w[prefix + "gate_proj.weight"] = matrix(width, d)
        w[prefix + "up_proj.weight"] = matrix(width, d)
        w[prefix + "down_proj.weight"] = matrix(d, width)

    w = {"model.embed_tokens.weight": normal((config["vocab_size"], d), _EMBED_STD)}
    for i, sparse in enumerate(sparse_layers(config)):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(d)
        for name, n_out in (("q", qd), ("k", kd), ("v", kd)):
            w[p + f"self_attn.{name}_proj.weight"] = matrix(n_out, d)
            if config.get("attention_bias"):
                w[p + f"self_attn.{name}_proj.bias"] = normal((n_out,), _BIAS_STD)
        w[p + "self_attn.o_proj.weight"] = matrix(d, qd)
        if not glm or config.get("use_qk_norm"):
            w[p + "self_attn.q_norm.weight"] = norm(h)
            w[p + "self_attn.k_norm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        if not sparse:
            swiglu(p + "mlp.", config["intermediate_size"])
            continue
        w[p + "mlp.gate.weight"] = matrix(e, d)
        if glm:
            w[p + "mlp.gate.e_score_correction_bias"] = normal((e,), 0.3)
        for j in range(e):
            swiglu(p + f"mlp.experts.{j}.", f)
        if glm:
            swiglu(p + "mlp.shared_experts.", f * config["n_shared_experts"])
    w["model.norm.weight"] = norm(d)
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = normal((config["vocab_size"], d), _EMBED_STD)
    return w


def build_tiny_moe_model(out: str | Path, seed: int = 0, *, overwrite: bool = False) -> Path:
    """Write `builtin:tiny-qwen3-moe` (config, weights, char tokenizer) to `out`; same seed,
    same bytes. Raises FileExistsError if `out` exists."""
    config = tiny_qwen3_moe_config()
    return write_tiny_folder(out, config, tiny_moe_weights(config, seed), overwrite, False)


def tiny_glm4_moe_config() -> dict[str, Any]:
    """config.json of `builtin:tiny-glm4-moe`: the tiny Qwen2's shape and char tokenizer as a
    GLM-4.5-style MoE (the DeepSeek-V3 router): 2 layers, the first dense
    (`first_k_dense_replace` 1), the second 8 routed experts of width 32 in 4 groups, top-2
    from the 2 best groups, sigmoid scores with a selection bias, renormalised gates scaled by
    2.5, one shared expert; q/k/v biases, q/k norms, half of each head rotary."""
    base = tiny_qwen2_config()
    drop = ("max_window_layers", "sliding_window", "use_sliding_window", "layer_types")
    config = {k: v for k, v in base.items() if k not in drop}
    rope = {**base["rope_parameters"], "partial_rotary_factor": 0.5}
    config.update(
        architectures=["Glm4MoeForCausalLM"],
        model_type="glm4_moe",
        head_dim=base["hidden_size"] // base["num_attention_heads"],
        rope_parameters=rope,
        attention_bias=True,
        use_qk_norm=True,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
    )
    return config


def build_tiny_glm4_moe_model(out: str | Path, seed: int = 0, *, overwrite: bool = False) -> Path:
    """Write `builtin:tiny-glm4-moe` (config, weights, char tokenizer) to `out`; same seed,
    same bytes. Raises FileExistsError if `out` exists."""
    config = tiny_glm4_moe_config()
    return write_tiny_folder(out, config, tiny_moe_weights(config, seed), overwrite, False)
