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
        sorted(
            [
                *("Config", "ConfigError", "GRPOConfig", "GRPOTrainer", "SFTConfig"),
                *("SFTTrainer", "TrainResult", "load_config"),
            ]
        )
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
        "of model.path 'builtin:tiny-qwen2' has no chat template: give string prompts or a "
        "model with one (builtin:tiny-qwen2-chat for the tiny model)"
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


@pytest.mark.heavy  # one GRPO step at the default lengths (288 tokens a row) through the CLI
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


# ----------------------------------------------------------------------------- TRL's shape


def _zero(prompts, completions, **kwargs):
    return [0.0] * len(prompts)


def _length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


# every TRL name GRPOConfig maps, with a value that differs from jgrpo's default
TRL_ARGS = dict(
    learning_rate=1e-4,
    weight_decay=0.01,
    adam_beta1=0.8,
    adam_beta2=0.99,
    adam_epsilon=1e-6,
    warmup_steps=1,
    lr_scheduler_type="cosine",
    max_grad_norm=0.5,
    num_generations=4,
    num_generations_eval=2,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=1,
    steps_per_generation=2,
    max_steps=4,
    seed=3,
    max_completion_length=8,
    temperature=0.9,
    top_p=0.95,
    top_k=5,
    beta=0.01,
    epsilon=0.1,
    epsilon_high=0.3,
    loss_type="dr_grpo",
    scale_rewards="none",
    importance_sampling_level="sequence",
    mask_truncated_completions=True,
    shuffle_dataset=False,
    save_steps=2,
    save_total_limit=1,
    eval_strategy="steps",
    eval_steps=2,
    eval_on_start=False,
    bf16=False,
    gradient_checkpointing=False,
    report_to="none",
    reward_weights=[1.0, 0.5],
    num_iterations=1,
    use_vllm=False,
    remove_unused_columns=False,
)
# the same run written by hand in jgrpo's keys
HAND = {
    "model": {
        "path": "builtin:tiny-qwen2",
        "compute_dtype": "float32",
        "remat": "none",
        "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]},
    },
    "data": {
        "task": "prompts",
        "shuffle": False,
        "reward_functions": [
            {"function": _zero, "weight": 1.0},
            {"function": _length, "weight": 0.5},
        ],
    },
    "grpo": {
        "num_prompts_per_step": 4,
        "num_generations_per_prompt": 4,
        "num_minibatches": 2,
        "num_microbatches": 1,
        "max_num_steps": 2,
        "val_period": 1,
        "val_at_start": False,
        "val_num_generations": 2,
        "seed": 3,
        "advantage": {"normalize_rewards": False},
    },
    "loss": {
        "ratio_clip_min": 0.1,
        "ratio_clip_max": 0.3,
        "reference_policy_kl_penalty": 0.01,
        "aggregation": "seq_sum_norm",
        "sequence_level_importance_ratios": True,
        "overlong_filtering": True,
    },
    "optim": {
        "learning_rate": 1e-4,
        "weight_decay": 0.01,
        "b1": 0.8,
        "b2": 0.99,
        "eps": 1e-6,
        "warmup_steps": 1,
        "warmup_start_ratio": 0.0,
        "schedule": "cosine",
        "max_grad_norm": 0.5,
    },
    "rollout": {"max_new_tokens": 8, "temperature": 0.9, "top_p": 0.95, "top_k": 5},
    "checkpoint": {"save_period": 1, "keep_last": 1},
    "logging": {"tensorboard": False, "wandb": False},
}


def _trl_trainer(tmp_path, **extra):
    peft = pytest.importorskip("peft")
    return jgrpo.GRPOTrainer(
        model="builtin:tiny-qwen2",
        reward_funcs=[_zero, _length],
        args=jgrpo.GRPOConfig(**TRL_ARGS, output_dir=str(tmp_path / "trl"), **extra),
        train_dataset=[{"prompt": f"{a}+{a}="} for a in range(6)],
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"]),
    )


def test_trl_shaped_call_resolves_to_the_jgrpo_config_written_by_hand(tmp_path):
    from jgrpo.api import build_config

    trainer = _trl_trainer(tmp_path)
    assert trainer.config == build_config(HAND)
    assert trainer.run_dir == tmp_path / "trl"
    # an argument left out keeps jgrpo's default, not TRL's (max_completion_length 512, ...)
    args = jgrpo.GRPOConfig()
    args.max_completion_length = 8  # set after construction, as TRL scripts do: checked too
    assert args.given == {"max_completion_length": 8} and args.top_p is None
    with pytest.raises(ConfigError, match=r"^GRPOConfig: logging_steps is not supported"):
        args.logging_steps = 5
    args = jgrpo.GRPOConfig()
    plain = jgrpo.GRPOTrainer(reward_funcs=_zero, args=args, train_dataset=[{}])
    assert plain.config == build_config({"data": {"task": "prompts"}}, reward_funcs=_zero)
    assert plain.config.data.wraps_string_prompts is False  # TRL: string prompts verbatim
    # only a dataset and a reward: task prompts on the default model, lengths that fit it
    bare = jgrpo.GRPOTrainer(train_dataset=[{"prompt": "hi"}], reward_funcs=_zero).config
    assert bare == plain.config and bare.model.path == "builtin:tiny-qwen2"
    check_model_path(bare.model.path, bare.rollout.prompt_bucket + bare.rollout.max_new_tokens)


