"""jgrpo.metrics and jgrpo.plots: jsonl lines and key sets, resume, TensorBoard, W&B, bar, plots."""

import dataclasses
import json
import math
import re
import struct
import sys
import types
import typing
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo import train
from jgrpo.config import Config, ConfigError, LoggingConfig, load_config
from jgrpo.metrics import MetricsLogger, Sink, read_metrics, truncate_metrics
from jgrpo.plots import CHARTS, Series, chart_series, draw_chart, plot_run

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")

QUIET = LoggingConfig(tensorboard=False, wandb=False, progress_bar=False)


def train_metrics(step: int) -> dict:
    return {
        "loss": np.float32(0.5 / step),
        "reward/mean": jnp.asarray(step / 10.0),
        "kl/penalty": 0.01 * step,
        "length/mean": 20 + step,
    }


def run_steps(logger, steps, val_every=3):
    for step in steps:
        logger.log(step, train_metrics(step))
        if step % val_every == 0:
            # Validation of the same step: merged into that step's line.
            logger.log(step, {"val/accuracy": step / 100.0})


def test_jsonl_lines_share_one_key_set(tmp_path):
    with MetricsLogger(tmp_path, QUIET, total_steps=5) as logger:
        logger.log(0, {"val/accuracy": 0.125})  # validation before the first step
        run_steps(logger, range(1, 6))
        # Flushed per line: readable while the logger is open.
        assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4, 5]
        logger.log(6, {"loss": float("nan"), "reward/mean": np.inf})

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    keys = ["step", "kl/penalty", "length/mean", "loss", "reward/mean", "val/accuracy"]
    assert all(list(r) == keys for r in rows)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert rows[0] == {k: None for k in keys} | {"step": 0, "val/accuracy": 0.125}
    assert rows[2] == {
        "step": 2,
        "kl/penalty": 0.02,
        "length/mean": 22.0,
        "loss": float(np.float32(0.25)),
        "reward/mean": float(jnp.asarray(0.2)),
        "val/accuracy": None,
    }
    assert rows[3]["val/accuracy"] == 0.03 and rows[3]["loss"] == float(np.float32(0.5 / 3))
    assert all(isinstance(r["length/mean"], float) for r in rows[1:6])
    # Non-finite values are null (strict JSON).
    assert rows[6]["loss"] is None and rows[6]["reward/mean"] is None
    assert "NaN" not in "".join(lines) and "Infinity" not in "".join(lines)


def test_log_rejects_bad_input(tmp_path):
    with MetricsLogger(tmp_path, QUIET, total_steps=5) as logger:
        logger.log(2, {"loss": 1.0})
        with pytest.raises(ValueError, match="must not decrease"):
            logger.log(1, {"loss": 1.0})
        with pytest.raises(TypeError, match="scalar"):
            logger.log(3, {"loss": np.ones(3)})
        with pytest.raises(TypeError, match="number"):
            logger.log(3, {"loss": "high"})


