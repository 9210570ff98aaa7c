"""Pre-flight check of an HF model folder: everything a load would trip on, without loading it.

Owns :func:`check_hf_folder`, called by :func:`jgrpo.models.sources.check_model_path` before
any model work starts. It reads only small things, imports neither jax nor transformers, and
raises :class:`ConfigError` with one line naming the file and what is wrong:
- config.json: UTF-8 JSON, a mapping, a supported model_type (checked first), positive
  integer sizes, heads that divide;
- weights: model.safetensors or the index and every shard it names; each header parses, its
  dtypes are ones the loader reads, its data offsets fit the file (a truncated download), and
  every tensor the decoder needs has the shape config.json implies (:func:`hf_tensor_shapes`);
- tokenizer: tokenizer.json loads with `tokenizers`, turns a sample prompt into at least one
  token, and every id it gives is below config.json's vocab_size; the other small JSON files
  (`_SMALL_JSON`: tokenizer_config, special_tokens_map, generation_config, ...) are objects;
- length: rollout.prompt_bucket + rollout.max_new_tokens fits max_position_embeddings.
Tensor names and shapes are the HF side of ``hf._layer_map``; the loader re-checks them."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Optional

from jgrpo.config import ConfigError, read_json
from jgrpo.models import moe_hf

_ST_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
"""safetensors dtypes the loader (hf.read_safetensors) reads, and their sizes in bytes."""
_MAX_HEADER = 100 * 2**20  # the safetensors format's own limit on the JSON header
_SAMPLE_PROMPT = "What is 12+34? Answer: 46"
_SMALL_JSON = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
    "generation_config.json",
)
"""JSON files of a model folder that must parse as objects when present."""
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **moe_hf.MOE_FAMILIES,
}
"""config.json model_type -> the HF causal-LM class of every family the decoder implements."""


def _fail(path: Path, what: str) -> None:
    raise ConfigError(f"model.path: {str(path)!r} {what}")


def read_json_file(path: Path, kind: type | None = None) -> Any:
    """Parse a small JSON file of the model folder (:func:`jgrpo.config.read_json`)."""
    return read_json(path, "model.path", kind)


def read_hf_config(folder: Path) -> dict:
    """config.json of `folder`, checked (mapping, positive sizes, heads that divide)."""
    path = folder / "config.json"
    hf = read_json_file(path)
    if not isinstance(hf, dict):
        _fail(path, f"must hold a JSON object, got {type(hf).__name__}")
    if hf.get("model_type") not in FAMILIES:  # first: other families name their sizes otherwise
        _fail(path, unsupported_model_type(hf.get("model_type")))
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    ):
        value = hf.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _fail(path, f"needs a positive integer {key}, got {value!r}")
    for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            _fail(path, f"{key} must be a positive integer, got {value!r}")
        if value is not None and value < 1:
            _fail(path, f"{key} must be a positive integer, got {value!r}")
    heads, kv = (
        hf["num_attention_heads"],
        hf.get("num_key_value_heads") or hf["num_attention_heads"],
    )
    if heads % kv:
        _fail(path, f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if not hf.get("head_dim") and hf["hidden_size"] % heads:
        _fail(path, f"hidden_size {hf['hidden_size']} is not a multiple of num_attention_heads")
    return hf


def check_lora_targets(hf: dict | None, lora_cfg) -> None:
    """ConfigError (one line) when `model.lora` (on) targets modules the family of config.json
    `hf` cannot adapt (MoE models: attention only, `moe_hf.lora_target_error`); None: unknown
    yet (the load checks it)."""
    if hf is None or lora_cfg.rank == 0:
        return
    error = moe_hf.lora_target_error(hf.get("model_type"), lora_cfg.target_modules)
    if error:
        raise ConfigError(error)


def unsupported_model_type(family) -> str:
    """The one-line refusal of a config.json `model_type` outside FAMILIES."""
    return f"model_type {family!r} is not supported (supported: {', '.join(FAMILIES)})"


def bias_flags(hf: dict) -> dict[str, bool]:
    """Which projections carry biases, as transformers builds config.json's family: q/k/v
    (`attention_bias`), o (`o_bias`), gate/up/down (`mlp_bias`); TransformerConfig fields."""
    if hf.get("model_type") == "qwen2":  # Qwen2Config has no bias flags: q/k/v always, no o
        return {"attention_bias": True, "o_bias": False, "mlp_bias": False}
    attention = bool(hf.get("attention_bias", False))  # Llama, Qwen3(-MoE): q/k/v and o
    if hf.get("model_type") == "glm4_moe":  # GLM-4.5: q/k/v only, never o
        return {"attention_bias": attention, "o_bias": False, "mlp_bias": False}
    mlp = hf.get("model_type") == "llama" and bool(hf.get("mlp_bias", False))
    return {"attention_bias": attention, "o_bias": attention, "mlp_bias": mlp}


IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
"""Tensors of old checkpoints that nothing reads by design (recomputed from config.json)."""


def hf_tensor_shapes(hf: dict, head: str = "lm", present=()) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the decoder loads, from a config.json mapping; `head`
    lm: the LM head (unless tied), score: a one-label sequence-classification head. `present`
    (the folder's tensor names): an MoE layer whose experts it holds fused is read fused."""
    d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    n = hf["num_attention_heads"]
    k = hf.get("num_key_value_heads") or n
    h = hf.get("head_dim") or d // n
    family = hf.get("model_type")
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if head == "score":
        shapes["score.weight"] = (1, d)
    elif not hf.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, d)
    layer = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (n * h, d),
        "self_attn.k_proj.weight": (k * h, d),
        "self_attn.v_proj.weight": (k * h, d),
        "self_attn.o_proj.weight": (d, n * h),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    biases = bias_flags(hf)
    if biases["attention_bias"]:
        layer |= {
            "self_attn.q_proj.bias": (n * h,),
            "self_attn.k_proj.bias": (k * h,),
            "self_attn.v_proj.bias": (k * h,),
        }
    if biases["o_bias"]:
        layer["self_attn.o_proj.bias"] = (d,)
    if biases["mlp_bias"]:
        layer |= {"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (d,)}
    if family in ("qwen3", "qwen3_moe") or hf.get("use_qk_norm"):
        layer |= {"self_attn.q_norm.weight": (h,), "self_attn.k_norm.weight": (h,)}
    moe = family in moe_hf.MOE_FAMILIES
    if moe:  # the MLP tensors differ per layer (dense MLP or MoE block)
        try:
            moe_hf.check_moe_config(hf)
        except ValueError as e:
            raise ConfigError(f"model.path: config.json: {e}") from None
        layer = {name: s for name, s in layer.items() if not name.startswith("mlp.")}
    for i in range(hf["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
        if moe:
            fused = f"model.layers.{i}.mlp.experts.gate_up_proj" in present
            shapes |= {
                f"model.layers.{i}.{n}": s for n, s in moe_hf.moe_layer_shapes(hf, i, fused).items()
            }
    return shapes


def read_safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of one .safetensors file, after checking its header against its size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                _fail(path, f"is truncated ({size} bytes; not a safetensors file)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(_MAX_HEADER, size - 8):
                _fail(path, f"is not a safetensors file (header length {header_len}, file {size})")
            raw = fh.read(header_len)
    except OSError as e:
        _fail(path, f"cannot be read ({e.strerror})")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        _fail(path, "has a damaged safetensors header (not JSON)")
    if not isinstance(header, dict):
        _fail(path, "has a damaged safetensors header (not a JSON object)")
    data_len = size - 8 - header_len
    shapes = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = all(isinstance(x, int) and x >= 0 for x in [*shape, start, end])
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            _fail(path, f"has a damaged safetensors header entry for tensor {name!r}")
        if dtype not in _ST_ITEMSIZE:
            _fail(path, f"tensor {name!r} has dtype {dtype} (supported: {', '.join(_ST_ITEMSIZE)})")
        if end - start != math.prod(shape) * _ST_ITEMSIZE[dtype] or start > end:
            _fail(path, f"tensor {name!r}: data offsets do not match its shape {shape}")
        if end > data_len:
            _fail(
                path,
                f"is truncated: tensor {name!r} ends at byte {end} of {data_len} data bytes",
            )
        shapes[name] = tuple(shape)
    return shapes


def _weight_shapes(folder: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, Path]]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = read_json_file(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            _fail(index, "has no weight_map object of tensor name -> file")
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        _fail(folder, "has no model.safetensors or model.safetensors.index.json")
    shapes, where = {}, {}
    for name in files:
        path = folder / name
        if not path.is_file():
            _fail(index, f"names shard {name!r}, which does not exist")
        for tensor, shape in read_safetensors_header(path).items():
            shapes[tensor], where[tensor] = shape, path
    return shapes, where


def _check_tokenizer(folder: Path, vocab_size: int) -> None:
    path = folder / "tokenizer.json"
    for name in _SMALL_JSON:  # what AutoTokenizer and the exporter read besides tokenizer.json
        if (folder / name).is_file():
            read_json_file(folder / name, dict)
    if not path.is_file():
        if not any((folder / n).is_file() for n in ("tokenizer.model", "vocab.json")):
            _fail(folder, "has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
        return  # a slow-tokenizer folder: transformers checks it when it loads
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust loader raises a bare Exception
        _fail(path, f"does not load as a tokenizer ({str(e).splitlines()[0][:120]})")
    ids = tokenizer.encode(_SAMPLE_PROMPT, add_special_tokens=False).ids
    if not ids:
        _fail(path, f"turns the prompt {_SAMPLE_PROMPT!r} into zero tokens")
    if max(ids) >= vocab_size:
        _fail(path, f"gives token id {max(ids)}, past config.json's vocab_size {vocab_size}")


_PASSED: dict[tuple, dict] = {}
"""Folders that passed in this process, by (path, config.json and weights mtimes): the CLI's
pre-flight, train.check_run and setup each check, the work is done once."""


def _stamp(folder: Path) -> tuple:
    files = [folder / n for n in ("config.json", "model.safetensors", "tokenizer.json")]
    files.append(folder / "model.safetensors.index.json")
    return (str(folder.absolute()),) + tuple(
        (f.stat().st_mtime_ns, f.stat().st_size) if f.exists() else None for f in files
    )


def check_hf_folder(
    folder: str | Path, sequence_length: Optional[int] = None, head: str = "lm"
) -> dict:
    """Check HF folder `folder` as described in the module docstring; returns config.json.
    `head` as `hf_tensor_shapes` (score: a reward model, `check_reward_model_folder`)."""
    folder = Path(folder)
    stamp = (*_stamp(folder), head)
    if stamp in _PASSED:
        check_sequence_length(_PASSED[stamp], sequence_length, folder / "config.json")
        return _PASSED[stamp]
    hf = read_hf_config(folder)
    shapes, where = _weight_shapes(folder)
    wanted = hf_tensor_shapes(hf, head, shapes)
    extra = moe_hf.unused_extra_layers(hf.get("model_type"), hf["num_hidden_layers"], shapes)
    wanted |= {name: shapes[name] for name in extra}  # GLM's MTP layer: never run (moe_hf)
    for name, want in wanted.items():
        if name not in shapes:
            _fail(folder, f"lacks tensor {name!r} (config.json: {hf['num_hidden_layers']} layers)")
        if shapes[name] != want:
            _fail(
                where[name],
                f"tensor {name!r} has shape {list(shapes[name])}, config.json implies {list(want)}",
            )
    tied = head == "lm" and hf.get("tie_word_embeddings", False)
    for name in sorted(shapes):  # strict: a tensor nothing reads is a flag we would drop silently
        if name in wanted or name.endswith(IGNORED_TENSOR_SUFFIXES):
            continue
        if not (tied and name == "lm_head.weight"):  # the loader checks it equals the embedding
            _fail(where[name], f"has tensor {name!r}, which nothing reads ({unread_hint(hf)})")
    _check_tokenizer(folder, hf["vocab_size"])
    _PASSED[stamp] = hf
    check_sequence_length(hf, sequence_length, folder / "config.json")
    return hf


def unread_hint(hf: dict) -> str:
    """What a tensor nothing reads means, for the one-line error."""
    flags = ", ".join(f"{k}={v}" for k, v in bias_flags(hf).items())
    return f"config.json model_type {hf.get('model_type')!r}, {flags}: a feature not implemented?"


def check_sequence_length(hf: dict, sequence_length: Optional[int], source: Any) -> None:
    """prompt_bucket + max_new_tokens must fit the model's max_position_embeddings."""
    limit = hf.get("max_position_embeddings")
    if sequence_length is not None and limit is not None and sequence_length > limit:
        raise ConfigError(
            f"rollout.prompt_bucket + rollout.max_new_tokens = {sequence_length} exceeds "
            f"max_position_embeddings {limit} of {str(source)!r}: lower rollout.max_new_tokens "
            f"(or rollout.prompt_bucket) so that they sum to at most {limit}"
        )


REWARD_MODEL_ARCHITECTURES = (
    "LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification",
)
"""config.json `architectures` a reward model (data.reward_functions[i].model) may declare."""


def check_reward_model_folder(folder: str | Path, key: str, max_length: Optional[int]) -> dict:
    """A reward model's folder (`key`: data.reward_functions[i]): a Llama / Qwen2 / Qwen3
    *ForSequenceClassification with one label (`score.weight` [1, hidden] in the safetensors
    header), `max_length` within its max_position_embeddings, and everything
    `check_hf_folder` checks. ConfigError naming `key` (one line, before any load); returns
    config.json."""
    folder = Path(folder)
    try:
        hf = read_hf_config(folder)
        archs = hf.get("architectures") or []
        if not archs or any(a not in REWARD_MODEL_ARCHITECTURES for a in archs):
            raise ConfigError(
                f"{str(folder)!r} is not a sequence-classification model (architectures "
                f"{archs}; allowed: {', '.join(REWARD_MODEL_ARCHITECTURES)})"
            )
        shapes, _ = _weight_shapes(folder)
        if "score.weight" not in shapes:
            raise ConfigError(
                f"{str(folder)!r} is not a sequence-classification model (no score.weight in "
                "its safetensors)"
            )
        labels = len(hf.get("id2label") or {}) or hf.get("num_labels", 2)
        if labels != 1 or shapes["score.weight"][0] != 1:
            raise ConfigError(
                f"{str(folder)!r} has num_labels {labels} (score.weight "
                f"{list(shapes['score.weight'])}); a reward model needs num_labels == 1"
            )
        limit = hf.get("max_position_embeddings")
        if max_length is None or limit is None or max_length <= limit:
            return check_hf_folder(folder, head="score")
    except ConfigError as e:
        message = str(e).removeprefix("model.path: ")
        raise ConfigError(f"{key}.model: {message}") from None
    raise ConfigError(
        f"{key}.max_length: {max_length} exceeds max_position_embeddings {limit} of {str(folder)!r}"
    )
