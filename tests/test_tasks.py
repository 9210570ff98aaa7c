"""jgrpo.tasks: verifiers, data order and restore, file loading, errors, rewards, prompts."""

import dataclasses
import json
import os
import pickle
import textwrap
import time

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jgrpo.config import ConfigError, DataConfig, RewardFunctionConfig
from jgrpo.tasks import (
    evaluate_expression,
    extract_answer,
    make_task,
    verify_countdown,
    verify_numeric,
)

GSM8K_RECORDS = [
    {
        "question": f"Tom has {i} apples and buys 2 more. How many?",
        "answer": f"{i}+2=<<{i}+2={i + 2}>>{i + 2}\n#### {i + 2}",
    }
    for i in range(10)
]


# ----------------------------------------------------------------------------- verifiers


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("So the total is 5.\n#### 72", "72", True),
        ("#### 1,000", "1000", True),
        ("#### $1,000.00 dollars", "1000", True),
        ("The answer is 12.50.", "12.5", True),
        ("The answer is: 3/4", "0.75", True),
        ("\\boxed{\\frac{3}{4}}", "0.75", True),
        ("\\boxed{1{,}000}", "1000", True),
        ("so x = \\boxed{-7} here 12", "-7", True),
        ("-47", "-47", True),
        ("47", "-47", False),
        ("10-3 leaves 7 cookies", "7", True),
        ("10 - 3", "-3", False),
        ("It costs $18 per day.", "18", True),
        ("Final answer: 5 apples", "5", True),
        ("#### 72\nthen I rambled about 9", "72", True),
        ("#### 71", "72", False),
        ("#### \n 72", "72", True),
        ("#### seventy-two\nor 72", "72", False),  # a `####` line with no number is no answer
        ("I have no idea", "3", False),
        ("", "0", False),
        ("0.333", "1/3", False),
        ("0.30000000000000004", "0.3", True),
        ("12.5", "12.50", True),
        ("5 %", "5", True),
        ("1/0", "0", False),
    ],
)
def test_verify_numeric(completion, reference, expected):
    assert verify_numeric(completion, reference) is expected


def test_extract_answer_priorities():
    assert extract_answer("4 then \\boxed{5}, answer is 6, finally 7") == "5"
    assert extract_answer("answer is 6, finally 7") == "6"
    assert extract_answer("1 2 3") == "3"
    assert extract_answer("nothing") is None


@pytest.mark.parametrize(
    "completion, numbers, target, expected",
    [
        ("(3+5)*2", [3, 5, 2], 16, True),
        ("#### 2*(5+3)", [3, 5, 2], 16, True),
        ("Let me think.\n(3 + 5) × 2 = 16", [3, 5, 2], 16, True),
        ("<answer>(3+5)*2</answer>", [3, 5, 2], 16, True),
        ("\\boxed{(3+5) \\times 2}", [3, 5, 2], 16, True),
        ("3+5", [3, 5, 2], 8, True),  # at most once: unused numbers are fine
        ("(3+5)*2*2", [3, 5, 2], 32, False),  # 2 used twice
        ("(3+5)*2*2", [3, 5, 2, 2], 32, True),  # ... unless given twice
        ("8*2", [3, 5, 2], 16, False),  # 8 is not a given number
        ("6/4*8", [6, 4, 8], 12, True),  # exact rational division
        ("7/2", [7, 2], 3, False),  # no integer division
        ("5/(3-3)", [5, 3, 3], 0, False),  # division by zero
        ("3**2", [3, 2], 9, False),  # no powers
        ("9**9**9**9", [9, 9, 9, 9], 1, False),
        ("3//2", [3, 2], 1, False),
        ("-3+5", [3, 5], 2, False),  # no unary sign
        ("2.5*2", [2, 5], 5, False),
        ("__import__('os').system('echo hi')", [1], 1, False),
        ("(lambda: 16)()", [16], 16, False),
        ("x+1", [1], 2, False),
        ("(" * 500 + "1" + ")" * 500, [1], 1, False),  # too long to parse
        ("", [1], 1, False),
    ],
)
def test_verify_countdown(completion, numbers, target, expected):
    assert verify_countdown(completion, numbers, target) is expected


def test_evaluate_expression_is_exact_and_refuses_code():
    value, used = evaluate_expression("(1+2)/3*7")
    assert value == 7 and used == [1, 2, 3, 7]
    for hostile in ["__import__('os')", "open('/etc/passwd')", "().__class__", "2**100000", "a"]:
        with pytest.raises(ValueError):
            evaluate_expression(hostile)


