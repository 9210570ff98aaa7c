"""The Mixture-of-Experts block: router, dropless experts, shared experts, router stats.

Per token x of an MoE layer (docs/moe.md): the softmax router (Qwen3-MoE) picks the top-k of
p = softmax(x W_r), gates p[ids] (renormalised with `norm_topk_prob`); the sigmoid router
(GLM-4.5 / DeepSeek-V3) picks the top-k of s + b (s = sigmoid(x W_r), b a selection-only bias)
within the `topk_groups` best expert groups, gates s[ids] (renormalised) x `routed_scaling`.
y = sum_k g_k SwiGLU_{ids_k}(x) (+ the shared experts' SwiGLU). Router math is float32.
Dropless (no capacity) experts, two paths behind the kernel switch (`EXPERT_PATHS`):
`grouped` sorts the t*k (token, choice) pairs by expert and runs `jax.lax.ragged_dot`;
`dense` runs every expert on every token, mixed by a [t, e] gate matrix.
Router replay: `route(..., expert_ids_tk=ids)` takes a given choice (rows of -1: the router's
own) and computes its gates from the current router (differentiable); `routing_mismatch`
counts the tokens whose own choice differs from a recorded one. Routing keeps the tokens'
[b, t] dims (rows split over context stay split). Legend: t tokens (any leading dims),
d model, f expert mlp, e experts, k chosen per token, l layers."""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jgrpo.models.moe_parallel import experts_sharded

RouterKind = Literal["softmax", "sigmoid"]
EXPERT_PATHS = {"cpu": "dense", "portable": "grouped"}
"""Kernel path (`kernels.resolve_kernels`) -> expert implementation (grouped | dense)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoESpec:
    """The MoE shape of a model (hashable: part of the static model config)."""

    num_experts: int
    """E routed experts per MoE layer."""
    top_k: int
    """k experts per token (HF num_experts_per_tok)."""
    expert_size: int
    """f, the hidden width of one expert's SwiGLU (HF moe_intermediate_size)."""
    router: RouterKind = "softmax"
    """softmax (Qwen3-MoE) | sigmoid (GLM-4.5 / DeepSeek-V3: bias, groups, scaling)."""
    norm_topk_prob: bool = True
    """Gates of the chosen experts divided by their sum."""
    num_groups: int = 1
    """Expert groups of the sigmoid router (HF n_group)."""
    topk_groups: int = 1
    """Groups a token may choose experts from (HF topk_group)."""
    routed_scaling: float = 1.0
    """Gates times this (HF routed_scaling_factor; sigmoid router)."""
    shared_size: int = 0
    """Hidden width of the shared-expert SwiGLU every token runs (0 = none; HF
    moe_intermediate_size x n_shared_experts)."""
    sparse_layers: tuple[bool, ...] = ()
    """Per decoder layer: True = MoE block, False = the dense MLP."""
    aux_loss_coef: float = 0.0
    """The HF config's router_aux_loss_coef (the run's default coefficient)."""

    @property
    def num_sparse(self) -> int:
        return sum(self.sparse_layers)


class Routing(NamedTuple):
    """One MoE layer's routing of t tokens."""

    expert_ids_tk: jax.Array
    """int32 [t, k] chosen experts (t: the tokens' leading dims, as given)."""
    gates_tk: jax.Array
    """float32 [t, k] their mixing weights (differentiable in the router)."""
    probs_te: jax.Array
    """float32 [t, e] the router's distribution (softmax p; sigmoid: s / sum s) for the
    load-balancing loss and the entropy metric."""
    logits_te: jax.Array
    """float32 [t, e] router logits (z-loss)."""
    chosen_tk: Optional[jax.Array] = None
    """int32 [t, k] the router's own choice (`expert_ids_tk` unless a choice was replayed)."""


class RouterStats(NamedTuple):
    """Sums over the counted (unmasked) tokens, per MoE layer [l, ...]: what the aux losses and
    the moe/ metrics are made of (`aux_losses`, `moe_metrics`)."""

    counts_le: jax.Array
    """(token, choice) pairs routed to each expert."""
    prob_sum_le: jax.Array
    """Sum of router probabilities per expert."""
    z_sum_l: jax.Array
    """Sum of logsumexp(logits)^2."""
    entropy_sum_l: jax.Array
    """Sum of the router distribution's entropy (nats)."""
    tokens_l: jax.Array
    """Number of counted tokens."""


# ----------------------------------------------------------------------------- routing


