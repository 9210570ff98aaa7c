"""LoRA adapters of the transformer's projections: their layout, init, forward delta and merge.

For a targeted projection y = x W (+ bias) with W [*in, *out] (PEFT's `lora.Linear`, dropout 0):
y = x W (+ bias) + scale * (x A) B, A [*in, r], B [r, *out], scale = alpha / r; A drawn like
PEFT (kaiming-uniform, a = sqrt(5)) and B = 0, so a fresh adapter leaves the model unchanged.
Adapters are stacked over layers ([l, *in, r], [l, r, *out]) as `nnx.LoRAParam`s in
`Transformer.lora` (so `nnx.split(model, nnx.LoRAParam, ...)` separates them from the frozen
base) and are always float32, whatever dtype the base is held in.

Sharding: an adapter's in/out dims carry the logical names of the base weight's dims and the
rank dim `lora_rank`, which no rule shards: adapters shard like the weight they adapt.
Two ways to run them, equal up to float rounding: training adds `add_delta` after each
targeted projection (unmerged: gradients reach A and B only); sampling folds scale * A B into
the inference weights once per generate call (`merge_layer`), so decode runs the base program.
The reference policy is the base: the forward with `use_lora=False` skips every adapter."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

MODULES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "q_proj": ("q", ("embed",), ("heads", "head_dim")),
    "k_proj": ("k", ("embed",), ("kv_heads", "head_dim")),
    "v_proj": ("v", ("embed",), ("kv_heads", "head_dim")),
    "o_proj": ("o", ("heads", "head_dim"), ("embed",)),
    "gate_proj": ("gate", ("embed",), ("mlp",)),
    "up_proj": ("up", ("embed",), ("mlp",)),
    "down_proj": ("down", ("mlp",), ("embed",)),
}
"""PEFT target-module name -> (our weight name, logical axes of its in dims, of its out dims)."""

RANK_AXIS = "lora_rank"
"""Logical name of the adapter rank dim (never sharded)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRASpec:
    """Which projections carry adapters, their rank and scale (hashable: part of the static
    TransformerConfig)."""

    rank: int
    """r >= 1."""
    alpha: float
    """scale = alpha / rank (PEFT's lora_alpha, use_rslora=False)."""
    target_modules: tuple[str, ...]
    """PEFT module names (keys of MODULES), in MODULES order."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def targets(self) -> tuple[str, ...]:
        """Our weight names of the targeted projections."""
        return tuple(MODULES[m][0] for m in self.target_modules)


def spec_from_config(lora_cfg) -> LoRASpec | None:
    """The LoRASpec of a `model.lora` config section (None when rank == 0: LoRA off)."""
    if lora_cfg.rank == 0:
        return None
    modules = tuple(m for m in MODULES if m in lora_cfg.target_modules)
    return LoRASpec(rank=lora_cfg.rank, alpha=float(lora_cfg.alpha), target_modules=modules)


def with_lora(model_cfg, lora_cfg):
    """Transformer config `model_cfg` carrying the LoRASpec of `model.lora` (None when off)."""
    spec = spec_from_config(lora_cfg)
    check_targets(model_cfg, spec)
    return dataclasses.replace(model_cfg, lora=spec)


def check_targets(model_cfg, spec: LoRASpec | None) -> None:
    """ConfigError when `spec` targets a projection the model's family cannot adapt (MoE:
    attention only, `moe_hf.lora_target_error`; the pre-flight checks it before any load)."""
    from jgrpo.config import ConfigError
    from jgrpo.models.moe_hf import lora_target_error

    error = None if spec is None else lora_target_error(model_cfg.family, spec.target_modules)
    if error:
        raise ConfigError(error)


def a_key(weight: str) -> str:
    return f"{weight}_lora_a"


def b_key(weight: str) -> str:
    return f"{weight}_lora_b"


def _dims(cfg) -> dict[str, int]:
    return {
        "embed": cfg.hidden_size,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "mlp": cfg.intermediate_size,
    }


def adapter_layout(cfg) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """{adapter key: (stacked shape, logical axes)} of `cfg.lora` on transformer config `cfg`."""
    spec, dims, l = cfg.lora, _dims(cfg), cfg.num_layers
    out = {}
    for module in spec.target_modules:
        weight, ins, outs = MODULES[module]
        in_shape, out_shape = tuple(dims[a] for a in ins), tuple(dims[a] for a in outs)
        out[a_key(weight)] = ((l, *in_shape, spec.rank), ("layers", *ins, RANK_AXIS))
        out[b_key(weight)] = ((l, spec.rank, *out_shape), ("layers", RANK_AXIS, *outs))
    return out


def init_adapters(cfg, key) -> dict[str, jax.Array]:
    """Fresh float32 adapters of `cfg.lora`: A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), B = 0."""
    out = {}
    for name, (shape, _) in adapter_layout(cfg).items():
        if name.endswith("_lora_a"):
            key, sub = jax.random.split(key)
            bound = 1.0 / math.sqrt(math.prod(shape[1:-1]))
            out[name] = jax.random.uniform(sub, shape, jnp.float32, -bound, bound)
        else:
            out[name] = jnp.zeros(shape, jnp.float32)
    return out


def make_adapter_params(cfg, rngs: nnx.Rngs) -> nnx.Dict:
    """The `Transformer.lora` attribute: one nnx.LoRAParam per adapter, with logical axes."""
    values = init_adapters(cfg, rngs.params())
    layout = adapter_layout(cfg)
    return nnx.Dict({k: nnx.LoRAParam(v, logical_axes=layout[k][1]) for k, v in values.items()})


def add_delta(y, p: dict, weight: str, x, spec: LoRASpec | None):
    """y + scale * (x A) B when layer params `p` hold an adapter of `weight`, else y itself.

    x [b, t, *in], y [b, t, *out]; computed in the activation dtype (adapters cast to it)."""
    if spec is None or a_key(weight) not in p:
        return y
    a, b = p[a_key(weight)].astype(x.dtype), p[b_key(weight)].astype(x.dtype)
    u_btr = jnp.tensordot(x, a, axes=a.ndim - 1)
    return y + (jnp.tensordot(u_btr, b, axes=1) * spec.scale).astype(y.dtype)


def merge_layer(p: dict, spec: LoRASpec | None) -> dict:
    """One layer's params with every adapter folded in: W + scale * A B (float32, then cast to
    W's dtype); the adapter entries are dropped. Unchanged without adapters."""
    if spec is None:
        return p
    p = dict(p)
    for weight in spec.targets:
        if a_key(weight) not in p:
            continue
        a, b = p.pop(a_key(weight)), p.pop(b_key(weight))
        delta = jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1) * spec.scale
        p[weight] = (p[weight].astype(jnp.float32) + delta).astype(p[weight].dtype)
    return p


def merge_stacked(stacked: dict, spec: LoRASpec | None) -> dict:
    """`merge_layer` over layer-stacked params ([l, ...] arrays), e.g. for export."""
    if spec is None:
        return stacked
    return jax.vmap(lambda p: merge_layer(p, spec))(stacked)
