"""Packed sequences (grpo.sequence_packing): the host packer against hand-worked layouts; the
packed train step against the unpacked one (loss, every metric and the gradients within 1e-6,
float32, tiny model) on one device, on a 2 x 2 x 2 mesh and with LoRA, over the loss options the
loss and step tests sweep; the number of programs a run compiles."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY_MODEL_FIELDS, make_rollout_batch
from flax import nnx
from test_step import BASE as STEP_BASE

from jgrpo import packing, sharding, step, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import ConfigError, load_config
from jgrpo.models import Transformer, TransformerConfig
from jgrpo.models.adapters import attach_lora
from jgrpo.models.lora import MODULES, LoRASpec

MODEL = TransformerConfig(**TINY_MODEL_FIELDS)
WIDTH = 24
"""Row width of the step tests' batches: a 5-column prompt bucket and up to 19 new tokens."""
BASE = [*STEP_BASE, f"rollout.max_new_tokens={WIDTH - 5}"]
"""test_step's overrides (4 prompts x 4, completions from column 5), the cap of WIDTH."""


# ----------------------------------------------------------------------------- the packer


def lengths_batch(prompts, completions, width, holes=()):
    """A host TrainBatch of left-padded prompts (`prompts[b]` tokens ending at column P =
    max(prompts)) and completions (`completions[b]` tokens from column P); token ids are
    100 x row + column; `holes` = (row, column) tool tokens: real, not generated."""
    b, p = len(prompts), max(prompts)
    cols = np.arange(width)
    real = (cols >= p - np.asarray(prompts)[:, None]) & (
        cols < p + np.asarray(completions)[:, None]
    )
    gen = real & (cols >= p)
    for i, c in holes:
        gen[i, c] = False
    return TrainBatch(
        input_ids=np.where(real, 100 * np.arange(b)[:, None] + cols, 0).astype(np.int32),
        attention_mask=real.astype(np.float32),
        token_mask=gen.astype(np.float32),
        generation_logprobs=np.where(gen, -1.0, 0.0).astype(np.float32),
        rewards=np.arange(b, dtype=np.float32),
        group_ids=np.zeros(b, np.int32),
        sample_mask=np.ones(b, np.float32),
    )


def spec(width=None, scored=8, minibatches=1, quantum=1):
    return packing.PackSpec(
        width=width, scored_width=scored, num_minibatches=minibatches, row_quantum=quantum
    )


def test_first_fit_decreasing_layout_by_hand():
    """Rows of 2+2, 1+6, 2+1, 2+5, 2+3 real tokens into packed rows of 10 tokens: decreasing
    length 7 (row 1), 7 (row 3), 5 (row 4), 4 (row 0), 3 (row 2); row 1 opens packed row 0,
    row 3 packed row 1 (7 + 7 > 10), row 4 packed row 2, row 0 fits nowhere before packed row
    2 (7 + 4 > 10, 5 + 4 <= 10), row 2 goes to packed row 0 (7 + 3 = 10)."""
    batch = lengths_batch([2, 1, 2, 2, 2], [2, 6, 1, 5, 3], 10, holes=[(3, 4)])
    out = packing.pack_batch(batch, spec())
    lay = out.layout
    assert out.rows is batch
    np.testing.assert_array_equal(lay.row, [2, 0, 0, 1, 2])
    np.testing.assert_array_equal(lay.slot, [3, 0, 6, 0, 0])
    seg = lambda *parts: sum(([s] * n for s, n in parts), [])
    np.testing.assert_array_equal(
        lay.segment_ids[:3],
        [
            seg((1, 7), (2, 3)),
            seg((1, 7), (0, 3)),
            seg((1, 5), (2, 4), (0, 1)),
        ],
    )
    np.testing.assert_array_equal(lay.positions[0], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2])
    np.testing.assert_array_equal(lay.positions[2], [0, 1, 2, 3, 4, 0, 1, 2, 3, 0])
    # tokens: row 1 = columns 1..7, row 2 = columns 0..2 (the prompt is left-padded to 2)
    np.testing.assert_array_equal(
        lay.input_ids[0], [101, 102, 103, 104, 105, 106, 107, 200, 201, 202]
    )
    np.testing.assert_array_equal(lay.input_ids[2], [400, 401, 402, 403, 404, 0, 1, 2, 3, 0])
    # scored: row 1's 6 tokens at packed 1..6, row 2's one at 9; row 3's hole (column 4:
    # its third completion token) is skipped: packed positions 2, 3, 5, 6
    np.testing.assert_array_equal(lay.scored[0], [1, 2, 3, 4, 5, 6, 9, 0])
    np.testing.assert_array_equal(lay.scored[1], [2, 3, 5, 6, 0, 0, 0, 0])
    np.testing.assert_array_equal(lay.scored[2], [2, 3, 4, 7, 8, 0, 0, 0])
    assert lay.input_ids.shape == (3, 10) and lay.scored.shape == (3, 8)