def route(x_td, router_de, bias_e, spec: MoESpec, expert_ids_tk=None) -> Routing:
    """The router of `spec` on tokens x_td ([..., d]) -> Routing. `expert_ids_tk` replays a
    given choice: tokens whose first id is -1 (not recorded) take the router's own."""
    logits_te = jnp.dot(
        x_td.astype(jnp.float32), router_de.astype(jnp.float32), precision="highest"
    )
    k = spec.top_k
    if spec.router == "softmax":
        probs_te = jax.nn.softmax(logits_te, axis=-1)
        chosen_tk = top_k_ids(probs_te, k)
        ids_tk = _replayed(expert_ids_tk, chosen_tk)
        gates_tk = jnp.take_along_axis(probs_te, ids_tk, axis=-1)
        if spec.norm_topk_prob:
            gates_tk = gates_tk / jnp.sum(gates_tk, axis=-1, keepdims=True)
        return Routing(ids_tk, gates_tk, probs_te, logits_te, chosen_tk.astype(jnp.int32))
    scores_te = jax.nn.sigmoid(logits_te)
    chosen_tk = _grouped_top_k(scores_te + bias_e.astype(jnp.float32), spec)
    ids_tk = _replayed(expert_ids_tk, chosen_tk)
    gates_tk = jnp.take_along_axis(scores_te, ids_tk, axis=-1)
    if spec.norm_topk_prob:
        gates_tk = gates_tk / (jnp.sum(gates_tk, axis=-1, keepdims=True) + 1e-20)
    gates_tk = gates_tk * spec.routed_scaling
    probs_te = scores_te / jnp.sum(scores_te, axis=-1, keepdims=True)
    return Routing(ids_tk, gates_tk, probs_te, logits_te, chosen_tk.astype(jnp.int32))


def _replayed(given_tk, chosen_tk):
    """int32 [t, k]: the given ids where recorded (first id >= 0), else the router's own."""
    chosen_tk = chosen_tk.astype(jnp.int32)
    if given_tk is None:
        return chosen_tk
    given_tk = given_tk.astype(jnp.int32)
    return jnp.where(given_tk[..., :1] >= 0, given_tk, chosen_tk)


RECORDED_ID_DTYPE = jnp.int16
"""Recorded expert ids (router replay) travel as int16, [tokens, l_moe, k] per batch: MoE models
have far fewer than 2^15 experts (the sampler refuses more)."""


def expert_rows(ids_l_b_k):
    """[l_moe, b, ..., k] expert ids (a forward's) -> [b, ..., l_moe, k] RECORDED_ID_DTYPE."""
    return jnp.moveaxis(ids_l_b_k, 0, -2).astype(RECORDED_ID_DTYPE)


def routing_mismatch(chosen_tk, recorded_tk):
    """bool [t]: the token was recorded (first id >= 0) and its chosen top-k set differs from
    the recorded one (order ignored)."""
    recorded_tk = recorded_tk.astype(jnp.int32)
    differ = jnp.any(jnp.sort(chosen_tk, axis=-1) != jnp.sort(recorded_tk, axis=-1), axis=-1)
    return differ & (recorded_tk[..., 0] >= 0)


