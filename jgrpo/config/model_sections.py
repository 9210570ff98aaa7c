"""The `model` section of the config tree: the policy model, its LoRA adapters and its MoE
routing options (``ModelConfig``, ``LoRAConfig``, ``MoEConfig``), re-exported by
``jgrpo.config.sections``, which holds the rest of the tree."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

FROZEN = dict(frozen=True, kw_only=True)
"""Every section's dataclass options: immutable, keyword-only."""


LoRATarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclasses.dataclass(**FROZEN)
class LoRAConfig:
    """LoRA: train low-rank adapters of the projections; the base stays frozen (and is the
    reference policy: the forward without adapters)."""

    rank: int = 0
    """r: adapter rank (0 = off: full fine-tuning)."""
    alpha: float = 16.0
    """Adapter updates are scaled by alpha / rank (PEFT's lora_alpha)."""
    target_modules: tuple[LoRATarget, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    """Projections (PEFT/HF module names) that get adapters; default all attention and MLP."""


@dataclasses.dataclass(**FROZEN)
class MoEConfig:
    """Mixture-of-Experts models (qwen3_moe, glm4_moe; docs/moe.md); ignored by dense ones."""

    router_aux_loss_coef: Optional[float] = None
    """Load-balancing loss weight (None = the HF config's router_aux_loss_coef, else 0)."""
    router_z_loss_coef: float = 0.0
    """Router z-loss weight: mean logsumexp(router logits)^2 (0 = off)."""
    router_replay: bool = False
    """Train step routes each generated token to the experts the sampler recorded for it."""
    record_routing: bool = False
    """Record the sampler's experts for moe/routing_mismatch only, never replayed."""


@dataclasses.dataclass(**FROZEN)
class ModelConfig:
    """The policy model (and its reference copy)."""

    path: str = "builtin:tiny-qwen2"
    """HF folder, hub id, `smollm2` or `builtin:NAME` (tiny-qwen2(-chat), tiny-{qwen3,glm4}-moe)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter (master weight) dtype: float32 = 4 bytes/param, bfloat16 (pure bf16) = 2."""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Activation/matmul dtype; auto = bfloat16 on GPU/TPU or with dtype bfloat16, else float32."""
    remat: Literal["none", "full", "dots"] = "full"
    """Layer recompute in the backward: full keeps layer inputs only, dots also matmul outputs."""
    logprob_chunk_size: int = 128
    """Tokens (along T) per LM-head + log-softmax chunk: memory rows x chunk x vocab x 4 bytes."""
    attention_block_size: int = 1024
    """Rows longer than this use blockwise attention (memory linear in length; 0 = never)."""
    kernels: Literal["auto", "cpu", "portable"] = "auto"
    """Platform kernels (jgrpo.models.kernels): auto = cpu on the CPU backend, else portable."""
    lora: LoRAConfig = LoRAConfig()
    """LoRA adapters (rank 0 = off); adapters are float32, the base keeps model.dtype."""
    moe: MoEConfig = MoEConfig()
    """Router losses and router replay of Mixture-of-Experts models."""

    def resolved_compute_dtype(self, platform: str) -> str:
        """The compute dtype on `platform` (jax.default_backend(): cpu | gpu | tpu | ...)."""
        if self.compute_dtype != "auto":
            return self.compute_dtype
        if self.dtype == "bfloat16" or platform != "cpu":
            return "bfloat16"
        return "float32"
