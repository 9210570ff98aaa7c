"""run(config): the GRPO loop, top to bottom. The CLI, notebooks and pods all call this.

Per step s (0-based; metrics.jsonl line `step` = s + 1 = updates done):
  collect the rollout batch of step s (generated with weights version s, or >= s - k in async
  mode) -> one jitted train step -> publish the new params (version s + 1) to the sampler ->
  request the batch of step s + 1 + k -> log -> validate every grpo.val_period -> checkpoint
  every checkpoint.save_period.
Resume: a checkpoint holds the train state (params, optimizer state, update count) and meta
(the data-stream position before the first untrained step, the step); sampling keys derive
from (grpo.seed, step), so a killed and resumed run repeats the uninterrupted one exactly.
LoRA: fresh adapters (seeded by grpo.seed) are the train state's params; the base of model.path
is the step's `frozen` argument and the backend's frozen tree, re-read on resume.
Pods: every process runs this loop over the global mesh, feeding only its slice of the rows;
checkpoints are collective (Orbax); only process 0 writes config.yaml, metrics.jsonl,
TensorBoard, W&B, plots and the console progress."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml
from flax import nnx

from jgrpo import compile_cache, distillation, distributed, evaluation, sharding, step, step_setup
from jgrpo.checkpoint import Checkpointer, latest_complete_step
from jgrpo.config import Config, ConfigError, to_dict
from jgrpo.config.rules import needs_chat_turns
from jgrpo.console import console_lines
from jgrpo.export import FINAL_DIR
from jgrpo.files import write_atomic
from jgrpo.metrics import MetricsLogger, NullLogger, read_metrics
from jgrpo.models import load_policy, policy_folder
from jgrpo.models.adapters import join_lora, merge_lora
from jgrpo.models.preflight import check_lora_targets
from jgrpo.models.reward_model import load_reward_models
from jgrpo.models.sources import check_model_path
from jgrpo.plots import plot_run
from jgrpo.rollout import (
    RolloutEngine,
    RolloutFailure,
    RolloutResult,
    concat_results,
    dapo,
    load_tokenizer,
    make_backend,
)
from jgrpo.rollout.exchange import exchange_rows
from jgrpo.rollout.results import batch_stats
from jgrpo.tasks import run_task
from jgrpo.tasks.child import forget_reports

log = logging.getLogger("jgrpo")


class RunStopped(RuntimeError):
    """The run stopped early for a reason outside the step (e.g. the worker failure budget)."""


@dataclasses.dataclass
class Trainer:
    """Everything a running GRPO job holds (built by `setup`)."""

    cfg: Config
    setup: step_setup.StepSetup
    """The built train step (mesh, graphdef, ref_params, frozen: the LoRA base or None,
    hparams, step_fn: aligned across processes). Its `state` is the one at `start_step`
    (donated by the first step); the live one is `state`."""
    state: step.TrainState
    """The current train state."""
    task: Any
    backend: Any
    checkpointer: Checkpointer
    start_step: int
    """First step to train (0, or the resumed checkpoint's step)."""
    draws: DataDraws = dataclasses.field(default_factory=lambda: DataDraws())
    """A resumed run's record of the draws its first requests repeat (async, dynamic sampling)."""


def check_run(cfg: Config) -> None:
    """Cheap checks that need no model: paths, data, mesh and batch divisibility."""
    length = cfg.rollout.prompt_bucket + cfg.rollout.max_new_tokens
    hf = check_model_path(cfg.model.path, length, multi_turn=needs_chat_turns(cfg))
    check_lora_targets(hf, cfg.model.lora)
    distillation.check_teacher(cfg)  # its tokenizer against the policy's, before any weights
    sharding.make_rules(cfg.mesh)
    step_setup.check_batch_split(cfg, jax.device_count())
    if cfg.rollout.backend == "ray" and cfg.rollout.ray_address:
        from jgrpo.rollout.ray_backend import check_ray_address

        check_ray_address(cfg.rollout.ray_address)
    check_pod(cfg, jax.process_count())


def check_pod(cfg: Config, num_processes: int) -> None:
    """What a run over several processes needs beyond a one-process run."""
    if num_processes == 1:
        return
    if cfg.grpo.num_prompts_per_step % num_processes:
        raise ConfigError(
            f"grpo.num_prompts_per_step: {cfg.grpo.num_prompts_per_step} prompts do not split "
            f"over {num_processes} processes (each host generates whole prompt groups)"
        )
    if cfg.rollout.backend == "ray" and not cfg.rollout.ray_address:
        raise ConfigError(
            "rollout.ray_address: a pod's Ray rollout needs one Ray cluster every process joins "
            "(HOST:PORT of its head, `ray start --head`); see docs/pods.md"
        )


def log_placement(built: step_setup.StepSetup) -> None:
    """Logs where the step's arrays went: the device count and kind, the mesh's axes."""
    log.info(
        "placed it on %d %s device(s) (mesh %s)",
        built.mesh.size,
        jax.default_backend().upper(),
        ", ".join(f"{a}={n}" for a, n in built.mesh.shape.items()),
    )


def setup(cfg: Config, run_dir: Path, resume: bool, datasets: dict | None = None) -> Trainer:
    check_run(cfg)
    compile_cache.enable()
    # ConfigError before the model loads
    task = run_task(cfg, **(datasets or {}))
    run_dir.mkdir(parents=True, exist_ok=True)
    if distributed.is_primary():
        write_run_config(run_dir, cfg)

    log.info("loading the model %s", cfg.model.path)
    folder = policy_folder(cfg.model)
    # with LoRA: fresh adapters over the loaded base (a resume overwrites them)
    model = load_policy(cfg.model, folder, seed=cfg.grpo.seed)
    log.debug("model folder %s", folder)
    teacher = None
    if cfg.distillation.teacher is not None:
        log.info("loading the distillation teacher %s", cfg.distillation.teacher)
        teacher = distillation.load_teacher(cfg)
    built = step_setup.build_step(cfg, model, teacher=teacher)
    del teacher  # its arrays live on in built.teacher, placed on the mesh
    log_placement(built)
    state = built.state
    if cfg.rollout.backend == "local":  # Ray workers load their own (rollout.build_engine)
        task.attach_reward_models(load_reward_models(cfg, built.mesh))  # frozen, on the mesh
    checkpointer = Checkpointer.from_config(run_dir / "checkpoints", cfg.checkpoint)
    distributed.watch_checkpoints(checkpointer.directory, latest_complete_step)
    start, draws = 0, DataDraws()
    restored = checkpointer.restore_latest_intact(state) if resume else None  # skips damage
    if restored is not None:
        state, meta, _ = restored
        start = meta["step"]
        task.train.restore(meta["data_state"])
        draws = DataDraws.from_meta(meta)
        log.info("resumed from step %d of %d", start, cfg.grpo.max_num_steps)
    elif resume:
        log.info("no intact checkpoint to resume from: starting at step 0")

    log.info("starting the %s rollout backend", cfg.rollout.backend)
    tokenizer = load_tokenizer(folder)
    engine = RolloutEngine(cfg, model.cfg, tokenizer, task)
    backend = make_backend(cfg, engine, nnx.graphdef(model), folder, built.frozen)
    trainable = sum(x.size for x in jax.tree.leaves(state.params))
    log.info(
        "trainable parameters: %s of %s", f"{trainable:,}", f"{trainable + _size(built.frozen):,}"
    )
    aligned = distributed.align_first_runs(built.step_fn)
    return Trainer(
        cfg=cfg,
        # drops a resume's unused initial state
        setup=dataclasses.replace(built, state=state, step_fn=aligned),
        state=state,
        task=task,
        backend=backend,
        checkpointer=checkpointer,
        start_step=start,
        draws=draws,
    )


def write_run_config(run_dir: Path, cfg: Config) -> None:
    """RUN_DIR/config.yaml, the resolved config (what export, eval and --resume read), written
    atomically: a start killed meanwhile leaves the old file or the new one, never a torn one."""
    write_atomic(Path(run_dir) / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))


