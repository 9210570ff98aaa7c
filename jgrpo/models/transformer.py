"""The decoder-only transformer (Llama / Qwen2 / Qwen3 families) in Flax NNX.

Covers HF LlamaForCausalLM (attention_bias, mlp_bias), Qwen2ForCausalLM (q/k/v biases) and
Qwen3ForCausalLM (q/k RMSNorm, head_dim, attention_bias): RMSNorm, RoPE (default, llama3),
GQA/MQA, SwiGLU, tied or untied embeddings, LoRA (`cfg.lora`, models/lora.py). Numerics follow
transformers' PyTorch forward (norms, softmax, RoPE, logits and logprobs in float32); params
stored in `cfg.param_dtype` are cast to the compute dtype `cfg.dtype` at use, per layer.

Entry points: `model(input_ids_bt, positions_bt=None, attention_mask_bt=None)` -> logits_btv;
`token_logprobs` (chunked, no [b, t, v] logits; the trainer's forward); `hidden_states` (for
a reward model's score head); `prefill` and `decode_step` over a KVCache with `layer_weights()`
taken once per generate call (the sampler's API). Layers are stacked on a leading `layers`
axis, run with `lax.scan` (the decode step unrolls them); logical axis names for sharding.
Shape legend: b batch rows, t query tokens, s key slots, d model, n query heads, k kv heads,
g query heads per kv head, h head dim, f mlp, v vocab, l layers."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jgrpo.models import context as _context
from jgrpo.models import kernels as _kernels
from jgrpo.models import lora as lora_lib
from jgrpo.models.blockwise import RowMask, blockwise_attention
from jgrpo.models.head_chunks import from_chunks, to_chunks
from jgrpo.models.kernels import resolve_kernels
from jgrpo.models.rope import RopeScaling, apply_rope, rope_tables


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Architecture hyperparameters (hashable: it is a static argument of jitted functions)."""

    family: str
    """HF model_type: llama | qwen2 | qwen3."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """q/k/v projections carry biases (Qwen2; Llama / Qwen3 attention_bias)."""
    o_bias: bool = False
    """The attention output projection carries a bias (Llama / Qwen3 attention_bias)."""
    mlp_bias: bool = False
    """gate/up/down projections carry biases (Llama mlp_bias)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on q and k before RoPE (Qwen3)."""
    max_position_embeddings: int = 2048
    dtype: str = "float32"
    """Compute dtype (activations, matmul inputs; params are cast to it at use): float32 |
    bfloat16. Logits and logprobs are float32 whatever it is."""
    param_dtype: str = "float32"
    """Storage dtype of the parameters (init and load): float32 | bfloat16."""
    remat: str = "none"
    """Recompute each layer in the backward of `__call__` / `token_logprobs`: none | full | dots
    (`REMAT_POLICIES`)."""
    logprob_chunk_size: int = 128
    """Tokens along T per chunk of `token_logprobs`' LM head + log-softmax (0 = one chunk)."""
    attention_block_size: int = 1024
    """Rows longer than this run blockwise attention in blocks of it (`attention`; memory
    linear in the row); shorter ones materialise [t, t] scores (0 = always materialise)."""
    kernels: str = "auto"
    """Platform kernels (`jgrpo.models.kernels`): auto (cpu on the CPU backend, else
    portable) | cpu | portable."""
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: Optional[int] = None
    lora: Optional[lora_lib.LoRASpec] = None
    """LoRA adapters on the targeted projections (None = none; see models/lora.py)."""

    @property
    def jnp_dtype(self):
        """The compute dtype."""
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        return jnp.dtype(self.param_dtype)


REMAT_POLICIES = {
    "full": None,  # save nothing inside a layer: its input is the only residual
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep weight matmuls
}
"""jax.checkpoint policies of `TransformerConfig.remat` (none = no jax.checkpoint)."""


