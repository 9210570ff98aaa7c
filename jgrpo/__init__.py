"""jgrpo: a JAX-native GRPO trainer for language models.

The public API (imported lazily, so `import jgrpo` stays cheap and imports no JAX):

    jgrpo.GRPOTrainer(config, *, train_dataset=None, eval_dataset=None, reward_funcs=None,
                      run_dir=None, overrides=()).train() -> jgrpo.TrainResult
    jgrpo.GRPOTrainer(model=..., reward_funcs=..., args=jgrpo.GRPOConfig(...),
                      train_dataset=..., peft_config=...)     # TRL's names (docs/trl.md)
    jgrpo.SFTTrainer(model=..., train_dataset=..., args=jgrpo.SFTConfig(...),
                     peft_config=...).train()                 # supervised (docs/sft.md)
    jgrpo.load_config(path, overrides) -> jgrpo.Config        # jgrpo.ConfigError on bad input

The CLI is `jgrpo train --config ...` (`jgrpo sft` for SFT); both run `jgrpo.train.run(config,
run_dir)` (`jgrpo.sft.run`).
"""

import os as _os
import re as _re

__version__ = "0.1.0"


def _enough_cpu_threads() -> None:
    """Fake CPU devices (XLA_FLAGS --xla_force_host_platform_device_count=N > 1) share one XLA
    thread pool of max(cores, N) threads, on which a device thread that waits in a collective
    holds its thread. A device running two independent collectives at once holds two, so the
    pool can run dry with one device still short of a collective the others wait in: a deadlock
    that XLA ends after 40 s by aborting the process (seen: 8 devices on 2 cores, 7 threads in an
    all-reduce, 1 in an fsdp all-gather). 4 threads per device (PJRT_NPROC, which XLA:CPU reads
    when it starts, so this runs when jgrpo is imported) unless the user set PJRT_NPROC."""
    count = _re.search(
        r"--xla_force_host_platform_device_count=(\d+)", _os.environ.get("XLA_FLAGS", "")
    )
    if count and int(count.group(1)) > 1:
        threads = max(4 * int(count.group(1)), len(_os.sched_getaffinity(0)))
        _os.environ.setdefault("PJRT_NPROC", str(threads))


_enough_cpu_threads()

_EXPORTS = {
    "GRPOTrainer": "jgrpo.api",
    "SFTTrainer": "jgrpo.api",
    "TrainResult": "jgrpo.api",
    "GRPOConfig": "jgrpo.trl_config",
    "SFTConfig": "jgrpo.trl_config",
    "Config": "jgrpo.config",
    "ConfigError": "jgrpo.config",
    "load_config": "jgrpo.config",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jgrpo' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
