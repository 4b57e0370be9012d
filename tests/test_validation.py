"""Bad inputs: one test each, a ValueError or TypeError whose message names the argument.

Every test runs with the implementations replaced by stubs that fail if reached
(`no_heavy_work`), so validation provably happens before any attention is computed
or any kernel is traced. Most checks are also repeated under jax.jit tracing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn
from pallas_attn.semantics import reference

B, T, S, N, K, H = 2, 8, 12, 4, 2, 16

API = pallas_attn.dot_product_attention
ENTRY_POINTS = {
    "api": API,
    "api_xla": functools.partial(API, implementation="xla"),
    "api_pallas_interpret": functools.partial(API, implementation="pallas", interpret=True),
}
entry_points = pytest.mark.parametrize("fn", list(ENTRY_POINTS.values()), ids=list(ENTRY_POINTS))


@pytest.fixture(autouse=True)
def no_heavy_work(monkeypatch):
    """Any attention computation reached by a bad call fails the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("validation let a bad input through to the implementation")

    monkeypatch.setattr(reference, "attention", forbidden)
    kernels = importlib.import_module("pallas_attn.kernels.vjp")
    monkeypatch.setattr(kernels, "attention", forbidden)


def _qkv(q_shape=(B, T, N, H), k_shape=(B, S, K, H), v_shape=None, dtype=jnp.float32, seed=0):
    """Valid-looking inputs (values are irrelevant here; NumPy avoids a compile per shape)."""
    rng = np.random.default_rng(seed)
    v_shape = k_shape if v_shape is None else v_shape
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype)
                 for shape in (q_shape, k_shape, v_shape))


Q, KEY, V = _qkv()