def cast_floats(tree, dtype):
    """Every floating leaf of `tree` as `dtype` (the compute-dtype cast of parameters)."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


class KVCache(NamedTuple):
    """One keys and one values array per layer (separate buffers, so a decode step updates and
    reads each layer's cache in place), in the compute dtype. The layout is the kernel path's
    (`jgrpo.models.kernels`): cpu keys [b, k, h, s] (q . k contracts h over contiguous slots)
    and values [b, k, s, h]; portable keys and values [b, s, k, h]."""

    keys: tuple[jax.Array, ...]
    """Per layer: [b, k, h, s] (cpu kernels) or [b, s, k, h] (portable)."""
    values: tuple[jax.Array, ...]
    """Per layer: [b, k, s, h] (cpu kernels) or [b, s, k, h] (portable)."""


# ----------------------------------------------------------------------------- pure pieces


def rms_norm(x, weight, eps):
    """HF RMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def attention(q_btnh, k_bskh, v_bskh, mask: RowMask, cfg: TransformerConfig):
    """Causal grouped-query softmax attention of aligned rows (query i is key i) -> [b, t, n,
    h]; scores and softmax in float32. Rows longer than `cfg.attention_block_size` run the
    blockwise path (`jgrpo.models.blockwise`: memory linear in t); shorter ones materialise
    `mask.dense()` and run the platform kernel (`cfg.kernels`, `jgrpo.models.kernels`: the CPU
    einsum, or jax.nn.dot_product_attention, cuDNN's flash kernel where it applies)."""
    block = cfg.attention_block_size
    if block and q_btnh.shape[1] > block:
        return blockwise_attention(q_btnh, k_bskh, v_bskh, *mask, block=block)
    path = resolve_kernels(cfg.kernels)
    return _kernels.attention(q_btnh, k_bskh, v_bskh, mask.dense(), path, causal=True)


def _project(x, w, contract: int = 1):
    """x [..., K] @ w [K, ...], K = w's first `contract` axes: one 2-D dot over the flattened
    tokens (XLA:CPU transposes an einsum's b, t weight-gradient dots; docs/performance.md), the
    einsum under `context.rows_split()` (flattening t split over context gathers whole rows)."""
    if _context.ROWS_SPLIT.get():
        return jnp.tensordot(x, w, axes=contract)
    k, lead = math.prod(w.shape[:contract]), x.shape[: x.ndim - contract]
    y = jnp.dot(x.reshape(-1, k), w.reshape(k, -1))
    return y.reshape(*lead, *w.shape[contract:])


def _dense(x, w, b=None, contract: int = 1):
    return _project(x, w, contract) if b is None else _project(x, w, contract) + b


def _fuse_layer_params(stacked, i: int, cfg):
    """Layer i of the stacked params in inference layout, as its own arrays: q|k|v and gate|up
    (and their biases) concatenated on the output axis (one dot each instead of three and two),
    o flattened to [n * h, d] (with two contracting axes XLA:CPU transposed both operands of
    every decode step's o dot), in the compute dtype (params may be stored in another)."""
    # LoRA adapters are merged in the stored dtype, then the sum is cast once
    p = lora_lib.merge_layer({name: w[i] for name, w in stacked.items()}, cfg.lora)
    p = {name: w.astype(cfg.jnp_dtype) for name, w in p.items()}
    d = p["q"].shape[0]
    p["o"] = p["o"].reshape(-1, d)
    p["qkv"] = jnp.concatenate([p.pop(name).reshape(d, -1) for name in "qkv"], axis=-1)
    if cfg.attention_bias:
        biases = [p.pop(f"{name}_bias").reshape(-1) for name in "qkv"]
        p["qkv_bias"] = jnp.concatenate(biases, axis=-1)
    p["gate_up"] = jnp.concatenate([p.pop("gate"), p.pop("up")], axis=-1)
    if cfg.mlp_bias:
        p["gate_up_bias"] = jnp.concatenate([p.pop("gate_bias"), p.pop("up_bias")], axis=-1)
    return p


def _layer_qkv(p, cfg, x_btd, rope):
    h_btd = rms_norm(x_btd, p["attn_norm"], cfg.rms_norm_eps)
    if "qkv" in p:  # fused (inference) layout
        b, t = x_btd.shape[:2]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = _dense(h_btd, p["qkv"], p.get("qkv_bias"))
        q, k, v = jnp.split(qkv, (q_size, q_size + kv_size), axis=-1)
        kv_shape = (b, t, cfg.num_kv_heads, cfg.head_dim)
        q, k, v = q.reshape(b, t, cfg.num_heads, -1), k.reshape(kv_shape), v.reshape(kv_shape)
    else:
        q = _dense(h_btd, p["q"], p.get("q_bias"))
        k = _dense(h_btd, p["k"], p.get("k_bias"))
        v = _dense(h_btd, p["v"], p.get("v_bias"))
        q, k, v = (lora_lib.add_delta(y, p, w, h_btd, cfg.lora) for y, w in zip((q, k, v), "qkv"))
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, *rope), apply_rope(k, *rope), v


