"""The sampler: greedy parity with transformers' generate, trainer-forward logprob parity
(float32 and bfloat16), filtering, stopping, early exit, determinism, compile count and sharded
parameters. Parity and determinism run on both kernel paths (cpu and portable, see
jgrpo.models.kernels): the GPU/TPU code is tested here on CPU too."""

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import make_random_hf_model, with_kernels
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jgrpo.config import RolloutConfig
from jgrpo.draws import filter_logits
from jgrpo.losses import token_logprobs as trainer_token_logprobs
from jgrpo.models import from_pretrained, kernels
from jgrpo.sampling import (
    SamplingParams,
    cache_length,
    compact_widths,
    compile_count,
    generate,
    generate_padded,
    make_decode_spec,
    pad_prompts,
)

VOCAB, PAD, EOS = 128, 0, 1
KERNELS = ["cpu", "portable"]


def make_hf_model(seed=0):
    """A random tiny Qwen2 (GQA, q/k/v biases) with weights large enough that logits are O(1)."""
    cfg = transformers.Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=None,
        attn_implementation="eager",
    )
    return make_random_hf_model(cfg, seed)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf_model = make_hf_model()
    folder = tmp_path_factory.mktemp("tiny_qwen2")
    hf_model.save_pretrained(folder)
    return hf_model, from_pretrained(folder)


@pytest.fixture(scope="module", params=KERNELS)
def path_pair(request, pair):
    """(hf_model, model on the kernel path `request.param`), sharing pair's parameters."""
    hf_model, model = pair
    return hf_model, with_kernels(model, request.param)


def make_prompts(lengths, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(2, VOCAB, n).tolist() for n in lengths]


LENGTHS = [5, 9, 3, 12, 7, 1]


def token_mult_prob_error(lg, lo, mask):
    return float(np.mean(np.exp(np.abs(lg[mask] - lo[mask]))))


def trainer_logits(model, gen):
    """One full forward over left-padded prompt + completion (pad after the end masked):
    logits_bnv[:, i] scores completion token i."""
    b, n = gen.tokens.shape
    p = gen.prompt_tokens.shape[1]
    prompt_mask = np.arange(p)[None] >= p - gen.prompt_lengths[:, None]
    completion_mask = np.arange(n)[None] < gen.lengths[:, None]
    ids = np.concatenate([gen.prompt_tokens, gen.tokens], axis=1)
    mask = np.concatenate([prompt_mask, completion_mask], axis=1)
    logits = model(jnp.asarray(ids), attention_mask_bt=jnp.asarray(mask))
    return logits[:, p - 1 : p + n - 1], completion_mask


def token_logprobs(logits_bnv, tokens_bn):
    logp = jax.nn.log_softmax(logits_bnv, axis=-1)
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(tokens_bn)[..., None], -1)[..., 0])


# ----------------------------------------------------------------------------- parity


def hf_greedy(hf_model, prompts, n, eos_ids):
    width = max(map(len, prompts))
    ids = np.full((len(prompts), width), PAD, np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=list(eos_ids),
            pad_token_id=PAD,
            return_dict_in_generate=True,
            output_logits=True,
        )
    tokens = np.full((len(prompts), n), PAD, np.int64)
    new = out.sequences[:, width:].numpy()
    tokens[:, : new.shape[1]] = new
    logits = torch.stack(out.logits, dim=1).float().numpy()  # [B, steps, V], raw
    return tokens, logits


def test_greedy_matches_transformers_generate(path_pair):
    hf_model, model = path_pair
    prompts, n = make_prompts(LENGTHS), 24
    free = generate(
        model,
        prompts,
        SamplingParams(max_new_tokens=n, temperature=0.0, prompt_bucket=8),
        jax.random.key(0),
    )
    stop = int(free.tokens[1, 6])  # an extra stop token that row 1 emits by its 7th token
    params = SamplingParams(
        max_new_tokens=n, temperature=0.0, stop_token_ids=(stop,), prompt_bucket=8
    )
    gen = generate(model, prompts, params, jax.random.key(0))
    ref_tokens, ref_logits = hf_greedy(hf_model, prompts, n, (EOS, stop))

    np.testing.assert_array_equal(gen.tokens, ref_tokens)
    assert gen.lengths[1] <= 7 and not gen.truncated[1]
    assert gen.truncated.any(), "the test wants rows that run to max_new_tokens too"
    ref_lp = jax.nn.log_softmax(ref_logits, axis=-1)
    steps = ref_logits.shape[1]
    valid = np.arange(n)[None] < gen.lengths[:, None]
    ref_lp = np.take_along_axis(np.asarray(ref_lp), gen.tokens[:, :steps, None], -1)[..., 0]
    np.testing.assert_allclose(
        gen.logprobs[:, :steps][valid[:, :steps]], ref_lp[valid[:, :steps]], atol=1e-4
    )
    assert (gen.logprobs[~valid] == 0).all() and (gen.filtered_logprobs == 0).all()