def test_minibatches_pack_their_own_rows_and_counts_are_bucketed():
    """Two minibatches (rows 0, 2, 4, ... and 1, 3, 5, ...): every row's packed row is in its
    minibatch (packed row mod 2 = row mod 2); the count is the largest need, bucketed."""
    prompts = [2] * 12
    completions = [8, 1, 1, 1, 1, 8, 8, 1, 8, 1, 8, 8]  # minibatch 0: four 10s and two 3s
    out = packing.pack_batch(lengths_batch(prompts, completions, 10), spec(minibatches=2))
    np.testing.assert_array_equal(out.layout.row % 2, np.arange(12) % 2)
    assert out.layout.input_ids.shape[0] == 2 * 5  # minibatch 0 needs 5 (bucket 5)
    out = packing.pack_batch(
        lengths_batch(prompts, completions, 10), spec(minibatches=2, quantum=2)
    )
    assert out.layout.input_ids.shape[0] == 2 * 6  # 5 -> 3 quanta of 2 rows
    assert packing.row_buckets(128) == (
        *range(1, 9),
        10,
        12,
        14,
        16,
        20,
        24,
        28,
        32,
        40,
        48,
        56,
        64,
        80,
        96,
        112,
        128,
    )
    for n in (1, 3, 8, 9, 100, 1000, 65536):
        buckets = np.asarray(packing.row_buckets(n))
        assert len(buckets) <= 4 * np.log2(n) + 1
        need = np.arange(1, n + 1)
        taken = buckets[np.searchsorted(buckets, need)]  # the smallest bucket >= need
        assert (taken <= 1.25 * need).all()
        assert packing.bucket_units(n // 2 + 1, n) == taken[n // 2]


def test_packing_refuses_what_it_cannot_reproduce():
    """A generated token after padding, a row past the budget, more generated tokens than the
    scored slots: a ValueError naming the cause (never different numbers)."""
    batch = lengths_batch([2, 2], [3, 3], 8)
    assert packing.pack_batch(batch, spec()) is not None
    gap = dict(batch.as_dict(), attention_mask=batch.attention_mask.copy())
    gap["attention_mask"][0, 2] = 0.0  # the column before a generated token
    gap["token_mask"] = batch.token_mask.copy()
    gap["token_mask"][0, 2] = 0.0
    with pytest.raises(ValueError, match="no real token before it"):
        packing.pack_batch(TrainBatch(**gap), spec())
    with pytest.raises(ValueError, match="packing_budget = 4: a row of 5 real tokens"):
        packing.pack_batch(batch, spec(width=4))
    with pytest.raises(ValueError, match="3 generated tokens, more than rollout.max_new_tokens"):
        packing.pack_batch(batch, spec(scored=2))


def test_packing_config_keys_are_checked():
    cfg = load_config(None, ["grpo.sequence_packing=true", "grpo.packing_budget=300"])
    assert cfg.grpo.packing_budget == 300
    with pytest.raises(ConfigError, match="grpo.packing_budget: set, but grpo.sequence_packing"):
        load_config(None, ["grpo.sequence_packing=false", "grpo.packing_budget=300"])
    with pytest.raises(ConfigError, match=r"grpo.packing_budget: must lie in \[.* = 288"):
        load_config(None, ["grpo.sequence_packing=true", "grpo.packing_budget=100"])


# ----------------------------------------------------------------------------- the packed step


def host_batch(seed=0):
    """make_rollout_batch at WIDTH columns with multi-turn holes (tool tokens inside some
    completions: attention 1, token_mask 0), one row out of the loss (sample_mask 0) and one
    padding row (group id -1): ragged rows that pack two or three to a packed row."""
    host = make_rollout_batch(seed, total_len=WIDTH)
    for i in (1, 6, 11):
        cols = np.flatnonzero(host["token_mask"][i])
        host["token_mask"][i, cols[1:3]] = 0.0
    host["sample_mask"][3] = 0.0
    host["group_ids"][9] = -1
    return host


def randomize_adapters(model, std=0.05):
    """Nonzero LoRA B (fresh adapters leave the policy equal to the reference)."""
    rng = np.random.RandomState(0)
    for p in model.lora.values():
        p[...] = jnp.asarray(rng.normal(0, std, p[...].shape), jnp.float32)


def build(overrides, packed, mesh_shape=(1, 1, 1), lora=False):
    adapters = ["model.lora.rank=4", "model.lora.alpha=8.0"] if lora else []
    cfg = load_config(None, [*BASE, *overrides, *adapters, f"grpo.sequence_packing={packed}"])
    data, fsdp, tensor = mesh_shape
    mesh_cfg = dataclasses.replace(cfg.mesh, data=data, fsdp=fsdp, tensor=tensor)
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[: data * fsdp * tensor])
    model = Transformer(MODEL, rngs=nnx.Rngs(0), init_scale=0.2)
    if lora:
        spec = LoRASpec(rank=4, alpha=8.0, target_modules=tuple(MODULES))
        model = attach_lora(model, spec, jax.random.key(0))
        randomize_adapters(model)
    return step_setup.build_step(cfg.replace(mesh=mesh_cfg), model, mesh=mesh)


