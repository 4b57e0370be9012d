"""The public entry points: validate once, plan (dispatch.py), run the plan.

`dot_product_attention` computes; `explain` returns the plan the same call would
run, for arrays or shapes (jax.ShapeDtypeStruct), on this or a described GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from pallas_attn import dispatch, sharding
from pallas_attn.device import DeviceInfo
from pallas_attn.plan import BlockSizes, Plan
from pallas_attn.semantics import reference
from pallas_attn.spec import (
    IMPLEMENTATIONS,
    AttentionSpec,
    Operands,
    check_bool,
    normalize,
)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    causal_alignment: str = "top_left",
    alibi_slopes: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    broadcast_dropout: bool = False,
    sinks: jax.Array | None = None,
    block_sizes: Any = None,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention, differentiable, with fused GPU kernels.

    Shapes use B batch, T query length, S key length, N query heads, K key/value
    heads (N a multiple of K), H head dim, Hv value head dim.

    Args:
      query: [B, T, N, H] or [T, N, H], floating.
      key: [B, S, K, H] or [S, K, H], same dtype as query.
      value: [B, S, K, Hv] or [S, K, Hv].
      bias: additive, broadcastable to [B, N, T, S] (each dim 1 or full); has a gradient.
      mask: boolean, broadcastable to [B, N, T, S]; True = attend.
      scale: multiplier of q.k; default 1 / sqrt(H).
      is_causal: key j visible to query i only if j <= i + offset (see causal_alignment).
      query_seq_lengths: int [B]; queries at i >= length see nothing (output 0).
      key_value_seq_lengths: int [B]; keys at j >= length are invisible.
      local_window_size: int w or (left, right): keys i + off - left <= j <= i + off + right.
      implementation: None (Pallas kernels on an NVIDIA GPU; elsewhere the reference, or
        the blockwise path once T * S >= 2**20 with causal masking or a window, 2**23
        without), "pallas", "xla" (the reference), or "xla_chunked" (blockwise jnp, O(T)
        memory).
      return_residual: also return the logsumexp, shaped [B, T, N] (float32).
      causal_alignment: "top_left" (offset 0, jax.nn's convention) or "bottom_right"
        (offset S - T, FlashAttention's convention); applies to causal, window, ALiBi.
      alibi_slopes: [N] or [B, N]; adds -slope * |i + off - j| to the logits.
      logits_soft_cap: c > 0; logits become c * tanh(logits / c) (after bias and ALiBi).
      q_segment_ids: int [B, T]; queries see only keys of the same segment.
      kv_segment_ids: int [B, S]; defaults to q_segment_ids when T == S.
      dropout_rate: probability of dropping an attention weight, in [0, 1).
      dropout_rng: jax PRNG key; required when dropout_rate > 0.
      broadcast_dropout: share one dropout mask across batch and heads (Flax's option).
      sinks: [N] float, one learnable logit per query head added to every row's softmax
        with no value (attention sinks); differentiable. A row that sees no key then
        gives output 0 and logsumexp sinks[n].
      block_sizes: a pallas_attn.BlockSizes overriding the tiles the kernels choose.
      interpret: run the Pallas kernels in the Pallas interpreter (CPU testing).

    Returns:
      out [B, T, N, Hv] (or [T, N, Hv]) in query's dtype, and with return_residual
      the logsumexp [B, T, N] (or [T, N]). A query row with no visible key gives
      output 0 and logsumexp -inf (jax.nn returns the mean of value there).
    """
    return_residual = check_bool("return_residual", return_residual)
    _check_options(implementation, block_sizes, interpret, None)
    sharding.check_interpretable(interpret)
    arrays = dict(query=query, key=key, value=value, bias=bias, mask=mask,
                  query_seq_lengths=query_seq_lengths,
                  key_value_seq_lengths=key_value_seq_lengths, alibi_slopes=alibi_slopes,
                  q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                  dropout_rng=dropout_rng, sinks=sinks)
    if (mesh := sharding.explicit_mesh(arrays)) is not None:
        static = dict(scale=scale, is_causal=is_causal, local_window_size=local_window_size,
                      implementation=implementation, return_residual=return_residual,
                      causal_alignment=causal_alignment, logits_soft_cap=logits_soft_cap,
                      dropout_rate=dropout_rate, broadcast_dropout=broadcast_dropout,
                      block_sizes=block_sizes, interpret=interpret)
        return sharding.in_auto_axes(
            mesh, lambda arrays: dot_product_attention(**arrays, **static), query, arrays,
            return_residual)
    spec, ops, batched = normalize(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, causal_alignment=causal_alignment,
        alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout,
        sinks=sinks)
    if 0 in (*ops.query.shape[:2], ops.key.shape[1]):  # every implementation alike
        return reference.finish(*reference.empty(ops), batched, return_residual)
    plan = _plan(spec, ops, implementation, block_sizes, interpret, None)
    if plan.implementation == "xla":
        out, lse = reference.attention(spec, ops)
    elif plan.implementation == "xla_chunked":
        from pallas_attn.semantics import chunked

        out, lse = _reverse_mode_only(plan, lambda: chunked.attention(spec, ops))
    else:
        from pallas_attn.kernels import vjp

        out, lse = _reverse_mode_only(plan, lambda: vjp.attention(spec, ops, plan))
    return reference.finish(out, lse, batched, return_residual)


