"""jgrpo.evaluation: unbiased pass@k against enumeration, maj@n with ties, named sets."""

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from jgrpo import evaluation
from jgrpo.config import ConfigError, ValSetConfig, load_config, to_dict
from jgrpo.rollout import RolloutResult
from jgrpo.rollout.engine import vote_ids
from jgrpo.tasks.verify import numeric_vote

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_unbiased_pass_at_k_equals_the_fraction_of_k_subsets_with_a_correct_sample(n):
    # pass@k = P(a uniformly drawn k-subset of the n samples holds a correct one)
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert evaluation.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_majority_vote_and_its_tie_rule():
    # answers 7, 7, 3: 7 wins (wrong)
    assert not evaluation.majority_correct([7, 7, 3], [False, False, True])
    # a tie 3 vs 7: the answer given first wins (3 here, then 7)
    assert evaluation.majority_correct([3, 7, 7, 3], [True, False, False, True])
    assert not evaluation.majority_correct([7, 3, 3, 7], [False, True, True, False])
    # no answer (-1) does not vote, even as the most frequent; nothing at all is wrong
    assert evaluation.majority_correct([-1, -1, -1, 5], [False, False, False, True])
    assert not evaluation.majority_correct([-1, -1], [False, False])


def test_votes_are_canonical_numbers():
    assert numeric_vote("so 12") == numeric_vote("#### 12.0") == numeric_vote("\\boxed{24/2}")
    assert numeric_vote("no number") is None
    ids = vote_ids(["12", None, "12", "3"])
    assert ids[1] == -1 and ids[0] == ids[2] != ids[3]


def _result(correct_xn, votes_xn):
    correct = np.asarray(correct_xn, bool).reshape(-1)
    batch = {
        "correct": correct,
        "rewards": correct.astype(np.float32),
        "lengths": np.full(correct.size, 3),
        "vote_ids": np.asarray(votes_xn, np.int64).reshape(-1),
    }
    return RolloutResult(batch, {}, [])


def test_sampled_metrics_hand_values():
    # 2 examples x n = 4: example 0 has 1 correct (answer 5 vs two 8s), example 1 has 3
    correct = [[1, 0, 0, 0], [1, 1, 0, 1]]
    votes = [[5, 8, 8, -1], [2, 2, 9, 2]]
    got = evaluation.sampled_metrics(_result(correct, votes), 2, 4, (1, 2, 4))
    assert got["mean@4"] == pytest.approx(4 / 8)
    assert got["pass@1"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    # pass@2: 1 - C(3,2)/C(4,2) = 1/2 for c = 1; 1 - C(1,2)/C(4,2) = 1 for c = 3
    assert got["pass@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert got["pass@4"] == 1.0
    assert got["maj@4"] == 0.5


def test_validate_all_logs_every_named_set():
    cfg = load_config(
        TINY,
        ["grpo.val_num_generations=2", "grpo.val_pass_at=[1, 2]", "rollout.val_temperature=0.7"],
    )
    calls = []

    class Backend:
        def evaluate(self, examples, step, pass_k, val_set=None):
            calls.append((tuple(examples), pass_k, val_set))
            n = len(examples) * pass_k
            correct = [e == "right" for e in examples for _ in range(pass_k)]
            if pass_k == 2:  # the sampled pass: the first sample of each example is wrong
                correct = [c and j == 1 for c, j in zip(correct, [0, 1] * len(examples))]
            return _result(np.reshape(correct, (-1,)), np.arange(n))

    class Task:
        val = ["right", "wrong"]
        val_tasks = {"hard": SimpleNamespace(val=["wrong"])}

    got = evaluation.validate_all(cfg, Backend(), Task(), 0)
    assert calls == [
        (("right", "wrong"), 1, None),
        (("right", "wrong"), 2, None),
        (("wrong",), 1, "hard"),
        (("wrong",), 2, "hard"),
    ]
    assert got["val/accuracy"] == 0.5
    assert got["val/mean@2"] == 0.25
    assert got["val/pass@1"] == 0.25 and got["val/pass@2"] == 0.5
    assert got["val/maj@2"] == 0.0  # every sample gives a different answer: the first wins
    assert got["val/hard/accuracy"] == 0.0 and got["val/hard/pass@2"] == 0.0
    assert "val/hard/maj@2" in got


def test_eval_config_keys(tmp_path):
    path = tmp_path / "extra.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(3))
    )
    cfg = load_config(TINY, [f"data.val_sets={{extra: {path}}}"])
    assert cfg.data.val_sets == (ValSetConfig(name="extra", path=str(path)),)
    from jgrpo.tasks import make_task

    task = make_task(cfg.data, 0)
    try:
        assert [e["question"] for e in task.val_tasks["extra"].val] == ["0+1", "1+1", "2+1"]
    finally:
        task.close()
    with pytest.raises(ConfigError, match="grpo.val_pass_at: k = 3 must lie in"):
        load_config(TINY, ["grpo.val_num_generations=2", "grpo.val_pass_at=[3]"])
    with pytest.raises(ConfigError, match="rollout.val_temperature: the val_num_generations"):
        load_config(TINY, ["grpo.val_num_generations=2", "rollout.val_temperature=0"])
    with pytest.raises(ConfigError, match="data.val_sets: name 'val' must be unique"):
        load_config(TINY, ["data.val_sets={val: x.jsonl}"])


def test_jgrpo_eval_prints_the_table_of_every_set(capsys, tmp_path):
    from jgrpo import cli

    path = tmp_path / "extra.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"{i}+2", "answer": str(i + 2)}) + "\n" for i in range(2))
    )
    argv = [
        "eval",
        "--config",
        TINY,
        "data.num_val_examples=3",
        "grpo.val_num_generations=2",
        "grpo.val_pass_at=[1, 2]",
        f"data.val_sets={{extra: {path}}}",
    ]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    table = {line.split()[0]: float(line.split()[1]) for line in lines[:-1]}
    keys = ["reward_mean", "length_mean", "accuracy", "mean@2", "pass@1", "pass@2", "maj@2"]
    assert list(table) == [f"val/{k}" for k in keys] + [f"val/extra/{k}" for k in keys]
    for key, value in table.items():
        assert value == pytest.approx(report[key], abs=5e-5)
        if "@" in key and "length" not in key:
            assert 0.0 <= value <= 1.0
    assert report["val/pass@1"] == pytest.approx(report["val/mean@2"])