def step_math(overrides, packed, mesh_shape=(1, 1, 1), lora=False, seed=0):
    """(first minibatch's float32 gradients, every metric of the frozen forwards, masking,
    advantages and that minibatch's loss) of one step, packed or not."""
    built = build(overrides, packed, mesh_shape, lora)
    # a reference that differs from the policy, so the KL terms are not 0 (LoRA: the base)
    ref = None if lora else jax.tree.map(lambda x: x * 0.9, built.state.params)
    return batch_math(built, TrainBatch(**host_batch(seed)), ref)


def batch_math(built, host, ref):
    """step_math's numbers for the step `built` on the host batch `host`."""
    flags, graphdef, hp = built.flags, built.graphdef, built.hparams
    batch = built.device_batch(host)

    @jax.jit
    def grads_of(state, batch, ref, frozen):
        full = state._replace(params=step.with_frozen(state.params, frozen))
        ref = step.with_frozen(ref, frozen)
        data, metrics = step.prepare_batch(full, batch, hp, ref, flags=flags, graphdef=graphdef)
        first = jax.tree.map(lambda x: x[0], step.chunk_rows(data, flags.num_minibatches))
        grads, loss_metrics = step.accumulate_gradients(
            state.params, first, hp, flags=flags, graphdef=graphdef, frozen=frozen
        )
        return grads, metrics | loss_metrics

    grads, metrics = grads_of(built.state, batch, ref, built.frozen)
    return jax.tree.map(np.asarray, grads), {k: float(v) for k, v in metrics.items()}


def assert_same(packed, unpacked):
    (g1, m1), (g0, m0) = packed, unpacked
    assert set(m1) == set(m0)
    for key in sorted(m0):
        np.testing.assert_allclose(m1[key], m0[key], rtol=1e-6, atol=1e-6, err_msg=key)
    assert max(np.abs(g).max() for g in jax.tree.leaves(g0)) > 1e-3  # a real gradient
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), g1, g0)