# ----------------------------------------------------------------------------- data order


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _ids(examples):
    return [e["id"] for e in examples]


@pytest.fixture
def gsm8k_cfg(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", GSM8K_RECORDS)
    return DataConfig(task="gsm8k", train_path=train, val_fraction=0.3)


def test_record_order_is_seeded_and_restorable(gsm8k_cfg):
    task = make_task(gsm8k_cfg, seed=7)
    assert len(task.val) == 3
    train_ids = set(_ids(task.train.next_prompts(7)))
    assert len(train_ids) == 7 and train_ids.isdisjoint(_ids(task.val))

    a, b = make_task(gsm8k_cfg, seed=7), make_task(gsm8k_cfg, seed=7)
    seq_a = [_ids(a.train.next_prompts(3)) for _ in range(6)]
    seq_b = [_ids(b.train.next_prompts(3)) for _ in range(6)]
    assert seq_a == seq_b
    other = make_task(gsm8k_cfg, seed=8)
    assert [_ids(other.train.next_prompts(3)) for _ in range(6)] != seq_a

    # epochs: every epoch is a permutation of the 7 training records, reshuffled
    flat = sum(seq_a, [])  # 18 examples: epochs of 7, 7, 4
    assert sorted(flat[:7]) == sorted(flat[7:14]) and flat[:7] != flat[7:14]

    # restore after k batches: the continuation is identical, also in a fresh task
    c = make_task(gsm8k_cfg, seed=7)
    c.train.next_prompts(3), c.train.next_prompts(3), c.train.next_prompts(3)
    state = json.loads(json.dumps(c.train.state()))
    assert state == {"kind": "records", "seed": 7, "epoch": 1, "offset": 2, "num_records": 7}
    d = make_task(gsm8k_cfg, seed=7)
    d.train.restore(state)
    assert [_ids(d.train.next_prompts(3)) for _ in range(3)] == seq_a[3:]
    with pytest.raises(ValueError, match="does not match"):
        make_task(gsm8k_cfg, seed=9).train.restore(state)


def test_no_shuffle_keeps_file_order(tmp_path):
    train = _write_jsonl(tmp_path / "t.jsonl", GSM8K_RECORDS)
    val = _write_jsonl(tmp_path / "v.jsonl", GSM8K_RECORDS[:2])
    task = make_task(DataConfig(task="gsm8k", train_path=train, val_path=val, shuffle=False), 0)
    assert _ids(task.train.next_prompts(12)) == [f"train/{i}" for i in range(10)] + [
        "train/0",
        "train/1",
    ]
    assert [e["answer"] for e in task.val] == ["2", "3"]


@pytest.mark.parametrize("kind", ["arithmetic", "countdown"])
def test_synthetic_stream_restore_and_val_disjoint(kind):
    cfg = DataConfig(task=kind, num_val_examples=50, max_operand=9)
    a = make_task(cfg, seed=3)
    first = [a.train.next_prompts(4) for _ in range(5)]
    b = make_task(cfg, seed=3)
    b.train.next_prompts(4), b.train.next_prompts(4)
    state = json.loads(json.dumps(b.train.state()))
    assert state == {"kind": "synthetic", "seed": 3, "index": 8}
    c = make_task(cfg, seed=3)
    c.train.restore(state)
    assert [c.train.next_prompts(4) for _ in range(3)] == first[2:]
    assert make_task(cfg, seed=4).train.next_prompts(20) != sum(first, [])
    key = (
        (lambda e: e["question"])
        if kind == "arithmetic"
        else (lambda e: tuple(sorted(e["numbers"])))
    )
    val_keys = {key(e) for e in a.val}
    assert len(val_keys) == 50
    assert val_keys.isdisjoint(key(e) for e in a.train.next_prompts(500))
    assert a.val == make_task(cfg, seed=99).val  # the val set does not depend on the run seed


def test_generated_examples_are_solvable_and_match_knobs():
    task = make_task(DataConfig(task="countdown", countdown_num_numbers=4, max_operand=20), 0)
    for example in task.train.next_prompts(300):
        assert len(example["numbers"]) == 4 and all(1 <= n <= 20 for n in example["numbers"])
        assert task.verify(task.reference_completion(example), example)
    task = make_task(DataConfig(task="arithmetic", num_terms=3, max_operand=5, operators="*"), 0)
    for example in task.train.next_prompts(100):
        a, b, c = map(int, example["question"].split("*"))
        assert max(a, b, c) <= 5 and int(example["answer"]) == a * b * c
        assert task.verify(task.reference_completion(example), example)


# ----------------------------------------------------------------------------- files and errors


def test_jsonl_parquet_and_hf_folder_load_alike(tmp_path):
    jsonl = _write_jsonl(tmp_path / "d.jsonl", GSM8K_RECORDS)
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K_RECORDS), parquet)
    folder = tmp_path / "hf"
    datasets.Dataset.from_list(GSM8K_RECORDS).save_to_disk(str(folder))
    csv = tmp_path / "d.csv"
    datasets.Dataset.from_list(GSM8K_RECORDS).to_csv(str(csv), index=False)
    seen = []
    for path in (jsonl, str(parquet), str(folder), str(csv)):
        task = make_task(
            DataConfig(task="gsm8k", train_path=path, val_fraction=0.2, shuffle=False), 0
        )
        seen.append((task.train.next_prompts(8), task.val))
    assert seen[0] == seen[1] == seen[2] == seen[3]
    example = seen[0][0][0]
    assert example["answer"] == str(int(example["question"].split()[2]) + 2)
    assert example["solution"].endswith(f"#### {example['answer']}")


