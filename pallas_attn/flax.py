"""Flax integration: a drop-in ``attention_fn`` and a small fused nnx attention layer.

``attention_fn`` has the signature of ``flax.nnx.dot_product_attention`` (and takes
every keyword ``flax.linen.MultiHeadDotProductAttention`` passes), so it plugs into
both module families::

    import pallas_attn.flax

    layer = nnx.MultiHeadAttention(num_heads=8, in_features=512,
                                   attention_fn=pallas_attn.flax.attention_fn,
                                   decode=False, rngs=nnx.Rngs(0))
    layer = nn.MultiHeadDotProductAttention(num_heads=8,
                                            attention_fn=pallas_attn.flax.attention_fn)

It runs ``pallas_attn.dot_product_attention``: the Pallas kernels on an NVIDIA GPU,
the jnp reference elsewhere. Keywords the Flax modules pass and how they map:

=========================  ==================================================================
Flax keyword               pallas_attn
=========================  ==================================================================
``bias``                   ``bias`` (additive, differentiable)
``mask``                   ``mask``; float masks from ``make_causal_mask`` /
                           ``make_attention_mask`` become boolean (nonzero = attend)
``is_causal``              ``is_causal`` with ``causal_alignment="top_left"`` (Flax's tril)
``dropout_rate``,          dropout only when ``not deterministic and dropout_rate > 0``;
``deterministic``,         ``dropout_rng`` seeds pallas_attn's counter-based dropout and
``dropout_rng``,           ``broadcast_dropout=True`` shares one mask across batch and heads.
``broadcast_dropout``      Same distribution as Flax, different random stream.
``dtype``,                 ``promote_dtype((query, key, value), dtype=dtype)``, as Flax does
``promote_dtype``
``precision``              accepted; the kernels accumulate in float32 and multiply float32
                           inputs in full float32 (never TF32), bf16/f16 inputs natively.
``force_fp32_for_softmax`` (linen) honoured: the softmax is always computed in float32
``module``                 ``None``: fused. A module (``sow_weights=True``): falls back, below
``qk_attn_weights_einsum``, (linen, AQT) ``None``: fused; otherwise falls back, below
``attn_weights_value_einsum``,
``einsum_dot_general``
``input_positions``,       (nnx) RoPE as in ``nnx.dot_product_attention_with_rope``: pass
``rope``                   ``rope=`` with ``functools.partial``
=========================  ==================================================================

Fallbacks: when Flax asks for something the fused op cannot give -- the attention
weights themselves (``module`` given, i.e. ``sow_weights=True``) or custom einsums --
``attention_fn`` calls Flax's own ``flax.nnx.dot_product_attention`` (nnx modules) or
``flax.linen.dot_product_attention`` (linen modules, custom einsums) and warns once per
reason with a :class:`FlaxFallbackWarning`. A head dim above the kernels' limit (only
when the kernels were chosen automatically) falls back to pallas_attn's jnp reference,
also with a one-time warning. Nothing is silently ignored.

One deliberate difference from Flax: a query row that sees no key at all (e.g. a padded
query row under ``make_attention_mask``) gives output 0 here, where Flax returns the
mean of ``value``. Rows with at least one visible key agree.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

try:
    from flax import linen, nnx
    from flax.nnx.nn import dtypes as nnx_dtypes
    from flax.nnx.nn.linear import default_kernel_init
except ModuleNotFoundError as e:  # flax is an optional dependency
    raise ImportError(f"pallas_attn.flax needs flax ({e}): pip install flax, or "
                      f"'pallas_attn[flax]'") from e

from pallas_attn.api import dot_product_attention
from pallas_attn.device import on_nvidia_gpu
from pallas_attn.spec import MAX_KERNEL_HEAD_DIM, check_bool, static_float, static_int

__all__ = [
    "FlaxFallbackWarning",
    "MultiHeadAttention",
    "attention_fn",
    "reset_fallback_warnings",
]

Array = jax.Array
_zeros_init = nnx.initializers.zeros_init()

# pallas_attn-only keywords attention_fn forwards to pallas_attn.dot_product_attention
# (bind them with functools.partial). Flax's own attention has no equivalent for these.
_SEMANTIC_EXTRAS = frozenset({
    "scale", "causal_alignment", "local_window_size", "logits_soft_cap", "alibi_slopes",
    "query_seq_lengths", "key_value_seq_lengths", "q_segment_ids", "kv_segment_ids",
})
_LENGTH_EXTRAS = ("query_seq_lengths", "key_value_seq_lengths")
_SEGMENT_EXTRAS = ("q_segment_ids", "kv_segment_ids")


class FlaxFallbackWarning(UserWarning):
    """attention_fn used a non-fused attention for something the fused op cannot give."""


_warned: set[str] = set()


def reset_fallback_warnings() -> None:
    """Forgets which fallback reasons were already warned about (each warns once)."""
    _warned.clear()


def _warn_once(reason: str, message: str) -> None:
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(message, FlaxFallbackWarning, stacklevel=3)


def _as_bool_mask(mask: Array | None) -> Array | None:
    """Flax masks are often float (make_causal_mask); nonzero means attend, as in Flax."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    return mask if mask.dtype == jnp.bool_ else mask != 0


