"""Argument normalisation and validation for every implementation.

`normalize()` turns the public arguments of `dot_product_attention` into

* an `AttentionSpec`: frozen and hashable, holding every static choice (scale,
  causal alignment, window, soft cap, dropout rate, which optional inputs are
  present and their broadcast shapes). It is what travels into `jax.custom_vjp`
  and what kernels are specialised on.
* an `Operands` tuple: the arrays in one canonical layout, 4-D with a batch axis.

All checks happen here, before any kernel is traced, and every failure is a
`ValueError` or `TypeError` that names the argument and the offending value.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn.semantics.dropout import program_keys, seed_from_key

IMPLEMENTATIONS = ("pallas", "xla", "xla_chunked")
ALIGNMENTS = ("top_left", "bottom_right")
MAX_KERNEL_HEAD_DIM = 256
KERNEL_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Every static choice of one attention call (hashable).

    Attributes:
      scale: multiplier of q.k.
      is_causal: key j is visible to query i only if j <= i + offset.
      causal_alignment: "top_left" (offset 0) or "bottom_right" (offset S - T).
      local_window: (left, right) band i + off - left <= j <= i + off + right, or None.
      logits_soft_cap: cap in cap * tanh(logits / cap), or None.
      dropout_rate: probability of dropping an attention weight.
      broadcast_dropout: one dropout mask shared by every batch entry and head.
      bias_shape: 4-D shape of the additive bias (each dim 1 or full), or None.
      mask_shape: 4-D shape of the boolean mask, or None.
      has_alibi / has_segments / has_q_lengths / has_kv_lengths / has_sinks: optional
        inputs.
    """

    scale: float
    is_causal: bool = False
    causal_alignment: str = "top_left"
    local_window: tuple[int, int] | None = None
    logits_soft_cap: float | None = None
    dropout_rate: float = 0.0
    broadcast_dropout: bool = False
    bias_shape: tuple[int, int, int, int] | None = None
    mask_shape: tuple[int, int, int, int] | None = None
    has_alibi: bool = False
    has_segments: bool = False
    has_q_lengths: bool = False
    has_kv_lengths: bool = False
    has_sinks: bool = False

    @property
    def has_bias(self) -> bool:
        return self.bias_shape is not None

    @property
    def has_mask(self) -> bool:
        return self.mask_shape is not None

    @property
    def has_dropout(self) -> bool:
        return self.dropout_rate > 0.0

    @property
    def hides_keys(self) -> bool:
        """Some key can be hidden from some row inside a tile a kernel reads (the lengths
        aside: positions past them are zeroed in the tiles or before the call)."""
        return (self.is_causal or self.local_window is not None or self.has_mask
                or self.has_segments)

    def offset(self, q_len: int, kv_len: int) -> int:
        """Query position i is aligned with key position i + offset."""
        return kv_len - q_len if self.causal_alignment == "bottom_right" else 0


class Operands(NamedTuple):
    """The arrays of one call in canonical layout (absent inputs are None).

    query [B, T, N, H], key [B, S, K, H], value [B, S, K, Hv];
    bias [Bb, Nb, Tb, Sb] and mask [Bm, Nm, Tm, Sm], each dim 1 or full;
    alibi_slopes [B, N] float32; q_segment_ids [B, T] / kv_segment_ids [B, S] int32;
    query_seq_lengths / key_value_seq_lengths [B] int32; dropout_keys uint32 [B, N]
    (or [1, 1] with broadcast_dropout), semantics/dropout.program_keys; origin int32 [2]:
    the positions of query 0 and key 0 (ring attention's blocks; absent means 0, 0).
    Every position-dependent rule (causal, window, ALiBi, lengths, dropout) uses
    positions counted from the origin. sinks [N] float32: one logit per query head
    added to every row's softmax, with no value.
    """

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None = None
    mask: jax.Array | None = None
    alibi_slopes: jax.Array | None = None
    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    query_seq_lengths: jax.Array | None = None
    key_value_seq_lengths: jax.Array | None = None
    dropout_keys: jax.Array | None = None
    origin: jax.Array | None = None
    sinks: jax.Array | None = None


# The optional operands, in the order the kernels receive them.
OPTIONAL_INPUTS = Operands._fields[3:]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _dtype(x: Any) -> np.dtype:
    return jnp.result_type(x)


