"""`make demo-tools` at toy size: the shipped config, the warm start's tool-call traces (what
`jgrpo sft` trains on: the ideal conversation, loss on the assistant ids only), then 2 GRPO
steps through the same config in which the warm-started model calls the calculator."""

import json
from pathlib import Path

import numpy as np
import pytest

from jgrpo import train
from jgrpo.config import load_config
from jgrpo.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "demo_tools.yaml")
TINY = (
    "--hidden-size 32 --num-layers 1 --num-heads 2 --num-kv-heads 1 --intermediate-size 64 "
    "--steps 40 --batch-size 8 --warmup-steps 5 --learning-rate 1e-2 --no-eval "
    "--direct-after 20 --direct-fraction 0.25"
).split()


def test_shipped_config_is_the_normal_multi_turn_path():
    cfg = load_config(CONFIG)
    assert cfg.data.task == "calculator" and cfg.data.operators == "*"
    assert cfg.rollout.max_turns >= 2 and cfg.rollout.tool_call_format == "hermes"
    assert cfg.rollout.backend == "local" and cfg.model.path == ".cache/demo-tools/tiny-calc-sft"


def test_traces_fit_the_budget_and_train_the_assistant_ids_only(warm_start, tmp_path):
    from jgrpo.models.tiny import build_tiny_model
    from jgrpo.rollout import load_tokenizer
    from jgrpo.sft_data import Encoder
    from jgrpo.tasks import make_task

    cfg = load_config(CONFIG)
    tokenizer = load_tokenizer(build_tiny_model(tmp_path / "m", chat=True))
    task = make_task(cfg.data, 1)
    try:
        example = {"task": "calculator", "question": "999*999", "answer": "998001", "id": "x"}
        # the warm start's records, laid out by `jgrpo sft` (jgrpo.sft_data) as a rollout
        encoder = Encoder(tokenizer, cfg, task.tool_runner.schemas)
        (ids, mask), (direct_ids, direct_mask) = [
            encoder.record({"messages": messages}, "record")
            for messages in (
                task.prompt_messages(example) + warm_start.assistant_turns(task, example, d)
                for d in (False, True)
            )
        ]
        prompt = task.format_prompt(example, tokenizer, tools=task.tool_runner.schemas)
    finally:
        task.close()
    prompt_len = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    # the largest question's ideal conversation fits the completion budget
    assert len(ids) - prompt_len <= cfg.rollout.max_new_tokens
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert trained == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "999*999"}}\n'
        "</tool_call><|im_end|>998001<|im_end|>"
    )
    assert not any(mask[:prompt_len])
    # a direct answer (the warm start's other behaviour): the same prompt ids, then the number
    assert direct_ids[:prompt_len] == ids[:prompt_len] and not any(direct_mask[:prompt_len])
    trained = tokenizer.decode([i for i, m in zip(direct_ids, direct_mask) if m])
    assert trained == "The answer is 998001.<|im_end|>"


def test_direct_answers_are_mixed_in_after_the_tool_only_steps(warm_start):
    settings = warm_start.Settings(
        data={}, steps=400, batch_size=32, direct_after=200, direct_fraction=0.7
    )
    direct = warm_start.direct_rows(settings).reshape(400, 32)
    assert not direct[:200].any()
    assert abs(direct[200:].mean() - 0.7) < 0.02  # 6400 draws: 3.5 standard deviations
    assert not warm_start.direct_rows(warm_start.Settings(data={})).any()  # the default


@pytest.mark.parametrize(
    "config,flags,needle",
    [
        (CONFIG, ["--direct-fraction", "1.5"], "--direct-fraction: must lie in [0, 1], got 1.5"),
        (CONFIG, ["--direct-after", "-1"], "--direct-after: must be >= 0, got -1"),
        (
            str(ROOT / "configs" / "demo.yaml"),
            ["--direct-fraction", "0.5"],
            "--direct-fraction: data.task 'arithmetic' has no reference conversation",
        ),
    ],
)
def test_direct_answer_flags_that_cannot_apply_exit_2(
    warm_start, tmp_path, capsys, config, flags, needle
):
    assert warm_start.main(["--config", config, "--out", str(tmp_path / "m"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {needle}") and len(err.splitlines()) == 1
    assert not (tmp_path / "m").exists()


@pytest.mark.heavy  # make test: test_traces_fit_the_budget_and_train_the_assistant_ids_only
def test_warm_start_then_grpo_calls_the_calculator(warm_start, tmp_path):
    folder = tmp_path / "sft"
    assert warm_start.main(["--config", CONFIG, "--out", str(folder), *TINY]) == 0
    record = json.loads((folder / "warm_start.json").read_text())
    assert record["loss_last"] < 0.5 * record["loss_first"]

    cfg = load_config(
        CONFIG,
        [
            f"model.path={folder}",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=2",
            "grpo.max_num_steps=2",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "logging.progress_bar=false",
            "logging.plot=false",
        ],
    )
    train.run(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["tools/calls"] >= 4 and r["turns/max"] == 2 and r["turns/mean"] > 1
        assert 0 < r["tokens/tool_fraction"] < 1 and np.isfinite(r["loss/total"])
        assert r["perf/tools_s"] > 0