@pytest.mark.parametrize(
    "trl, key, value",
    [
        ({"epsilon": 0.25}, "loss.ratio_clip_max", 0.25),  # epsilon_high defaults to epsilon
        ({"loss_type": "dapo"}, "loss.aggregation", "token_mean"),
        ({"loss_type": "grpo"}, "loss.aggregation", "seq_mean"),
        ({"scale_rewards": True}, "grpo.advantage.normalize_rewards", True),
        ({"scale_rewards": "group"}, "grpo.advantage.normalize_rewards", True),
        ({"importance_sampling_level": "token"}, "loss.sequence_level_importance_ratios", False),
        ({"lr_scheduler_type": "constant_with_warmup"}, "optim.schedule", "constant"),
        ({"lr_scheduler_type": "linear"}, "optim.schedule", "linear"),
        ({"max_grad_norm": 0}, "optim.max_grad_norm", None),
        ({"top_k": 0}, "rollout.top_k", None),
        ({"bf16": True}, "model.compute_dtype", "bfloat16"),
        ({"gradient_checkpointing": True}, "model.remat", "full"),
        ({"report_to": ["wandb", "tensorboard"]}, "logging.wandb", True),
        ({"eval_strategy": "no"}, "grpo.val_at_end", False),
        ({"max_steps": -1}, "grpo.max_num_steps", 100),  # TRL's "unset"
        ({"generation_batch_size": 16}, "grpo.num_prompts_per_step", 2),  # 16 rows / G 8
        ({"generation_batch_size": 16}, "grpo.num_minibatches", 2),  # 16 / per_device 8
        ({"per_device_train_batch_size": 16}, "grpo.num_prompts_per_step", 2),
        ({"gradient_accumulation_steps": 2}, "grpo.num_microbatches", 2),
        ({"gradient_accumulation_steps": 2}, "grpo.num_prompts_per_step", 2),
    ],
)
def test_each_trl_name_maps_to_its_jgrpo_key(trl, key, value):
    import functools

    cfg = jgrpo.GRPOTrainer(reward_funcs=_zero, args=jgrpo.GRPOConfig(**trl)).config
    assert functools.reduce(getattr, key.split("."), cfg) == value


@pytest.mark.parametrize("trl_schedule", ["constant_with_warmup", "linear", "cosine"])
def test_trl_learning_rates_are_transformers_schedulers(trl_schedule):
    """The learning rate of every update of a TRL-shaped run is the one transformers' own
    scheduler gives TRL's Trainer (it warms up from 0), read from a torch optimizer it drives."""
    torch = pytest.importorskip("torch")
    from transformers import get_scheduler

    from jgrpo import optimizer, step

    args = dict(lr_scheduler_type=trl_schedule, warmup_steps=3, max_steps=10)
    cfg = jgrpo.GRPOTrainer(reward_funcs=_zero, args=jgrpo.GRPOConfig(**args)).config
    flags = step.StepFlags.from_config(cfg)
    schedule = optimizer.make_schedule(
        flags.schedule, flags.warmup_steps, flags.total_updates, 0.0, flags.warmup_start_ratio
    )
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hf = get_scheduler(trl_schedule, sgd, num_warmup_steps=3, num_training_steps=10)
    expected = []
    for _ in range(flags.total_updates):
        expected.append(sgd.param_groups[0]["lr"])  # the rate of this update
        sgd.step()
        hf.step()
    assert flags.total_updates == 10 and expected[0] == 0.0
    np.testing.assert_allclose([float(schedule(k)) for k in range(10)], expected, atol=1e-7)


def test_trl_batch_arithmetic_uses_the_base_config_group_size():
    """tiny.yaml has G = 4: 8 rows a generation are 2 prompts of 4, not 1 of TRL's 8."""
    args = jgrpo.GRPOConfig(per_device_train_batch_size=8)
    cfg = jgrpo.GRPOTrainer(TINY, args=args).config
    assert (cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt) == (2, 4)