def _bad(fn, exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def test_good_call_passes_validation():
    """Sanity of the fixture: a valid call reaches the (stubbed) implementation."""
    with pytest.raises(AssertionError, match="let a bad input through"):
        API(Q, KEY, V, implementation="xla")


# ----------------------------------------------------------------------------- ranks


@entry_points
def test_query_2d(fn):
    _bad(fn, ValueError, r"query must be \[B, T, N, H\] or \[T, N, H\]", Q[0, :, 0], KEY, V)


@entry_points
def test_query_5d(fn):
    _bad(fn, ValueError, r"query must be \[B, T, N, H\] or \[T, N, H\].*\(1, 2, 8, 4, 16\)",
         Q[None], KEY, V)


@entry_points
def test_key_rank_differs(fn):
    _bad(fn, ValueError, r"same rank.*key \(12, 2, 16\)", Q, KEY[0], V)


@entry_points
def test_value_rank_differs(fn):
    _bad(fn, ValueError, r"same rank.*value \(12, 2, 16\)", Q, KEY, V[0])


# ----------------------------------------------------------------------------- sizes


@entry_points
def test_batch_mismatch(fn):
    _bad(fn, ValueError, r"batch sizes differ: query 2, key 1", Q, KEY[:1], V)


@entry_points
def test_value_batch_mismatch(fn):
    _bad(fn, ValueError, r"batch sizes differ: .*value 1", Q, KEY, V[:1])


@entry_points
def test_key_value_sequence_mismatch(fn):
    _bad(fn, ValueError, r"value must be \[B, S, K, Hv\] matching key's S=12", Q, KEY, V[:, :7])


@entry_points
def test_key_head_dim_differs_from_query(fn):
    q, k, v = _qkv(k_shape=(B, S, K, 8))
    _bad(fn, ValueError, r"key head dim 8 must equal query head dim 16", q, k, v)


@entry_points
def test_value_heads_differ_from_key_heads(fn):
    q, k, v = _qkv(v_shape=(B, S, 1, H))
    _bad(fn, ValueError, r"value must be .*K=2", q, k, v)


@entry_points
def test_query_heads_not_multiple_of_key_heads(fn):
    q, k, v = _qkv(q_shape=(B, T, 3, H))
    _bad(fn, ValueError, r"query heads \(3\) must be a multiple of key/value heads \(2\)", q, k, v)


@entry_points
def test_fewer_query_heads_than_key_heads(fn):
    q, k, v = _qkv(q_shape=(B, T, 2, H), k_shape=(B, S, 4, H))
    _bad(fn, ValueError, r"query heads \(2\) must be a multiple of key/value heads \(4\)", q, k, v)


@entry_points
@pytest.mark.parametrize("shapes", [((B, T, 0, H), (B, S, 0, H)), ((B, T, N, 0), (B, S, K, 0))],
                         ids=["no_heads", "no_features"])
def test_no_heads_or_features(fn, shapes):
    q, k, v = _qkv(q_shape=shapes[0], k_shape=shapes[1])
    _bad(fn, ValueError, r"at least one head and one feature", q, k, v)


# ----------------------------------------------------------------------------- dtypes


@entry_points
@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_integer_inputs(fn, which):
    args = dict(query=Q, key=KEY, value=V)
    args[which] = args[which].astype(jnp.int32)
    _bad(fn, TypeError, rf"{which} must have a floating dtype, got int32", args["query"],
         args["key"], args["value"])


@entry_points
def test_all_integer_inputs(fn):
    q, k, v = _qkv(dtype=jnp.int32)
    _bad(fn, TypeError, r"query must have a floating dtype", q, k, v)


@entry_points
def test_mixed_dtypes(fn):
    _bad(fn, TypeError, r"query, key and value must share one dtype.*float32.*bfloat16", Q,
         KEY.astype(jnp.bfloat16), V)


@entry_points
def test_query_not_an_array(fn):
    _bad(fn, TypeError, r"query must be an array, got str", "query", KEY, V)


# ----------------------------------------------------------------------------- bias / mask


@entry_points
@pytest.mark.parametrize("shape,label", [((B, 3, T, S), "heads"), ((B, N, T, S + 1), "kv_len"),
                                         ((3, N, T, S), "batch"), ((T + 2, S), "q_len")])
def test_bias_not_broadcastable(fn, shape, label):
    bias = jnp.ones(shape, jnp.float32) * 0.5
    _bad(fn, ValueError, rf"bias of shape .* is not broadcastable .*its {label} dim", Q, KEY, V,
         bias)


@entry_points
@pytest.mark.parametrize("shape", [(1, B, N, T, S), (S,)], ids=["5d", "1d"])
def test_bias_wrong_rank(fn, shape):
    _bad(fn, ValueError, r"bias must be 4-D", Q, KEY, V, jnp.full(shape, 0.5))


@entry_points
def test_bias_integer(fn):
    _bad(fn, TypeError, r"bias must have a floating dtype", Q, KEY, V,
         jnp.ones((T, S), jnp.int32))


@entry_points
@pytest.mark.parametrize("shape", [(B, N, T, S - 1), (B, 3, 1, S), (1, B, N, T, S)])
def test_mask_not_broadcastable(fn, shape):
    match = r"mask must be 4-D" if len(shape) == 5 else r"mask of shape .* is not broadcastable"
    _bad(fn, ValueError, match, Q, KEY, V, mask=jnp.ones(shape, bool))


@entry_points
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_mask_not_boolean(fn, dtype):
    _bad(fn, TypeError, r"mask must be boolean", Q, KEY, V, mask=jnp.ones((T, S), dtype))


# ----------------------------------------------------------------------------- dropout


@entry_points
@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_rate_out_of_range(fn, rate):
    _bad(fn, ValueError, r"dropout_rate must lie in \[0, 1\)", Q, KEY, V, dropout_rate=rate,
         dropout_rng=jax.random.key(0))


@entry_points
@pytest.mark.parametrize("rate", ["0.1", True, jnp.ones(2), None], ids=str)
def test_dropout_rate_not_a_float(fn, rate):
    _bad(fn, TypeError, r"dropout_rate must be a Python float", Q, KEY, V, dropout_rate=rate,
         dropout_rng=jax.random.key(0))


@entry_points
def test_dropout_without_rng(fn):
    _bad(fn, ValueError, r"dropout_rate=0.1 needs a dropout_rng", Q, KEY, V, dropout_rate=0.1)


@entry_points
@pytest.mark.parametrize("rng", [5, "key", jnp.ones(2, jnp.float32)], ids=["int", "str", "float"])
def test_dropout_rng_not_a_key(fn, rng):
    _bad(fn, TypeError, r"dropout_rng must be a jax PRNG key", Q, KEY, V, dropout_rate=0.1,
         dropout_rng=rng)


# ----------------------------------------------------------------------------- window, cap


@entry_points
@pytest.mark.parametrize("window", [-1, (-1, 2), (3, -2)], ids=str)
def test_negative_window(fn, window):
    _bad(fn, ValueError, r"local_window_size must be non-negative", Q, KEY, V,
         local_window_size=window)


@entry_points
@pytest.mark.parametrize("window", [(1, 2, 3), 2.0, (1.5, 2), (1,), True, "2"], ids=str)
def test_malformed_window(fn, window):
    _bad(fn, TypeError, r"local_window_size must be an int or a \(left, right\) pair", Q, KEY,
         V, local_window_size=window)


@entry_points
@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan")], ids=str)
def test_soft_cap_not_positive_finite(fn, cap):
    _bad(fn, ValueError, r"logits_soft_cap must be positive and finite", Q, KEY, V,
         logits_soft_cap=cap)


@entry_points
@pytest.mark.parametrize("cap", ["5", True, jnp.ones(2), 1j], ids=str)
def test_soft_cap_not_a_float(fn, cap):
    _bad(fn, TypeError, r"logits_soft_cap must be a (Python float|real number)", Q, KEY, V,
         logits_soft_cap=cap)


@entry_points
@pytest.mark.parametrize("scale", ["0.5", True, jnp.ones(2), np.array([0.5]), jnp.bool_(True)],
                         ids=str)
def test_scale_not_a_float(fn, scale):
    _bad(fn, TypeError, r"scale must be a Python float", Q, KEY, V, scale=scale)


@entry_points
@pytest.mark.parametrize("scale", [float("inf"), float("nan")], ids=str)
def test_scale_not_finite(fn, scale):
    _bad(fn, ValueError, r"scale must be finite", Q, KEY, V, scale=scale)


@entry_points
@pytest.mark.parametrize("causal", [1, "yes", None, jnp.ones(2, bool), jnp.int32(1)], ids=str)
def test_is_causal_not_bool(fn, causal):
    _bad(fn, TypeError, r"is_causal must be a bool", Q, KEY, V, is_causal=causal)


@entry_points
@pytest.mark.parametrize("alignment", ["bottom-right", "top", None], ids=str)
def test_unknown_causal_alignment(fn, alignment):
    _bad(fn, ValueError, r"causal_alignment must be one of", Q, KEY, V, is_causal=True,
         causal_alignment=alignment)


# ----------------------------------------------------------------------------- lengths


@entry_points
@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
@pytest.mark.parametrize("shape", [(B + 1,), (B, 1), (), (1,)], ids=str)
def test_seq_lengths_wrong_shape(fn, name, shape):
    _bad(fn, ValueError, rf"{name} must have shape \[batch\] = \(2,\)", Q, KEY, V,
         **{name: jnp.full(shape, 3, jnp.int32)})


@entry_points
@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bool_], ids=str)
def test_seq_lengths_not_integer(fn, name, dtype):
    _bad(fn, TypeError, rf"{name} must have an integer dtype", Q, KEY, V,
         **{name: jnp.ones((B,), dtype)})