def _apply_rope(rope: Any, query: Array, key: Array,
                input_positions: Array | None) -> tuple[Array, Array]:
    """RoPE on [batch..., T, heads, D] query and key, per head.

    Without positions this is exactly nnx.dot_product_attention_with_rope. Positions
    may be [T] or [batch..., T] (leading dims equal to the inputs' batch dims); each
    batch entry's positions are rotated separately (flax 0.12's own function maps
    positions over the head axis instead and fails for these shapes).
    """
    per_head = jax.vmap(rope, in_axes=-2, out_axes=-2)
    if input_positions is None:
        return per_head(query), per_head(key)
    positions = jnp.asarray(input_positions)
    apply = jax.vmap(rope, in_axes=(-2, None), out_axes=-2)
    for _ in range(positions.ndim - 1):
        apply = jax.vmap(apply)
    return apply(query, positions), apply(key, positions)


def _flatten_batch(x: Array | None, batch_shape: tuple[int, ...], trailing: int) -> Array | None:
    """[batch..., *rest] (leading dims 1 or full, possibly missing) -> [prod(batch) or 1, *rest]."""
    if x is None:
        return None
    x = jnp.asarray(x)
    nb = len(batch_shape)
    full_rank = nb + trailing
    if x.ndim > full_rank:
        raise ValueError(f"array of shape {x.shape} has more dims than [batch..., *{trailing}]")
    x = x.reshape((1,) * (full_rank - x.ndim) + x.shape)
    lead, rest = x.shape[:nb], x.shape[nb:]
    if all(d == 1 for d in lead):
        return x.reshape((1, *rest))
    return jnp.broadcast_to(x, batch_shape + rest).reshape((math.prod(batch_shape), *rest))


def _repeat_kv_heads(query: Array, key: Array, value: Array) -> tuple[Array, Array]:
    group = query.shape[-2] // key.shape[-2]
    if group == 1:
        return key, value
    return jnp.repeat(key, group, axis=-2), jnp.repeat(value, group, axis=-2)


def _flax_attention(
    which: str, query: Array, key: Array, value: Array, bias: Array | None,
    mask: Array | None, *, broadcast_dropout: bool, dropout_rng: Array | None,
    dropout_rate: float, deterministic: bool, dtype: Any, precision: Any, module: Any,
    promote_dtype: Callable[..., Any], is_causal: bool, force_fp32_for_softmax: bool,
    einsum_dot_general: Any, qk_attn_weights_einsum: Any, attn_weights_value_einsum: Any,
) -> Array:
    """Flax's own attention (which = "nnx" or "linen") with every option Flax was given."""
    if which == "linen":
        # linen's function has neither is_causal nor GQA: fold them into mask and heads.
        if is_causal:
            T, S = query.shape[-3], key.shape[-3]
            causal = jnp.tril(jnp.ones((T, S), jnp.bool_))
            mask = causal if mask is None else jnp.logical_and(_as_bool_mask(mask), causal)
        key, value = _repeat_kv_heads(query, key, value)
        return linen.dot_product_attention(
            query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
            deterministic, dtype, precision, module, force_fp32_for_softmax,
            einsum_dot_general=einsum_dot_general,
            qk_attn_weights_einsum=qk_attn_weights_einsum,
            attn_weights_value_einsum=attn_weights_value_einsum)
    out_dtype = query.dtype
    if force_fp32_for_softmax and out_dtype != jnp.float32:
        # nnx's function has no such option: run it in float32, as linen's softmax would.
        query, key, value = (x.astype(jnp.float32) for x in (query, key, value))
        dtype = None
    out = nnx.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
        deterministic, dtype, precision, module, promote_dtype, is_causal)
    return out.astype(out_dtype)


