"""rollout.kv_cache_dtype: the sampler's KV cache stored narrower than the compute dtype.

A float32 model samples with a float32 (default), bfloat16 and float8_e4m3fn cache; each
generation's logprobs are scored by the float32 training forward (an independent full forward,
no cache). The default is exact to float32 rounding; a narrower cache costs what its rounding
costs (token_mult_prob_error measured in docs/long-context.md), and its bytes shrink with it."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from conftest import with_kernels
from test_sampling import make_prompts, token_logprobs, token_mult_prob_error, trainer_logits

from jgrpo.config import ConfigError, load_config
from jgrpo.models import kernels, load_policy
from jgrpo.sampling import KV_CACHE_DTYPES, SamplingParams, generate, kv_cache_bytes


@pytest.fixture(scope="module")
def tiny():
    from jgrpo.config import ModelConfig

    return load_policy(ModelConfig(path="builtin:tiny-qwen2", compute_dtype="float32"))


@pytest.mark.parametrize("kernels_path", ["cpu", pytest.param("portable", marks=pytest.mark.heavy)])
def test_narrow_kv_cache_costs_only_its_rounding(tiny, kernels_path):
    model = with_kernels(tiny, kernels_path)
    assert model.cfg.jnp_dtype == jnp.float32
    prompts = make_prompts([20, 37, 9, 50], seed=3)
    errors = {}
    for dtype in (None, "bfloat16", "float8_e4m3fn"):
        params = SamplingParams(
            max_new_tokens=24, temperature=1.0, prompt_bucket=16, ignore_eos=True,
            kv_cache_dtype=dtype,
        )  # fmt: skip
        gen = generate(model, prompts, params, jax.random.key(3))
        logits, mask = trainer_logits(model, gen)
        lo = token_logprobs(logits, gen.tokens)
        errors[dtype] = token_mult_prob_error(gen.logprobs, lo, mask)
    # the default cache is the float32 compute dtype: the forward's logprobs to rounding
    assert errors[None] <= 1.00001, errors
    # bfloat16 (8 mantissa bits) then float8 (3): each measurably worse, neither far off
    assert 1.0002 < errors["bfloat16"] < 1.01 < errors["float8_e4m3fn"] < 1.1, errors


def test_kv_cache_bytes_follow_the_dtype_and_the_cast_is_the_store(tiny):
    base = SamplingParams(max_new_tokens=32, prompt_bucket=16)
    size = {
        d: kv_cache_bytes(tiny.cfg, 8, 16, dataclasses.replace(base, kv_cache_dtype=d))
        for d in (None, *KV_CACHE_DTYPES)
    }
    assert size[None] == size["float32"] == 2 * size["bfloat16"] == 4 * size["float8_e4m3fn"]
    cache = kernels.cache_in((jnp.ones((2, 3), jnp.float32),), "bfloat16")
    assert cache[0].dtype == jnp.bfloat16
    assert kernels.cache_in(cache, None) is cache


def test_config_rejects_an_unknown_kv_cache_dtype():
    assert load_config(None, ["rollout.kv_cache_dtype=bfloat16"]).rollout.kv_cache_dtype
    with pytest.raises(ConfigError, match="rollout.kv_cache_dtype: must be one of float32"):
        load_config(None, ["rollout.kv_cache_dtype=float16"])
    # the config's list is the sampler's (config does not import the sampler)
    with pytest.raises(ConfigError, match=", ".join(KV_CACHE_DTYPES)):
        load_config(None, ["rollout.kv_cache_dtype=int8"])


def test_the_run_config_reaches_the_sampler():
    rollout = load_config(None, ["rollout.kv_cache_dtype=float8_e4m3fn"]).rollout
    params = SamplingParams.from_rollout_config(rollout)
    assert params.kv_cache_dtype == "float8_e4m3fn"
    assert SamplingParams.from_rollout_config(load_config(None).rollout).kv_cache_dtype is None


@pytest.mark.heavy
def test_decode_slots_store_the_narrow_cache_too(tiny):
    """The slot loop (prompts prefilled one at a time into slots) rounds the cache the same way:
    its logprobs cost what the one-batch loop's cost, against the same float32 forward."""
    prompts = make_prompts([20, 37, 9, 50], seed=3)
    for slots, dtype, low, high in ((2, "bfloat16", 1.0002, 1.01), (2, None, 1.0, 1.00001)):
        params = SamplingParams(
            max_new_tokens=24, temperature=1.0, prompt_bucket=16, ignore_eos=True,
            kv_cache_dtype=dtype, decode_slots=slots,
        )  # fmt: skip
        gen = generate(tiny, prompts, params, jax.random.key(3))
        logits, mask = trainer_logits(tiny, gen)
        err = token_mult_prob_error(gen.logprobs, token_logprobs(logits, gen.tokens), mask)
        assert low <= err <= high, (dtype, err)
