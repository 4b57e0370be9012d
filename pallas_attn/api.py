"""The public entry point: validate once, pick an implementation, run it."""

from __future__ import annotations

from typing import Any

import jax

from pallas_attn import reference
from pallas_attn.spec import IMPLEMENTATIONS, MAX_KERNEL_HEAD_DIM, check_bool, normalize


def default_implementation(interpret: bool = False) -> str:
    """The Pallas kernels on an NVIDIA GPU (or in the interpreter), the reference elsewhere."""
    if interpret:
        return "pallas"
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return "xla"
    if device.platform == "gpu" and "nvidia" in device.device_kind.lower():
        return "pallas"
    return "xla"


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
        the blockwise path once T * S >= 2**22), "pallas", "xla" (the reference), or
        "xla_chunked" (blockwise jnp, O(T) memory).
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
      block_sizes: a pallas_attn.BlockSizes overriding the tiles the kernels choose.
      interpret: run the Pallas kernels in the Pallas interpreter (CPU testing).

    Returns:
      out [B, T, N, Hv] (or [T, N, Hv]) in query's dtype, and with return_residual
      the logsumexp [B, T, N] (or [T, N]). A query row with no visible key gives
      output 0 and logsumexp -inf (jax.nn returns the mean of value there).
    """
    return_residual = check_bool("return_residual", return_residual)
    interpret = check_bool("interpret", interpret)
    automatic = implementation is None
    if automatic:
        implementation = default_implementation(interpret)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    spec, ops, batched = normalize(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, causal_alignment=causal_alignment,
        alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout)
    if automatic and implementation == "xla":
        from pallas_attn import chunked

        if chunked.prefer_chunked(ops.query.shape[1], ops.key.shape[1]):
            implementation = "xla_chunked"  # the reference would build T x S matrices
    if implementation != "pallas" and (block_sizes is not None or interpret):
        raise ValueError(
            f"block_sizes and interpret apply to implementation='pallas', got {implementation!r}")

    if implementation == "xla":
        out, lse = reference.attention(spec, ops)
    elif implementation == "xla_chunked":
        from pallas_attn import chunked

        out, lse = chunked.attention(spec, ops)
    else:
        head_dims = (ops.query.shape[-1], ops.value.shape[-1])
        if max(head_dims) > MAX_KERNEL_HEAD_DIM:
            raise ValueError(
                f"the Pallas kernels support head dims up to {MAX_KERNEL_HEAD_DIM}, got "
                f"query/key {head_dims[0]} and value {head_dims[1]}; use implementation='xla'")
        from pallas_attn.kernels import attention as kernel_attention
        from pallas_attn.tuning import BlockSizes, check_fuse_dbias

        if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
            raise TypeError(f"block_sizes must be a pallas_attn.BlockSizes, got "
                            f"{type(block_sizes).__name__}")
        if block_sizes is not None:
            check_fuse_dbias(block_sizes, spec.bias_shape, batch=ops.query.shape[0],
                             num_heads=ops.query.shape[2],
                             bias_dtype=None if ops.bias is None else ops.bias.dtype,
                             dtype=ops.query.dtype)
        out, lse = kernel_attention.attention(spec, ops, block_sizes=block_sizes,
                                              interpret=interpret)
    return reference.finish(out, lse, batched, return_residual)