CASES = {
    "t0.7": dict(temperature=0.7),
    "t1.0": dict(temperature=1.0),
    "t0.7_topk_topp": dict(temperature=0.7, top_k=20, top_p=0.9),
    "t1.0_topp": dict(temperature=1.0, top_p=0.8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_forward_reproduces_generation_logprobs(path_pair, case):
    _, model = path_pair
    kw = CASES[case]
    params = SamplingParams(max_new_tokens=16, prompt_bucket=8, **kw)
    gen = generate(model, make_prompts(LENGTHS, seed=1), params, jax.random.key(7))
    logits_bnv, mask = trainer_logits(model, gen)
    scaled = logits_bnv / kw["temperature"]
    lo = token_logprobs(scaled, gen.tokens)
    err = token_mult_prob_error(gen.logprobs, lo, mask)
    assert err <= 1.001, err
    np.testing.assert_allclose(gen.logprobs[mask], lo[mask], atol=1e-4)

    b, n, v = scaled.shape
    filtered = filter_logits(scaled.reshape(b * n, v), kw.get("top_p", 1.0), kw.get("top_k"))
    lo_filtered = token_logprobs(filtered.reshape(b, n, v), gen.tokens)
    assert np.isfinite(lo_filtered[mask]).all(), "a sampled token lies outside the filter"
    assert token_mult_prob_error(gen.filtered_logprobs, lo_filtered, mask) <= 1.001
    if "top_k" in kw or "top_p" in kw:
        assert (gen.filtered_logprobs[mask] >= gen.logprobs[mask] - 1e-6).all()
        assert (gen.filtered_logprobs[mask] > gen.logprobs[mask] + 1e-3).any()
    else:
        np.testing.assert_allclose(gen.filtered_logprobs, gen.logprobs, atol=1e-6)
    if "top_k" in kw:
        ranks = (
            np.asarray(scaled) > np.take_along_axis(np.asarray(scaled), gen.tokens[..., None], -1)
        ).sum(-1)
        assert ranks[mask].max() < kw["top_k"]


def bfloat16_models(model, kernels_path):
    """(sampler, trainer) computing in bfloat16: the sampler keeps model's float32 parameters
    (master weights, cast as the sampler takes them), the trainer holds their bfloat16 casts
    (what a mixed-precision training forward computes with)."""
    sampler = with_kernels(model, kernels_path)
    sampler.cfg = dataclasses.replace(sampler.cfg, dtype="bfloat16")
    graphdef, state = nnx.split(sampler)
    return sampler, nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))


@pytest.mark.parametrize("kernels_path", ["cpu", pytest.param("portable", marks=pytest.mark.heavy)])
def test_bfloat16_generation_logprobs_match_trainer_forward(pair, kernels_path):
    """bf16 compute (float32 parameters): the sampler's logprobs vs the training forward's
    (Transformer.__call__ + losses.token_logprobs over the left-padded prompt + completion)."""
    _, model = pair
    sampler, trainer = bfloat16_models(model, kernels_path)
    assert jax.tree.leaves(nnx.state(sampler))[0].dtype == jnp.float32
    params = SamplingParams(max_new_tokens=16, temperature=1.0, prompt_bucket=8)
    gen = generate(sampler, make_prompts(LENGTHS, seed=1), params, jax.random.key(7))

    p = gen.prompt_tokens.shape[1]
    prompt_mask = np.arange(p)[None] >= p - gen.prompt_lengths[:, None]
    completion_mask = np.arange(gen.tokens.shape[1])[None] < gen.lengths[:, None]
    ids = jnp.asarray(np.concatenate([gen.prompt_tokens, gen.tokens], axis=1))
    mask = jnp.asarray(np.concatenate([prompt_mask, completion_mask], axis=1))
    # jitted as the train step is, with the model's XLA options (kernels.COMPILER_OPTIONS)
    forward = jax.jit(
        lambda m, ids, mask: m(ids, attention_mask_bt=mask),  # positions cumsum(mask) - 1
        compiler_options=kernels.COMPILER_OPTIONS,
    )
    logits = forward(trainer, ids, mask)
    assert logits.dtype == jnp.float32
    lo = np.asarray(trainer_token_logprobs(logits, ids, 1.0))[:, p:]
    err = token_mult_prob_error(gen.logprobs, lo, completion_mask)
    # measured 1.0000001 on both paths (max |lg - lo| 5e-7): the sampler and the forward run
    # the same bf16 ops, each rounded as written; what is left is float32 log-softmax rounding.
    # The float32 bound and tolerance of the test above hold.
    assert err <= 1.001, err
    np.testing.assert_allclose(gen.logprobs[completion_mask], lo[completion_mask], atol=1e-4)
    # not trivially 1: bf16 compute is in effect (vs the float32 forward: 1.015 measured)
    lo32 = np.asarray(trainer_token_logprobs(model(ids, attention_mask_bt=mask), ids, 1.0))
    assert token_mult_prob_error(gen.logprobs, lo32[:, p:], completion_mask) > 1.005

    _, cache = sampler.prefill(ids[:, :p], jnp.zeros((len(ids), p), jnp.int32), mask[:, :p], p)
    assert {x.dtype for x in cache.keys + cache.values} == {jnp.dtype(jnp.bfloat16)}


