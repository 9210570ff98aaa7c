"""User code is loud: a failing reward function's first traceback is shown once per run with its
name and sample, every failure is counted per function (`reward/<name>/num_errors`),
data.reward_errors: raise stops the run; None and NaN are "no reward" in both forms; modules
next to the config import from the CLI, and an import error says where it looked."""

import json
import math
import os
import sys
import textwrap

import numpy as np
import pytest
import yaml
from transformers import AutoTokenizer

from jgrpo import cli
from jgrpo.config import ConfigError, DataConfig, RewardFunctionConfig
from jgrpo.metrics import read_metrics
from jgrpo.models.tiny import build_tiny_model
from jgrpo.rollout.turns import TurnSettings
from jgrpo.tasks import make_task
from jgrpo.tasks.child import (
    ERROR,
    NONE,
    OK,
    Failure,
    UserCodeError,
    add_user_folders,
    report_failures,
)
from jgrpo.tasks.tools import ToolRunner
from tests.test_cli import TINY
from tests.test_multiturn import CALL, FakeRunner, run_script

MODULE = textwrap.dedent(
    """
    import math, os

    def ps_none(prompt, completion, example):
        return None if completion == "none" else (math.nan if completion == "nan" else 1.0)

    def b_none(prompts, completions, **kwargs):
        return [None if c == "none" else (math.nan if c == "nan" else 1.0) for c in completions]

    def ps_boom(prompt, completion, example):
        if completion == "bad":
            raise ValueError("ps_boom cannot read " + completion)
        return 1.0

    def b_boom(prompts, completions, **kwargs):
        raise ValueError("b_boom is broken")

    def ps_text(prompt, completion, example):
        return "high"

    def b_short(prompts, completions, **kwargs):
        return [1.0]

    def ps_exit(prompt, completion, example):
        os._exit(3)
    """
)
RECORDS = [{"prompt": f"p{i}"} for i in range(8)]


@pytest.fixture(scope="module")
def loud(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loud")
    (folder / "jgrpo_test_loud.py").write_text(MODULE)
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(folder))
    yield "jgrpo_test_loud"
    mp.undo()


def _task(fns, **kw):
    rfs = tuple(
        RewardFunctionConfig(function=f, per_sample=f.split(":")[1].startswith("ps_")) for f in fns
    )
    cfg = DataConfig(task="prompts", reward_functions=rfs, num_val_examples=1, **kw)
    return make_task(cfg, 0, train_dataset=RECORDS)


def _score(task, completions):
    examples = task.train.next_prompts(len(completions))
    rewards, info = task.score(["p"] * len(completions), completions, examples)
    return rewards, info, [e["id"] for e in examples]


@pytest.mark.parametrize("name", ["ps_none", "b_none"])
def test_none_and_nan_are_no_reward_in_both_forms(loud, name):
    """per_sample: true follows the batched form's rule: None / NaN -> reward/num_none, and a
    sample with no value at all is masked out of its group and the loss."""
    task = _task([f"{loud}:{name}"])
    try:
        rewards, info, _ = _score(task, ["none", "nan", "ok", "none"])
    finally:
        task.close()
    assert info["num_reward_none"] == 3 and info["num_reward_errors"] == 0
    assert info["sample_mask"].tolist() == [False, False, True, False]
    assert rewards.tolist() == [0.0, 0.0, 1.0, 0.0]
    assert np.isnan(info["reward_terms"][:, 0]).tolist() == [True, True, False, True]
    assert info["reward_status"][:, 0].tolist() == [NONE, NONE, OK, NONE]
    assert info["failures"] == []


def test_each_failing_function_reports_its_first_failure(loud):
    task = _task([f"{loud}:{n}" for n in ("ps_boom", "b_boom", "ps_text", "b_short")])
    try:
        _, info, ids = _score(task, ["ok", "bad", "bad", "ok"])
    finally:
        task.close()
    assert (info["reward_status"] == ERROR).sum(axis=0).tolist() == [2, 4, 4, 4]
    assert info["num_reward_errors"] == 14
    by_name = {f.name: f for f in info["failures"]}
    assert sorted(by_name) == [
        "data.reward_functions[0] ('ps_boom')",
        "data.reward_functions[1] ('b_boom')",
        "data.reward_functions[2] ('ps_text')",
        "data.reward_functions[3] ('b_short')",
    ]
    boom = by_name["data.reward_functions[0] ('ps_boom')"]
    assert boom.where == f"sample 1 (record {ids[1]})"
    assert boom.text.startswith("Traceback (most recent call last):")
    assert "jgrpo_test_loud.py" in boom.text and "in ps_boom" in boom.text
    assert boom.text.endswith("ValueError: ps_boom cannot read bad")
    assert "jgrpo/tasks" not in boom.text  # the user's frames only
    assert boom.counter == "reward/ps_boom/num_errors" and not boom.fatal
    batched = by_name["data.reward_functions[1] ('b_boom')"]
    assert batched.where == "samples 0-3 (one batched call)"
    assert batched.text.endswith("ValueError: b_boom is broken")
    assert "returned 'high', not a number" in by_name["data.reward_functions[2] ('ps_text')"].text
    assert "returned 1 values for 4 samples" in by_name["data.reward_functions[3] ('b_short')"].text


