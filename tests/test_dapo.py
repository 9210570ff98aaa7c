"""DAPO: overlong shaping and filtering, dynamic sampling (hand-worked values, TRL's formula)."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from jgrpo import losses, sampling
from jgrpo.config import AdvantageConfig, ConfigError, RewardFunctionConfig, load_config
from jgrpo.rollout import dapo
from jgrpo.rollout.engine import RolloutEngine, batch_stats, load_tokenizer

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
    assert stats["completions/clipped_ratio"] == 0.25
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
    with pytest.raises(ConfigError, match="grpo.use_dynamic_sampling: needs rollout.max_stal"):
        load_config(
            TINY,
            [
                "grpo.use_dynamic_sampling=true",
                "rollout.backend=ray",
                "rollout.max_staleness=1",
                "loss.use_importance_sampling_correction=true",
            ],
        )
