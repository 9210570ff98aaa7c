"""The loop through jgrpo.train.run: NaN steps are skipped, rollout failures stop cleanly."""

import math
from pathlib import Path

import pytest

from jgrpo import train
from jgrpo.config import load_config
from jgrpo.metrics import read_metrics
from jgrpo.rollout import LocalRollout, RolloutFailure

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
QUIET = ["grpo.val_at_start=false", "grpo.val_at_end=false", "logging.tensorboard=false"]


def test_nonfinite_loss_skips_the_update_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    # rewards of 3e38 overflow the group statistics in float32: the advantages, hence the loss,
    # become non-finite; the step must keep the params and count the skip
    (tmp_path / "huge_rewards.py").write_text(
        "def huge(prompts, completions, **columns):\n"
        "    return [3.0e38 * (len(c) % 2) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    cfg = load_config(
        TINY,
        [
            *QUIET,
            "grpo.max_num_steps=3",
            "data.task_reward_weight=0.0",
            "data.reward_functions=[{function: 'huge_rewards:huge'}]",
        ],
    )
    train.run(cfg, tmp_path / "run")
    err = capsys.readouterr().err  # the API says what it does, as the CLI does
    assert "jgrpo: step 1 of 3: generating, then compiling the train step" in err, err
    assert "jgrpo: trained 3 steps in " in err
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    skipped = [r["train/skipped_updates"] for r in rows]
    assert sum(skipped) >= 1
    for r, s in zip(rows, skipped):
        loss_finite = r["loss/total"] is not None and math.isfinite(r["loss/total"])
        assert s == (0.0 if loss_finite else 1.0)
        if s:  # non-finite values are written as null
            assert r["train/grad_norm"] is None


def test_rollout_failure_checkpoints_and_resume_finishes_the_run(tmp_path, monkeypatch):
    overrides = [*QUIET, "grpo.max_num_steps=3", "checkpoint.save_period=10"]
    full_dir, broken_dir = tmp_path / "full", tmp_path / "broken"
    train.run(load_config(TINY, overrides), full_dir)

    collect = LocalRollout.collect

    def failing_collect(self, step):
        if step == 2:
            raise RolloutFailure("worker budget exhausted (test)")
        return collect(self, step)

    monkeypatch.setattr(LocalRollout, "collect", failing_collect)
    with pytest.raises(
        train.RunStopped, match="checkpoint saved at step 2: continue with --resume"
    ):
        train.run(load_config(TINY, overrides), broken_dir)
    assert (broken_dir / "checkpoints" / "2" / "commit_success.txt").is_file()
    monkeypatch.setattr(LocalRollout, "collect", collect)

    train.run(load_config(TINY, overrides), broken_dir, resume=True)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]
    assert strip(read_metrics(broken_dir)) == strip(read_metrics(full_dir))


def test_validation_pass_at_k_groups_samples_by_example():
    """pass@k from k samples: an example counts when any of them is correct (rows are
    example-major); val/accuracy stays the greedy one."""
    import numpy as np

    from jgrpo.rollout import RolloutResult

    class Backend:
        def evaluate(self, examples, step, pass_k, val_set=None):
            assert len(examples) == 3 and val_set is None
            if pass_k == 1:  # greedy: only the first example
                correct = np.array([1, 0, 0], bool)
            else:
                assert pass_k == 4
                correct = np.array([[0, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
            batch = {
                "correct": correct.reshape(-1),
                "rewards": correct.reshape(-1).astype(np.float32),
                "lengths": np.full(correct.size, 3),
            }
            return RolloutResult(batch, {}, [])

    class Task:
        val = ["a", "b", "c"]
        val_tasks = {}

    cfg = load_config(TINY, ["grpo.val_num_generations=4", "grpo.val_pass_at=[4]"])
    t = train.Trainer(
        cfg=cfg,
        setup=None,
        state=None,
        task=Task(),
        backend=Backend(),
        checkpointer=None,
        start_step=0,
    )
    metrics = train.validate(t, 0)
    assert metrics["val/pass@4"] == pytest.approx(2 / 3)
    assert metrics["val/mean@4"] == pytest.approx(5 / 12)
    assert metrics["val/accuracy"] == pytest.approx(1 / 3)
    assert metrics["val/reward_mean"] == pytest.approx(1 / 3)


@pytest.mark.slow  # two one-step runs of configs/tiny.yaml
@pytest.mark.heavy  # in make test: test_step's prompt-bucket test (loss and metrics)
def test_seq_sum_norm_gradient_does_not_depend_on_the_prompt_bucket(tmp_path, monkeypatch):
    # the same rollouts padded to prompt buckets 8 and 64: seq_sum_norm divides by the
    # generation budget (rollout.max_new_tokens), not the padded width (1.197 vs 0.266 before).
    # A length reward makes every group informative (the untrained model solves nothing).
    (tmp_path / "length_reward.py").write_text(
        "def length(prompts, completions, **columns):\n"
        "    return [float(len(c) % 3) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    overrides = [
        *QUIET,
        "grpo.max_num_steps=1",
        "loss.aggregation=seq_sum_norm",
        "data.task_reward_weight=0.0",
        "data.reward_functions=[{function: 'length_reward:length'}]",
    ]
    runs = {}
    for bucket in (8, 64):
        cfg = load_config(TINY, [*overrides, f"rollout.prompt_bucket={bucket}"])
        train.run(cfg, tmp_path / str(bucket))
        (runs[bucket],) = read_metrics(tmp_path / str(bucket))
    assert runs[8]["reward/frac_groups_all_equal"] < 1.0
    assert runs[8]["reward/mean"] == runs[64]["reward/mean"]  # the same rollouts
    assert runs[8]["train/grad_norm"] > 1e-3
    assert runs[64]["train/grad_norm"] == pytest.approx(runs[8]["train/grad_norm"], rel=1e-5)
    assert runs[64]["loss/total"] == pytest.approx(runs[8]["loss/total"], rel=1e-5, abs=1e-7)


def test_run_config_is_replaced_atomically(tmp_path, monkeypatch):
    """config.yaml goes through a fsynced temporary and a rename: a write that dies midway
    leaves the previous file whole (and no temporary); a finished one reads back."""
    from jgrpo import files
    from jgrpo.cli import run_folder_kind
    from jgrpo.export import load_run_config

    old = load_config(TINY, ["grpo.seed=1"])
    train.write_run_config(tmp_path, old)
    before = (tmp_path / "config.yaml").read_bytes()

    def die(fd):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "fsync", die)
    with pytest.raises(OSError, match="disk full"):
        train.write_run_config(tmp_path, load_config(TINY, ["grpo.seed=2"]))
    assert (tmp_path / "config.yaml").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    monkeypatch.undo()

    new = load_config(TINY, ["grpo.seed=2"])
    train.write_run_config(tmp_path, new)
    assert load_run_config(tmp_path) == new
    # a temporary left by a kill is a run's own file, not someone else's
    (tmp_path / "config.yaml.tmp").write_text("torn")
    assert run_folder_kind(tmp_path) == "run"


def test_the_summary_of_a_run_without_validation_says_what_it_needs():
    """A run with no held-out set (task prompts, train_path only) says which keys give one."""
    line = train.summarize([])
    assert line.startswith("no validation was run (") and "data.val_path" in line
    assert "data.val_fraction" in line and "\n" not in line
