"""A run's per-step metrics: metrics.jsonl (read, truncate, append) and the sinks they fan out to.

`MetricsLogger(run_dir, logging_cfg, total_steps, resume_step=...)` builds the sinks that
`logging_cfg` enables and hands each step's values to all of them: `JsonlSink` (always:
RUN_DIR/metrics.jsonl and RUN_DIR/samples.jsonl; its docstring states the file's rules),
`TensorBoardSink` (RUN_DIR/tb/), `WandbSink` and `ProgressBarSink` (stderr). Every sink has
the `Sink` interface: write(step, values), write_samples(step, rows, text), close().
`read_metrics` / `truncate_metrics` are the file's readers; exact resume from checkpoint step k
drops the lines with step > k before anything is logged, so a resumed file equals the
uninterrupted one. On a pod only process 0 opens the sinks; the others log to a `NullLogger`.
W&B is used only when ``logging.wandb`` is true; if wandb is then not importable the logger
raises `ConfigError` naming ``logging.wandb`` before touching the run directory.
PNG curves of the file: `jgrpo.plots`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from jgrpo.config import ConfigError, LoggingConfig
from jgrpo.files import write_atomic

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"


def _metrics_path(run_dir_or_file: str | Path) -> Path:
    path = Path(run_dir_or_file)
    return path / METRICS_FILE if path.is_dir() else path


def _parse_line(line: str) -> Optional[dict]:
    """A metrics line as a dict, or None unless it is {"step": int >= 0, key: number|null}."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict):
        return None
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    for key, value in row.items():
        if key != "step" and value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return None
    return row


def _scan(path: Path) -> tuple[list[dict], list[int], int]:
    """(well-formed rows, 1-based numbers of damaged lines, number of the last non-blank line)."""
    if not path.exists():
        return [], [], 0
    rows, bad, last = [], [], 0
    for i, raw in enumerate(path.read_bytes().split(b"\n")):
        if not raw.strip():
            continue
        last = i + 1
        try:
            row = _parse_line(raw.decode("utf-8"))
        except UnicodeDecodeError:
            row = None
        if row is None:
            bad.append(i + 1)
        else:
            rows.append(row)
    return rows, bad, last


def read_metrics(run_dir_or_file: str | Path) -> list[dict]:
    """The lines of RUN_DIR/metrics.jsonl as dicts (a torn last line from a crash is skipped).

    A damaged line elsewhere (not UTF-8 JSON of the form the logger writes) raises
    ConfigError naming the file and line."""
    path = _metrics_path(run_dir_or_file)
    rows, bad, last = _scan(path)
    inner = [n for n in bad if n != last]
    if inner:
        more = f" (and {len(inner) - 1} more)" if len(inner) > 1 else ""
        raise ConfigError(
            f"{str(path)!r} line {inner[0]}{more}: not a metrics line (a JSON object with an "
            f"integer step and numeric or null values)"
        )
    return rows


def _format_line(step: int, values: Mapping[str, Optional[float]]) -> str:
    row = {"step": step, **{k: values[k] for k in sorted(values)}}
    return json.dumps(row, allow_nan=False) + "\n"


def truncate_metrics(run_dir_or_file: str | Path, last_step: int) -> list[dict]:
    """Atomically drop the lines with step > `last_step`; returns the lines kept.

    Damaged lines (torn by a crash anywhere in the file, not only the last) are dropped too,
    the intact lines kept; damaged lines before the last one are named in one warning (a torn
    last line is the usual trace of a kill mid-write and goes silently)."""
    path = _metrics_path(run_dir_or_file)
    rows, bad, last = _scan(path)
    rows = [r for r in rows if r["step"] <= last_step]
    if [n for n in bad if n != last]:
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        warnings.warn(
            f"{path}: dropped {len(bad)} damaged line(s) (line {shown}); kept the intact lines "
            f"up to step {last_step}",
            stacklevel=2,
        )
    if path.exists():
        write_atomic(path, "".join(_format_line(r["step"], _values(r)) for r in rows))
    return rows


def _values(row: Mapping[str, Any]) -> dict[str, Optional[float]]:
    return {k: v for k, v in row.items() if k != "step"}


def _to_float(key: str, value: Any) -> float:
    if hasattr(value, "shape") and tuple(value.shape) != ():
        if math.prod(value.shape) != 1:
            raise TypeError(f"metric {key!r}: expected a scalar, got shape {tuple(value.shape)}")
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r}: expected a number, got {value!r}") from None


class Sink:
    """One destination of a run's metrics (no-op defaults; each sink overrides what it keeps)."""

    def write(self, step: int, values: Mapping[str, float]) -> None:
        """Record `values` (plain floats, non-finite included) of training step `step`."""

    def write_samples(self, step: int, rows: list[dict], text: str) -> None:
        """Record a few sample rows of step `step` (`text`: the same rows as markdown)."""

    def close(self) -> None:
        """Flush and release the sink."""


