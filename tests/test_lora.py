"""LoRA: the adapted forward vs PEFT on transformers' PyTorch model (float32, 1e-4), the merged
export vs transformers, adapters off = the base exactly, sampler (merged) = training forward."""

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from conftest import make_random_hf_model
from flax import nnx

from jgrpo.models import from_pretrained, save_pretrained
from jgrpo.models.adapters import (
    attach_lora,
    load_peft,
    merge_lora,
    save_peft,
    split_lora,
)
from jgrpo.models.lora import MODULES, LoRASpec

TOL = 1e-4
BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=128,
    max_position_embeddings=256,
    attn_implementation="eager",
)
FAMILIES = {
    "llama": transformers.LlamaConfig(**BASE, tie_word_embeddings=False),
    "qwen2": transformers.Qwen2Config(**BASE, tie_word_embeddings=True),
}
ALL = tuple(MODULES)


def randomize_adapters(model, seed=0, std=0.1):
    """Nonzero B (fresh adapters have B = 0, which would make every comparison trivial)."""
    rng = np.random.RandomState(seed)
    for p in model.lora.values():
        p[...] = jnp.asarray(rng.normal(0, std, p[...].shape), jnp.float32)


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf_base(request, tmp_path_factory):
    hf_model = make_random_hf_model(FAMILIES[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder)
    return folder


def lora_model(folder, targets=ALL, rank=4, alpha=8.0, seed=0):
    spec = LoRASpec(rank=rank, alpha=alpha, target_modules=targets)
    model = attach_lora(from_pretrained(folder), spec, jax.random.key(seed))
    randomize_adapters(model, seed)
    return model


def torch_logits(model, ids, mask=None):
    kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask)}
    with torch.no_grad():
        return model(torch.tensor(ids), **kwargs).logits.numpy()


IDS = np.random.RandomState(1).randint(0, 128, (3, 12))


@jax.jit
def forward(model, ids, mask=None):
    return model(ids, attention_mask_bt=mask)


def test_fresh_adapters_leave_the_model_unchanged(hf_base):
    base = from_pretrained(hf_base)
    model = attach_lora(base, LoRASpec(rank=4, alpha=8.0, target_modules=ALL), jax.random.key(0))
    a = model.lora["q_lora_a"][...]
    assert a.shape == (2, 64, 4) and float(jnp.abs(a).max()) > 0  # A random, B zero
    assert model.lora["o_lora_a"][...].shape == (2, 4, 16, 4)
    assert model.lora["down_lora_b"][...].shape == (2, 4, 64)
    np.testing.assert_array_equal(forward(model, IDS), forward(base, IDS))


def test_peft_export_loads_in_peft_with_equal_logits(hf_base, tmp_path):
    model = lora_model(hf_base)
    ours = np.asarray(forward(model, IDS))
    folder = save_peft(model, tmp_path / "adapter", base_model_name_or_path=str(hf_base))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_base, attn_implementation="eager")
    base_logits = torch_logits(hf, IDS)
    peft_model = peft.PeftModel.from_pretrained(hf, folder).eval()
    ref = torch_logits(peft_model, IDS)
    assert np.abs(ref - base_logits).max() > 0.1, "the adapters must change the logits"
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)
    # and back: the PEFT folder re-read gives the same adapters, bit for bit
    again = load_peft(from_pretrained(hf_base), folder)
    for name, p in model.lora.items():
        np.testing.assert_array_equal(again.lora[name][...], p[...])