def test_a_reward_that_kills_its_process_is_reported(loud):
    task = _task([f"{loud}:ps_exit"], reward_errors="raise")
    try:
        _, info, ids = _score(task, ["a", "b"])
    finally:
        task.close()
    (failure,) = info["failures"]
    assert failure.where == f"sample 0 (record {ids[0]})" and failure.fatal
    assert failure.text == "it ended the reward process (exit code 3)"
    assert info["num_reward_errors"] == 2


def test_report_failures_shows_each_name_once_and_raise_stops(capsys):
    first = Failure("data.reward_functions[0] ('once_a')", "sample 2", "Traceback\nE: x", "c/a")
    other = Failure("data.reward_functions[1] ('once_b')", "sample 0", "Traceback\nE: y", "c/b")
    report_failures([first, other])
    report_failures([first, Failure(first.name, "sample 5", "Traceback\nE: z", "c/a")])
    err = capsys.readouterr().err
    assert err.count("('once_a') failed at sample 2") == 1 and err.count("E: x") == 1
    assert err.count("('once_b') failed at sample 0") == 1
    assert "E: z" not in err and "counted in c/a" in err
    fatal = Failure("data.reward_functions[0] ('stop')", "sample 1", "Traceback\nE: w", "", True)
    with pytest.raises(UserCodeError, match=r"\('stop'\) failed at sample 1") as e:
        report_failures([other, fatal])
    assert str(e.value).endswith("Traceback\nE: w")


def test_an_import_error_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        _task(["jgrpo_no_such_module_q:fn"])
    message = str(e.value)
    assert "No module named 'jgrpo_no_such_module_q'; looked in " in message
    assert str(tmp_path) in message and "and the installed packages" in message