def reference_filter(x, top_p, top_k):
    """NumPy float64 top-k then top-p (kept = shortest prefix reaching top_p), -inf elsewhere."""
    x = np.asarray(x, np.float64).copy()
    for row in x:
        order = np.argsort(-row, kind="stable")
        keep = np.zeros(len(row), bool)
        k = len(row) if top_k is None else top_k
        probs = np.exp(row[order[:k]] - row[order[0]])
        probs /= probs.sum()
        before = 0.0
        for j in range(k):
            if j > 0 and before >= top_p:
                break
            keep[order[j]] = True
            before += probs[j]
        row[row < row[keep].min()] = -np.inf  # a threshold: ties with the last kept stay
    return x


@pytest.mark.parametrize("path", KERNELS)
@pytest.mark.parametrize("v", [1, 7, 100, 4099])
def test_gumbel_noise_is_jax_random_gumbel(v, path):
    """Both paths' noise (the CPU one a written-out threefry) is jax.random.gumbel's bits
    exactly, per row key."""
    keys = jax.random.split(jax.random.key(1234), 6)
    ref = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)
    out = jax.jit(kernels.gumbel_noise, static_argnums=(1, 2))(keys, v, path)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    if path == "cpu":
        with pytest.raises(ValueError, match="threefry2x32"):
            kernels.gumbel_noise(jax.random.split(jax.random.key(0, impl="rbg"), 2), v, path)


@pytest.mark.parametrize("path", KERNELS)
def test_argmax_takes_the_first_maximum(path):
    x = np.round(np.random.RandomState(0).normal(0, 1, (64, 37))).astype(np.float32)
    x[3] = 2.0  # a row of ties
    out = np.asarray(jax.jit(kernels.argmax, static_argnums=1)(jnp.asarray(x), path))
    np.testing.assert_array_equal(out, np.argmax(x, axis=-1))
    assert out.dtype == np.int32


def test_kernel_paths_draw_the_same_tokens(pair):
    """Same key, same tokens on both paths (same Gumbel bits and argmax ties; the logits
    differ by float rounding only)."""
    _, model = pair
    prompts = make_prompts(LENGTHS, seed=5)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, prompt_bucket=8)
    cpu = generate(with_kernels(model, "cpu"), prompts, params, jax.random.key(4))
    portable = generate(with_kernels(model, "portable"), prompts, params, jax.random.key(4))
    np.testing.assert_array_equal(portable.tokens, cpu.tokens)
    np.testing.assert_allclose(portable.logprobs, cpu.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="kernels"):
        generate(with_kernels(model, "gpu"), prompts, params, jax.random.key(4))


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(
    "top_p,top_k", [(1.0, None), (0.7, None), (0.95, None), (0.01, None), (1.0, 5), (0.6, 10)]
)
def test_filter_logits_matches_reference(top_p, top_k, ties):
    x = np.random.RandomState(0).normal(0, 2, (16, 300)).astype(np.float32)
    if ties:
        x = np.round(x)  # many exact ties, also at the thresholds
    out = np.asarray(filter_logits(jnp.asarray(x), jnp.float32(top_p), top_k))
    ref = reference_filter(x, top_p, top_k)
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
    np.testing.assert_array_equal(out[np.isfinite(out)], x[np.isfinite(ref)])
    if top_p == 1.0 and top_k is None:
        np.testing.assert_array_equal(out, x)


def test_top_k_1_is_greedy(pair):
    _, model = pair
    prompts = make_prompts(LENGTHS, seed=2)
    greedy = generate(
        model,
        prompts,
        SamplingParams(max_new_tokens=10, temperature=0.0, prompt_bucket=8),
        jax.random.key(0),
    )
    k1 = generate(
        model,
        prompts,
        SamplingParams(max_new_tokens=10, temperature=1.0, top_k=1, prompt_bucket=8),
        jax.random.key(3),
    )
    np.testing.assert_array_equal(k1.tokens, greedy.tokens)
    np.testing.assert_allclose(k1.logprobs, greedy.logprobs, atol=1e-6)
    np.testing.assert_array_equal(k1.filtered_logprobs, 0.0)


# ----------------------------------------------------------------------------- control flow