CLIP = ["loss.ratio_clip_min=0.1", "loss.ratio_clip_max=0.28"]
KL = ["loss.reference_policy_kl_penalty=0.1"]
TIS = [
    "loss.use_importance_sampling_correction=true",
    "loss.truncated_importance_sampling_ratio=1.5",
    "loss.truncated_importance_sampling_ratio_min=0.5",
]
LOSS_OPTIONS = {
    "ppo_clip": [],
    "asymmetric_clip": CLIP,
    "dual_clip": ["loss.ratio_clip_c=3.0"],
    "reinforce": ["loss.disable_ppo_ratio=true"],
    "force_on_policy": ["loss.force_on_policy_ratio=true", *KL],
    "force_on_policy_threshold": [
        "loss.force_on_policy_ratio=true",
        "grpo.seq_logprob_error_threshold=9.0",
    ],
    "threshold": ["grpo.seq_logprob_error_threshold=9.0", *KL],
    "gspo": ["loss.sequence_level_importance_ratios=true", "loss.aggregation=seq_mean"],
    "seq_mean": ["loss.aggregation=seq_mean", *KL],
    "dr_grpo": ["loss.aggregation=seq_sum_norm", "grpo.advantage.estimator=dr_grpo", *KL],
    "kl_k1": [*KL, "loss.reference_policy_kl_type=k1"],
    "kl_k2": [*KL, "loss.reference_policy_kl_type=k2", "loss.kl_output_clamp_value=0.05"],
    "kl_k3_on_policy_approx": [*KL, "loss.use_on_policy_kl_approximation=true"],
    "is": ["loss.use_importance_sampling_correction=true"],
    "is_tis": [*TIS, "loss.truncated_importance_sampling_type=tis"],
    "is_icepop": [*TIS, "loss.truncated_importance_sampling_type=icepop"],
    "is_seq_mask_tis": [
        # the tiny random model's logprobs (about -4.8) lie far below host_batch's generation
        # logprobs (-3 to -1): its rows' exp(mean_t(lo - lg)) lie in 0.04..0.17, so this
        # window keeps some rows and masks some on either side ([0.5, 1.5] masks them all)
        "loss.use_importance_sampling_correction=true",
        "loss.truncated_importance_sampling_ratio=0.12",
        "loss.truncated_importance_sampling_ratio_min=0.07",
        "loss.truncated_importance_sampling_type=seq-mask-tis",
    ],
    "gspo_is_tis": [
        "loss.sequence_level_importance_ratios=true",
        "loss.aggregation=seq_mean",
        *TIS,
        "loss.truncated_importance_sampling_type=tis",
    ],
    "leave_one_out": ["grpo.advantage.use_leave_one_out_baseline=true", *KL],
    "reinforce_pp_kl_in_reward": [
        "grpo.advantage.estimator=reinforce_plus_plus",
        "loss.use_kl_in_reward=true",
        *KL,
        "grpo.advantage.advantage_clip_low=-2.0",
    ],
}
"""The loss options of tests/test_losses.py and tests/test_step.py, as step overrides."""


def test_packed_step_equals_the_unpacked_step():
    """make test's representative: LoRA on the 2 x 2 x 2 mesh, a loss of per-sequence parts
    (GSPO's ratio and IS weight with tis, seq_mean, logprob-error masking), two packed
    microbatches, multi-turn holes in the token mask."""
    overrides = [
        *LOSS_OPTIONS["gspo_is_tis"],
        "grpo.seq_logprob_error_threshold=9.0",
        "grpo.num_microbatches=2",
    ]
    unpacked = step_math(overrides, False, (2, 2, 2), lora=True)
    assert 0 < unpacked[1]["logprob/num_masked_seqs_by_logprob_error"] < 15  # it masks
    assert_same(step_math(overrides, True, (2, 2, 2), lora=True), unpacked)


PLACEMENTS = {
    "one_device": ((1, 1, 1), False),
    "mesh_2x2x2": ((2, 2, 2), False),
    "lora": ((1, 1, 1), True),
}