def _layer_out(p, cfg, x_btd, attn_btnh):
    if "qkv" in p:  # fused (inference) layout: o is [n * h, d]
        b, t = attn_btnh.shape[:2]
        x_btd = x_btd + _dense(attn_btnh.reshape(b, t, -1), p["o"], p.get("o_bias"))
    else:
        o_btd = _dense(attn_btnh, p["o"], p.get("o_bias"), contract=2)
        x_btd = x_btd + lora_lib.add_delta(o_btd, p, "o", attn_btnh, cfg.lora)
    h_btd = rms_norm(x_btd, p["mlp_norm"], cfg.rms_norm_eps)
    if "gate_up" in p:  # fused (inference) layout
        gate_btf, up_btf = jnp.split(_dense(h_btd, p["gate_up"], p.get("gate_up_bias")), 2, -1)
    else:
        gate_btf, up_btf = (
            lora_lib.add_delta(_dense(h_btd, p[w], p.get(f"{w}_bias")), p, w, h_btd, cfg.lora)
            for w in ("gate", "up")
        )
    act_btf = jax.nn.silu(gate_btf) * up_btf
    down_btd = _dense(act_btf, p["down"], p.get("down_bias"))
    return x_btd + lora_lib.add_delta(down_btd, p, "down", act_btf, cfg.lora)


# ----------------------------------------------------------------------------- the module