def test_deterministic_for_a_key_and_keys_differ(path_pair):
    _, model = path_pair
    prompts, params = make_prompts(LENGTHS), SamplingParams(max_new_tokens=12, prompt_bucket=8)
    a = generate(model, prompts, params, jax.random.key(1))
    b = generate(model, prompts, params, jax.random.key(1))
    c = generate(model, prompts, params, jax.random.key(2))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (a.tokens != c.tokens).mean() > 0.5


def test_stop_tokens_lengths_and_truncation(pair):
    _, model = pair
    prompts, n, key = make_prompts(LENGTHS), 16, jax.random.key(5)
    base = SamplingParams(max_new_tokens=n, prompt_bucket=8, ignore_eos=True)
    free = generate(model, prompts, base, key)
    assert free.truncated.all() and (free.lengths == n).all()
    assert free.num_decode_steps == n - 1

    stop = int(free.tokens[0, 3])
    gen = generate(
        model,
        prompts,
        SamplingParams(max_new_tokens=n, prompt_bucket=8, ignore_eos=True, stop_token_ids=(stop,)),
        key,
    )
    for row in range(len(prompts)):
        hits = np.flatnonzero(free.tokens[row] == stop)
        length = hits[0] + 1 if len(hits) else n
        assert gen.lengths[row] == length
        assert gen.truncated[row] == (len(hits) == 0)
        np.testing.assert_array_equal(gen.tokens[row, :length], free.tokens[row, :length])
        np.testing.assert_allclose(
            gen.logprobs[row, :length], free.logprobs[row, :length], atol=1e-6
        )
        assert (gen.tokens[row, length:] == PAD).all() and (gen.logprobs[row, length:] == 0).all()
    expected_steps = n - 1 if gen.truncated.any() else gen.lengths.max() - 1
    assert gen.num_decode_steps == expected_steps


def test_early_exit_when_every_row_stops(pair):
    _, model = pair
    params = SamplingParams(
        max_new_tokens=32, prompt_bucket=8, stop_token_ids=tuple(range(VOCAB))
    )  # every token stops
    gen = generate(model, make_prompts(LENGTHS), params, jax.random.key(0))
    assert gen.num_decode_steps == 0
    assert (gen.lengths == 1).all() and not gen.truncated.any()
    assert (gen.tokens[:, 1:] == PAD).all()


def test_model_eos_stops_rows(pair):
    """The model config's eos id (1) stops a row; greedy from a prompt whose argmax is eos."""
    _, model = pair
    prompts = make_prompts([4] * 64, seed=9)
    gen = generate(
        model,
        prompts,
        SamplingParams(max_new_tokens=8, temperature=2.0, prompt_bucket=8),
        jax.random.key(11),
    )
    stopped = ~gen.truncated
    assert stopped.any(), "with 64 rows at T=2 some row samples eos within 8 tokens"
    last = gen.tokens[np.flatnonzero(stopped), gen.lengths[stopped] - 1]
    assert (last == EOS).all()
    for row in np.flatnonzero(gen.truncated):
        assert EOS not in gen.tokens[row]


# ----------------------------------------------------------------------------- compiles


def test_compile_count_per_bucket(pair):
    _, model = pair
    n = 6
    before = compile_count()
    for i, lengths in enumerate([[3, 5, 2, 8], [8, 1, 1, 1], [6, 7, 4, 2]]):
        params = SamplingParams(
            max_new_tokens=n, temperature=0.5 + 0.2 * i, top_p=[0.8, 0.9, 0.95][i], prompt_bucket=8
        )
        split = nnx.split(model) if i == 2 else model  # (graphdef, state) shares the compile
        generate(split, make_prompts(lengths, seed=i), params, jax.random.key(i))
    assert compile_count() == before + 1
    generate(model, make_prompts([9, 2, 3, 4]), params, jax.random.key(0))  # next bucket
    assert compile_count() == before + 2
    generate(model, make_prompts([9, 2, 3]), params, jax.random.key(0))  # new batch size
    assert compile_count() == before + 3
    # modes are programs: no nucleus filter (top_p = 1), greedy (temperature = 0)
    for mode in (dict(top_p=1.0), dict(temperature=0.0), dict(temperature=0.0, top_p=0.5)):
        mode_params = dataclasses.replace(params, **mode)
        generate(model, make_prompts([9, 2, 3]), mode_params, jax.random.key(0))
    assert compile_count() == before + 5  # greedy ignores top_p


def test_from_rollout_config():
    rc = RolloutConfig(
        temperature=0.6,
        top_p=0.95,
        top_k=50,
        max_new_tokens=77,
        prompt_bucket=16,
    )  # compact_decode: the config's default (true), not SamplingParams' (false)
    sp = SamplingParams.from_rollout_config(rc, stop_token_ids=(7,))
    assert (
        sp.temperature,
        sp.top_p,
        sp.top_k,
        sp.max_new_tokens,
        sp.prompt_bucket,
        sp.stop_token_ids,
        sp.compact_decode,
    ) == (0.6, 0.95, 50, 77, 16, (7,), True)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