@pytest.mark.heavy  # make test: test_packed_step_equals_the_unpacked_step (LoRA on the mesh)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("option", LOSS_OPTIONS)
def test_every_loss_option_packs_exactly(option, placement):
    """Packed with two microbatches = unpacked with one (one device, LoRA) or two (the mesh:
    a chunk's rows must split over its 4 batch devices)."""
    mesh_shape, lora = PLACEMENTS[placement]
    micro = ["grpo.num_microbatches=2"]
    unpacked = step_math(
        LOSS_OPTIONS[option] + (micro if placement == "mesh_2x2x2" else []), False, mesh_shape, lora
    )
    if option == "is_seq_mask_tis":  # is/oob_ratio: the share of rows the mask drops
        assert 0 < unpacked[1]["is/oob_ratio"] < 1
    assert_same(step_math(LOSS_OPTIONS[option] + micro, True, mesh_shape, lora), unpacked)


def sgd_step(built):
    """`built`'s jitted train step and a fresh state with clipped SGD in place of the config's
    clipped AdamW (learning rate and clip norm from the step's hparams, as AdamW's)."""
    tx = optax.inject_hyperparams(
        lambda learning_rate, max_grad_norm: optax.chain(
            optax.clip_by_global_norm(max_grad_norm), optax.sgd(learning_rate)
        ),
        hyperparam_dtype=jnp.float32,
    )(learning_rate=0.0, max_grad_norm=0.0)
    state = step_setup.init_train_state(built.state.params, tx)
    return step.make_train_step(built.flags, built.graphdef, tx), state


@pytest.mark.heavy  # make test: test_packed_step_equals_the_unpacked_step
def test_minibatches_pack_exactly():
    """Two minibatches (two optimizer updates) with two microbatches each, through the jitted
    step itself: every metric (both updates' grad norms included) and the new parameters.

    The optimizer is SGD (clipped), not AdamW: Adam's first update is g / (|g| + eps) per
    coordinate, so a gradient near eps = 1e-8 turns float rounding into parameter changes of
    O(lr). Measured on this batch with AdamW: the first update's gradients agree to 5e-7 of
    each leaf's largest (norms to 4e-8), yet one coordinate whose gradient is -2.56e-9
    unpacked and -2.21e-9 packed moves 1.25e-5 apart (clipped by 1/2.29: 0.1007 vs 0.0882 of
    lr 1e-3), and the second minibatch's ratio/max then differs by 8e-6; from the same
    parameters its metrics agree to 1e-7 relative. SGD's update is linear in the gradient, so
    rounding stays rounding, while rows in the wrong minibatch or the second update from the
    wrong parameters change the numbers (at a learning rate of 0.1, packed as one minibatch, 12
    metrics differed, loss/pg 2.62 vs 0.072).
    The learning rate is 0.015: the second update is off-policy (ratio spread > 0.05) and the
    rounding stays inside 1e-6 with or without AVX-512 (at 0.05 a CPU without it was 2.3e-6
    off on ratio/clamped_max, 2026-12-07). With SGD the updated parameters agree to 1.2e-7 (an
    ulp), and the second minibatch's ratio = exp(lp - prev) carries its logprobs' rounding,
    whose ulp at |lp| ~ 5 is 4.8e-7: ratio/max differed by 1.9e-6 relative at 0.1 and 9.6e-7
    at 0.05 on an AVX-512 CPU (linear in the update's size), though CI had passed it at 0.1."""
    overrides = [
        *KL,
        "grpo.num_minibatches=2",
        "grpo.num_microbatches=2",
        "optim.learning_rate=0.015",
    ]
    out = {}
    for packed in (False, True):
        built = build(overrides, packed)
        step_fn, state = sgd_step(built)
        ref = jax.tree.map(lambda x: x * 0.9, built.state.params)
        batch = built.device_batch(TrainBatch(**host_batch()))
        state, metrics = step_fn(state, batch, built.hparams, ref)
        out[packed] = (
            jax.tree.map(np.asarray, state.params),
            {k: float(v) for k, v in metrics.items()},
        )
    assert out[False][1]["ratio/max"] - out[False][1]["ratio/min"] > 0.05  # off-policy
    assert out[True][1].keys() == out[False][1].keys()
    for key, value in out[False][1].items():
        np.testing.assert_allclose(out[True][1][key], value, rtol=1e-6, atol=1e-6, err_msg=key)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
        *(out[p][0] for p in (True, False)),
    )


