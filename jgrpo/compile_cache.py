"""JAX's persistent compilation cache, on by default, under the jgrpo cache.

Compiling the train step and the sampler is most of a short run's wall time on a CPU. With the
cache on, a second run of the same programs (same shapes, flags, devices and jax version)
loads the compiled executables from disk instead of compiling them again.

Where it lives, first match wins:
    JGRPO_COMPILATION_CACHE=0          off (jgrpo leaves jax's settings alone)
    jax's own setting                  `JAX_COMPILATION_CACHE_DIR` or
                                       `jax.config.update("jax_compilation_cache_dir", ...)`
    <jgrpo cache>/xla/                 the default; <jgrpo cache> is $JGRPO_CACHE or ~/.cache/jgrpo

The folder is capped at `MAX_BYTES` (least recently used first) unless
`jax_compilation_cache_max_size` was set; jax's `jax_persistent_cache_min_compile_time_secs`
default is kept. The cache is trusted code: do not point it at a folder that others can write."""

from __future__ import annotations

import os
from pathlib import Path

ENV_SWITCH = "JGRPO_COMPILATION_CACHE"
"""Set to 0 to leave the persistent compilation cache off."""
MAX_BYTES = 2 * 2**30
"""Size cap of the default cache folder."""


def default_directory() -> Path:
    from jgrpo.models.sources import cache_root

    return cache_root() / "xla"


def enable() -> Path | None:
    """Turn the cache on (see the module docstring); returns its folder, or None when off.
    Call before the first compile of a process; calling again changes nothing."""
    import jax

    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    folder = default_directory()
    jax.config.update("jax_compilation_cache_dir", str(folder))
    if jax.config.jax_compilation_cache_max_size == -1:  # -1: jax's "no limit"
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return folder