@entry_points
@pytest.mark.parametrize("name,bound", [("query_seq_lengths", T), ("key_value_seq_lengths", S)])
@pytest.mark.parametrize("bad", ["negative", "too_long"])
def test_seq_lengths_out_of_range(fn, name, bound, bad):
    values = [-1, 3] if bad == "negative" else [3, bound + 1]
    _bad(fn, ValueError, rf"{name} must lie in \[0, {bound}\]", Q, KEY, V,
         **{name: jnp.array(values, jnp.int32)})
    # 64-bit lengths are checked before a conversion to int32 could wrap them into range.
    _bad(fn, ValueError, rf"{name} must lie in \[0, {bound}\]", Q, KEY, V,
         **{name: np.array([3, 2**32 + 1], np.int64)})


# ----------------------------------------------------------------------------- segments


@entry_points
@pytest.mark.parametrize("shape", [(B, T + 1), (T,), (B, T, 1)], ids=str)
def test_q_segment_ids_wrong_shape(fn, shape):
    _bad(fn, ValueError, r"q_segment_ids must have shape \[2, 8\]", Q, KEY, V,
         q_segment_ids=jnp.zeros(shape, jnp.int32), kv_segment_ids=jnp.zeros((B, S), jnp.int32))


@entry_points
def test_kv_segment_ids_wrong_shape(fn):
    _bad(fn, ValueError, r"kv_segment_ids must have shape \[2, 12\]", Q, KEY, V,
         q_segment_ids=jnp.zeros((B, T), jnp.int32), kv_segment_ids=jnp.zeros((B, T), jnp.int32))


