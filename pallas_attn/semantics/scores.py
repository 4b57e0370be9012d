"""Score modifiers and visibility, written once on index arrays.

Every function takes query positions `rows` and key positions `cols` already
shaped to broadcast against each other (rows [..., Tq, 1], cols [..., 1, Tk]),
so the same code serves a [block_q, block_k] tile inside a Pallas kernel and the
full [B, N, T, S] matrix of the reference. Pure jnp: no Pallas imports here.

Semantics (README.md, "Semantics"):

    logits = scale * q.k + bias - slope * |i + off - j|     then cap * tanh(logits / cap)
    visible = mask & causal & window & same segment & inside both sequence lengths
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_attn.spec import AttentionSpec


def alibi_bias(slope: Any, rows: Any, cols: Any, offset: int) -> jax.Array:
    """The ALiBi term -slope * |i + offset - j| (float32); rows and cols may be
    integers or float32 holding integers (exact below 2**24)."""
    shifted = rows if isinstance(offset, int) and offset == 0 else rows + offset
    distance = jnp.abs(shifted - cols).astype(jnp.float32)
    return -slope * distance


def soft_cap_tanh(logits: jax.Array, cap: float,
                  tanh: Callable[[jax.Array], jax.Array] = jnp.tanh) -> jax.Array:
    """t = tanh(logits / cap): the soft-capped logit is cap * t."""
    return tanh(logits * (1.0 / cap))


def soft_cap(logits: jax.Array, cap: float) -> jax.Array:
    return cap * soft_cap_tanh(logits, cap)


def soft_cap_slope(t: jax.Array) -> jax.Array:
    """d(cap * tanh(x / cap)) / dx = 1 - t^2, from t = tanh(x / cap)."""
    return 1.0 - t * t


def soft_cap_derivative(capped: jax.Array, cap: float) -> jax.Array:
    """The same derivative expressed through the capped value cap * t."""
    return soft_cap_slope(capped * (1.0 / cap))


def add_logit_terms(
    logits: jax.Array, rows: Any, cols: Any, offset: int, *,
    bias: jax.Array | None = None, alibi_slope: Any = None,
) -> jax.Array:
    """Adds the bias and the ALiBi term to scaled logits (float32)."""
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if alibi_slope is not None:
        logits = logits + alibi_bias(alibi_slope, rows, cols, offset)
    return logits


def modify_logits(
    logits: jax.Array, rows: Any, cols: Any, spec: AttentionSpec, offset: int, *,
    bias: jax.Array | None = None, alibi_slope: Any = None, visible: Any = None,
) -> jax.Array:
    """Adds bias and ALiBi to scaled logits (float32), then applies the soft cap
    (the jnp paths; the kernels compose the same pieces in log2 units).

    visible (`visibility`, or None): the entries it hides enter the cap as 0, so the
    cap's derivative there, which their zero gradient meets, is finite whatever a
    hidden bias entry or key put in them (0 * NaN would reach dS and every gradient)."""
    logits = add_logit_terms(logits, rows, cols, offset, bias=bias, alibi_slope=alibi_slope)
    if spec.logits_soft_cap is not None:
        if visible is not None:
            logits = jnp.where(visible, logits, 0.0)
        logits = soft_cap(logits, spec.logits_soft_cap)
    return logits


def _and(a: jax.Array | None, b: jax.Array) -> jax.Array:
    return b if a is None else jnp.logical_and(a, b)


def visibility(
    rows: Any, cols: Any, spec: AttentionSpec, offset: int, *,
    q_bound: int | None = None, kv_bound: int | None = None,
    mask: jax.Array | None = None,
    q_segments: jax.Array | None = None, kv_segments: jax.Array | None = None,
    q_length: Any = None, kv_length: Any = None,
) -> jax.Array | None:
    """Boolean visibility of key j to query i, or None when everything is visible.

    q_bound / kv_bound: true sequence lengths when the caller padded the tiles.
    q_segments [..., Tq, 1] and kv_segments [..., 1, Tk]; q_length / kv_length
    broadcast against rows / cols.
    """
    visible = None
    if mask is not None:
        visible = mask
    if spec.is_causal:
        visible = _and(visible, cols <= rows + offset)
    if spec.local_window is not None:
        left, right = spec.local_window
        visible = _and(visible, (cols >= rows + offset - left) & (cols <= rows + offset + right))
    if q_segments is not None:
        visible = _and(visible, q_segments == kv_segments)
    if q_length is not None:
        visible = _and(visible, rows < q_length)
    if kv_length is not None:
        visible = _and(visible, cols < kv_length)
    if q_bound is not None:
        visible = _and(visible, rows < q_bound)
    if kv_bound is not None:
        visible = _and(visible, cols < kv_bound)
    return visible


def key_range(q_start: Any, q_stop: Any, spec: AttentionSpec, offset: int,
              kv_len: int) -> tuple[Any, Any]:
    """Keys [lo, hi) that queries [q_start, q_stop) can see through causal/window.

    Used by kernels to skip key tiles that are entirely masked (not just mask them).
    """
    lo, hi = 0, kv_len
    if spec.is_causal:
        hi = jnp.minimum(hi, q_stop + offset)  # last visible key is (q_stop - 1) + offset
    if spec.local_window is not None:
        left, right = spec.local_window
        lo = jnp.maximum(lo, q_start + offset - left)
        hi = jnp.minimum(hi, q_stop + offset + right)
    return lo, hi


def query_range(k_start: Any, k_stop: Any, spec: AttentionSpec, offset: int,
                q_len: int) -> tuple[Any, Any]:
    """Queries [lo, hi) that can see some key in [k_start, k_stop) (causal/window)."""
    lo, hi = 0, q_len
    if spec.is_causal:
        lo = jnp.maximum(lo, k_start - offset)  # query i sees key j iff i >= j - offset
    if spec.local_window is not None:
        left, right = spec.local_window
        lo = jnp.maximum(lo, k_start - offset - right)
        hi = jnp.minimum(hi, k_stop - offset + left)
    return lo, hi


def sink_gradient(sinks: jax.Array, lse: jax.Array, delta: jax.Array,
                  total: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """d sinks [N] = -sum over b, t of exp(sink - lse) * delta, from lse and delta
    [B, N, T] (delta = rowsum(dO * out) minus the lse cotangent; rows with lse = +inf,
    the kernels' padding, count 0); total: the sum over b and t of [B, N, T] terms
    (default jnp.sum)."""
    weight = jnp.exp(sinks[None, :, None] - lse)
    terms = jnp.where(lse == jnp.inf, 0.0, weight * delta)
    return -(jnp.sum(terms, axis=(0, 2)) if total is None else total(terms))
