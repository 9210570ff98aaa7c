"""The one way to build the policy of a run: `load_policy(cfg.model)` -> Transformer.

Owns how a run's `model` section (jgrpo.config.ModelConfig) becomes a model: model.path
resolved to an HF folder (jgrpo.models.sources), its config.json read and checked, the run's
precision and execution options applied (:func:`model_options`: storage and compute dtype,
remat, logprob chunk, kernels), and model.lora's adapters attached. Train, export, eval,
inspect-step, the rollout workers and the tools all build their model (or its config) here;
`from_pretrained` (jgrpo.models.hf) stays the low-level reader of an HF folder.

    load_policy(model_cfg, folder=None, *, abstract=False, adapters=True, seed=0)
    policy_config(model_cfg, folder=None, *, adapters=True) -> TransformerConfig
"""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx

from jgrpo.config import ModelConfig
from jgrpo.models import lora, preflight
from jgrpo.models.adapters import attach_lora
from jgrpo.models.hf import config_from_hf, from_pretrained, model_class
from jgrpo.models.sources import resolve_model_path
from jgrpo.models.transformer import Transformer, TransformerConfig


def model_options(model_cfg: ModelConfig) -> dict:
    """`config_from_hf` / `from_pretrained` keyword arguments of a run's `model` section:
    storage dtype = model.dtype, compute dtype = model.compute_dtype with `auto` resolved on
    this process's default backend, remat, the logprob chunk size, the platform kernels and
    the attention block size. The one place the run config's execution options become the
    model's."""
    return {
        "dtype": model_cfg.resolved_compute_dtype(jax.default_backend()),
        "param_dtype": model_cfg.dtype,
        "remat": model_cfg.remat,
        "logprob_chunk_size": model_cfg.logprob_chunk_size,
        "kernels": model_cfg.kernels,
        "attention_block_size": model_cfg.attention_block_size,
    }


def policy_folder(model_cfg: ModelConfig, *, config_only: bool = False) -> Path:
    """The HF folder of model.path (built or converted into the cache once); with
    `config_only`, a folder holding only config.json is enough (nothing will be loaded)."""
    folder = Path(model_cfg.path).expanduser()
    if config_only and (folder / "config.json").is_file():
        return folder
    return resolve_model_path(model_cfg.path)


def policy_config(
    model_cfg: ModelConfig, folder: str | Path | None = None, *, adapters: bool = True
) -> TransformerConfig:
    """The TransformerConfig of model.path's config.json (`folder`: model.path already
    resolved; None = resolve it, config.json alone is enough) under the run's options, with
    model.lora's LoRASpec when `adapters` (None when model.lora.rank = 0)."""
    folder = policy_folder(model_cfg, config_only=True) if folder is None else Path(folder)
    model = config_from_hf(preflight.read_hf_config(folder), **model_options(model_cfg))
    return lora.with_lora(model, model_cfg.lora) if adapters else model


def load_policy(
    model_cfg: ModelConfig,
    folder: str | Path | None = None,
    *,
    abstract: bool = False,
    adapters: bool = True,
    seed: int = 0,
) -> Transformer:
    """The policy of a run's `model` section.

    `folder`: model.path already resolved (None = resolve it). `abstract`: an `nnx.eval_shape`
    model (jax.ShapeDtypeStructs; only config.json is read, nothing is allocated), the
    restore target of a checkpoint or a model to size. Otherwise the weights of the folder
    under the run's options. With model.lora.rank > 0 and `adapters`, the model carries
    model.lora's adapters (fresh ones drawn from `seed`, B = 0, so the function is the
    base's); `adapters=False` gives the base alone.
    """
    if abstract:
        arch = policy_config(model_cfg, folder, adapters=adapters)
        return nnx.eval_shape(lambda: model_class(arch)(arch, rngs=nnx.Rngs(0)))
    folder = policy_folder(model_cfg) if folder is None else Path(folder)
    model = from_pretrained(folder, **model_options(model_cfg))
    spec = lora.spec_from_config(model_cfg.lora) if adapters else None
    if spec is not None:
        model = attach_lora(model, spec, jax.random.key(seed))
    return model
