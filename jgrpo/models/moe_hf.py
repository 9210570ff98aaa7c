"""The HF side of the MoE families: config.json keys <-> MoE fields, tensor names and shapes.

Families: `qwen3_moe` (Qwen3MoeForCausalLM: softmax router, `mlp_only_layers` and
`decoder_sparse_step` place dense MLP layers) and `glm4_moe` (Glm4MoeForCausalLM: the
DeepSeek-V3 sigmoid router with `e_score_correction_bias`, groups and routed scaling, shared
experts, the first `first_k_dense_replace` layers dense, partial rotary). Experts are read in
the per-expert layout HF checkpoints ship (`mlp.experts.{j}.gate_proj.weight` ...) or the fused
one transformers 5 holds in memory (`mlp.experts.gate_up_proj` [e, 2f, d], `mlp.experts.down_proj`
[e, d, f]); written per expert (what `save_pretrained` writes: both transformers 4 and 5 load
it). GLM's multi-token-prediction layers (index num_hidden_layers and up) are not read, as in
transformers. No jax: the pre-flight (jgrpo.models.preflight) reads the shapes here."""

from __future__ import annotations

from typing import Any

import numpy as np

MOE_FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
"""HF model_type -> architecture of the MoE families."""
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
"""PEFT module names that may carry LoRA adapters on an MoE model: attention only (no adapters
on the experts, the router, the shared experts or the dense MLP layers; docs/moe.md)."""


def lora_target_error(model_type, target_modules) -> str | None:
    """The one-line refusal of LoRA `target_modules` an MoE family cannot adapt (None: fine;
    dense families take every module)."""
    extra = [m for m in target_modules if m not in LORA_MODULES]
    if model_type not in MOE_FAMILIES or not extra:
        return None
    return (
        f"model.lora.target_modules: {extra} are not supported on {model_type} (MoE: adapters "
        f"on attention only, not on the experts or MLPs; allowed: {', '.join(LORA_MODULES)})"
    )


def _num_experts(hf: dict) -> int:
    if hf["model_type"] == "glm4_moe":
        return int(hf.get("n_routed_experts", hf.get("num_local_experts", 128)))
    return int(hf.get("num_experts", hf.get("num_local_experts", 0)))


def sparse_layers(hf: dict) -> tuple[bool, ...]:
    """Per decoder layer of an MoE config.json: True = MoE block, False = dense MLP."""
    n = hf["num_hidden_layers"]
    if hf["model_type"] == "glm4_moe":
        first = int(hf.get("first_k_dense_replace", 1))
        return tuple(i >= first for i in range(n))
    dense = set(hf.get("mlp_only_layers") or ())
    step = int(hf.get("decoder_sparse_step", 1))
    experts = _num_experts(hf)
    return tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n))


def partial_rotary_factor(hf: dict) -> float:
    """The rotated fraction of head_dim (glm4_moe defaults to 0.5, as transformers does)."""
    rope = hf.get("rope_parameters") or {}
    default = 0.5 if hf["model_type"] == "glm4_moe" else 1.0
    return float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", default)))