@pytest.mark.parametrize(
    "entry, message",
    [
        ("{a: {task: gsm8k}}", r"^data.val_sets.a.path: required key is missing$"),
        ("{a: {path: p, reward: x}}", r"^unknown config key `data.val_sets.a.reward`; did you"),
        ("{a: {path: p, num_examples: 0}}", r"^data.val_sets.a.num_examples: must lie in"),
        ("{a: {path: p, task: prompts, reward_functions: []}}", r"^data.val_sets.a.reward_fu"),
        ("{a: {path: p, reward_functions: [{model: org/rm}]}}", r"functions\[0\]: give a func"),
        ("{a: {path: p, reward_functions: [{function: f}]}}", r"\[0\].function: 'f' must look"),
        ("{val: p}", r"^data.val_sets: name 'val' must be unique"),
    ],
)
def test_val_set_errors_name_the_set(entry, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [f"data.val_sets={entry}"])


def test_val_set_forms_and_what_a_set_inherits():
    from jgrpo.config import Config, from_dict

    short = (ValSetConfig(name="a", path="x.jsonl"),)
    assert load_config(TINY, ["data.val_sets={a: x.jsonl}"]).data.val_sets == short
    cfg = load_config(TINY, ["data.val_sets={a: {path: x.jsonl, task: gsm8k, num_examples: 5}}"])
    assert cfg.data.val_sets == (
        ValSetConfig(name="a", path="x.jsonl", task="gsm8k", num_examples=5),
    )
    assert from_dict(Config, to_dict(cfg)) == cfg  # a run's saved config.yaml loads back
    saved = to_dict(load_config(TINY))
    saved["data"]["val_sets"] = [["a", "x.jsonl"]]  # what runs saved before the long form
    assert from_dict(Config, saved).data.val_sets == short
    data = load_config(
        TINY, ["data.reward_functions=[{function: 'm:f'}]", "data.task_reward_weight=0.5"]
    ).data
    same = ValSetConfig(name="a", path="p", num_examples=3).data_config(data)
    assert (same.task, same.val_path, same.train_path, same.num_val_examples) == (
        "arithmetic",
        "p",
        None,
        3,
    )
    assert same.reward_functions == data.reward_functions and same.task_reward_weight == 0.5
    other = ValSetConfig(name="a", path="p", task="gsm8k").data_config(data)
    assert (other.task, other.reward_functions, other.task_reward_weight) == ("gsm8k", (), 1.0)
    assert other.num_val_examples == data.num_val_examples and other.val_sets == ()


