"""Compile the train step of a config ahead of time, allocating nothing, and report its cost.

Everything is abstract (`step_setup.build_step` on an `nnx.eval_shape` model:
jax.ShapeDtypeStructs with shardings), so a full-size model can be sized for any mesh on a
laptop; a model.path folder holding only config.json is enough. The report: total and active
parameters (`active_params`: what one token runs of an MoE model); matmul flops of
the whole step (`hlo_dot_flops` walks the compiled HLO and multiplies each while body by its
trip count, XLA's own count is kept beside it) and the same from the shapes alone
(`analytic_flops`, the cross-check); per-device bytes of the parameters, optimizer state,
reference copy, reward models, arguments and XLA's temporaries, and a peak estimate; the
sampler's KV cache; the named forwards present in the compiled and the traced program
(`forwards_in_hlo`, `forwards_in_jaxpr`: the probes the static-flag proofs use) and dot counts;
for a completion-length distribution (`--lengths`), `packing_report`: real vs padded vs packed
tokens and flops. docs/precision-and-memory.md describes every JSON key; its text form and the
`--device-memory` verdict: `jgrpo.inspect_report`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo import compile_cache, distillation, packing, sampling, step, step_setup
from jgrpo.batch import TrainBatch
from jgrpo.config import Config, ConfigError
from jgrpo.models import load_policy
from jgrpo.models.lora import adapter_layout


def forwards_in_hlo(hlo_text: str) -> list[str]:
    """Which of the step's named forwards (`step.FORWARDS`) a compiled program contains (read
    from op metadata)."""
    return [name for name in step.FORWARDS if f"forward_{name}" in hlo_text]


def forwards_in_jaxpr(closed_jaxpr) -> list[str]:
    """Which named forwards were traced at all (before any dead-code elimination).

    A forward computed and then ignored would vanish from compiled HLO through DCE; this walks
    the traced jaxpr, sub-jaxprs of scan/while/cond/pjit included, so it would still show."""
    scopes: set[str] = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            scopes.add(str(eqn.source_info.name_stack))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed_jaxpr.jaxpr)
    return [name for name in step.FORWARDS if any(f"forward_{name}" in s for s in scopes)]


def bytes_per_device(tree) -> int:
    """Bytes one device holds of an abstract sharded tree (the largest shard)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s+\((.*)\)\s+->\s+.*\{\s*$")
_PARAM = re.compile(r"([\w.\-]+): (\w+)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(\w+)\[([\d,]*)\]")
_DOT = re.compile(r"\sdot\(%([^,\s)]+), %([^,\s)]+)\)")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CALLS = re.compile(r"(?:calls|to_apply|body|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def hlo_dot_flops(hlo_text: str) -> tuple[float, bool]:
    """(matmul flops of a compiled HLO module counting every trip of every while loop, whether
    every loop's trip count was known). XLA's cost_analysis counts a loop body once; this
    walks the call graph from ENTRY and multiplies each while body by its known_trip_count.
    A dot's flops are 2 x prod(output shape) x prod(lhs contracting dims)."""
    local: dict[str, float] = {}
    children: dict[str, list[tuple[str, int]]] = {}
    entry, name, shapes, all_known = None, None, {}, True
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            name = head.group(1)
            entry = name if line.startswith("ENTRY") else entry
            shapes = {p: _dims(d) for p, _, d in _PARAM.findall(head.group(2))}
            local[name], children[name] = 0.0, []
            continue
        if name is None:
            continue
        instr = _INSTR.match(line)
        if instr:
            shapes[instr.group(1)] = _dims(instr.group(3))
        dot = _DOT.search(line)
        if dot and instr:
            lhs = shapes.get(dot.group(1))
            contract = _CONTRACT.search(line)
            if lhs is not None and contract:
                k = math.prod(lhs[int(i)] for i in contract.group(1).split(",") if i)
                local[name] += 2.0 * math.prod(shapes[instr.group(1)]) * k
        trips = 1
        if " while(" in line:
            found = _TRIPS.search(line)
            all_known &= found is not None
            trips = int(found.group(1)) if found else 1
        for callee in _CALLS.findall(line):
            children[name].append((callee, trips if " while(" in line else 1))
        for group in _BRANCHES.findall(line):  # a conditional: count its costliest branch
            branches = [b.strip().lstrip("%") for b in group.split(",") if b.strip()]
            children[name].append(("|".join(branches), 1))

    memo: dict[str, float] = {}

    def total(comp: str) -> float:
        if "|" in comp:
            return max(total(c) for c in comp.split("|"))
        if comp not in memo:
            memo[comp] = local.get(comp, 0.0) + sum(n * total(c) for c, n in children.get(comp, []))
        return memo[comp]

    return (total(entry) if entry else 0.0), all_known


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def analytic_flops(
    cfg: Config, model_cfg, row_tokens=None, head_positions=None, scored_width=None
) -> dict:
    """Matmul flops of one train step from the shapes alone, every trip counted.

    Per token and layer: q/k/v/o projections 2d(n + 2k)h + 2nhd, the MLP (`mlp_flops`: SwiGLU
    6df; an MoE layer runs its top_k experts and router), attention (`attention_flops`: the
    T x T square of a materialised row, the causal block pairs of a blockwise one), LoRA
    adapters 2r(in + out) per targeted projection (x A, then B); the LM head 2dV over the
    chunk-padded positions after the prompt bucket (the only ones scored). `row_tokens` (the
    tokens of each row through the layers) and `head_positions` (LM-head positions in all)
    describe another layout: default B rows of T tokens. A frozen forward (ref, prev) costs one
    forward; the policy costs its forward and a backward. Full fine-tuning: the backward is 2
    forwards (every matmul differentiates both operands). LoRA: the frozen base weights and the
    (frozen) head take no weight gradient, so their matmuls cost one more forward only (the
    activation gradient), while attention and the adapters cost two; the reference forward is
    the base alone (adapters skipped). Recomputed: a blockwise row's scores in the policy's
    backward (half its attention forward); the layers (remat full) or their attention (dots);
    the head when it runs in more than one chunk (each chunk is then a jax.checkpoint; a head
    of one chunk, `scored_width` <= model.logprob_chunk_size, is not: see
    `Transformer.token_logprobs`). `scored_width`: the positions per row the head scores, which
    fix its chunk count (default rollout.max_new_tokens; packed: the scored slots per packed
    row). `model` leaves the recompute out (the numerator of MFU), `step` includes it (what the
    compiled program executes)."""
    m, g, ro = model_cfg, cfg.grpo, cfg.rollout
    b, t = g.batch_size, ro.prompt_bucket + ro.max_new_tokens
    d, n, k, h, v, l = (
        m.hidden_size,
        m.num_heads,
        m.num_kv_heads,
        m.head_dim,
        m.vocab_size,
        m.num_layers,
    )
    scored_width = ro.max_new_tokens if scored_width is None else int(scored_width)
    if head_positions is None:
        head_positions = b * chunk_padded(scored_width, m.logprob_chunk_size)
    row_tokens = [t] * b if row_tokens is None else [int(x) for x in row_tokens]
    tokens = sum(row_tokens)
    attention, scores_again = (
        l * sum(x) for x in zip(*(attention_flops(x, m) for x in row_tokens))
    )
    weights = tokens * (l * (2 * d * (n + 2 * k) * h + 2 * n * h * d) + mlp_flops(m))
    adapters = 0
    if m.lora is not None:
        per_layer = sum(math.prod(shape) for shape, _ in adapter_layout(m).values()) // l
        adapters = tokens * l * 2 * per_layer
    head = head_positions * 2 * d * v
    base = weights + attention + head  # a forward without adapters
    policy_forward = base + adapters
    if m.lora is None:
        backward = 2 * policy_forward
        ref_forward = policy_forward
    else:
        backward = weights + head + 2 * (attention + adapters)
        ref_forward = base
    layers = weights + attention + adapters
    head_recomputed = chunk_count(scored_width, m.logprob_chunk_size) > 1
    recompute = {"none": 0.0, "full": layers, "dots": attention}[m.remat] + head_recomputed * head
    recompute += scores_again  # the policy's backward of blockwise rows
    frozen = (not cfg.skip_ref) * ref_forward + (not cfg.skip_prev) * policy_forward
    model = frozen + policy_forward + backward
    return {
        "forward": float(policy_forward),
        "model": float(model),
        "step": float(model + recompute),
    }


def attention_flops(tokens: int, model_cfg) -> tuple[int, int]:
    """(forward, recomputed in the backward) matmul flops of one layer's attention over one row
    of `tokens`. A materialised row (at most model.attention_block_size tokens, or the size 0)
    computes scores and values over the full T x T square: 4 T^2 n h (masking saves nothing).
    A blockwise row is padded to nb blocks of B and computes the P = nb (nb + 1) / 2 block
    pairs at or below the diagonal, 4 P B^2 n h; its backward recomputes each pair's scores
    (2 P B^2 n h) beside the 8 P B^2 n h of its gradients (`jgrpo.models.blockwise`)."""
    n, h, block = model_cfg.num_heads, model_cfg.head_dim, model_cfg.attention_block_size
    if not block or tokens <= block:
        return 4 * tokens * tokens * n * h, 0
    blocks = -(-tokens // block)
    pairs = blocks * (blocks + 1) // 2
    return 4 * pairs * block * block * n * h, 2 * pairs * block * block * n * h


def mlp_flops(model_cfg) -> int:
    """Matmul flops of one token's forward through every layer's MLP: a dense layer's SwiGLU
    6df; an MoE layer's router 2dE, its top_k routed experts 6 d f_e each and its shared
    experts 6 d f_s (what the grouped path computes; the dense path runs all E)."""
    d, spec = model_cfg.hidden_size, getattr(model_cfg, "moe", None)
    dense = 6 * d * model_cfg.intermediate_size
    if spec is None:
        return model_cfg.num_layers * dense
    sparse = 2 * d * spec.num_experts + 6 * d * (spec.top_k * spec.expert_size + spec.shared_size)
    return (model_cfg.num_layers - spec.num_sparse) * dense + spec.num_sparse * sparse


def chunk_count(positions: int, chunk: int) -> int:
    """Trips of the chunked LM head's loop for `positions` scored ones per row."""
    chunk = min(chunk or positions, positions)
    return -(-positions // chunk) if positions else 0


def chunk_padded(positions: int, chunk: int) -> int:
    """Positions the chunked LM head computes for `positions` scored ones (whole chunks)."""
    chunk = min(chunk or positions, positions)
    return chunk_count(positions, chunk) * chunk


def kv_cache_bytes(cfg: Config, model_cfg) -> int:
    """Bytes of the sampler's KV cache for one rollout batch (`sampling.kv_cache_bytes`): the
    P x G rows, or rollout.decode_slots of them (+ the staged prompt), x the cache length of
    prompt_bucket + max_new_tokens, every layer's keys and values in rollout.kv_cache_dtype
    (default: the compute dtype)."""
    params = sampling.SamplingParams.from_rollout_config(cfg.rollout)
    return sampling.kv_cache_bytes(
        model_cfg, cfg.grpo.batch_size, cfg.rollout.prompt_bucket, params
    )


def reward_model_bytes(cfg: Config, mesh) -> dict[str, int]:
    """Bytes per device of every reward model's frozen parameters (data.reward_functions[i]
    .model), placed as the run places them: on the trainer's mesh (this host's rows) under the
    local backend, whole on each Ray rollout worker's device under ray (the trainer's then
    hold none); a folder holding only config.json is enough."""
    from pathlib import Path

    from jgrpo import sharding
    from jgrpo.config import MeshConfig
    from jgrpo.models.reward_model import abstract_params, reward_model_config
    from jgrpo.models.sources import resolve_model_path

    on_workers = cfg.rollout.backend == "ray"
    if on_workers:  # a worker's devices: assume one (the sampler's)
        mesh = sharding.make_mesh(MeshConfig(data=1), jax.devices()[:1])
    total, rules = 0, sharding.make_rules(cfg.mesh)
    for rf in cfg.data.reward_functions:
        if rf.model is None:
            continue
        folder = Path(rf.model)
        if not (folder / "config.json").is_file():
            folder = resolve_model_path(rf.model)
        dtype = rf.dtype
        if dtype == "auto":
            dtype = cfg.model.resolved_compute_dtype(jax.default_backend())
        model_cfg = reward_model_config(folder, dtype, cfg.model.kernels)
        total += bytes_per_device(abstract_params(model_cfg, sharding.host_mesh(mesh), rules))
    return {
        "reward_model_bytes_per_device": 0 if on_workers else total,
        "reward_model_bytes_per_worker": total if on_workers else 0,
    }


def completion_lengths(spec: str, rows: int, cap: int, seed: int = 0) -> np.ndarray:
    """[rows] completion lengths in [1, cap] (`inspect-step --lengths SPEC`): `uniform`, every
    row at the cap; `skewed`, log-normal with median cap / 8 and sigma 1 (its quantiles at
    (i + 0.5) / rows, shuffled by `seed`; clipped to [1, cap]): most rows stop early, a few run
    to the cap; or `L1,L2,...`, these lengths repeated over the rows."""
    if spec == "uniform":
        return np.full(rows, cap, np.int64)
    if spec == "skewed":
        z = np.array([NormalDist().inv_cdf((i + 0.5) / rows) for i in range(rows)])
        lengths = np.clip(np.round(cap / 8 * np.exp(z)), 1, cap).astype(np.int64)
        return np.random.RandomState(seed).permutation(lengths)
    try:
        values = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ConfigError(
            f"--lengths: {spec!r} is not uniform, skewed or a comma list of integers"
        ) from None
    if min(values) < 1 or max(values) > cap:
        raise ConfigError(
            f"--lengths: every length must lie in [1, rollout.max_new_tokens = {cap}], got {spec!r}"
        )
    return np.resize(np.asarray(values, np.int64), rows)


def length_batch(prompt: int, completions_b, new_tokens: int, group: int = 1) -> TrainBatch:
    """A host TrainBatch of `prompt` prompt tokens and completions_b[b] generated tokens per
    row (ids 0, groups of `group` rows): the layout a length distribution gives the step."""
    completions_b = np.asarray(completions_b)
    cols = np.arange(prompt + new_tokens)
    real = cols < prompt + completions_b[:, None]
    generated = real & (cols >= prompt)
    b = len(completions_b)
    return TrainBatch(
        input_ids=np.zeros(real.shape, np.int32),
        attention_mask=real.astype(np.float32),
        token_mask=generated.astype(np.float32),
        generation_logprobs=np.zeros(real.shape, np.float32),
        rewards=np.zeros(b, np.float32),
        group_ids=(np.arange(b) // group).astype(np.int32),
        sample_mask=np.ones(b, np.float32),
    )


def compiled_flops(built, args) -> float:
    """Matmul flops (every loop trip) of `built`'s step compiled for `args`, all devices."""
    text = built.step_fn.lower(*args).compile().as_text()
    return hlo_dot_flops(text)[0] * built.mesh.size


def packing_report(cfg: Config, abstract_model, spec: str, compile: bool = True) -> dict:
    """Real vs padded vs packed tokens and flops of the step for the completion lengths `spec`
    (`completion_lengths`), every prompt filling rollout.prompt_bucket: real counts each row's
    own tokens (attention over its own square, the LM head over its generated tokens); padded
    is the unpacked step (B rows of T); packed the step under grpo.sequence_packing with the
    packed rows `jgrpo.packing` makes of them (the config's budget, or T)."""
    g, ro, model_cfg = cfg.grpo, cfg.rollout, abstract_model.cfg
    lengths_b = completion_lengths(spec, g.batch_size, ro.max_new_tokens, g.seed)
    packed_cfg = cfg.replace(grpo=dataclasses.replace(g, sequence_packing=True))
    padded_cfg = cfg.replace(
        grpo=dataclasses.replace(g, sequence_packing=False, packing_budget=None)
    )
    packed = step_setup.build_step(packed_cfg, abstract_model)
    host = length_batch(
        ro.prompt_bucket, lengths_b, ro.max_new_tokens, g.num_generations_per_prompt
    )
    layout = packing.pack_batch(host, packed.pack_spec).layout
    (r, w), h = layout.input_ids.shape, layout.scored.shape[1]
    real_b = ro.prompt_bucket + lengths_b
    head = r * chunk_padded(h, model_cfg.logprob_chunk_size)
    report = {
        "lengths": spec,
        "completion_length_median": float(np.median(lengths_b)),
        "tokens_real": int(real_b.sum()),
        "tokens_padded": g.batch_size * (ro.prompt_bucket + ro.max_new_tokens),
        "tokens_packed": r * w,
        "packed_rows": r,
        "packed_width": w,
        "flops_real_analytic": analytic_flops(cfg, model_cfg, real_b, lengths_b.sum())["step"],
        "flops_padded_analytic": analytic_flops(cfg, model_cfg)["step"],
        "flops_packed_analytic": analytic_flops(cfg, model_cfg, [w] * r, head, h)["step"],
    }
    if compile:
        padded = step_setup.build_step(padded_cfg, abstract_model)
        report["flops_padded"] = compiled_flops(padded, padded.abstract_args())
        batch = packed.abstract_batch(packed_rows=r)
        report["flops_packed"] = compiled_flops(packed, packed.abstract_args(batch))
    return report


def _count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def routed_expert_params(model_cfg) -> tuple[int, float]:
    """(parameters of the routed experts, the share of them one token runs: top_k / experts)
    of an MoE model config; (0, 1.0) for a dense one. The routed experts are the gate, up and
    down matrices of every MoE layer's E experts: 3 x d x f x E per MoE layer."""
    spec = getattr(model_cfg, "moe", None)
    if spec is None or not spec.num_sparse:
        return 0, 1.0
    per_layer = 3 * model_cfg.hidden_size * spec.expert_size * spec.num_experts
    return spec.num_sparse * per_layer, spec.top_k / spec.num_experts


def active_params(total: int, model_cfg) -> int:
    """The parameters one token runs, of a model of `total` parameters: everything but the
    routed experts not chosen for it. Counted in full: attention, norms, dense MLP layers,
    shared experts, routers, LoRA adapters, the embedding and the LM head (as the "A3B" of
    Qwen3-30B-A3B counts them, though a token reads one row of the embedding); of the routed
    experts, top_k / E of them. A dense model: `total`."""
    routed, share = routed_expert_params(model_cfg)
    return total - routed + round(routed * share)


def teacher_forward_flops(built, batch) -> float:
    """Matmul flops (all devices) of the distillation teacher's forward alone over `batch`,
    compiled as its own program: its share of the step's `flops` (inside the one jitted step
    its time cannot be taken apart from the rest)."""
    rows, layout = (batch.rows, batch.layout) if built.pack_spec is not None else (batch, None)
    flags = built.flags

    def forward(params, rows, layout):
        return step.frozen_logprobs(
            "teacher",
            built.teacher.graphdef,
            params,
            rows,
            built.hparams.temperature,
            flags.num_minibatches * flags.num_microbatches,
            first_scored=flags.first_scored,
            layout=layout,
        )

    text = jax.jit(forward).lower(built.teacher.params, rows, layout).compile().as_text()
    return hlo_dot_flops(text)[0] * built.mesh.size


def inspect_step(cfg: Config, compile: bool = True, lengths: str | None = None) -> dict:
    """The report (docs/precision-and-memory.md). Under grpo.sequence_packing the step is
    sized for the most packed rows a batch can take (B: no row shares one); `lengths` adds
    `packing_report` for that completion-length distribution."""
    start = time.perf_counter()
    compile_cache.enable()
    abstract_model = load_policy(cfg.model, abstract=True)  # config.json alone is enough
    model_cfg = abstract_model.cfg
    step_setup.check_batch_split(cfg, jax.device_count())
    teacher = None
    if cfg.distillation.teacher is not None:
        teacher = distillation.load_teacher(cfg, abstract=True)
    built = step_setup.build_step(cfg, abstract_model, teacher=teacher)
    state = built.state
    batch_devices = built.mesh.shape["data"] * built.mesh.shape["fsdp"]
    kv = kv_cache_bytes(cfg, model_cfg)
    num_params = _count((state.params, built.frozen))
    report = {
        "mesh": dict(built.mesh.shape),
        "num_params": num_params,
        "num_active_params": active_params(num_params, model_cfg),
        "num_trainable_params": _count(state.params),
        "param_dtype": model_cfg.param_dtype,
        "compute_dtype": model_cfg.dtype,
        "remat": model_cfg.remat,
        "logprob_chunk_size": model_cfg.logprob_chunk_size,
        "param_bytes_per_device": bytes_per_device((state.params, built.frozen)),
        "trainable_param_bytes_per_device": bytes_per_device(state.params),
        "opt_state_bytes_per_device": bytes_per_device(state.opt_state),
        "ref_param_bytes_per_device": bytes_per_device(built.ref_params),
        "teacher_param_bytes_per_device": bytes_per_device(built.teacher and built.teacher.params),
        "kv_cache_bytes": kv,
        "kv_cache_bytes_per_device": kv // batch_devices,
        "flops_analytic": analytic_flops(cfg, model_cfg)["step"],
        **reward_model_bytes(cfg, built.mesh),
    }
    if compile:
        args = built.abstract_args()
        fn = built.step_fn
        lowered = fn.lower(*args)
        compiled = lowered.compile()
        text = compiled.as_text()
        memory = compiled.memory_analysis()
        per_device, trips_known = hlo_dot_flops(text)
        temp = int(getattr(memory, "temp_size_in_bytes", 0))
        arguments = int(getattr(memory, "argument_size_in_bytes", 0))
        outputs = int(getattr(memory, "output_size_in_bytes", 0))
        aliased = int(getattr(memory, "alias_size_in_bytes", 0))
        report |= {
            "flops": per_device * built.mesh.size,
            "flops_per_device": per_device,
            "flops_trip_counts_known": trips_known,
            "flops_xla_cost_analysis": float(compiled.cost_analysis()["flops"]),
            "dot_ops": text.count(" dot("),
            "dot_general_ops_lowered": lowered.as_text().count("stablehlo.dot_general"),
            "forwards": forwards_in_hlo(text),
            "forwards_traced": forwards_in_jaxpr(jax.make_jaxpr(fn)(*args)),
            "temp_bytes_per_device": temp,
            "argument_bytes_per_device": arguments,
            "peak_bytes_per_device_estimate": arguments + outputs - aliased + temp,
        }
        if teacher is not None:
            report["flops_teacher"] = teacher_forward_flops(built, args[1])
    if lengths is not None:
        report |= packing_report(cfg, abstract_model, lengths, compile)
    report["seconds"] = round(time.perf_counter() - start, 2)
    return report
