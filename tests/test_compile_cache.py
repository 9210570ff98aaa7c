"""The persistent compilation cache (jgrpo.compile_cache): where it goes and its off switch."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = """
import jax, jax.numpy as jnp
from jgrpo import compile_cache
print(compile_cache.enable())
print(float(jax.jit(lambda x: jnp.tanh(x) @ x)(jnp.ones((64, 64))).sum()))
"""


def run(tmp_path, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    full |= {
        "JGRPO_CACHE": str(tmp_path / "jg"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # cache even this quick program
        "PYTHONPATH": str(ROOT),
        **env,
    }
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=full, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_on_by_default_under_the_jgrpo_cache_and_reused(tmp_path):
    folder, value = run(tmp_path)
    assert Path(folder) == tmp_path / "jg" / "xla"
    first = entries(Path(folder))
    assert first, "the compiled program was not written to the cache"
    _, again = run(tmp_path)
    assert again == value and entries(Path(folder)) == first  # loaded, not compiled anew


def test_jax_setting_wins_and_the_switch_turns_it_off(tmp_path):
    own = tmp_path / "own"
    folder, _ = run(tmp_path, JAX_COMPILATION_CACHE_DIR=str(own))
    assert Path(folder) == own and entries(own)
    assert not entries(tmp_path / "jg" / "xla")
    off = run(tmp_path, JGRPO_COMPILATION_CACHE="0")
    assert off[0] == "None" and not entries(tmp_path / "jg" / "xla")
