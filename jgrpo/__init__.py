"""jgrpo: a JAX-native GRPO trainer for language models.

The public API (imported lazily, so `import jgrpo` stays cheap and imports no JAX):

    jgrpo.GRPOTrainer(config, *, train_dataset=None, eval_dataset=None, reward_funcs=None,
                      run_dir=None, overrides=()).train() -> jgrpo.TrainResult
    jgrpo.load_config(path, overrides) -> jgrpo.Config        # jgrpo.ConfigError on bad input

The CLI is `jgrpo train --config ...`; both run `jgrpo.train.run(config, run_dir)`.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "GRPOTrainer": "jgrpo.api",
    "TrainResult": "jgrpo.api",
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
