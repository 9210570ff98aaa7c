"""PNG curves of a run, drawn from its metrics.jsonl: RUN_DIR/plots/<group>.png.

`plot_run(RUN_DIR)` draws one figure per `PLOT_GROUPS` entry that has data and returns the
paths written (what `jgrpo plot` and the end of a training run call). It reads the file with
`metrics.read_metrics`, so a damaged metrics.jsonl is refused the same way.
"""

from __future__ import annotations

from pathlib import Path

from jgrpo.metrics import read_metrics

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
