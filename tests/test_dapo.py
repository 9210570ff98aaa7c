"""DAPO: overlong shaping and filtering, dynamic sampling (hand-worked values, TRL's formula)."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from jgrpo import losses, sampling
from jgrpo.config import AdvantageConfig, ConfigError, RewardFunctionConfig, load_config
from jgrpo.rollout import dapo
from jgrpo.rollout.engine import RolloutEngine, load_tokenizer
from jgrpo.rollout.results import batch_stats

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
QUIET = ["grpo.val_at_start=false", "grpo.val_at_end=false", "logging.tensorboard=false"]


# ----------------------------------------------------------------------------- overlong


def test_overlong_penalty_hand_values():
    # Lmax 8, buffer 4: free up to 8 - 4 = 4 tokens, then -(L - 4) / 4 * penalty
    got = dapo.overlong_penalty([1, 4, 5, 6, 8], max_new_tokens=8, length=4, penalty=1.0)
    np.testing.assert_array_equal(got, np.float32([0.0, 0.0, -0.25, -0.5, -1.0]))
    got = dapo.overlong_penalty([7], max_new_tokens=8, length=4, penalty=0.5)
    np.testing.assert_array_equal(got, np.float32([-0.375]))


def _batch(rewards, group_ids, truncated, lengths):
    n = len(rewards)
    return {
        "input_ids": np.zeros((n, 3), np.int32),
        "rewards": np.float32(rewards),
        "group_ids": np.int32(group_ids),
        "sample_mask": np.ones(n, np.float32),
        "truncated": np.asarray(truncated, bool),
        "lengths": np.int32(lengths),
        "weight_version": np.zeros(n, np.int32),
    }


def test_shaping_keeps_the_unshaped_reward_and_filtering_keeps_truncated_rows_in_the_group():
    cfg = load_config(
        TINY,
        ["grpo.overlong_buffer={length: 4, penalty: 1.0}", "loss.overlong_filtering=true"],
    )
    b = _batch([1, 0, 0, 1], [0, 0, 1, 1], [True, False, False, False], [8, 6, 2, 3])
    dapo.shape_training_batch(b, cfg)
    np.testing.assert_array_equal(b["rewards_unshaped"], np.float32([1, 0, 0, 1]))
    np.testing.assert_array_equal(b["reward_overlong"], np.float32([-1, -0.5, 0, 0]))
    np.testing.assert_array_equal(b["rewards"], np.float32([0, -0.5, 0, 1]))
    np.testing.assert_array_equal(b["sample_mask"], np.float32([0, 1, 1, 1]))
    # the truncated row (sample_mask 0) still counts in its group: the group is {0, -0.5},
    # mean -0.25, Bessel std sqrt(0.125); row 1's advantage is -0.25 / (0.35355 + 1e-6)
    adv = np.asarray(
        losses.compute_advantages(b["rewards"], b["group_ids"], AdvantageConfig(), b["sample_mask"])
    )
    np.testing.assert_allclose(adv[1], -0.25 / (np.sqrt(0.125) + 1e-6), rtol=1e-6)
    assert adv[0] == 0.0
    stats = batch_stats(b)
    assert stats["length/truncation_rate"] == 0.25
    assert stats["reward/overlong/mean"] == -0.375
    # unshaped rewards: group 0 = {1, 0}, group 1 = {0, 1}: no group is all equal
    assert stats["batch/frac_reward_zero_std"] == 0.0


def test_frac_reward_zero_std_counts_groups_not_rows():
    b = _batch([1, 1, 1, 0, 0, 0, 2, 3, 2], [5, 5, 5, 7, 7, 7, 9, 9, 9], [False] * 9, [1] * 9)
    assert dapo.frac_zero_std(b) == pytest.approx(2 / 3)
    b["rewards_unshaped"] = np.float32([1, 0, 1, 0, 0, 0, 2, 2, 2])  # the filter reads these
    assert dapo.frac_zero_std(b) == pytest.approx(2 / 3)
    b["rewards_unshaped"][3] = 1
    assert dapo.frac_zero_std(b) == pytest.approx(1 / 3)


def trl_soft_overlong_punishment(max_completion_len, soft_punish_cache):
    """TRL's get_soft_overlong_punishment (trl/rewards/other_rewards.py, huggingface/trl at
    01f8dc59): the same three cases on len(completion_ids), transcribed."""

    def soft_overlong_punishment_reward(completion_ids, **kwargs):
        rewards = []
        for ids in completion_ids:
            n = len(ids)
            if n <= max_completion_len - soft_punish_cache:
                rewards.append(0.0)
            elif n <= max_completion_len:
                rewards.append((max_completion_len - soft_punish_cache - n) / soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards

    return soft_overlong_punishment_reward


def test_trl_soft_overlong_punishment_through_jgrpo_equals_the_overlong_term(monkeypatch):
    # TRL's completion_ids hold the EOS token; jgrpo's must too, so the TRL reward function
    # given as a custom reward equals grpo.overlong_buffer's term row by row
    from jgrpo.models.sources import resolve_model_path
    from jgrpo.tasks import make_task

    n = 8
    cfg = load_config(TINY, ["grpo.overlong_buffer={length: 6, penalty: 1.0}"])
    fn = trl_soft_overlong_punishment(max_completion_len=n, soft_punish_cache=6)
    rf = RewardFunctionConfig(function=fn)
    cfg = cfg.replace(data=dataclasses.replace(cfg.data, reward_functions=(rf,)))
    folder = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(folder)
    task = make_task(cfg.data, 0)
    try:
        engine = RolloutEngine(cfg, None, tokenizer, task)
        eos = tokenizer.eos_token_id
        lengths = np.int32([1, 2, 3, 5, 8, 8])
        truncated = np.asarray([False, False, False, False, False, True])
        tokens = np.full((6, n), 7, np.int32)
        for b, (length, cut) in enumerate(zip(lengths, truncated)):
            if not cut:
                tokens[b, length - 1] = eos
            tokens[b, length:] = tokenizer.pad_token_id
        gen = sampling.Generation(
            tokens=tokens,
            logprobs=np.zeros((6, n), np.float32),
            filtered_logprobs=np.zeros((6, n), np.float32),
            lengths=lengths,
            truncated=truncated,
            prompt_tokens=np.ones((6, 16), np.int32),
            prompt_lengths=np.full(6, 4, np.int32),
            num_decode_steps=n - 1,
        )
        monkeypatch.setattr(sampling, "generate", lambda *a, **k: gen)
        examples = task.train.next_prompts(3)
        result = engine.rollout(None, None, examples, None, 0, num_generations=2)
    finally:
        task.close()
    trl = result.batch["reward_terms"][:, 0]
    # hand values: (8 - 6 - L) / 6 for L > 2
    want = np.float32([0, 0, -1 / 6, -3 / 6, -1, -1])
    np.testing.assert_allclose(trl, want, rtol=1e-6)
    np.testing.assert_allclose(result.batch["reward_overlong"], trl, rtol=1e-6)


def test_dapo_config_errors():
    with pytest.raises(ConfigError, match="grpo.overlong_buffer.length: must lie in"):
        load_config(TINY, ["grpo.overlong_buffer={length: 9}"])
    with pytest.raises(ConfigError, match="grpo.overlong_buffer.length: required"):
        load_config(TINY, ["grpo.overlong_buffer={penalty: 1.0}"])
    with pytest.raises(ConfigError, match="grpo.batch_multiplier: > 1 needs"):
        load_config(TINY, ["grpo.batch_multiplier=2"])
    with pytest.raises(ConfigError, match="grpo.dynamic_sampling_filter: correct needs a task"):
        load_config(
            TINY,
            [
                "grpo.use_dynamic_sampling=true",
                "grpo.dynamic_sampling_filter=correct",
                "data.task=prompts",
            ],
        )


# ----------------------------------------------------------------------------- dynamic sampling


def _group_batch(rewards_by_group, width=3):
    rewards = [r for group in rewards_by_group for r in group]
    g = len(rewards_by_group[0])
    gids = [i for i in range(len(rewards_by_group)) for _ in range(g)]
    b = _batch(rewards, gids, [False] * len(rewards), [1] * len(rewards))
    b["input_ids"] = np.arange(len(rewards) * width, dtype=np.int32).reshape(-1, width)
    for key in ("attention_mask", "token_mask", "generation_logprobs"):
        b[key] = np.ones((len(rewards), width), np.float32)
    b["rewards_unshaped"] = b["rewards"].copy()
    return b


class _FakeBackend:
    """Generation batch j of the step scores its prompts from `script[j]` (one reward list per
    group); records what was requested."""

    def __init__(self, script):
        self.script, self.requests = script, []

    def request(self, step, examples, gen_batch=0):
        self.requests.append((step, gen_batch, list(examples)))

    def collect(self, step, gen_batch=0):
        from jgrpo.rollout import RolloutResult

        batch = _group_batch(self.script[gen_batch], width=3 + gen_batch)
        counts = dict.fromkeys(("reward/num_errors", "reward/num_timeouts", "reward/num_none"), 0)
        return RolloutResult(batch, batch_stats(batch) | counts, [], ())


class _FakeStream:
    def __init__(self):
        self.position = 0

    def next_prompts(self, n):
        self.position += n
        return list(range(self.position - n, self.position))


def _trainer(cfg, backend):
    from types import SimpleNamespace

    return SimpleNamespace(
        cfg=cfg,
        backend=backend,
        task=SimpleNamespace(train=_FakeStream()),
        setup=SimpleNamespace(mesh=None),  # one process: rows are selected without the mesh
    )


def test_all_equal_groups_draw_more_batches_and_only_informative_groups_are_trained():
    from jgrpo import train

    cfg = load_config(TINY, ["grpo.use_dynamic_sampling=true"])  # P = 4, G = 4
    flat, up = [1, 1, 1, 1], [0, 1, 0, 0]
    script = [
        [flat, flat, [0] * 4, [0.5] * 4],  # every group all equal
        [flat, up, flat, [0, 0, 2, 0]],  # 2 informative
        [[3, 1, 1, 1], flat, [1, 2, 3, 4], [5, 5, 5, 6]],  # 3 informative: 2 are used
    ]
    backend = _FakeBackend(script)
    t = _trainer(cfg, backend)
    first = backend.collect(0)
    result = train.collect_informative(t, 0, first)
    # the stream advanced by P prompts per extra generation batch (batch 0 was requested before)
    assert [(s, j, ex) for s, j, ex in backend.requests] == [
        (0, 1, [0, 1, 2, 3]),
        (0, 2, [4, 5, 6, 7]),
    ]
    b = result.batch
    np.testing.assert_array_equal(
        b["rewards"], np.float32([*up, 0, 0, 2, 0, 3, 1, 1, 1, 1, 2, 3, 4])
    )
    np.testing.assert_array_equal(b["group_ids"], np.repeat(np.arange(4), 4))
    assert b["input_ids"].shape == (16, 5)  # left-padded to the widest generation batch
    # group 1 of batch 1 (width 4): one pad column on the left
    np.testing.assert_array_equal(b["input_ids"][:4, 0], 0)
    np.testing.assert_array_equal(b["input_ids"][:4, 1:], np.arange(64).reshape(16, 4)[4:8])
    assert result.stats["dynamic_sampling/gen_batches"] == 3
    assert result.stats["dynamic_sampling/kept_groups"] == 4
    # before filtering: 12 groups generated, 7 all equal
    assert result.stats["batch/frac_reward_zero_std"] == pytest.approx(7 / 12)


def test_dynamic_sampling_past_max_gen_batches_pads_or_raises(caplog):
    from jgrpo import train

    flat = [1, 1, 1, 1]
    script = [[flat, [0, 1, 0, 0], flat, flat], [flat] * 4]
    cfg = load_config(
        TINY, ["grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=2"]
    )
    backend = _FakeBackend(script)
    with caplog.at_level("WARNING", logger="jgrpo"):
        result = train.collect_informative(_trainer(cfg, backend), 0, backend.collect(0))
    assert [r.getMessage() for r in caplog.records] == [
        "dynamic sampling: step 1 has 1 informative groups of 4 after "
        "grpo.dynamic_sampling_max_gen_batches = 2 generation batches; training on those (the "
        "rest are padding rows)"
    ]
    b = result.batch
    np.testing.assert_array_equal(b["group_ids"], [0] * 4 + [-1] * 12)
    np.testing.assert_array_equal(b["sample_mask"], [1] * 4 + [0] * 12)
    assert result.stats["dynamic_sampling/kept_groups"] == 1
    cfg = load_config(
        TINY,
        [
            "grpo.use_dynamic_sampling=true",
            *[
                "grpo.dynamic_sampling_max_gen_batches=2",
                "grpo.dynamic_sampling_on_exhausted=raise",
            ],
        ],
    )
    backend = _FakeBackend(script)
    with pytest.raises(train.RunStopped, match="step 1 has 1 informative groups of 4"):
        train.collect_informative(_trainer(cfg, backend), 0, backend.collect(0))


REWARD_MODULE = """
import zlib