def _size(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


def policy_model(t: Trainer, view=None):
    """The current policy as a plain Transformer (LoRA adapters merged into the base): what
    an HF export of the run holds. `view` maps each parameter tree first (on a pod: this
    host's replica, `sharding.host_local`)."""
    view = view or (lambda tree: tree)
    frozen = None if t.setup.frozen is None else view(t.setup.frozen)
    return merge_lora(join_lora(t.setup.graphdef, view(t.state.params), frozen))


def validate(t: Trainer, step_index: int) -> dict[str, float]:
    """Every held-out set's metrics (`jgrpo.evaluation`) with the current weights."""
    start = time.perf_counter()
    metrics = evaluation.validate_all(t.cfg, t.backend, t.task, step_index)
    return metrics | {"perf/val_s": time.perf_counter() - start}


@dataclasses.dataclass
class DataDraws:
    """Where the training stream stood for the steps a checkpoint had requested but not trained.

    meta["data_state"]: the stream before step `done`'s first draw (what a run without async
    or dynamic sampling restores and draws on from). With rollout.max_staleness k >= 1 and
    dynamic sampling, the requests of steps done..done+k were drawn interleaved with earlier
    steps' extra prompts, so the meta also holds each requested step's position
    (`data_pending`) and the position after every draw so far (`data_next`): a resume draws
    each pending step from its own position, then continues from `data_next`."""

    pending: dict[int, dict] = dataclasses.field(default_factory=dict)
    next: dict | None = None

    @classmethod
    def from_meta(cls, meta: dict) -> DataDraws:
        pending = {int(s): state for s, state in (meta.get("data_pending") or {}).items()}
        return cls(pending, meta.get("data_next"))

    def draw(self, stream, step: int, n: int) -> tuple[dict, list]:
        """(the stream's state before, the examples) of step's first generation batch."""
        if step in self.pending:
            stream.restore(self.pending.pop(step))
        elif self.next is not None:
            stream.restore(self.next)
            self.next = None
        state = stream.state()
        return state, stream.next_prompts(n)

    def done(self, stream) -> None:
        """After the resumed run's first requests: continue where the checkpointed run was."""
        if self.next is not None:
            stream.restore(self.next)
        self.pending, self.next = {}, None


def save_checkpoint(t: Trainer, done: int, data_states: dict[int, dict]) -> None:
    current = t.task.train.state()
    meta = {
        "step": done,
        "data_state": data_states.get(done) or current,
        "data_pending": {str(s): state for s, state in data_states.items() if s >= done},
        "data_next": current,
        "config": to_dict(t.cfg),
    }
    t.checkpointer.save(done, t.state, meta)


def to_floats(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


def run(
    cfg: Config,
    run_dir: str | Path,
    resume: bool = False,
    *,
    train_dataset=None,
    eval_dataset=None,
) -> History:
    """Train; returns the validation records [{step, val/accuracy, ...}] (a resume's include
    the earlier ones, `History`), also written to RUN_DIR/summary.json. The trained policy is
    left in RUN_DIR/final/ (an HF folder, see `save_final`). Says what it does on stderr
    (`jgrpo.console`).

    The reference policy is the initial model of `cfg.model.path`, so a resumed run reloads it
    from there exactly; the checkpoint does not duplicate it. `train_dataset` / `eval_dataset`
    (list of dicts or datasets.Dataset) replace data.train_path / data.val_path."""
    forget_reports()  # "once per run": a second run in this process reports its own failures
    with console_lines():
        if not distributed.is_primary() and log.getEffectiveLevel() == logging.INFO:
            log.setLevel(logging.WARNING)  # process 0 says what the pod does
        return _run(cfg, Path(run_dir), resume, train_dataset, eval_dataset)


def _run(cfg: Config, run_dir: Path, resume: bool, train_dataset, eval_dataset) -> History:
    datasets = {"train_dataset": train_dataset, "eval_dataset": eval_dataset}
    t = setup(cfg, run_dir, resume, datasets)
    g, k = cfg.grpo, cfg.rollout.max_staleness
    resume_step = t.start_step if resume else None
    if distributed.is_primary():
        logger = MetricsLogger(
            run_dir, cfg.logging, g.max_num_steps, resume_step=resume_step, run_config=to_dict(cfg)
        )
    else:
        logger = NullLogger()
    data_states: dict[int, dict] = {}
    history = History(start_step=t.start_step)
    if resume_step and distributed.is_primary():  # metrics.jsonl holds steps <= resume_step now
        history += validation_records(read_metrics(run_dir))
    done = t.start_step
    try:
        t.backend.publish(t.state.params, t.start_step)
        for s in range(t.start_step, min(t.start_step + 1 + k, g.max_num_steps)):
            data_states[s], examples = t.draws.draw(t.task.train, s, g.gen_prompts_per_batch)
            t.backend.request(s, examples)
        t.draws.done(t.task.train)
        held_out = evaluation.has_held_out(t.task)
        if g.val_at_start and t.start_step == 0 and held_out:
            log.info("validating at step 0 (compiling the sampler first: %s)", _compile_hint())
            val = validate(t, 0)
            history.append({"step": 0, **val})
            logger.log(0, val)
        clock = StepClock(t.start_step)
        for s in range(t.start_step, g.max_num_steps):
            if s == t.start_step:
                log.info(
                    "step %d of %d: generating, then compiling the train step (%s)",
                    s + 1,
                    g.max_num_steps,
                    _compile_hint(),
                )
            metrics = train_one_step(t, s, data_states, logger)
            done = s + 1
            clock.tick(done, metrics)
            periodic = g.val_period and done % g.val_period == 0
            if held_out and (periodic or (g.val_at_end and done == g.max_num_steps)):
                val = validate(t, done)
                history.append({"step": done, **val})
                metrics |= val
            logger.log(done, metrics)
            last = done == g.max_num_steps
            if t.checkpointer.should_save(done) or (last and cfg.checkpoint.save_period > 0):
                save_checkpoint(t, done, data_states)
                log.info("saved checkpoint %s", run_dir / "checkpoints" / str(done))
                if cfg.checkpoint.export_hf:
                    save_final(t, run_dir / "hf" / f"step_{done}")
            data_states.pop(s, None)
        save_final(t, run_dir / FINAL_DIR)
        finished = f"{clock.summary()}; the trained policy is in {run_dir / FINAL_DIR}"
    except RolloutFailure as e:
        if done not in t.checkpointer.all_steps():
            save_checkpoint(t, done, data_states)
        raise RunStopped(
            f"rollout failed past rollout.max_worker_failures ({e}); checkpoint saved at step "
            f"{done}: continue with --resume"
        ) from e
    finally:
        logger.close()
        t.task.close()  # the reward child process, if any
        t.backend.close()
        t.checkpointer.close()
    log.info("%s", finished)  # after the progress bar closed
    if distributed.is_primary():
        write_summary(run_dir, history)
        if cfg.logging.plot:
            plot_run(run_dir)
    return history


def _compile_hint() -> str:
    return f"this can take a minute on {jax.default_backend().upper()}"


class StepClock:
    """Wall time of the steps one process trains, the first step (which compiles) apart."""

    def __init__(self, start_step: int):
        self.start_step = start_step
        self.began = time.perf_counter()
        self.first_done: float | None = None
        self.last_step = start_step

    def tick(self, done: int, metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        self.last_step = done
        if self.first_done is None:
            self.first_done = now
            log.info(
                "step %d took %.1f s, compiling included; the next steps reuse the compiled "
                "programs",
                done,
                now - self.began,
            )
        log.debug(
            "step %d: %.2f s (generation %.2f s, train %.2f s), reward %.3f",
            done,
            metrics["perf/step_s"],
            metrics["perf/generation_s"],
            metrics["perf/train_s"],
            metrics.get("reward/mean", float("nan")),
        )

    def summary(self) -> str:
        """`trained N steps in T s` and the time a step took after the first."""
        steps = self.last_step - self.start_step
        if self.first_done is None:
            return (
                f"nothing to train: the run is at step {self.start_step}, grpo.max_num_steps "
                "(raise it to train on)"
            )
        total = time.perf_counter() - self.began
        line = f"trained {steps} step{'s' * (steps != 1)} in {total:.1f} s"
        if steps > 1:
            after = (time.perf_counter() - self.first_done) / (steps - 1)
            line += f" ({after:.2f} s a step after the first)"
        return line


def train_one_step(
    t: Trainer, s: int, data_states: dict[int, dict], logger: MetricsLogger | None = None
) -> dict[str, float]:
    g, k = t.cfg.grpo, t.cfg.rollout.max_staleness
    start = time.perf_counter()
    result = t.backend.collect(s)
    if g.use_dynamic_sampling:
        result = collect_informative(t, s, result)
    if logger is not None:
        logger.log_samples(s + 1, result.samples[: t.cfg.logging.num_samples])
    gen_s = time.perf_counter() - start
    u = t.setup
    batch = u.device_batch(result.step_batch())
    t.state, step_metrics = u.step_fn(t.state, batch, u.hparams, u.ref_params, u.frozen, u.teacher)
    metrics = to_floats(step_metrics)  # waits for the step
    train_s = time.perf_counter() - start - gen_s
    sync = t.backend.publish(t.state.params, s + 1)
    nxt = s + 1 + k
    if nxt < g.max_num_steps:
        data_states[nxt] = t.task.train.state()
        t.backend.request(nxt, t.task.train.next_prompts(g.gen_prompts_per_batch))
    total_s = time.perf_counter() - start
    rows = distributed.allgather_rows({k: result.batch[k] for k in ("lengths", "weight_version")})
    tokens = float(rows["lengths"].sum())
    staleness = s - rows["weight_version"]
    return {
        **metrics,
        **result.stats,
        **sync,
        "rollout/staleness_max": float(staleness.max()),
        "rollout/staleness_mean": float(staleness.mean()),
        "perf/step_s": total_s,
        "perf/generation_s": gen_s,
        "perf/train_s": train_s,
        "perf/tokens_per_s": tokens / max(total_s, 1e-9),
    }


def collect_informative(t: Trainer, s: int, first: RolloutResult) -> RolloutResult:
    """Dynamic sampling (docs/dapo.md): generation batches of step s until P informative groups
    (at most grpo.dynamic_sampling_max_gen_batches); the extra prompts come from the training
    stream, so it advances the same way in every run of this config (and a resume). The batch
    holds the first P informative groups in order, then padding rows (group id -1, sample_mask
    0) for a shortfall; its statistics are those of every generated row, before filtering.
    On a pod every host decides on every host's rows (one gather of per-row values per
    generation batch), so all draw the same extra prompts and keep the same groups; the rows
    a host feeds may come from another host (`exchange_rows`)."""
    g = t.cfg.grpo
    results = [first]
    rows = [pod_rows(first.batch, 0)]
    kept = sum(dapo.informative_groups(rows[-1], g.dynamic_sampling_filter).values())
    while kept < g.num_prompts_per_step and len(results) < g.dynamic_sampling_max_gen_batches:
        j = len(results)
        t.backend.request(s, t.task.train.next_prompts(g.gen_prompts_per_batch), gen_batch=j)
        results.append(t.backend.collect(s, gen_batch=j))
        rows.append(pod_rows(results[-1].batch, sum(len(r.batch["rewards"]) for r in results[:-1])))
        kept += sum(dapo.informative_groups(rows[-1], g.dynamic_sampling_filter).values())
    pick_b, group_b, kept = dapo.plan_groups(
        rows, g.num_prompts_per_step, g.num_generations_per_prompt, g.dynamic_sampling_filter
    )
    if kept < g.num_prompts_per_step:
        message = (
            f"dynamic sampling: step {s + 1} has {kept} informative groups of "
            f"{g.num_prompts_per_step} after grpo.dynamic_sampling_max_gen_batches = "
            f"{len(results)} generation batches"
        )
        if g.dynamic_sampling_on_exhausted == "raise":
            raise RunStopped(message)
        log.warning("%s; training on those (the rest are padding rows)", message)
    every = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    local = dapo.join_batches([r.batch for r in results])
    batch, position_b = exchange_rows(
        local, every["process"][pick_b], every["pool_row"][pick_b], t.setup.mesh
    )
    batch = dapo.relabel(batch, group_b[position_b])
    offsets = [j * g.gen_prompts_per_batch for j in range(len(results))]
    every["group_ids"] = np.concatenate(
        [r["group_ids"] + offset for r, offset in zip(rows, offsets)]
    )
    stats = {**results[-1].stats, **concat_results(results, offsets).stats}
    stats |= batch_stats(every, first.reward_names)  # every host's rows (one process: the same)
    stats["dynamic_sampling/gen_batches"] = float(len(results))
    stats["dynamic_sampling/kept_groups"] = float(kept)
    return RolloutResult(batch, stats, first.samples, first.reward_names)


def pod_rows(batch: dict, pool_start: int) -> dict[str, np.ndarray]:
    """Every host's per-row arrays of a generation batch (this process's alone on one), each
    row tagged with its process and its index in that process's generation batches joined
    (`pool_start`: this process's rows before this batch). Collective on a pod."""
    n = len(batch["rewards"])
    mine = {k: v for k, v in batch.items() if k not in dapo.PADDED_KEYS}
    mine["process"] = np.full(n, distributed.process_index(), np.int32)
    mine["pool_row"] = pool_start + np.arange(n, dtype=np.int64)
    return distributed.allgather_rows(mine)


def save_final(t: Trainer, out: Path) -> Path:
    """Write the current policy as an HF folder (config.json, safetensors, tokenizer files,
    generation_config.json) that transformers and `jgrpo.models.from_pretrained` load; the
    folder is replaced atomically. On a pod only process 0 writes it."""
    return save_policy(t.setup, t.state.params, out)


def save_policy(setup: step_setup.StepSetup, params, out: Path) -> Path:
    """`save_final` of any run built by `step_setup.build_step` (`jgrpo train`, `jgrpo sft`):
    the trainable `params` joined with `setup.frozen`, LoRA merged, as an HF folder."""
    from jgrpo.files import atomic_folder
    from jgrpo.models.hf import save_pretrained

    view = lambda tree: tree  # noqa: E731
    if distributed.is_multiprocess():  # process 0 writes from its host's replica (no gather)
        if not distributed.is_primary():
            return out
        view = lambda tree: sharding.host_local(tree, sharding.host_mesh(setup.mesh))  # noqa: E731
    frozen = None if setup.frozen is None else view(setup.frozen)
    model = merge_lora(join_lora(setup.graphdef, view(params), frozen))
    folder = policy_folder(setup.cfg.model)
    with atomic_folder(out, overwrite=True) as tmp:
        save_pretrained(model, tmp, source=folder)
    return out


class History(list):
    """`run`'s validation records [{step, val/..., perf/val_s}] in step order: a resumed run's
    earlier ones (from metrics.jsonl) first. `start_step`: where this run started training."""

    def __init__(self, records=(), start_step: int = 0):
        super().__init__(records)
        self.start_step = start_step


def validation_records(rows: list[dict]) -> list[dict]:
    """The validation records of metrics.jsonl lines: their val/* keys and perf/val_s."""
    records = []
    for row in rows:
        val = {k: v for k, v in row.items() if k.startswith("val/") and v is not None}
        if val:
            extra = {"perf/val_s": row["perf/val_s"]} if row.get("perf/val_s") is not None else {}
            records.append({"step": row["step"], **val, **extra})
    return records


def summarize(history: list[dict]) -> str:
    """A before/after table of validation accuracy: from the resume point (the last record at
    or before `history.start_step`, for a `History`) to the end."""
    if not history:
        return (
            "no validation was run (it needs a held-out set: data.val_path, data.val_fraction or "
            "a built-in task's data.num_val_examples)"
        )
    start = getattr(history, "start_step", 0)
    first = ([r for r in history if r["step"] <= start] or history)[-1]
    last = history[-1]
    rows = [("step", first["step"], last["step"])]
    if "val/accuracy" in first:  # tasks with a verifier
        rows.append(("val/accuracy", f"{first['val/accuracy']:.3f}", f"{last['val/accuracy']:.3f}"))
    rows += [
        ("val/reward_mean", f"{first['val/reward_mean']:.3f}", f"{last['val/reward_mean']:.3f}"),
        ("val/length_mean", f"{first['val/length_mean']:.1f}", f"{last['val/length_mean']:.1f}"),
    ]
    lines = [f"{'':18s}{'before':>10s}{'after':>10s}"]
    lines += [f"{name:18s}{str(a):>10s}{str(b):>10s}" for name, a, b in rows]
    return "\n".join(lines)


def write_summary(run_dir: Path, history: list[dict]) -> None:
    """RUN_DIR/summary.json: every validation record of the run (a resume keeps the earlier)."""
    write_atomic(Path(run_dir) / "summary.json", json.dumps(history, indent=2))