def test_val_pass_k_maps_to_the_sampled_keys():
    assert load_config(TINY, ["grpo.val_pass_k=1"]) == load_config(TINY)  # old config.yaml files
    with pytest.warns(UserWarning, match=r"grpo.val_pass_k: 4 is now grpo.val_num_generations: 4"):
        cfg = load_config(TINY, ["grpo.val_pass_k=4"])
    assert (cfg.grpo.val_num_generations, cfg.grpo.val_pass_at) == (4, (4,))
    with pytest.raises(ConfigError, match=r"^grpo.val_pass_k: replaced by grpo.val_num_gen"):
        load_config(TINY, ["grpo.val_pass_k=4", "grpo.val_num_generations=8"])


VAL_REWARDS = """
def half(prompts, completions, **columns):
    return [0.5 for _ in completions]

def bonus(prompts, completions, bonus, **columns):
    return [float(b) for b in bonus]
"""


def _scripted_generate(tokenizer, answers: dict[str, str]):
    """A stand-in for sampling.generate: each row's completion is answers[k] for the first key
    k in its decoded prompt (else "ok"), then the stop token."""
    from jgrpo import sampling

    def generate(model, prompts, params, key, first_row=0, group_size=1):
        n, b = params.max_new_tokens, len(prompts)
        tokens = np.full((b, n), tokenizer.pad_token_id, np.int32)
        lengths = np.zeros(b, np.int32)
        for i, ids in enumerate(prompts):
            text = tokenizer.decode(ids)
            answer = next((a for k, a in answers.items() if k in text), "ok")
            out = [
                *tokenizer(answer, add_special_tokens=False)["input_ids"],
                params.stop_token_ids[0],
            ]
            tokens[i, : len(out)], lengths[i] = out, len(out)
        width = -(-max(map(len, prompts)) // 16) * 16
        prompt_tokens = np.zeros((b, width), np.int32)
        for i, ids in enumerate(prompts):
            prompt_tokens[i, width - len(ids) :] = ids
        return sampling.Generation(
            tokens=tokens,
            logprobs=np.zeros((b, n), np.float32),
            filtered_logprobs=np.zeros((b, n), np.float32),
            lengths=lengths,
            truncated=np.zeros(b, bool),
            prompt_tokens=prompt_tokens,
            prompt_lengths=np.asarray([len(p) for p in prompts], np.int32),
            num_decode_steps=int(lengths.max()) - 1,
        )

    return generate


def test_each_val_set_is_prompted_and_scored_by_its_own_task(capsys, tmp_path, monkeypatch):
    """Training on prompts scored by a custom reward (0.5 each); `arith` is scored by the
    arithmetic verifier alone (the independent task metric), `bonus` by its own function."""
    from jgrpo import cli, sampling
    from jgrpo.models.sources import resolve_model_path
    from jgrpo.rollout import load_tokenizer

    (tmp_path / "val_rewards.py").write_text(VAL_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))

    def jsonl(name, records):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
        return tmp_path / name

    train = jsonl("train.jsonl", [{"prompt": f"say {i}"} for i in range(4)])
    arith = jsonl(
        "arith.jsonl",
        [{"question": q, "answer": a} for q, a in [("1+2", "3"), ("4+4", "8"), ("5-1", "4")]],
    )
    bonus = jsonl(
        "bonus.jsonl", [{"prompt": "first", "bonus": 0.25}, {"prompt": "second", "bonus": 1.0}]
    )
    tokenizer = load_tokenizer(resolve_model_path("builtin:tiny-qwen2"))
    # 2 of the 3 sums right: "5-1" is answered 5
    answers = {"1+2": "3", "4+4": "8", "5-1": "5"}
    monkeypatch.setattr(sampling, "generate", _scripted_generate(tokenizer, answers))
    argv = [
        "eval",
        "--config",
        TINY,
        "data.task=prompts",
        f"data.train_path={train}",
        "data.val_fraction=0.5",
        "data.reward_functions=[{function: 'val_rewards:half'}]",
        f"data.val_sets={{arith: {{path: {arith}, task: arithmetic}}, bonus: {{path: {bonus}, "
        "reward_functions: [{function: 'val_rewards:bonus'}]}}",
    ]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["val/reward_mean"] == 0.5  # the training reward on the run's own split
    assert report["val/arith/accuracy"] == pytest.approx(2 / 3)
    assert report["val/arith/reward_mean"] == pytest.approx(
        2 / 3
    )  # no 0.5 from the training reward
    assert report["val/bonus/reward_mean"] == pytest.approx((0.25 + 1.0) / 2)
    assert "val/accuracy" not in report and "val/bonus/accuracy" not in report  # no verifier