def coin(prompts, completions, **columns):
    # half the prompts score every completion 0 (an all-equal group), the others vary
    return [0.0 if zlib.crc32(p.encode()) % 2 else float(zlib.crc32(c.encode()) % 3)
            for p, c in zip(prompts, completions)]
"""


@pytest.fixture
def install_module(tmp_path, monkeypatch):
    """install(name, source): a module importable here and in the reward process (and workers)."""

    def install(name, source):
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))

    return install


@pytest.fixture
def coin_reward(install_module):
    """REWARD_MODULE importable as `coin_reward`."""
    install_module("coin_reward", REWARD_MODULE)


def test_dynamic_sampling_trains_no_all_equal_group_and_resume_repeats_the_run(
    tmp_path, coin_reward
):
    from jgrpo import train
    from jgrpo.metrics import read_metrics

    overrides = [
        *QUIET,
        "grpo.use_dynamic_sampling=true",
        "data.task_reward_weight=0.0",
        "data.reward_functions=[{function: 'coin_reward:coin'}]",
        "checkpoint.save_period=1",
    ]
    full, broken = tmp_path / "full", tmp_path / "broken"
    train.run(load_config(TINY, [*overrides, "grpo.max_num_steps=2"]), full)
    train.run(load_config(TINY, [*overrides, "grpo.max_num_steps=1"]), broken)
    train.run(load_config(TINY, [*overrides, "grpo.max_num_steps=2"]), broken, resume=True)
    rows = read_metrics(full)
    assert [r["step"] for r in rows] == [1, 2]
    assert max(r["dynamic_sampling/gen_batches"] for r in rows) > 1
    for r in rows:
        assert r["dynamic_sampling/kept_groups"] == 4
        assert r["reward/frac_groups_all_equal"] == 0.0  # what the step trained on
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rs]
    assert strip(read_metrics(broken)) == strip(rows)


def test_batch_multiplier_draws_more_prompts_per_generation_batch():
    from jgrpo import train

    cfg = load_config(TINY, ["grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=1.5"])
    assert cfg.grpo.gen_prompts_per_batch == 6  # ceil(4 x 1.5)
    flat, up = [1, 1, 1, 1], [0, 1, 0, 0]
    script = [[flat, up, flat, flat, up, flat], [up, flat, up, up, flat, flat]]
    backend = _FakeBackend(script)
    result = train.collect_informative(_trainer(cfg, backend), 0, backend.collect(0))
    assert [(j, ex) for _, j, ex in backend.requests] == [(1, [0, 1, 2, 3, 4, 5])]
    assert result.stats["dynamic_sampling/kept_groups"] == 4
    np.testing.assert_array_equal(result.batch["rewards"], np.float32(up * 4))
    assert result.stats["batch/frac_reward_zero_std"] == pytest.approx(7 / 12)


@pytest.mark.slow
@pytest.mark.heavy  # in make test: the local dynamic-sampling tests
def test_dynamic_sampling_on_ray_workers_matches_the_local_backend(tmp_path, coin_reward):
    from jgrpo import train
    from jgrpo.metrics import read_metrics

    overrides = [
        *QUIET,
        "grpo.max_num_steps=2",
        "grpo.use_dynamic_sampling=true",
        "data.task_reward_weight=0.0",
        "data.reward_functions=[{function: 'coin_reward:coin'}]",
    ]
    train.run(load_config(TINY, overrides), tmp_path / "local")
    ray_overrides = [*overrides, "rollout.backend=ray", "rollout.num_workers=1"]
    train.run(load_config(TINY, ray_overrides), tmp_path / "ray")
    keys = ("dynamic_sampling/", "reward/", "length/", "batch/", "loss/")
    pick = lambda rows: [{k: v for k, v in r.items() if k.startswith(keys)} for r in rows]
    local, ray = pick(read_metrics(tmp_path / "local")), pick(read_metrics(tmp_path / "ray"))
    assert max(r["dynamic_sampling/gen_batches"] for r in local) > 1
    assert ray == local


def test_a_resume_draws_each_pending_step_where_the_run_drew_it():
    """Async (k = 1) with dynamic sampling: step s + 1 is requested before step s draws its
    extra prompts, so the stream interleaves them; the checkpoint keeps each requested step's
    position, and a resume requests the same prompts, then continues where the run was."""
    from types import SimpleNamespace

    from jgrpo import train
    from jgrpo.tasks.data import RecordStream

    def stream():
        return RecordStream([{"id": i} for i in range(7)], seed=3, shuffle=True)

    run, saved = stream(), {}
    t = SimpleNamespace(
        cfg=load_config(TINY),
        state=None,
        task=SimpleNamespace(train=run),
        checkpointer=SimpleNamespace(save=lambda step, state, meta: saved.update(meta)),
    )
    draws, states, asked = train.DataDraws(), {}, {}
    for s in (0, 1):  # the first requests: steps 0 .. k
        states[s], asked[s] = draws.draw(run, s, 2)
    draws.done(run)
    extras = {0: [run.next_prompts(2)]}  # step 0 draws one more generation batch
    states[2], asked[2] = run.state(), run.next_prompts(2)  # then requests step 2
    extras[1] = [run.next_prompts(2), run.next_prompts(2)]  # step 1 draws two more
    states[3], asked[3] = run.state(), run.next_prompts(2)  # then requests step 3
    train.save_checkpoint(t, 2, states)  # steps 0 and 1 trained
    extras[2] = [run.next_prompts(2)]  # the uninterrupted run goes on
    assert sorted(saved["data_pending"]) == ["2", "3"]

    resumed = stream()
    resumed.restore(saved["data_state"])
    draws = train.DataDraws.from_meta(json.loads(json.dumps(saved)))
    for s in (2, 3):
        assert draws.draw(resumed, s, 2)[1] == asked[s]
    draws.done(resumed)
    assert resumed.next_prompts(2) == extras[2][0]


ALTERNATING_MODULE = """
import zlib

