"""The XLA flags the launcher sets on GPU: `GPU_FLAGS`, added to XLA_FLAGS by `set_gpu_flags`.

JAX's "GPU performance tips" (docs.jax.dev/en/latest/gpu_performance_tips.html, "XLA
performance flags") recommends two: `--xla_gpu_enable_latency_hiding_scheduler=true` (the
scheduler overlaps collectives, e.g. an fsdp all-gather, with compute; also the NVIDIA JAX
containers' default) and `--xla_gpu_triton_gemm_any=true` (Triton's GEMM emitter for every
matmul it supports, which XLA can fuse with the elementwise work around it). CUDA graphs
(command buffers) need no flag: XLA's default already captures fusions, cuBLAS and cuDNN calls.

`jgrpo train`, `eval` and `inspect-step` call `set_gpu_flags()` before anything touches a
device (XLA reads XLA_FLAGS once, when its backend starts); Ray rollout workers inherit the
driver's XLA_FLAGS. A flag the user already set (either value) is left as the user set it. On a
machine without an NVIDIA GPU, or with JAX_PLATFORMS naming no GPU platform, nothing changes.
Imports no jax. docs/performance.md lists the flags."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

GPU_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_triton_gemm_any=true",
)
"""What JAX's GPU performance guide recommends, set on GPU only."""

_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")
_GPU_PLATFORMS = {"cuda", "gpu"}


def gpu_visible(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether JAX will run on an NVIDIA GPU: a CUDA plugin is installed, the driver's device
    node exists, and JAX_PLATFORMS (if set) names cuda or gpu."""
    platforms = environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms and not _GPU_PLATFORMS & set(platforms.split(",")):
        return False
    has_plugin = any(importlib.util.find_spec(name) for name in _CUDA_PLUGINS)
    return has_plugin and Path("/dev/nvidiactl").exists()


def with_gpu_flags(xla_flags: str) -> str:
    """`xla_flags` with every GPU_FLAGS flag the user has not set (by name) appended."""
    flags = xla_flags.split()
    names = {f.split("=", 1)[0] for f in flags}
    return " ".join([*flags, *(f for f in GPU_FLAGS if f.split("=", 1)[0] not in names)])


def set_gpu_flags(environ: MutableMapping[str, str] = os.environ, gpu: bool | None = None):
    """On GPU (`gpu_visible` unless `gpu` says), add GPU_FLAGS to environ["XLA_FLAGS"] ->
    the flags added (() off GPU, or when a JAX backend already started: too late to matter)."""
    if not (gpu_visible(environ) if gpu is None else gpu) or _backend_started():
        return ()
    before = environ.get("XLA_FLAGS", "")
    environ["XLA_FLAGS"] = with_gpu_flags(before)
    return tuple(f for f in environ["XLA_FLAGS"].split() if f not in before.split())


def _backend_started() -> bool:
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(bridge is not None and getattr(bridge, "_backends", None))
