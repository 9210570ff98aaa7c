"""The LM head's position chunks (`Transformer.token_logprobs`): scored positions [b, n, ...]
to chunks [k, b, c, ...] of `logprob_chunk_size` positions and back to rows."""

from __future__ import annotations

import jax.numpy as jnp


def to_chunks(a_bn, k: int, c: int, start: int = 0):
    """[b, start + n, ...] -> [k, b, c, ...] of columns start.. zero-padded to k x c positions
    (None stays None)."""
    if a_bn is None:
        return None
    a_bn = a_bn[:, start:]
    b, n = a_bn.shape[:2]
    pad = [(0, 0), (0, k * c - n)] + [(0, 0)] * (a_bn.ndim - 2)
    return jnp.swapaxes(jnp.pad(a_bn, pad).reshape(b, k, c, *a_bn.shape[2:]), 0, 1)


def from_chunks(a_kbc, n: int, first: int, scored_bn=None):
    """[k, b, c, ...] -> [b, first + n, ...] with `first` zero columns in front, or, for
    packed rows (`scored_bn` [b, n]: 0 = no token), [b, n, ...] with 0 where unscored."""
    k, b, c = a_kbc.shape[:3]
    a_bn = jnp.swapaxes(a_kbc, 0, 1).reshape(b, k * c, *a_kbc.shape[3:])[:, :n]
    if scored_bn is not None:
        scored = (scored_bn > 0).reshape(b, n, *[1] * (a_bn.ndim - 2))
        return jnp.where(scored, a_bn, 0)
    return jnp.pad(a_bn, [(0, 0), (first, 0)] + [(0, 0)] * (a_bn.ndim - 2))
