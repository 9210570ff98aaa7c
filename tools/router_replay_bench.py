"""Router replay, measured: how often the trainer routes a generated token to other experts
than the sampler did, and what that does to the logprobs, with and without
model.moe.router_replay (docs/moe.md "Router replay").

One rollout per model: `sampling.generate` with the experts recorded (`record_experts`) on
random prompts of the character vocabulary, `--rows` rows of up to `--tokens` new tokens at
temperature 1, in `--dtype` compute (float32 master weights, as a GPU run keeps them). The
same batch then goes through the train step's prepare_batch and gradient pass (compiled with
the step's XLA options; one device, one minibatch: the same weights as the sampler) twice:
with model.moe.record_routing (the trainer routes by its own router, the recorded experts
only compared) and with
model.moe.router_replay (the prev and policy forwards replay them). Reported per mode, as the
step logs them: moe/routing_mismatch (the share of (fed generated token, MoE layer) pairs whose
trainer top-k set differs from the recorded one) and logprob/token_mult_prob_error (token mean
of exp|lg - lo|), logprob/gen_kl_error.

Models: `tiny` = builtin:tiny-qwen3-moe (2 MoE layers, 8 experts, top-2, d 64); `wide` = the
same recipe at d 128, 4 MoE layers, 64 experts of width 32, top-8 (more near-ties in the
router, so more chances to flip).

    python tools/router_replay_bench.py [--models tiny,wide] [--rows 32] [--tokens 64]
        [--dtype bfloat16] [--xla-default]

`--xla-default` compiles the trainer's side under XLA's default options (bfloat16 kept in
float32 across fused ops, as the sampler does not): a trainer that rounds unlike its sampler,
as two different engines do.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jgrpo import step, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import load_config
from jgrpo.models import kernels, load_policy
from jgrpo.models.tiny import (
    build_tiny_moe_model,
    tiny_qwen3_moe_config,
    tiny_qwen3_moe_weights,
    write_tiny_folder,
)
from jgrpo.rollout.engine import assemble_batch
from jgrpo.sampling import SamplingParams, generate

GROUP = 4
REPORTED = (
    "moe/routing_mismatch",
    "logprob/token_mult_prob_error",
    "logprob/gen_kl_error",
)


def build_wide_moe_model(out: Path, seed: int = 0) -> Path:
    """A wider tiny Qwen3-MoE: d 128 (4 heads of 32), 4 MoE layers, 64 experts, top-8."""
    config = tiny_qwen3_moe_config()
    config.update(
        hidden_size=128,
        head_dim=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        num_experts=64,
        num_experts_per_tok=8,
    )
    return write_tiny_folder(out, config, tiny_qwen3_moe_weights(config, seed), False, False)


def config_for(folder, rows: int, tokens: int, dtype: str, mode: str):
    return load_config(
        None,
        [
            f"model.path={folder}",
            f"model.compute_dtype={dtype}",
            f"grpo.num_prompts_per_step={rows // GROUP}",
            f"grpo.num_generations_per_prompt={GROUP}",
            "rollout.prompt_bucket=16",
            f"rollout.max_new_tokens={tokens}",
            "rollout.temperature=1.0",
            f"model.moe.{mode}=true",
        ],
    )


def sample(model, rows: int, tokens: int, seed: int = 0) -> dict:
    """A recorded rollout batch (numpy) of `rows` rows, GROUP per random prompt."""
    rng = np.random.RandomState(seed)
    prompts = [list(rng.randint(4, 100, rng.randint(4, 13))) for _ in range(rows // GROUP)]
    params = SamplingParams(max_new_tokens=tokens, prompt_bucket=16, record_experts=True)
    gen = generate(
        model,
        [p for p in prompts for _ in range(GROUP)],
        params,
        jax.random.key(seed),
        group_size=GROUP,
    )
    groups = [i for i in range(len(prompts)) for _ in range(GROUP)]
    rewards = rng.rand(rows).astype(np.float32)
    return assemble_batch(gen, groups, rewards, version=0)


def step_metrics(cfg, model, batch: dict, step_options: bool = True) -> dict[str, float]:
    """The step's metrics (prepare_batch + the gradient pass, no update) on `batch`, compiled
    with the train step's XLA options (`step_options`) or XLA's default."""
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    built = step_setup.build_step(cfg, model)
    device_batch = built.device_batch(TrainBatch.from_mapping(batch))

    def metrics(state, batch, hparams, ref):
        kw = dict(flags=built.flags, graphdef=built.graphdef)
        data, out = step.prepare_batch(state, batch, hparams, ref, **kw)
        _, loss_metrics = step.accumulate_gradients(state.params, data, hparams, **kw)
        return out | loss_metrics

    # the train step's XLA options: bfloat16 rounded as the sampler rounds it (models/kernels.py)
    options = kernels.COMPILER_OPTIONS if step_options else None
    metrics = jax.jit(metrics, compiler_options=options)
    out = metrics(built.state, device_batch, built.hparams, built.ref_params)
    return {k: float(out[k]) for k in REPORTED}


def measure(folder, rows: int, tokens: int, dtype: str, step_options: bool = True) -> dict:
    """{mode: metrics} of one recorded rollout on the model in `folder`."""
    record = config_for(folder, rows, tokens, dtype, "record_routing")
    model = load_policy(record.model)
    batch = sample(model, rows, tokens)
    fed = int(((batch["expert_ids"][..., 0, 0] >= 0) & (batch["token_mask"] > 0)).sum())
    out = {"fed_tokens": fed}
    for mode in ("record_routing", "router_replay"):
        cfg = config_for(folder, rows, tokens, dtype, mode)
        out[mode] = step_metrics(cfg, model, batch, step_options)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,wide")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument(
        "--xla-default",
        action="store_true",
        help="compile the trainer's side with XLA's default options, not the step's",
    )
    args = ap.parse_args(argv)
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        builders = {"tiny": build_tiny_moe_model, "wide": build_wide_moe_model}
        for name in args.models.split(","):
            folder = builders[name](Path(tmp) / name)
            report[name] = measure(folder, args.rows, args.tokens, args.dtype, not args.xla_default)
    options = "XLA's default options" if args.xla_default else "the step's XLA options"
    print(
        f"== router replay, {args.dtype} compute, {args.rows} rows x {args.tokens} tokens, "
        f"trainer under {options}"
    )
    print(f"{'model':6} {'fed':>5} {'mode':15} " + " ".join(f"{k:>30}" for k in REPORTED))
    for name, r in report.items():
        for mode in ("record_routing", "router_replay"):
            values = " ".join(f"{r[mode][k]:>30.6g}" for k in REPORTED)
            print(f"{name:6} {r['fed_tokens']:>5} {mode:15} {values}")
    return report


if __name__ == "__main__":
    main()