# ----------------------------------------------------------------------------- sharding

RULES = {
    "embed": "fsdp",
    "vocab": "tensor",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
}


def shard_state(state, mesh):
    def place(var):
        axes = var.get_metadata()["logical_axes"]
        spec = [RULES.get(a) for a in axes]
        spec = [m if m and dim % mesh.shape[m] == 0 else None for m, dim in zip(spec, var.shape)]
        return var.replace(jax.device_put(var[...], NamedSharding(mesh, PartitionSpec(*spec))))

    return jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


@pytest.mark.parametrize(
    "temperature,kernels_path",
    [pytest.param(t, "cpu", marks=pytest.mark.heavy) for t in (0.0, 1.0)] + [(1.0, "portable")],
)
def test_sharded_params_give_the_same_tokens(pair, temperature, kernels_path):
    model = with_kernels(pair[1], kernels_path)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    graphdef, state = nnx.split(model)
    sharded = shard_state(state, mesh)
    q = jax.tree.leaves(sharded)[0]
    assert len(jax.tree.leaves(sharded)) == len(jax.tree.leaves(state))
    specs = {tuple(x.sharding.spec) for x in jax.tree.leaves(sharded)}
    assert any("tensor" in s for s in specs) and any("fsdp" in s for s in specs), specs
    assert len(q.sharding.device_set) == 8
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_p=0.9, prompt_bucket=8)
    prompts = make_prompts(LENGTHS + [4, 6], seed=4)
    ref = generate((graphdef, state), prompts, params, jax.random.key(3))
    out = generate((graphdef, sharded), prompts, params, jax.random.key(3))
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)


# ----------------------------------------------------------------------------- real model


@pytest.mark.heavy  # make test: tiny greedy parity; test_model: SmolLM2 logits
def test_smollm2_greedy_matches_transformers():
    sources = pytest.importorskip("jgrpo.models.sources")
    try:
        folder = sources.resolve_model_path("smollm2")
    except Exception as e:  # the GGUF package may be missing on this machine
        pytest.skip(f"smollm2 unavailable: {e}")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model = from_pretrained(folder)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(10, 5000, n).tolist() for n in (7, 12, 4)]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, prompt_bucket=16, pad_id=0)
    gen = generate(model, prompts, params, jax.random.key(0))
    width = max(map(len, prompts))
    ids = np.zeros((3, width), np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=list(model.cfg.eos_token_ids),
        )
    ref = np.zeros((3, 16), np.int64)
    ref[:, : out.shape[1] - width] = out[:, width:].numpy()
    np.testing.assert_array_equal(gen.tokens, ref)


def test_split_batch_samples_what_the_whole_batch_samples(pair):
    """Per-row keys: rows generated in two parts (as two rollout workers do) are identical."""
    _, model = pair
    prompts = make_prompts(LENGTHS, seed=7)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, prompt_bucket=16)
    key = jax.random.key(3)
    whole = generate(model, prompts, params, key)
    head = generate(model, prompts[:4], params, key)
    tail = generate(model, prompts[4:], params, key, first_row=4)
    np.testing.assert_array_equal(np.concatenate([head.tokens, tail.tokens]), whole.tokens)
    # Logprobs agree to float32 rounding, not bit for bit: XLA:CPU matmul results depend on the
    # number of rows at the ulp level (the trainer's own full forward gives logits differing by
    # ~3e-6 between a 12-row batch and its 4- and 8-row parts).
    np.testing.assert_allclose(
        np.concatenate([head.logprobs, tail.logprobs]), whole.logprobs, atol=1e-5
    )
    shifted = generate(model, prompts[4:], params, key)  # without the offset: other draws
    assert not np.array_equal(shifted.tokens, whole.tokens[4:])


# ----------------------------------------------------------------------------- shared prefill


def grouped_prompts(num_prompts, group, seed):
    """num_prompts distinct prompts of varied lengths, each repeated `group` times in a row."""
    lengths = [5, 9, 3, 12, 7, 1, 10, 4][:num_prompts]
    return [p for p in make_prompts(lengths, seed=seed) for _ in range(group)]


STOPS = tuple(range(2, 14))
"""12 of the 128 tokens stop a row: lengths spread from 1 to the cap, so slots free up early."""
SLOT_PARAMS = SamplingParams(
    max_new_tokens=20, top_p=0.9, prompt_bucket=8, stop_token_ids=STOPS, attention_chunk=8
)
"""Prompts of <= 16 tokens: a cache of 48 columns; decode segments [1, 9), [9, 17), [17, 20)
attend 32, 48 and 48 of them (a segment runs while its slots' rows are young enough)."""


