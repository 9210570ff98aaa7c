"""jgrpo: a JAX-native GRPO trainer for language models.

Entry points: `jgrpo.train.run(config, run_dir)` (what the CLI, notebooks and pods call),
`jgrpo.config.load_config(path, overrides)`, `jgrpo.models.from_pretrained(path)`.
"""

__version__ = "0.1.0"