class JsonlSink(Sink):
    """RUN_DIR/metrics.jsonl, one JSON object per logged step flushed per line, and
    RUN_DIR/samples.jsonl, a few {step, prompt, completion, reward, ...} rows per step.

    metrics.jsonl rules (what `read_metrics` and ``jgrpo plot`` rely on):
    - Every line is ``{"step": int, <key>: float | null, ...}`` with keys sorted after
      ``step``, and every line of the file has the same key set. A key first logged at step s
      (validation keys such as ``val/accuracy`` first appear at the first validation) is added
      as ``null`` to all earlier lines by an atomic rewrite of the file (once per new key);
      later lines that do not log it carry ``null`` too.
    - Values are plain floats. NaN and +-inf are written as ``null`` to keep the file strict
      JSON; the other sinks still get the real value.
    - Writing twice with the same step merges into that step's line (train metrics, then
      validation at the same step); steps must not decrease (ValueError, nothing written).
    - `resume_step=k`: lines with step > k are dropped by an atomic rewrite; None is a fresh
      run: an existing metrics.jsonl is replaced, and samples.jsonl at the first samples.
    """

    def __init__(self, run_dir: Path, resume_step: Optional[int], keys: tuple[str, ...] = ()):
        self.path = run_dir / METRICS_FILE
        self.samples_path = run_dir / SAMPLES_FILE
        self._fresh, self._samples_started = resume_step is None, False
        # Lines already in the file; the last one is the newest step's (merge target).
        rows = truncate_metrics(self.path, resume_step) if resume_step is not None else []
        if resume_step is None:
            write_atomic(self.path, "")
        self._keys: set[str] = set(keys).union(*(_values(r) for r in rows))
        self._rows = rows
        if self._keys and any(set(_values(r)) != self._keys for r in rows):
            self._rewrite()
        self._file = open(self.path, "a")

    def _rewrite(self) -> None:
        """Give every line the current key set (missing keys as null), atomically."""
        text = "".join(
            _format_line(r["step"], {k: r.get(k) for k in self._keys}) for r in self._rows
        )
        write_atomic(self.path, text)
        self._rows = [json.loads(line) for line in text.splitlines()]

    def write(self, step: int, values: Mapping[str, float]) -> None:
        last_step = self._rows[-1]["step"] if self._rows else None
        if last_step is not None and step < last_step:
            raise ValueError(f"log: step {step} after step {last_step}; steps must not decrease")
        clean = {k: (v if math.isfinite(v) else None) for k, v in values.items()}
        merge = step == last_step
        row = dict(self._rows[-1]) if merge else {"step": step}
        row.update(clean)
        new_keys = set(clean) - self._keys
        self._keys |= new_keys
        if merge:
            self._rows[-1] = row
        else:
            self._rows.append(row)
        if new_keys or merge:
            self._file.close()
            self._rewrite()
            self._file = open(self.path, "a")
        else:
            self._file.write(_format_line(step, {k: row.get(k) for k in self._keys}))
            self._file.flush()

    def write_samples(self, step: int, rows: list[dict], text: str) -> None:
        if not self._samples_started and self._fresh:
            self.samples_path.unlink(missing_ok=True)
        self._samples_started = True
        with open(self.samples_path, "a") as fh:
            fh.writelines(json.dumps(r, default=str) + "\n" for r in rows)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardSink(Sink):
    """TensorBoard events under RUN_DIR/tb/: a scalar per metric, the samples as text."""

    def __init__(self, run_dir: Path, resume_step: Optional[int]):
        from tensorboardX import SummaryWriter

        # purge_step hides events of the killed run past the resume point.
        purge = resume_step + 1 if resume_step is not None else None
        self._writer = SummaryWriter(logdir=str(run_dir / "tb"), purge_step=purge)

    def write(self, step: int, values: Mapping[str, float]) -> None:
        for k, v in values.items():
            self._writer.add_scalar(k, v, step)
        self._writer.flush()

    def write_samples(self, step: int, rows: list[dict], text: str) -> None:
        self._writer.add_text("samples", text, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink(Sink):
    """A Weights & Biases run (project logging.wandb_project, named after RUN_DIR)."""

    def __init__(self, wandb, run_dir: Path, project: str, run_config: Optional[dict]):
        self._run = wandb.init(
            project=project,
            dir=str(run_dir),
            name=run_dir.name,
            config=run_config,
            resume="allow",
        )

    def write(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def write_samples(self, step: int, rows: list[dict], text: str) -> None:
        self._run.log({"samples": text}, step=step)

    def close(self) -> None:
        self._run.finish()


class ProgressBarSink(Sink):
    """Progress on stderr (`stream`): on a terminal a tqdm bar of the steps done of
    `total_steps`, the latest `FIELDS` and the ETA; elsewhere (a log file, CI) one plain
    `step N/T ...` line each tenth of the run. The first step this process trains compiles
    the train step: its throughput is not shown and the ETA runs on the steps after it."""

    FIELDS = {"reward": "reward/mean", "acc": "val/accuracy", "tok/s": "perf/tokens_per_s"}
    """Bar field -> metric key; the bar shows the latest value seen of each."""
    COMPILING = frozenset({"perf/tokens_per_s"})
    """Keys whose value at the first trained step measures compiling (not shown)."""

    def __init__(
        self, total_steps: int, resume_step: Optional[int], stream=None, clock=time.perf_counter
    ):
        self._stream = stream or sys.stderr
        self._clock = clock
        self._total, self._start = total_steps, resume_step or 0
        self._done = self._printed = self._start
        self._compiled: Optional[tuple[float, int]] = None  # (time, step) after the first step
        self._line_every = max(1, (total_steps - self._start) // 10)
        self._shown: dict[str, float] = {}
        self._bar = None
        if self._stream.isatty():
            from tqdm import tqdm

            try:  # a terminal without a size (`script`, some CI runners) reports 0 columns
                sized = os.get_terminal_size(self._stream.fileno()).columns > 0
            except (AttributeError, OSError, ValueError):
                sized = True
            self._bar = tqdm(
                total=total_steps,
                initial=self._start,
                file=self._stream,
                unit="step",
                dynamic_ncols=sized,
                ncols=None if sized else 100,
                nrows=None if sized else 24,  # tqdm hides bars below a 0-row screen
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
            )

    def _eta(self) -> Optional[float]:
        if self._compiled is None or self._done <= self._compiled[1]:
            return None
        began, step = self._compiled
        return (self._clock() - began) / (self._done - step) * (self._total - self._done)

    def write(self, step: int, values: Mapping[str, float]) -> None:
        first = step == self._start + 1 and self._compiled is None
        for name, key in self.FIELDS.items():
            if key in values and not (first and key in self.COMPILING):
                self._shown[name] = values[key]
        if step > self._done:
            self._done = step
            if first:
                self._compiled = (self._clock(), step)
        fields = {k: f"{self._shown[k]:.4g}" for k in self.FIELDS if k in self._shown}
        eta = self._eta()
        if eta is not None:
            fields["eta"] = _format_seconds(eta)
        if self._bar is not None:
            self._bar.set_postfix(fields, refresh=False)
            self._bar.update(max(0, step - self._bar.n))
        elif step > self._printed and (
            (step - self._start) % self._line_every == 0 or step == self._total
        ):
            self._printed = step
            text = " ".join(f"{k}={v}" for k, v in fields.items())
            print(f"jgrpo: step {step}/{self._total} {text}".rstrip(), file=self._stream)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _format_seconds(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _import_wandb():
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "logging.wandb: true, but the `wandb` package is not installed; "
            "pip install wandb, or set logging.wandb=false"
        ) from None
    return wandb


class MetricsLogger:
    """Fans each step's metrics out to the sinks of `logging_cfg`; a context manager, or
    close()."""

    def __init__(
        self,
        run_dir: str | Path,
        logging_cfg: LoggingConfig,
        total_steps: int,
        *,
        resume_step: Optional[int] = None,
        keys: tuple[str, ...] = (),
        run_config: Optional[dict] = None,
    ):
        """Open the sinks of `logging_cfg` for a run of `total_steps` steps (the bar's ETA).

        `resume_step`: checkpoint step resumed from (None = fresh run). `keys`: metric keys
        known up front (saves a rewrite when they first appear). `run_config`: the resolved
        config dict, given to W&B.
        """
        self.run_dir = Path(run_dir)
        wandb = _import_wandb() if logging_cfg.wandb else None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # The jsonl sink comes first: it refuses a decreasing step before any sink writes.
        self.sinks: list[Sink] = [JsonlSink(self.run_dir, resume_step, keys)]
        if logging_cfg.tensorboard:
            self.sinks.append(TensorBoardSink(self.run_dir, resume_step))
        if wandb is not None:
            project = logging_cfg.wandb_project
            self.sinks.append(WandbSink(wandb, self.run_dir, project, run_config))
        if logging_cfg.progress_bar:
            self.sinks.append(ProgressBarSink(total_steps, resume_step))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` (key -> scalar) for training step `step` in every sink."""
        if "step" in metrics:
            raise ValueError("metrics: `step` is passed as the step argument, not a metric key")
        values = {k: _to_float(k, v) for k, v in metrics.items()}
        for sink in self.sinks:
            sink.write(step, values)

    def log_samples(self, step: int, samples: list[Mapping[str, Any]]) -> None:
        """Record a few {prompt, completion, reward, ...} rows of step `step`: appended to
        RUN_DIR/samples.jsonl (one JSON object a line, with `step`; a fresh run starts the file
        anew, a resumed run appends) and given to TensorBoard / W&B as text."""
        if not samples:
            return
        rows = [{"step": step, **dict(r)} for r in samples]
        text = "\n\n".join(
            f"**reward {r.get('reward')}**\n\n    {r.get('prompt')!s}\n    -> "
            f"{r.get('completion')!s}"
            for r in rows
        )
        for sink in self.sinks:
            sink.write_samples(step, rows, text)

    def close(self) -> None:
        """Flush and close every sink (once)."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullLogger:
    """The logger of every process but process 0 of a pod: the sinks exist once per run."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Nothing: process 0 logs the pod's (global) metrics."""

    def log_samples(self, step: int, samples: list[Mapping[str, Any]]) -> None:
        """Nothing: process 0 logs the samples of its slice (the step's first rows)."""

    def close(self) -> None:
        """Nothing to close."""
