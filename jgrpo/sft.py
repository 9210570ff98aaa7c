"""run(config): supervised fine-tuning, top to bottom (`jgrpo sft`, `jgrpo.SFTTrainer`).

The SFT step IS the GRPO train step (`step_setup.build_step`) with `StepFlags.objective =
"sft"`: one jitted function whose loss is `sft_loss.sft_loss` (the token-mean NLL of the target
tokens over the step's batch; no frozen forward, no advantages). The rest is the GRPO run's
machinery: mesh, LoRA, bf16, microbatches, packing, optimizer, checkpoints, `--resume`,
RUN_DIR/final/ (`train.save_policy`), hence `jgrpo export` / `jgrpo eval`. `step_config(cfg)`
is the bridge: the GRPO config the step is built from, with B = sft.batch_size rows of T =
sft.max_seq_length tokens, one minibatch, temperature 1, no KL; config.yaml holds cfg as given.
Per step: the next batch of encoded examples (`jgrpo.sft_data`; a pod process feeds its slice)
-> the step -> log -> validate every sft.val_period (`val/loss`; greedy `val/accuracy` of data's
held-out set for a task with a verifier) -> checkpoint (meta: the data order's state, so a
resumed run trains on the batches the uninterrupted one would have)."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jgrpo import compile_cache, distributed, evaluation, sharding, step, step_setup
from jgrpo.checkpoint import Checkpointer, latest_complete_step
from jgrpo.config import Config, ConfigError, LossConfig, to_dict
from jgrpo.console import console_lines
from jgrpo.export import FINAL_DIR
from jgrpo.metrics import MetricsLogger, NullLogger, read_metrics
from jgrpo.models import load_policy, policy_folder
from jgrpo.models.sources import check_model_path
from jgrpo.plots import plot_run
from jgrpo.sft_data import Encoded, Encoder, SFTSource, make_batch, make_sources
from jgrpo.tasks import make_task
from jgrpo.tasks.child import forget_reports
from jgrpo.train import History, log_placement, save_policy, write_run_config, write_summary

log = logging.getLogger("jgrpo")


def step_config(cfg: Config) -> Config:
    """The GRPO config of the SFT step (module docstring): sft.* batch, length and packing."""
    s = cfg.sft
    grpo = dataclasses.replace(
        cfg.grpo,
        num_prompts_per_step=s.batch_size,
        num_generations_per_prompt=1,
        max_num_steps=s.max_num_steps,
        num_minibatches=1,
        num_microbatches=s.num_microbatches,
        sequence_packing=s.sequence_packing,
        packing_budget=s.packing_budget,
        seq_logprob_error_threshold=None,
        use_dynamic_sampling=False,
        batch_multiplier=1.0,
        seed=s.seed,
    )
    rollout = dataclasses.replace(
        cfg.rollout, prompt_bucket=1, max_new_tokens=s.max_seq_length - 1, temperature=1.0
    )
    loss = LossConfig(force_on_policy_ratio=True, reference_policy_kl_penalty=0.0)
    return cfg.replace(grpo=grpo, rollout=rollout, loss=loss)


def check_run(cfg: Config) -> None:
    """Cheap checks that need no model: the model folder, the mesh, the batch split, a pod."""
    check_model_path(cfg.model.path, cfg.sft.max_seq_length)
    sharding.make_rules(cfg.mesh)
    step_setup.check_batch_split(step_config(cfg), jax.device_count())
    if cfg.sft.batch_size % jax.process_count():
        raise ConfigError(
            f"sft.batch_size: {cfg.sft.batch_size} rows do not split over "
            f"{jax.process_count()} processes"
        )


@dataclasses.dataclass
class SFTRun:
    """Everything a running SFT job holds (built by `setup`)."""

    cfg: Config
    setup: step_setup.StepSetup
    state: step.TrainState
    source: SFTSource
    val_examples: Optional[list[Encoded]]
    """Encoded validation examples (None: no validation loss)."""
    task: Any
    backend: Any
    """A local rollout backend for greedy accuracy (None: not measured)."""
    checkpointer: Checkpointer
    start_step: int
    pad_id: int
    val_loss_fn: Any


def setup(
    cfg: Config, run_dir: Path, resume: bool, train_dataset=None, eval_dataset=None
) -> SFTRun:
    from flax import nnx

    from jgrpo.rollout import LocalRollout, RolloutEngine, load_tokenizer

    check_run(cfg)
    compile_cache.enable()
    task = make_task(cfg.data, cfg.sft.seed)  # ConfigError before the model loads
    try:
        folder = policy_folder(cfg.model)
        tokenizer = load_tokenizer(folder)
        tools = task.tool_runner.schemas if task.tool_runner.active else None
        encoder = Encoder(tokenizer, cfg, tools)
        source, val_examples = make_sources(cfg, encoder, task, train_dataset, eval_dataset)
    except BaseException:
        task.close()
        raise
    run_dir.mkdir(parents=True, exist_ok=True)
    if distributed.is_primary():
        write_run_config(run_dir, cfg)
    log.info("loading the model %s", cfg.model.path)
    model = load_policy(cfg.model, folder, seed=cfg.sft.seed)
    built = step_setup.build_step(step_config(cfg), model, objective="sft")
    log_placement(built)
    state = built.state
    checkpointer = Checkpointer.from_config(run_dir / "checkpoints", cfg.checkpoint)
    distributed.watch_checkpoints(checkpointer.directory, latest_complete_step)
    start = 0
    restored = checkpointer.restore_latest_intact(state) if resume else None
    if restored is not None:
        state, meta, _ = restored
        start = meta["step"]
        source.restore(meta["data_state"])
        log.info("resumed from step %d of %d", start, cfg.sft.max_num_steps)
    elif resume:
        log.info("no intact checkpoint to resume from: starting at step 0")
    backend, accuracy = None, cfg.sft.val_accuracy
    if accuracy is None:  # the data task's own records: its held-out questions measure them
        accuracy = cfg.sft.train_path is None and train_dataset is None
    if accuracy and task.has_verifier and evaluation.has_held_out(task):
        engine = RolloutEngine(cfg, model.cfg, tokenizer, task)
        backend = LocalRollout(engine, nnx.graphdef(model), cfg.grpo.seed, 1, built.frozen)
    trainable = sum(x.size for x in jax.tree.leaves(state.params))
    frozen = sum(x.size for x in jax.tree.leaves(built.frozen))
    log.info("trainable parameters: %s of %s", f"{trainable:,}", f"{trainable + frozen:,}")
    return SFTRun(
        cfg=cfg,
        setup=dataclasses.replace(built, state=state),
        state=state,
        source=source,
        val_examples=val_examples,
        task=task,
        backend=backend,
        checkpointer=checkpointer,
        start_step=start,
        pad_id=int(tokenizer.pad_token_id),
        val_loss_fn=make_val_loss(built),
    )


def make_val_loss(built: step_setup.StepSetup):
    """jit((params, frozen, batch) -> (summed NLL of the target tokens, their count))."""

    def fn(params, frozen, batch):
        full = step.with_frozen(params, frozen)
        lp_bt = step.sequence_logprobs(
            built.graphdef, full, batch.input_ids, batch.attention_mask, 1.0
        )
        m_bt = batch.token_mask * batch.sample_mask[:, None]
        return -jnp.sum(lp_bt * m_bt), jnp.sum(m_bt)

    return jax.jit(fn)


def validation_loss(r: SFTRun) -> float:
    """Token-mean NLL of every validation example (batches of sft.batch_size rows)."""
    s = r.cfg.sft
    total = count = 0.0
    lo, hi = distributed.process_slice(s.batch_size)
    for first in range(0, len(r.val_examples), s.batch_size):
        chunk = r.val_examples[first : first + s.batch_size]
        batch = make_batch(chunk, s.batch_size, s.max_seq_length, r.pad_id)
        local = jax.tree.map(lambda x: x[lo:hi], batch)  # noqa: B023 - used at once
        nll, n = r.val_loss_fn(r.state.params, r.setup.frozen, local.shard(r.setup.mesh))
        total, count = total + float(nll), count + float(n)
    return total / max(count, 1.0)


def validate(r: SFTRun, step_index: int) -> dict[str, float]:
    start = time.perf_counter()
    metrics: dict[str, float] = {}
    if r.val_examples:
        metrics["val/loss"] = validation_loss(r)
    if r.backend is not None:
        r.backend.publish(r.state.params, step_index)
        metrics |= evaluation.validate_all(r.cfg, r.backend, r.task, step_index)
    return metrics | {"perf/val_s": time.perf_counter() - start}


def train_one_step(r: SFTRun) -> dict[str, float]:
    s, u = r.cfg.sft, r.setup
    start = time.perf_counter()
    examples = r.source.next_examples(s.batch_size)
    lo, hi = distributed.process_slice(s.batch_size)
    batch = make_batch(examples[lo:hi], hi - lo, s.max_seq_length, r.pad_id)
    r.state, metrics = u.step_fn(r.state, u.device_batch(batch), u.hparams, None, u.frozen)
    out = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
    took = time.perf_counter() - start
    tokens = float(sum(len(ids) for ids, _ in examples))
    return out | {"perf/step_s": took, "perf/tokens_per_s": tokens / max(took, 1e-9)}


def save_checkpoint(r: SFTRun, done: int) -> None:
    meta = {"step": done, "data_state": r.source.state(), "config": to_dict(r.cfg)}
    r.checkpointer.save(done, r.state, meta)


def run(
    cfg: Config, run_dir: str | Path, resume: bool = False, *, train_dataset=None, eval_dataset=None
) -> History:
    """Fine-tune; returns the validation records [{step, val/loss, val/accuracy, ...}] (also
    RUN_DIR/summary.json); the model is left in RUN_DIR/final/ (an HF folder).
    `train_dataset` / `eval_dataset` (list of dicts or datasets.Dataset) replace sft.train_path
    / sft.val_path."""
    forget_reports()
    with console_lines():
        if not distributed.is_primary() and log.getEffectiveLevel() == logging.INFO:
            log.setLevel(logging.WARNING)
        return _run(cfg, Path(run_dir), resume, train_dataset, eval_dataset)


def _run(cfg: Config, run_dir: Path, resume: bool, train_dataset, eval_dataset) -> History:
    r = setup(cfg, run_dir, resume, train_dataset, eval_dataset)
    s = cfg.sft
    resume_step = r.start_step if resume else None
    if distributed.is_primary():
        logger = MetricsLogger(
            run_dir, cfg.logging, s.max_num_steps, resume_step=resume_step, run_config=to_dict(cfg)
        )
    else:
        logger = NullLogger()
    history = History(start_step=r.start_step)
    if resume_step and distributed.is_primary():
        from jgrpo.train import validation_records

        history += validation_records(read_metrics(run_dir))
    began, done = time.perf_counter(), r.start_step
    try:
        for i in range(r.start_step, s.max_num_steps):
            if i == r.start_step:
                log.info(
                    "step %d of %d: compiling the SFT step (this can take a minute on %s)",
                    i + 1,
                    s.max_num_steps,
                    jax.default_backend().upper(),
                )
            metrics = train_one_step(r)
            done = i + 1
            periodic = s.val_period and done % s.val_period == 0
            if periodic or (s.val_at_end and done == s.max_num_steps):
                val = validate(r, done)
                history.append({"step": done, **val})
                metrics |= val
            logger.log(done, metrics)
            if r.checkpointer.should_save(done) or (
                done == s.max_num_steps and cfg.checkpoint.save_period > 0
            ):
                save_checkpoint(r, done)
                log.info("saved checkpoint %s", run_dir / "checkpoints" / str(done))
        save_policy(r.setup, r.state.params, run_dir / FINAL_DIR)
        steps = done - r.start_step
        finished = (
            f"trained {steps} SFT step{'s' * (steps != 1)} in "
            f"{time.perf_counter() - began:.1f} s; the model is in {run_dir / FINAL_DIR}"
        )
    finally:
        logger.close()
        r.task.close()
        r.checkpointer.close()
    log.info("%s", finished)
    if distributed.is_primary():
        write_summary(run_dir, history)
        if cfg.logging.plot:
            plot_run(run_dir)
    return history


def summarize(history: list[dict]) -> str:
    """The first and last validation records: step, val/loss, val/accuracy (if measured)."""
    if not history:
        return "no validation was run (sft.val_period, sft.val_at_end)"
    first, last = history[0], history[-1]
    lines = [
        f"{'':18s}{'first':>10s}{'last':>10s}",
        f"{'step':18s}{first['step']:>10}{last['step']:>10}",
    ]
    for key in ("val/loss", "val/accuracy"):
        if key in first and key in last:
            lines.append(f"{key:18s}{first[key]:>10.4f}{last[key]:>10.4f}")
    return "\n".join(lines)