@entry_points
@pytest.mark.parametrize("which", ["q_segment_ids", "kv_segment_ids"])
def test_segment_ids_past_int32_are_refused(fn, which):
    """The kernels compare int32 ids: a 64-bit id converted first would wrap, and 2**32
    would then meet id 0."""
    ids = dict(q_segment_ids=np.zeros((B, T), np.int64), kv_segment_ids=np.zeros((B, S), np.int64))
    ids[which][0, -1] = 2**32
    _bad(fn, ValueError, rf"{which} must lie in \[-2147483648, 2147483647\], got values from "
         r"0 to 4294967296", Q, KEY, V, **ids)


@entry_points
@pytest.mark.parametrize("which", ["q_segment_ids", "kv_segment_ids"])
def test_segment_ids_float(fn, which):
    ids = dict(q_segment_ids=jnp.zeros((B, T), jnp.int32),
               kv_segment_ids=jnp.zeros((B, S), jnp.int32))
    ids[which] = ids[which].astype(jnp.float32)
    _bad(fn, TypeError, rf"{which} must have an integer dtype", Q, KEY, V, **ids)


@entry_points
def test_kv_segment_ids_without_q_segment_ids(fn):
    _bad(fn, ValueError, r"kv_segment_ids given without q_segment_ids", Q, KEY, V,
         kv_segment_ids=jnp.zeros((B, S), jnp.int32))


@entry_points
def test_missing_kv_segment_ids_when_lengths_differ(fn):
    _bad(fn, ValueError, r"kv_segment_ids is required when q_len \(8\) != kv_len \(12\)", Q, KEY,
         V, q_segment_ids=jnp.zeros((B, T), jnp.int32))


# ----------------------------------------------------------------------------- ALiBi


@entry_points
@pytest.mark.parametrize("shape", [(N + 1,), (B, N - 1), (1, N, 1), (K,), ()], ids=str)
def test_alibi_slopes_wrong_shape(fn, shape):
    _bad(fn, ValueError, r"alibi_slopes must have shape \[N\] = \(4,\) or \[B, N\] = \(2, 4\)",
         Q, KEY, V, alibi_slopes=jnp.full(shape, 0.1, jnp.float32))


@entry_points
def test_alibi_slopes_integer(fn):
    _bad(fn, TypeError, r"alibi_slopes must have a floating dtype", Q, KEY, V,
         alibi_slopes=jnp.ones((N,), jnp.int32))


# ----------------------------------------------------------------------------- implementation


@pytest.mark.parametrize("impl", ["triton", "XLA", "", "mosaic"])
def test_unknown_implementation(impl):
    _bad(API, ValueError, r"implementation must be None or one of", Q, KEY, V,
         implementation=impl)


@pytest.mark.parametrize("q_head,v_head", [(320, 320), (16, 512)])
def test_head_dim_over_256_with_pallas(q_head, v_head):
    q, k, v = _qkv(q_shape=(1, 16, 2, q_head), k_shape=(1, 16, 2, q_head),
                   v_shape=(1, 16, 2, v_head))
    _bad(API, ValueError, r"the Pallas kernels support head dims up to 256", q, k, v,
         implementation="pallas", interpret=True)


@pytest.mark.parametrize("blocks", [{"block_q": 32}, (32, 32), 64], ids=str)
def test_block_sizes_wrong_type(blocks):
    _bad(API, TypeError, r"block_sizes must be a pallas_attn.BlockSizes, got", Q, KEY, V,
         implementation="pallas", interpret=True, block_sizes=blocks)


@pytest.mark.parametrize("impl", ["xla", None])
def test_block_sizes_with_xla(impl):
    _bad(API, ValueError, r"block_sizes and interpret apply to implementation='pallas'", Q, KEY,
         V, implementation=impl, block_sizes=pallas_attn.BlockSizes())


def test_interpret_with_xla():
    _bad(API, ValueError, r"block_sizes and interpret apply to implementation='pallas'", Q, KEY,
         V, implementation="xla", interpret=True)


def _block_size_fields(prefix):
    return [f.name for f in dataclasses.fields(pallas_attn.BlockSizes) if f.name.startswith(prefix)]