def test_error_messages_name_key_and_file(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match=r"^data\.train_path: .*nope\.jsonl.* does not exist$"):
        make_task(DataConfig(task="gsm8k", train_path=missing), 0)
    with pytest.raises(ConfigError, match=r"^data\.val_path: .*nope\.jsonl"):
        make_task(DataConfig(task="arithmetic", val_path=missing), 0)
    with pytest.raises(ConfigError) as e:  # relative: read from the working folder, named
        make_task(DataConfig(task="gsm8k", train_path="no/such.jsonl"), 0)
    assert str(e.value) == (
        f"data.train_path: 'no/such.jsonl' does not exist in the working folder {os.getcwd()!r}"
    )
    with pytest.raises(ConfigError, match=r"^data\.train_path: task 'gsm8k' needs"):
        make_task(DataConfig(task="gsm8k"), 0)
    bad_field = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "1+1", "answer": "2"}] * 3)
    with pytest.raises(
        ConfigError, match=r"^data\.question_key: record 0 of .*q\.jsonl.* no field 'question'"
    ):
        make_task(DataConfig(task="gsm8k", train_path=bad_field), 0)
    make_task(DataConfig(task="gsm8k", train_path=bad_field, question_key="prompt"), 0)
    no_number = _write_jsonl(tmp_path / "a.jsonl", [{"question": "q", "answer": "lots"}] * 3)
    with pytest.raises(ConfigError, match=r"^data\.answer_key: record 0 of .*a\.jsonl"):
        make_task(DataConfig(task="gsm8k", train_path=no_number), 0)
    (tmp_path / "broken.jsonl").write_text('{"question": "q", "answer": "1"}\n{oops\n')
    with pytest.raises(
        ConfigError, match=r"^data\.train_path: .*broken\.jsonl.* line 2 is not valid JSON$"
    ):
        make_task(DataConfig(task="gsm8k", train_path=str(tmp_path / "broken.jsonl")), 0)
    (tmp_path / "d.txt").write_text("question,answer\n")
    with pytest.raises(ConfigError, match=r"^data\.train_path: unsupported format '\.txt'"):
        make_task(DataConfig(task="gsm8k", train_path=str(tmp_path / "d.txt")), 0)
    with pytest.raises(ConfigError, match=r"^data\.train_path: .* not an HF datasets folder"):
        make_task(DataConfig(task="gsm8k", train_path=str(tmp_path)), 0)
    countdown = _write_jsonl(tmp_path / "c.jsonl", [{"nums": [1, 2], "goal": 3}])
    with pytest.raises(ConfigError, match=r"countdown record 0 of .*c\.jsonl.* 'target'"):
        make_task(DataConfig(task="countdown", train_path=countdown), 0)


def _reward_cfg(specs, per_sample=True, **kw):
    fns = tuple(RewardFunctionConfig(function=s, weight=w, per_sample=per_sample) for s, w in specs)
    return DataConfig(task="arithmetic", reward_functions=fns, num_val_examples=4, **kw)


@pytest.mark.parametrize(
    "spec, per_sample, message",
    [
        (
            "no_such_module_xyz:fn",
            False,
            r"cannot import 'no_such_module_xyz:fn' \(ModuleNotFoundError",
        ),
        ("json:no_such_fn", False, r"cannot import 'json:no_such_fn' \(AttributeError"),
        ("json:decoder", False, r"'json:decoder' is not callable"),
        ("math:pi", True, r"'math:pi' is not callable"),
        ("os.path:join", True, None),
        ("json:dumps", True, r"'json:dumps' must accept \(prompt, completion, example\)"),
        ("os.path:join", False, r"'os.path:join' must accept prompts=, completions= and \*\*kw"),
        ("nomodule", False, r"'nomodule' must look like module:function"),
    ],
)
def test_reward_function_import_errors(spec, per_sample, message):
    cfg = _reward_cfg([(spec, 1.0)], per_sample=per_sample)
    if message is None:
        make_task(cfg, 0).close()
        return
    with pytest.raises(ConfigError, match=r"^data\.reward_functions\[0\]\.function: " + message):
        make_task(cfg, 0)


