"""The model vs transformers' PyTorch forward (float32, 1e-4 max abs) on both kernel paths
(cpu and portable, see jgrpo.models.kernels); HF folders in/out."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from conftest import make_random_hf_model, with_kernels

from jgrpo.models import ModelFormatError, from_pretrained, save_pretrained

TOL = 1e-4
KERNELS = ["cpu", "portable"]

BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    vocab_size=128,
    max_position_embeddings=256,
)

CASES = {
    "llama_gqa_untied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama_mqa_tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "llama3_rope_scaling": (
        "llama",
        dict(
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "qwen2_tied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2_untied_mha": ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "qwen3_head_dim": ("qwen3", dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)),
    # every bias flag transformers 5 defines for a family: Llama's attention_bias (q/k/v/o) and
    # mlp_bias (gate/up/down), Qwen3's attention_bias (q/k/v/o); Qwen2Config has none
    "llama_attention_bias": ("llama", dict(num_key_value_heads=2, attention_bias=True)),
    "llama_mlp_bias": ("llama", dict(num_key_value_heads=2, mlp_bias=True)),
    "qwen3_attention_bias": ("qwen3", dict(num_key_value_heads=2, attention_bias=True)),
}

CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}


def make_hf_model(family, extra, seed=0):
    """A random HF model with weights large enough that logits are O(1)."""
    cfg = CONFIG_CLASSES[family](**BASE, **extra, attn_implementation="eager")
    return make_random_hf_model(cfg, seed)


@pytest.fixture(scope="module", params=list(CASES))
def hf_pair(request, tmp_path_factory):
    family, extra = CASES[request.param]
    hf_model = make_hf_model(family, extra)
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder)
    return request.param, hf_model, folder


def hf_logits(model, ids, mask=None, positions=None):
    kwargs = {}
    if mask is not None:
        kwargs["attention_mask"] = torch.tensor(mask)
    if positions is not None:
        kwargs["position_ids"] = torch.tensor(positions)
    with torch.no_grad():
        return model(torch.tensor(ids), **kwargs).logits.numpy()


@pytest.mark.parametrize("kernels", KERNELS)
def test_logits_match_transformers(hf_pair, kernels):
    name, hf_model, folder = hf_pair
    model = with_kernels(from_pretrained(folder), kernels)
    seq = 40 if name == "llama3_rope_scaling" else 12  # past the original 16-token context
    ids = np.random.RandomState(1).randint(0, 128, (3, seq))
    ref = hf_logits(hf_model, ids)
    out = np.asarray(model(jnp.asarray(ids)))
    assert out.dtype == np.float32
    assert np.abs(ref).max() > 0.5, "logits must be O(1) for the comparison to mean anything"
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("kernels", KERNELS)
def test_padded_batch_matches_transformers(hf_pair, kernels):
    _, hf_model, folder = hf_pair
    model = with_kernels(from_pretrained(folder), kernels)
    rng = np.random.RandomState(2)
    ids = rng.randint(0, 128, (3, 10))
    mask = np.ones((3, 10), np.int64)
    mask[0, :4] = 0  # left padding
    mask[1, 7:] = 0  # right padding
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ref = hf_logits(hf_model, ids, mask, positions)
    out = np.asarray(model(jnp.asarray(ids), attention_mask_bt=jnp.asarray(mask)))
    valid = mask.astype(bool)
    np.testing.assert_allclose(out[valid], ref[valid], atol=TOL, rtol=0)
    assert np.isfinite(out).all()
    # explicit positions take the run-time RoPE tables instead of the trace-time ones
    explicit = model(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(explicit)[valid], ref[valid], atol=TOL, rtol=0)


# make test: the portable decode path against transformers' generate in test_sampling
@pytest.mark.parametrize("kernels", ["cpu", pytest.param("portable", marks=pytest.mark.heavy)])
def test_cached_decode_matches_full_forward(hf_pair, kernels):
    """Prefill a left-padded prompt, then decode token by token: same logits as one forward,
    both attending over the whole cache and over a prefix of it (attend_len)."""
    _, _, folder = hf_pair
    model = with_kernels(from_pretrained(folder), kernels)
    rng = np.random.RandomState(3)
    prompt_len, total = 6, 10
    ids = rng.randint(0, 128, (2, total))
    mask = np.ones((2, total), bool)
    mask[0, :2] = False
    full = np.asarray(model(jnp.asarray(ids), attention_mask_bt=jnp.asarray(mask)))
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    kv_mask = jnp.asarray(mask)
    logits, cache = model.prefill(
        jnp.asarray(ids[:, :prompt_len]),
        jnp.asarray(positions[:, :prompt_len]),
        kv_mask[:, :prompt_len],
        total,
    )
    assert len(cache.keys) == model.cfg.num_layers
    k, h = model.cfg.num_kv_heads, model.cfg.head_dim
    if kernels == "cpu":
        assert cache.keys[0].shape == (2, k, h, total)
        assert cache.values[0].shape == (2, k, total, h)
    else:
        assert cache.keys[0].shape == cache.values[0].shape == (2, total, k, h)
    np.testing.assert_allclose(logits, full[:, prompt_len - 1], atol=1e-5, rtol=0)
    layers = model.layer_weights()
    step = jax.jit(model.decode_step, static_argnums=6)
    for t in range(prompt_len, total):
        attend_len = None if t % 2 else t + 1  # a prefix that still holds slot t
        logits, cache = step(
            layers,
            jnp.asarray(ids[:, t]),
            jnp.asarray(positions[:, t]),
            kv_mask,
            cache,
            t,
            attend_len,
        )
        np.testing.assert_allclose(
            np.asarray(logits)[mask[:, t]], full[:, t][mask[:, t]], atol=1e-5, rtol=0
        )


def test_save_pretrained_roundtrip(hf_pair, tmp_path):
    _, hf_model, folder = hf_pair
    model = from_pretrained(folder)
    out = save_pretrained(model, tmp_path / "out")
    reloaded_hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager"
    )
    ids = np.random.RandomState(4).randint(0, 128, (2, 9))
    np.testing.assert_allclose(hf_logits(reloaded_hf, ids), hf_logits(hf_model, ids), atol=TOL)
    again = from_pretrained(out)
    for a, b in zip(
        jax.tree.leaves(jax.tree.map(np.asarray, nnx_params(model))),
        jax.tree.leaves(jax.tree.map(np.asarray, nnx_params(again))),
    ):
        np.testing.assert_array_equal(a, b)  # exact


def nnx_params(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


def test_sharded_checkpoint_and_bfloat16(tmp_path):
    hf_model = make_hf_model("qwen2", dict(num_key_value_heads=2))
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = np.random.RandomState(5).randint(0, 128, (2, 8))
    out = np.asarray(from_pretrained(tmp_path)(jnp.asarray(ids)))
    np.testing.assert_allclose(out, hf_logits(hf_model, ids), atol=TOL)

    bf16 = from_pretrained(tmp_path, dtype="bfloat16")
    assert nnx_params(bf16)["embed"][...].dtype == jnp.bfloat16
    out16 = np.asarray(bf16(jnp.asarray(ids)))
    assert out16.dtype == np.float32
    assert np.abs(out16 - out).max() < 0.1 * np.abs(out).max()


def test_bfloat16_safetensors_roundtrip(tmp_path):
    hf_model = make_hf_model("llama", dict(num_key_value_heads=2)).to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path / "bf16")
    model = from_pretrained(tmp_path / "bf16", dtype="bfloat16")
    ref = hf_model.model.embed_tokens.weight.float().detach().numpy()
    np.testing.assert_array_equal(np.asarray(model.embed[...]).astype(np.float32), ref)


def test_a_tensor_nothing_reads_is_an_error(tmp_path):
    """Strict loading: a Llama folder with attention_bias / mlp_bias biases whose config.json
    flag is off (a feature we would drop) is refused naming the tensor, by the pre-flight (one
    line, before any load) and by the loader; so is a tied lm_head.weight that differs."""
    from jgrpo.config import ConfigError
    from jgrpo.models.preflight import check_hf_folder
    from jgrpo.models.tiny import save_char_tokenizer

    for flag, tensor in (
        ("attention_bias", "self_attn.k_proj.bias"),  # the first of q/k/v/o's, by name
        ("mlp_bias", "mlp.down_proj.bias"),
    ):
        folder = tmp_path / flag
        make_hf_model("llama", {flag: True}).save_pretrained(folder)
        save_char_tokenizer(folder)
        check_hf_folder(folder)  # the flag on: every tensor is read
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, flag: False}))
        name = f"model.layers.0.{tensor}"
        with pytest.raises(ModelFormatError, match=f"tensor {name!r} is read by nothing"):
            from_pretrained(folder)
        with pytest.raises(ConfigError, match=f"has tensor {name!r}, which nothing reads") as e:
            check_hf_folder(folder)
        assert "\n" not in str(e.value)
    folder = tmp_path / "tied"  # a tied model's lm_head.weight: read when it is the embedding
    make_hf_model("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)).save_pretrained(
        folder
    )
    weights = safetensors.numpy.load_file(folder / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    for head, ok in ((embed, True), (embed + 1, False)):
        safetensors.numpy.save_file(
            {**weights, "lm_head.weight": head}, folder / "model.safetensors"
        )
        if ok:
            from_pretrained(folder)
        else:
            with pytest.raises(ModelFormatError, match="lm_head.weight differs"):
                from_pretrained(folder)


def test_unsupported_folder_errors(tmp_path):
    with pytest.raises(ModelFormatError, match="config.json"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelFormatError, match="model_type 'gpt2'"):
        from_pretrained(tmp_path)


@pytest.mark.slow
def test_smollm2_logits_match_transformers():
    """The converted SmolLM2-135M-Instruct (30 layers): jgrpo vs transformers, float32."""
    from jgrpo.models.sources import resolve_model_path

    folder = resolve_model_path("smollm2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = np.asarray([tokenizer(text, add_special_tokens=False)["input_ids"]])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager"
    ).eval()
    ref = hf_logits(hf_model, ids)
    out = np.asarray(from_pretrained(folder)(jnp.asarray(ids)))
    diff = np.abs(out - ref).max()
    # measured here: 1.1e-4 max abs on logits up to ~38 (30 layers, float32, 44 tokens)
    assert diff < 1e-3, diff
    assert (out.argmax(-1) == ref.argmax(-1)).all()