BAD_BLOCK_FIELDS = (
    [(f, v) for f in _block_size_fields("block_") for v in (24, 8, 0, -64, 64.0)]
    + [(f, v) for f in _block_size_fields("num_warps") for v in (3, 0, 32)]
    + [(f, v) for f in _block_size_fields("num_stages") for v in (0, 9, 2.5, True)]
    + [("block_q", True)]
)


@pytest.mark.parametrize("field,value", BAD_BLOCK_FIELDS, ids=str)
def test_invalid_block_sizes_fields(field, value):
    with pytest.raises(ValueError, match=rf"BlockSizes\.{field} must be"):
        pallas_attn.BlockSizes(**{field: value})


@pytest.mark.parametrize("field,value", [("block_q", np.int64(64)), ("num_warps", np.int32(4)),
                                         ("num_stages", np.int64(2))], ids=str)
def test_block_sizes_take_numpy_integers_as_ints(field, value):
    blocks = pallas_attn.BlockSizes(**{field: value})
    assert getattr(blocks, field) == value and type(getattr(blocks, field)) is int
    with pytest.raises(ValueError, match=rf"BlockSizes\.{field} must be"):
        pallas_attn.BlockSizes(**{field: value * 5})


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_invalid_fuse_dbias(value):
    with pytest.raises(ValueError, match=r"BlockSizes\.fuse_dbias must be True, False or None"):
        pallas_attn.BlockSizes(fuse_dbias=value)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_invalid_deterministic(value):
    with pytest.raises(ValueError, match=r"BlockSizes\.deterministic must be True or False"):
        pallas_attn.BlockSizes(deterministic=value)


@pytest.mark.parametrize("bias_shape", [(2, 2, 8, 1), (1, 2, 8, 8), (2, 1, 8, 8), (8, 8)])
def test_fuse_dbias_true_rejects_a_bias_it_cannot_fuse(bias_shape):
    """Fused dbias needs one entry per batch entry, head and key (no sum across programs)."""
    _bad(API, ValueError, r"fuse_dbias=True needs a bias with its own entry for every batch "
         r"entry, head and key \(2, 2, T or 1, S\); this bias has shape",
         jnp.zeros((2, 8, 2, 16)), jnp.zeros((2, 8, 2, 16)), jnp.zeros((2, 8, 2, 16)),
         jnp.zeros(bias_shape), implementation="pallas", interpret=True,
         block_sizes=pallas_attn.BlockSizes(fuse_dbias=True))


# Regression (fixed): BlockSizes accepts num_warps=4.0 and num_warps=True because the
# check is `value not in (1, 2, 4, 8, 16)` (4.0 == 4, True == 1); num_stages already
# rejects floats and bools. These tests fail until num_warps gets the same int check.
@pytest.mark.parametrize("field,value", [("num_warps", 4.0), ("num_warps", True)], ids=str)
def test_regression_block_sizes_num_warps_must_be_int(field, value):
    with pytest.raises(ValueError, match=rf"BlockSizes\.{field} must be"):
        pallas_attn.BlockSizes(**{field: value})


@pytest.mark.parametrize("fn", [ENTRY_POINTS["api"], ENTRY_POINTS["api_pallas_interpret"]],
                         ids=["api", "pallas"])
@pytest.mark.parametrize("value", [1, 0, "yes", None], ids=str)
def test_return_residual_not_bool(fn, value):
    _bad(fn, TypeError, r"return_residual must be a bool", Q, KEY, V, return_residual=value)


# Regression (fixed): broadcast_dropout was not validated: broadcast_dropout="no" is truthy
# and silently shares one dropout mask across batch and heads. Fails until it is checked.
@pytest.mark.parametrize("fn", [ENTRY_POINTS["api"], ENTRY_POINTS["api_xla"]],
                         ids=["api", "reference"])
@pytest.mark.parametrize("value", ["no"], ids=str)
def test_regression_broadcast_dropout_not_bool(fn, value):
    _bad(fn, TypeError, r"broadcast_dropout must be a bool", Q, KEY, V, dropout_rate=0.1,
         dropout_rng=jax.random.key(0), broadcast_dropout=value)


# ----------------------------------------------------------------------------- unbatched layout