# ----------------------------------------------------------------------------- rewards


REWARDS_MODULE = textwrap.dedent(
    """
    import time

    def length(prompt, completion, example):
        return len(completion)

    def boom(prompt, completion, example):
        raise RuntimeError("reward bug")

    def sleep_forever(prompt, completion, example):
        time.sleep(10_000)

    def stubborn(prompt, completion, example):
        while True:
            try:
                time.sleep(10_000)
            except BaseException:
                pass

    def odd_only(prompt, completion, example):
        if int(example["answer"]) % 2 == 0:
            raise ValueError("even")
        return 0.5
    """
)


@pytest.fixture(scope="module")
def rewards_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rewards")
    (folder / "jgrpo_test_rewards.py").write_text(REWARDS_MODULE)
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(folder))
    yield "jgrpo_test_rewards"
    mp.undo()


def _batch(task, n):
    examples = task.train.next_prompts(n)
    completions = [
        task.reference_completion(e) if i % 2 == 0 else "wrong" for i, e in enumerate(examples)
    ]
    return [task.format_prompt(e) for e in examples], completions, examples


def test_custom_rewards_are_weighted(rewards_module):
    cfg = _reward_cfg([(f"{rewards_module}:length", 0.25)], task_reward_weight=2.0)
    task = make_task(cfg, 0)
    try:
        prompts, completions, examples = _batch(task, 6)
        rewards, info = task.score(prompts, completions, examples)
        expected = [2.0 * (i % 2 == 0) + 0.25 * len(c) for i, c in enumerate(completions)]
        np.testing.assert_allclose(rewards, expected, rtol=1e-6)
        assert rewards.dtype == np.float32 and rewards.shape == (6,)
        assert info["accuracy"] == 0.5 and info["correct"].tolist() == [True, False] * 3
        assert info["num_reward_errors"] == 0 and info["num_reward_timeouts"] == 0
        np.testing.assert_allclose(info["custom_rewards"][0], [len(c) for c in completions])
    finally:
        task.close()


def test_failing_and_hanging_rewards_score_zero_and_are_counted(rewards_module):
    m = rewards_module
    cfg = _reward_cfg(
        [
            (f"{m}:length", 1.0),
            (f"{m}:boom", 5.0),
            (f"{m}:sleep_forever", 5.0),
            (f"{m}:odd_only", 2.0),
        ],
        reward_timeout_s=0.5,
    )
    task = make_task(cfg, 0)
    try:
        prompts, completions, examples = _batch(task, 4)
        task.score(prompts, completions, examples)  # warm: the child process starts here
        start = time.monotonic()
        rewards, info = task.score(prompts, completions, examples)
        elapsed = time.monotonic() - start
        assert elapsed < 0.5 + 1.0, elapsed  # one timeout, not one per sample
        odd = [int(e["answer"]) % 2 == 1 for e in examples]
        expected = [
            (i % 2 == 0) + len(c) + 2.0 * 0.5 * o for i, (c, o) in enumerate(zip(completions, odd))
        ]
        np.testing.assert_allclose(rewards, expected, rtol=1e-6)
        assert info["num_reward_timeouts"] == 4
        assert info["num_reward_errors"] == 4 + odd.count(False)
        assert info["accuracy"] == 0.5
    finally:
        task.close()


def test_reward_that_ignores_the_alarm_is_killed(rewards_module):
    cfg = _reward_cfg(
        [(f"{rewards_module}:stubborn", 1.0), (f"{rewards_module}:length", 1.0)],
        reward_timeout_s=0.3,
    )
    start = time.monotonic()  # what a child's start costs on this machine now
    make_task(_reward_cfg([(f"{rewards_module}:length", 1.0)]), 0).close()
    restart_s = time.monotonic() - start
    task = make_task(cfg, 0)
    try:
        prompts, completions, examples = _batch(task, 3)
        start = time.monotonic()
        rewards, info = task.score(prompts, completions, examples)
        # one kill for the batch (timeout + kill slack) and one restart, not one per row
        assert time.monotonic() - start < 0.3 + 1.0 + 2 * restart_s + 0.5
        assert info["num_reward_timeouts"] == 3
        expected = [(i % 2 == 0) + len(c) for i, c in enumerate(completions)]
        np.testing.assert_allclose(rewards, expected, rtol=1e-6)
        rewards, info = task.score(prompts, completions, examples)  # a fresh child, same outcome
        assert info["num_reward_timeouts"] == 3
        np.testing.assert_allclose(rewards, expected, rtol=1e-6)
    finally:
        task.close()


