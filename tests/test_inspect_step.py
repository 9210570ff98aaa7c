"""inspect-step tells the truth at a real model shape: flops over every loop trip (1 and 2
microbatches agree; the analytic count agrees), per-device bytes, no [B, T, V] logits."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from jgrpo import cli
from jgrpo.config import ConfigError, load_config
from jgrpo.inspect_report import format_report, parse_device_memory
from jgrpo.inspect_step import hlo_dot_flops, inspect_step

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}


def test_hlo_dot_flops_counts_every_trip():
    """A scan of 3 matmuls and a map of 4: hand-counted flops, which XLA counts once per body."""
    import jax
    import jax.numpy as jnp

    def f(w_lab, x_ab):
        y_ab, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x_ab, w_lab)
        return jax.lax.map(lambda r: r @ r.T, y_ab.reshape(4, 2, -1))

    compiled = jax.jit(f).lower(jnp.ones((3, 16, 16)), jnp.ones((8, 16))).compile()
    flops, known = hlo_dot_flops(compiled.as_text())
    assert known
    assert flops == 3 * (2 * 8 * 16 * 16) + 4 * (2 * 2 * 2 * 16)
    assert compiled.cost_analysis()["flops"] < 0.6 * flops  # what it replaces


def test_blockwise_attention_flops_count_the_causal_blocks_every_trip():
    """Hand count: 2 rows of 40 tokens in blocks of 16 are padded to 48, 3 blocks, so 6 block
    pairs at or below the diagonal (not 9). One matmul of a pair is 2 x 2 rows x 16 x 16 x
    4 heads x 8 dims = 32,768 flops; the forward runs 2 a pair (scores, values), the backward 5
    (scores again, dv, dp, dq, dk). The compiled program knows every loop trip, and
    `attention_flops` (the analytic count, per row) says the same."""
    import types

    import jax
    import jax.numpy as jnp

    from jgrpo.inspect_step import attention_flops
    from jgrpo.models.blockwise import blockwise_attention

    q, kv = jnp.ones((2, 40, 4, 8)), jnp.ones((2, 40, 2, 8))

    def loss(q, k, v):
        return blockwise_attention(q, k, v, jnp.ones((2, 40), bool), block=16).sum()

    unit = 2 * 2 * 16 * 16 * 4 * 8
    forward = hlo_dot_flops(jax.jit(loss).lower(q, kv, kv).compile().as_text())
    grad = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv).compile()
    assert forward == (6 * 2 * unit, True)
    assert hlo_dot_flops(grad.as_text()) == (6 * 7 * unit, True)
    assert grad.cost_analysis()["flops"] < 0.5 * 6 * 7 * unit  # XLA: each loop body once
    shape = types.SimpleNamespace(num_heads=4, head_dim=8, attention_block_size=16)
    assert attention_flops(40, shape) == (6 * 2 * unit // 2, 6 * unit // 2)  # one row
    assert attention_flops(16, shape) == (4 * 16 * 16 * 4 * 8, 0)  # materialised: the square


@pytest.mark.heavy  # make test: the hand count above
@pytest.mark.parametrize(
    "overrides",
    [["model.remat=dots"], ["model.remat=none"], ["model.remat=dots", "model.lora.rank=4"]],
    ids=["dots", "none", "lora"],
)
def test_blockwise_step_flops_equal_the_analytic_count(overrides):
    """The tiny step with 56-token rows in blocks of 16 (4 blocks, 10 pairs): the compiled
    matmul flops, every trip known, equal `analytic_flops` exactly (causal blocks, the
    backward's recomputed scores, remat's recomputed attention)."""
    base = ["rollout.prompt_bucket=16", "rollout.max_new_tokens=40"]
    cfg = load_config(TINY, [*base, "model.attention_block_size=16", *overrides])
    report = inspect_step(cfg)
    assert report["flops_trip_counts_known"]
    assert report["flops"] == report["flops_analytic"]


def temp_bytes_bound(
    report, microbatches, rows=16, tokens=64, chunk=32, fsdp=8, shape=SMOLLM2_135M
) -> int:
    """What the SmolLM2-shaped step below needs in temporaries per device, from its shapes.

    fsdp splits the rows and every weight 8 ways; bf16 compute, float32 master weights, remat
    full, `microbatches` microbatches of the `rows` rows. Terms (bytes, per device):
    - gradients and update: the float32 gradient accumulator, one microbatch's gradient and
      one tree of optimizer updates, each the size of the (float32) params: 3 x P;
    - one logprob chunk (vocab-parallel head: every row of the microbatch, 1/fsdp of the
      vocab): float32 logits [rows, chunk, V / fsdp], with up to 8 buffers of that size alive
      (the logits, their exponentials, the cotangent, bfloat16 casts and XLA:CPU's float32
      copies of bfloat16 dot operands);
    - one layer's weights gathered whole (FSDP), in float32 and a bfloat16 cast, in the
      forward and again for the backward's weight gradients before their reduce-scatter:
      2 x (4 + 2) bytes x layer params;
    - activations: the remat residuals (every layer's input, its rows of the microbatch, at
      most float32) and up to 16 float32 per-layer intermediates of the largest per-row
      width (MLP [t, f], attention scores [n, t, t]).
    A head gathered whole costs V x d x 4 bytes (113 MB here) per copy: the head gathered
    once per forward, as XLA:CPU did before the vocab-parallel head, exceeds this bound."""
    d, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    n, k, h, layers = (
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["head_dim"],
        shape["num_hidden_layers"],
    )
    mb_rows = rows // microbatches
    device_rows = mb_rows // fsdp
    grads = 3 * report["param_bytes_per_device"]
    logits = 8 * mb_rows * chunk * (v // fsdp) * 4
    layer_params = d * (n + 2 * k) * h + n * h * d + 3 * d * f + 2 * d
    weights = 2 * (4 + 2) * layer_params
    widest = max(tokens * f, n * tokens * tokens)
    activations = layers * device_rows * tokens * d * 4 + 16 * device_rows * widest * 4
    return grads + logits + weights + activations


def inspect_shape(folder, hf_config, overrides, microbatches):
    """inspect_step of a model folder holding only `hf_config`'s config.json, bf16 compute,
    remat full (the default), fsdp=8 on the 8 fake devices, reference KL on, plus `overrides`:
    {microbatch count: report}."""
    (folder / "config.json").write_text(json.dumps(hf_config))  # nothing else
    base = [
        f"model.path={folder}",
        "model.compute_dtype=bfloat16",
        "model.remat=full",
        "mesh.fsdp=8",
        "mesh.data=1",
        "loss.reference_policy_kl_penalty=0.1",
        *overrides,
    ]
    return {
        mb: inspect_step(load_config(TINY, [*base, f"grpo.num_microbatches={mb}"]))
        for mb in microbatches
    }


def test_moe_flops_count_the_experts_each_path_runs():
    """The tiny MoE step (8 experts, top-2): the compiled dense path (the cpu kernels: every
    expert on every token) equals `analytic_flops` with all 8 experts active; the reported
    analytic count is the one with 2 (what the grouped path runs)."""
    import dataclasses

    from jgrpo.inspect_step import analytic_flops
    from jgrpo.models import load_policy

    cfg = load_config(TINY, ["model.path=builtin:tiny-qwen3-moe"])
    report = inspect_step(cfg)
    model_cfg = load_policy(cfg.model, abstract=True).cfg
    spec = model_cfg.moe
    every = dataclasses.replace(model_cfg, moe=dataclasses.replace(spec, top_k=spec.num_experts))
    assert report["flops"] == pytest.approx(analytic_flops(cfg, every)["step"], rel=0.02)
    assert report["flops_analytic"] == analytic_flops(cfg, model_cfg)["step"]
    assert report["flops_analytic"] < 0.8 * report["flops"]
    assert report["num_active_params"] < report["num_params"]


@pytest.mark.heavy
def test_smollm2_shape_flops_and_memory_per_device(tmp_path):
    overrides = [
        "model.logprob_chunk_size=32",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=8",
        "rollout.prompt_bucket=16",
        "rollout.max_new_tokens=48",
    ]
    reports = inspect_shape(tmp_path, SMOLLM2_135M, overrides, (1, 2))
    one, two = reports[1], reports[2]
    assert one["num_params"] == 134_515_008  # SmolLM2-135M
    assert one["forwards"] == one["forwards_traced"] == ["ref", "prev", "policy"]
    # every trip counted: the microbatch count does not change the work
    assert one["flops_trip_counts_known"] and two["flops_trip_counts_known"]
    assert two["flops"] == pytest.approx(one["flops"], rel=0.02)
    assert one["flops"] == pytest.approx(one["flops_analytic"], rel=0.05)
    assert one["flops_xla_cost_analysis"] < 0.2 * one["flops"]  # XLA: each loop body once
    # float32 master weights split 8 ways (norms replicated), float32 Adam moments, bf16 ref
    assert 4 * 134_515_008 / 8 <= one["param_bytes_per_device"] < 4 * 134_515_008 / 7.9
    assert one["opt_state_bytes_per_device"] == pytest.approx(
        2 * one["param_bytes_per_device"], rel=0.001
    )
    assert one["ref_param_bytes_per_device"] == pytest.approx(
        one["param_bytes_per_device"] / 2, rel=0.001
    )
    # temporaries: within what the shapes need (`temp_bytes_bound`), and part of the peak
    for mb, report in reports.items():
        assert 0 < report["temp_bytes_per_device"] <= temp_bytes_bound(report, mb)
        assert report["temp_bytes_per_device"] < report["peak_bytes_per_device_estimate"]
    # the sampler's bf16 KV cache: rows x slots x (k and v) x layers x kv heads x head dim x 2,
    # rows = 16 and the 8 of the first narrowing (rollout.compact_decode)
    assert one["kv_cache_bytes"] == (16 + 8) * 64 * 2 * 30 * 3 * 64 * 2
    assert one["kv_cache_bytes_per_device"] == one["kv_cache_bytes"] // 8
    assert math.isfinite(one["flops"]) and one["flops"] > 0


QWEN25_1_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}


@pytest.mark.heavy  # make test: the SmolLM2 shape
def test_qwen25_1_5b_shape_fits_4_gib_of_temporaries_per_device(tmp_path):
    """The real-size claim: Qwen2.5-1.5B, bf16 compute, fsdp=8, 32 prompts x 8 generations of
    64 + 1024 tokens, reference KL on, defaults otherwise (remat full, chunks of 128)."""
    overrides = [
        "grpo.num_prompts_per_step=32",
        "grpo.num_generations_per_prompt=8",
        "rollout.prompt_bucket=64",
        "rollout.max_new_tokens=1024",
        # materialised attention (1088-token rows): the claim as first made
        "model.attention_block_size=2048",
    ]
    reports = inspect_shape(tmp_path, QWEN25_1_5B, overrides, (1, 8))
    one, eight = reports[1], reports[8]
    assert one["num_params"] == 1_543_714_304  # Qwen2.5-1.5B
    assert eight["forwards"] == ["ref", "prev", "policy"]
    assert eight["temp_bytes_per_device"] <= 4 * 2**30
    assert eight["flops_trip_counts_known"]
    assert eight["flops"] == pytest.approx(one["flops"], rel=0.02)


def test_lora_optimizer_bytes_add_up_to_the_adapter_shapes():
    """configs/tiny.yaml with rank-8 LoRA on all seven projections: every optimizer byte
    accounted for from the shapes. The tiny Qwen2 (d 64, f 128, 4 heads of 16, 2 kv heads,
    2 layers, vocab 264, tied, q/k/v biases) has 91,200 parameters; its adapters are
    r x (in + out) per projection per layer: 16,384, 17.96% of them (rank 8 is 1/8 of d,
    so the adapters are a large share of so small a model). Adam keeps mu and nu (float32)
    per trainable leaf: 2 x 4 bytes x trainable params; the scalars are inject_hyperparams'
    count and three hyperparameters, adam's count and the schedule's count (6 x 4 bytes,
    replicated; with mesh.data=-1 every leaf is replicated, so per device = whole)."""
    d, f, n, k, h, layers, v, r = 64, 128, 4, 2, 16, 2, 264, 8
    per_layer = d * (n + 2 * k) * h + n * h * d + 3 * d * f + 2 * d + (n + 2 * k) * h
    full_params = v * d + layers * per_layer + d
    qkvo = (d + n * h) + 2 * (d + k * h) + (n * h + d)
    adapters = layers * r * (qkvo + 2 * (d + f) + (f + d))
    assert (full_params, adapters) == (91_200, 16_384)
    scalars = 6 * 4
    full = inspect_step(load_config(TINY, []), compile=False)
    lora = inspect_step(load_config(TINY, ["model.lora.rank=8"]), compile=False)
    assert full["num_trainable_params"] == full_params
    assert lora["num_trainable_params"] == adapters
    assert lora["num_params"] == full_params + adapters
    assert full["opt_state_bytes_per_device"] == 2 * 4 * full_params + scalars
    assert lora["opt_state_bytes_per_device"] == 2 * 4 * adapters + scalars
    assert lora["trainable_param_bytes_per_device"] == 4 * adapters
    ratio = lora["opt_state_bytes_per_device"] / full["opt_state_bytes_per_device"]
    assert ratio == pytest.approx(adapters / full_params, rel=1e-3)  # 18%, not 10%


@pytest.mark.slow
@pytest.mark.heavy  # in make test: test_precision's layer-stack test
def test_qwen25_1_5b_shape_pure_bf16_fits_4_gib_of_temporaries_per_device(tmp_path):
    """The same 1.5B shape with pure bf16 parameters (model.dtype=bfloat16) against float32
    master weights (mixed precision). XLA:CPU slices a bfloat16 array in float32: a loop over a
    bfloat16 stack works on a float32 copy of the whole stack, made before the loop. The layer
    loop slices uint16 views instead: of the stored weights (otherwise pure bf16 holds a float32
    copy of its parameters, 4 bytes x params per device) and, with remat, of the stacked
    layer inputs that the backward reads (otherwise held as float32 in both modes: 0.7 GiB per
    device here, which kept mixed precision above 3.5 GiB). What pure bf16 still adds over
    mixed precision: XLA:CPU materialises the weights' uint16 views (2 bytes x params) and
    copies its bfloat16 embedding to float32 (the token gather, the head's relayout), against
    its bfloat16 (not float32) per-microbatch layer gradients (docs/performance.md)."""
    overrides = [
        "grpo.num_prompts_per_step=32",
        "grpo.num_generations_per_prompt=8",
        "rollout.prompt_bucket=64",
        "rollout.max_new_tokens=1024",
    ]
    (tmp_path / "mixed").mkdir()
    (tmp_path / "bf16").mkdir()
    mixed = inspect_shape(tmp_path / "mixed", QWEN25_1_5B, overrides, (8,))[8]
    pure = [*overrides, "model.dtype=bfloat16"]
    bf16 = inspect_shape(tmp_path / "bf16", QWEN25_1_5B, pure, (8,))[8]
    assert bf16["param_dtype"] == "bfloat16" and mixed["param_dtype"] == "float32"
    view = bf16["param_bytes_per_device"]  # the uint16 view: 2 bytes x params per device
    float32_copy = 2 * view
    assert float32_copy == mixed["param_bytes_per_device"]
    extra = bf16["temp_bytes_per_device"] - mixed["temp_bytes_per_device"]
    assert 0 < extra < float32_copy  # no float32 copy of the parameters
    assert mixed["temp_bytes_per_device"] <= 3.5 * 2**30  # no float32 stack of layer inputs
    assert bf16["temp_bytes_per_device"] <= 4 * 2**30


def test_kv_cache_bytes_with_decode_slots():
    """The sampler's KV cache by hand for the tiny config (float32, 2 layers, 2 kv heads of 16,
    4 x 4 rows, prompt bucket 16, 8 new tokens: 16 + 8 - 1 slots rounded up to 32): every row,
    or rollout.decode_slots rows and the staged prompt's; with rollout.compact_decode (the
    default) also the half of them the first narrowing gathers while the wider cache is live."""
    per_row = 32 * 2 * 2 * 2 * 16 * 4  # slots x (k, v) x layers x kv heads x head dim x bytes
    for compact, narrowed in (("true", 1), ("false", 0)):
        compact = f"rollout.compact_decode={compact}"
        rows = inspect_step(load_config(TINY, [compact]), compile=False)
        slots = inspect_step(load_config(TINY, [compact, "rollout.decode_slots=4"]), compile=False)
        assert rows["kv_cache_bytes"] == (16 + 8 * narrowed) * per_row
        assert slots["kv_cache_bytes"] == (4 + 1 + 2 * narrowed) * per_row


def test_packing_report_counts_tokens_by_hand():
    """64 rows (16 prompts x 4) of 4 prompt tokens and completions 1, 12, 3, 6 (repeated), 12
    new tokens at most, 8 devices: real = 64 x 4 + 16 x (1 + 12 + 3 + 6) = 608 tokens; padded
    = 64 x 16 = 1024. Packed into rows of 16 (first-fit decreasing on the row lengths 16, 10,
    7, 5): each 16 alone, each 10 with a 5, the 7s two by two: 16 + 16 + 8 = 40 rows, a
    multiple of the 8 devices (no bucket rounding), 640 tokens."""
    cfg = load_config(
        TINY,
        [
            "grpo.num_prompts_per_step=16",
            "rollout.prompt_bucket=4",
            "rollout.max_new_tokens=12",
        ],
    )
    report = inspect_step(cfg, compile=False, lengths="1,12,3,6")
    assert report["tokens_real"] == 608
    assert report["tokens_padded"] == 1024
    assert (report["packed_rows"], report["packed_width"]) == (40, 16)
    assert report["tokens_packed"] == 640
    # every row's own tokens, squares and generated tokens vs 40 full rows: fewer flops
    assert report["flops_real_analytic"] < report["flops_packed_analytic"]
    assert report["flops_packed_analytic"] < 0.7 * report["flops_padded_analytic"]


def test_length_distributions():
    from jgrpo.config import ConfigError
    from jgrpo.inspect_step import completion_lengths

    skewed = completion_lengths("skewed", 128, 256, seed=0)
    assert np.median(skewed) == 32 and skewed.max() == 256 and skewed.min() >= 1
    assert 2 <= (skewed == 256).sum() <= 4  # a few reach the cap
    np.testing.assert_array_equal(skewed, completion_lengths("skewed", 128, 256, seed=0))
    assert (completion_lengths("uniform", 5, 7) == 7).all()
    np.testing.assert_array_equal(completion_lengths("2,5", 5, 7), [2, 5, 2, 5, 2])
    with pytest.raises(ConfigError, match="--lengths: every length must lie in"):
        completion_lengths("2,9", 5, 7)
    with pytest.raises(ConfigError, match="not uniform, skewed or a comma list"):
        completion_lengths("long", 5, 7)


@pytest.mark.heavy  # make test: test_packing_report_counts_tokens_by_hand (sizes only)
@pytest.mark.parametrize(
    "head",
    [
        [],  # 64 scored positions: the LM head in one chunk (no recompute), data-parallel
        ["model.logprob_chunk_size=32", "mesh.data=1", "mesh.fsdp=8"],  # two, vocab-parallel
    ],
    ids=["one_chunk", "two_chunks_fsdp"],
)
def test_packing_report_compiled_flops_match_the_shapes(head):
    """The compiled unpacked and packed steps' matmul flops equal `analytic_flops` of their
    layouts (B rows of T; packed rows of the budget, the LM head over their scored slots), with
    the head's chunks rematerialised (two chunks) or not (one)."""
    overrides = ["grpo.num_prompts_per_step=16", "rollout.prompt_bucket=8", *head]
    cfg = load_config(TINY, [*overrides, "rollout.max_new_tokens=64"])
    report = inspect_step(cfg, lengths="skewed")
    assert report["flops_padded"] == report["flops_padded_analytic"] == report["flops"]
    assert report["flops_packed"] == report["flops_packed_analytic"]
    assert report["flops_packed"] < 0.5 * report["flops_padded"]