def _param(rngs, shape, axes, dtype, scale):
    if scale is None:  # norm weights start at one
        value = jnp.ones(shape, dtype)
    else:
        value = (scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


class Transformer(nnx.Module):
    """Decoder-only LM. Parameters are stacked over layers (see module docstring)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs, init_scale: float = 0.02):
        self.cfg = cfg
        # where the trainer's [b, t, d] activations live: a jax Sharding, static in the graph
        # def (None = wherever propagation puts them); set by jgrpo.step_setup.constrained_graphdef
        self.activation_sharding = None
        # where token_logprobs puts the LM head and its chunks (a jgrpo.sharding.LogitShardings:
        # the vocab-parallel head), static in the graph def likewise (None = propagation)
        self.logit_shardings = None
        # how token_logprobs splits rows over the mesh's context axis (a jgrpo.sharding.
        # ContextParallel, models/context.py), static likewise (None = rows stay whole)
        self.context_parallel = None
        d, f, l, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
        n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        dt, s = cfg.jnp_param_dtype, init_scale
        self.embed = _param(rngs, (v, d), ("vocab", "embed"), dt, s)
        layers = {
            "attn_norm": _param(rngs, (l, d), ("layers", "norm"), dt, None),
            "q": _param(rngs, (l, d, n, h), ("layers", "embed", "heads", "head_dim"), dt, s),
            "k": _param(rngs, (l, d, k, h), ("layers", "embed", "kv_heads", "head_dim"), dt, s),
            "v": _param(rngs, (l, d, k, h), ("layers", "embed", "kv_heads", "head_dim"), dt, s),
            "o": _param(rngs, (l, n, h, d), ("layers", "heads", "head_dim", "embed"), dt, s),
            "mlp_norm": _param(rngs, (l, d), ("layers", "norm"), dt, None),
            "gate": _param(rngs, (l, d, f), ("layers", "embed", "mlp"), dt, s),
            "up": _param(rngs, (l, d, f), ("layers", "embed", "mlp"), dt, s),
            "down": _param(rngs, (l, f, d), ("layers", "mlp", "embed"), dt, s),
        }
        if cfg.attention_bias:
            layers["q_bias"] = _param(rngs, (l, n, h), ("layers", "heads", "head_dim"), dt, s)
            layers["k_bias"] = _param(rngs, (l, k, h), ("layers", "kv_heads", "head_dim"), dt, s)
            layers["v_bias"] = _param(rngs, (l, k, h), ("layers", "kv_heads", "head_dim"), dt, s)
        if cfg.o_bias:
            layers["o_bias"] = _param(rngs, (l, d), ("layers", "embed"), dt, s)
        for name, width, axis in (("gate", f, "mlp"), ("up", f, "mlp"), ("down", d, "embed")):
            if cfg.mlp_bias:
                layers[f"{name}_bias"] = _param(rngs, (l, width), ("layers", axis), dt, s)
        if cfg.qk_norm:
            layers["q_norm"] = _param(rngs, (l, h), ("layers", "head_dim"), dt, None)
            layers["k_norm"] = _param(rngs, (l, h), ("layers", "head_dim"), dt, None)
        self.layers = nnx.Dict(layers)
        self.final_norm = _param(rngs, (d,), ("norm",), dt, None)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (d, v), ("embed", "vocab"), dt, s)
        self.lora = None if cfg.lora is None else lora_lib.make_adapter_params(cfg, rngs)

    def _constrain(self, x_btd):
        if self.activation_sharding is None:
            return x_btd
        return jax.lax.with_sharding_constraint(x_btd, self.activation_sharding)

    def _pin(self, x, field: str):
        """x constrained to `self.logit_shardings.<field>` (as it is when that is None)."""
        where = None if self.logit_shardings is None else getattr(self.logit_shardings, field)
        return x if where is None else jax.lax.with_sharding_constraint(x, where)

    def _layer_params(self, use_lora: bool = True):
        """The stacked layer params as stored, with the LoRA adapters unless use_lora=False."""
        stacked = {name: p[...] for name, p in self.layers.items()}
        if use_lora and self.lora is not None:
            stacked |= {name: p[...] for name, p in self.lora.items()}
        return stacked

    def _head(self):
        """The LM head [d, v] as stored (the transposed embedding when tied)."""
        return self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]

    def _final_norm(self, x_btd):
        return rms_norm(x_btd, self.final_norm[...].astype(x_btd.dtype), self.cfg.rms_norm_eps)

    def head_weights(self):
        """The LM head [d, v] in the compute dtype (the tied head: the embedding transposed):
        what `decode_step` takes as `head_dv`, taken once per generate call, outside the loop."""
        return self._head().astype(self.cfg.jnp_dtype)

    def _logits(self, x_btd, head_dv=None):
        """Final norm + LM head (`head_weights()` unless given) -> float32 logits (matmul
        inputs in the compute dtype)."""
        head_dv = self.head_weights() if head_dv is None else head_dv
        return jnp.einsum(
            "btd,dv->btv", self._final_norm(x_btd), head_dv, preferred_element_type=jnp.float32
        )

    def layer_weights(self) -> tuple[dict, ...]:
        """Every layer's weights in inference layout (`_fuse_layer_params`), each as its own
        arrays: what `decode_step` runs on (and `prefill`'s last layer). A copy of the layer
        weights when called under jit: take it once per generate call, outside the decode loop
        (a scan over the stacked weights would slice, i.e. copy, every layer per token)."""
        stacked = self._layer_params()
        return tuple(_fuse_layer_params(stacked, i, self.cfg) for i in range(self.cfg.num_layers))

    def _attention_inputs(
        self, input_ids_bt, positions_bt, attention_mask_bt, positions_below=None, segments=None
    ):
        """-> (RowMask: causal & key padding & one segment of `segments` [b, t] (packed rows),
        RoPE tables) for t tokens; positions are < `positions_below` if known (`rope_tables`)."""
        b, t = input_ids_bt.shape
        if attention_mask_bt is None:
            attention_mask_bt = jnp.ones((b, t), jnp.bool_)
        mask_bt = attention_mask_bt.astype(jnp.bool_)
        if positions_bt is None:
            positions_bt = jnp.maximum(jnp.cumsum(mask_bt, axis=-1) - 1, 0)
            rope = rope_tables(self.cfg, positions_bt, num_positions=t)
        else:
            rope = rope_tables(self.cfg, positions_bt, num_positions=positions_below)
        return RowMask(mask_bt, segments), rope

    def _hidden(
        self,
        input_ids_bt,
        positions_bt=None,
        attention_mask_bt=None,
        use_lora=True,
        segments=None,
        context=False,
    ):
        """The layer stack -> hidden states [b, t, d] before the final norm (compute dtype).
        `segments` = (positions_bt, segment_ids_bt) of packed rows (`token_logprobs`).
        `context`: rows permuted and split over `self.context_parallel` (models/context.py).

        Each layer's stored weights are cast to the compute dtype inside the scan body, so no
        full-model copy in the compute dtype exists, and in the backward their gradients leave
        the body in the stored dtype (16-bit stored weights enter the scan as their integer
        views on the CPU path, `kernels.from_bits`: no float32 copy of a stack). With `cfg.remat`
        the body is a `jax.checkpoint`: the backward keeps only each layer's input (full) or
        also its weight-matmul outputs (dots) and recomputes the rest; on the CPU path a 16-bit
        layer input enters the checkpoint as its integer view too, so the stack of inputs the
        backward keeps is uint16, not float32."""
        cfg = self.cfg
        t = input_ids_bt.shape[1]
        if segments is None:
            mask, rope = self._attention_inputs(
                input_ids_bt, positions_bt, attention_mask_bt, t if context else None
            )
        else:  # every position of a packed row is < its width
            positions_bt, segments_bt = segments
            mask, rope = self._attention_inputs(
                input_ids_bt, positions_bt, segments_bt > 0, input_ids_bt.shape[1], segments_bt
            )

        def layer(x_in, xs):
            x_bits, x_btd = x_in  # x_bits: x_btd's uint16 view (the remat residual) or None
            if x_bits is not None:
                x_btd = _kernels.from_bits(x_bits, x_btd)
            p, bits = xs
            p = {n: _kernels.from_bits(bits[n], w) if n in bits else w for n, w in p.items()}
            p = cast_floats(p, cfg.jnp_dtype)
            x_btd = self._constrain(x_btd)
            q, k, v = _layer_qkv(p, cfg, x_btd, rope)
            if context:
                cp, block = self.context_parallel, cfg.attention_block_size
                attn_btnh = _context.attention(q, k, v, mask, cp, block)
            else:
                attn_btnh = attention(q, k, v, mask, cfg)
            return self._constrain(_layer_out(p, cfg, x_btd, attn_btnh)), None

        if cfg.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
        x_btd = jnp.take(self.embed[...], input_ids_bt, axis=0).astype(cfg.jnp_dtype)
        stacked = self._layer_params(use_lora)
        path = resolve_kernels(cfg.kernels)
        bits = _kernels.uint16_views(stacked, path)

        def body(x_btd, xs):
            views = {} if cfg.remat == "none" else _kernels.uint16_views({"x": x_btd}, path)
            return layer((views.get("x"), x_btd), xs)

        x_btd, _ = jax.lax.scan(body, self._constrain(x_btd), (stacked, bits))
        return x_btd

    def __call__(self, input_ids_bt, positions_bt=None, attention_mask_bt=None, *, use_lora=True):
        """-> float32 logits [b, t, v]: causal attention over the given tokens;
        `attention_mask_bt` (1 = real token) masks padded keys, and positions default to
        `cumsum(mask) - 1`, so left- and right-padded batches both work. use_lora=False runs
        the base model alone (the reference policy of a LoRA run)."""
        hidden_btd = self._hidden(input_ids_bt, positions_bt, attention_mask_bt, use_lora)
        return self._logits(hidden_btd)

    def hidden_states(self, input_ids_bt, attention_mask_bt=None):
        """-> [b, t, d] final-normed hidden states in the compute dtype (HF's
        `last_hidden_state`): what a head other than the LM head (a reward model's score) reads."""
        return self._final_norm(self._hidden(input_ids_bt, None, attention_mask_bt))

    def token_logprobs(
        self,
        input_ids_bt,
        attention_mask_bt=None,
        temperature=1.0,
        *,
        use_lora=True,
        first_scored=1,
        packed=None,
        top_k=0,
        topk_ids=None,
    ):
        """[b, t] float32 logprob of input_ids_bt[:, t] under softmax(logits[:, t-1] /
        temperature), column 0 = 0: `losses.token_logprobs(self(ids), ids, temperature)`
        without ever holding [b, t, v] logits. `first_scored` (static): columns before it
        are 0 and their logits are never computed (the trainer passes rollout.prompt_bucket:
        no generated token sits left of it, and a prompt's logprobs are never used).
        `packed` = (positions_bt, segment_ids_bt, scored_bn) of packed rows (jgrpo.packing):
        attention within segments, and the [b, n] logprobs of the tokens at columns scored_bn
        only (0 where scored_bn is 0).

        The LM head, log-sum-exp and the gathered target logit run over chunks of
        `cfg.logprob_chunk_size` positions along t (lax.map); with several chunks each is a
        `jax.checkpoint` (the backward recomputes its logits: memory O(b x chunk x v)); one chunk
        is not (XLA merges its recompute with the forward on some shardings only, so flops
        would depend on the mesh). Under the trainer's `logit_shardings` the head is
        vocab-parallel (`jgrpo.sharding.LogitShardings`): each device holds a vocab slice in
        its stored dtype (cast inside each chunk, so its gradient sums over chunks in float32)
        and computes that slice's logits. Otherwise it is cast once, before the loop.
        Top-k distillation (jgrpo.distillation): `top_k` (static) > 0 -> (logprobs, (top-k
        logprobs, ids) [b, t, k]); `topk_ids` [b, t, j] -> (logprobs, logits/temp at them)."""
        if self.context_parallel is not None:
            if top_k > 0 or topk_ids is not None:  # jgrpo.distillation rejects the config
                raise ValueError("top-k distillation does not run under context parallelism")
            args = (attention_mask_bt, temperature, use_lora, first_scored, packed)
            return _context.token_logprobs(self, input_ids_bt, *args)
        cfg = self.cfg
        seg = None if packed is None else packed[:2]
        x_btd = self._final_norm(self._hidden(input_ids_bt, None, attention_mask_bt, use_lora, seg))
        b, t = input_ids_bt.shape
        first = min(max(int(first_scored), 1), t)
        if packed is None:  # scored columns first .. t-1, each from the position before it
            n, targets_bn, x_bnd = t - first, input_ids_bt[:, first:], x_btd[:, first - 1 : t - 1]
        else:  # the tokens of the scored slots, each from the position before it
            n, scored_bn = packed[2].shape[1], packed[2]
            targets_bn = jnp.take_along_axis(input_ids_bt, scored_bn, axis=1)
            x_bnd = jnp.take_along_axis(x_btd, jnp.maximum(scored_bn - 1, 0)[..., None], axis=1)
        if n == 0:
            return jnp.zeros((b, t if packed is None else 0), jnp.float32)
        c = min(cfg.logprob_chunk_size or n, n)
        k = -(-n // c)
        scored_bn = None if packed is None else packed[2]  # topk_ids: by slot, or by column
        ids_kbcj = to_chunks(topk_ids, k, c, 0 if packed else first)
        xs = (to_chunks(x_bnd, k, c), to_chunks(targets_bn, k, c))
        out = self._chunk_logprobs(*xs, temperature, top_k, ids_kbcj)
        return jax.tree.map(lambda a: from_chunks(a, n, first, scored_bn), out)

    def _chunk_logprobs(self, x_kbcd, targets_kbc, temperature, top_k=0, ids_kbcj=None):
        """[k, b, c] logprobs of targets_kbc from the final-normed x_kbcd, chunk by chunk
        (`token_logprobs`' LM head loop), paired with the top-k or ids_kbcj extras."""
        cfg, k = self.cfg, x_kbcd.shape[0]
        temperature = jnp.asarray(temperature, jnp.float32)
        temperature = jnp.where(temperature > 0, temperature, 1.0)  # greedy: as losses does
        # the stored head pinned to its own sharding (its gradient is reduce-scattered into
        # it), then moved to the chunks' layout once, before the loop: XLA would hoist the
        # move out of the loop anyway, and a head gathered whole there is one full copy per
        # forward (XLA:CPU runs bfloat16 matmuls in float32, so each copy is a float32 head;
        # docs/performance.md: memory of a step)
        stored = self.embed[...] if cfg.tie_word_embeddings else self.lm_head[...]
        stored = self._pin(stored, "head")
        head_vd = self._pin(stored if cfg.tie_word_embeddings else stored.T, "head_vd")
        vocab_parallel = self.logit_shardings is not None and self.logit_shardings.head_vd
        if not vocab_parallel:  # whole (or gathered) on each device: cast once, before the loop
            head_vd = head_vd.astype(cfg.jnp_dtype)

        def chunk(xs):
            x_bcd, targets_bc, ids_bcj = xs
            x_bcd = self._pin(self._constrain(x_bcd), "rows_bcd")
            logits_bcv = jnp.einsum(
                "bcd,vd->bcv",
                x_bcd,
                head_vd.astype(cfg.jnp_dtype),
                preferred_element_type=jnp.float32,
            )
            logits_bcv = self._pin(logits_bcv / temperature, "logits_bcv")
            if vocab_parallel:  # a select-and-sum reduces over vocab slices (a gather would not)
                vocab_v = jnp.arange(logits_bcv.shape[-1], dtype=targets_bc.dtype)
                hit_bcv = vocab_v == targets_bc[..., None]
                picked_bc = jnp.sum(jnp.where(hit_bcv, logits_bcv, 0.0), axis=-1)
            else:
                picked_bc = jnp.take_along_axis(logits_bcv, targets_bc[..., None], axis=-1)[..., 0]
            lse_bc = jax.nn.logsumexp(logits_bcv, axis=-1)
            lp_bc = self._pin(picked_bc - lse_bc, "out_bc")
            if top_k > 0:  # the teacher's k largest logits, as logprobs, and their ids
                top_bck, ids_bck = jax.lax.top_k(logits_bcv, top_k)
                return lp_bc, (top_bck - lse_bc[..., None], ids_bck)
            if ids_bcj is None:
                return lp_bc
            return lp_bc, jnp.take_along_axis(logits_bcv, ids_bcj, axis=-1)  # the student's

        if k > 1:  # one chunk: no recompute (the docstring)
            chunk = jax.checkpoint(chunk, prevent_cse=False)
        return jax.lax.map(chunk, (x_kbcd, targets_kbc, ids_kbcj))

    def prefill(
        self, input_ids_bt, positions_bt, attention_mask_bt, cache_len: int, last_layer=None
    ):
        """Forward a (left-padded) prompt batch -> (logits_bv of its last position, KVCache of
        `cache_len` slots holding every layer's keys/values in slots [0, t), zeros after).
        Positions must be < t (as `cumsum(mask) - 1` of a padded batch is). `last_layer`: the
        last layer's weights when the caller holds them (`layer_weights()[-1]`). The embedding
        and layers run in the compute dtype whatever dtype the parameters are stored in.

        Only the last position's logits are wanted, so the last layer computes keys/values
        for every position (the cache needs them) but attention, output projection and MLP for
        the last position only.
        """
        cfg, dtype = self.cfg, self.cfg.jnp_dtype
        path = resolve_kernels(cfg.kernels)
        stacked = self._layer_params()
        t = input_ids_bt.shape[1]
        mask, rope = self._attention_inputs(
            input_ids_bt, positions_bt, attention_mask_bt, positions_below=t
        )

        def layer(x_btd, i):
            # the slice scan's xs would take, in the compute dtype
            p = {name: w[i].astype(dtype) for name, w in stacked.items()}
            q, k, v = _layer_qkv(p, cfg, x_btd, rope)
            attn_btnh = attention(q, k, v, mask, cfg)
            return _layer_out(p, cfg, x_btd, attn_btnh), (k, v)

        x_btd = jnp.take(self.embed[...], input_ids_bt, axis=0).astype(dtype)
        layer_ids = jnp.arange(cfg.num_layers - 1)
        x_btd, (k_lbtkh, v_lbtkh) = jax.lax.scan(layer, x_btd, layer_ids)
        p = last_layer if last_layer is not None else _fuse_layer_params(stacked, -1, cfg)
        q, k, v = _layer_qkv(p, cfg, x_btd, rope)
        attn_b1nh = _kernels.attention(q[:, -1:], k, v, mask.dense()[:, -1:], path)
        x_b1d = _layer_out(p, cfg, x_btd[:, -1:], attn_b1nh)

        def to_cache(kv_lbtkh, kv_btkh, values):
            kv_lbtkh = jnp.concatenate([kv_lbtkh, kv_btkh[None]])
            return _kernels.cache_from_prefill(kv_lbtkh, cache_len, dtype, path, values=values)

        cache = KVCache(to_cache(k_lbtkh, k, False), to_cache(v_lbtkh, v, True))
        return self._logits(x_b1d)[:, 0], cache

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
        """Forward one token per row against the cache -> (logits_bv, updated cache).

        `layers` is `self.layer_weights()` (in the compute dtype); the layers run unrolled,
        each writing its new key/value at cache `slot` with one `dynamic_update_slice` (in
        place in a loop carry; a [b] array `slot` gives each row its own column: a scatter).
        Positions must be < the number of cache slots (a token's slot bounds it). `attend_len`
        (static) limits attention to cache slots [0, attend_len): the caller promises no slot
        past it is wanted yet (the sampler decodes in segments: early tokens read less).
        `head_dv`: `self.head_weights()`, taken outside the decode loop (else: each step)."""
        cfg = self.cfg
        path = resolve_kernels(cfg.kernels)
        num_slots = _kernels.cache_slots(cache.keys[0], path)
        s = num_slots if attend_len is None else attend_len
        slot = jnp.asarray(slot, jnp.int32)
        mask_bs = kv_mask_bs[:, :s] & (jnp.arange(s)[None, :] <= slot[..., None])
        rope = rope_tables(cfg, positions_b[:, None], num_positions=kv_mask_bs.shape[1])

        # sampled ids are in range by construction; "clip" skips the out-of-range fill select
        x_b1d = jnp.take(self.embed[...], token_b[:, None], axis=0, mode="clip")
        x_b1d = x_b1d.astype(cfg.jnp_dtype)
        keys, values = [], []
        for p, k_cache, v_cache in zip(layers, cache.keys, cache.values):
            q_b1nh, k_b1kh, v_b1kh = _layer_qkv(p, cfg, x_b1d, rope)
            out_b1nh, k_cache, v_cache = _kernels.decode_attention(
                q_b1nh, k_b1kh, v_b1kh, k_cache, v_cache, slot, mask_bs, path
            )
            keys.append(k_cache)
            values.append(v_cache)
            x_b1d = _layer_out(p, cfg, x_b1d, out_b1nh)
        return self._logits(x_b1d, head_dv)[:, 0], KVCache(tuple(keys), tuple(values))
