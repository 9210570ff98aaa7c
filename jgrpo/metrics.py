"""Per-step metric sinks of a run: metrics.jsonl, TensorBoard, Weights & Biases, a progress bar;
and PNG curves drawn from metrics.jsonl.

On-disk layout::

    RUN_DIR/metrics.jsonl   one JSON object per logged step, flushed per line
    RUN_DIR/samples.jsonl   a few {step, prompt, completion, reward, ...} rows per step
    RUN_DIR/tb/             TensorBoard events (logging.tensorboard)
    RUN_DIR/plots/*.png     plot_run(RUN_DIR): reward, accuracy, kl, length, loss (.png)

metrics.jsonl rules (what :func:`read_metrics` and ``jgrpo plot`` rely on):

- Every line is ``{"step": int, <key>: float | null, ...}`` with keys sorted after ``step``,
  and every line of the file has the same key set. A key first logged at step s (validation
  keys such as ``val/accuracy`` first appear at the first validation) is added as ``null`` to
  all earlier lines by an atomic rewrite of the file; later lines that do not log it carry
  ``null`` too. So validation values live in the line of the step they were measured at and
  are ``null`` on the other steps. The rewrite happens once per new key, not per step.
- Values are plain floats (numpy / jax scalars are converted). NaN and +-inf are written as
  ``null`` to keep the file strict JSON; TensorBoard, W&B and the bar still get the real value.
- ``log`` twice with the same step merges into that step's line (train metrics, then
  validation at the same step); steps must not decrease.
- Resume from checkpoint step k (``resume_step=k``): lines with step > k are dropped by an
  atomic rewrite before anything is logged, so a resumed file equals the uninterrupted one.
  ``resume_step=None`` is a fresh run: an existing metrics.jsonl is replaced.

On a pod only process 0 opens these sinks; the other processes log to a :class:`NullLogger`
(the metrics every process computes are the pod's global ones).

W&B is used only when ``logging.wandb`` is true; if wandb is then not importable the logger
raises :class:`ConfigError` naming ``logging.wandb`` at construction, before any training,
rather than silently running without it.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from jgrpo.config import ConfigError, LoggingConfig
from jgrpo.files import write_atomic

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"

# Progress-bar field -> metric key; the bar shows the latest value seen of each.
BAR_FIELDS = {"reward": "reward/mean", "acc": "val/accuracy", "tok/s": "perf/tokens_per_s"}

# plot_run: one PNG per name, holding every metric key that starts with one of these prefixes
# or equals one without its slash (`loss` and `loss/pg` both go to loss.png).
# Curves sharing a figure share a scale: counts and lengths stay out of the [0, 1] figures.
PLOT_GROUPS = {
    "reward": ("reward/mean", "reward/std", "reward/accuracy", "reward/frac_groups_all_equal"),
    "accuracy": ("val/accuracy", "val/reward_mean"),
    "kl": ("kl/", "loss/kl", "logprob/gen_kl_error", "logprob/policy_kl_error"),
    "length": ("length/mean", "length/min", "length/max", "val/length_mean"),
    "loss": ("loss/",),
}


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


class MetricsLogger:
    """Writes each step's metrics to every enabled sink; use as a context manager or close()."""

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
        self.cfg = logging_cfg
        self._fresh, self._samples_started = resume_step is None, False
        self.path = self.run_dir / METRICS_FILE
        wandb = None
        if logging_cfg.wandb:
            try:
                import wandb
            except ImportError:
                raise ConfigError(
                    "logging.wandb: true, but the `wandb` package is not installed; "
                    "pip install wandb, or set logging.wandb=false"
                ) from None
        self.run_dir.mkdir(parents=True, exist_ok=True)

        # Lines already in the file; _last_row is the line of the newest step (merge target).
        rows = truncate_metrics(self.path, resume_step) if resume_step is not None else []
        if resume_step is None:
            write_atomic(self.path, "")
        self._keys: set[str] = set(keys).union(*(_values(r) for r in rows))
        self._rows = rows
        if self._keys and any(set(_values(r)) != self._keys for r in rows):
            self._rewrite()
        self._file = open(self.path, "a")
        self._bar_values: dict[str, float] = {}

        self._tb = None
        if logging_cfg.tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step hides events of the killed run past the resume point.
            purge = resume_step + 1 if resume_step is not None else None
            self._tb = SummaryWriter(logdir=str(self.run_dir / "tb"), purge_step=purge)

        self._wandb_run = None
        if wandb is not None:
            self._wandb_run = wandb.init(
                project=logging_cfg.wandb_project,
                dir=str(self.run_dir),
                name=self.run_dir.name,
                config=run_config,
                resume="allow",
            )

        self._bar = None
        if logging_cfg.progress_bar:
            from tqdm import tqdm

            start = resume_step or 0
            self._bar = tqdm(
                total=total_steps, initial=start, file=sys.stderr, unit="step", dynamic_ncols=True
            )

    def _rewrite(self) -> None:
        """Give every line the current key set (missing keys as null), atomically."""
        text = "".join(
            _format_line(r["step"], {k: r.get(k) for k in self._keys}) for r in self._rows
        )
        write_atomic(self.path, text)
        self._rows = [json.loads(line) for line in text.splitlines()]

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` (key -> scalar) for training step `step` in every sink."""
        if "step" in metrics:
            raise ValueError("metrics: `step` is passed as the step argument, not a metric key")
        last_step = self._rows[-1]["step"] if self._rows else None
        if last_step is not None and step < last_step:
            raise ValueError(f"log: step {step} after step {last_step}; steps must not decrease")
        values = {k: _to_float(k, v) for k, v in metrics.items()}
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

        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(dict(values), step=step)
        if self._bar is not None:
            for name, key in BAR_FIELDS.items():
                if key in values:
                    self._bar_values[name] = values[key]
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in self._bar_values.items()})
            self._bar.update(max(0, step - self._bar.n))

    def log_samples(self, step: int, samples: list[Mapping[str, Any]]) -> None:
        """Append a few {prompt, completion, reward, ...} rows of step `step` to
        RUN_DIR/samples.jsonl (one JSON object a line, with `step`) and to TensorBoard / W&B as
        text. A fresh run starts the file anew; a resumed run appends."""
        if not samples:
            return
        rows = [{"step": step, **dict(r)} for r in samples]
        path = self.run_dir / SAMPLES_FILE
        if not self._samples_started and self._fresh:
            path.unlink(missing_ok=True)
        self._samples_started = True
        with open(path, "a") as fh:
            fh.writelines(json.dumps(r, default=str) + "\n" for r in rows)
        text = "\n\n".join(
            f"**reward {r.get('reward')}**\n\n    {r.get('prompt')!s}\n    -> "
            f"{r.get('completion')!s}"
            for r in rows
        )
        if self._tb is not None:
            self._tb.add_text("samples", text, step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log({"samples": text}, step=step)

    def close(self) -> None:
        """Flush and close every sink."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

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


def plot_run(run_dir: str | Path) -> list[Path]:
    """Draw RUN_DIR/plots/<group>.png for each PLOT_GROUPS entry with data; returns the paths.

    Validation keys have values on few steps: each curve is drawn over the steps where its
    key is not null, with markers. Uses the Agg canvas directly (no pyplot, no global backend).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    keys = sorted({k for r in rows for k in r if k != "step"})
    out_dir = run_dir / "plots"
    written = []
    for name, prefixes in PLOT_GROUPS.items():
        series = {}
        for key in keys:
            if not (key.startswith(prefixes) or key in {p.rstrip("/") for p in prefixes}):
                continue
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                series[key] = points
        if not series:
            continue
        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for key, points in series.items():
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if len(points) < 50 else None, ms=3, label=key)
        ax.set_xlabel("step")
        ax.set_title(f"{run_dir.name}: {name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        written.append(path)
    return written