def check_moe_config(hf: dict) -> None:
    """ValueError (one line naming the key and what is supported) for an MoE variant this
    decoder does not implement."""
    family = hf["model_type"]
    for key in ("moe_intermediate_size", "num_experts_per_tok"):
        value = hf.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{family} needs a positive integer {key}, got {value!r}")
    if family == "qwen3_moe" and hf.get("attention_bias"):
        raise ValueError("qwen3_moe with attention_bias=true is not supported (o_proj bias)")
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (allowed: silu)")
    e, k = _num_experts(hf), int(hf.get("num_experts_per_tok", 0))
    if not 1 <= k <= e:
        raise ValueError(f"{family}: num_experts_per_tok {k} must be in 1..{e} (the experts)")
    if family == "glm4_moe":
        groups, topk_groups = int(hf.get("n_group", 1)), int(hf.get("topk_group", 1))
        if e % groups or (groups > 1 and e // groups < 2):
            raise ValueError(f"glm4_moe: n_group {groups} must split {e} experts into groups of 2+")
        if not 1 <= topk_groups <= groups:
            raise ValueError(f"glm4_moe: topk_group {topk_groups} must be in 1..n_group {groups}")
        if topk_groups * (e // groups) < k:
            raise ValueError(f"glm4_moe: topk_group x experts per group < num_experts_per_tok {k}")
        factor = partial_rotary_factor(hf)
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        if int(head_dim * factor) % 2 or int(head_dim * factor) < 2:
            raise ValueError(f"glm4_moe: partial_rotary_factor {factor} gives an odd rotary dim")


def moe_spec_fields(hf: dict) -> dict[str, Any]:
    """`jgrpo.models.moe.MoESpec` fields of an MoE config.json (checked first)."""
    check_moe_config(hf)
    fields: dict[str, Any] = dict(
        num_experts=_num_experts(hf),
        top_k=int(hf["num_experts_per_tok"]),
        expert_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", hf["model_type"] == "glm4_moe")),
        sparse_layers=sparse_layers(hf),
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
    )
    if hf["model_type"] == "glm4_moe":
        fields.update(
            router="sigmoid",
            num_groups=int(hf.get("n_group", 1)),
            topk_groups=int(hf.get("topk_group", 1)),
            routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
            shared_size=int(hf["moe_intermediate_size"]) * int(hf.get("n_shared_experts", 1)),
        )
    return fields


def moe_config_to_hf(cfg) -> dict[str, Any]:
    """The MoE keys of config.json for an MoE TransformerConfig `cfg` (its `moe` spec)."""
    spec = cfg.moe
    if cfg.family == "glm4_moe":
        dense = spec.sparse_layers.index(True) if True in spec.sparse_layers else cfg.num_layers
        return {
            "n_routed_experts": spec.num_experts,
            "num_experts_per_tok": spec.top_k,
            "moe_intermediate_size": spec.expert_size,
            "n_shared_experts": spec.shared_size // spec.expert_size,
            "n_group": spec.num_groups,
            "topk_group": spec.topk_groups,
            "routed_scaling_factor": spec.routed_scaling,
            "norm_topk_prob": spec.norm_topk_prob,
            "first_k_dense_replace": dense,
            "use_qk_norm": cfg.qk_norm,
            "attention_bias": cfg.attention_bias,
            "num_nextn_predict_layers": 0,
        }
    return {
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.top_k,
        "moe_intermediate_size": spec.expert_size,
        "norm_topk_prob": spec.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, s in enumerate(spec.sparse_layers) if not s],
        "router_aux_loss_coef": spec.aux_loss_coef,
        "attention_bias": False,
    }


def moe_layer_shapes(hf: dict, layer: int, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """HF per-layer suffix -> shape of the MLP tensors of decoder layer `layer` (dense MLP or
    MoE block; experts per expert, or in transformers 5's fused layout when `fused`)."""
    d = hf["hidden_size"]
    if not sparse_layers(hf)[layer]:
        f = hf["intermediate_size"]
        return {
            "mlp.gate_proj.weight": (f, d),
            "mlp.up_proj.weight": (f, d),
            "mlp.down_proj.weight": (d, f),
        }
    e, f = _num_experts(hf), hf["moe_intermediate_size"]
    shapes = {"mlp.gate.weight": (e, d)}
    if fused:
        shapes |= {"mlp.experts.gate_up_proj": (e, 2 * f, d), "mlp.experts.down_proj": (e, d, f)}
    for j in range(0 if fused else e):
        shapes |= {
            f"mlp.experts.{j}.gate_proj.weight": (f, d),
            f"mlp.experts.{j}.up_proj.weight": (f, d),
            f"mlp.experts.{j}.down_proj.weight": (d, f),
        }
    if hf["model_type"] == "glm4_moe":
        fs = f * int(hf.get("n_shared_experts", 1))
        shapes |= {
            "mlp.gate.e_score_correction_bias": (e,),
            "mlp.shared_experts.gate_proj.weight": (fs, d),
            "mlp.shared_experts.up_proj.weight": (fs, d),
            "mlp.shared_experts.down_proj.weight": (d, fs),
        }
    return shapes


# ----------------------------------------------------------------------------- tensors


def unused_extra_layers(family: str, num_layers: int, names) -> list[str]:
    """Of tensor `names`, GLM's multi-token-prediction layers (`model.layers.{i}.*` with i >=
    num_hidden_layers): the forward never runs them; transformers ignores them too."""
    if family != "glm4_moe":
        return []
    out = []
    for name in names:
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[2].isdigit():
            if int(parts[2]) >= num_layers:
                out.append(name)
    return out


def _experts_of_layer(take, prefix: str, e: int, tensors: dict):
    """(gate [e, d, f], up [e, d, f], down [e, f, d]) of one MoE layer, per-expert or fused."""
    fused = prefix + "mlp.experts.gate_up_proj"
    if fused in tensors:
        gate_up = np.asarray(take(fused))  # [e, 2f, d]
        f = gate_up.shape[1] // 2
        down = np.asarray(take(prefix + "mlp.experts.down_proj"))  # [e, d, f]
        return (
            np.swapaxes(gate_up[:, :f], 1, 2),
            np.swapaxes(gate_up[:, f:], 1, 2),
            np.swapaxes(down, 1, 2),
        )
    parts = [
        np.stack([np.asarray(take(f"{prefix}mlp.experts.{j}.{name}.weight")).T for j in range(e)])
        for name in ("gate_proj", "up_proj", "down_proj")
    ]
    return tuple(parts)


def moe_weights_from_hf(cfg, take, tensors: dict) -> dict[str, dict]:
    """{"dense_mlp": {name: [l_dense, ...]}, "moe": {name: [l_moe, ...]}} numpy arrays in our
    layout from HF tensors; `take(name)` returns a tensor or raises naming the missing one."""
    spec = cfg.moe
    dense: dict[str, list] = {"gate": [], "up": [], "down": []}
    experts: dict[str, list] = {}
    for i, sparse in enumerate(spec.sparse_layers):
        pre = f"model.layers.{i}."
        if not sparse:
            for name in dense:
                dense[name].append(np.asarray(take(f"{pre}mlp.{name}_proj.weight")).T)
            continue
        gate, up, down = _experts_of_layer(take, pre, spec.num_experts, tensors)
        layer = {
            "router": np.asarray(take(pre + "mlp.gate.weight")).T,
            "expert_gate": gate,
            "expert_up": up,
            "expert_down": down,
        }
        if spec.router == "sigmoid":
            layer["router_bias"] = np.asarray(take(pre + "mlp.gate.e_score_correction_bias"))
        if spec.shared_size:
            for name in ("gate", "up", "down"):
                w = take(f"{pre}mlp.shared_experts.{name}_proj.weight")
                layer[f"shared_{name}"] = np.asarray(w).T
        for name, w in layer.items():
            experts.setdefault(name, []).append(w)
    out = {}
    if dense["gate"]:
        out["dense_mlp"] = {name: np.stack(ws) for name, ws in dense.items()}
    if experts:
        out["moe"] = {name: np.stack(ws) for name, ws in experts.items()}
    return out


def moe_weights_to_hf(cfg, dense: dict, experts: dict) -> dict:
    """HF-named numpy tensors (per-expert layout) of the stacked `dense` / `experts` arrays."""
    spec, out, index = cfg.moe, {}, {False: 0, True: 0}
    c = np.ascontiguousarray
    for i, sparse in enumerate(spec.sparse_layers):
        pre, j = f"model.layers.{i}.", index[sparse]
        index[sparse] += 1
        if not sparse:
            for name in ("gate", "up", "down"):
                out[f"{pre}mlp.{name}_proj.weight"] = c(dense[name][j].T)
            continue
        out[pre + "mlp.gate.weight"] = c(experts["router"][j].T)
        if spec.router == "sigmoid":
            out[pre + "mlp.gate.e_score_correction_bias"] = c(experts["router_bias"][j])
        for x in range(spec.num_experts):
            for name in ("gate", "up", "down"):
                w = experts[f"expert_{name}"][j, x]
                out[f"{pre}mlp.experts.{x}.{name}_proj.weight"] = c(w.T)
        if spec.shared_size:
            for name in ("gate", "up", "down"):
                out[f"{pre}mlp.shared_experts.{name}_proj.weight"] = c(
                    experts[f"shared_{name}"][j].T
                )
    return out