def _fused_attention(
    query: Array, key: Array, value: Array, bias: Array | None, mask: Array | None, *,
    is_causal: bool, dropout_rate: float, dropout_rng: Array | None, broadcast_dropout: bool,
    implementation: str | None, interpret: bool, block_sizes: Any, extras: dict[str, Any],
) -> Array:
    """pallas_attn.dot_product_attention on Flax layouts ([batch..., len, heads, dim])."""
    mask = _as_bool_mask(mask)
    batch_shape = query.shape[:-3]
    flat = len(batch_shape) > 1
    if flat:  # several batch dims: fold them into one (pallas_attn takes [B, T, N, H])
        B = math.prod(batch_shape)
        query, key, value = (x.reshape((B, *x.shape[-3:])) for x in (query, key, value))
        bias = _flatten_batch(bias, batch_shape, 3)
        mask = _flatten_batch(mask, batch_shape, 3)
        extras = dict(extras)
        for name in _LENGTH_EXTRAS:
            if extras.get(name) is not None:
                extras[name] = jnp.broadcast_to(extras[name], batch_shape).reshape(B)
        for name in _SEGMENT_EXTRAS:
            if extras.get(name) is not None:
                ids = jnp.asarray(extras[name])
                extras[name] = jnp.broadcast_to(ids, batch_shape + ids.shape[-1:]).reshape(B, -1)
        if extras.get("alibi_slopes") is not None and jnp.ndim(extras["alibi_slopes"]) > 1:
            slopes = jnp.asarray(extras["alibi_slopes"])
            extras["alibi_slopes"] = jnp.broadcast_to(
                slopes, batch_shape + slopes.shape[-1:]).reshape(B, -1)
    out = dot_product_attention(
        query, key, value, bias, mask, is_causal=is_causal,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        broadcast_dropout=bool(broadcast_dropout), implementation=implementation,
        interpret=interpret, block_sizes=block_sizes, **extras)
    if flat:
        out = out.reshape((*batch_shape, *out.shape[-3:]))
    return out