@pytest.mark.parametrize(
    "trl, message",
    [
        ({"use_vllm": True}, r"^GRPOConfig\.use_vllm: True is not supported"),
        ({"max_prompt_length": 256}, r"^GRPOConfig: max_prompt_length is not supported"),
        ({"num_train_epochs": 3}, r"^GRPOConfig: num_train_epochs is not supported"),
        ({"logging_steps": 10}, r"^GRPOConfig: logging_steps is not supported"),
        ({"vllm_mode": "colocate"}, r"^GRPOConfig: vllm_mode is not a TRL argument jgrpo"),
        ({"num_iterations": 2}, r"^GRPOConfig\.num_iterations: 2 must be 1"),
        ({"loss_type": "bnpo"}, r"^GRPOConfig\.loss_type: 'bnpo' must be one of"),
        ({"scale_rewards": "batch"}, r"^GRPOConfig\.scale_rewards: 'batch' must be"),
        ({"eval_strategy": "epoch"}, r"^GRPOConfig\.eval_strategy: 'epoch'"),
        ({"lr_scheduler_type": "polynomial"}, r"^GRPOConfig\.lr_scheduler_type: 'polynomial'"),
        ({"report_to": "mlflow"}, r"^GRPOConfig\.report_to: 'mlflow'"),
        ({"generation_batch_size": 12}, r"^GRPOConfig\.generation_batch_size: 12 must be a"),
        (
            {"generation_batch_size": 16, "steps_per_generation": 2},
            r"^GRPOConfig\.generation_batch_size: 16 and steps_per_generation",
        ),
        (
            {"steps_per_generation": 3, "gradient_accumulation_steps": 2},
            r"^GRPOConfig\.steps_per_generation: 3 must be a multiple of gradient_acc",
        ),
        (
            {"max_steps": 3, "steps_per_generation": 2},
            r"^GRPOConfig\.max_steps: 3 must be a multiple of 2 optimizer steps",
        ),
    ],
)
def test_unsupported_trl_arguments_are_one_line_errors_naming_them(trl, message):
    with pytest.raises(ConfigError, match=message):
        jgrpo.GRPOTrainer(reward_funcs=_zero, args=jgrpo.GRPOConfig(**trl))


def test_peft_config_and_model_errors():
    peft = pytest.importorskip("peft")
    from jgrpo.config import LoRAConfig

    def trainer(**kw):
        return jgrpo.GRPOTrainer(**{"reward_funcs": _zero, **kw})

    own = LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj",))
    assert trainer(peft_config=own).config.model.lora == own
    every = trainer(peft_config=peft.LoraConfig(r=2, target_modules="all-linear"))
    assert every.config.model.lora == LoRAConfig(rank=2, alpha=8.0)  # peft's lora_alpha 8
    for kw, message in [
        ({"lora_dropout": 0.05}, r"^peft_config\.lora_dropout: 0\.05 is not supported"),
        ({"use_dora": True}, r"^peft_config\.use_dora: True is not supported"),
        ({"use_rslora": True}, r"^peft_config\.use_rslora: True"),
        ({"bias": "all"}, r"^peft_config\.bias: 'all'"),
        ({"target_modules": None}, r"^peft_config\.target_modules: None"),
        ({"target_modules": ["c_attn"]}, r"^model\.lora\.target_modules"),
    ]:
        with pytest.raises(ConfigError, match=message):
            trainer(peft_config=peft.LoraConfig(r=2, **{"target_modules": ["q_proj"], **kw}))
    with pytest.raises(ConfigError, match=r"^peft_config: expected a peft\.LoraConfig"):
        trainer(peft_config={"r": 2})
    with pytest.raises(ConfigError, match=r"^model: expected what model\.path takes"):
        trainer(model=object())
    with pytest.raises(ConfigError, match=r"^GRPOTrainer: processing_class is not supported"):
        trainer(processing_class=None)
    with pytest.raises(ConfigError, match=r"^args: expected a jgrpo\.GRPOConfig"):
        trainer(args={"learning_rate": 1.0})
    with pytest.raises(ConfigError, match=r"^run_dir: give run_dir or GRPOConfig\.output_dir"):
        trainer(args=jgrpo.GRPOConfig(output_dir="a"), run_dir="b")
    with pytest.raises(ConfigError, match=r"^reward_funcs\[0\]: a weight here and in GRPOConfig"):
        trainer(args=jgrpo.GRPOConfig(reward_weights=[1.0]), reward_funcs=[(_zero, 2.0)])


@pytest.mark.heavy  # 2 GRPO steps of the tiny model through the TRL-shaped call
def test_trl_shaped_call_trains_the_tiny_model(tmp_path):
    trainer = _trl_trainer(tmp_path)
    result = trainer.train()
    assert [r["step"] for r in result.metrics] == [1, 2]
    assert result.history == []  # no eval_dataset: nothing held out, no validation
    assert all(r["reward/_length/mean"] is not None for r in result.metrics)
    assert (result.model_dir / "model.safetensors").is_file()
    assert result.run_dir == tmp_path / "trl"


def test_eval_without_a_held_out_set_is_one_line(tmp_path, capsys):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    argv = ["eval", "--config", TINY, "data.task=gsm8k", f"data.train_path={data}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "data.val_path: nothing to evaluate; give data.val_path, data.val_fraction or data.val_sets"
    )
    assert len(err.splitlines()) == 1