def path_dtype_temperature_cases(fast) -> list:
    """Every (kernel path, dtype, temperature) case; those not in `fast` (the ones make test
    runs) are marked heavy, for make test-all."""
    return [
        pytest.param(*case, marks=() if case in fast else pytest.mark.heavy)
        for case in itertools.product(KERNELS, ("float32", "bfloat16"), (0.0, 1.0))
    ]


SHARED_PREFILL_FAST = {("cpu", "float32", 1.0)}
"""The case make test runs (sampled; the portable path's cases are in make test-all)."""
SHARED_PREFILL_CASES = path_dtype_temperature_cases(SHARED_PREFILL_FAST)


@pytest.mark.parametrize("kernels_path,dtype,temperature", SHARED_PREFILL_CASES)
def test_shared_prefill_gives_the_same_tokens(pair, kernels_path, dtype, temperature):
    """group_size G: each prompt prefilled once for its G rows; the same tokens and logprobs
    as prefilling every row (draws keyed by row: the G rows of a prompt still differ)."""
    model = with_kernels(pair[1], kernels_path)
    model.cfg = dataclasses.replace(model.cfg, dtype=dtype)
    prompts, group = grouped_prompts(4, 4, seed=6), 4
    params = dataclasses.replace(SLOT_PARAMS, temperature=temperature)  # decode slots' ref too
    key = jax.random.key(8)
    rows = generate(model, prompts, params, key, first_row=6)
    shared = generate(model, prompts, params, key, first_row=6, group_size=group)
    np.testing.assert_array_equal(shared.tokens, rows.tokens)
    np.testing.assert_array_equal(shared.lengths, rows.lengths)
    np.testing.assert_array_equal(shared.prompt_tokens, rows.prompt_tokens)
    np.testing.assert_array_equal(shared.prompt_lengths, rows.prompt_lengths)
    # bit-identical here (4 vs 16 prefill rows compile alike); at other shapes XLA:CPU may fuse
    # the prefill differently for another number of rows (a [b, 64, 64] float32 rms_norm
    # becomes one fusion from b = 64 on, 1 ulp apart): then they agree to float32 rounding
    np.testing.assert_array_equal(shared.logprobs, rows.logprobs)
    np.testing.assert_array_equal(shared.filtered_logprobs, rows.filtered_logprobs)
    if temperature > 0:  # the rows of one prompt drew different completions
        assert (shared.tokens[0::group] != shared.tokens[1::group]).any()


def test_default_sampler_logprobs_match_trainer_forward(pair):
    """The run's default sampler (rollout.shared_prefill and rollout.compact_decode on), float32:
    neither is bit-exact against per-row prefill at the full width (a few ulps), so the bound that
    matters is the trainer's: its forward reproduces the generation logprobs to
    token_mult_prob_error <= 1.001, as for the plain sampler above."""
    model = with_kernels(pair[1], "cpu")
    prompts, group = grouped_prompts(4, 4, seed=6), 4
    params = dataclasses.replace(SLOT_PARAMS, compact_decode=True)  # rows stop: it narrows
    gen = generate(model, prompts, params, jax.random.key(8), first_row=6, group_size=group)
    assert gen.lengths.min() <= 2 and gen.truncated.any(), gen.lengths  # 16 -> 8 -> 4 rows
    logits_bnv, mask = trainer_logits(model, gen)
    lo = token_logprobs(logits_bnv / params.temperature, gen.tokens)
    err = token_mult_prob_error(gen.logprobs, lo, mask)
    assert err <= 1.001, err
    np.testing.assert_allclose(gen.logprobs[mask], lo[mask], atol=1e-4)


def test_shared_prefill_prefills_each_prompt_once(pair, monkeypatch):
    """The prefill's input has one row per distinct prompt (B / G rows, not B)."""
    _, model = pair
    seen = []
    prefill = type(model).prefill

    def spy(self, input_ids_bt, *args, **kw):
        seen.append(input_ids_bt.shape)
        return prefill(self, input_ids_bt, *args, **kw)

    monkeypatch.setattr(type(model), "prefill", spy)
    prompts, group = grouped_prompts(4, 4, seed=3), 4
    params = SamplingParams(max_new_tokens=7, temperature=1.0, prompt_bucket=8)  # a new compile
    generate(model, prompts, params, jax.random.key(0), group_size=group)
    generate(model, prompts, params, jax.random.key(0))
    assert seen == [(4, 16), (16, 16)]