def _grouped_top_k(choice_te, spec: MoESpec):
    """Top-k experts of `choice_te` among the `topk_groups` groups whose two best scores sum
    highest (DeepSeek-V3's group-limited routing); the choice carries no gradient."""
    choice_te = jax.lax.stop_gradient(choice_te)
    *lead, e = choice_te.shape
    g = spec.num_groups
    if g > 1 and spec.topk_groups < g:
        choice_tgn = choice_te.reshape(*lead, g, e // g)
        top2_tg2 = jnp.take_along_axis(choice_tgn, top_k_ids(choice_tgn, 2), axis=-1)
        groups_tj = top_k_ids(jnp.sum(top2_tg2, axis=-1), spec.topk_groups)
        kept_tg = jnp.any(groups_tj[..., None] == jnp.arange(g), axis=-2)
        kept_te = jnp.repeat(kept_tg, e // g, axis=-1)
        choice_te = jnp.where(kept_te, choice_te, -jnp.inf)
    return top_k_ids(choice_te, spec.top_k)


def top_k_ids(x_tn, k: int):
    """int32 [..., k]: `jax.lax.top_k(x_tn, k)`'s indices (descending, the lower index first
    among equals), as k argmax passes over the last dim. XLA's SPMD partitioner keeps those
    on each device's tokens, where its top_k gathers every device's tokens first (rows split
    over data x fsdp x context). Needs k finite entries per token (-inf ones are never
    picked while a finite one is left; routers have them)."""
    n = x_tn.shape[-1]
    ids = []
    for _ in range(k):
        i_t = jnp.argmax(x_tn, axis=-1)
        ids.append(i_t)
        x_tn = jnp.where(jnp.arange(n) == i_t[..., None], -jnp.inf, x_tn)
    return jnp.stack(ids, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------- experts


def swiglu(x, gate_df, up_df, down_fd):
    """down(silu(x gate) * up(x)): one dense SwiGLU MLP (the shared experts) on x [..., d]."""
    return jnp.dot(jax.nn.silu(jnp.dot(x, gate_df)) * jnp.dot(x, up_df), down_fd)


def experts_grouped(x_td, ids_tk, gates_tk, gate_edf, up_edf, down_efd):
    """Dropless experts by grouped matmuls: the t*k (token, choice) pairs sorted by expert,
    `ragged_dot` over the expert groups, the outputs put back in pair order and mixed by the
    gates. Exact (no capacity), work ~ t*k experts."""
    t, k = ids_tk.shape
    e = gate_edf.shape[0]
    flat_ids = ids_tk.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    group_sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)
    x_pd = jnp.take(x_td, order // k, axis=0)  # p = t * k pairs, sorted by expert
    gate_pf = jax.lax.ragged_dot(x_pd, gate_edf, group_sizes)
    up_pf = jax.lax.ragged_dot(x_pd, up_edf, group_sizes)
    y_pd = jax.lax.ragged_dot(jax.nn.silu(gate_pf) * up_pf, down_efd, group_sizes)
    y_pd = jnp.zeros_like(y_pd).at[order].set(y_pd, unique_indices=True)
    y_tkd = y_pd.reshape(t, k, -1)
    return jnp.sum(y_tkd * gates_tk[..., None].astype(y_tkd.dtype), axis=1)


def experts_dense(x_td, ids_tk, gates_tk, gate_edf, up_edf, down_efd):
    """Every expert on every token, mixed by a [t, e] gate matrix (zero off the chosen
    experts): the same result as `experts_grouped`, work ~ t*E experts, no sort or gather.
    The gates scale each expert's hidden [t, e, f] before the down projection, which then sums
    over experts and f in one matmul: no [t, e, d] per-expert output is ever held."""
    t = x_td.shape[0]
    e = gate_edf.shape[0]
    mix_te = jnp.zeros((t, e), jnp.float32).at[jnp.arange(t)[:, None], ids_tk].add(gates_tk)
    gate_tef = jnp.einsum("td,edf->tef", x_td, gate_edf)
    up_tef = jnp.einsum("td,edf->tef", x_td, up_edf)
    h_tef = jax.nn.silu(gate_tef) * up_tef
    return jnp.einsum("tef,efd->td", h_tef * mix_te[..., None].astype(h_tef.dtype), down_efd)


def moe_mlp(p: dict, x_btd, spec: MoESpec, path: str, expert_ids_btk=None, parallel=None):
    """The MoE block on x_btd with one layer's params `p` (router [d, e], router_bias [e] for
    the sigmoid router, expert_gate / expert_up [e, d, f], expert_down [e, f, d], shared_gate /
    shared_up [d, fs], shared_down [fs, d] when spec.shared_size) -> (y_btd, Routing of the
    [b, t] tokens). `path`: the resolved kernel path (EXPERT_PATHS picks the expert code).
    `parallel`: a `sharding.ExpertParallel` (the trainer's mesh): experts split over devices
    (moe_parallel.experts_sharded, on [b, t] as they are); None runs every expert here, on
    the b*t tokens flattened."""
    b, t, d = x_btd.shape
    routing = route(x_btd, p["router"], p.get("router_bias"), spec, expert_ids_btk)
    experts = experts_grouped if EXPERT_PATHS[path] == "grouped" else experts_dense
    weights = (p["expert_gate"], p["expert_up"], p["expert_down"])
    if parallel is None:
        ids_tk, gates_tk = (a.reshape(b * t, -1) for a in routing[:2])
        y_btd = experts(x_btd.reshape(b * t, d), ids_tk, gates_tk, *weights).reshape(b, t, d)
    else:
        y_btd = experts_sharded(parallel, experts, x_btd, *routing[:2], *weights)
    if spec.shared_size:
        y_btd = y_btd + swiglu(x_btd, p["shared_gate"], p["shared_up"], p["shared_down"])
    return y_btd.astype(x_btd.dtype), routing


# ----------------------------------------------------------------------------- stats, losses


def router_stats(routing: Routing, mask_t, num_experts: int) -> RouterStats:
    """One layer's RouterStats over the tokens where mask_t (1 = counted; the routing's
    leading dims)."""
    m_t = mask_t.astype(jnp.float32)
    m_tk = jnp.broadcast_to(m_t[..., None], routing.expert_ids_tk.shape)
    counts_e = jnp.zeros((num_experts,), jnp.float32).at[routing.expert_ids_tk].add(m_tk)
    probs_te = routing.probs_te
    tokens = tuple(range(probs_te.ndim - 1))
    entropy_t = -jnp.sum(probs_te * jnp.log(jnp.maximum(probs_te, 1e-30)), axis=-1)
    z_t = jax.nn.logsumexp(routing.logits_te, axis=-1) ** 2
    return RouterStats(
        counts_le=counts_e,
        prob_sum_le=jnp.sum(probs_te * m_t[..., None], axis=tokens),
        z_sum_l=jnp.sum(z_t * m_t),
        entropy_sum_l=jnp.sum(entropy_t * m_t),
        tokens_l=jnp.sum(m_t),
    )


def aux_losses(stats: RouterStats, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(load-balancing loss, router z-loss) of stats over l layers.

    Balance: E * sum_e f_e P_e with f_e the (token, choice) pairs routed to expert e per
    token and P_e its mean router probability, both pooled over the l layers (transformers'
    `load_balancing_loss_func` with an attention mask: k when perfectly balanced). z-loss:
    mean over layers and tokens of logsumexp(logits)^2 (ST-MoE)."""
    tokens = jnp.maximum(jnp.sum(stats.tokens_l), 1.0)
    f_e = jnp.sum(stats.counts_le, axis=0) / tokens
    p_e = jnp.sum(stats.prob_sum_le, axis=0) / tokens
    return num_experts * jnp.sum(f_e * p_e), jnp.sum(stats.z_sum_l) / tokens


def moe_metrics(stats: RouterStats, num_experts: int) -> dict[str, jax.Array]:
    """moe/ metrics of stats: tokens per expert (max and mean over experts, pooled over
    layers), mean router entropy, the aux and z losses."""
    aux, z = aux_losses(stats, num_experts)
    counts_e = jnp.sum(stats.counts_le, axis=0) / stats.counts_le.shape[0]
    tokens = jnp.maximum(jnp.sum(stats.tokens_l), 1.0)
    return {
        "moe/tokens_per_expert_max": jnp.max(counts_e),
        "moe/tokens_per_expert_mean": jnp.mean(counts_e),
        "moe/router_entropy": jnp.sum(stats.entropy_sum_l) / tokens,
        "moe/aux_loss": aux,
        "moe/z_loss": z,
    }


def stack_stats(per_layer: list[RouterStats]) -> Optional[RouterStats]:
    """RouterStats of several layer runs ([l_i, ...] each) concatenated on the layer axis."""
    if not per_layer:
        return None
    return RouterStats(*(jnp.concatenate(xs) for xs in zip(*per_layer)))


def add_router_losses(loss, metrics, routed, spec, *, aux_coef, z_coef, num_microbatches: int):
    """loss + the router terms of an MoE forward (`routed`: MoEOutput, `spec`: MoESpec; both
    None for a dense model: unchanged): aux_coef (None = spec.aux_loss_coef, the HF config's)
    x load-balancing loss + z_coef x router z-loss (`aux_losses`), and the moe/
    metrics. Each microbatch adds 1/M of its own terms (the step sums microbatches), so a
    minibatch's terms and metrics are means over its microbatches (maxima: the max)."""
    if routed is None:
        return loss, metrics
    aux, z = aux_losses(routed.stats, spec.num_experts)
    aux_coef = jnp.asarray(spec.aux_loss_coef if aux_coef is None else aux_coef, jnp.float32)
    router = (aux_coef * aux + (0.0 if z_coef is None else z_coef) * z) / num_microbatches
    stats = moe_metrics(routed.stats, spec.num_experts)
    metrics = metrics | {
        k: v if k.endswith("_max") else v / num_microbatches for k, v in stats.items()
    }
    metrics["moe/router_loss"] = router
    metrics["loss/total"] = metrics["loss/total"] + router
    return loss + router, metrics