def test_merged_export_matches_transformers(hf_base, tmp_path):
    model = lora_model(hf_base, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
    mask = np.ones(IDS.shape, np.int64)
    mask[0, :3] = 0
    ours = np.asarray(forward(model, IDS, mask))
    out = save_pretrained(merge_lora(model), tmp_path / "merged", source=hf_base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    ref = torch_logits(hf, IDS, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=TOL, rtol=0)


def test_adapters_off_is_the_base_exactly(hf_base):
    base = from_pretrained(hf_base)
    model = lora_model(hf_base)
    fwd = jax.jit(lambda m, ids: m(ids, use_lora=False))
    np.testing.assert_array_equal(fwd(model, IDS), forward(base, IDS))
    assert np.abs(np.asarray(forward(model, IDS) - forward(base, IDS))).max() > 0.1


def test_split_trees_hold_adapters_and_base(hf_base):
    model = lora_model(hf_base, targets=("q_proj", "up_proj"))
    graphdef, trainable, frozen = split_lora(model)
    assert set(trainable) == {"lora"} and set(trainable["lora"]) == {
        "q_lora_a",
        "q_lora_b",
        "up_lora_a",
        "up_lora_b",
    }
    assert "lora" not in frozen and "q" in frozen["layers"]
    again = nnx.merge(graphdef, frozen, trainable)
    np.testing.assert_array_equal(forward(again, IDS), forward(model, IDS))


def test_sampler_weights_are_merged(hf_base):
    """Prefill + decode on the merged inference weights = the unmerged training forward."""
    model = lora_model(hf_base)
    total, prompt_len = 10, 6
    ids = jnp.asarray(IDS[:2, :total])
    full = np.asarray(forward(model, ids))
    mask = jnp.ones((2, total), bool)
    positions = jnp.broadcast_to(jnp.arange(total), (2, total))
    prefill = jax.jit(lambda m, *a: m.prefill(*a, total))
    logits, cache = prefill(
        model, ids[:, :prompt_len], positions[:, :prompt_len], mask[:, :prompt_len]
    )
    np.testing.assert_allclose(logits, full[:, prompt_len - 1], atol=1e-5, rtol=0)
    layers = jax.jit(lambda m: m.layer_weights())(model)
    assert not any("lora" in k for k in layers[0])
    step = jax.jit(lambda m, *a: m.decode_step(*a))
    for t in range(prompt_len, total):
        logits, cache = step(model, layers, ids[:, t], positions[:, t], mask, cache, t)
        np.testing.assert_allclose(logits, full[:, t], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_ray_ships_the_base_once_and_adapters_each_step(tmp_path):
    """The Ray backend puts base + adapters on the first publish, adapters alone after it, and
    samples what the local backend samples from base | adapters (both versions)."""
    from jgrpo.config import load_config
    from jgrpo.models.sources import build_tiny_model
    from jgrpo.rollout import LocalRollout, build_engine, make_backend
    from jgrpo.rollout.ray_backend import init_ray
    from jgrpo.tasks import make_task

    folder = build_tiny_model(tmp_path / "m")
    cfg = load_config(
        None,
        [
            f"model.path={folder}",
            "model.lora.rank=4",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "rollout.max_new_tokens=8",
            "rollout.prompt_bucket=16",
            "rollout.backend=ray",
            "rollout.num_workers=1",
        ],
    )
    engine, graphdef = build_engine(cfg, folder)
    versions = []
    for v in range(2):
        model = attach_lora(
            from_pretrained(folder),
            LoRASpec(rank=4, alpha=16.0, target_modules=ALL),
            jax.random.key(0),
        )
        randomize_adapters(model, seed=v, std=0.3)
        versions.append(split_lora(model))
    assert nnx.graphdef(nnx.merge(*versions[0])) == graphdef  # the workers' graph is the trainer's
    _, _, frozen = versions[0]
    adapter_mb = sum(x.nbytes for x in jax.tree.leaves(versions[0][1])) / 2**20
    base_mb = sum(x.nbytes for x in jax.tree.leaves(frozen)) / 2**20
    local = LocalRollout(engine, graphdef, cfg.grpo.seed, 4, frozen)
    started = init_ray(num_cpus=2)
    backend = make_backend(cfg, engine, graphdef, folder, frozen)
    try:
        stream = make_task(cfg.data, cfg.grpo.seed).train
        for step, (_, trainable, _) in enumerate(versions):
            metrics = backend.publish(trainable, step)
            want_mb = adapter_mb + (base_mb if step == 0 else 0.0)
            assert metrics["rollout/weight_mb"] == pytest.approx(want_mb, rel=1e-9)
            local.publish(trainable, step)
            examples = stream.next_prompts(2)
            backend.request(step, examples)
            local.request(step, examples)
            got, want = backend.collect(step), local.collect(step)
            for key in ("input_ids", "token_mask", "rewards"):
                np.testing.assert_array_equal(got.batch[key], want.batch[key], err_msg=key)
        assert base_mb > 10 * adapter_mb
    finally:
        backend.close()
        if started:
            import ray

            ray.shutdown()


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.lora.rank=-1", "model.lora.rank: must be >= 0"),
        ("model.lora.alpha=0", "model.lora.alpha: must be > 0"),
        ("model.lora.target_modules=[q_proj, qkv]", "model.lora.target_modules\\[1\\]: 'qkv'"),
        ("model.lora.target_modules=[q_proj, q_proj]", "names a module twice"),
    ],
)
def test_lora_config_errors_name_the_key(override, message):
    from jgrpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.lora.rank=8", override])
