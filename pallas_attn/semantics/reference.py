"""The reference implementation: pure jnp, every feature, float32 accumulation.

This is the single source of truth for the semantics (README.md, "Semantics").
It is `implementation="xla"`, the CPU fallback for short sequences, and the
oracle every kernel is tested against. It builds the full [B, N, T, S] logits,
so it is meant for modest sizes; `implementation="xla_chunked"` is the
memory-efficient CPU path.

Differentiable by ordinary jax autodiff, including the bias. A query row with no
visible key gives output 0, logsumexp -inf and zero gradients, never NaN.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_attn.semantics import dropout as dropout_lib
from pallas_attn.semantics import scores
from pallas_attn.spec import AttentionSpec, Operands


def hide_past(x: jax.Array, lengths: jax.Array | None, start: Any = 0) -> jax.Array:
    """x [B, L, ...] with the positions (start + index along axis 1) at or past each
    batch entry's length zeroed; x itself when lengths is None."""
    if lengths is None:
        return x
    positions = start + jnp.arange(x.shape[1], dtype=jnp.int32)
    keep = positions[None, :] < lengths[:, None]
    return jnp.where(keep.reshape(keep.shape + (1,) * (x.ndim - 2)), x, jnp.zeros_like(x))


def hide_past_lengths(ops: Operands) -> Operands:
    """Queries and keys/values past their lengths zeroed: hidden, they never meet a
    product (where 0 * NaN would poison the visible rows) and get zero gradients."""
    q0, k0 = (0, 0) if ops.origin is None else (ops.origin[0], ops.origin[1])
    return ops._replace(query=hide_past(ops.query, ops.query_seq_lengths, q0),
                        key=hide_past(ops.key, ops.key_value_seq_lengths, k0),
                        value=hide_past(ops.value, ops.key_value_seq_lengths, k0))


def logits_and_visibility(spec: AttentionSpec, ops: Operands) -> tuple[jax.Array, Any]:
    """Full float32 logits [B, N, T, S] (after bias, ALiBi, soft cap) and visibility."""
    q, k = ops.query, ops.key
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    group = N // K
    # NOTE: batched matmuls over (batch, kv head), each query head's rows stacked: XLA
    # runs these twice as fast on CPU as one five-index einsum (docs/decisions.md).
    qg = q.astype(jnp.float32).reshape(B, T, K, group, H).transpose(0, 2, 3, 1, 4)
    s = jnp.einsum("bkqh,bksh->bkqs", qg.reshape(B, K, group * T, H),
                   jnp.swapaxes(k.astype(jnp.float32), 1, 2),
                   precision=jax.lax.Precision.HIGHEST).reshape(B, N, T, S)
    s = s * spec.scale
    offset = spec.offset(T, S)
    q0, k0 = (0, 0) if ops.origin is None else (ops.origin[0], ops.origin[1])
    rows = q0 + jnp.arange(T, dtype=jnp.int32)[:, None]
    cols = k0 + jnp.arange(S, dtype=jnp.int32)[None, :]
    slope = None if ops.alibi_slopes is None else ops.alibi_slopes[:, :, None, None]
    logits = scores.modify_logits(s, rows, cols, spec, offset, bias=ops.bias, alibi_slope=slope)
    visible = scores.visibility(
        rows, cols, spec, offset,
        mask=ops.mask,
        q_segments=None if ops.q_segment_ids is None else ops.q_segment_ids[:, None, :, None],
        kv_segments=None if ops.kv_segment_ids is None else ops.kv_segment_ids[:, None, None, :],
        q_length=None if ops.query_seq_lengths is None
        else ops.query_seq_lengths[:, None, None, None],
        kv_length=None if ops.key_value_seq_lengths is None
        else ops.key_value_seq_lengths[:, None, None, None],
    )
    if visible is not None:
        visible = jnp.broadcast_to(visible, logits.shape)
    return logits, visible


def attention(spec: AttentionSpec, ops: Operands) -> tuple[jax.Array, jax.Array]:
    """Canonical-layout attention: (out [B, T, N, Hv] in query dtype, lse [B, N, T] float32)."""
    ops = hide_past_lengths(ops)
    logits, visible = logits_and_visibility(spec, ops)
    B, N, T, S = logits.shape
    # NOTE: the row maximum and the masked entries are handled so that neither the
    # value nor the gradient ever sees inf - inf: masked entries become exp(-inf) = 0
    # through a where on (logits - max), and a row with nothing visible uses max 0.
    hidden = (lambda x: x) if visible is None else (
        lambda x: jnp.where(visible, x, -jnp.inf))
    row_max = jnp.max(hidden(logits), axis=-1, keepdims=True)
    sink = None if ops.sinks is None else ops.sinks[None, :, None, None]
    if sink is not None:  # the sink is one more logit of every row, with no value
        row_max = jnp.maximum(row_max, sink)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    e = jnp.exp(hidden(logits - row_max))
    total = jnp.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink - row_max)
    # NOTE: a NaN row sum counts as seen: a NaN in a visible input shows in out and lse.
    seen = total != 0
    p = e / jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    if spec.has_dropout:
        origin = (0, 0) if ops.origin is None else (ops.origin[0], ops.origin[1])
        keep = dropout_lib.keep_mask(ops.dropout_keys, q_len=T, kv_len=S,
                                     rate=spec.dropout_rate, q_origin=origin[0],
                                     kv_origin=origin[1])
        p = jnp.where(keep, p * (1.0 / (1.0 - spec.dropout_rate)), 0.0)
    v = ops.value
    K, Hv = v.shape[2], v.shape[3]
    out = jnp.einsum("bkqs,bksh->bkqh", p.reshape(B, K, N // K * T, S),
                     jnp.swapaxes(v.astype(jnp.float32), 1, 2),
                     precision=jax.lax.Precision.HIGHEST)
    out = out.reshape(B, K, N // K, T, Hv).transpose(0, 3, 1, 2, 4)
    out = out.reshape(B, T, N, Hv).astype(ops.query.dtype)
    return out, lse[..., 0]


def empty(ops: Operands) -> tuple[jax.Array, jax.Array]:
    """The result when B, T or S is 0: no query row sees a key (out 0, lse -inf, or the
    head's sink)."""
    B, T, N, _ = ops.query.shape
    out = jnp.zeros((B, T, N, ops.value.shape[-1]), ops.query.dtype)
    if ops.sinks is not None:
        return out, jnp.broadcast_to(ops.sinks[None, :, None], (B, N, T))
    return out, jnp.full((B, N, T), -jnp.inf, jnp.float32)


def finish(out: jax.Array, lse: jax.Array, batched: bool, return_residual: bool):
    """Public layout: drop the batch axis added for [T, N, H] inputs; lse to [B, T, N]."""
    lse = jnp.swapaxes(lse, 1, 2)
    if not batched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_residual else out
