"""Rotary position embeddings as transformers computes them: llama3 frequency scaling
(`RopeScaling`), the inverse frequencies, the (cos, sin) tables (CPU: trace-time tables,
`kernels.rope_cos_sin`) and the rotate-half rotation. `cfg` is a TransformerConfig (any object
with head_dim, rope_theta, rope_scaling and kernels)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax.numpy as jnp
import numpy as np

from jgrpo.models import kernels as _kernels
from jgrpo.models.kernels import resolve_kernels


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """llama3 RoPE frequency scaling (transformers' `_compute_llama3_parameters`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def rope_inv_freq(cfg) -> np.ndarray:
    """Inverse frequencies [h/2] in float32, as transformers computes them."""
    exponent = np.arange(0, cfg.head_dim, 2, dtype=np.int64).astype(np.float32) / cfg.head_dim
    inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** exponent)).astype(np.float32)
    sc = cfg.rope_scaling
    if sc is None:
        return inv_freq
    low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / sc.factor, inv_freq)
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_tables(cfg, positions_bt, num_positions: Optional[int] = None):
    """(cos, sin) [b, t, 1, h/2] in float32 for `apply_rope` (HF's tables repeat these for the
    two halves of head_dim), of the float32 angle `position * inv_freq` as transformers forms it.
    `num_positions` (every position < it, when known) lets the CPU kernels look them up in
    trace-time tables (`kernels.rope_cos_sin`)."""
    path = resolve_kernels(cfg.kernels)
    cos, sin = _kernels.rope_cos_sin(rope_inv_freq(cfg), positions_bt, num_positions, path)
    return cos[:, :, None, :], sin[:, :, None, :]


def apply_rope(x_btnh, cos, sin):
    """Rotate-half RoPE (HF layout: the two halves of head_dim pair up): the same float32
    products and sums as HF's `x * cos + rotate_half(x) * sin`, written per half (one
    concatenate of results instead of building rotate_half(x), cheaper on CPU)."""
    x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)