def test_pickled_task_scores_without_data(rewards_module, tmp_path):
    train = _write_jsonl(tmp_path / "t.jsonl", GSM8K_RECORDS)
    cfg = DataConfig(
        task="gsm8k",
        train_path=train,
        reward_functions=(
            RewardFunctionConfig(function=f"{rewards_module}:length", weight=0.5, per_sample=True),
        ),
    )
    task = make_task(cfg, 0)
    clone = pickle.loads(pickle.dumps(task))
    try:
        examples = task.train.next_prompts(2)
        completions = ["#### " + examples[0]["answer"], "#### 0"]
        rewards, _ = clone.score(["p", "p"], completions, examples)
        np.testing.assert_allclose(
            rewards, [1 + 0.5 * len(completions[0]), 0.5 * len(completions[1])]
        )
        with pytest.raises(RuntimeError, match="without data"):
            clone.train.next_prompts(1)
    finally:
        clone.close()
        task.close()


# ----------------------------------------------------------------------------- batched rewards


BATCHED_MODULE = textwrap.dedent(
    """
    import json, os, sys, time

    def by_column(prompts, completions, completion_ids, bonus, **kwargs):
        with open(os.environ["JGRPO_TEST_CALLS"], "a") as fh:
            fh.write(json.dumps({"prompts": prompts, "completions": completions,
                                 "bonus": bonus, "ids": completion_ids,
                                 "other": sorted(kwargs)}) + "\\n")
        return [None if b is None else float(b) + len(c if isinstance(c, str) else
                c[0]["content"]) for b, c in zip(bonus, completions)]

    def raises(prompts, completions, **kwargs):
        raise RuntimeError("bug")

    def interrupt(prompts, completions, **kwargs):
        raise KeyboardInterrupt

    def wrong_length(prompts, completions, **kwargs):
        return [1.0]

    def hangs(prompts, completions, **kwargs):
        time.sleep(10_000)

    def all_none(prompts, completions, **kwargs):
        return [None] * len(prompts)
    """
)


@pytest.fixture(scope="module")
def batched_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batched")
    (folder / "jgrpo_test_batched.py").write_text(BATCHED_MODULE)
    (folder / "jgrpo_exits_at_import.py").write_text("import os\nos._exit(0)\n")
    (folder / "jgrpo_hangs_at_import.py").write_text("import time\ntime.sleep(10_000)\n")
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(folder))
    yield "jgrpo_test_batched"
    mp.undo()


PROMPT_RECORDS = [
    {"prompt": "plain 0", "bonus": 1.0, "tag": "a"},
    {"prompt": [{"role": "user", "content": "chat 1"}], "bonus": None, "tag": "b"},
    {"prompt": "plain 2", "bonus": 3.0, "tag": "c"},
    {
        "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "chat 3"}],
        "bonus": 4.0,
        "tag": "d",
    },
]


def _prompts_cfg(path, fns, **kw):
    rfs = tuple(RewardFunctionConfig(function=f, weight=w) for f, w in fns)
    return DataConfig(
        task="prompts", train_path=path, reward_functions=rfs, num_val_examples=1, **kw
    )


