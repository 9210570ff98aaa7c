"""The `jgrpo` CLI: bad inputs exit 2 with one line naming the key; tiny runs end to end."""

import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from jgrpo import cli
from jgrpo.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def bad_files(tmp_path):
    (tmp_path / "broken.yaml").write_text("grpo: [unclosed\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "wrong_fields.jsonl").write_text(json.dumps({"prompt": "1+1", "label": "2"}) + "\n")
    return tmp_path


BAD_INPUTS = [
    # (argv after `train --config X`, or a full argv; the key/file the message must name)
    (["--config", "{tmp}/missing.yaml"], "missing.yaml"),
    (["--config", "{tmp}/broken.yaml"], "not valid YAML"),
    (["--config", "{tmp}/list.yaml"], "mapping"),
    (["grpo.num_promts_per_step=4"], "num_prompts_per_step"),
    (["grpo.num_prompts_per_step=abc"], "grpo.num_prompts_per_step"),
    (["grpo.num_prompts_per_step"], "dotted.key=value"),
    (["optim.learning_rate=.nan"], "optim.learning_rate"),
    (["optim.learning_rate=-1"], "optim.learning_rate"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["rollout.decode_slots=0"], "rollout.decode_slots"),
    (["rollout.kv_cache_dtype=float16"], "rollout.kv_cache_dtype"),
    (["loss.aggregation=mean"], "loss.aggregation"),
    (["loss.use_kl_in_reward=true", "loss.reference_policy_kl_penalty=0.1"], "use_kl_in_reward"),
    (["loss.force_on_policy_ratio=true", "grpo.num_minibatches=2"], "force_on_policy_ratio"),
    (
        [
            "grpo.skip_reference_policy_logprobs_calculation=true",
            "loss.reference_policy_kl_penalty=0.1",
        ],
        "skip_reference_policy_logprobs_calculation",
    ),
    (
        [
            "loss.use_importance_sampling_correction=true",
            "loss.truncated_importance_sampling_type=tis",
            "loss.truncated_importance_sampling_ratio=1.5",
            "loss.truncated_importance_sampling_ratio_min=2.0",
        ],
        "truncated_importance_sampling_ratio_min",
    ),
    (["loss.sequence_level_importance_ratios=true"], "sequence_level_importance_ratios"),
    (
        [
            "grpo.advantage.estimator=reinforce_plus_plus",
            "loss.use_kl_in_reward=true",
            "loss.reference_policy_kl_penalty=0.1",
            "loss.force_on_policy_ratio=true",
        ],
        "use_kl_in_reward",
    ),
    (["rollout.backend=ray", "rollout.max_staleness=1"], "use_importance_sampling_correction"),
    (["grpo.num_minibatches=3"], "grpo.num_minibatches"),
    (["grpo.num_prompts_per_step=3", "grpo.num_generations_per_prompt=2"], "mesh.data"),
    (["model.path={tmp}/no_model"], "model.path"),
    (["data.task=gsm8k", "data.train_path={tmp}/nothing.jsonl"], "data.train_path"),
    (["data.task=gsm8k", "data.train_path={tmp}/wrong_fields.jsonl"], "data.question_key"),
    (["data.reward_functions=[{function: 'no_such_module_xyz:fn'}]"], "data.reward_functions[0]"),
    (["data.reward_functions=[{function: 'os.path'}]"], "data.reward_functions[0]"),
    (["mesh.tensor=3"], "mesh"),
]


@pytest.mark.parametrize("argv,needle", BAD_INPUTS, ids=[b[1] for b in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line(capsys, bad_files, argv, needle):
    argv = [a.replace("{tmp}", str(bad_files)) for a in argv]
    if argv[0] != "--config":
        argv = ["--config", TINY, *argv]
    start = time.perf_counter()
    code, out, err = run_cli(capsys, "train", "--run-dir", str(bad_files / "run"), *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jgrpo: error:"), err
    assert needle.replace("{tmp}", str(bad_files)) in lines[0]
    assert "Traceback" not in err
    assert not (bad_files / "run").exists(), "rejected before any run folder or model"
    assert time.perf_counter() - start < 20


def test_existing_run_folder_needs_resume_or_fresh(capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--run-dir", str(tmp_path))
    assert code == 2 and "--run-dir" in err and "--resume" in err
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.5}\n'


@pytest.mark.parametrize("fresh", [False, True])
def test_a_finished_run_folder_with_a_foreign_file_is_refused_naming_it(capsys, tmp_path, fresh):
    for name in ("final", "hf", "checkpoints", "plots", "tb", ".final.ab12cd_e.partial"):
        (tmp_path / name).mkdir()
    for name in ("metrics.jsonl", "samples.jsonl", "summary.json", "config.yaml", cli.RUN_MARKER):
        (tmp_path / name).write_text("")
    assert cli.run_folder_kind(tmp_path) == "run"
    (tmp_path / "notes.txt").write_text("mine")
    argv = ["train", "--config", TINY, "--run-dir", str(tmp_path)] + ["--fresh"] * fresh
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "'notes.txt'" in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "final").is_dir()


def test_version_prints_the_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"jgrpo {version('jgrpo')}\n"


def test_checkpoints_are_on_by_default():
    from jgrpo.config import Config

    assert Config().checkpoint.save_period > 0


def test_console_script_exit_code(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jgrpo.cli", "train", "--config", str(tmp_path / "nope.yaml")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"jgrpo: error: config file {str(tmp_path / 'nope.yaml')!r} does not exist"
    ]


def test_show_config_prints_docs(capsys):
    code, out, _ = run_cli(capsys, "train", "--config", TINY, "--show-config", "grpo.seed=7")
    assert code == 0
    assert "seed: 7  # Seeds data order, sampling and init." in out
    assert "force_on_policy_ratio: false  #" in out


def test_overrides_may_follow_flags(capsys):
    """`--config X a=1 --flag b=2`: both overrides apply, in order; a stray word is still an
    argparse error (exit 2), and so is an override for a command without overrides."""
    argv = ["train", "--config", TINY, "grpo.seed=7", "--show-config", "grpo.max_num_steps=9"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    assert "seed: 7  #" in out and "max_num_steps: 9  #" in out
    code, out, _ = run_cli(capsys, *argv[:-1], "grpo.seed=8")
    assert "seed: 8  #" in out
    stray = ["train", "--config", TINY, "a=1", "--show-config", "stray"]
    for argv in (stray, ["plot", "r", "a=1"]):
        with pytest.raises(SystemExit) as e:
            run_cli(capsys, *argv)
        assert e.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_a_reward_term_may_be_a_bare_module_function_string(tmp_path):
    """YAML `reward_functions: [mod:fn]` is `[{function: mod:fn}]`; a number is still refused."""
    from jgrpo.config import ConfigError, from_dict
    from jgrpo.config.sections import DataConfig

    short = from_dict(
        DataConfig, {"reward_functions": ["mod:fn", {"function": "m:g", "weight": 2}]}
    )
    assert [(r.function, r.weight) for r in short.reward_functions] == [("mod:fn", 1.0), ("m:g", 2)]
    with pytest.raises(ConfigError, match=r"reward_functions\[0\]: expected a mapping"):
        from_dict(DataConfig, {"reward_functions": [3]})


def test_every_shipped_config_loads():
    from jgrpo.config import load_config

    files = sorted((REPO / "configs").glob("*.yaml"))
    assert any(f.name == "tiny.yaml" for f in files)
    for file in files:
        load_config(file)


PERF_PREFIXES = ("perf/", "rollout/weight_sync")


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(PERF_PREFIXES)} for r in rows]


def test_tiny_run_through_cli(capsys, tmp_path):
    run_dir = tmp_path / "run"
    every_writer = ["checkpoint.save_period=3", "checkpoint.export_hf=true", "logging.plot=true"]
    code, out, err = run_cli(
        capsys, "train", "--config", TINY, "--run-dir", str(run_dir), *every_writer
    )
    assert code == 0, err
    assert "val/accuracy" in out and "before" in out
    lines = err.splitlines()  # what it does while loading and compiling, then a line per step
    assert lines[0] == f"jgrpo: run folder {run_dir}", err
    assert any(re.match(r"jgrpo: step 1 took [0-9.]+ s, compiling included", x) for x in lines)
    assert "jgrpo: step 3/3 reward=" in err
    # a finished run's folder is recognised as a run: no flags names both ways on
    assert {"final", "hf", "plots", "samples.jsonl", "summary.json"} <= set(os.listdir(run_dir))
    assert cli.run_folder_kind(run_dir) == "run"
    code, _, err = run_cli(capsys, "train", "--config", TINY, "--run-dir", str(run_dir))
    assert code == 2 and "pass --resume" in err and "--fresh" in err, err
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(set(r) == set(rows[0]) for r in rows)
    for r in rows[1:]:
        assert math.isfinite(r["loss/total"]) and 0.0 <= r["reward/mean"] <= 1.0
        assert r["train/skipped_updates"] == 0.0
    assert rows[0]["val/accuracy"] is not None and rows[3]["val/accuracy"] is not None
    assert rows[1]["val/accuracy"] is None
    code, out, err = run_cli(capsys, "plot", str(run_dir))
    assert code == 0, err
    pngs = [Path(line) for line in out.split()]
    assert {p.name for p in pngs} >= {"reward.png", "accuracy.png", "kl.png", "length.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["grpo"]["num_prompts_per_step"] == 4
    assert list((run_dir / "tb").iterdir())

    # export -> an HF folder transformers loads with our logits
    import jax.numpy as jnp
    import torch
    import transformers

    from jgrpo.models import from_pretrained

    out_dir = tmp_path / "export"
    code, _, err = run_cli(capsys, "export", str(run_dir), str(out_dir))
    assert code == 0, err
    ours = from_pretrained(out_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    ids = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray([ids]))), ref, atol=1e-4)

    # eval of the checkpoint equals the run's final validation
    code, out, err = run_cli(capsys, "eval", "--config", TINY, "--checkpoint", str(run_dir))
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["val/accuracy"] == rows[3]["val/accuracy"]

    # --fresh reruns a finished run (as `make demo` twice in a row does)
    code, _, err = run_cli(
        capsys, "train", "--config", TINY, "--run-dir", str(run_dir), "--fresh", "--verbose",
        "grpo.max_num_steps=1",
    )  # fmt: skip
    assert code == 0, err
    lines = err.splitlines()  # what it does, each line timed (--verbose)
    assert all(re.match(r"jgrpo: (\[ *[0-9.]+ s\] |step 1/1 )", line) for line in lines), err
    assert any("step 1 of 1: generating, then compiling the train step" in x for x in lines)
    assert any("--fresh: deleted the earlier run" in line for line in lines), err
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    assert not (run_dir / "hf").exists() and not (run_dir / "checkpoints" / "3").exists()

    # a run whose only model is final/ (checkpoint.save_period=0): export and eval take it
    for source in (run_dir, run_dir / "final"):
        code, out, err = run_cli(capsys, "eval", "--config", TINY, "--checkpoint", str(source))
        assert code == 0, err
        assert json.loads(out.strip().splitlines()[-1])["val/accuracy"] == rows[1]["val/accuracy"]
        copy = tmp_path / f"export-{source.name}"
        assert run_cli(capsys, "export", str(source), str(copy))[0] == 0
        for name in ("model.safetensors", "tokenizer.json", "config.json"):
            assert (copy / name).read_bytes() == (run_dir / "final" / name).read_bytes()


def test_resume_after_sigkill_reproduces_the_uninterrupted_run(capsys, tmp_path):
    common = ["grpo.max_num_steps=4", "checkpoint.save_period=2", "grpo.val_period=2"]
    full = tmp_path / "full"
    code, out, err = run_cli(
        capsys, "train", "--config", TINY, "--run-dir", str(full), "-q", *common
    )
    assert code == 0 and err == "" and "before" in out, err  # --quiet: the table alone

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jgrpo.cli",
            "train",
            "--config",
            TINY,
            "--run-dir",
            str(killed),
            *common,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while time.time() < deadline:
        if (killed / "checkpoints" / "2" / "commit_success.txt").exists():
            rows = read_metrics(killed) if (killed / "metrics.jsonl").exists() else []
            if any(r["step"] == 3 for r in rows) or proc.poll() is not None:
                break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "checkpoints" / "4").exists(), "the kill came too late to test resume"

    code, out, err = run_cli(
        capsys, "train", "--config", TINY, "--run-dir", str(killed), "--resume", *common
    )
    assert code == 0, err
    assert "jgrpo: resumed from step 2 of 4\n" in err
    assert comparable(read_metrics(killed)) == comparable(read_metrics(full))
    # summary.json keeps the validations before the resume; the table starts at the resume
    summary = [comparable([r]) for r in json.loads((killed / "summary.json").read_text())]
    assert summary == [comparable([r]) for r in json.loads((full / "summary.json").read_text())]
    assert [r[0]["step"] for r in summary] == [0, 2, 4]
    assert re.search(r"^step +2 +4$", out, re.M), out


