"""PNG curves of a run, drawn from its metrics.jsonl: RUN_DIR/plots/<chart>.png.

`chart_series(rows)` decides what each chart draws (one `Series` per distinct curve: keys
whose values coincide at every step are one curve, labelled with all their names);
`draw_chart` draws one chart on an integer step axis; `plot_run(RUN_DIR)` writes the PNG of
every `CHARTS` entry that has data and returns the paths (what `jgrpo plot` and the end of a
training run call). It reads the file with `metrics.read_metrics`, so a damaged metrics.jsonl
is refused the same way. docs/metrics.md lists the keys and their charts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jgrpo.metrics import read_metrics

CHARTS = {
    "reward": ("reward/mean", "reward/std", "reward/accuracy", "reward/frac_groups_all_equal"),
    "accuracy": ("val/accuracy", "val/reward_mean"),
    "kl": ("kl/", "loss/kl", "logprob/gen_kl_error", "logprob/policy_kl_error"),
    "length": ("length/mean", "length/min", "length/max", "val/length_mean"),
    "loss": ("loss/",),
    "throughput": ("perf/tokens_per_s",),
    "grad_norm": ("train/grad_norm",),
    "entropy": ("policy/approx_entropy",),
    "clip_fraction": ("ratio/clip_fraction", "ratio/dual_clip_fraction", "is/oob_ratio"),
}
"""Chart name -> the metric keys it holds: a key equal to an entry, or starting with an entry
that ends in `/`, or equal to such an entry without its slash (`loss` goes to loss.png).
Curves sharing a chart share a scale: counts and lengths stay out of the [0, 1] charts."""


@dataclasses.dataclass(frozen=True)
class Series:
    """One curve of a chart: the keys it stands for (several when their values coincide at
    every step) and its points, the steps where the key is not null."""

    keys: tuple[str, ...]
    steps: tuple[int, ...]
    values: tuple[float, ...]

    @property
    def label(self) -> str:
        """The legend entry: the keys joined by ` = `."""
        return " = ".join(self.keys)


def _in_chart(key: str, entries: tuple[str, ...]) -> bool:
    return key in entries or any(
        e.endswith("/") and (key.startswith(e) or key == e[:-1]) for e in entries
    )


def chart_series(rows: list[dict]) -> dict[str, list[Series]]:
    """{chart: its curves} for the metrics rows `rows` (charts without data are left out).

    Keys are taken in sorted order; a key whose points equal an earlier curve's joins that
    curve instead of drawing a second line on top of it."""
    keys = sorted({k for r in rows for k in r if k != "step"})
    charts = {}
    for name, entries in CHARTS.items():
        curves: dict[tuple, list[str]] = {}
        for key in keys:
            if not _in_chart(key, entries):
                continue
            points = tuple((int(r["step"]), r[key]) for r in rows if r.get(key) is not None)
            if points:
                curves.setdefault(points, []).append(key)
        if curves:
            charts[name] = [
                Series(tuple(names), *map(tuple, zip(*points))) for points, names in curves.items()
            ]
    return charts


def draw_chart(title: str, series: list[Series]):
    """A matplotlib Figure of `series` on an integer step axis (the Agg canvas directly: no
    pyplot, no global backend). Validation keys have values on few steps: each curve is drawn
    over its own steps, with markers below 50 points."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for s in series:
        ax.plot(s.steps, s.values, marker="o" if len(s.steps) < 50 else None, ms=3, label=s.label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_run(run_dir: str | Path) -> list[Path]:
    """Draw RUN_DIR/plots/<chart>.png for each CHARTS entry with data; returns the paths."""
    run_dir = Path(run_dir)
    out_dir = run_dir / "plots"
    written = []
    for name, series in chart_series(read_metrics(run_dir)).items():
        fig = draw_chart(f"{run_dir.name}: {name}", series)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        written.append(path)
    return written
