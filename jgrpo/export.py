"""Checkpoints out of a run: `jgrpo export` (-> HF folder) and `jgrpo eval` (held-out accuracy).

A run folder holds config.yaml (the resolved config) and checkpoints/<step>/; the policy
architecture and tokenizer come from the config's model.path, the weights from the checkpoint.

A run folder resolves to its newest intact checkpoint (a damaged newer one is skipped with a
one-line warning, see jgrpo.checkpoint); a step folder given explicitly must verify. Export
writes the whole HF folder beside OUT and renames it into place, so an existing OUT (only with
overwrite) is replaced at once and never mixes old and new shards.

A LoRA run's checkpoint holds the adapters (and optimizer state) only: the base is re-read from
model.path; `export` merges the adapters into it, `export --adapter` writes them in PEFT format.
"""

from __future__ import annotations

import logging
from pathlib import Path

from jgrpo import compile_cache
from jgrpo.config import Config, ConfigError, from_dict, read_yaml, validate
from jgrpo.files import atomic_folder

log = logging.getLogger("jgrpo")

# jax, flax and orbax are imported inside the functions: `check_checkpoint_source` (the CLI's
# pre-flight of export and eval) rejects a wrong path before they load.


FINAL_DIR = "final"
"""RUN_DIR/final/: the HF folder a run ends with (written by `jgrpo.train.save_final`)."""


def _has_checkpoint(ckpt_dir: Path) -> bool:
    return ckpt_dir.is_dir() and any(
        p.name.isdigit() and (p / "commit_success.txt").is_file() for p in ckpt_dir.iterdir()
    )


def final_folder(path) -> Path | None:
    """The run's final/ HF folder that `path` names, or None: `path` is RUN_DIR/final itself,
    or a run folder without a complete checkpoint whose only model is final/."""
    path = Path(path)
    if path.name == FINAL_DIR and (path / "config.json").is_file():
        if (path.parent / "config.yaml").is_file():
            return path
    if (path / FINAL_DIR / "config.json").is_file() and not _has_checkpoint(path / "checkpoints"):
        return path / FINAL_DIR
    return None