def test_reward_functions_that_raise_or_hang_score_zero(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "import time\n"
        "def boom(prompts, completions, **kw):\n    raise RuntimeError('bad reward')\n"
        "def hang(prompts, completions, **kw):\n    time.sleep(3600)\n"
        "def length(prompts, completions, **kw):\n    return [0.01 * len(c) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    funcs = (
        "data.reward_functions=[{function: 'my_rewards:boom'}, "
        "{function: 'my_rewards:hang', weight: 2.0}, {function: 'my_rewards:length'}]"
    )
    run_dir = tmp_path / "run"
    start = time.perf_counter()
    code, _, err = run_cli(
        capsys,
        "train",
        "--config",
        TINY,
        "--run-dir",
        str(run_dir),
        funcs,
        "data.reward_timeout_s=0.5",
        "grpo.max_num_steps=2",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
    )
    assert code == 0, err
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/num_errors"] >= 16  # boom fails on every sample
        assert r["reward/num_timeouts"] >= 1
        assert r["reward/mean"] > 0  # the length term still scores
    assert time.perf_counter() - start < 120


# make test: the same three sets of forwards in test_step's test_skipped_forwards_are_absent_...
@pytest.mark.heavy
def test_inspect_step_reports_forwards(capsys):
    reports = {}
    for name, overrides in {
        "both": ["loss.reference_policy_kl_penalty=0.1"],
        "on_policy": ["loss.force_on_policy_ratio=true", "loss.reference_policy_kl_penalty=0.1"],
        "none": ["loss.force_on_policy_ratio=true", "loss.reference_policy_kl_penalty=0.0"],
    }.items():
        code, out, err = run_cli(capsys, "inspect-step", "--config", TINY, *overrides, "--json")
        assert code == 0, err
        reports[name] = json.loads(out.strip().splitlines()[-1])
    assert reports["both"]["forwards"] == ["ref", "prev", "policy"]
    assert reports["on_policy"]["forwards"] == ["ref", "policy"]
    assert reports["none"]["forwards"] == ["policy"]
    assert all(r["forwards_traced"] == r["forwards"] for r in reports.values())
    one_forward = reports["both"]["dot_ops"] - reports["on_policy"]["dot_ops"]
    assert one_forward > 0
    assert reports["on_policy"]["dot_ops"] - reports["none"]["dot_ops"] == one_forward
    assert reports["both"]["flops"] > reports["on_policy"]["flops"] > reports["none"]["flops"]