def count_batches(needs):
    """Host batches whose rows need `needs[i]` packed rows of WIDTH: that many full rows, the
    others empty (group id -1)."""
    out = []
    for seed, need in enumerate(needs):
        host = host_batch(seed)
        mask = np.zeros_like(host["attention_mask"])
        mask[:need] = 1.0
        host.update(
            attention_mask=mask,
            token_mask=mask * (np.arange(WIDTH) >= 5),
            group_ids=np.where(mask.any(1), host["group_ids"], -1).astype(np.int32),
        )
        out.append(TrainBatch(**host))
    return out


def test_packed_row_buckets_bound_the_programs_of_a_jit():
    """Batches needing 2, 2, 5, 9 and 11 packed rows take 2, 2, 5, 10 and 12 (the buckets of
    16 rows): a jit over the packed batch compiles one program per bucket, four here. (The
    train step's own jit: test_packed_step_compiles_once_per_bucket, make test-all.)"""
    pack = packing.PackSpec(width=None, scored_width=WIDTH - 5, num_minibatches=1, row_quantum=1)
    probe = jax.jit(lambda batch: jnp.sum(batch.layout.scored) + jnp.sum(batch.rows.token_mask))
    rows = []
    for host in count_batches([2, 2, 5, 9, 11]):
        batch = packing.pack_batch(host, pack)
        rows.append(batch.layout.input_ids.shape[0])
        assert float(probe(batch)) > 0
    assert rows == [2, 2, 5, 10, 12]
    assert probe._cache_size() == 4 <= len(packing.row_buckets(16))


@pytest.mark.heavy  # make test: test_packed_row_buckets_bound_the_programs_of_a_jit
def test_packed_step_compiles_once_per_bucket():
    """The jitted train step on batches needing 2, 2, 5 and 9 packed rows (run as 2, 2, 5, 10):
    three programs."""
    built = build([], True)
    for host in count_batches([2, 2, 5, 9]):
        state, metrics = built.step_fn(built.state, built.device_batch(host), built.hparams, None)
        built = dataclasses.replace(built, state=state)
        assert np.isfinite(float(metrics["loss/total"]))
    assert built.step_fn.top_level._cache_size() == 3


@pytest.mark.heavy  # make test: test_packed_step_equals_the_unpacked_step
def test_a_packed_run_logs_the_unpacked_runs_metrics(tmp_path, monkeypatch):
    """Two steps of `jgrpo.train.run` on configs/tiny.yaml (sampler, rewards, the step in the
    loop) with the rows packed up to three to a packed row (a 48-token budget) log the metrics
    of the same run unpacked, step by step. A length reward makes the groups informative (the
    untrained model solves nothing: the gradient would be 0)."""
    from pathlib import Path

    from jgrpo import train
    from jgrpo.metrics import read_metrics

    (tmp_path / "length_reward.py").write_text(
        "def length(prompts, completions, **columns):\n"
        "    return [float(len(c) % 3) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    quiet = [
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "logging.tensorboard=false",
        "data.task_reward_weight=0.0",
        "data.reward_functions=[{function: 'length_reward:length'}]",
    ]
    rows = {}
    for packed in (False, True):
        extra = ["grpo.packing_budget=48"] if packed else ["grpo.sequence_packing=false"]
        cfg = load_config(tiny, [*quiet, "grpo.max_num_steps=2", *extra])
        train.run(cfg, tmp_path / f"packed_{packed}")
        rows[packed] = read_metrics(tmp_path / f"packed_{packed}")
    assert len(rows[True]) == len(rows[False]) == 2
    assert all(r["train/grad_norm"] > 1e-3 for r in rows[False])
    for unpacked, packed in zip(rows[False], rows[True]):
        for key, value in unpacked.items():
            if isinstance(value, float) and not key.startswith("perf/"):
                assert packed[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
