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

from pathlib import Path

from jgrpo import compile_cache
from jgrpo.config import Config, ConfigError, from_dict, read_yaml, validate
from jgrpo.files import atomic_folder

# jax, flax and orbax are imported inside the functions: `check_checkpoint_source` (the CLI's
# pre-flight of export and eval) rejects a wrong path before they load.


def _locate(path) -> tuple[Path, Path, int | None]:
    """(run folder, checkpoints folder, step or None = newest intact) of a run or step folder."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        return path, path / "checkpoints", None
    if path.name.isdigit() and path.parent.name == "checkpoints" and path.is_dir():
        return path.parent.parent, path.parent, int(path.name)
    raise ConfigError(f"{str(path)!r}: not a run folder (with checkpoints/) or a checkpoint step")


def load_run_config(run_dir: Path) -> Config:
    file = run_dir / "config.yaml"
    try:
        return validate(from_dict(Config, read_yaml(file, "run config")))
    except ConfigError as e:
        if str(e).startswith("run config"):
            raise
        raise ConfigError(f"run config {str(file)!r}: {e}") from None


def check_checkpoint_source(path, cfg: Config | None = None) -> Config:
    """Cheap checks of a run or step folder (and its config.yaml unless `cfg`); the config."""
    run_dir, ckpt_dir, ckpt_step = _locate(path)
    cfg = cfg or load_run_config(run_dir)
    if ckpt_step is None and not any(
        p.name.isdigit() and (p / "commit_success.txt").is_file() for p in ckpt_dir.iterdir()
    ):
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
    from jgrpo.models import save_pretrained
    from jgrpo.models.adapters import merge_lora, save_peft

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
    """Every held-out set's metrics (`jgrpo.evaluation`) of a checkpoint, or of cfg.model.path
    (any HF folder or model source)."""
    from flax import nnx

    from jgrpo.evaluation import validate_all
    from jgrpo.models import load_policy, policy_folder
    from jgrpo.rollout import LocalRollout, RolloutEngine, load_tokenizer
    from jgrpo.tasks import make_task

    compile_cache.enable()
    task = make_task(cfg.data, cfg.grpo.seed)
    if not task.val and not task.val_tasks:
        task.close()
        raise ConfigError(
            "data.val_path: nothing to evaluate; give data.val_path, data.val_fraction or "
            "data.val_sets"
        )
    if checkpoint is not None:
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
    try:
        metrics = validate_all(cfg, backend, task, 0)
    finally:
        task.close()
    return metrics | {"num_examples": len(task.val)}