def attention_fn(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    promote_dtype: Callable[..., Any] = nnx_dtypes.promote_dtype,
    is_causal: bool = False,
    *,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., Array] | None = None,
    qk_attn_weights_einsum: Callable[..., Array] | None = None,
    attn_weights_value_einsum: Callable[..., Array] | None = None,
    rope: Any = None,
    input_positions: Array | None = None,
    implementation: str | None = None,
    interpret: bool = False,
    block_sizes: Any = None,
    **kwargs: Any,
) -> Array:
    """Fused dot-product attention with the signature of ``flax.nnx.dot_product_attention``.

    Pass it as ``attention_fn=`` to ``flax.nnx.MultiHeadAttention`` or
    ``flax.linen.MultiHeadDotProductAttention``. Shapes use ``batch...`` for zero or
    more batch dims, T query length, S key length, N query heads, K key/value heads
    (N a multiple of K: grouped-query attention), H head dim, Hv value head dim.

    Args:
      query: [batch..., T, N, H].
      key: [batch..., S, K, H].
      value: [batch..., S, K, Hv].
      bias: additive, broadcastable to [batch..., N, T, S]; differentiable.
      mask: broadcastable to [batch..., N, T, S] (e.g. from ``make_causal_mask`` or
        ``make_attention_mask``, [batch, 1, T, S]); nonzero / True = attend.
      broadcast_dropout: one dropout mask shared by every batch entry and head.
      dropout_rng: PRNG key for dropout; required when dropout is active.
      dropout_rate: probability of dropping an attention weight, in [0, 1).
      deterministic: no dropout when True.
      dtype: computation dtype; query, key and value are cast by ``promote_dtype``.
      precision: accepted for compatibility. The fused op always accumulates in
        float32 and multiplies float32 inputs in full float32 precision.
      module: the module that wants the attention weights sowed (``sow_weights=True``).
        The fused op never forms the weights, so a module triggers the Flax fallback.
      promote_dtype: nnx-style ``promote_dtype((q, k, v), dtype=dtype)``.
      is_causal: key j is visible to query i only if j <= i (Flax's top-left tril).
      force_fp32_for_softmax: (linen) always true of the fused op; passed on in fallbacks.
      einsum_dot_general: (linen) custom dot_general; forces the linen fallback.
      qk_attn_weights_einsum: (linen, AQT) custom einsum; forces the linen fallback.
      attn_weights_value_einsum: (linen, AQT) custom einsum; forces the linen fallback.
      rope: an ``nnx.RoPE`` applied to query and key first (like
        ``nnx.dot_product_attention_with_rope``).
      input_positions: [batch..., T] positions for ``rope`` (nnx passes it when given).
      implementation: ``pallas_attn.dot_product_attention``'s implementation (None:
        the kernels on an NVIDIA GPU, the jnp reference elsewhere).
      interpret: run the Pallas kernels in the interpreter (CPU tests).
      block_sizes: a ``pallas_attn.BlockSizes`` for the kernels.
      **kwargs: pallas_attn-only options forwarded to ``dot_product_attention``:
        scale, causal_alignment, local_window_size, logits_soft_cap, alibi_slopes,
        query_seq_lengths, key_value_seq_lengths, q_segment_ids, kv_segment_ids.

    Returns:
      [batch..., T, N, Hv] in the promoted dtype. A query row with no visible key
      gives 0 (Flax gives the mean of value there).

    Raises:
      ValueError: dropout active without ``dropout_rng``; a bad rate; pallas_attn-only
        options combined with a Flax fallback that could not honour them.
      TypeError: an unknown keyword.
    """
    unknown = sorted(set(kwargs) - _SEMANTIC_EXTRAS)
    if unknown:
        raise TypeError(
            f"attention_fn got unexpected keyword argument(s) {unknown}; pallas_attn-only "
            f"options are {sorted(_SEMANTIC_EXTRAS)}")
    extras = {k: v for k, v in kwargs.items() if v is not None}
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in the range [0, 1), got {dropout_rate!r}.")
    use_dropout = not deterministic and dropout_rate > 0.0
    if use_dropout and dropout_rng is None:
        raise ValueError("dropout_rng is required when dropout_rate > 0 and deterministic=False.")
    if rope is not None:
        query, key = _apply_rope(rope, query, key, input_positions)
    elif input_positions is not None:
        raise TypeError("attention_fn got input_positions without rope; bind an nnx.RoPE with "
                        "functools.partial(pallas_attn.flax.attention_fn, rope=rope)")
    query, key, value = promote_dtype((query, key, value), dtype=dtype)

    # Where the fused op cannot give what Flax asks for, use Flax's own attention.
    linen_only = (einsum_dot_general is not None or qk_attn_weights_einsum is not None
                  or attn_weights_value_einsum is not None)
    reasons = []
    if module is not None:
        reasons.append((
            "sow", "the attention weights were asked for (module= / sow_weights=True), and the "
                   "fused op never forms them"))
    if linen_only:
        reasons.append((
            "einsum", "custom einsums (einsum_dot_general / qk_attn_weights_einsum / "
                      "attn_weights_value_einsum) were given"))
    if reasons:
        if isinstance(module, nnx.Module) and linen_only:
            raise ValueError("custom linen einsums cannot be combined with sowing into an nnx "
                             "module; flax.nnx.dot_product_attention has no einsum options")
        if extras:
            raise ValueError(
                f"attention_fn must fall back to Flax's attention ({reasons[0][1]}), which "
                f"cannot honour the pallas_attn-only options {sorted(extras)}")
        which = "linen" if isinstance(module, linen.Module) or linen_only else "nnx"
        for reason, why in reasons:
            _warn_once(reason, f"pallas_attn.flax.attention_fn: {why}; using "
                               f"flax.{which}.dot_product_attention instead.")
        return _flax_attention(
            which, query, key, value, bias, mask, broadcast_dropout=broadcast_dropout,
            dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic,
            dtype=dtype, precision=precision, module=module, promote_dtype=promote_dtype,
            is_causal=is_causal, force_fp32_for_softmax=force_fp32_for_softmax,
            einsum_dot_general=einsum_dot_general,
            qk_attn_weights_einsum=qk_attn_weights_einsum,
            attn_weights_value_einsum=attn_weights_value_einsum)

    if implementation is None and block_sizes is None:
        head_dims = (query.shape[-1], value.shape[-1])
        if on_nvidia_gpu() and max(head_dims) > MAX_KERNEL_HEAD_DIM and not interpret:
            _warn_once("head_dim", f"pallas_attn.flax.attention_fn: head dims {head_dims} exceed "
                                   f"the kernels' {MAX_KERNEL_HEAD_DIM}; using pallas_attn's jnp "
                                   f"reference (implementation='xla') instead.")
            implementation = "xla"
    return _fused_attention(
        query, key, value, bias, mask, is_causal=is_causal,
        dropout_rate=float(dropout_rate) if use_dropout else 0.0,
        dropout_rng=dropout_rng if use_dropout else None,
        broadcast_dropout=broadcast_dropout, implementation=implementation,
        interpret=interpret, block_sizes=block_sizes, extras=extras)