def test_prompts_task_batched_reward_sees_columns_per_row(
    batched_module, tmp_path, monkeypatch, chat_tokenizer
):
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("JGRPO_TEST_CALLS", str(calls))
    path = _write_jsonl(tmp_path / "p.jsonl", PROMPT_RECORDS)
    cfg = _prompts_cfg(
        path,
        [(f"{batched_module}:by_column", 0.5), (f"{batched_module}:all_none", 2.0)],
        shuffle=False,
    )
    task = make_task(cfg, 0)
    try:
        examples = task.train.next_prompts(3)  # records 0..3 minus the held-out one
        rows = [int(e["id"].split("/")[1]) for e in examples]
        texts = [task.format_prompt(e, chat_tokenizer) for e in examples]
        for e, text in zip(examples, texts):
            value = e["row"]["prompt"]
            if isinstance(value, str):  # verbatim by default (TRL); use_chat_template wraps it
                assert text == value
                wrapping = make_task(
                    dataclasses.replace(cfg, use_chat_template=True), 0, load_data=False
                )
                wrapped = wrapping.format_prompt(e, chat_tokenizer)
                assert wrapped == f"<|user|>{value}<|end|><|assistant|>"
            else:
                assert text.endswith(f"<|user|>{value[-1]['content']}<|end|><|assistant|>")
        completions = ["xy", "xyz", "x"]
        ids = [[5, 6], [5, 6, 7], [5]]
        rewards, info = task.score(texts, completions, examples, ids)
        lines = [json.loads(x) for x in calls.read_text().splitlines()]
        assert len(lines) == 1  # one call per function per batch
        (seen,) = lines
        assert seen["bonus"] == [PROMPT_RECORDS[r]["bonus"] for r in rows]
        assert seen["prompts"] == [PROMPT_RECORDS[r]["prompt"] for r in rows]
        assert seen["other"] == ["tag"] and seen["ids"] == ids
        for r, c in zip(rows, seen["completions"]):  # chat prompts get chat completions
            plain = isinstance(PROMPT_RECORDS[r]["prompt"], str)
            assert c == (
                completions[rows.index(r)]
                if plain
                else [{"role": "assistant", "content": completions[rows.index(r)]}]
            )
        bonus = [PROMPT_RECORDS[r]["bonus"] for r in rows]
        expected = [0.0 if b is None else 0.5 * (b + len(c)) for b, c in zip(bonus, completions)]
        np.testing.assert_allclose(rewards, expected)
        assert info["sample_mask"].tolist() == [b is not None for b in bonus]
        assert info["num_reward_none"] == 3 + bonus.count(None)  # all_none + by_column
        assert info["correct"] is None and info["accuracy"] is None
        terms = info["reward_terms"]
        assert np.isnan(terms[:, 1]).all()
        assert np.isnan(terms[:, 0]).tolist() == [b is None for b in bonus]
    finally:
        task.close()


def test_batched_reward_failures_are_contained(batched_module, tmp_path, capfd):
    path = _write_jsonl(tmp_path / "p.jsonl", [r for r in PROMPT_RECORDS if r["bonus"]] * 2)
    m = batched_module
    cfg = _prompts_cfg(
        path,
        [
            (f"{m}:raises", 1.0),
            (f"{m}:interrupt", 1.0),
            (f"{m}:wrong_length", 1.0),
            (f"{m}:hangs", 1.0),
        ],
        reward_timeout_s=0.5,
    )
    task = make_task(cfg, 0)
    try:
        examples = task.train.next_prompts(4)
        start = time.monotonic()
        rewards, info = task.score(["p"] * 4, ["c"] * 4, examples)
        assert time.monotonic() - start < 0.5 + 1.0
        assert rewards.tolist() == [0.0] * 4
        assert info["num_reward_errors"] == 12 and info["num_reward_timeouts"] == 4
        assert info["sample_mask"].all()  # errors score 0, they are not "no reward"
    finally:
        task.close()
    assert "Traceback" not in capfd.readouterr().err


def test_reward_given_as_a_python_function_is_pickled_to_the_child(tmp_path):
    offset = 0.25  # a closure over a local: only cloudpickle can send it

    def shout(prompts, completions, **columns):
        return [offset + c.count("!") for c in completions]

    plain = [{"prompt": f"p{i}"} for i in range(4)]
    task = make_task(_prompts_cfg(None, [(shout, 2.0)]), 0, train_dataset=plain)
    try:
        examples = task.train.next_prompts(2)
        rewards, _ = task.score(["p", "p"], ["a!!", "b"], examples)
        np.testing.assert_allclose(rewards, [2 * 2.25, 2 * 0.25])
        assert task.reward_names == ("shout",)
    finally:
        task.close()