def test_modules_in_the_working_folder_import(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", os.getcwd())])
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    (tmp_path / "jgrpo_test_cwd_rewards.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="No module named 'jgrpo_test_cwd_rewards'"):
        _task(["jgrpo_test_cwd_rewards:b_none"])
    add_user_folders()
    assert sys.path[-1] == str(tmp_path)
    assert os.environ["PYTHONPATH"].split(os.pathsep)[-1] == str(tmp_path)
    task = _task(["jgrpo_test_cwd_rewards:b_none"])
    task.close()


# ----------------------------------------------------------------------------- the CLI

CLI_MODULE = textwrap.dedent(
    """
    def always_fails(prompt, completion, example):
        return 1.0 / (len(completion) * 0)

    def length(prompts, completions, **kwargs):
        return [0.01 * len(c) for c in completions]
    """
)


def _user_folders(tmp_path, monkeypatch):
    """configs/ (run.yaml and its reward module) and elsewhere/, the working folder."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # add_user_folders changes both
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    configs, elsewhere = tmp_path / "configs", tmp_path / "elsewhere"
    configs.mkdir(exist_ok=True)
    elsewhere.mkdir(exist_ok=True)
    (configs / "jgrpo_cli_loud.py").write_text(CLI_MODULE)
    cfg = yaml.safe_load(open(TINY))
    cfg["data"]["reward_functions"] = [
        {"function": "jgrpo_cli_loud:always_fails", "per_sample": True},
        {"function": "jgrpo_cli_loud:length"},
    ]
    cfg["grpo"].update(max_num_steps=2, val_at_start=False, val_at_end=False)
    (configs / "run.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(elsewhere)
    return elsewhere


def _cli_run(tmp_path, monkeypatch, capsys, *overrides):
    """The CLI from another working folder, with the reward module next to the config."""
    elsewhere = _user_folders(tmp_path, monkeypatch)
    code = cli.main(["train", "--config", "../configs/run.yaml", "--run-dir", "run", *overrides])
    return code, capsys.readouterr().err, elsewhere / "run"


def test_the_python_api_finds_modules_next_to_the_config(tmp_path, monkeypatch):
    """GRPOTrainer("configs/run.yaml") from another folder imports the reward module next to
    the config, as the CLI does, and puts that folder on PYTHONPATH for Ray workers."""
    from jgrpo import GRPOTrainer

    _user_folders(tmp_path, monkeypatch)
    configs = tmp_path / "configs"
    trainer = GRPOTrainer(str(configs / "run.yaml"))
    assert str(configs.resolve()) in os.environ["PYTHONPATH"].split(os.pathsep)
    task = make_task(trainer.config.data, 0)  # imports the module in the reward process
    task.close()


def test_cli_shows_a_failing_rewards_traceback_once_and_counts_it(tmp_path, monkeypatch, capsys):
    code, err, run_dir = _cli_run(tmp_path, monkeypatch, capsys)
    assert code == 0, err
    header = "jgrpo: warning: data.reward_functions[0] ('always_fails') failed at sample 0 ("
    assert err.count(header) == 1, err  # two steps of 16 failures: shown once
    assert err.count("ZeroDivisionError: float division by zero") == 1
    assert err.count("in always_fails") == 1 and "jgrpo_cli_loud.py" in err
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/always_fails/num_errors"] == 16
        assert r["reward/length/num_errors"] == 0
        assert r["reward/num_errors"] == 16
        assert math.isfinite(r["reward/length/mean"])
    # a second run in this process (a notebook's, a test worker's) shows its own first failure
    code = cli.main(["train", "--config", "../configs/run.yaml", "--run-dir", "run", "--fresh"])
    err = capsys.readouterr().err
    assert code == 0 and err.count(header) == 1, err


@pytest.mark.heavy  # make test: the local backend's test above (the same reports)
def test_ray_workers_failures_are_shown_once_by_the_driver(
    tmp_path, monkeypatch, capsys, ray_cluster
):
    """Two workers fail on every sample of two steps; their reports travel with the batches
    (workers log nothing to the driver) and the trainer shows the first one once."""
    code, err, run_dir = _cli_run(
        tmp_path, monkeypatch, capsys, "rollout.backend=ray", "rollout.num_workers=2"
    )
    assert code == 0, err
    assert err.count("('always_fails') failed at sample 0 (") == 1, err
    assert err.count("ZeroDivisionError: float division by zero") == 1
    for r in read_metrics(run_dir):
        assert r["reward/always_fails/num_errors"] == 16
        assert r["reward/length/num_errors"] == 0


def test_cli_reward_errors_raise_stops_with_the_traceback(tmp_path, monkeypatch, capsys):
    code, err, run_dir = _cli_run(tmp_path, monkeypatch, capsys, "data.reward_errors=raise")
    assert code == 1
    # progress lines (loading, compiling) may come first; the stop is the last report
    stop = "jgrpo: stopped: data.reward_functions[0] ('always_fails') failed at sample 0"
    assert err.count(stop) == 1, err
    err = err[err.index(stop) :]
    assert "(data.reward_errors: raise)" in err
    assert err.rstrip().endswith("ZeroDivisionError: float division by zero")
    assert not (run_dir / "metrics.jsonl").exists() or not [
        json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


# ----------------------------------------------------------------------------- tools, environments

TOOLS_MODULE = textwrap.dedent(
    '''
    def add(a: int, b: int) -> int:
        """Add.

        Args:
            a: first
            b: second
        """
        return a + b

    def divide(a: int) -> float:
        """Divide by zero.

        Args:
            a: numerator
        """
        return a / 0

    class Game:
        def reset(self, **record):
            return "go"

        def step(self, text):
            return int(text), None, True
    '''
)


@pytest.fixture
def tool_runner(tmp_path, monkeypatch):
    (tmp_path / "jgrpo_test_loud_tools.py").write_text(TOOLS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    runner = ToolRunner(
        ["jgrpo_test_loud_tools:add", "jgrpo_test_loud_tools:divide"],
        ["data.tools[0]", "data.tools[1]"],
        "jgrpo_test_loud_tools:Game",
        timeout_s=5.0,
        import_timeout_s=60.0,
    )
    runner.start()
    yield runner
    runner.close()


def test_tools_and_environments_report_their_first_failure(tool_runner):
    ops = [
        ("call", 0, ("divide", {"a": 1})),
        ("call", 1, ("divide", {"a": 2})),
        ("call", 2, ("add", {"a": 1})),  # the model's bad call: an error message, no report
        ("call", 3, ("nope", {})),  # likewise
        ("reset", 0, {}),
        ("step", 0, "not a number"),
    ]
    out = tool_runner.run(ops)
    assert [status for status, _ in out] == [ERROR, ERROR, ERROR, ERROR, OK, ERROR]
    assert out[0][1] == "error: ZeroDivisionError: division by zero"  # what the model reads
    by_name = {f.name: f for f in tool_runner.take_failures()}
    assert sorted(by_name) == ["data.environment ('Game')", "data.tools[1] ('divide')"]
    divide = by_name["data.tools[1] ('divide')"]
    assert divide.where == "a call (row 0)" and divide.counter == "tools/divide/num_errors"
    assert "in divide" in divide.text and divide.text.endswith(
        "ZeroDivisionError: division by zero"
    )
    game = by_name["data.environment ('Game')"]
    assert game.where == "step (row 0)" and game.counter == "environment/errors"
    assert "in step" in game.text and "ValueError: invalid literal for int()" in game.text
    assert tool_runner.take_failures() == []  # taken once


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(
        build_tiny_model(tmp_path_factory.mktemp("tok") / "m", chat=True)
    )


def test_turns_count_failed_calls_per_tool(monkeypatch, chat_tok):
    tok = chat_tok
    settings = TurnSettings(max_turns=2, tools=True)
    runner = FakeRunner(answer=lambda name, args: (ERROR, "error: boom"))
    texts = {1: CALL % "1", 2: "done<|im_end|>"}
    prompt = tok("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    conv, _, _ = run_script(
        monkeypatch, tok, texts, settings, n=256, runner=runner, prompts=[prompt] * 2
    )
    assert conv.tool_errors_by_name == {"calculator": 2}