def test_shared_prefill_checks_the_groups(pair):
    _, model = pair
    prompts = grouped_prompts(2, 3, seed=1)
    params = SamplingParams(max_new_tokens=4, prompt_bucket=8)
    with pytest.raises(ValueError, match="divide the 6 prompts"):
        generate(model, prompts, params, jax.random.key(0), group_size=4)
    prompts[4] = prompts[4] + [7]
    with pytest.raises(ValueError, match="row 4's prompt differs from its group's first row 3"):
        generate(model, prompts, params, jax.random.key(0), group_size=3)


# ----------------------------------------------------------------------------- decode slots

DECODE_SLOTS_FAST = {("cpu", "float32", 1.0): [(2, 4)]}
"""The case make test runs (one slot count: a slot program compiles in seconds); make test-all
runs all eight with every (slots, group_size)."""
DECODE_SLOTS_CASES = path_dtype_temperature_cases(DECODE_SLOTS_FAST)


@pytest.mark.parametrize("kernels_path,dtype,temperature", DECODE_SLOTS_CASES)
def test_decode_slots_give_the_same_tokens(pair, kernels_path, dtype, temperature):
    """decode_slots S < rows: a stopped row's slot takes the next waiting row (prefilled into
    it); draws are keyed by row, so S = rows, rows / 2 and rows / 8 give the tokens of one
    batch of every row, with and without shared prefill (S = 2 < G = 4: a prompt's rows enter
    in parts, its prefill staged until the last one is in)."""
    model = with_kernels(pair[1], kernels_path)
    model.cfg = dataclasses.replace(model.cfg, dtype=dtype)
    prompts, group = grouped_prompts(4, 4, seed=6), 4  # 16 rows
    params = dataclasses.replace(SLOT_PARAMS, temperature=temperature)
    key = jax.random.key(8)
    ref = generate(model, prompts, params, key, first_row=6)  # every row in one batch
    assert ref.lengths.min() <= 2 and ref.truncated.any(), ref.lengths  # early and late stops
    # (slots, group_size); make test: rows / 8 shared on cpu
    variants = DECODE_SLOTS_FAST.get((kernels_path, dtype, temperature))
    variants = variants or [(16, 1), (16, group), (8, 1), (8, group), (2, 1), (2, group)]
    for slots, group_size in variants:
        slot_params = dataclasses.replace(params, decode_slots=slots)
        out = generate(model, prompts, slot_params, key, first_row=6, group_size=group_size)
        for name in ("tokens", "lengths", "truncated", "prompt_tokens", "prompt_lengths"):
            np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), name)
        # a step advances at most `slots` rows (a row of length L takes L - 1 steps)
        assert out.num_decode_steps >= np.sum(ref.lengths - 1) / slots
        # float32: the prefill of one prompt per slot rounds apart from the one over every row
        # at the ulp level (XLA:CPU picks another dot kernel for another number of rows, as in
        # test_split_batch_samples_what_the_whole_batch_samples): measured <= 9 ulps
        for name in ("logprobs", "filtered_logprobs"):
            np.testing.assert_allclose(getattr(out, name), getattr(ref, name), atol=1e-5)


COMPACT_FAST = {("cpu", "float32", 1.0)}
"""The case make test runs (sampled; the portable and greedy cases are in make test-all)."""
COMPACT_CASES = path_dtype_temperature_cases(COMPACT_FAST)


@pytest.mark.parametrize("kernels_path,dtype,temperature", COMPACT_CASES)
def test_compact_decode_gives_the_same_tokens(pair, kernels_path, dtype, temperature):
    """compact_decode: once no more than 8, 4, 2 of the 16 rows still run, they go on as a batch
    of that width (gathered from the wider one's cache); draws are keyed by row, so the tokens are
    those of the full-width loop, with and without shared prefill (the rows' lengths make it
    narrow twice while rows still run)."""
    model = with_kernels(pair[1], kernels_path)
    model.cfg = dataclasses.replace(model.cfg, dtype=dtype)
    prompts, group = grouped_prompts(4, 4, seed=6), 4  # 16 rows
    params = dataclasses.replace(SLOT_PARAMS, temperature=temperature)
    key = jax.random.key(8)
    ref = generate(model, prompts, params, key, first_row=6)
    running = [int(np.sum(ref.lengths > i)) for i in range(params.max_new_tokens)]
    assert compact_widths(16) == (16, 8, 4, 2)
    assert running[1] > 8 and min(running) <= 4, running  # two narrowings: 16 -> 8 -> 4
    compact = dataclasses.replace(params, compact_decode=True)
    for group_size in (1, group):
        out = generate(model, prompts, compact, key, first_row=6, group_size=group_size)
        for name in ("tokens", "lengths", "truncated", "prompt_tokens", "prompt_lengths"):
            np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), name)
        assert out.num_decode_steps == ref.num_decode_steps
        # float32: a narrower batch's matmuls round apart at the ulp level (as any split batch)
        for name in ("logprobs", "filtered_logprobs"):
            np.testing.assert_allclose(getattr(out, name), getattr(ref, name), atol=1e-5)
    # the program holds the narrower batches: KV caches [w, ...] of widths 8 and 4 (not today's)
    cache_widths = {}
    for flag in (False, True):
        spec = make_decode_spec(model.cfg, dataclasses.replace(params, compact_decode=flag))
        ids_up, lengths_u = pad_prompts(prompts, params.prompt_bucket, spec.pad_id)
        args = (model, ids_up, lengths_u, key, np.float32(temperature), np.float32(0.9))
        text = generate_padded.lower(*args, np.arange(16, dtype=np.int32), spec=spec).as_text()
        cache_widths[flag] = set(re.findall(r"tensor<(\d+)x\d+x\d+x\d+x[bf]", text))
    assert {"8", "4"} <= cache_widths[True] - cache_widths[False], cache_widths