def _reverse_mode_only(plan: Plan, run: Callable[[], Any]) -> Any:
    """run(), with JAX's refusal of forward mode for a custom_vjp (jax.jvp, jax.jacfwd)
    replaced by one that names the implementation and the alternatives."""
    try:
        return run()
    except TypeError as e:
        if "forward-mode autodiff" not in str(e):
            raise
        chosen = f" (chosen automatically: {plan.why})" if plan.why else ""
        raise TypeError(
            f"implementation={plan.implementation!r}{chosen} has no forward-mode derivative "
            f"(jax.jvp, jax.jacfwd): differentiate it in reverse mode (jax.grad, jax.vjp, "
            f"jax.jacrev, jax.linearize), or pass implementation='xla', the reference, "
            f"which has both") from e


def _check_options(implementation: Any, block_sizes: Any, interpret: Any, device: Any) -> None:
    check_bool("interpret", interpret)
    if implementation == "cudnn":
        raise ValueError("implementation='cudnn' names jax.nn's cuDNN path; pallas_attn's GPU "
                         "kernels are implementation='pallas' (and None, the default, picks "
                         "them on an NVIDIA GPU)")
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a pallas_attn.BlockSizes, got "
                        f"{type(block_sizes).__name__}")
    if device is not None and not isinstance(device, DeviceInfo):
        raise TypeError(f"device must be a pallas_attn.DeviceInfo, got "
                        f"{type(device).__name__}")


def _plan(spec: AttentionSpec, ops: Operands, implementation: str | None,
          block_sizes: BlockSizes | None, interpret: bool, device: DeviceInfo | None) -> Plan:
    """The plan of a normalized call (options checked by _check_options)."""
    call = dispatch.Call.of(spec, ops)
    implementation, why = dispatch.choose_implementation(implementation, call, bool(interpret),
                                                         device)
    return dispatch.plan(call, implementation=implementation, device=device,
                         block_sizes=block_sizes, interpret=bool(interpret), why=why)


def explain(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    implementation: str | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    device: DeviceInfo | None = None,
    **kwargs: Any,
) -> Plan:
    """The plan `dot_product_attention` runs for these arguments, without running it.

    Takes the same arguments (arrays, or jax.ShapeDtypeStruct for any array
    argument) and device: a pallas_attn.DeviceInfo to plan for a GPU you are not on
    (implementation then defaults to "pallas"). `print(explain(...))` shows one line
    per role (forward, dQ, dK/dV, and dbias with a bias) naming its backend (mosaic,
    triton or xla) and tiles, each followed by the faster backends not taken and why.
    """
    _check_options(implementation, block_sizes, interpret, device)
    if "return_residual" in kwargs:  # the same kernels either way
        check_bool("return_residual", kwargs.pop("return_residual"))
    arrays = {"query": query, "key": key, "value": value, "bias": bias, "mask": mask}
    arrays.update({name: x for name, x in kwargs.items()
                   if name not in _STATIC and _is_array_like(x)})
    static = {name: x for name, x in kwargs.items() if name not in arrays}
    normalized = {}

    def trace(arrays):
        spec, ops, _ = normalize(**arrays, **static)
        normalized["spec"] = spec
        return ops

    ops = jax.eval_shape(trace, arrays)
    return _plan(normalized["spec"], ops, implementation, block_sizes, interpret, device)


# Keyword arguments that shape the kernels (never traced, even when given as arrays).
_STATIC = ("scale", "is_causal", "local_window_size", "causal_alignment", "logits_soft_cap",
           "dropout_rate", "broadcast_dropout")


def _is_array_like(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct) or (
        hasattr(x, "shape") and hasattr(x, "dtype"))
