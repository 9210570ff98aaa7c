"""Your data, your rewards, your model: the prompts task end to end through `jgrpo train` and
`jgrpo.GRPOTrainer`, the RUN_DIR/final/ HF folder, and model ids from the local HF cache."""

import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jgrpo
from jgrpo import cli
from jgrpo.config import ConfigError
from jgrpo.metrics import read_metrics
from jgrpo.models.sources import check_model_path, resolve_model_path, tiny_qwen2_folder

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# some prompts plain strings, some chat messages; `target` is an extra column the reward reads
RECORDS = [
    {"prompt": "1+2=", "target": "3"},
    {"prompt": [{"role": "user", "content": "4+4="}], "target": "8"},
    {"prompt": "5-1=", "target": "4"},
    {
        "prompt": [{"role": "system", "content": "math"}, {"role": "user", "content": "2+7="}],
        "target": "9",
    },
    {"prompt": "6+0=", "target": "6"},
    {"prompt": [{"role": "user", "content": "3+3="}], "target": "6"},
]
REWARD_MODULE = """
import json, os

def matches_target(prompts, completions, target, **kwargs):
    with open(os.environ["JGRPO_TEST_SEEN"], "a") as fh:
        for p, t in zip(prompts, target):
            fh.write(json.dumps([p, t]) + "\\n")
    text = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(t in c) + 0.1 * len(c) if len(c) % 3 else None for c, t in zip(text, target)]
"""
QUICK = [
    "data.task=prompts",
    "data.val_fraction=0.34",
    "grpo.max_num_steps=3",
    "grpo.val_at_start=false",
    "grpo.val_at_end=true",
    "logging.tensorboard=false",
]


def _chat_model(folder: Path) -> Path:
    """The tiny model with a chat template (message prompts need one)."""
    shutil.copytree(tiny_qwen2_folder(), folder)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


def _check_seen(seen_file: Path) -> int:
    """Every (prompt, target) the reward saw belongs to one record: the columns are aligned."""
    by_prompt = {json.dumps(r["prompt"]): r["target"] for r in RECORDS}
    pairs = [json.loads(line) for line in seen_file.read_text().splitlines()]
    assert pairs
    for prompt, target in pairs:
        assert by_prompt[json.dumps(prompt)] == target
    assert {type(p) for p, _ in pairs} == {str, list}  # both kinds of prompt reached it
    return len(pairs)