QWEN05 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}


@pytest.mark.heavy  # make test: test_inspect_step (the SmolLM2 shape on 8 devices)
def test_inspect_step_sizes_a_full_size_model_per_device(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN05))
    reports = {}
    for fsdp in (1, 8):
        code, out, err = run_cli(
            capsys,
            "inspect-step",
            "--config",
            TINY,
            f"model.path={tmp_path}",
            f"mesh.fsdp={fsdp}",
            "mesh.data=-1",
            "grpo.num_prompts_per_step=2",
            "rollout.max_new_tokens=32",
            "--json",
        )
        assert code == 0, err
        reports[fsdp] = json.loads(out.strip().splitlines()[-1])
    assert reports[1]["num_params"] == 494_032_768  # Qwen2.5-0.5B
    assert reports[1]["param_bytes_per_device"] == 4 * 494_032_768
    ratio = reports[1]["param_bytes_per_device"] / reports[8]["param_bytes_per_device"]
    assert 7.9 < ratio <= 8.0  # norms stay replicated
    opt_ratio = reports[1]["opt_state_bytes_per_device"] / reports[8]["opt_state_bytes_per_device"]
    assert 7.9 < opt_ratio <= 8.0
    assert reports[8]["temp_bytes_per_device"] > 0


@pytest.mark.heavy  # make test: test_tasks loads GSM8K JSONL and scores countdown
def test_gsm8k_jsonl_and_countdown_runs(capsys, tmp_path):
    records = [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many?",
            "answer": f"He has {a}+{b}=<<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
        }
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (4, 1), (6, 3), (9, 9)]
    ]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    quick = [
        "grpo.max_num_steps=2",
        "grpo.val_at_start=false",
        "logging.tensorboard=false",
        "data.num_val_examples=4",
        "rollout.prompt_bucket=64",
    ]
    for name, task in {
        "gsm8k": ["data.task=gsm8k", f"data.train_path={data}", "data.val_fraction=0.5"],
        "countdown": ["data.task=countdown", "data.countdown_num_numbers=3"],
    }.items():
        run_dir = tmp_path / name
        code, _, err = run_cli(
            capsys, "train", "--config", TINY, "--run-dir", str(run_dir), *task, *quick
        )
        assert code == 0, (name, err)
        rows = read_metrics(run_dir)
        assert [r["step"] for r in rows] == [1, 2], name
        assert 0.0 <= rows[-1]["val/accuracy"] <= 1.0
        assert all(math.isfinite(r["loss/total"]) for r in rows)


