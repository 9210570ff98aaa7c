"""The train step's forwards (jgrpo.step runs them): the model's logprobs of a batch.

`sequence_logprobs` (one forward, `Transformer.token_logprobs`), `policy_logprobs_routed` (the
policy's, with an MoE model's routing: router stats, recorded experts compared and replayed),
`frozen_logprobs` (a no-gradient forward over the whole batch in chunks, rows or packed rows);
`chunk_rows` / `unchunk_rows` / `scan_chunks` (rows to interleaved chunks and a scan over
them) and `with_frozen` (trainable + frozen params)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jgrpo import packing, replay
from jgrpo.models.moe_transformer import MoETransformer


def scan_chunks(f, carry, xs_k):
    """`jax.lax.scan(f, carry, xs_k)` over the leading (chunk) axis, or, for one chunk, the body
    called once: XLA keeps a one-trip while loop as a loop (nothing fuses across its
    boundary). Same values either way."""
    if jax.tree.leaves(xs_k)[0].shape[0] != 1:
        return jax.lax.scan(f, carry, xs_k)
    carry, y = f(carry, jax.tree.map(lambda x: x[0], xs_k))
    return carry, jax.tree.map(lambda x: x[None], y)


def chunk_rows(tree, num_chunks: int):
    """[B, ...] -> [K, B/K, ...] with row i in chunk i mod K (keeps batch sharding intact)."""

    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // num_chunks, num_chunks, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, tree)


def unchunk_rows(x_k):
    """Inverse of chunk_rows for one array."""
    return jnp.swapaxes(x_k, 0, 1).reshape(-1, *x_k.shape[2:])


def with_frozen(params, frozen):
    """The full parameter tree: the trainable `params` nested dict merged with the `frozen`
    one (None = nothing frozen). Their leaf paths are disjoint."""
    if frozen is None or params is None:
        return params
    out = dict(params)
    for key, value in frozen.items():
        out[key] = with_frozen(out[key], value) if key in out else value
    return out


def sequence_logprobs(
    graphdef,
    params,
    input_ids_bt,
    attention_mask_bt,
    temperature,
    use_lora=True,
    first_scored=1,
    packed=None,
    expert_ids=None,
    top_k=0,
):
    """[B, T] float32 logprobs of `input_ids_bt` under the model (temperature-scaled), through
    `Transformer.token_logprobs` (chunked LM head: no [B, T, V] logits); 0 in the columns
    before `first_scored` (no logits computed there); use_lora=False skips the LoRA adapters
    (the base model). `packed` = (positions, segment_ids, scored) of packed rows: the
    [R, H] logprobs of their scored slots instead. `expert_ids` [B, T, l_moe, k] (an MoE
    model): the recorded routing, replayed. `top_k` > 0: (logprobs, (the top-k logprobs,
    their ids)) (`Transformer.token_logprobs`: the distillation teacher's)."""
    model = nnx.merge(graphdef, params)
    kwargs = dict(use_lora=use_lora, first_scored=first_scored, packed=packed, top_k=top_k)
    if expert_ids is None:
        return model.token_logprobs(input_ids_bt, attention_mask_bt, temperature, **kwargs)
    ids = replay.layer_major(expert_ids)
    return model.token_logprobs_routed(
        input_ids_bt, attention_mask_bt, temperature, expert_ids=ids, **kwargs
    )[0]


def policy_logprobs_routed(
    graphdef,
    params,
    input_ids_bt,
    attention_mask_bt,
    temperature,
    first_scored=1,
    packed=None,
    expert_ids=None,
    replay_ids=False,
    topk_ids=None,
):
    """`sequence_logprobs` of the policy -> (logprobs, MoEOutput, MoESpec) of an MoE model's
    forward (the router stats of the aux losses), (logprobs, None, None) of a dense one.
    `expert_ids` [B, T, l_moe, k]: the recorded routing, compared with the router's choice
    (MoEOutput.mismatch) and replayed when `replay_ids`. `topk_ids` (top-k distillation): the
    logprobs are (logprobs, the logits at those ids) (`Transformer.token_logprobs`)."""
    model = nnx.merge(graphdef, params)
    kwargs = dict(first_scored=first_scored, packed=packed, topk_ids=topk_ids)
    if not isinstance(model, MoETransformer):
        return (
            model.token_logprobs(input_ids_bt, attention_mask_bt, temperature, **kwargs),
            None,
            None,
        )
    kwargs |= dict(expert_ids=replay.layer_major(expert_ids), replay=replay_ids)
    lp, routed = model.token_logprobs_routed(input_ids_bt, attention_mask_bt, temperature, **kwargs)
    return lp, routed, model.cfg.moe


def frozen_logprobs(
    name,
    graphdef,
    params,
    batch,
    temperature,
    num_chunks,
    use_lora=True,
    first_scored=1,
    layout=None,
    replay_ids=False,
    top_k=0,
):
    """A no-gradient forward over the whole batch (anything with input_ids, attention_mask and
    token_mask) in `num_chunks` chunks (bounded memory) -> [B, T]; with a packed `layout`,
    over its packed rows, read back to the batch's rows (0 off token_mask). `replay_ids`:
    route the recorded tokens with the batch's (the layout's) expert_ids. `top_k` > 0: (lp,
    (top-k logprobs, ids) [B, T, k]) (`sequence_logprobs`)."""
    packed = layout is not None
    inputs = layout.tokens() if packed else (batch.input_ids, batch.attention_mask)
    experts = (layout if packed else batch).expert_ids if replay_ids else None

    def forward(_, xs):
        mb, ids_btlk = xs
        ids, mask, where = (mb[0], None, mb[1:]) if packed else (*mb, None)
        lp = sequence_logprobs(
            graphdef, params, ids, mask, temperature, use_lora, first_scored, where, ids_btlk, top_k
        )
        return None, lp

    with jax.named_scope(f"forward_{name}"):
        _, lp_k = scan_chunks(forward, None, chunk_rows((inputs, experts), num_chunks))
    lp = jax.tree.map(unchunk_rows, lp_k)
    if packed:
        where = dict(row_b=layout.row, slot_b=layout.slot, token_mask_bt=batch.token_mask)
        lp = jax.tree.map(lambda a: packing.unpack_logprobs(a, **where), lp)
    return jax.lax.stop_gradient(lp)