def _concrete_scalar(value: Any) -> bool:
    """A 0-d NumPy or JAX array with a value known now (not traced under jit)."""
    return (isinstance(value, np.ndarray | jax.Array) and np.shape(value) == ()
            and not isinstance(value, jax.core.Tracer))


def _traced(name: str, value: Any, kind: str) -> None:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name} must be a static {kind} (it shapes the kernels), got a traced "
                        f"value: compute it outside jax.jit or pass a Python {kind}")


def check_bool(name: str, value: Any) -> bool:
    """A Python, NumPy or concrete JAX bool, else TypeError naming the argument."""
    _traced(name, value, "bool")
    if _concrete_scalar(value) and np.dtype(value.dtype) == np.bool_:
        return bool(value)
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def static_float(name: str, value: Any) -> float:
    """A Python, NumPy or concrete JAX real number as a float, else TypeError naming the
    argument (bools are not numbers here)."""
    _traced(name, value, "float")
    if _concrete_scalar(value) and (jnp.issubdtype(value.dtype, jnp.floating)
                                    or jnp.issubdtype(value.dtype, jnp.integer)):
        return float(value)
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
        raise TypeError(f"{name} must be a Python float, got {value!r}")
    if isinstance(value, np.complexfloating):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    return float(value)


def static_int(name: str, value: Any, low: int | None = None) -> int:
    """A Python, NumPy or concrete JAX integer (not a bool) of at least low, as an int,
    else TypeError / ValueError naming the argument."""
    _traced(name, value, "int")
    if _concrete_scalar(value) and jnp.issubdtype(value.dtype, jnp.integer):
        value = int(value)
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a Python int, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be at least {low}, got {value!r}")
    return int(value)