TAIL_CASES = path_dtype_temperature_cases({("cpu", "float32", 1.0)})
"""make test: the cpu float32 sampled case (with the lowered program's cache widths)."""


@pytest.mark.parametrize("kernels_path,dtype,temperature", TAIL_CASES)
def test_decode_slots_tail_compaction_gives_the_same_tokens(pair, kernels_path, dtype, temperature):
    """decode_slots 8 < 16 rows with compact_decode: once no row waits, the 8 slots narrow to
    4, 2, 1 as their rows stop (gathered from the wider pool's cache). Draws are keyed by row,
    so the tokens and the decode steps are those of the slot loop without it, and of one batch
    of every row; the lowered program holds the narrower slot caches."""
    model = with_kernels(pair[1], kernels_path)
    model.cfg = dataclasses.replace(model.cfg, dtype=dtype)
    cfg = model.cfg
    prompts, group = grouped_prompts(4, 4, seed=6), 4  # 16 rows
    key = jax.random.key(8)
    params = dataclasses.replace(SLOT_PARAMS, temperature=temperature)
    ref = generate(model, prompts, params, key, first_row=6)  # every row in one batch
    slots = dataclasses.replace(params, decode_slots=8)
    full = generate(model, prompts, slots, key, first_row=6, group_size=group)
    tail = dataclasses.replace(slots, compact_decode=True)
    out = generate(model, prompts, tail, key, first_row=6, group_size=group)
    for name in ("tokens", "lengths", "truncated", "prompt_tokens", "prompt_lengths"):
        np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), name)
    assert out.num_decode_steps == full.num_decode_steps
    for name in ("logprobs", "filtered_logprobs"):  # as test_compact_decode_gives_the_same_tokens
        np.testing.assert_allclose(getattr(out, name), getattr(full, name), atol=1e-5)
    if (kernels_path, dtype) != ("cpu", "float32"):
        return  # the cache layout matched below is the cpu path's, in float32
    cache_widths = {}
    for params in (slots, tail):
        spec = make_decode_spec(model.cfg, params)
        ids_up, lengths_u = pad_prompts(prompts[::group], params.prompt_bucket, spec.pad_id)
        args = (model, ids_up, lengths_u, key, np.float32(1.0), np.float32(0.9))
        text = generate_padded.lower(*args, np.arange(16, dtype=np.int32), spec=spec).as_text()
        keys = rf"tensor<(\d+)x{cfg.num_kv_heads}x{cfg.head_dim}x{cache_length(16, 20)}xf32>"
        cache_widths[params.compact_decode] = set(re.findall(keys, text))  # cpu keys [w, k, h, s]
    # 8 slots, 4 (a group's rows entering at once; the first narrowing), 1 (the staged prompt)
    assert cache_widths[True] - cache_widths[False] == {"2"}, cache_widths


def test_decode_slots_compile_once_per_shape(pair):
    """The decode-slot program's shapes are rows, prompt bucket, slots and the cache length
    (bucket + max_new_tokens): new prompts in the bucket, temperatures and top_p reuse it, and
    every slot count >= rows runs the one-batch program."""
    model = with_kernels(pair[1], "cpu")  # the fast case above: its programs, when it ran
    params = SLOT_PARAMS
    slot_params = dataclasses.replace(params, decode_slots=2)
    prompts, group = grouped_prompts(4, 4, seed=6), 4
    generate(model, prompts, slot_params, jax.random.key(0), group_size=group)  # compiled above
    generate(model, prompts, params, jax.random.key(0))
    before = compile_count()
    other = grouped_prompts(4, 4, seed=2)  # other prompts, the same bucket
    hotter = dataclasses.replace(slot_params, temperature=1.3, top_p=0.8)
    generate(model, other, hotter, jax.random.key(1), first_row=5, group_size=group)
    for slots in (None, 16, 64):  # >= rows: one batch of every row
        generate(model, other, dataclasses.replace(params, decode_slots=slots), jax.random.key(1))
    assert compile_count() == before