def alternate(prompts, completions, **columns):
    # prompts with an odd crc score all their completions 0 (an all-equal group); the others
    # score 0, 1, 0, 1 by row (a group's rows are consecutive): which groups are informative
    # depends on the prompts alone, not on the weights that generated them
    return [0.0 if zlib.crc32(p.encode()) % 2 else float(i % 2) for i, p in enumerate(prompts)]
"""


class RecordRequests:
    """Wraps a backend: records every request (step, generation batch, example ids); raises a
    RolloutFailure when asked to collect `fail_at`, as a run past its worker failures does."""

    def __init__(self, inner, log, fail_at=None):
        self.inner, self.log, self.fail_at = inner, log, fail_at

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def request(self, step, examples, gen_batch=0):
        self.log[step, gen_batch] = [e["id"] for e in examples]
        self.inner.request(step, examples, gen_batch=gen_batch)

    def collect(self, step, gen_batch=0):
        from jgrpo.rollout import RolloutFailure

        if (step, gen_batch) == self.fail_at:
            raise RolloutFailure("worker lost (test)")
        return self.inner.collect(step, gen_batch=gen_batch)


@pytest.mark.slow
@pytest.mark.heavy  # in make test: test_a_resume_draws_each_pending_step_where_the_run_drew_it
def test_async_dynamic_sampling_on_ray_resumes_with_the_same_prompts(
    tmp_path, monkeypatch, install_module, ray_cluster
):
    """rollout.max_staleness 1: a run stopped at step 4 (a checkpoint of 3 steps, steps 3 and 4
    requested) and resumed requests every later generation batch with the prompts of the
    uninterrupted run. (The weights of the batches in flight differ after an async resume:
    the checkpoint holds only the newest; the rewards here do not depend on them.)"""
    from jgrpo import train
    from jgrpo.metrics import read_metrics

    install_module("alternating", ALTERNATING_MODULE)
    overrides = [
        *QUIET,
        "grpo.max_num_steps=6",
        "grpo.use_dynamic_sampling=true",
        "data.task_reward_weight=0.0",
        "data.reward_functions=[{function: 'alternating:alternate'}]",
        "rollout.backend=ray",
        "rollout.num_workers=1",
        "rollout.max_staleness=1",
        "loss.use_importance_sampling_correction=true",
        "checkpoint.save_period=1",
    ]
    real, logs = train.make_backend, {}

    def run(name, run_dir, fail_at=None, resume=False):
        log = logs.setdefault(name, {})
        monkeypatch.setattr(
            train, "make_backend", lambda *a: RecordRequests(real(*a), log, fail_at)
        )
        train.run(load_config(TINY, overrides), tmp_path / run_dir, resume=resume)

    run("full", "full")
    with pytest.raises(train.RunStopped, match="checkpoint saved at step 3"):
        run("stopped", "broken", fail_at=(3, 0))
    run("resumed", "broken", resume=True)
    full = logs["full"]
    assert max(j for _, j in full) >= 1  # extra generation batches were drawn
    assert {k for k in logs["stopped"] if k[0] >= 3} == {(3, 0), (4, 0)}  # in flight
    # every (step, generation batch) from step 3 on is drawn with the run's prompts
    assert logs["resumed"] == {k: v for k, v in full.items() if k[0] >= 3}
    rows = read_metrics(tmp_path / "full")
    assert [r["dynamic_sampling/gen_batches"] for r in read_metrics(tmp_path / "broken")] == [
        r["dynamic_sampling/gen_batches"] for r in rows
    ]
    for r in rows:
        assert r["dynamic_sampling/kept_groups"] == 4
        assert r["reward/frac_groups_all_equal"] == 0.0
        assert r["rollout/staleness_max"] <= 1