# ----------------------------------------------------------------------------- text and verdict

GIB = 2**30


@pytest.mark.parametrize(
    "text, size",
    [
        ("80GB", 80 * 10**9),
        ("80GiB", 80 * GIB),
        ("80 gib", 80 * GIB),
        ("16000MB", 16 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("2TB", 2 * 10**12),
    ],
)
def test_device_memory_sizes(text, size):
    assert parse_device_memory(text) == size


@pytest.mark.parametrize("text", ["80", "80XB", "GB", "-1GB", "0GB", "eighty GB", "80 G B", ""])
def test_malformed_device_memory_is_refused(text):
    with pytest.raises(
        ConfigError,
        match=r"^--device-memory: .* is not a size: a positive number and one of the units",
    ):
        parse_device_memory(text)


def test_malformed_device_memory_exits_2_before_the_config_is_read(capsys):
    """The flag is checked first: a missing config file is not even looked at."""
    argv = ["inspect-step", "--config", "/nonexistent/c.yaml", "--device-memory", "80XB"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "jgrpo: error: --device-memory: '80XB' is not a size: a positive number and one of the "
        "units MB, GB, TB, MiB, GiB, TiB (such as 80GiB)"
    ]


REPORT = {
    "mesh": {"data": 1, "fsdp": 8, "tensor": 1},
    "num_params": 494_032_768,
    "num_active_params": 3_353_032_704,
    "num_trainable_params": 7_615_616_512,
    "param_dtype": "float32",
    "param_bytes_per_device": 2 * GIB + GIB // 2,
    "opt_state_bytes_per_device": 5 * GIB,
    "ref_param_bytes_per_device": 0,
    "kv_cache_bytes_per_device": GIB,
    "reward_model_bytes_per_device": 3 * 2**20,
    "flops": 3.2104e15,
    "flops_analytic": 4.5e11,
    "flops_trip_counts_known": True,
    "dot_ops": 1234,
    "forwards": ["ref", "policy"],
    "temp_bytes_per_device": 20 * GIB,
    "peak_bytes_per_device_estimate": 30 * GIB,
    "seconds": 12.34,
}


def test_text_report_uses_human_units():
    lines = dict(line.split(None, 1) for line in format_report(REPORT).splitlines())
    assert list(lines) == list(REPORT)  # the --json keys, in order
    assert lines == {
        "mesh": "data 1 x fsdp 8 x tensor 1",
        "num_params": "494.0M (494,032,768)",
        "num_active_params": "3.35B (3,353,032,704)",
        "num_trainable_params": "7.62B (7,615,616,512)",
        "param_dtype": "float32",
        "param_bytes_per_device": "2.50 GiB",
        "opt_state_bytes_per_device": "5.00 GiB",
        "ref_param_bytes_per_device": "0 B",
        "kv_cache_bytes_per_device": "1.00 GiB",
        "reward_model_bytes_per_device": "3.00 MiB",
        "flops": "3,210 TFLOP",
        "flops_analytic": "450 GFLOP",
        "flops_trip_counts_known": "True",
        "dot_ops": "1,234",
        "forwards": "ref, policy",
        "temp_bytes_per_device": "20.00 GiB",
        "peak_bytes_per_device_estimate": "30.00 GiB",
        "seconds": "12.3 s",
    }


def verdict(report, text):
    last = format_report(report, (parse_device_memory(text), text)).splitlines()[-1]
    key, line = last.split(None, 1)
    assert key == "verdict"
    return line


def test_verdict_against_a_device_size():
    """Needs: the peak (30 GiB) + the KV cache share (1 GiB) + reward models (3 MiB)."""
    # 80 GB = 74.51 GiB: 74.505806 - 31.00293 = 43.502876 GiB left, 58% of the device
    assert verdict(REPORT, "80GB") == (
        "fits: each device needs 31.00 GiB of 80GB (74.51 GiB), 43.50 GiB (58%) left"
    )
    # 16 GB = 14.90 GiB: 31.00293 - 14.901161 = 16.101768 GiB over
    assert verdict(REPORT, "16GB") == (
        "does not fit: each device needs 31.00 GiB of 16GB (14.90 GiB), 16.10 GiB over"
    )
    assert verdict(REPORT, "31GiB").startswith("does not fit:")  # 3 MiB over
    # without compiling: params + optimizer + reference + KV + reward models, a lower bound
    sizes_only = {
        k: v
        for k, v in REPORT.items()
        if k not in ("temp_bytes_per_device", "peak_bytes_per_device_estimate")
    }
    assert verdict(sizes_only, "16GB") == (
        "may fit (without compiling, temporaries are not counted): each device needs at least "
        "8.50 GiB of 16GB (14.90 GiB), 6.40 GiB (43%) left"
    )


def test_cli_prints_the_verdict_in_text_and_json(capsys):
    """The tiny config through the CLI, sizes only: text with human units and the verdict;
    --json keeps inspect-step's keys and adds the device's."""
    base = ["inspect-step", "--config", TINY, "--no-compile"]
    assert cli.main([*base, "--device-memory", "1MB"]) == 0
    out = capsys.readouterr().out
    assert "param_bytes_per_device" in out and "KiB" in out and "{" not in out
    assert out.strip().splitlines()[-1].startswith("verdict")
    assert "does not fit: each device needs at least" in out and "of 1MB (976.56 KiB)" in out
    assert cli.main([*base, "--device-memory", "80GB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_active_params"] == report["num_params"] > 0  # dense: every weight runs
    need = sum(
        report[k]
        for k in (
            "param_bytes_per_device",
            "opt_state_bytes_per_device",
            "ref_param_bytes_per_device",
            "kv_cache_bytes_per_device",
            "reward_model_bytes_per_device",
        )
    )
    assert report["device_memory_bytes"] == 80 * 10**9
    assert report["device_bytes_needed"] == need
    assert report["device_fits"] is False  # temporaries unknown without compiling
