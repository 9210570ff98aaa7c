"""Checkpoints out of a run: `jgrpo export` (-> HF folder) and `jgrpo eval` (held-out accuracy).

A run folder holds config.yaml (the resolved config) and checkpoints/<step>/; the policy
architecture and tokenizer come from the config's model.path, the weights from the checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import yaml
from flax import nnx

from jgrpo import sharding, step
from jgrpo.checkpoint import Checkpointer, latest_complete_step
from jgrpo.config import Config, ConfigError, from_dict, validate
from jgrpo.models import (
    Transformer,
    from_pretrained,
    model_options,
    read_hf_config,
    save_pretrained,
)
from jgrpo.models.sources import resolve_model_path


def _locate(path) -> tuple[Path, Path, int]:
    """(run folder, checkpoints folder, step) of a run folder or a checkpoint step folder."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        run_dir, ckpt_dir = path, path / "checkpoints"
        latest = latest_complete_step(ckpt_dir)
        if latest is None:
            raise ConfigError(f"{str(ckpt_dir)!r}: no complete checkpoint")
        return run_dir, ckpt_dir, latest
    if path.name.isdigit() and path.parent.name == "checkpoints":
        return path.parent.parent, path.parent, int(path.name)
    raise ConfigError(f"{str(path)!r}: not a run folder (with checkpoints/) or a checkpoint step")


def load_run_config(run_dir: Path) -> Config:
    file = run_dir / "config.yaml"
    if not file.is_file():
        raise ConfigError(f"{str(file)!r} does not exist")
    return validate(from_dict(Config, yaml.safe_load(file.read_text())))


def load_checkpoint_model(path, cfg: Config | None = None):
    """(model with the checkpoint's params, model folder, config), on one device.

    The restore target is the abstract train state of `step.build_step` (nothing is allocated
    or read from model.path but its config.json)."""
    run_dir, ckpt_dir, ckpt_step = _locate(path)
    cfg = cfg or load_run_config(run_dir)
    folder = resolve_model_path(cfg.model.path)
    model_cfg = read_hf_config(folder, **model_options(cfg.model))
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    one = dataclasses.replace(cfg.mesh, data=1, fsdp=1, tensor=1)
    built = step.build_step(cfg, abstract, mesh=sharding.make_mesh(one, jax.devices()[:1]))
    with Checkpointer(ckpt_dir, keep_last=10**6) as checkpointer:
        state, _ = checkpointer.restore(ckpt_step, built.state)
    model = nnx.merge(built.graphdef, state.params)
    # the trainer's constraints; this model samples and exports
    model.activation_sharding = model.head_sharding = None
    return model, folder, cfg


def export_checkpoint(path, out) -> Path:
    model, folder, _ = load_checkpoint_model(path)
    return save_pretrained(model, out, source=folder)


def evaluate(cfg: Config, checkpoint=None) -> dict:
    """Held-out accuracy (greedy or pass@k) of a checkpoint, or of cfg.model.path."""
    from jgrpo.rollout import LocalRollout, RolloutEngine, load_tokenizer, validation_metrics
    from jgrpo.tasks import make_task

    task = make_task(cfg.data, cfg.grpo.seed)
    if checkpoint is not None:
        model, folder, _ = load_checkpoint_model(checkpoint, cfg)
    else:
        folder = resolve_model_path(cfg.model.path)
        model = from_pretrained(folder, **model_options(cfg.model))
    graphdef, state = nnx.split(model)
    engine = RolloutEngine(cfg, model.cfg, load_tokenizer(folder), task)
    backend = LocalRollout(engine, graphdef, cfg.grpo.seed, cfg.grpo.num_generations_per_prompt)
    backend.publish(nnx.to_pure_dict(state), 0)
    k = cfg.grpo.val_pass_k
    result = backend.evaluate(task.val, 0, pass_k=k)
    metrics = validation_metrics(result, len(task.val), k)
    return metrics | {"num_examples": len(task.val), "pass_k": k}
