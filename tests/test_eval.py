"""jgrpo.evaluation: unbiased pass@k against enumeration, maj@n with ties, named sets."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from jgrpo import evaluation
from jgrpo.config import ConfigError, load_config
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
        def evaluate(self, examples, step, pass_k):
            calls.append((tuple(examples), pass_k))
            n = len(examples) * pass_k
            correct = [e == "right" for e in examples for _ in range(pass_k)]
            if pass_k == 2:  # the sampled pass: the first sample of each example is wrong
                correct = [c and j == 1 for c, j in zip(correct, [0, 1] * len(examples))]
            return _result(np.reshape(correct, (-1,)), np.arange(n))

    class Task:
        val = ["right", "wrong"]
        val_sets = {"hard": ["wrong"]}

    got = evaluation.validate_all(cfg, Backend(), Task(), 0)
    assert calls == [
        (("right", "wrong"), 1),
        (("right", "wrong"), 2),
        (("wrong",), 1),
        (("wrong",), 2),
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
    assert cfg.data.val_sets == (("extra", str(path)),)
    from jgrpo.tasks import make_task

    task = make_task(cfg.data, 0)
    try:
        assert [e["question"] for e in task.val_sets["extra"]] == ["0+1", "1+1", "2+1"]
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