def _locate(path) -> tuple[Path, Path, int | None]:
    """(run folder, checkpoints folder, step or None = newest intact) of a run or step folder."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        return path, path / "checkpoints", None
    if path.name.isdigit() and path.parent.name == "checkpoints" and path.is_dir():
        return path.parent.parent, path.parent, int(path.name)
    raise ConfigError(
        f"{str(path)!r}: not a run folder (with checkpoints/ or final/), a checkpoint step "
        "or a run's final/ folder"
    )


def load_run_config(run_dir: Path) -> Config:
    file = run_dir / "config.yaml"
    try:
        return validate(from_dict(Config, read_yaml(file, "run config")))
    except ConfigError as e:
        if str(e).startswith("run config"):
            raise
        raise ConfigError(f"run config {str(file)!r}: {e}") from None


def check_checkpoint_source(path, cfg: Config | None = None) -> Config:
    """Cheap checks of a run, step or final/ folder (and the run's config.yaml unless `cfg`);
    the config."""
    final = final_folder(path)
    if final is not None:
        from jgrpo.models.sources import check_model_path

        check_model_path(str(final))
        return cfg or load_run_config(final.parent)
    run_dir, ckpt_dir, ckpt_step = _locate(path)
    cfg = cfg or load_run_config(run_dir)
    if ckpt_step is None and not _has_checkpoint(ckpt_dir):
        raise ConfigError(f"{str(ckpt_dir)!r}: no complete checkpoint")
    return cfg


def load_checkpoint_model(path, cfg: Config | None = None):
    """(model with the checkpoint's params, model folder, config), on one device.

    The restore target is the abstract train state of `step_setup.build_step` (nothing is allocated
    or read from model.path but its config.json)."""
    import dataclasses

    import jax
    from flax import nnx

    from jgrpo import sharding, step_setup
    from jgrpo.checkpoint import Checkpointer, CheckpointError, CheckpointMismatch, complete_steps
    from jgrpo.models import load_policy, policy_folder
    from jgrpo.models.adapters import join_lora

    run_dir, ckpt_dir, ckpt_step = _locate(path)
    cfg = cfg or load_run_config(run_dir)
    if ckpt_step is None and not complete_steps(ckpt_dir):
        raise CheckpointError(f"{str(ckpt_dir)!r}: no complete checkpoint")
    with Checkpointer(ckpt_dir, keep_last=10**6, read_only=True) as checkpointer:
        if ckpt_step is not None:
            reason = checkpointer.verify(ckpt_step)
            if reason is not None:
                raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {reason}")
        folder = policy_folder(cfg.model)
        abstract = load_policy(cfg.model, folder, abstract=True)
        one = dataclasses.replace(cfg.mesh, data=1, fsdp=1, tensor=1)
        mesh = sharding.make_mesh(one, jax.devices()[:1])
        built = step_setup.build_step(cfg, abstract, mesh=mesh)
        try:
            if ckpt_step is None:
                restored = checkpointer.restore_latest_intact(built.state)
                if restored is None:
                    raise CheckpointError(f"{str(ckpt_dir)!r}: no complete checkpoint")
                state = restored[0]
            else:
                state, _ = checkpointer.restore(ckpt_step, built.state)
        except CheckpointMismatch as e:
            raise CheckpointError(
                f"checkpoint {str(path)!r} does not fit model.path {cfg.model.path!r} ({e})"
            ) from None
    base = None
    if abstract.cfg.lora is not None:
        # LoRA: the checkpoint holds the adapters; the base is re-read from model.path
        base = nnx.to_pure_dict(nnx.state(load_policy(cfg.model, folder, adapters=False)))
    return join_lora(built.graphdef, state.params, base), folder, cfg


def export_checkpoint(path, out, *, overwrite: bool = False, adapter: bool = False) -> Path:
    """Write the checkpoint's policy as HF folder `out`, atomically: LoRA adapters merged into
    the base, or with `adapter` the LoRA adapters alone in PEFT's format (LoRA runs only).

    Raises ConfigError if `out` exists and is not empty, unless `overwrite`."""
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise ConfigError(f"export: {str(out)!r} is not empty; pass overwrite to replace it")
    final = final_folder(path)
    if final is not None:  # already an HF folder: copied as it is
        if adapter:
            raise ConfigError(
                f"export --adapter: {str(final)!r} holds the merged policy; the adapters alone "
                "come from a checkpoint (checkpoint.save_period > 0)"
            )
        import shutil

        with atomic_folder(out, overwrite=True) as tmp:
            shutil.copytree(final, tmp, dirs_exist_ok=True)
        return out
    from jgrpo.models import save_pretrained
    from jgrpo.models.adapters import merge_lora, save_peft

    log.info("loading the checkpoint of %s", path)
    model, folder, cfg = load_checkpoint_model(path)
    if adapter and model.cfg.lora is None:
        raise ConfigError("export --adapter: the run has no LoRA adapters (model.lora.rank=0)")
    with atomic_folder(out, overwrite=True) as tmp:
        if adapter:
            save_peft(model, tmp, base_model_name_or_path=str(cfg.model.path))
        else:
            save_pretrained(merge_lora(model), tmp, source=folder)
    return out


def evaluate(cfg: Config, checkpoint=None) -> dict:
    """Every held-out set's metrics (`jgrpo.evaluation`) of a checkpoint (a run, step or final/
    folder), or of cfg.model.path (any HF folder or model source)."""
    import jax
    from flax import nnx

    from jgrpo.evaluation import validate_all
    from jgrpo.models import load_policy, policy_folder
    from jgrpo.rollout import LocalRollout, RolloutEngine, load_tokenizer
    from jgrpo.tasks import run_task

    compile_cache.enable()
    task = run_task(cfg)
    if not task.val and not task.val_tasks:
        task.close()
        raise ConfigError(
            "data.val_path: nothing to evaluate; give data.val_path, data.val_fraction or "
            "data.val_sets"
        )
    final = None if checkpoint is None else final_folder(checkpoint)
    log.info("loading the model %s", final or checkpoint or cfg.model.path)
    if final is not None:  # the merged policy of a finished run
        folder, model = final, load_policy(cfg.model, final, adapters=False)
    elif checkpoint is not None:
        model, folder, _ = load_checkpoint_model(checkpoint, cfg)
    else:
        folder = policy_folder(cfg.model)
        model = load_policy(cfg.model, folder, adapters=False)
    graphdef, state = nnx.split(model)
    if any(rf.model is not None for rf in cfg.data.reward_functions):
        from jgrpo import sharding
        from jgrpo.models.reward_model import load_reward_models

        task.attach_reward_models(load_reward_models(cfg, sharding.make_mesh(cfg.mesh)))
    engine = RolloutEngine(cfg, model.cfg, load_tokenizer(folder), task)
    backend = LocalRollout(engine, graphdef, cfg.grpo.seed, cfg.grpo.num_generations_per_prompt)
    backend.publish(nnx.to_pure_dict(state), 0)
    log.info(
        "validating (compiling the sampler first: this can take a minute on %s)",
        jax.default_backend().upper(),
    )
    try:
        metrics = validate_all(cfg, backend, task, 0)
    finally:
        task.close()
    return metrics | {"num_examples": len(task.val)}
