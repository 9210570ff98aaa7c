"""The MoE decoder (Qwen3-MoE, GLM-4.5 MoE): the dense decoder's attention, then per layer an
MoE block (jgrpo.models.moe) or a dense MLP.

`MoETransformer` subclasses `Transformer` and keeps its API and numerics (`__call__`,
`token_logprobs`, `prefill`, `layer_weights` + `decode_step`, LoRA on attention). Params:
`layers` = attention + norms of every layer (the dense names: attention adapters apply as is);
`dense_mlp` = gate/up/down of the dense layers; `moe` = router [l_moe, d, e] (+ router_bias),
experts expert_gate/expert_up [l_moe, e, d, f], expert_down [l_moe, e, f, d], shared_*. Runs
of consecutive same-kind layers are one `lax.scan` each. Partial rotary (GLM): RoPE turns the
first `rotary_dim` dims of a head. Router replay: `token_logprobs_routed(..., expert_ids=)`
returns (logprobs, MoEOutput: expert ids [l_moe, b, t, k] + RouterStats) and replays given ids;
`prefill_routed` / `decode_step_routed` also return the ids of the tokens they feed. Context
parallelism (models/context.py): the dense attention path; ids in and out are permuted with
the tokens, the router stats are sums over every token. Legend as transformer.py."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jgrpo.models import context as _context
from jgrpo.models import kernels as _kernels
from jgrpo.models import lora as lora_lib
from jgrpo.models import moe as moe_lib
from jgrpo.models.blockwise import RowMask
from jgrpo.models.kernels import resolve_kernels
from jgrpo.models.rope import apply_rope, rope_tables
from jgrpo.models.transformer import (
    REMAT_POLICIES,
    KVCache,
    Transformer,
    TransformerConfig,
    _dense,
    _param,
    _project,
    attention,
    cast_floats,
    rms_norm,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoETransformerConfig(TransformerConfig):
    """TransformerConfig of an MoE family (family qwen3_moe | glm4_moe)."""

    moe: moe_lib.MoESpec
    """Experts, router and which layers are MoE (`sparse_layers`)."""
    rotary_dim: int = 0
    """Leading dims of head_dim RoPE turns (0 = all; GLM's partial rotary)."""

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim


class MoEOutput(NamedTuple):
    """What the MoE layers of one forward decided."""

    expert_ids: jax.Array
    """int32 [l_moe, b, t, k] experts chosen per token per MoE layer."""
    stats: moe_lib.RouterStats
    """[l_moe, ...] sums over the counted tokens (`moe.aux_losses`, `moe.moe_metrics`)."""
    mismatch: Optional[jax.Array] = None
    """int32 [b, t] MoE layers whose own top-k set differs from the recorded one
    (`moe.routing_mismatch`; 0 where nothing was recorded); None without recorded ids."""


def layer_runs(sparse: tuple[bool, ...]) -> list[tuple[bool, int, int, int]]:
    """Maximal runs of consecutive layers of one kind -> (sparse, first layer, end layer,
    index of the first in its kind's stack)."""
    runs, counts = [], {True: 0, False: 0}
    for i, s in enumerate(sparse):
        if runs and runs[-1][0] == s:
            runs[-1][2] = i + 1
        else:
            runs.append([s, i, i + 1, counts[s]])
        counts[s] += 1
    return [tuple(r) for r in runs]


def _rope(x_btnh, rope, rope_dim: int):
    if rope_dim == x_btnh.shape[-1]:
        return apply_rope(x_btnh, *rope)
    turned = apply_rope(x_btnh[..., :rope_dim], *rope)
    return jnp.concatenate([turned, x_btnh[..., rope_dim:]], axis=-1)


def _qkv(p, cfg: MoETransformerConfig, x_btd, rope):
    h_btd = rms_norm(x_btd, p["attn_norm"], cfg.rms_norm_eps)
    q = _dense(h_btd, p["q"], p.get("q_bias"))
    k = _dense(h_btd, p["k"], p.get("k_bias"))
    v = _dense(h_btd, p["v"], p.get("v_bias"))
    q, k, v = (lora_lib.add_delta(y, p, w, h_btd, cfg.lora) for y, w in zip((q, k, v), "qkv"))
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return _rope(q, rope, cfg.rope_dim), _rope(k, rope, cfg.rope_dim), v


def _mlp(
    p, m, cfg: MoETransformerConfig, x_btd, attn_btnh, sparse: bool, path, ids=None, parallel=None
):
    """Attention output + residual, then the MLP (dense or MoE `m`; `parallel`: its experts'
    sharding.ExpertParallel or None) + residual -> (x_btd, Routing or None)."""
    o_btd = _project(attn_btnh, p["o"], contract=2)
    x_btd = x_btd + lora_lib.add_delta(o_btd, p, "o", attn_btnh, cfg.lora)
    h_btd = rms_norm(x_btd, p["mlp_norm"], cfg.rms_norm_eps)
    if not sparse:
        return x_btd + moe_lib.swiglu(h_btd, m["gate"], m["up"], m["down"]), None
    y_btd, routing = moe_lib.moe_mlp(m, h_btd, cfg.moe, path, ids, parallel)
    return x_btd + y_btd, routing


def _layer_major_permuted(x_lbt, c: int, permute):
    """[l, b, t, ...] with `permute` (context.zigzag | unzigzag) applied to its rows."""
    return jnp.moveaxis(permute(jnp.moveaxis(x_lbt, 0, 2), c), 2, 0)


class MoETransformer(Transformer):
    """Decoder-only MoE LM (see module docstring)."""

    def __init__(self, cfg: MoETransformerConfig, *, rngs: nnx.Rngs, init_scale: float = 0.02):
        nnx.Module.__init__(self)
        self.cfg = cfg
        self.activation_sharding = None  # as Transformer's (jgrpo.step_setup sets them)
        self.logit_shardings = None
        self.context_parallel = None  # as Transformer's (models/context.py)
        # the trainer's sharding.ExpertParallel (static in the graph def like the above; set by
        # step_setup.constrained_graphdef): None = every expert on every device (the sampler)
        self.expert_parallel = None
        spec = cfg.moe
        d, n, k, h, l, v = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.num_layers,
            cfg.vocab_size,
        )
        ld, lm = l - spec.num_sparse, spec.num_sparse
        e, f, fs, dt, s = (
            spec.num_experts,
            spec.expert_size,
            spec.shared_size,
            cfg.jnp_param_dtype,
            init_scale,
        )
        self.embed = _param(rngs, (v, d), ("vocab", "embed"), dt, s)
        layers = {
            "attn_norm": _param(rngs, (l, d), ("layers", "norm"), dt, None),
            "q": _param(rngs, (l, d, n, h), ("layers", "embed", "heads", "head_dim"), dt, s),
            "k": _param(rngs, (l, d, k, h), ("layers", "embed", "kv_heads", "head_dim"), dt, s),
            "v": _param(rngs, (l, d, k, h), ("layers", "embed", "kv_heads", "head_dim"), dt, s),
            "o": _param(rngs, (l, n, h, d), ("layers", "heads", "head_dim", "embed"), dt, s),
            "mlp_norm": _param(rngs, (l, d), ("layers", "norm"), dt, None),
        }
        if cfg.attention_bias:
            layers["q_bias"] = _param(rngs, (l, n, h), ("layers", "heads", "head_dim"), dt, s)
            layers["k_bias"] = _param(rngs, (l, k, h), ("layers", "kv_heads", "head_dim"), dt, s)
            layers["v_bias"] = _param(rngs, (l, k, h), ("layers", "kv_heads", "head_dim"), dt, s)
        if cfg.qk_norm:
            layers["q_norm"] = _param(rngs, (l, h), ("layers", "head_dim"), dt, None)
            layers["k_norm"] = _param(rngs, (l, h), ("layers", "head_dim"), dt, None)
        self.layers = nnx.Dict(layers)
        fd = cfg.intermediate_size
        dense = {
            "gate": _param(rngs, (ld, d, fd), ("layers", "embed", "mlp"), dt, s),
            "up": _param(rngs, (ld, d, fd), ("layers", "embed", "mlp"), dt, s),
            "down": _param(rngs, (ld, fd, d), ("layers", "mlp", "embed"), dt, s),
        }
        self.dense_mlp = nnx.Dict(dense) if ld else None
        experts = {
            "router": _param(rngs, (lm, d, e), ("layers", "embed", "expert"), dt, s),
            "expert_gate": _param(rngs, (lm, e, d, f), ("layers", "expert", "embed", "mlp"), dt, s),
            "expert_up": _param(rngs, (lm, e, d, f), ("layers", "expert", "embed", "mlp"), dt, s),
            "expert_down": _param(rngs, (lm, e, f, d), ("layers", "expert", "mlp", "embed"), dt, s),
        }
        if spec.router == "sigmoid":
            experts["router_bias"] = _param(rngs, (lm, e), ("layers", "expert"), dt, s)
        if fs:
            experts["shared_gate"] = _param(rngs, (lm, d, fs), ("layers", "embed", "mlp"), dt, s)
            experts["shared_up"] = _param(rngs, (lm, d, fs), ("layers", "embed", "mlp"), dt, s)
            experts["shared_down"] = _param(rngs, (lm, fs, d), ("layers", "mlp", "embed"), dt, s)
        self.moe = nnx.Dict(experts) if lm else None
        self.final_norm = _param(rngs, (d,), ("norm",), dt, None)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (d, v), ("embed", "vocab"), dt, s)
        self.lora = None if cfg.lora is None else lora_lib.make_adapter_params(cfg, rngs)

    # ------------------------------------------------------------------------- pieces

    def _mlp_params(self, sparse: bool) -> dict:
        group = self.moe if sparse else self.dense_mlp
        return {} if group is None else {name: p[...] for name, p in group.items()}

    def _attention_inputs(
        self, input_ids_bt, positions_bt, attention_mask_bt, positions_below=None, segments=None
    ):
        """As Transformer's, with RoPE tables of the rotary dims only."""
        b, t = input_ids_bt.shape
        if attention_mask_bt is None:
            attention_mask_bt = jnp.ones((b, t), jnp.bool_)
        mask_bt = attention_mask_bt.astype(jnp.bool_)
        rope_cfg = dataclasses.replace(self.cfg, head_dim=self.cfg.rope_dim)
        if positions_bt is None:
            positions_bt = jnp.maximum(jnp.cumsum(mask_bt, axis=-1) - 1, 0)
            positions_below = t
        rope = rope_tables(rope_cfg, positions_bt, num_positions=positions_below)
        return RowMask(mask_bt, segments), rope

    def _run_layers(
        self,
        x_btd,
        mask,
        rope,
        counted_bt,
        use_lora=True,
        expert_ids=None,
        replay=True,
        context=False,
    ):
        """Every layer on x_btd -> (x_btd, per-layer (k, v) [l, b, t, k, h] each, MoEOutput or
        None). `counted_bt`: the tokens the router stats count. `expert_ids` [l_moe, b, t, k]
        (-1 rows: not recorded): recorded routing, replayed when `replay`, and compared with
        the router's own choice either way (MoEOutput.mismatch). `context`: permuted rows split
        over `self.context_parallel` (attention by `context.attention`)."""
        cfg, spec = self.cfg, self.cfg.moe
        path = resolve_kernels(cfg.kernels)
        attn_stack = self._layer_params(use_lora)
        keys, values, ids_out, stats_out, differ_out = [], [], [], [], []
        for sparse, i0, i1, j0 in layer_runs(spec.sparse_layers):

            def layer(x_btd, xs, sparse=sparse):
                p, m, ids = xs
                p, m = cast_floats(p, cfg.jnp_dtype), cast_floats(m, cfg.jnp_dtype)
                x_btd = self._constrain(x_btd)
                q, k, v = _qkv(p, cfg, x_btd, rope)
                if context:
                    cp, block = self.context_parallel, cfg.attention_block_size
                    attn_btnh = _context.attention(q, k, v, mask, cp, block)
                else:
                    attn_btnh = attention(q, k, v, mask, cfg)
                x_btd, routing = _mlp(
                    p,
                    m,
                    cfg,
                    x_btd,
                    attn_btnh,
                    sparse,
                    path,
                    ids if replay else None,
                    self.expert_parallel,
                )
                out = (k, v)
                if sparse:
                    stats = moe_lib.router_stats(routing, counted_bt, spec.num_experts)
                    out += (routing.expert_ids_tk, stats)
                    if ids is not None:
                        differ = moe_lib.routing_mismatch(routing.chosen_tk, ids)
                        out += (differ.astype(jnp.int32),)
                return self._constrain(x_btd), out

            if cfg.remat != "none":
                layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
            j1 = j0 + i1 - i0
            p = {name: w[i0:i1] for name, w in attn_stack.items()}
            m = {name: w[j0:j1] for name, w in self._mlp_params(sparse).items()}
            ids = None if expert_ids is None or not sparse else expert_ids[j0:j1]
            x_btd, out = jax.lax.scan(layer, x_btd, (p, m, ids))
            keys.append(out[0])
            values.append(out[1])
            if sparse:
                ids_out.append(out[2])
                stats_out.append(out[3])
                if expert_ids is not None:
                    differ_out.append(jnp.sum(out[4], axis=0))
        routed = None
        if ids_out:
            mismatch = sum(differ_out) if differ_out else None
            routed = MoEOutput(jnp.concatenate(ids_out), moe_lib.stack_stats(stats_out), mismatch)
        return x_btd, (jnp.concatenate(keys), jnp.concatenate(values)), routed

    # ------------------------------------------------------------------------- forward

    def _hidden(
        self,
        input_ids_bt,
        positions_bt=None,
        attention_mask_bt=None,
        use_lora=True,
        segments=None,
        context=False,
    ):
        """As Transformer's; routing in/out through `token_logprobs_routed`'s hand-over (under
        `context` the rows are permuted, `context.zigzag`: recorded ids are permuted on the way
        in, the chosen ids and mismatch counts put back in row order on the way out)."""
        cfg = self.cfg
        b, t = input_ids_bt.shape
        if segments is None:
            below = t if context else None
            mask, rope = self._attention_inputs(
                input_ids_bt, positions_bt, attention_mask_bt, below
            )
            counted_bt = (
                jnp.ones((b, t), jnp.bool_) if attention_mask_bt is None else attention_mask_bt
            )
        else:
            positions_bt, segments_bt = segments
            mask, rope = self._attention_inputs(
                input_ids_bt, positions_bt, segments_bt > 0, t, segments_bt
            )
            counted_bt = segments_bt > 0
        x_btd = jnp.take(self.embed[...], input_ids_bt, axis=0).astype(cfg.jnp_dtype)
        hand_over = self.__dict__.get("_routing_hand_over")
        ids_in = None if hand_over is None else hand_over.get("expert_ids")
        replay = hand_over is None or hand_over.get("replay", True)
        c = self.context_parallel.size if context else 1
        if ids_in is not None and context:
            ids_in = _layer_major_permuted(ids_in, c, _context.zigzag)
        x_btd, _, routed = self._run_layers(
            self._constrain(x_btd), mask, rope, counted_bt, use_lora, ids_in, replay, context
        )
        if routed is not None and context:
            back = _layer_major_permuted(routed.expert_ids, c, _context.unzigzag)
            mismatch = routed.mismatch
            mismatch = None if mismatch is None else _context.unzigzag(mismatch, c)
            routed = routed._replace(expert_ids=back, mismatch=mismatch)
        if hand_over is not None:
            hand_over["out"] = routed
        return x_btd

    def token_logprobs_routed(
        self,
        input_ids_bt,
        attention_mask_bt=None,
        temperature=1.0,
        *,
        expert_ids=None,
        replay=True,
        **kwargs,
    ) -> tuple[jax.Array, MoEOutput]:
        """`token_logprobs` (same arguments) -> (logprobs, MoEOutput of that forward);
        `expert_ids` [l_moe, b, t, k] (a token's ids -1: not recorded) is a recorded routing
        (the sampler's): replayed when `replay` (unrecorded tokens: the router chooses) and
        compared with the router's own choice (MoEOutput.mismatch). (The ids and stats are
        handed from `_hidden` through a per-call entry of the instance dict, removed before
        returning: `token_logprobs` keeps its signature.)"""
        self.__dict__["_routing_hand_over"] = {"expert_ids": expert_ids, "replay": replay}
        try:
            lp = self.token_logprobs(input_ids_bt, attention_mask_bt, temperature, **kwargs)
            return lp, self.__dict__["_routing_hand_over"]["out"]
        finally:
            del self.__dict__["_routing_hand_over"]

    # ------------------------------------------------------------------------- sampler

    def layer_weights(self) -> tuple[dict, ...]:
        """Every layer's weights in the compute dtype, as its own arrays (LoRA merged): the
        attention params and, under "mlp", its dense MLP or MoE params."""
        cfg, spec = self.cfg, self.cfg.moe
        stacked = self._layer_params()
        mlp = {s: self._mlp_params(s) for s in (False, True)}
        out, index = [], {False: 0, True: 0}
        for i, sparse in enumerate(spec.sparse_layers):
            p = lora_lib.merge_layer({name: w[i] for name, w in stacked.items()}, cfg.lora)
            j = index[sparse]
            index[sparse] += 1
            p["mlp"] = {name: w[j] for name, w in mlp[sparse].items()}
            out.append(cast_floats(p, cfg.jnp_dtype))
        return tuple(out)

    def prefill(
        self, input_ids_bt, positions_bt, attention_mask_bt, cache_len: int, last_layer=None
    ):
        """As Transformer's (`last_layer` is not used: every layer runs on every position)."""
        logits_bv, cache, _ = self.prefill_routed(
            input_ids_bt, positions_bt, attention_mask_bt, cache_len
        )
        return logits_bv, cache

    def prefill_routed(self, input_ids_bt, positions_bt, attention_mask_bt, cache_len: int):
        """`prefill` -> (logits_bv, cache, expert ids [l_moe, b, t, k] of the prompt tokens)."""
        cfg, dtype = self.cfg, self.cfg.jnp_dtype
        path = resolve_kernels(cfg.kernels)
        t = input_ids_bt.shape[1]
        mask, rope = self._attention_inputs(
            input_ids_bt, positions_bt, attention_mask_bt, positions_below=t
        )
        x_btd = jnp.take(self.embed[...], input_ids_bt, axis=0).astype(dtype)
        x_btd, (k_lbtkh, v_lbtkh), routed = self._run_layers(x_btd, mask, rope, attention_mask_bt)
        cache = KVCache(
            _kernels.cache_from_prefill(k_lbtkh, cache_len, dtype, path, values=False),
            _kernels.cache_from_prefill(v_lbtkh, cache_len, dtype, path, values=True),
        )
        ids = None if routed is None else routed.expert_ids
        return self._logits(x_btd[:, -1:])[:, 0], cache, ids

    def decode_step(
        self,
        layers,
        token_b,
        positions_b,
        kv_mask_bs,
        cache: KVCache,
        slot,
        attend_len: Optional[int] = None,
        head_dv=None,
    ):
        """As Transformer's."""
        logits_bv, cache, _ = self.decode_step_routed(
            layers, token_b, positions_b, kv_mask_bs, cache, slot, attend_len, head_dv
        )
        return logits_bv, cache

    def decode_step_routed(
        self,
        layers,
        token_b,
        positions_b,
        kv_mask_bs,
        cache: KVCache,
        slot,
        attend_len=None,
        head_dv=None,
    ):
        """`decode_step` -> (logits_bv, cache, expert ids [l_moe, b, k] of the fed token)."""
        cfg = self.cfg
        path = resolve_kernels(cfg.kernels)
        num_slots = _kernels.cache_slots(cache.keys[0], path)
        s = num_slots if attend_len is None else attend_len
        slot = jnp.asarray(slot, jnp.int32)
        mask_bs = kv_mask_bs[:, :s] & (jnp.arange(s)[None, :] <= slot[..., None])
        rope_cfg = dataclasses.replace(cfg, head_dim=cfg.rope_dim)
        rope = rope_tables(rope_cfg, positions_b[:, None], num_positions=kv_mask_bs.shape[1])
        x_b1d = jnp.take(self.embed[...], token_b[:, None], axis=0, mode="clip")
        x_b1d = x_b1d.astype(cfg.jnp_dtype)
        keys, values, ids = [], [], []
        for p, sparse, k_cache, v_cache in zip(
            layers, cfg.moe.sparse_layers, cache.keys, cache.values
        ):
            q_b1nh, k_b1kh, v_b1kh = _qkv(p, cfg, x_b1d, rope)
            out_b1nh, k_cache, v_cache = _kernels.decode_attention(
                q_b1nh, k_b1kh, v_b1kh, k_cache, v_cache, slot, mask_bs, path
            )
            keys.append(k_cache)
            values.append(v_cache)
            x_b1d, routing = _mlp(p, p["mlp"], cfg, x_b1d, out_b1nh, sparse, path)
            if sparse:
                ids.append(routing.expert_ids_tk[:, 0])
        ids_lbk = jnp.stack(ids) if ids else None
        return self._logits(x_b1d, head_dv)[:, 0], KVCache(tuple(keys), tuple(values)), ids_lbk
