"""HF folders in and out: config.json <-> TransformerConfig, safetensors <-> NNX parameters.

Reads both the old top-level `rope_theta` / `rope_scaling` keys and transformers 5's
`rope_parameters`; single-file and sharded (model.safetensors.index.json) checkpoints; float32
and bfloat16 tensors (safetensors is parsed directly, so bfloat16 needs no torch). Writes a
folder `transformers.AutoModelForCausalLM.from_pretrained` loads with the same logits, copying
tokenizer files from the source folder when there is one.

HF stores projections as [out, in]; we store [in, heads, head_dim] etc. (see transformer.py).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jgrpo.models import moe_hf
from jgrpo.models.moe import MoESpec
from jgrpo.models.moe_transformer import MoETransformer, MoETransformerConfig
from jgrpo.models.preflight import FAMILIES as _FAMILIES
from jgrpo.models.preflight import (
    IGNORED_TENSOR_SUFFIXES,
    bias_flags,
    unsupported_model_type,
)
from jgrpo.models.transformer import RopeScaling, Transformer, TransformerConfig

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)
_ST_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
}


class ModelFormatError(ValueError):
    """The HF folder describes something this model does not implement."""


# ----------------------------------------------------------------------------- config


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ModelFormatError(f"rope type {kind!r} is not supported (allowed: default, llama3)")
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def config_from_hf(
    hf: dict, dtype: str = "float32", param_dtype: str | None = None, **options
) -> TransformerConfig:
    """The TransformerConfig of an HF config.json dict. `dtype` is the compute dtype,
    `param_dtype` the storage dtype (None = `dtype`: a pure float32 or bfloat16 model);
    `options` are the remaining execution fields (remat, logprob_chunk_size, kernels,
    attention_block_size)."""
    family = hf.get("model_type")
    if family not in _FAMILIES:
        raise ModelFormatError(unsupported_model_type(family))
    if hf.get("use_sliding_window"):
        raise ModelFormatError("use_sliding_window=true is not supported")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ModelFormatError(f"hidden_act {act!r} is not supported (allowed: silu)")
    heads = hf["num_attention_heads"]
    theta, scaling = _rope(hf)
    cls, extra = TransformerConfig, {}
    if family in moe_hf.MOE_FAMILIES:  # the MoE decoder's fields (jgrpo.models.moe_hf)
        try:
            spec = MoESpec(**moe_hf.moe_spec_fields(hf))
        except ValueError as e:
            raise ModelFormatError(str(e)) from None
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        rotary = int(head_dim * moe_hf.partial_rotary_factor(hf))
        cls, extra = MoETransformerConfig, {"moe": spec, "rotary_dim": rotary}
    return cls(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **bias_flags(hf),
        qk_norm=family in ("qwen3", "qwen3_moe") or bool(hf.get("use_qk_norm")),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        dtype=dtype,
        param_dtype=param_dtype or dtype,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
        **extra,
        **options,
    )


def config_to_hf(cfg: TransformerConfig) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **vars(cfg.rope_scaling)}
    eos = list(cfg.eos_token_ids)
    hf = {
        "architectures": [_FAMILIES[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": cfg.pad_token_id,
        "dtype": cfg.param_dtype,
    }
    if cfg.family != "qwen2":
        hf["attention_bias"] = cfg.attention_bias
    if cfg.family == "llama":
        hf["mlp_bias"] = cfg.mlp_bias
    if isinstance(cfg, MoETransformerConfig):
        hf.update(moe_hf.moe_config_to_hf(cfg))
        if cfg.family == "glm4_moe":  # transformers' default when absent is 0.5
            rope["partial_rotary_factor"] = cfg.rope_dim / cfg.head_dim
    ours = {k: getattr(cfg, k) for k in ("attention_bias", "o_bias", "mlp_bias")}
    if bias_flags(hf) != ours:  # transformers would build other projections
        raise ModelFormatError(f"{cfg.family} has no config.json flags for the biases {ours}")
    return hf


# ----------------------------------------------------------------------------- safetensors


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Memory-mapped tensors of one .safetensors file (any of F32/F16/BF16/F64)."""
    with open(path, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ModelFormatError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        dtype = _ST_DTYPES[info["dtype"]]
        tensors[name] = data[start:end].view(dtype).reshape(info["shape"])
    return tensors


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    names = {v: k for k, v in _ST_DTYPES.items()}
    header, offset = {}, 0
    for name, arr in tensors.items():
        nbytes = arr.nbytes
        header[name] = {
            "dtype": names[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for arr in tensors.values():
            fh.write(np.ascontiguousarray(arr).tobytes())


def read_hf_weights(folder: Path) -> dict[str, np.ndarray]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ModelFormatError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    tensors = {}
    for name in files:
        tensors.update(read_safetensors(folder / name))
    return tensors


# ----------------------------------------------------------------------------- name mapping


def _layer_map(cfg: TransformerConfig):
    """(our stacked name, HF per-layer suffix, HF [out,in] -> our layout, our -> HF)."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    same = (lambda w: w, lambda w: w)
    rows = [
        ("attn_norm", "input_layernorm.weight", *same),
        ("mlp_norm", "post_attention_layernorm.weight", *same),
        (
            "q",
            "self_attn.q_proj.weight",
            lambda w: w.T.reshape(d, n, h),
            lambda w: w.reshape(d, n * h).T,
        ),
        (
            "k",
            "self_attn.k_proj.weight",
            lambda w: w.T.reshape(d, k, h),
            lambda w: w.reshape(d, k * h).T,
        ),
        (
            "v",
            "self_attn.v_proj.weight",
            lambda w: w.T.reshape(d, k, h),
            lambda w: w.reshape(d, k * h).T,
        ),
        (
            "o",
            "self_attn.o_proj.weight",
            lambda w: w.T.reshape(n, h, d),
            lambda w: w.reshape(n * h, d).T,
        ),
    ]
    if not isinstance(cfg, MoETransformerConfig):  # MoE MLPs: moe_hf.moe_weights_*
        rows += [
            ("gate", "mlp.gate_proj.weight", lambda w: w.T, lambda w: w.T),
            ("up", "mlp.up_proj.weight", lambda w: w.T, lambda w: w.T),
            ("down", "mlp.down_proj.weight", lambda w: w.T, lambda w: w.T),
        ]
    if cfg.attention_bias:
        rows += [
            ("q_bias", "self_attn.q_proj.bias", lambda w: w.reshape(n, h), lambda w: w.reshape(-1)),
            ("k_bias", "self_attn.k_proj.bias", lambda w: w.reshape(k, h), lambda w: w.reshape(-1)),
            ("v_bias", "self_attn.v_proj.bias", lambda w: w.reshape(k, h), lambda w: w.reshape(-1)),
        ]
    if cfg.o_bias:
        rows.append(("o_bias", "self_attn.o_proj.bias", *same))
    if cfg.mlp_bias:
        rows += [(f"{w}_bias", f"mlp.{w}_proj.bias", *same) for w in ("gate", "up", "down")]
    if cfg.qk_norm:
        rows += [
            ("q_norm", "self_attn.q_norm.weight", *same),
            ("k_norm", "self_attn.k_norm.weight", *same),
        ]
    return rows


def _take(tensors: dict, name: str, folder) -> np.ndarray:
    if name not in tensors:
        raise ModelFormatError(f"{folder}: checkpoint has no tensor {name!r}")
    return tensors[name]


def load_weights(
    model: Transformer, tensors: dict[str, np.ndarray], folder="checkpoint", also_read=()
) -> None:
    """Copy HF-named tensors into `model`'s parameters (cast to the storage dtype). Strict: a
    tensor that nothing reads (not the model's, not in `also_read`, the names a caller reads
    itself) is a ModelFormatError naming it, so no config.json flag is dropped silently."""
    cfg = model.cfg
    dtype = cfg.jnp_param_dtype
    unread = {
        name
        for name in tensors
        if name not in also_read and not name.endswith(IGNORED_TENSOR_SUFFIXES)
    }
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:  # a tied copy some exports keep
        if not np.array_equal(tensors["lm_head.weight"], tensors.get("model.embed_tokens.weight")):
            raise ModelFormatError(
                f"{folder}: lm_head.weight differs from model.embed_tokens.weight, but "
                "config.json has tie_word_embeddings=true"
            )
        unread.discard("lm_head.weight")

    def put(param, value):
        value = np.asarray(value)
        if value.shape != param[...].shape:
            raise ModelFormatError(
                f"{folder}: shape {value.shape} does not match the config's {param[...].shape}"
            )
        param[...] = jnp.asarray(value.astype(np.float32) if value.dtype != dtype else value, dtype)

    put(model.embed, _take(tensors, "model.embed_tokens.weight", folder))
    put(model.final_norm, _take(tensors, "model.norm.weight", folder))
    if not cfg.tie_word_embeddings:
        put(model.lm_head, _take(tensors, "lm_head.weight", folder).T)
    for ours, suffix, to_ours, _ in _layer_map(cfg):
        stacked = np.stack(
            [
                to_ours(np.asarray(_take(tensors, f"model.layers.{i}.{suffix}", folder)))
                for i in range(cfg.num_layers)
            ]
        )
        put(model.layers[ours], stacked)
    if isinstance(cfg, MoETransformerConfig):

        def take(name):
            unread.discard(name)
            return _take(tensors, name, folder)

        groups = moe_hf.moe_weights_from_hf(cfg, take, tensors)
        for group, arrays in groups.items():
            for name, value in arrays.items():
                put(getattr(model, group)[name], value)
        unread -= set(moe_hf.unused_extra_layers(cfg.family, cfg.num_layers, unread))
    unread -= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    unread -= {
        f"model.layers.{i}.{row[1]}" for row in _layer_map(cfg) for i in range(cfg.num_layers)
    }
    if unread:
        flags = ", ".join(
            f"{k}={getattr(cfg, k)}" for k in ("attention_bias", "o_bias", "mlp_bias")
        )
        raise ModelFormatError(
            f"{folder}: tensor {min(unread)!r} is read by nothing ({len(unread)} such tensors; "
            f"{cfg.family} with {flags}: a config.json feature not implemented?)"
        )


def export_weights(model: Transformer) -> dict[str, np.ndarray]:
    """HF-named numpy tensors of `model` (gathered to host)."""
    cfg = model.cfg

    def host(param):
        return np.asarray(jax.device_get(param[...]))

    out = {"model.embed_tokens.weight": host(model.embed)}
    for ours, suffix, _, to_hf in _layer_map(cfg):
        stacked = host(model.layers[ours])
        for i in range(cfg.num_layers):
            out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(to_hf(stacked[i]))
    if isinstance(cfg, MoETransformerConfig):
        groups = {g: getattr(model, g) or {} for g in ("dense_mlp", "moe")}
        arrays = {g: {n: host(p) for n, p in ps.items()} for g, ps in groups.items()}
        out.update(moe_hf.moe_weights_to_hf(cfg, arrays["dense_mlp"], arrays["moe"]))
    out["model.norm.weight"] = host(model.final_norm)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(host(model.lm_head).T)
    return out


# ----------------------------------------------------------------------------- folders


def read_hf_config(path, **kwargs) -> TransformerConfig:
    """The TransformerConfig of an HF folder's config.json (kwargs as `config_from_hf`)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ModelFormatError(f"{path}: no config.json (not an HF model folder)")
    return config_from_hf(json.loads(config_file.read_text()), **kwargs)


def from_pretrained(
    path, dtype: str = "float32", param_dtype: str | None = None, **options
) -> Transformer:
    """Load an HF folder (Llama / Qwen2 / Qwen3) into a Transformer; `dtype` is the compute
    dtype, `param_dtype` the storage dtype (None = `dtype`), `options` as `config_from_hf`."""
    folder = Path(path)
    cfg = read_hf_config(folder, dtype=dtype, param_dtype=param_dtype, **options)
    return model_from_tensors(cfg, read_hf_weights(folder), folder)


def model_from_tensors(
    cfg: TransformerConfig, tensors: dict, folder, also_read: tuple[str, ...] = ()
) -> Transformer:
    """A Transformer of `cfg` holding the HF-named `tensors` read from `folder` (no random
    init: the abstract model's parameters become zeros, then the tensors overwrite them).
    `also_read`: tensors the caller reads itself (a reward model's `score.weight`); any other
    tensor the decoder does not hold is an error (`load_weights`)."""
    model = nnx.eval_shape(lambda: model_class(cfg)(cfg, rngs=nnx.Rngs(0)))
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable) and isinstance(var.get_raw_value(), jax.ShapeDtypeStruct):
            abstract = var.get_raw_value()
            var.set_raw_value(jnp.zeros(abstract.shape, abstract.dtype))
    load_weights(model, tensors, folder, also_read)
    return model


def model_class(cfg: TransformerConfig) -> type[Transformer]:
    """The decoder class of `cfg`: MoETransformer for the MoE families, else Transformer."""
    return MoETransformer if isinstance(cfg, MoETransformerConfig) else Transformer


MAX_SHARD_BYTES = 5 * 2**30
"""save_pretrained splits the weights into shards of at most this many bytes (HF's default)."""


def _shards(tensors: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    """Consecutive groups of tensors of at most `max_bytes` each (a larger tensor stands alone)."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    return shards


def save_pretrained(
    model: Transformer, path, source=None, *, max_shard_bytes: int = MAX_SHARD_BYTES
) -> Path:
    """Write config.json + model.safetensors (or, past `max_shard_bytes`, shards
    model-0000i-of-0000n.safetensors + model.safetensors.index.json) + generation_config.json;
    copy tokenizer files (and the source's generation_config.json) from `source` if given."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = config_to_hf(model.cfg)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tensors = export_weights(model)
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        write_safetensors(folder / "model.safetensors", tensors)
    else:
        weight_map = {}
        for k, shard in enumerate(shards, 1):
            name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(folder / name, shard)
            weight_map.update(dict.fromkeys(shard, name))
        index = {
            "metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
            "weight_map": weight_map,
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if source is not None:
        for name in _TOKENIZER_FILES:
            if (Path(source) / name).is_file():
                shutil.copy2(Path(source) / name, folder / name)
    if not (folder / "generation_config.json").is_file():
        generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id") if k in hf_config}
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return folder
