"""Reward models (jgrpo.models.reward_model): parity with transformers' sequence-classification
forward, batching independence, a training run that mixes a reward model with a function, and
the bad inputs the pre-flight refuses."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import build_reward_model, xla_flags

from jgrpo import cli, train
from jgrpo.config import load_config
from jgrpo.metrics import read_metrics

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
QUIET = ["grpo.val_at_start=false", "grpo.val_at_end=false", "logging.tensorboard=false"]


def hf_scores(folder, prompts, completions):
    """TRL's reward-model scoring with transformers' PyTorch forward (the reference)."""
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(folder), dtype=torch.float32
    ).eval()
    model.config.pad_token_id = tok.pad_token_id
    texts = []
    for p, c in zip(prompts, completions):
        if isinstance(p, str):
            texts.append(p + c)
        else:
            texts.append(tok.apply_chat_template(p + c, tokenize=False))
    enc = tok(
        texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
    )
    with torch.no_grad():
        return model(**enc).logits[:, 0].double().numpy()


STRING_PROMPTS = ["What is 2+3? ", "Say hi.", "x" * 40, "Tell me a long story about ducks: "]
STRING_COMPLETIONS = ["5", "hi there", "y", "Once upon a time " * 5]
CHAT_PROMPTS = [
    [{"role": "user", "content": "2+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    [{"role": "user", "content": "Count to ten"}],
]
CHAT_COMPLETIONS = [
    [{"role": "assistant", "content": "5"}],
    [{"role": "assistant", "content": "Hi."}],
    [{"role": "assistant", "content": "1 2 3 4 5 6 7 8 9 10"}],
]


@pytest.mark.parametrize(
    "family, pad",
    # without a pad token: llama (transformers' Qwen2Tokenizer adds its own <|endoftext|>)
    [("llama", True), ("qwen2", True), ("qwen3", True), ("llama", False)],
)
def test_scores_match_transformers(tmp_path, family, pad):
    from jgrpo.models.reward_model import RewardModel

    folder = build_reward_model(tmp_path / "rm", family, pad=pad)
    rm = RewardModel(folder, dtype="float32", batch_tokens=256)
    for prompts, completions in [
        (STRING_PROMPTS, STRING_COMPLETIONS),
        (CHAT_PROMPTS, CHAT_COMPLETIONS),
    ]:
        ours = rm.score(prompts, completions)
        want = hf_scores(folder, prompts, completions)
        assert np.std(want) > 0.05  # the texts score differently: the check is not trivial
        np.testing.assert_allclose(ours, want, rtol=0, atol=1e-4)
    # the chat text ends in <eos>: with eos as pad the score is read before it, as in HF
    ids = rm.encode(CHAT_PROMPTS, CHAT_COMPLETIONS)
    assert all(row[-1] == 1 for row in ids)
    assert len(rm.batches([len(r) for r in rm.encode(STRING_PROMPTS, STRING_COMPLETIONS)])) > 1


def test_a_score_does_not_depend_on_its_batch(tmp_path):
    """Split by the token budget in any order (and padded to other shapes), a text scores the
    same; the budget holds for every batch."""
    from jgrpo.models.reward_model import RewardModel

    folder = build_reward_model(tmp_path / "rm", "qwen3")
    rng = np.random.default_rng(0)
    prompts = ["".join(rng.choice(list("abcdefgh "), rng.integers(1, 90))) for _ in range(13)]
    completions = ["".join(rng.choice(list("xyz"), rng.integers(1, 30))) for _ in range(13)]
    alone = RewardModel(folder, batch_tokens=128)  # every row in its own batch or nearly
    ids = alone.encode(prompts, completions)
    single = np.array([alone.score_ids([row])[0] for row in ids])
    for budget in (128, 512, 4096):
        rm = RewardModel(folder, batch_tokens=budget)
        batches = rm.batches([len(r) for r in ids])
        assert all(rows * width <= budget for _, rows, width in batches)
        assert sorted(i for take, _, _ in batches for i in take) == list(range(len(ids)))
        perm = rng.permutation(len(ids))
        scores = rm.score_ids([ids[i] for i in perm])
        np.testing.assert_allclose(scores, single[perm], rtol=0, atol=1e-5)
    np.testing.assert_allclose(single, hf_scores(folder, prompts, completions), atol=1e-4)


def test_scores_on_a_2x2x2_mesh_equal_one_device(tmp_path):
    import jax

    from jgrpo import sharding
    from jgrpo.config import MeshConfig
    from jgrpo.models.reward_model import RewardModel

    folder = build_reward_model(tmp_path / "rm", "qwen2")
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    one = RewardModel(folder, batch_tokens=256)
    many = RewardModel(folder, batch_tokens=256, mesh=mesh, rules=sharding.DEFAULT_RULES)
    assert len(jax.tree.leaves(many.params)[0].sharding.device_set) == 8
    assert many.bytes_per_device() < one.bytes_per_device()
    np.testing.assert_allclose(
        many.score(STRING_PROMPTS, STRING_COMPLETIONS),
        one.score(STRING_PROMPTS, STRING_COMPLETIONS),
        rtol=0,
        atol=1e-5,
    )


def test_the_forwards_run_while_the_verifier_and_functions_do(tmp_path, monkeypatch):
    """Task.score starts the reward models' forwards first, runs the reward functions (the
    child process) meanwhile and collects the scores last: device and host work overlap."""
    import time

    from jgrpo.tasks import make_task

    stamp = tmp_path / "called"
    (tmp_path / "stamp_reward.py").write_text(
        "import time\n"
        "def stamp(prompts, completions, **columns):\n"
        f"    open({str(stamp)!r}, 'w').write(repr(time.time()))\n"
        "    return [0.5] * len(prompts)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    events = {}

    class Pending:
        def result(self):
            events["result"] = time.time()
            return np.arange(4.0)

    class Model:
        def dispatch(self, prompts, completions):
            events["dispatch"] = time.time()
            return Pending()

    terms = f"data.reward_functions=[{{function: 'stamp_reward:stamp'}}, {{model: '{tmp_path}'}}]"
    data = load_config(TINY, [terms]).data
    task = make_task(data, 0, load_data=False)
    task.attach_reward_models({1: Model()})
    examples = make_task(load_config(TINY, []).data, 0).val[:4]
    try:
        rewards, info = task.score(["1+1="] * 4, ["2", "3", "x", ""], examples)
    finally:
        task.close()
    assert events["dispatch"] < float(stamp.read_text()) < events["result"]
    np.testing.assert_array_equal(info["reward_terms"][:, 1], np.arange(4.0))
    want = info["correct"] + 0.5 + np.arange(4.0)  # verifier + function + model, weights 1
    np.testing.assert_allclose(rewards, want)


def _run_overrides(rm_folder, tmp_path, monkeypatch):
    (tmp_path / "brevity_reward.py").write_text(
        "def short(prompts, completions, **columns):\n"
        "    return [-len(c) / 8.0 for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return [
        *QUIET,
        "grpo.max_num_steps=2",
        "data.task_reward_weight=0.0",
        f"data.reward_functions=[{{model: '{rm_folder}', weight: 2.0, batch_tokens: 256, "
        "name: judge}, {function: 'brevity_reward:short', weight: 0.5}]",
    ]


def test_training_with_a_reward_model_and_a_function(tmp_path, monkeypatch):
    folder = build_reward_model(tmp_path / "rm", "qwen2")
    overrides = _run_overrides(folder, tmp_path, monkeypatch)
    train.run(load_config(TINY, overrides), tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2
    for r in rows:
        assert r["reward/judge/mean"] is not None and np.isfinite(r["reward/judge/mean"])
        assert r["reward/short/mean"] is not None
        assert r["perf/reward_model_s"] > 0
        assert r["reward/frac_groups_all_equal"] < 1.0  # nonzero advantages
        assert r["train/grad_norm"] > 1e-4
        # the total is the weighted sum of the two terms (no verifier)
        want = 2.0 * r["reward/judge/mean"] + 0.5 * r["reward/short/mean"]
        assert r["reward/mean"] == pytest.approx(want, rel=1e-4, abs=1e-5)

    # resume is exact: 1 step, then resume to 2, equals the 2-step run
    part = tmp_path / "part"
    saving = [*overrides, "checkpoint.save_period=1"]
    train.run(load_config(TINY, [*saving, "grpo.max_num_steps=1"]), part)
    train.run(load_config(TINY, saving), part, resume=True)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]  # noqa: E731
    assert strip(read_metrics(part)) == strip(rows)


@pytest.mark.heavy  # in make test: test_scores_on_a_2x2x2_mesh_equal_one_device
def test_training_on_a_2x2x2_mesh_matches_one_device(tmp_path, monkeypatch):
    """Two steps with a reward model and a function reward: on one device (a `jgrpo train`
    subprocess that sees one CPU device) and on a 2x2x2 mesh (this process's 8)."""
    import os
    import subprocess
    import sys

    folder = build_reward_model(tmp_path / "rm", "qwen2")
    overrides = _run_overrides(folder, tmp_path, monkeypatch)
    root = Path(TINY).parents[1]
    env = os.environ | {
        "XLA_FLAGS": xla_flags(1),
        "PYTHONPATH": os.pathsep.join([str(root), str(tmp_path)]),
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
    }
    one = subprocess.Popen(
        [sys.executable, "-m", "jgrpo.cli", "train", "--config", TINY, "--run-dir"]
        + [str(tmp_path / "one"), *overrides, "mesh.data=1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    train.run(load_config(TINY, [*overrides, *mesh]), tmp_path / "mesh")
    out, _ = one.communicate(timeout=900)
    assert one.returncode == 0, out[-3000:]
    rows, want = read_metrics(tmp_path / "mesh"), read_metrics(tmp_path / "one")
    assert [r["step"] for r in rows] == [r["step"] for r in want] == [1, 2]
    for m, w in zip(rows, want):
        assert w["train/grad_norm"] > 1e-3  # nonzero advantages: not trivially equal
        for key in ("reward/judge/mean", "reward/short/mean", "reward/mean", "advantage/std"):
            assert m[key] == pytest.approx(w[key], abs=1e-5), key
        assert m["loss/total"] == pytest.approx(w["loss/total"], rel=1e-4, abs=1e-6)
        assert m["train/grad_norm"] == pytest.approx(w["train/grad_norm"], rel=1e-4)


def test_inspect_step_counts_the_reward_model(tmp_path):
    from jgrpo.inspect_step import inspect_step

    folder = build_reward_model(tmp_path / "rm", "qwen3")
    base = load_config(TINY, [])
    cfg_overrides = [f"data.reward_functions=[{{model: '{folder}'}}]"]
    cfg = load_config(TINY, cfg_overrides)
    got = inspect_step(cfg, compile=False)["reward_model_bytes_per_device"]
    assert inspect_step(base, compile=False)["reward_model_bytes_per_device"] == 0
    # tied decoder (no LM head) + score [d], float32, replicated over the data axis
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder))
    assert got == 4 * sum(p.numel() for p in hf.parameters())
    # rollout.backend=ray: the whole model on each worker's device, none on the trainer's
    ray = inspect_step(load_config(TINY, [*cfg_overrides, "rollout.backend=ray"]), compile=False)
    assert ray["reward_model_bytes_per_device"] == 0
    assert ray["reward_model_bytes_per_worker"] == got


def _bad(tmp_path, capsys, overrides):
    capsys.readouterr()  # what building the test's models printed
    code = cli.main(["train", "--config", TINY, "--run-dir", str(tmp_path / "run"), *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()
    return err


def test_bad_reward_models_exit_2_with_one_line(tmp_path, capsys):
    from jgrpo.models.sources import tiny_qwen2_folder

    rf = "data.reward_functions"
    # a causal LM, not a classifier
    err = _bad(tmp_path, capsys, [f"{rf}=[{{model: '{tiny_qwen2_folder()}'}}]"])
    assert f"{rf}[0].model" in err and "not a sequence-classification model" in err
    # architectures claim a classifier but there is no score.weight
    fake = tmp_path / "fake"
    fake.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (fake / name).write_bytes((tiny_qwen2_folder() / name).read_bytes())
    hf = json.loads((tiny_qwen2_folder() / "config.json").read_text())
    hf["architectures"] = ["Qwen2ForSequenceClassification"]
    (fake / "config.json").write_text(json.dumps(hf))
    err = _bad(tmp_path, capsys, [f"{rf}=[{{model: '{fake}'}}]"])
    assert "no score.weight" in err
    # two labels
    two = build_reward_model(tmp_path / "two", "llama", num_labels=2)
    err = _bad(tmp_path, capsys, [f"{rf}=[{{function: 'a:b'}}, {{model: '{two}'}}]"])
    assert f"{rf}[1].model" in err and "num_labels 2" in err
    # longer than the model allows
    ok = build_reward_model(tmp_path / "ok", "qwen3", max_pos=64)
    err = _bad(tmp_path, capsys, [f"{rf}=[{{model: '{ok}', max_length: 128}}]"])
    assert f"{rf}[0].max_length" in err and "max_position_embeddings 64" in err
    # neither or both of function / model
    err = _bad(tmp_path, capsys, [f"{rf}=[{{weight: 1.0}}]"])
    assert "exactly one of function" in err


def test_python_api_takes_a_model_path_among_reward_funcs(tmp_path):
    from jgrpo.api import build_config

    folder = build_reward_model(tmp_path / "rm", "qwen2")

    def mine(prompts, completions, **kw):
        return [0.0] * len(prompts)

    cfg = build_config(TINY, reward_funcs=[str(folder), (mine, 0.5), "m:f"])
    terms = cfg.data.reward_functions
    assert terms[0].model == str(folder) and terms[0].function is None
    assert terms[1].function is mine and terms[1].weight == 0.5
    assert terms[2].function == "m:f" and terms[2].model is None
    assert terms[0].label == "rm"