def test_resume_truncates_to_checkpoint_step(tmp_path):
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    with MetricsLogger(full_dir, QUIET, total_steps=8) as logger:
        run_steps(logger, range(1, 9))

    # Killed after step 7 (mid-write of step 8's line); the last checkpoint was step 4.
    with MetricsLogger(resumed_dir, QUIET, total_steps=8) as logger:
        run_steps(logger, range(1, 8))
    with open(resumed_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "loss": 0.0')
    with MetricsLogger(resumed_dir, QUIET, total_steps=8, resume_step=4) as logger:
        assert [r["step"] for r in read_metrics(resumed_dir)] == [1, 2, 3, 4]
        run_steps(logger, range(5, 9))

    full = (full_dir / "metrics.jsonl").read_bytes()
    assert (resumed_dir / "metrics.jsonl").read_bytes() == full
    assert not list(resumed_dir.glob("*.tmp"))

    # A fresh run (no resume step) in the same folder starts a new file.
    with MetricsLogger(resumed_dir, QUIET, total_steps=8) as logger:
        logger.log(1, {"loss": 2.0})
    assert read_metrics(resumed_dir) == [{"step": 1, "loss": 2.0}]


def test_truncate_metrics_and_declared_keys(tmp_path):
    with MetricsLogger(tmp_path, QUIET, total_steps=3, keys=("val/accuracy",)) as logger:
        logger.log(1, {"loss": 1.0})
        logger.log(2, {"loss": 0.5})
    assert read_metrics(tmp_path) == [
        {"step": 1, "loss": 1.0, "val/accuracy": None},
        {"step": 2, "loss": 0.5, "val/accuracy": None},
    ]
    kept = truncate_metrics(tmp_path, 1)
    assert kept == read_metrics(tmp_path) == [{"step": 1, "loss": 1.0, "val/accuracy": None}]
    assert read_metrics(tmp_path / "missing") == []


def _read_tb_scalars(tb_dir):
    """(tag, step, value) of every scalar in the TFRecord event files under tb_dir."""
    from tensorboardX.proto import event_pb2

    scalars = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            record = data[pos + 12 : pos + 12 + length]
            pos += 12 + length + 4
            event = event_pb2.Event.FromString(record)
            for v in event.summary.value:
                scalars.append((v.tag, event.step, v.simple_value))
    return scalars


def test_tensorboard_events_written(tmp_path):
    cfg = LoggingConfig(tensorboard=True, wandb=False, progress_bar=False)
    with MetricsLogger(tmp_path, cfg, total_steps=3) as logger:
        run_steps(logger, range(1, 4))
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert files and all(f.stat().st_size > 0 for f in files)
    scalars = _read_tb_scalars(tmp_path / "tb")
    assert ("loss", 2, pytest.approx(0.25)) in scalars
    assert ("val/accuracy", 3, pytest.approx(0.03)) in scalars
    assert sum(tag == "reward/mean" for tag, _, _ in scalars) == 3


def test_wandb_enabled_but_missing_raises(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    cfg = LoggingConfig(tensorboard=False, wandb=True, progress_bar=False)
    with pytest.raises(ConfigError, match=r"logging\.wandb"):
        MetricsLogger(tmp_path / "run", cfg, total_steps=3)
    assert not (tmp_path / "run").exists()  # failed before touching the run directory


def test_wandb_receives_metrics(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs["project"], kwargs["config"]))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    cfg = LoggingConfig(tensorboard=False, wandb=True, wandb_project="p", progress_bar=False)
    with MetricsLogger(tmp_path, cfg, total_steps=2, run_config={"a": 1}) as logger:
        logger.log(1, {"loss": np.float32(0.5)})
    assert calls == [("init", "p", {"a": 1}), ("log", 1, {"loss": 0.5}), ("finish",)]


def test_progress_bar_shows_step_reward_accuracy(tmp_path, capsys):
    cfg = LoggingConfig(tensorboard=False, wandb=False, progress_bar=True)
    with MetricsLogger(tmp_path, cfg, total_steps=10) as logger:
        logger.log(1, {"reward/mean": 0.25, "perf/tokens_per_s": 1234.0})
        logger.log(1, {"val/accuracy": 0.5})
        logger.log(2, {"reward/mean": 0.5})
    err = capsys.readouterr().err
    assert "2/10" in err
    assert "reward=0.5" in err and "acc=0.5" in err and "tok/s=1234" in err


def test_plot_run_writes_pngs(tmp_path):
    with MetricsLogger(tmp_path, QUIET, total_steps=6) as logger:
        run_steps(logger, range(1, 7))
    paths = plot_run(tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["accuracy.png", "kl.png", "length.png", "loss.png", "reward.png"]
    for path in paths:
        assert path.parent == tmp_path / "plots"
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert plot_run(tmp_path / "empty") == []


def test_values_are_plain_floats(tmp_path):
    with MetricsLogger(tmp_path, QUIET, total_steps=1) as logger:
        logger.log(1, {"a": np.int64(3), "b": jnp.bfloat16(0.5), "c": True, "d": jnp.ones(())})
    row = read_metrics(tmp_path)[0]
    assert row == {"step": 1, "a": 3.0, "b": 0.5, "c": 1.0, "d": 1.0}
    assert all(type(v) is float for k, v in row.items() if k != "step")
    assert not any(math.isnan(v) for k, v in row.items() if k != "step")


def test_every_sink_gets_the_real_values_and_one_close(tmp_path):
    """The logger fans out: each sink sees the step's plain floats (NaN included; only the
    jsonl file writes it as null), the samples with their text, and one close; a decreasing
    step is refused before any sink writes."""
    calls = []

    class Recorder(Sink):
        def write(self, step, values):
            calls.append(("write", step, dict(values)))

        def write_samples(self, step, rows, text):
            calls.append(("samples", step, rows, "-> c" in text))

        def close(self):
            calls.append(("close",))

    logger = MetricsLogger(tmp_path, QUIET, total_steps=2)
    logger.sinks.append(Recorder())
    logger.log(2, {"loss": np.float32(0.5), "kl/penalty": float("nan")})
    with pytest.raises(ValueError, match="must not decrease"):
        logger.log(1, {"loss": 1.0})
    logger.log_samples(2, [{"prompt": "p", "completion": "c", "reward": 1.0}])
    logger.close()
    logger.close()
    (_, step, values), samples, close = calls
    assert step == 2 and values["loss"] == 0.5 and type(values["loss"]) is float
    assert math.isnan(values["kl/penalty"])
    assert samples == (
        "samples",
        2,
        [{"step": 2, "prompt": "p", "completion": "c", "reward": 1.0}],
        True,
    )
    assert close == ("close",)
    assert read_metrics(tmp_path) == [{"step": 2, "kl/penalty": None, "loss": 0.5}]


def test_charts_draw_coinciding_keys_once():
    """What each chart draws: keys with equal points at every step are one curve named after
    all of them; the throughput, grad norm, entropy and clip fraction charts exist."""
    rows = [
        {"step": 0, "val/accuracy": 0.25},
        *(
            {
                "step": s,
                "loss": 0.5 / s,  # an old run's copy of loss/total
                "loss/total": 0.5 / s,
                "loss/pg": 0.5 / s,
                "loss/kl": 0.0,
                "kl/penalty": 0.0,
                "perf/tokens_per_s": 100.0 * s,
                "train/grad_norm": 1.0 / s,
                "policy/approx_entropy": 4.0 - s,
                "ratio/clip_fraction": 0.1,
                "ratio/dual_clip_fraction": 0.0,
            }
            for s in (1, 2, 3)
        ),
    ]
    charts = chart_series(rows)
    assert sorted(charts) == [
        "accuracy", "clip_fraction", "entropy", "grad_norm", "kl", "loss", "throughput",
    ]  # fmt: skip
    assert [s.label for s in charts["loss"]] == ["loss = loss/pg = loss/total", "loss/kl"]
    assert charts["loss"][0] == Series(
        ("loss", "loss/pg", "loss/total"), (1, 2, 3), (0.5, 0.25, 0.5 / 3)
    )
    assert [s.label for s in charts["kl"]] == ["kl/penalty = loss/kl"]
    assert charts["throughput"] == [
        Series(("perf/tokens_per_s",), (1, 2, 3), (100.0, 200.0, 300.0))
    ]
    assert [s.keys for s in charts["grad_norm"]] == [("train/grad_norm",)]
    assert [s.keys for s in charts["entropy"]] == [("policy/approx_entropy",)]
    assert [s.keys for s in charts["clip_fraction"]] == [
        ("ratio/clip_fraction",),
        ("ratio/dual_clip_fraction",),
    ]
    assert charts["accuracy"] == [Series(("val/accuracy",), (0,), (0.25,))]


def test_chart_step_axis_has_integer_ticks():
    fig = draw_chart("t", [Series(("loss/total",), (1, 2, 3), (0.5, 0.25, 0.1))])
    (ax,) = fig.axes
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["loss/total"]


# ----------------------------------------------------------------------------- docs/metrics.md

METRICS_PAGE = REPO / "docs" / "metrics.md"
ALWAYS = ("every step", "validation")


def documented_metrics() -> dict[str, str]:
    """{key: its "when" cell} of every metric row of docs/metrics.md's tables."""
    rows = {}
    for line in METRICS_PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`"):
            assert cells[0].strip("`") not in rows, f"{cells[0]} documented twice"
            rows[cells[0].strip("`")] = cells[3]
    return rows


def key_pattern(key: str) -> re.Pattern:
    """`reward/<name>/mean` -> a regex where each <...> is one or more characters."""
    parts = re.split(r"<[^>]+>", key)
    return re.compile("(.+)".join(map(re.escape, parts)) + "$")


def config_field_exists(dotted: str) -> bool:
    cls = Config
    for name in dotted.split("."):
        fields = (
            {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        )
        if name not in fields:
            return False
        hints = typing.get_type_hints(cls)
        cls = hints[name]
    return True


@pytest.fixture(scope="module")
def tiny_run_keys(tmp_path_factory):
    """The metric keys of a 2-step tiny run with validation before and after."""
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    cfg = load_config(TINY, ["grpo.max_num_steps=2", "logging.tensorboard=false"])
    train.run(cfg, run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    return {k for r in rows for k in r if k != "step"}


@pytest.mark.slow  # a 2-step tiny run
def test_every_logged_key_is_on_the_metrics_page(tiny_run_keys):
    documented = documented_metrics()
    patterns = [key_pattern(k) for k in documented]
    missing = sorted(k for k in tiny_run_keys if not any(p.match(k) for p in patterns))
    assert not missing, f"logged but not in docs/metrics.md: {missing}"
    # every key the page says every run logs is logged
    always = {k for k, when in documented.items() if when.startswith(ALWAYS) and "<" not in k}
    assert not always - tiny_run_keys, sorted(always - tiny_run_keys)
    # one name per number: the copies that existed before are gone
    assert not {"loss", "completions/clipped_ratio"} & tiny_run_keys


def test_conditional_metrics_name_the_config_key_that_turns_them_on():
    """A key not logged by every run names, in its "when" cell, real config keys; a literal
    key is a string in jgrpo's source (the page lists nothing the code cannot log)."""
    source = "\n".join(p.read_text() for p in (REPO / "jgrpo").rglob("*.py"))
    conditional = {k: w for k, w in documented_metrics().items() if not w.startswith(ALWAYS)}
    assert len(conditional) > 20
    for key, when in conditional.items():
        flags = re.findall(r"`([a-z_]+\.[a-z_.]+)`", when)
        assert flags, (key, when)
        for flag in flags:
            assert config_field_exists(flag), (key, flag)
        if "<" not in key:
            assert f'"{key}"' in source, key


def test_metrics_page_lists_each_chart_with_its_keys():
    """The page's chart table is what chart_series draws from rows holding every key listed."""
    listed = {}
    for line in METRICS_PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].endswith(".png`"):
            listed[cells[0].strip("`").removesuffix(".png")] = re.findall(r"`([^`]+)`", cells[1])
    assert set(listed) == set(CHARTS)
    documented = documented_metrics()
    keys = {k for ks in listed.values() for k in ks}
    assert keys <= set(documented)
    # distinct values: no two keys coincide, so each is its own curve
    row = {"step": 1, **{k: float(i) for i, k in enumerate(sorted(keys))}}
    drawn = {
        name: sorted(k for s in series for k in s.keys)
        for name, series in chart_series([row]).items()
    }
    assert drawn == {name: sorted(ks) for name, ks in listed.items()}