def test_reward_module_that_exits_or_hangs_at_import_is_a_config_error(batched_module, tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", PROMPT_RECORDS)
    with pytest.raises(
        ConfigError,
        match=r"^data\.reward_functions\[1\]\.function: loading 'jgrpo_exits_at_import:f' "
        r"ended the reward process \(exit code 0\)",
    ):
        make_task(
            _prompts_cfg(path, [(f"{batched_module}:raises", 1), ("jgrpo_exits_at_import:f", 1)]),
            0,
        )
    start = time.monotonic()
    with pytest.raises(
        ConfigError,
        match=r"^data\.reward_functions\[0\]\.function: loading 'jgrpo_hangs_at_import:f' did "
        r"not finish within 0\.5 s$",
    ):
        make_task(
            _prompts_cfg(path, [("jgrpo_hangs_at_import:f", 1)], reward_import_timeout_s=0.5), 0
        )
    assert time.monotonic() - start < 0.5 + 1.0 + 5.0  # + the child's start


def test_null_prompts_and_questions_are_rejected_naming_the_record(tmp_path):
    records = [dict(r) for r in PROMPT_RECORDS]
    records[2]["prompt"] = None
    path = _write_jsonl(tmp_path / "p.jsonl", records)
    fn = "os.path:join"
    with pytest.raises(
        ConfigError, match=r"^data\.prompt_key: record 2 of .*p\.jsonl.* null 'prompt'"
    ):
        make_task(_prompts_cfg(path, [(fn, 1)]), 0)
    with pytest.raises(ConfigError, match=r"^data\.prompt_key: record 2 of train_dataset"):
        make_task(_prompts_cfg(None, [(fn, 1)]), 0, train_dataset=records)
    with pytest.raises(ConfigError, match=r"^data\.prompt_key: .* no column 'text'"):
        make_task(_prompts_cfg(path, [(fn, 1)], prompt_key="text"), 0)
    gsm = [dict(r) for r in GSM8K_RECORDS]
    gsm[1]["question"] = None
    path = _write_jsonl(tmp_path / "g.jsonl", gsm)
    with pytest.raises(ConfigError, match=r"^data\.question_key: record 1 of .* null 'question'"):
        make_task(DataConfig(task="gsm8k", train_path=path), 0)


def test_hf_dataset_id_from_the_local_cache(tmp_path, monkeypatch):
    # the hub cache layout: datasets--org--name/{refs/main, snapshots/<rev>/...}
    repo = tmp_path / "hub" / "datasets--someone--prompts"
    rev = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    data = repo / "snapshots" / rev / "data"
    data.mkdir(parents=True)
    datasets.Dataset.from_list(GSM8K_RECORDS).to_parquet(str(data / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(GSM8K_RECORDS[:3]).to_parquet(
        str(data / "test-00000-of-00001.parquet")
    )
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = DataConfig(task="gsm8k", train_path="someone/prompts", val_path="someone/prompts")
    task = make_task(cfg, 0)
    assert len(task.val) == 3 and task.val[0]["question"] == GSM8K_RECORDS[0]["question"]
    assert len(task.train.next_prompts(10)) == 10
    with pytest.raises(ConfigError, match=r"^data\.train_path: 'someone/other' is neither"):
        make_task(DataConfig(task="gsm8k", train_path="someone/other"), 0)


# ----------------------------------------------------------------------------- prompts


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(
        set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 +-*/=?#.,:()[]\n|<>")
    )
    vocab = {c: i for i, c in enumerate(["<unk>", "<eos>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def test_chat_template_prompts(chat_tokenizer):
    example = {"task": "arithmetic", "question": "12+34", "answer": "46", "id": "x"}
    task = make_task(DataConfig(task="arithmetic", system_prompt="Be brief."), 0, load_data=False)
    prompt = task.format_prompt(example, chat_tokenizer)
    assert prompt == (
        "<|system|>Be brief.<|end|><|user|>What is 12+34? Give the final answer as a number "
        "after ####.<|end|><|assistant|>"
    )
    task = make_task(DataConfig(task="countdown"), 0, load_data=False)
    example = {
        "task": "countdown",
        "question": "",
        "answer": "",
        "numbers": [3, 5, 2],
        "target": 16,
    }
    prompt = task.format_prompt(example, chat_tokenizer)
    assert prompt.startswith("<|user|>Using the numbers [3, 5, 2], each at most once")
    assert "equals 16. Give the final expression after ####." in prompt
    no_chat = make_task(DataConfig(task="arithmetic", use_chat_template=False), 0, load_data=False)
    assert no_chat.format_prompt({"question": "12+34"}, chat_tokenizer) == "12+34="


def test_bare_prompts_and_reference_completions(tmp_path):
    class NoTemplate:
        chat_template = None

    arithmetic = make_task(DataConfig(task="arithmetic"), 0, load_data=False)
    example = {"task": "arithmetic", "question": "12+34-5", "answer": "41"}
    assert arithmetic.format_prompt(example, NoTemplate()) == "12+34-5="
    assert arithmetic.format_prompt(example) == "12+34-5="
    assert arithmetic.reference_completion(example) == "41"

    countdown = make_task(DataConfig(task="countdown"), 0, load_data=False)
    example = {"task": "countdown", "numbers": [3, 5, 2], "target": 16, "answer": "(3+5)*2"}
    assert countdown.format_prompt(example) == "3,5,2:16="
    assert countdown.reference_completion(example) == "(3+5)*2"

    train = _write_jsonl(tmp_path / "t.jsonl", GSM8K_RECORDS)
    gsm8k = make_task(DataConfig(task="gsm8k", train_path=train, shuffle=False), 0)
    example = gsm8k.train.next_prompts(1)[0]
    assert gsm8k.format_prompt(example) == f"Q: {example['question']}\nA:"
    i = int(example["question"].split()[2])
    assert gsm8k.reference_completion(example) == f" {i}+2={i + 2}\n#### {i + 2}"
    assert gsm8k.verify(gsm8k.reference_completion(example), example)


def test_python_datasets_replace_the_paths(tmp_path):
    train = datasets.Dataset.from_list(GSM8K_RECORDS)
    val = GSM8K_RECORDS[:2]
    task = make_task(
        DataConfig(task="gsm8k", shuffle=False), 0, train_dataset=train, eval_dataset=val
    )
    assert [e["id"] for e in task.val] == ["val/0", "val/1"]
    assert [e["question"] for e in task.val] == [r["question"] for r in val]
    assert _ids(task.train.next_prompts(3)) == ["train/0", "train/1", "train/2"]
    with pytest.raises(ConfigError, match=r"^train_dataset: record 1 is a str, not a dict"):
        make_task(DataConfig(task="gsm8k"), 0, train_dataset=[GSM8K_RECORDS[0], "oops"])


# ----------------------------------------------------------------------------- validation split


def test_record_data_without_a_val_source_holds_nothing_out(tmp_path):
    """No data.val_path / eval_dataset / data.val_fraction: every record trains, none is
    validation (the old rule held out a silent split of up to half the records)."""
    path = _write_jsonl(tmp_path / "t.jsonl", GSM8K_RECORDS)
    for kwargs in ({"train_path": path}, {}):
        cfg = DataConfig(task="gsm8k", shuffle=False, **kwargs)
        dataset = None if kwargs else GSM8K_RECORDS
        task = make_task(cfg, 0, train_dataset=dataset)
        assert task.val == []
        assert _ids(task.train.next_prompts(10)) == [f"train/{i}" for i in range(10)]


@pytest.mark.parametrize("fraction, num_val", [(0.3, 3), (0.6, 6), (0.1, 1), (0.9, 9)])
def test_val_fraction_holds_out_exactly_that_fraction(fraction, num_val):
    cfg = DataConfig(task="gsm8k", val_fraction=fraction, shuffle=False)
    task = make_task(cfg, 0, train_dataset=GSM8K_RECORDS)
    val = _ids(task.val)
    train = _ids(task.train.next_prompts(10 - num_val))
    assert len(val) == num_val and len(set(train)) == 10 - num_val
    assert sorted(val + train, key=lambda i: int(i.split("/")[1])) == [
        f"train/{i}" for i in range(10)
    ]
    again = make_task(cfg, 5, train_dataset=GSM8K_RECORDS)  # the split ignores the run seed
    assert _ids(again.val) == val
    capped = make_task(
        DataConfig(task="gsm8k", val_fraction=fraction, num_val_examples=1),
        0,
        train_dataset=GSM8K_RECORDS,
    )
    assert len(capped.val) == 1 and len(capped.train.next_prompts(10 - num_val)) == 10 - num_val


def test_one_record_trains():
    task = make_task(DataConfig(task="gsm8k"), 0, train_dataset=GSM8K_RECORDS[:1])
    assert task.val == []
    assert _ids(task.train.next_prompts(3)) == ["train/0"] * 3


def test_val_fraction_errors(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", GSM8K_RECORDS)
    with pytest.raises(ConfigError, match=r"^data\.val_fraction: 0\.01 of 10 .* holds out 0"):
        make_task(DataConfig(task="gsm8k", val_fraction=0.01), 0, train_dataset=GSM8K_RECORDS)
    with pytest.raises(ConfigError, match=r"^data\.val_fraction: .*not both"):
        make_task(
            DataConfig(task="gsm8k", val_fraction=0.5),
            0,
            train_dataset=GSM8K_RECORDS,
            eval_dataset=GSM8K_RECORDS,
        )
    with pytest.raises(ConfigError, match=r"^data\.val_fraction: task 'arithmetic' generates"):
        make_task(DataConfig(task="arithmetic", val_fraction=0.5), 0)
    from jgrpo.config import Config, validate

    for data, message in [
        (DataConfig(val_fraction=1.0), r"^data\.val_fraction: must lie in \(0, 1\), got 1\.0$"),
        (DataConfig(val_fraction=0.2, val_path=path), r"^data\.val_fraction: .*not both$"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(Config(data=data))
