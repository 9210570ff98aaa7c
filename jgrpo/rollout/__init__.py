"""The rollout layer: generation and scoring behind one backend protocol.

    backend.publish(params, version) -> metrics   # new weights after a train step
    backend.request(step, examples, gen_batch=0)  # ask for step's batch (may start at once)
    backend.collect(step, gen_batch=0) -> RolloutResult  # blocks until it is scored
                                                  # (gen_batch > 0: dynamic sampling's extras)
    backend.evaluate(examples, step, pass_k, val_set=None)  # validation generations
    backend.close()

`rollout.backend: local` runs the engine in-process on the trainer's params;
`rollout.backend: ray` runs RolloutWorker actors (jgrpo.rollout.ray_backend, the only module
of jgrpo that imports ray). The trainer only ever sees numpy batches.
"""

from jgrpo.rollout.engine import (
    RolloutEngine,
    RolloutFailure,
    build_engine,
    load_tokenizer,
    step_key,
)
from jgrpo.rollout.local import LocalRollout
from jgrpo.rollout.results import STEP_KEYS, RolloutResult, concat_results

__all__ = [
    "STEP_KEYS",
    "LocalRollout",
    "RolloutEngine",
    "RolloutFailure",
    "RolloutResult",
    "build_engine",
    "concat_results",
    "load_tokenizer",
    "step_key",
]


def make_backend(cfg, engine: RolloutEngine, graphdef, model_folder, frozen=None):
    """The configured backend (rollout.backend). `frozen`: the parameters `publish` never
    sends (the LoRA base; None when every parameter trains)."""
    g = cfg.grpo
    if cfg.rollout.backend == "local":
        return LocalRollout(engine, graphdef, g.seed, g.num_generations_per_prompt, frozen)
    from jgrpo.rollout.ray_backend import RayRollout  # the only ray import of jgrpo

    return RayRollout(
        cfg,
        model_folder,
        frozen=frozen,
        num_cpus_per_worker=cfg.rollout.num_cpus_per_worker,
        num_gpus_per_worker=cfg.rollout.num_gpus_per_worker,
        reward_names={
            name: tuple(engine.task_of(name).reward_names)
            for name in (None, *engine.task.val_tasks)
        },
    )
