"""The reference implementation: pure jnp, every feature, float32 accumulation.

This is the single source of truth for the semantics (README.md, "Semantics").
It is `implementation="xla"`, the CPU fallback for short sequences, and the
oracle every kernel is tested against. It builds the full [B, N, T, S] logits,
so it is meant for modest sizes; `implementation="xla_chunked"` is the
memory-efficient CPU path.

Differentiable by ordinary jax autodiff, including the bias. A query row with no
visible key gives output 0, logsumexp -inf and zero gradients, never NaN. Keys hidden
from a row never change its results, NaN or inf among them included; a non-finite
visible key makes the row NaN.
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


def hide_rows_past(x: jax.Array, ops: Operands) -> jax.Array:
    """x [B, T, ...] (an output or its cotangent) zeroed at the rows past the query
    lengths: those rows see no key, so their output is 0 whatever the inputs, and what
    their cotangents hold (NaN included) reaches no gradient."""
    return hide_past(x, ops.query_seq_lengths, 0 if ops.origin is None else ops.origin[0])


def _by_group(x: jax.Array | None, num_kv_heads: int) -> jax.Array | None:
    """An operand [X, N or 1, ...] in the logits' layout: its query-head axis split into
    (query head of the group, kv head) with the group first, [N / K, X, K, ...], or
    [1, X, 1, ...] for one shared by the heads."""
    if x is None:
        return None
    heads = x.shape[1]
    if heads == 1:
        return x[None]
    split = x.reshape(x.shape[0], num_kv_heads, heads // num_kv_heads, *x.shape[2:])
    return jnp.moveaxis(split, 2, 0)


def nonfinite_poison(key: jax.Array, value: jax.Array) -> jax.Array:
    """[B, S, K, 1] float: NaN where key j of kv head k (its key or value row) holds a
    non-finite entry, else 0."""
    # NOTE: x * 0 is NaN exactly where x is not finite: one float reduction, which
    # XLA:CPU runs faster than isfinite's boolean ones.
    if key.shape[-1] == value.shape[-1]:
        poison = jnp.sum(key * 0 + value * 0, axis=-1, keepdims=True)
    else:
        poison = (jnp.sum(key * 0, axis=-1, keepdims=True)
                  + jnp.sum(value * 0, axis=-1, keepdims=True))
    return jax.lax.stop_gradient(poison.astype(jnp.float32))


def nonfinite_keys(key: jax.Array, value: jax.Array) -> tuple[jax.Array, jax.Array,
                                                               jax.Array]:
    """(key, value, poison): key and value with their non-finite entries zeroed, and
    poison [B, K, S] float32, NaN for the keys that held one (`nonfinite_poison`).

    A key hidden from a row (masked, another segment, causally future) then meets that
    row's products as zeros, where 0 * NaN would poison the row and its gradients; a
    visible one gives the row a NaN score instead (`with_nonfinite_keys`), so the row's
    output, logsumexp and gradients show it."""
    poison = jnp.swapaxes(nonfinite_poison(key, value)[..., 0], 1, 2)

    def zeroed(pair):
        return tuple(jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x)) for x in pair)

    # NOTE: on a CPU finite inputs skip the zeroed copies, which cost a causal T = 256 call
    # about 6% (docs/decisions.md, "Zeroed non-finite keys only where one is"); a GPU
    # would wait on the host for the cond's predicate, so it always zeroes.
    if jax.default_backend() != "cpu":
        return (*zeroed((key, value)), poison)
    key, value = jax.lax.cond(jnp.isnan(jnp.sum(poison)), zeroed, lambda pair: pair,
                              (key, value))
    return key, value, poison


def with_nonfinite_keys(logits: jax.Array, poison: jax.Array) -> jax.Array:
    """Logits with NaN in the columns of the keys `nonfinite_keys` found non-finite
    (poison, its [B, K, S] given axes that broadcast against the logits)."""
    # NOTE: added, not selected: a select here cost XLA:CPU's backward (docs/decisions.md).
    return logits + poison


def nan_nonfinite_keys(key: jax.Array, value: jax.Array) -> jax.Array:
    """key with every key row whose key or value held a non-finite entry made NaN: where
    no row hides a key, each of them gives every row a NaN score through the product
    itself, with no pass over the logits and no select on key or value."""
    return key + nonfinite_poison(key, value).astype(key.dtype)


def logits_and_visibility(spec: AttentionSpec, ops: Operands, poison: jax.Array | None
                          ) -> tuple[jax.Array, Any]:
    """Full float32 logits [G, B, K, T, S] (after bias, ALiBi, soft cap; query head
    n = k * G + g; NaN in the columns of the non-finite keys, poison [B, K, S]
    from `nonfinite_keys`, if given) and visibility (broadcasting against them), or None."""
    q, k = ops.query, ops.key
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    group = N // K
    # NOTE: one product per query head of a kv group, vmapped over the group, with the
    # scores kept as [G, B, K, T, S] until the output, as jax.nn does: XLA:CPU lays these
    # out faster than a five-index einsum, a [B, N, T, S] layout or the group inside
    # (docs/decisions.md, "The reference's products vmapped over the group").
    qg = q.astype(jnp.float32).reshape(B, T, K, group, H)
    s = jax.vmap(lambda x: jnp.einsum("btkh,bskh->bkts", x, k.astype(jnp.float32),
                                      precision=jax.lax.Precision.HIGHEST),
                 in_axes=3)(qg)
    s = s * spec.scale
    if poison is not None:
        s = with_nonfinite_keys(s, poison[None, :, :, None, :])
    offset = spec.offset(T, S)
    q0, k0 = (0, 0) if ops.origin is None else (ops.origin[0], ops.origin[1])
    rows = q0 + jnp.arange(T, dtype=jnp.int32)[:, None]
    cols = k0 + jnp.arange(S, dtype=jnp.int32)[None, :]
    slope = _by_group(ops.alibi_slopes, K)
    per_entry = (None, slice(None), None, None, None)  # [B] -> [1, B, 1, 1, 1]
    visible = scores.visibility(
        rows, cols, spec, offset,
        mask=_by_group(ops.mask, K),
        q_segments=None if ops.q_segment_ids is None
        else ops.q_segment_ids[None, :, None, :, None],
        kv_segments=None if ops.kv_segment_ids is None
        else ops.kv_segment_ids[None, :, None, None, :],
        q_length=None if ops.query_seq_lengths is None else ops.query_seq_lengths[per_entry],
        kv_length=None if ops.key_value_seq_lengths is None
        else ops.key_value_seq_lengths[per_entry],
    )
    logits = scores.modify_logits(s, rows, cols, spec, offset, bias=_by_group(ops.bias, K),
                                  alibi_slope=None if slope is None else slope[..., None, None],
                                  visible=visible)
    return logits, visible


@jax.custom_jvp
def _materialized(x: jax.Array) -> jax.Array:
    """x, computed once before its uses (an optimization barrier on the value only: the
    tangents, and so the backward's fusions, pass through unchanged)."""
    return jax.lax.optimization_barrier(x)


@_materialized.defjvp
def _materialized_jvp(primals, tangents):
    return _materialized(primals[0]), tangents[0]


def attention(spec: AttentionSpec, ops: Operands) -> tuple[jax.Array, jax.Array]:
    """Canonical-layout attention: (out [B, T, N, Hv] in query dtype, lse [B, N, T] float32)."""
    ops = hide_past_lengths(ops)
    if spec.hides_keys or spec.has_q_lengths or spec.has_kv_lengths:
        key, value, poison = nonfinite_keys(ops.key, ops.value)
        ops = ops._replace(key=key, value=value)
    else:  # every row sees every key
        ops, poison = ops._replace(key=nan_nonfinite_keys(ops.key, ops.value)), None
    logits, visible = logits_and_visibility(spec, ops, poison)
    G, B, K, T, S = logits.shape
    # NOTE: neither the value nor the gradient ever sees inf - inf: hidden entries are
    # -inf less a finite row maximum (a row with nothing visible uses the lowest float),
    # exp(-inf) = 0. Arithmetic, not selects, on the row vectors: XLA:CPU's backward ran
    # up to 1.6x slower with selects there (docs/decisions.md, "The reference's products").
    if visible is not None:
        logits = jnp.where(visible, logits, -jnp.inf)
    # NOTE: XLA:CPU may otherwise fuse the logits' arithmetic (the scale's product, a
    # bias added to it) into exp(logits - max) as multiply-adds rounded apart from the
    # max's logits: above 0 by ulps of the logits, exp overflows from |logits| near 1e9.
    logits = _materialized(logits)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    sink = None if ops.sinks is None else _by_group(ops.sinks[None], K)[..., None, None]
    if sink is not None:  # the sink is one more logit of every row, with no value
        row_max = jnp.maximum(row_max, sink)
    row_max = jax.lax.stop_gradient(jnp.maximum(row_max, jnp.finfo(jnp.float32).min))
    e = jnp.exp(logits - row_max)
    total = jnp.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink - row_max)
    # NOTE: a NaN row sum counts as seen: a NaN in a visible input shows in out and lse.
    # A row that sees nothing divides by 1.
    seen = total != 0
    total = total + jnp.logical_not(seen).astype(total.dtype)
    p = e / total
    lse = jnp.where(seen, row_max + jnp.log(total), -jnp.inf)
    if spec.has_dropout:
        origin = (0, 0) if ops.origin is None else (ops.origin[0], ops.origin[1])
        keep = dropout_lib.keep_mask(ops.dropout_keys, q_len=T, kv_len=S,
                                     rate=spec.dropout_rate, q_origin=origin[0],
                                     kv_origin=origin[1])
        p = jnp.where(_by_group(keep, K), p * (1.0 / (1.0 - spec.dropout_rate)), 0.0)
    v = ops.value
    Hv = v.shape[3]
    out = jax.vmap(lambda x: jnp.einsum("bkts,bskh->btkh", x, v.astype(jnp.float32),
                                        precision=jax.lax.Precision.HIGHEST),
                   out_axes=3)(p)
    out = hide_rows_past(out.reshape(B, T, K * G, Hv).astype(ops.query.dtype), ops)
    return out, jnp.moveaxis(lse[..., 0], 0, 2).reshape(B, K * G, T)


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
