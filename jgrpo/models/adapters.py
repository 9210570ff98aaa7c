"""LoRA on whole models: attach adapters to a loaded base, split them off, merge them in, and
PEFT adapter folders out and in.

The adapter math and layout live in models/lora.py; this file works on `Transformer`s:
- `attach_lora(model, spec, key)`: the LoRA model over `model`'s own base arrays (no copy);
- `split_lora(model)`: (graphdef, trainable adapters, frozen base) as pure dicts, the trainer's
  two trees; `join_lora(graphdef, trainable, frozen)` rebuilds the model (to sample or export);
- `merge_lora(model)`: a plain Transformer with W + scale * A B in every targeted weight (what
  `jgrpo export` writes and transformers loads);
- `save_peft(model, folder)` / `load_peft(model, folder)`: PEFT's LoRA format
  (adapter_config.json + adapter_model.safetensors, keys
  `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight`
  [out, r], as peft 0.21 writes them for Llama / Qwen2 / Qwen3), which
  `peft.PeftModel.from_pretrained(hf_base, folder)` loads with the same logits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jgrpo.models import lora
from jgrpo.models.hf import (
    ModelFormatError,
    _layer_map,
    model_class,
    read_safetensors,
    write_safetensors,
)
from jgrpo.models.moe_transformer import MoETransformer
from jgrpo.models.transformer import Transformer

_PEFT_PREFIX = "base_model.model.model.layers"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _graphdef(cfg):
    return nnx.graphdef(nnx.eval_shape(lambda: model_class(cfg)(cfg, rngs=nnx.Rngs(0))))


def attach_lora(model: Transformer, spec: lora.LoRASpec, key) -> Transformer:
    """`model` (no adapters) with fresh adapters of `spec`; its base arrays are shared."""
    if model.cfg.lora is not None:
        raise ValueError("attach_lora: the model already has LoRA adapters")
    lora.check_targets(model.cfg, spec)
    cfg = dataclasses.replace(model.cfg, lora=spec)
    base = nnx.to_pure_dict(nnx.state(model))
    return nnx.merge(_graphdef(cfg), base, {"lora": lora.init_adapters(cfg, key)})


def split_lora(model: Transformer):
    """(graphdef, trainable, frozen): the adapters and the base as pure dicts."""
    graphdef, trainable, frozen = nnx.split(model, nnx.LoRAParam, ...)
    return graphdef, nnx.to_pure_dict(trainable), nnx.to_pure_dict(frozen)


def join_lora(graphdef, trainable, frozen=None) -> Transformer:
    """The model of the trainer's two trees, sharing their arrays: the `frozen` base (None:
    everything trains) and the `trainable` tree (the adapters), whose top-level keys are
    disjoint. The train step's sharding constraints and MoE expert parallelism (which name
    the trainer's mesh) are cleared: this model samples or exports on whatever devices its
    arrays are on."""
    model = nnx.merge(graphdef, trainable if frozen is None else frozen | trainable)
    model.activation_sharding = model.logit_shardings = model.context_parallel = None
    if isinstance(model, MoETransformer):
        model.expert_parallel = None
    return model


def merge_lora(model: Transformer) -> Transformer:
    """A plain Transformer whose targeted weights hold W + scale * A B (float32 merge, cast to
    the base dtype); the model itself is unchanged."""
    spec = model.cfg.lora
    if spec is None:
        return model
    params = nnx.to_pure_dict(nnx.state(model))
    adapters = params.pop("lora")
    params["layers"] = lora.merge_stacked(params["layers"] | adapters, spec)
    return nnx.merge(_graphdef(dataclasses.replace(model.cfg, lora=None)), params)


def _module_paths(cfg) -> dict[str, str]:
    """Our weight name -> HF module path under `model.layers.{i}` (e.g. `self_attn.q_proj`)."""
    return {ours: suffix.removesuffix(".weight") for ours, suffix, _, _ in _layer_map(cfg)}


def save_peft(model: Transformer, path, base_model_name_or_path: str | None = None) -> Path:
    """Write the adapters of `model` as a PEFT LoRA folder."""
    cfg, spec = model.cfg, model.cfg.lora
    if spec is None:
        raise ValueError("save_peft: the model has no LoRA adapters")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    adapters = {k: np.asarray(jax.device_get(v[...])) for k, v in model.lora.items()}
    paths, r = _module_paths(cfg), spec.rank
    tensors = {}
    for i in range(cfg.num_layers):
        for weight in spec.targets:
            prefix = f"{_PEFT_PREFIX}.{i}.{paths[weight]}"
            a_ir = adapters[lora.a_key(weight)][i].reshape(-1, r)  # [in, r]
            b_ro = adapters[lora.b_key(weight)][i].reshape(r, -1)  # [r, out]
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a_ir.T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b_ro.T)
    write_safetensors(folder / ADAPTER_WEIGHTS, tensors)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": spec.alpha,
        "target_modules": list(spec.target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def read_peft_spec(folder) -> lora.LoRASpec:
    """The LoRASpec of a PEFT folder; anything but plain LoRA on our modules is refused."""
    file = Path(folder) / ADAPTER_CONFIG
    if not file.is_file():
        raise ModelFormatError(f"{folder}: no {ADAPTER_CONFIG} (not a PEFT adapter folder)")
    c = json.loads(file.read_text())
    plain = {"bias": "none", "use_rslora": False, "use_dora": False}
    for key, want in plain.items():
        if c.get(key, want) != want:
            raise ModelFormatError(f"{file}: {key}={c[key]!r} is not supported (need {want!r})")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if c.get(key):
            raise ModelFormatError(f"{file}: {key} is not supported")
    targets = c["target_modules"]
    targets = [targets] if isinstance(targets, str) else targets
    unknown = sorted(set(targets) - set(lora.MODULES))
    if c.get("peft_type") != "LORA" or unknown:
        raise ModelFormatError(f"{file}: only LoRA on {', '.join(lora.MODULES)} is supported")
    modules = tuple(m for m in lora.MODULES if m in targets)
    return lora.LoRASpec(rank=int(c["r"]), alpha=float(c["lora_alpha"]), target_modules=modules)


def load_peft(model: Transformer, path) -> Transformer:
    """Base `model` (no adapters) with the adapters of the PEFT folder `path`."""
    folder = Path(path)
    spec = read_peft_spec(folder)
    cfg = dataclasses.replace(model.cfg, lora=spec)
    tensors = read_safetensors(folder / ADAPTER_WEIGHTS)
    paths = _module_paths(cfg)
    adapters = {}
    for name, (shape, _) in lora.adapter_layout(cfg).items():
        weight, kind = name.rsplit("_lora_", 1)
        per_layer = []
        for i in range(cfg.num_layers):
            key = f"{_PEFT_PREFIX}.{i}.{paths[weight]}.lora_{kind.upper()}.weight"
            if key not in tensors:
                raise ModelFormatError(f"{folder}: adapter has no tensor {key!r}")
            w = np.asarray(tensors[key], np.float32).T  # A: [in, r]; B: [r, out]
            per_layer.append(w.reshape(shape[1:]))
        adapters[name] = np.stack(per_layer)
    base = nnx.to_pure_dict(nnx.state(model))
    return nnx.merge(_graphdef(cfg), base, {"lora": jax.tree.map(jax.numpy.asarray, adapters)})