def _hf_cache(root: Path, repo_id: str, files: Path) -> Path:
    """A hub cache as huggingface_hub lays it out, holding `files` as repo `repo_id`."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    rev = "a" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    shutil.copytree(files, repo / "snapshots" / rev)
    return root


@pytest.mark.slow
def test_prompts_dataset_and_batched_reward_via_cli_and_api(tmp_path, monkeypatch, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = _chat_model(tmp_path / "chat-model")

    # 1. the CLI, model from a folder, the reward from a module path
    monkeypatch.setenv("JGRPO_TEST_SEEN", str(tmp_path / "seen_cli.jsonl"))
    run_dir = tmp_path / "cli"
    code = cli.main(
        [
            "train",
            "--config",
            TINY,
            "--run-dir",
            str(run_dir),
            *QUICK,
            f"model.path={model}",
            f"data.train_path={data}",
            "data.reward_functions=[{function: 'my_rewards:matches_target', weight: 2.0}]",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0, err
    assert _check_seen(tmp_path / "seen_cli.jsonl") >= 3 * 16  # 3 steps of 4 x 4 rows
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("reward/matches_target/mean" in r for r in rows)
    assert all(r["reward/num_none"] is not None for r in rows)
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2, 3} and "completion" in samples[0]
    _check_final_folder(run_dir / "final")  # `jgrpo train` on configs/tiny.yaml left it

    # 2. the Python API, model from a (faked) HF cache, the reward as a function object
    monkeypatch.setenv("HF_HUB_CACHE", str(_hf_cache(tmp_path / "hub", "someone/tiny-chat", model)))
    monkeypatch.setenv("JGRPO_TEST_SEEN", str(tmp_path / "seen_api.jsonl"))
    import my_rewards

    result = jgrpo.GRPOTrainer(
        TINY,
        train_dataset=RECORDS,
        reward_funcs=[(my_rewards.matches_target, 2.0)],
        run_dir=tmp_path / "api",
        overrides=[*QUICK, "model.path=someone/tiny-chat"],
    ).train()
    assert _check_seen(tmp_path / "seen_api.jsonl") >= 3 * 16
    assert [r["step"] for r in result.metrics] == [1, 2, 3]
    assert result.history and result.history[-1]["step"] == 3
    assert result.model_dir == tmp_path / "api" / "final"
    assert (result.model_dir / "model.safetensors").is_file()


def _check_final_folder(final: Path) -> None:
    """RUN_DIR/final/ is an HF folder of the trained weights; transformers' float32 forward
    gives jgrpo's logits (1e-4)."""
    import jax.numpy as jnp
    import torch
    import transformers

    from jgrpo.models import from_pretrained
    from jgrpo.models.hf import read_hf_weights

    names = {p.name for p in final.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names
    trained, initial = read_hf_weights(final), read_hf_weights(tiny_qwen2_folder())
    assert trained.keys() == initial.keys()
    assert any(not np.array_equal(trained[k], initial[k]) for k in trained)  # it trained

    ids = np.random.RandomState(0).randint(4, 200, (2, 11))
    ours = np.asarray(from_pretrained(final, dtype="float32")(jnp.asarray(ids)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        final, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(final)
    assert tok.decode(tok("7+2=")["input_ids"]) == "7+2="


def test_sharded_save_round_trips(tmp_path):
    import transformers

    from jgrpo.models import from_pretrained, save_pretrained
    from jgrpo.models.hf import read_hf_weights

    model = from_pretrained(tiny_qwen2_folder())
    out = save_pretrained(model, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and not (out / "model.safetensors").exists()
    a, b = read_hf_weights(out), read_hf_weights(tiny_qwen2_folder())
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    transformers.AutoModelForCausalLM.from_pretrained(out)  # loads the index


def test_model_path_hub_id_from_the_local_cache(tmp_path, monkeypatch):
    cache = _hf_cache(tmp_path / "hub", "org/tiny", tiny_qwen2_folder())
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_model_path("org/tiny")
    folder = resolve_model_path("org/tiny")
    assert folder == cache / "models--org--tiny" / "snapshots" / ("a" * 40)
    assert (folder / "config.json").is_file()
    with pytest.raises(
        ConfigError,
        match=r"^model\.path: 'org/missing' is not a folder and not "
        r"a model in the local Hugging Face cache",
    ):
        check_model_path("org/missing")


def test_api_validates_like_the_cli(tmp_path):
    with pytest.raises(ConfigError, match=r"^grpo\.num_prompts_per_step: must be >= 1"):
        jgrpo.GRPOTrainer(TINY, overrides=["grpo.num_prompts_per_step=0"])
    cfg = jgrpo.load_config(TINY)
    bad = cfg.replace(grpo=cfg.grpo.__class__(num_prompts_per_step=0))
    with pytest.raises(ConfigError, match=r"^grpo\.num_prompts_per_step"):
        jgrpo.GRPOTrainer(bad)
    wrong_type = cfg.replace(grpo=cfg.grpo.__class__(max_num_steps="3"))
    with pytest.raises(ConfigError, match=r"^grpo\.max_num_steps: expected an integer"):
        jgrpo.GRPOTrainer(wrong_type)
    with pytest.raises(ConfigError, match=r"^data\.reward_functions: task 'prompts'"):
        jgrpo.GRPOTrainer({"data": {"task": "prompts"}})
    with pytest.raises(ConfigError, match=r"^reward_funcs\[0\]"):
        jgrpo.GRPOTrainer(TINY, reward_funcs=[3])
    trainer = jgrpo.GRPOTrainer(TINY, reward_funcs=lambda prompts, completions, **kw: [0.0])
    assert trainer.config.data.reward_functions[0].label == "<lambda>"


def test_import_jgrpo_is_cheap_and_curated():
    code = (
        "import sys, jgrpo, jgrpo.config\n"
        "assert 'jax' not in sys.modules, 'jax imported'\n"
        "print(sorted(n for n in dir(jgrpo) if not n.startswith('_')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(
        sorted(["Config", "ConfigError", "GRPOConfig", "GRPOTrainer", "TrainResult", "load_config"])
    )


@pytest.mark.parametrize(
    "module, message",
    [
        ("import os\nos._exit(0)\n", r"ended the reward process \(exit code 0\)"),
        ("import time\ntime.sleep(10_000)\n", r"did not finish within 1 s"),
        ("raise KeyboardInterrupt\n", r"cannot import 'bad_reward:f' \(KeyboardInterrupt"),
    ],
)
def test_cli_names_a_reward_module_that_exits_hangs_or_interrupts_at_import(
    tmp_path, monkeypatch, capsys, module, message
):
    (tmp_path / "bad_reward.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = cli.main(
        [
            "train", "--config", TINY, "--run-dir", str(tmp_path / "run"),
            "data.reward_functions=[{function: 'bad_reward:f'}]",
            "data.reward_import_timeout_s=1",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert re.search(r"data\.reward_functions\[0\]\.function: .*" + message, err), err


def test_log_samples_writes_jsonl_and_tensorboard_text(tmp_path):
    from jgrpo.config import LoggingConfig
    from jgrpo.metrics import MetricsLogger

    cfg = LoggingConfig(tensorboard=True, progress_bar=False)
    rows = [{"prompt": "1+1=", "completion": "2", "reward": 1.0, "reward/correct": None}]
    with MetricsLogger(tmp_path, cfg, 2) as logger:
        logger.log_samples(1, rows)
        logger.log_samples(2, rows * 2)
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, **rows[0]}, {"step": 2, **rows[0]}, {"step": 2, **rows[0]}]
    from tensorboardX.proto import event_pb2

    texts = []  # (step, text) of the text summaries in the TFRecord event files
    for path in sorted((tmp_path / "tb").glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                if v.tag.startswith("samples"):
                    texts.append((event.step, v.tensor.string_val[0]))
    assert [step for step, _ in texts] == [1, 2] and b"1+1=" in texts[0][1]


def test_chat_prompts_need_a_chat_template(tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    code = cli.main(
        [
            "train", "--config", TINY, "--run-dir", str(tmp_path / "run"), *QUICK,
            f"data.train_path={data}", "data.reward_functions=[{function: 'os.path:join', "
            "per_sample: true}]",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err, err
    assert err.endswith(
        "data.prompt_key: the dataset has chat-message prompts but the tokenizer "
        "of model.path 'builtin:tiny-qwen2' has no chat template"
    ), err


# ----------------------------------------------------------------------------- defaults that run


def test_default_lengths_fit_the_default_model_and_the_length_error_says_what_to_set():
    """A config setting only data.task resolves and passes the model pre-flight: the default
    rollout lengths (prompt_bucket + max_new_tokens) fit the default model's positions."""
    cfg = jgrpo.GRPOTrainer({"data": {"task": "arithmetic"}}).config
    assert cfg.model.path == "builtin:tiny-qwen2"
    check_model_path(cfg.model.path, cfg.rollout.prompt_bucket + cfg.rollout.max_new_tokens)
    check_model_path("builtin:tiny-qwen2-chat", 32 + 256)
    with pytest.raises(
        ConfigError,
        match=r"^rollout\.prompt_bucket \+ rollout\.max_new_tokens = 4096 exceeds "
        r"max_position_embeddings 2048 of .*: lower rollout\.max_new_tokens \(or "
        r"rollout\.prompt_bucket\) so that they sum to at most 2048$",
    ):
        check_model_path(cfg.model.path, 4096)


@pytest.mark.slow  # one GRPO step at the default lengths (288 tokens a row) through the CLI
def test_a_config_of_only_data_task_trains(tmp_path, capsys):
    (tmp_path / "min.yaml").write_text("data:\n  task: arithmetic\n")
    small = [  # fewer rows and steps; the lengths and the model stay the defaults
        "grpo.max_num_steps=1",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=2",
        "grpo.val_at_start=false",
        "data.num_val_examples=2",
        "logging.tensorboard=false",
        "logging.plot=false",
    ]
    run_dir = tmp_path / "run"
    argv = ["train", "--config", str(tmp_path / "min.yaml"), "--run-dir", str(run_dir), *small]
    assert cli.main(argv) == 0, capsys.readouterr().err
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1] and "val/accuracy" in rows[0]