@entry_points
def test_unbatched_segment_ids_must_be_1d(fn):
    _bad(fn, ValueError, r"q_segment_ids must have shape \[8\]", Q[0], KEY[0], V[0],
         q_segment_ids=jnp.zeros((1, T), jnp.int32), kv_segment_ids=jnp.zeros((S,), jnp.int32))


@entry_points
def test_unbatched_bias_with_batch_2(fn):
    _bad(fn, ValueError, r"bias of shape .* its batch dim is 2, expected 1", Q[0], KEY[0], V[0],
         jnp.ones((2, N, T, S), jnp.float32))


# ----------------------------------------------------------------------------- dropout_keep_mask


@pytest.mark.parametrize("kwargs,match", [
    (dict(rate=1.0), r"rate must lie in \[0, 1\)"),
    (dict(rate=-0.5), r"rate must lie in \[0, 1\)"),
    (dict(batch=0), r"batch must be a positive int"),
    (dict(num_heads=2.0), r"num_heads must be a positive int"),
    (dict(q_len=-1), r"q_len must be a positive int"),
    (dict(kv_len=None), r"kv_len must be a positive int"),
])
def test_dropout_keep_mask_arguments(kwargs, match):
    args = dict(batch=1, num_heads=2, q_len=4, kv_len=4, rate=0.1) | kwargs
    with pytest.raises(ValueError, match=match):
        pallas_attn.dropout_keep_mask(jax.random.key(0), **args)


# ----------------------------------------------------------------------------- under jax.jit

JIT_BAD_CALLS = {
    "key_rank": (lambda q, k, v: API(q, k[0], v), ValueError, r"same rank"),
    "heads": (lambda q, k, v: API(q[:, :, :3], k, v), ValueError, r"query heads \(3\)"),
    "int_query": (lambda q, k, v: API(q.astype(jnp.int32), k, v), TypeError,
                  r"query must have a floating dtype"),
    "bias": (lambda q, k, v: API(q, k, v, jnp.zeros((B, 3, T, S))), ValueError,
             r"bias of shape"),
    "mask_dtype": (lambda q, k, v: API(q, k, v, mask=jnp.zeros((T, S))), TypeError,
                   r"mask must be boolean"),
    "dropout_rng": (lambda q, k, v: API(q, k, v, dropout_rate=0.2), ValueError,
                    r"needs a dropout_rng"),
    "window": (lambda q, k, v: API(q, k, v, local_window_size=-2), ValueError,
               r"local_window_size must be non-negative"),
    "soft_cap": (lambda q, k, v: API(q, k, v, logits_soft_cap=0.0), ValueError,
                 r"logits_soft_cap must be positive"),
    "lengths_shape": (lambda q, k, v: API(q, k, v, query_seq_lengths=jnp.ones((3,), jnp.int32)),
                      ValueError, r"query_seq_lengths must have shape"),
    "segments": (lambda q, k, v: API(q, k, v, q_segment_ids=jnp.zeros((B, T), jnp.int32)),
                 ValueError, r"kv_segment_ids is required"),
    "alibi": (lambda q, k, v: API(q, k, v, alibi_slopes=jnp.ones((3,))), ValueError,
              r"alibi_slopes must have shape"),
    "implementation": (lambda q, k, v: API(q, k, v, implementation="triton"), ValueError,
                       r"implementation must be"),
    "head_dim_pallas": (lambda q, k, v: API(jnp.tile(q, 20), jnp.tile(k, 20), v,
                                            implementation="pallas", interpret=True),
                        ValueError, r"head dims up to 256"),
    "block_sizes_xla": (lambda q, k, v: API(q, k, v, implementation="xla",
                                            block_sizes=pallas_attn.BlockSizes()),
                        ValueError, r"block_sizes and interpret apply"),
    "reference_alignment": (lambda q, k, v: API(
        q, k, v, implementation="xla", causal_alignment="middle"), ValueError,
        r"causal_alignment must be one of"),
}


@pytest.mark.parametrize("name", list(JIT_BAD_CALLS))
def test_same_error_under_jit(name):
    """Validation runs at trace time: jax.jit raises the same error on concrete arrays."""
    call, exc, match = JIT_BAD_CALLS[name]
    with pytest.raises(exc, match=match):
        call(Q, KEY, V)
    with pytest.raises(exc, match=match):
        jax.jit(call)(Q, KEY, V)
    with pytest.raises(exc, match=match):
        jax.eval_shape(call, Q, KEY, V)