_KILL_IN_SAVE = """
import os, signal, sys
import orbax.checkpoint._src.path.atomicity as atomicity
from jgrpo.cli import main

finalize = atomicity.AtomicRenameTemporaryPath.finalize

async def killing_finalize(self):
    # every item of step 4 is written; the kill lands just before the step folder's rename
    if self.get_final().name == "4":
        os.kill(os.getpid(), signal.SIGKILL)
    return await finalize(self)

atomicity.AtomicRenameTemporaryPath.finalize = killing_finalize
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.heavy  # make test: test_resume_after_sigkill_..., test_checkpoint's killed saves
def test_kill_during_save_and_damaged_checkpoint_resume_like_uninterrupted(capsys, tmp_path):
    common = [
        "grpo.max_num_steps=6",
        "checkpoint.save_period=2",
        "grpo.val_period=3",
        "data.num_val_examples=4",
        "logging.tensorboard=false",
    ]
    # --fresh on an existing run folder of an older jgrpo (no marker) deletes it and starts over
    full = tmp_path / "full"
    full.mkdir()
    (full / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    (full / "config.yaml").write_text("{}\n")
    code, _, err = run_cli(
        capsys, "train", "--config", TINY, "--run-dir", str(full), "--fresh", *common
    )
    assert code == 0, err
    assert (full / ".jgrpo-run").is_file()
    want = comparable(read_metrics(full))
    assert [r["step"] for r in want] == [0, 1, 2, 3, 4, 5, 6]

    # 1. SIGKILL inside the save of step 4: the resume starts from step 2
    killed = tmp_path / "killed"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _KILL_IN_SAVE,
            "train",
            "--config",
            TINY,
            "--run-dir",
            str(killed),
            *common,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not (killed / "checkpoints" / "4").exists()
    assert (killed / "checkpoints" / "2" / "jgrpo_checksums.json").is_file()
    code, _, err = run_cli(
        capsys, "train", "--config", TINY, "--run-dir", str(killed), "--resume", *common
    )
    assert code == 0, err
    assert comparable(read_metrics(killed)) == want

    # 2. the newest checkpoint damaged afterwards, and a torn line in the middle of metrics.jsonl
    state_files = [p for p in (killed / "checkpoints" / "6" / "state").rglob("*") if p.is_file()]
    biggest = max(state_files, key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x01
    biggest.write_bytes(bytes(data))
    lines = (killed / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[2] = lines[2][: len(lines[2]) // 2] + "\n"  # step 2's line, torn
    (killed / "metrics.jsonl").write_text("".join(lines))
    code, _, err = run_cli(
        capsys, "train", "--config", TINY, "--run-dir", str(killed), "--resume", *common
    )
    assert code == 0, err
    assert "jgrpo: warning: checkpoint damaged, resuming from step 4 (step 6: " in err
    assert "dropped 1 damaged line(s) (line 3)" in err
    rows = comparable(read_metrics(killed))
    assert rows == [r for r in want if r["step"] != 2]  # the torn line is gone, the rest equal
    from jgrpo.checkpoint import verify_step

    assert verify_step(killed / "checkpoints" / "6") is None  # saved again, intact


def test_export_refuses_a_non_empty_folder_then_replaces_it_atomically(capsys, tmp_path):
    import jax
    from flax import nnx

    from jgrpo import optimizer, step_setup
    from jgrpo.checkpoint import Checkpointer
    from jgrpo.config import load_config, to_dict
    from jgrpo.models import from_pretrained
    from jgrpo.models.hf import read_hf_weights
    from jgrpo.models.sources import resolve_model_path

    cfg = load_config(TINY)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    model = from_pretrained(resolve_model_path(cfg.model.path))
    params = jax.tree.map(lambda x: x + 0.25, nnx.to_pure_dict(nnx.state(model)))
    with Checkpointer(run / "checkpoints") as ckpt:
        state = step_setup.init_train_state(params, optimizer.make_optimizer(cfg))
        ckpt.save(2, state, {"step": 2})

    out = tmp_path / "out"  # an older sharded export: loading it would give the OLD weights
    out.mkdir()
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old shard")
    before = sorted(p.name for p in out.iterdir())
    code, _, err = run_cli(capsys, "export", str(run), str(out))
    assert code == 2 and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == before

    # a writer's save in flight: export only reads (it must not remove the writer's tmp folder)
    in_flight = run / "checkpoints" / "4.orbax-checkpoint-tmp-1700000000"
    (in_flight / "state").mkdir(parents=True)
    code, _, err = run_cli(capsys, "export", str(run), str(out), "--overwrite")
    assert code == 0, err
    assert (in_flight / "state").is_dir()
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and "tokenizer.json" in names
    assert not names & {"model.safetensors.index.json", "model-00001-of-00002.safetensors"}
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left
    exported = read_hf_weights(out)["model.embed_tokens.weight"]
    base = read_hf_weights(resolve_model_path(cfg.model.path))["model.embed_tokens.weight"]
    np.testing.assert_allclose(exported, base + 0.25, atol=1e-6)


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_eta_and_throughput_leave_out_the_compiling_step():
    from jgrpo.metrics import ProgressBarSink

    now = [0.0]
    stream = FakeTerminal()
    bar = ProgressBarSink(10, None, stream=stream, clock=lambda: now[0])
    bar.write(0, {"val/accuracy": 0.25})
    for step, t, tokens_per_s in [(1, 100.0, 1.0), (2, 101.0, 50.0), (3, 102.0, 60.0)]:
        now[0] = t  # step 1 compiled for 100 s, then one step a second
        bar.write(step, {"reward/mean": 0.5, "perf/tokens_per_s": tokens_per_s})
    bar.close()
    last = stream.getvalue().split("\r")[-1]
    assert "3/10" in last and "eta=0:07" in last and "tok/s=60" in last, last
    assert "tok/s=1," not in stream.getvalue() and "tok/s=1]" not in stream.getvalue()


def test_progress_without_a_terminal_is_a_line_each_tenth_of_the_run():
    from jgrpo.metrics import ProgressBarSink

    now = [0.0]
    stream = io.StringIO()
    bar = ProgressBarSink(25, 5, stream=stream, clock=lambda: now[0])
    for step in range(6, 26):
        now[0] = 100.0 + step  # step 6 compiled, then a second a step
        bar.write(step, {"reward/mean": 0.5, "perf/tokens_per_s": 100.0 * step})
        bar.write(step, {"val/accuracy": 0.5})  # a merge into the same step prints no line
    lines = stream.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == [f"{s}/25" for s in range(7, 26, 2)]
    assert lines[0] == "jgrpo: step 7/25 reward=0.5 acc=0.5 tok/s=700 eta=0:18"
    assert lines[-1] == "jgrpo: step 25/25 reward=0.5 acc=0.5 tok/s=2500 eta=0:00"
    assert "\r" not in stream.getvalue()