class MultiHeadAttention(nnx.Module):
    """Multi-head attention on the fused op: GQA, causal, dropout, KV-cache decoding.

    Its parameters (``query``, ``key``, ``value``, ``out``: ``nnx.LinearGeneral``) have
    the names, shapes, initializers and rng order of ``flax.nnx.MultiHeadAttention``,
    so the same ``rngs`` give the same weights and state can move between the two.

    Shapes: B batch, L input length, F features, N = num_heads, K = num_kv_heads,
    D = qkv_features // num_heads.

    Decoding: ``init_cache(batch_size, max_length)``, then call with ``decode=True`` and
    one or more new tokens [B, L, F]; their keys and values are appended to the cache
    and they attend causally to everything cached so far. One token attends through
    ``key_value_seq_lengths`` alone (no mask array); a chunk of L > 1 tokens adds an
    [1, 1, L, max_length] boolean mask of explicit positions. A call that raises leaves
    the cache as it was; past max_length an eager call raises ValueError and, under jit,
    the call and every later one return NaN (until init_cache).

    Example::

        layer = MultiHeadAttention(8, 512, num_kv_heads=2, is_causal=True, rngs=nnx.Rngs(0))
        y = layer(x)                                   # [B, T, 512]
        layer.init_cache(batch_size=B, max_length=128)
        y_prompt = layer(prompt, decode=True)          # [B, P, 512]
        y_next = layer(next_token, decode=True)        # [B, 1, 512]
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        is_causal: bool = False,
        dropout_rate: float = 0.0,
        broadcast_dropout: bool = True,
        deterministic: bool | None = None,
        decode: bool | None = None,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Any = default_kernel_init,
        bias_init: Any = _zeros_init,
        implementation: str | None = None,
        interpret: bool = False,
        sinks: bool = False,
        rngs: nnx.Rngs,
    ) -> None:
        """Builds the projections.

        Args:
          num_heads: N, query heads.
          in_features: F, features of the query input.
          qkv_features: N * D (default in_features); must be divisible by num_heads.
          out_features: output features (default in_features).
          num_kv_heads: K, key/value heads (default num_heads); must divide num_heads.
          in_kv_features: features of the key/value input (default in_features).
          is_causal: causal self-attention outside decoding (decoding is always causal).
          dropout_rate: attention-weight dropout probability.
          broadcast_dropout: one dropout mask shared by batch and heads (Flax's default).
          deterministic: default for ``__call__``'s ``deterministic`` (needed with dropout).
          decode: default for ``__call__``'s ``decode``.
          use_bias: biases in the projections.
          dtype: computation dtype (default: inferred from inputs and params).
          param_dtype: parameter dtype.
          precision: precision of the projections (the fused attention accumulates in
            float32 and multiplies float32 inputs exactly regardless).
          kernel_init: projection kernel initializer.
          bias_init: projection bias initializer.
          implementation: pallas_attn implementation (None: automatic).
          interpret: run the Pallas kernels in the interpreter.
          sinks: learn one attention-sink logit per head (``sinks``, zeros at first),
            added to every row's softmax with no value (GPT-OSS, StreamingLLM).
          rngs: ``params`` for initialisation; ``dropout`` kept when dropout_rate > 0.
        """
        num_heads = static_int("num_heads", num_heads, 1)
        if num_kv_heads is not None:
            num_kv_heads = static_int("num_kv_heads", num_kv_heads, 1)
        dropout_rate = static_float("dropout_rate", dropout_rate)
        if not 0.0 <= dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate!r}")
        sinks = check_bool("sinks", sinks)
        is_causal, broadcast_dropout, interpret = (
            check_bool(name, x) for name, x in (("is_causal", is_causal), (
                "broadcast_dropout", broadcast_dropout), ("interpret", interpret)))
        deterministic, decode = (None if x is None else check_bool(name, x)
                                 for name, x in (("deterministic", deterministic),
                                                 ("decode", decode)))
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.in_features = in_features
        self.qkv_features = in_features if qkv_features is None else qkv_features
        self.out_features = in_features if out_features is None else out_features
        self.in_kv_features = in_features if in_kv_features is None else in_kv_features
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.qkv_features % num_heads:
            raise ValueError(f"qkv_features ({self.qkv_features}) must be divisible by "
                             f"num_heads ({num_heads})")
        self.head_dim = self.qkv_features // num_heads
        self.is_causal = is_causal
        self.dropout_rate = dropout_rate
        self.broadcast_dropout = broadcast_dropout
        self.deterministic = deterministic
        self.decode = decode
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.implementation = implementation
        self.interpret = interpret

        linear = functools.partial(
            nnx.LinearGeneral, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
            bias_init=bias_init, use_bias=use_bias, precision=precision, rngs=rngs)
        self.query = linear(in_features, out_features=(num_heads, self.head_dim))
        self.key = linear(self.in_kv_features, out_features=(self.num_kv_heads, self.head_dim))
        self.value = linear(self.in_kv_features, out_features=(self.num_kv_heads, self.head_dim))
        self.out = nnx.LinearGeneral(
            in_features=(num_heads, self.head_dim), out_features=self.out_features,
            axis=(-2, -1), dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
            bias_init=bias_init, use_bias=use_bias, precision=precision, rngs=rngs)
        self.rngs = rngs.dropout.fork() if dropout_rate > 0 else None
        self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype)) if sinks else nnx.data(None)
        self.cached_key: nnx.Cache | None = nnx.data(None)
        self.cached_value: nnx.Cache | None = nnx.data(None)
        self.cache_index: nnx.Cache | None = nnx.data(None)
        self.page_table: nnx.Cache | None = nnx.data(None)
        self.cache_dtype = None

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None,
                   page_size: int | None = None) -> None:
        """Allocates an empty KV cache: keys and values [batch_size, max_length, K, D], or
        with page_size, pages [batch_size * ceil(max_length / page_size), page_size, K, D]
        and a page table (decoding then runs pallas_attn.paged_attention).

        Args:
          batch_size: B of the decode calls.
          max_length: most tokens the cache holds (prompt and generated together).
          dtype: cache dtype (default: the dtype of the keys the layer computes, so that
            a bfloat16 model keeps a bfloat16 cache whatever its param_dtype).
          page_size: tokens per page, or None.
        """
        batch_size = static_int("batch_size", batch_size, 1)
        max_length = static_int("max_length", max_length, 1)
        self.cache_dtype = dtype
        dtype = dtype or self.dtype or self.param_dtype
        if page_size is None:
            shape = (batch_size, max_length, self.num_kv_heads, self.head_dim)
            self.page_table = nnx.data(None)
        else:
            page_size = static_int("page_size", page_size, 1)
            pages = -(-max_length // page_size)
            shape = (batch_size * pages, page_size, self.num_kv_heads, self.head_dim)
            self.page_table = nnx.Cache(
                jnp.arange(batch_size * pages, dtype=jnp.int32).reshape(batch_size, pages))
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.array(0, dtype=jnp.int32))

    def set_view(self, deterministic: bool | None = None, decode: bool | None = None) -> None:
        """For ``nnx.view``: sets the default ``deterministic`` / ``decode`` flags."""
        if deterministic is not None:
            self.deterministic = check_bool("deterministic", deterministic)
        if decode is not None:
            self.decode = check_bool("decode", decode)

    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array | None = None,
        *,
        mask: Array | None = None,
        key_value_seq_lengths: Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        decode: bool | None = None,
    ) -> Array:
        """Attends ``inputs_q`` to ``inputs_kv`` (self-attention when None).

        Args:
          inputs_q: [B, L, F].
          inputs_kv: [B, S, in_kv_features] for cross-attention; None in decode mode.
          mask: boolean (or 0/1) mask broadcastable to [B, N, L, S] (decode: S =
            max_length); True = attend.
          key_value_seq_lengths: int [B]; keys at j >= length are ignored (padding).
          deterministic: no dropout when True (default: the constructor's).
          rngs: dropout randomness (default: the stream kept at construction).
          decode: append to the KV cache and attend to the cached prefix.

        Returns:
          [B, L, out_features]. A query row that sees no key gives 0 before ``out``.
        """
        decode = bool(self.decode) if decode is None else check_bool("decode", decode)
        if deterministic is not None:
            deterministic = check_bool("deterministic", deterministic)
        if decode and inputs_kv is not None:
            raise ValueError("decode=True is self-attention; inputs_kv must be None")
        kv_inputs = inputs_q if inputs_kv is None else inputs_kv
        query = self.query(inputs_q)
        key = self.key(kv_inputs)
        value = self.value(kv_inputs)
        dropout_rate, dropout_rng = self._dropout(deterministic, rngs)
        mask = _as_bool_mask(mask)
        is_causal = self.is_causal
        sinks = None if self.sinks is None else self.sinks[...]
        if decode and self.page_table is not None:
            out, state = self._paged_decode(query, key, value, mask, key_value_seq_lengths,
                                            dropout_rate, sinks)
            return self.out(self._commit(out, state))
        state = None
        if decode:
            key, value, mask, key_value_seq_lengths, state = self._append_to_cache(
                key, value, mask, key_value_seq_lengths)
            is_causal = False  # causality is in the cache lengths and positions mask
        out = dot_product_attention(
            query, key.astype(query.dtype), value.astype(query.dtype), mask=mask,
            is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
            dropout_rate=dropout_rate, dropout_rng=dropout_rng,
            broadcast_dropout=self.broadcast_dropout, implementation=self.implementation,
            interpret=self.interpret, sinks=sinks)
        return self.out(out if state is None else self._commit(out, state))

    def _commit(self, out: Array, state: tuple[Array, Array, Array, Any]) -> Array:
        """Stores a decode call's cache once its attention has run (a call that raises
        leaves the cache as it was); under jit, a call past the cache's end gives NaN
        (its keys had nowhere to go), and so does every later one."""
        keys, values, index, overflow = state
        self.cached_key.set_value(keys)
        self.cached_value.set_value(values)
        self.cache_index[...] = index
        if overflow is False:
            return out
        return jnp.where(overflow, jnp.asarray(jnp.nan, out.dtype), out)

    def _paged_decode(self, query: Array, key: Array, value: Array, mask: Array | None,
                      lengths: Array | None, dropout_rate: float, sinks: Array | None
                      ) -> tuple[Array, tuple[Array, Array, Array, Any]]:
        """Attends through the pages with the new keys/values written into them: the
        output and the cache state to store (`_commit`)."""
        from pallas_attn.paged import paged_attention, paged_cache_update

        for name, given in (("mask", mask is not None), ("key_value_seq_lengths",
                                                         lengths is not None),
                            ("dropout", dropout_rate > 0)):
            if given:
                raise ValueError(f"decoding with a paged cache takes no {name}: the cache "
                                 f"lengths say what each token sees")
        table = self.page_table[...]
        B, L = key.shape[:2]
        if B != table.shape[0]:
            raise ValueError(f"decode inputs have batch {B}, the paged cache was made for "
                             f"batch_size={table.shape[0]}")
        cached_keys, cached_values = self._cache_in(key.dtype)
        capacity = table.shape[1] * cached_keys.shape[1]
        index, overflow = self._advance(L, capacity)
        lengths = jnp.broadcast_to(index, (B,)).astype(jnp.int32)
        keys, values = paged_cache_update(cached_keys, cached_values, key, value, table,
                                          lengths)
        out = paged_attention(query, keys.astype(query.dtype), values.astype(query.dtype),
                              table, lengths, sinks=sinks, implementation=self.implementation,
                              interpret=self.interpret)
        return out, (keys, values, index, overflow)

    def _cache_in(self, dtype: Any) -> tuple[Array, Array]:
        """The cached keys and values; a cache whose dtype was not given takes the dtype
        of the keys it receives."""
        keys, values = self.cached_key[...], self.cached_value[...]
        if self.cache_dtype is None and keys.dtype != dtype:
            keys, values = keys.astype(dtype), values.astype(dtype)
        return keys, values

    def _advance(self, new: int, capacity: int) -> tuple[Array, Any]:
        """The cache index past `new` tokens, and whether they overflow the cache: a
        concrete index (eager use) raises ValueError there, a traced one (under jit)
        gives a traced flag (False: no overflow possible)."""
        index = self.cache_index[...]
        try:
            if int(index) + new > capacity:
                raise ValueError(f"the KV cache holds {capacity} tokens: {int(index)} cached "
                                 f"+ {new} new do not fit")
            return index + new, False
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
            return index + new, index + new > capacity

    def _dropout(self, deterministic: bool | None,
                 rngs: nnx.Rngs | nnx.RngStream | None) -> tuple[float, Array | None]:
        if self.dropout_rate <= 0.0:
            return 0.0, None
        deterministic = deterministic if deterministic is not None else self.deterministic
        if deterministic is None:
            raise ValueError("MultiHeadAttention has dropout: pass deterministic= to __call__ "
                             "or the constructor (or use model.train() / model.eval())")
        if deterministic:
            return 0.0, None
        stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs
        stream = self.rngs if stream is None else stream
        if stream is None:
            raise ValueError("dropout needs rngs: pass rngs= to __call__")
        return float(self.dropout_rate), stream()

    def _append_to_cache(
        self, key: Array, value: Array, mask: Array | None, lengths: Array | None,
    ) -> tuple[Array, Array, Array | None, Array, tuple[Array, Array, Array, Any]]:
        """[B, L, K, D] keys/values written at cache_index: what the queries see, and the
        cache state to store (`_commit`)."""
        if self.cached_key is None or self.cached_value is None or self.cache_index is None:
            raise ValueError("the KV cache is not initialised: call init_cache(batch, max_len)")
        B, max_length, K, D = self.cached_key.shape
        L = key.shape[1]
        if key.shape != (B, L, K, D):
            raise ValueError(f"decode inputs give keys {key.shape}, the cache holds "
                             f"[{B}, {max_length}, {K}, {D}]")
        cached_keys, cached_values = self._cache_in(key.dtype)
        index = self.cache_index[...]
        end, overflow = self._advance(L, max_length)
        zero = jnp.zeros_like(index)  # every start int32, under jax_enable_x64 too
        start = (zero, index, zero, zero)
        keys = jax.lax.dynamic_update_slice(cached_keys, key.astype(cached_keys.dtype), start)
        values = jax.lax.dynamic_update_slice(cached_values, value.astype(cached_values.dtype),
                                              start)
        filled = jnp.broadcast_to(index + L, (B,)).astype(jnp.int32)
        lengths = filled if lengths is None else jnp.minimum(filled, lengths)
        if L > 1:  # new token i sits at position index + i and sees keys j <= index + i
            rows = index + jnp.arange(L, dtype=jnp.int32)[:, None]
            causal = (jnp.arange(max_length, dtype=jnp.int32)[None, :] <= rows)[None, None]
            mask = causal if mask is None else jnp.logical_and(mask, causal)
        return keys, values, mask, lengths, (keys, values, end, overflow)