def _as_array(name: str, x: Any) -> jax.Array:
    if isinstance(x, jax.ShapeDtypeStruct):
        raise TypeError(f"{name} must be an array, got a jax.ShapeDtypeStruct (use "
                        "jax.eval_shape to trace shapes)")
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, np.ndarray | np.generic):
        return jnp.asarray(x)  # the jnp paths trace it inside loops
    if isinstance(x, bool | int | float | list | tuple):
        try:
            return jnp.asarray(x)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name} must be an array, got {type(x).__name__}: {e}") from None
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # tracers
        return x
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def _check_float(name: str, x: Any) -> None:
    if not jnp.issubdtype(_dtype(x), jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {_dtype(x)}")


def _check_int(name: str, x: Any) -> None:
    if not jnp.issubdtype(_dtype(x), jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {_dtype(x)}")


def _broadcast_shape_4d(name: str, x: Any, full: tuple[int, int, int, int]) -> tuple:
    """Checks that x is 4-D (or 3-D for batchless inputs) and broadcastable to full."""
    shape = _shape(x)
    if len(shape) not in (2, 3, 4):
        raise ValueError(
            f"{name} must be 4-D [batch, heads, q_len, kv_len] (or 2-D/3-D, leading dims "
            f"broadcast), got shape {shape}"
        )
    shape = (1,) * (4 - len(shape)) + shape
    labels = ("batch", "heads", "q_len", "kv_len")
    for size, want, label in zip(shape, full, labels, strict=True):
        if size not in (1, want):
            raise ValueError(
                f"{name} of shape {_shape(x)} is not broadcastable to [B, N, T, S] = "
                f"{list(full)}: its {label} dim is {size}, expected 1 or {want}"
            )
    return shape


def _check_lengths(name: str, x: Any, batch: int, bound: int) -> jax.Array:
    given = x  # checked before any conversion to 32 bits could wrap it
    x = _as_array(name, x)
    _check_int(name, x)
    if _shape(x) != (batch,):
        raise ValueError(f"{name} must have shape [batch] = ({batch},), got {_shape(x)}")
    check_concrete_range(name, given, 0, bound)
    return jnp.asarray(x, jnp.int32)


INT32_RANGE = (-2**31, 2**31 - 1)


def check_concrete_range(name: str, x: Any, low: int, high: int) -> None:
    """Range check for values known at trace time (skipped under jit)."""
    try:
        values = np.asarray(x)
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return
    if values.size and (values.min() < low or values.max() > high):
        raise ValueError(f"{name} must lie in [{low}, {high}], got values from "
                         f"{values.min()} to {values.max()}")


def normalize(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: int | tuple[int, int] | None = None,
    causal_alignment: str = "top_left",
    alibi_slopes: Any = None,
    logits_soft_cap: float | None = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    dropout_rate: float = 0.0,
    dropout_rng: Any = None,
    broadcast_dropout: bool = False,
    sinks: Any = None,
    sequence_ways: int = 1,
) -> tuple[AttentionSpec, Operands, bool]:
    """Validates the public arguments; returns (spec, operands, had_batch_axis).

    sequence_ways: how many devices split the sequences (ring attention): lengths
    count global positions, up to that many times the local lengths.
    """
    query = _as_array("query", query)
    key = _as_array("key", key)
    value = _as_array("value", value)
    q_shape, k_shape, v_shape = _shape(query), _shape(key), _shape(value)
    if len(q_shape) not in (3, 4):
        raise ValueError(f"query must be [B, T, N, H] or [T, N, H], got shape {q_shape}")
    batched = len(q_shape) == 4
    if len(k_shape) != len(q_shape) or len(v_shape) != len(q_shape):
        raise ValueError(
            f"query, key and value must have the same rank, got query {q_shape}, "
            f"key {k_shape}, value {v_shape}"
        )
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check_float(name, x)
    if not (_dtype(query) == _dtype(key) == _dtype(value)):
        raise TypeError(
            f"query, key and value must share one dtype, got {_dtype(query)}, "
            f"{_dtype(key)}, {_dtype(value)}"
        )
    if not batched:
        query, key, value = query[None], key[None], value[None]
        q_shape, k_shape, v_shape = (1, *q_shape), (1, *k_shape), (1, *v_shape)
    B, T, N, H = q_shape
    Bk, S, K, Hk = k_shape
    if Bk != B or v_shape[0] != B:
        raise ValueError(f"batch sizes differ: query {B}, key {Bk}, value {v_shape[0]}")
    if v_shape[1] != S or v_shape[2] != K:
        raise ValueError(
            f"value must be [B, S, K, Hv] matching key's S={S} and K={K}, got shape {v_shape}"
        )
    if Hk != H:
        raise ValueError(f"key head dim {Hk} must equal query head dim {H}")
    if min(N, K, H, v_shape[3]) == 0:
        raise ValueError(f"query, key and value need at least one head and one feature, got "
                         f"query {q_shape}, key {k_shape}, value {v_shape}")
    if N % K:
        raise ValueError(
            f"query heads ({N}) must be a multiple of key/value heads ({K})"
        )

    scale = 1.0 / math.sqrt(H) if scale is None else static_float("scale", scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")

    is_causal = check_bool("is_causal", is_causal)
    broadcast_dropout = check_bool("broadcast_dropout", broadcast_dropout)
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")

    window = None
    if local_window_size is not None:
        if isinstance(local_window_size, int | np.integer) and not isinstance(
            local_window_size, bool
        ):
            window = (int(local_window_size), int(local_window_size))
        elif (
            isinstance(local_window_size, tuple | list)
            and len(local_window_size) == 2
            and all(isinstance(w, int | np.integer) and not isinstance(w, bool)
                    for w in local_window_size)
        ):
            window = (int(local_window_size[0]), int(local_window_size[1]))
        else:
            raise TypeError(
                f"local_window_size must be an int or a (left, right) pair of ints, "
                f"got {local_window_size!r}"
            )
        if min(window) < 0:
            raise ValueError(f"local_window_size must be non-negative, got {local_window_size!r}")
        # Any window wider than T + S sees the same keys; clamping keeps the int32
        # position arithmetic of the band from overflowing.
        bound = (T + S) * sequence_ways
        window = (min(window[0], bound), min(window[1], bound))

    if logits_soft_cap is not None:
        logits_soft_cap = static_float("logits_soft_cap", logits_soft_cap)
        if not (logits_soft_cap > 0 and math.isfinite(logits_soft_cap)):
            raise ValueError(f"logits_soft_cap must be positive and finite, got {logits_soft_cap}")

    full = (B, N, T, S)
    bias_shape = mask_shape = None
    if bias is not None:
        bias = _as_array("bias", bias)
        _check_float("bias", bias)
        bias_shape = _broadcast_shape_4d("bias", bias, full)
        bias = jnp.reshape(bias, bias_shape)
    if mask is not None:
        mask = _as_array("mask", mask)
        if _dtype(mask) != np.dtype(bool):
            raise TypeError(
                f"mask must be boolean (True = attend), got dtype {_dtype(mask)}; "
                "pass an additive mask as bias"
            )
        mask_shape = _broadcast_shape_4d("mask", mask, full)
        mask = jnp.reshape(mask, mask_shape)

    if alibi_slopes is not None:
        alibi_slopes = _as_array("alibi_slopes", alibi_slopes)
        _check_float("alibi_slopes", alibi_slopes)
        a_shape = _shape(alibi_slopes)
        if a_shape == (N,):
            alibi_slopes = jnp.broadcast_to(alibi_slopes[None], (B, N))
        elif a_shape != (B, N):
            raise ValueError(
                f"alibi_slopes must have shape [N] = ({N},) or [B, N] = ({B}, {N}), got {a_shape}"
            )
        alibi_slopes = jnp.asarray(alibi_slopes, jnp.float32)

    if q_segment_ids is None and kv_segment_ids is not None:
        raise ValueError("kv_segment_ids given without q_segment_ids")
    if q_segment_ids is not None:
        if kv_segment_ids is None:
            if T != S:
                raise ValueError(
                    f"kv_segment_ids is required when q_len ({T}) != kv_len ({S})"
                )
            kv_segment_ids = q_segment_ids
        shared = kv_segment_ids is q_segment_ids
        segs = []
        for name, ids, length in (("q_segment_ids", q_segment_ids, T),
                                  ("kv_segment_ids", kv_segment_ids, S)):
            given = ids
            ids = _as_array(name, ids)
            _check_int(name, ids)
            # The kernels compare int32 ids: wider ones must fit, or distinct ids could meet
            # (int32 ones need no look at their values, so no copy to the host).
            wide = given.dtype if hasattr(given, "dtype") else np.asarray(given).dtype
            if not np.can_cast(wide, np.int32):
                check_concrete_range(name, given, *INT32_RANGE)
            want = (B, length) if batched else (length,)
            if _shape(ids) != want:
                raise ValueError(f"{name} must have shape {list(want)}, got {_shape(ids)}")
            segs.append(jnp.asarray(ids, jnp.int32).reshape(B, length))
        q_segment_ids, kv_segment_ids = segs
        if shared:  # one array: the kernels then find the segments as its runs
            kv_segment_ids = q_segment_ids

    if sinks is not None:
        sinks = _as_array("sinks", sinks)
        _check_float("sinks", sinks)
        if _shape(sinks) != (N,):
            raise ValueError(f"sinks must have shape [N] = ({N},) (one logit per query head), "
                             f"got {_shape(sinks)}")
        sinks = jnp.asarray(sinks, jnp.float32)

    if query_seq_lengths is not None:
        query_seq_lengths = _check_lengths("query_seq_lengths", query_seq_lengths, B,
                                           T * sequence_ways)
    if key_value_seq_lengths is not None:
        key_value_seq_lengths = _check_lengths("key_value_seq_lengths", key_value_seq_lengths,
                                               B, S * sequence_ways)

    dropout_rate = static_float("dropout_rate", dropout_rate)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must lie in [0, 1), got {dropout_rate}")
    drop_keys = None
    if dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng (a jax PRNG key)")
        drop_keys = program_keys(seed_from_key(dropout_rng), B, N, bool(broadcast_dropout))

    spec = AttentionSpec(
        scale=float(scale),
        is_causal=bool(is_causal),
        causal_alignment=causal_alignment,
        local_window=window,
        logits_soft_cap=logits_soft_cap,
        dropout_rate=dropout_rate,
        broadcast_dropout=bool(broadcast_dropout),
        bias_shape=bias_shape,
        mask_shape=mask_shape,
        has_alibi=alibi_slopes is not None,
        has_segments=q_segment_ids is not None,
        has_q_lengths=query_seq_lengths is not None,
        has_kv_lengths=key_value_seq_lengths is not None,
        has_sinks=sinks is not None,
    )
    operands = Operands(query, key, value, bias, mask, alibi_slopes, q_segment_ids,
                        kv_segment_ids, query_seq_lengths, key_value_seq_lengths, drop_keys,
                        sinks=sinks)
    return spec, operands, batched
