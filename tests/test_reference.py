"""The reference implementation (implementation="xla") against independent oracles.

* jax.nn.dot_product_attention(implementation="xla") on every argument it shares.
* A naive float64 implementation written here (`naive_attention`, broadcasting over
  b, n, i, j; no library code) for every extra feature: bottom-right alignment,
  ALiBi, soft cap, segment ids, Hv != H, fully masked rows and dropout (the keep
  mask comes from the public `pallas_attn.dropout_keep_mask`). The same function run
  with jax.numpy under `jax.enable_x64` is the float64 gradient oracle.
* jit / vmap / grad, and the statistics and determinism of dropout.

Shapes are small (B <= 2, T, S <= 48, heads <= 4, head dims <= 32); inputs and
cotangents are random with fixed seeds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn

# The reference semantics through the public entry point.
XLA = functools.partial(pallas_attn.dot_product_attention, implementation="xla")
IMPLS = {"api_xla": XLA}
impl_params = pytest.mark.parametrize("impl", list(IMPLS))

FWD_TOL = dict(rtol=2e-5, atol=2e-5)
GRAD_TOL = dict(rtol=2e-4, atol=2e-4)


# --------------------------------------------------------------------------------------
# Independent float64 oracle
# --------------------------------------------------------------------------------------


def naive_visibility(B, N, T, S, *, mask=None, is_causal=False, local_window_size=None,
                     causal_alignment="top_left", q_segment_ids=None, kv_segment_ids=None,
                     query_seq_lengths=None, key_value_seq_lengths=None):
    """Boolean [B, N, T, S]: key j visible to query i (numpy, straight from DESIGN.md)."""
    off = S - T if causal_alignment == "bottom_right" else 0
    i = np.arange(T)[None, None, :, None]
    j = np.arange(S)[None, None, None, :]
    vis = np.ones((B, N, T, S), bool)
    if mask is not None:
        vis &= np.broadcast_to(np.asarray(mask, bool), vis.shape)
    if is_causal:
        vis &= j <= i + off
    if local_window_size is not None:
        if isinstance(local_window_size, int):
            left = right = local_window_size
        else:
            left, right = local_window_size
        vis &= (j >= i + off - left) & (j <= i + off + right)
    if q_segment_ids is not None:
        qs = np.asarray(q_segment_ids).reshape(B, T)
        ks = np.asarray(kv_segment_ids).reshape(B, S)
        vis &= qs[:, None, :, None] == ks[:, None, None, :]
    if query_seq_lengths is not None:
        vis &= i < np.asarray(query_seq_lengths).reshape(B, 1, 1, 1)
    if key_value_seq_lengths is not None:
        vis &= j < np.asarray(key_value_seq_lengths).reshape(B, 1, 1, 1)
    return vis


def naive_attention(xp, q, k, v, bias=None, *, scale=None, alibi_slopes=None,
                    logits_soft_cap=None, keep=None, dropout_rate=0.0, **vis_kwargs):
    """out [B, T, N, Hv], lse [B, T, N] from 4-D q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv].

    xp is numpy (float64 forward) or jax.numpy under jax.enable_x64 (float64 autodiff).
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    group = N // K
    k_rep = xp.repeat(k, group, axis=2)  # query head n reads key head n // group
    v_rep = xp.repeat(v, group, axis=2)
    if scale is None:
        scale = 1.0 / math.sqrt(H)
    logits = xp.einsum("btnh,bsnh->bnts", q, k_rep) * scale
    if bias is not None:
        logits = logits + bias  # numpy broadcasting = "leading dims broadcast"
    off = S - T if vis_kwargs.get("causal_alignment") == "bottom_right" else 0
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, np.float64)
        slopes = slopes.reshape((1 if slopes.ndim == 1 else B, N, 1, 1))
        distance = np.abs(np.arange(T)[:, None] + off - np.arange(S)[None, :])
        logits = logits - slopes * distance
    if logits_soft_cap is not None:
        logits = logits_soft_cap * xp.tanh(logits / logits_soft_cap)
    vis = naive_visibility(B, N, T, S, **vis_kwargs)
    any_vis = vis.any(axis=-1, keepdims=True)
    masked = xp.where(vis, logits, -np.inf)
    row_max = xp.where(any_vis, xp.max(masked, axis=-1, keepdims=True), 0.0)
    e = xp.exp(masked - row_max)
    total = xp.sum(e, axis=-1, keepdims=True)
    safe_total = xp.where(any_vis, total, 1.0)
    p = e / safe_total
    lse = xp.where(any_vis, row_max + xp.log(safe_total), -np.inf)[..., 0]  # [B, N, T]
    if keep is not None:
        p = p * np.asarray(keep, np.float64) / (1.0 - dropout_rate)
    out = xp.einsum("bnts,bsnh->btnh", p, v_rep)
    return out, xp.transpose(lse, (0, 2, 1))


def np64(x):
    return np.asarray(x, np.float64)


def oracle_forward(q, k, v, bias=None, **kw):
    out, lse = naive_attention(np, np64(q), np64(k), np64(v),
                               None if bias is None else np64(bias), **kw)
    return out, lse


def _sum_to_shape(x, shape):
    """Reduces a [B, N, T, S] gradient to a bias of `shape` (leading dims broadcast)."""
    full = (1,) * (4 - len(shape)) + tuple(shape)
    axes = tuple(a for a, (want, have) in enumerate(zip(full, x.shape, strict=True))
                 if want == 1 and have != 1)
    return np.sum(x, axis=axes, keepdims=True).reshape(shape)


def oracle_vjp(q, k, v, bias, cot_out, cot_lse, *, scale=None, alibi_slopes=None,
               logits_soft_cap=None, keep=None, dropout_rate=0.0, **vis_kwargs):
    """Float64 NumPy (out, lse) and the hand-derived gradients w.r.t. (q, k, v[, bias]).

    Backward of softmax attention written out (checked against jax float64 autodiff
    and central finite differences below):
      dV = P_drop^T dO,  dP = (dO V^T) * keep / (1 - rate),
      dS = P * (dP - rowsum(P * dP)) + P * dlse,  dS_pre = dS * (1 - tanh^2) under a soft cap,
      dbias = dS_pre summed to bias's shape,  dQ = scale dS_pre K,  dK = scale dS_pre^T Q.
    """
    q, k, v, cot_out, cot_lse = (np64(x) for x in (q, k, v, cot_out, cot_lse))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    group = N // K
    k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    if scale is None:
        scale = 1.0 / math.sqrt(H)
    pre = np.einsum("btnh,bsnh->bnts", q, k_rep) * scale
    if bias is not None:
        pre = pre + np64(bias)
    off = S - T if vis_kwargs.get("causal_alignment") == "bottom_right" else 0
    if alibi_slopes is not None:
        slopes = np64(alibi_slopes)
        slopes = slopes.reshape((1 if slopes.ndim == 1 else B, N, 1, 1))
        pre = pre - slopes * np.abs(np.arange(T)[:, None] + off - np.arange(S)[None, :])
    logits = pre
    if logits_soft_cap is not None:
        tanh = np.tanh(pre / logits_soft_cap)
        logits = logits_soft_cap * tanh
    vis = naive_visibility(B, N, T, S, **vis_kwargs)
    any_vis = vis.any(axis=-1, keepdims=True)
    masked = np.where(vis, logits, -np.inf)
    row_max = np.where(any_vis, masked.max(axis=-1, keepdims=True), 0.0)
    e = np.exp(masked - row_max)
    total = np.where(any_vis, e.sum(axis=-1, keepdims=True), 1.0)
    p = e / total
    lse = np.where(any_vis, row_max + np.log(total), -np.inf)[..., 0]
    drop = 1.0 if keep is None else np64(keep) / (1.0 - dropout_rate)
    out = np.einsum("bnts,bsnh->btnh", p * drop, v_rep)

    d_v_rep = np.einsum("bnts,btnh->bsnh", p * drop, cot_out)
    dp = np.einsum("btnh,bsnh->bnts", cot_out, v_rep) * drop
    dlse = np.transpose(cot_lse, (0, 2, 1))[..., None]
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True)) + p * dlse
    if logits_soft_cap is not None:
        ds = ds * (1.0 - tanh**2)
    dq = np.einsum("bnts,bsnh->btnh", ds, k_rep) * scale
    d_k_rep = np.einsum("bnts,btnh->bsnh", ds, q) * scale
    dk = d_k_rep.reshape(B, S, K, group, H).sum(axis=3)
    dv = d_v_rep.reshape(B, S, K, group, -1).sum(axis=3)
    grads = [dq, dk, dv]
    if bias is not None:
        grads.append(_sum_to_shape(ds, np.shape(bias)))
    return out, np.transpose(lse, (0, 2, 1)), grads


def oracle_vjp_x64(q, k, v, bias, cot_out, cot_lse, **kw):
    """The same through jax float64 autodiff of `naive_attention(jnp, ...)`."""
    with jax.enable_x64(True):
        primals = [jnp.asarray(np64(x)) for x in (q, k, v, bias) if x is not None]

        def f(*args):
            return naive_attention(jnp, *args, **kw)

        (out, lse), vjp = jax.vjp(f, *primals)
        grads = vjp((jnp.asarray(np64(cot_out)), jnp.asarray(np64(cot_lse))))
        return np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]


def lib_vjp(fn, q, k, v, bias, cot_out, cot_lse, **kw):
    """(out, lse) and the gradients w.r.t. (q, k, v[, bias]) of a library function."""
    primals = [x for x in (q, k, v, bias) if x is not None]

    def f(*args):
        return fn(*args, return_residual=True, **kw)

    (out, lse), vjp = jax.vjp(f, *primals)
    grads = vjp((cot_out, cot_lse))
    return out, lse, grads


def keys(seed, n):
    return jax.random.split(jax.random.key(seed), n)


# Random arrays are slices of one fixed-size jax.random draw: jax compiles its sampler
# once per shape, so a single pool shape keeps every test from paying that again.
POOL = 1 << 14  # >= the largest array drawn here (2 * 4 * 40 * 40 = 12800)


def _pool(sampler, key, shape):
    n = math.prod(shape)
    assert n <= POOL, shape
    return np.asarray(sampler(key, (POOL,), jnp.float32))[:n].reshape(shape)


def normal(key, shape, scale=1.0):
    """float32 standard normal (times scale) of the given shape, as a jax array."""
    return jnp.asarray(np.float32(scale) * _pool(jax.random.normal, key, shape))


def uniform(key, shape, low=0.0, high=1.0):
    return np.float32(low) + np.float32(high - low) * _pool(jax.random.uniform, key, shape)


def bernoulli(key, p, shape):
    """numpy bool array, True with probability p."""
    return uniform(key, shape) < p


def randint(key, shape, low, high):
    return np.minimum(np.floor(uniform(key, shape, low, high)), high - 1).astype(np.int32)


def assert_no_nan(*arrays):
    for a in arrays:
        assert not np.isnan(np.asarray(a)).any()


# --------------------------------------------------------------------------------------
# Case description shared by the forward and gradient checks against the oracle
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    B: int = 2
    T: int = 24
    S: int = 24
    N: int = 4
    K: int = 2
    H: int = 16
    Hv: int | None = None
    batched: bool = True  # False: [T, N, H] layout (B must be 1)
    bias: tuple | None = None  # the bias shape as passed
    mask: tuple | None = None  # the mask shape as passed (random, 75% True)
    empty_rows: tuple = ()  # query rows whose mask row is all False (needs a full-T mask)
    is_causal: bool = False
    causal_alignment: str = "top_left"
    window: Any = None
    scale: float | None = None
    alibi: str | None = None  # "N" or "BN"
    soft_cap: float | None = None
    segments: str | None = None  # "self" (kv defaults to q), "cross", "disjoint"
    q_lengths: tuple | None = None
    kv_lengths: tuple | None = None
    dropout: float = 0.0
    broadcast_dropout: bool = False
    raw_key: bool = False  # dropout_rng as a raw uint32[2] PRNGKey
    qk_scale: float = 1.0  # multiplies q and k (large logits)

    def __str__(self):
        return self.name


@dataclasses.dataclass
class Built:
    q: jax.Array
    k: jax.Array
    v: jax.Array
    bias: jax.Array | None
    lib_kw: dict
    oracle_kw: dict
    cot_out: jax.Array
    cot_lse: jax.Array


def build(case: Case, seed: int = 0) -> Built:
    c = case
    B, T, S, N, K, H = c.B, c.T, c.S, c.N, c.K, c.H
    Hv = c.Hv or H
    ks = keys(seed, 16)
    lead = (B,) if c.batched else ()
    if not c.batched:
        assert B == 1
    q = normal(ks[0], (*lead, T, N, H), c.qk_scale)
    k = normal(ks[1], (*lead, S, K, H), c.qk_scale)
    v = normal(ks[2], (*lead, S, K, Hv))
    bias = None if c.bias is None else normal(ks[3], c.bias)
    lib_kw: dict = {}
    okw: dict = {}

    def both(name, value, oracle_value=None):
        lib_kw[name] = value
        okw[name] = value if oracle_value is None else oracle_value

    if c.mask is not None:
        mask = bernoulli(ks[4], 0.75, c.mask)
        for row in c.empty_rows:
            mask[..., row, :] = False
        both("mask", jnp.asarray(mask), mask)
    if c.is_causal:
        both("is_causal", True)
    if c.causal_alignment != "top_left":
        both("causal_alignment", c.causal_alignment)
    if c.window is not None:
        both("local_window_size", c.window)
    if c.scale is not None:
        both("scale", c.scale)
    if c.alibi is not None:
        shape = (N,) if c.alibi == "N" else (B, N)
        slopes = jnp.asarray(uniform(ks[5], shape, 0.05, 0.6))
        both("alibi_slopes", slopes, np.asarray(slopes))
    if c.soft_cap is not None:
        both("logits_soft_cap", c.soft_cap)
    if c.segments is not None:
        seg_shape = (lambda n: (B, n)) if c.batched else (lambda n: (n,))
        q_seg = randint(ks[6], seg_shape(T), 0, 3)
        if c.segments == "self":
            assert T == S
            kv_seg = q_seg
        else:
            kv_seg = randint(ks[7], seg_shape(S), 0, 3)
        if c.segments == "disjoint":  # rows whose id no key has: fully masked
            q_seg[..., ::5] = 7
        lib_kw["q_segment_ids"] = jnp.asarray(q_seg)
        if c.segments != "self":
            lib_kw["kv_segment_ids"] = jnp.asarray(kv_seg)
        okw["q_segment_ids"], okw["kv_segment_ids"] = q_seg, kv_seg
    if c.q_lengths is not None:
        both("query_seq_lengths", jnp.asarray(c.q_lengths, jnp.int32), np.array(c.q_lengths))
    if c.kv_lengths is not None:
        both("key_value_seq_lengths", jnp.asarray(c.kv_lengths, jnp.int32),
             np.array(c.kv_lengths))
    if c.dropout:
        rng = jax.random.PRNGKey(seed + 1000) if c.raw_key else jax.random.key(seed + 1000)
        lib_kw.update(dropout_rate=c.dropout, dropout_rng=rng,
                      broadcast_dropout=c.broadcast_dropout)
        okw["keep"] = np.asarray(pallas_attn.dropout_keep_mask(
            rng, batch=B, num_heads=N, q_len=T, kv_len=S, rate=c.dropout,
            broadcast_batch_heads=c.broadcast_dropout))
        okw["dropout_rate"] = c.dropout
    cot_out = normal(ks[8], (*lead, T, N, Hv))
    cot_lse = normal(ks[9], (*lead, T, N))
    return Built(q, k, v, bias, lib_kw, okw, cot_out, cot_lse)


def canon(case: Case, *arrays):
    """Adds the batch axis of [T, ...] layouts so results compare with the oracle's."""
    if case.batched:
        return arrays
    return tuple(None if a is None else np.asarray(a)[None] for a in arrays)


# Few distinct shapes keep the suite fast (eager jax caches compiled ops by shape):
# square (T = S = 24), wide (T = 16 < S = 40) and tall (T = 40 > S = 16).
WIDE = dict(T=16, S=40)
TALL = dict(T=40, S=16)
BR = dict(causal_alignment="bottom_right")

FEATURE_CASES = [
    # causal_alignment="bottom_right": offset S - T for causal, window and ALiBi
    Case("bottom_right_causal_T<S", **WIDE, **BR, is_causal=True),
    Case("bottom_right_causal_T>S", **TALL, **BR, is_causal=True),
    Case("bottom_right_window_T<S", **WIDE, **BR, window=(3, 5)),
    Case("bottom_right_window_T>S", **TALL, **BR, window=4),
    Case("bottom_right_window_causal", **WIDE, **BR, window=(6, 2), is_causal=True),
    Case("top_left_window_causal_T>S", **TALL, window=(5, 0), is_causal=True),
    # ALiBi
    Case("alibi_N", alibi="N"),
    Case("alibi_BN", alibi="BN"),
    Case("alibi_BN_bottom_right_causal", **WIDE, **BR, alibi="BN", is_causal=True),
    Case("alibi_N_bottom_right_T>S", **TALL, **BR, alibi="N"),
    Case("alibi_top_left_T<S", **WIDE, alibi="N"),
    # soft cap (after bias and ALiBi)
    Case("soft_cap", soft_cap=5.0, scale=1.0),
    Case("soft_cap_bias_alibi", soft_cap=2.5, scale=0.8, bias=(2, 4, 24, 24), alibi="N"),
    # segment ids
    Case("segments_kv_defaults_to_q", segments="self"),
    Case("segments_cross_T<S", **WIDE, segments="cross"),
    Case("segments_disjoint_rows", segments="disjoint"),
    # value head dim != query head dim
    Case("value_head_dim_8", **WIDE, Hv=8),
    Case("mqa_T<S", **WIDE, K=1, window=(9, 4)),
    # fully masked rows
    Case("fully_masked_rows_mask", mask=(2, 4, 24, 24), empty_rows=(0, 5, 23)),
    Case("fully_masked_rows_lengths", q_lengths=(24, 0), kv_lengths=(0, 17)),
    # dropout (keep mask = pallas_attn.dropout_keep_mask)
    Case("dropout", dropout=0.3),
    Case("dropout_broadcast", **WIDE, dropout=0.5, broadcast_dropout=True),
    Case("dropout_raw_key", dropout=0.2, raw_key=True),
    # several features together
    Case("combo_gqa_everything", **WIDE, **BR, Hv=8, bias=(1, 4, 16, 40), mask=(2, 1, 16, 40),
         is_causal=True, alibi="BN", soft_cap=4.0, segments="cross", q_lengths=(14, 16),
         kv_lengths=(40, 30), dropout=0.25),
    Case("combo_unbatched", B=1, batched=False, Hv=24, bias=(24, 24), window=(4, 3), alibi="N",
         soft_cap=3.0, dropout=0.4, broadcast_dropout=True, kv_lengths=(19,)),
    Case("combo_window_segments_bias", bias=(2, 1, 24, 24), window=6, is_causal=True,
         segments="self", mask=(24, 24), scale=0.3, dropout=0.1),
]
feature_params = pytest.mark.parametrize("case", FEATURE_CASES, ids=str)


# --------------------------------------------------------------------------------------
# 1. jax.nn.dot_product_attention on the shared arguments
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NNCase:
    name: str
    B: int = 2
    T: int = 24
    S: int = 24
    N: int = 4
    K: int = 2
    H: int = 16
    batched: bool = True
    bias: tuple | None = None
    mask: tuple | None = None
    scale: float | None = None
    is_causal: bool = False
    q_lengths: tuple | None = None
    kv_lengths: tuple | None = None
    window: Any = None

    def __str__(self):
        return self.name


NN_CASES = [
    NNCase("plain"),
    NNCase("tnh_layout", B=1, batched=False),
    NNCase("tnh_layout_bias_mask_causal", B=1, batched=False, bias=(4, 24, 24),
           mask=(24, 24), is_causal=True),
    NNCase("bias_BNTS", bias=(2, 4, 24, 24)),
    NNCase("bias_1NTS", bias=(1, 4, 24, 24)),
    NNCase("bias_B1TS", bias=(2, 1, 24, 24)),
    NNCase("bias_BN1S", bias=(2, 4, 1, 24)),
    NNCase("bias_B11S", bias=(2, 1, 1, 24)),
    NNCase("bias_11TS", bias=(1, 1, 24, 24)),
    NNCase("bias_3d_NTS", bias=(4, 24, 24)),
    NNCase("bias_2d_TS", bias=(24, 24)),
    NNCase("mask_BNTS", mask=(2, 4, 24, 24)),
    NNCase("mask_B1TS", mask=(2, 1, 24, 24)),
    NNCase("mask_1N1S", mask=(1, 4, 1, 24)),
    NNCase("mask_2d", mask=(24, 24)),
    NNCase("scale", scale=0.37),
    NNCase("causal", is_causal=True),
    NNCase("causal_T<S", **WIDE, is_causal=True),
    NNCase("causal_T>S", **TALL, is_causal=True),
    NNCase("q_lengths", q_lengths=(24, 9)),
    NNCase("kv_lengths", kv_lengths=(5, 24)),
    NNCase("both_lengths_T<S", **WIDE, q_lengths=(16, 3), kv_lengths=(40, 11)),
    NNCase("window_int", window=3),
    NNCase("window_left_only", window=(4, 0)),
    NNCase("window_right_only", window=(0, 5)),
    NNCase("window_causal", window=(6, 6), is_causal=True),
    NNCase("window_T<S", **WIDE, window=(2, 9)),
    NNCase("window_T>S", **TALL, window=(9, 1)),
    NNCase("mha", K=4),
    NNCase("mqa_T<S", **WIDE, K=1),
    NNCase("combo_gqa", **WIDE, K=2, bias=(2, 1, 16, 40), mask=(2, 4, 16, 40), is_causal=True,
           q_lengths=(16, 11), kv_lengths=(30, 40), window=(7, 3), scale=0.2),
]


def build_nn(case: NNCase, seed: int):
    ks = keys(seed, 6)
    lead = (case.B,) if case.batched else ()
    q = normal(ks[0], (*lead, case.T, case.N, case.H))
    k = normal(ks[1], (*lead, case.S, case.K, case.H))
    v = normal(ks[2], (*lead, case.S, case.K, case.H))
    kw: dict = {}
    if case.bias is not None:
        kw["bias"] = normal(ks[3], case.bias)
    if case.mask is not None:
        kw["mask"] = jnp.asarray(bernoulli(ks[4], 0.7, case.mask))
    if case.scale is not None:
        kw["scale"] = case.scale
    if case.is_causal:
        kw["is_causal"] = True
    if case.q_lengths is not None:
        kw["query_seq_lengths"] = jnp.asarray(case.q_lengths, jnp.int32)
    if case.kv_lengths is not None:
        kw["key_value_seq_lengths"] = jnp.asarray(case.kv_lengths, jnp.int32)
    if case.window is not None:
        kw["local_window_size"] = case.window
    return q, k, v, kw


def visible_rows(case, kw):
    """[B, T, N] True where the query row sees at least one key."""
    vis = naive_visibility(
        case.B, case.N, case.T, case.S, mask=kw.get("mask"), is_causal=case.is_causal,
        local_window_size=case.window, query_seq_lengths=case.q_lengths,
        key_value_seq_lengths=case.kv_lengths)
    return np.transpose(vis.any(-1), (0, 2, 1))


@impl_params
@pytest.mark.parametrize("case", NN_CASES, ids=str)
def test_matches_jax_nn(impl, case):
    q, k, v, kw = build_nn(case, seed=len(case.name))
    fn = IMPLS[impl]
    want_out, want_lse = jax.nn.dot_product_attention(
        q, k, v, implementation="xla", return_residual=True, **kw)
    out, lse = fn(q, k, v, return_residual=True, **kw)
    assert out.shape == want_out.shape and out.dtype == jnp.float32
    assert lse.shape == want_lse.shape == q.shape[:-1]
    assert lse.dtype == jnp.float32
    rows = visible_rows(case, kw)
    assert rows.any()
    out, lse, want_out, want_lse = canon(case, out, lse, want_out, want_lse)
    np.testing.assert_allclose(np.asarray(out)[rows], np.asarray(want_out)[rows], **FWD_TOL)
    np.testing.assert_allclose(np.asarray(lse)[rows], np.asarray(want_lse)[rows], **FWD_TOL)
    # Our convention where nothing is visible: output 0 and lse -inf.
    assert np.all(np.asarray(out)[~rows] == 0)
    assert np.all(np.asarray(lse)[~rows] == -np.inf)
    # Without return_residual: just the output, identical.
    plain = fn(q, k, v, **kw)
    np.testing.assert_array_equal(canon(case, plain)[0], out)


def test_default_implementation_on_cpu_is_the_reference():
    """implementation=None off-GPU is "xla": bitwise the reference, gradients included."""
    if jax.devices()[0].platform == "gpu":
        pytest.skip("the default is the Pallas kernels on an NVIDIA GPU")
    b = build(JIT_CASE, seed=3)
    got = lib_vjp(pallas_attn.dot_product_attention, b.q, b.k, b.v, b.bias, b.cot_out,
                  b.cot_lse, **b.lib_kw)
    want = lib_vjp(XLA, b.q, b.k, b.v, b.bias, b.cot_out,
                   b.cot_lse, **b.lib_kw)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("case", [c for c in NN_CASES if c.name == "combo_gqa"], ids=str)
def test_gradients_match_jax_nn(case):
    """Gradients of q, k, v and bias agree with jax.nn's (output cotangent only)."""
    q, k, v, kw = build_nn(case, seed=7)
    bias = kw.pop("bias", None)
    rows = visible_rows(case, kw)
    # jax.nn averages V over invisible rows; give those rows no cotangent.
    cot = normal(jax.random.key(3), q.shape) * (rows if case.batched else rows[0])[..., None]
    args = (q, k, v) if bias is None else (q, k, v, bias)

    def loss(fn, *a):
        return jnp.sum(fn(*a, **kw) * cot)

    want = jax.grad(functools.partial(loss, functools.partial(
        jax.nn.dot_product_attention, implementation="xla")), argnums=range(len(args)))(*args)
    got = jax.grad(functools.partial(loss, XLA),
                   argnums=range(len(args)))(*args)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, **GRAD_TOL)


# --------------------------------------------------------------------------------------
# 2. Every feature against the float64 oracle (forward): out and lse of every feature case
#    in test_gradients_match_float64_oracle (section 3), with the gradients; here the
#    forward's conventions
# --------------------------------------------------------------------------------------


def test_feature_cases_cover_fully_masked_rows():
    """Sanity of the case table: these cases do produce rows with no visible key."""
    for name in ("bottom_right_causal_T>S", "segments_disjoint_rows", "fully_masked_rows_mask",
                 "fully_masked_rows_lengths"):
        case = next(c for c in FEATURE_CASES if c.name == name)
        b = build(case, seed=1)
        kw = {k: v for k, v in b.oracle_kw.items() if k not in (
            "scale", "alibi_slopes", "logits_soft_cap", "keep", "dropout_rate")}
        vis = naive_visibility(case.B, case.N, case.T, case.S, **kw)
        assert (~vis.any(-1)).any(), name


def test_bottom_right_equals_top_left_when_square():
    b = build(Case("sq", is_causal=True, window=(3, 2), alibi="N"), seed=2)
    tl = XLA(b.q, b.k, b.v, **b.lib_kw)
    br = XLA(b.q, b.k, b.v, causal_alignment="bottom_right",
                                         **b.lib_kw)
    np.testing.assert_array_equal(tl, br)


def test_bottom_right_offset_is_a_shift_of_top_left():
    """bottom_right with T < S equals top_left on queries padded in front to length S."""
    ks = keys(3, 3)
    T, S = 16, 40
    q_full = normal(ks[0], (2, S, 4, 16))
    k = normal(ks[1], (2, S, 2, 16))
    v = normal(ks[2], (2, S, 2, 16))
    kw = dict(is_causal=True, local_window_size=(7, 1), alibi_slopes=jnp.linspace(0.1, 0.4, 4))
    full = XLA(q_full, k, v, **kw)
    tail = XLA(q_full[:, S - T:], k, v,
                                           causal_alignment="bottom_right", **kw)
    np.testing.assert_allclose(tail, full[:, S - T:], rtol=1e-6, atol=1e-6)


def test_kv_segment_ids_default_to_q_segment_ids():
    b = build(Case("seg", segments="self"), seed=4)
    implicit = XLA(b.q, b.k, b.v, **b.lib_kw)
    explicit = XLA(
        b.q, b.k, b.v, kv_segment_ids=b.lib_kw["q_segment_ids"], **b.lib_kw)
    np.testing.assert_array_equal(implicit, explicit)


@impl_params
def test_alibi_slopes_N_equals_broadcast_BN(impl):
    b = build(Case("alibi", **WIDE, **BR, alibi="N"), seed=5)
    slopes = b.lib_kw.pop("alibi_slopes")
    fn = IMPLS[impl]
    a = fn(b.q, b.k, b.v, alibi_slopes=slopes, **b.lib_kw)
    c = fn(b.q, b.k, b.v, alibi_slopes=jnp.broadcast_to(slopes, (2, 4)), **b.lib_kw)
    np.testing.assert_array_equal(a, c)


@impl_params
def test_fully_masked_rows_output_zero_lse_minus_inf(impl):
    ks = keys(6, 4)
    q = normal(ks[0], (2, 16, 4, 16))
    k, v = normal(ks[1], (2, 40, 2, 16)), normal(ks[2], (2, 40, 2, 16))
    mask = bernoulli(ks[3], 0.8, (2, 4, 16, 40))
    mask[0, 1, 4] = False
    mask[1, :, 9] = False
    out, lse = IMPLS[impl](q, k, v, mask=jnp.asarray(mask), query_seq_lengths=jnp.array([16, 12]),
                           return_residual=True)
    assert_no_nan(out, lse)
    assert np.all(np.asarray(out)[0, 4, 1] == 0.0) and lse[0, 4, 1] == -np.inf
    assert np.all(np.asarray(out)[1, 9] == 0.0) and np.all(np.asarray(lse)[1, 9] == -np.inf)
    assert np.all(np.asarray(out)[1, 12:] == 0.0) and np.all(np.asarray(lse)[1, 12:] == -np.inf)
    assert np.isfinite(np.asarray(lse)[0, :4]).all()


# Regression (fixed): window bounds are computed in int32 (rows + offset + right), so a "practically
# unbounded" right window such as (0, 2**31 - 1) overflows and silently masks the wrong
# keys (rows >= 1 see nothing); values >= 2**31 raise an OverflowError from inside jax
# that does not name local_window_size. The right-unbounded / symmetric / 2**40 cases fail
# until the window is clamped to the sequence lengths (or rejected with a clear error).
@pytest.mark.parametrize("window,equivalent", [
    ((2**31 - 1, 0), dict(is_causal=True)),
    ((0, 2**31 - 1), dict(mask=np.triu(np.ones((24, 24), bool)))),
    (2**31 - 1, {}),
    (2**40, {}),
], ids=["left_int32_max_is_causal", "right_int32_max_is_anticausal", "int32_max_is_no_window",
        "2**40_is_no_window"])
def test_regression_huge_local_window(window, equivalent):
    b = build(Case("huge_window"), seed=9)
    want = XLA(b.q, b.k, b.v, **equivalent)
    try:
        got = XLA(b.q, b.k, b.v, local_window_size=window)
    except (ValueError, TypeError) as e:  # a clear rejection is acceptable too
        assert "local_window_size" in str(e)
        return
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_low_precision_inputs(dtype):
    """Output in the input dtype, lse float32, close to the float32 result."""
    b = build(Case("lp", is_causal=True, bias=(1, 4, 24, 24), alibi="N"), seed=8)
    q, k, v, bias = (x.astype(dtype) for x in (b.q, b.k, b.v, b.bias))
    out, lse = XLA(q, k, v, bias, return_residual=True, **b.lib_kw)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    want_out, want_lse = oracle_forward(q.astype(jnp.float32), k.astype(jnp.float32),
                                        v.astype(jnp.float32), bias.astype(jnp.float32),
                                        **b.oracle_kw)
    np.testing.assert_allclose(out.astype(jnp.float32), want_out, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------
# 3. Gradients against the float64 oracle
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in FEATURE_CASES if c.name == "combo_gqa_everything"],
                         ids=str)
def test_numpy_backward_matches_float64_autodiff(case):
    """The hand-written NumPy backward of the oracle equals jax float64 autodiff of it."""
    b = build(case, seed=17)
    got = oracle_vjp(b.q, b.k, b.v, b.bias, b.cot_out, b.cot_lse, **b.oracle_kw)
    want = oracle_vjp_x64(b.q, b.k, b.v, b.bias, b.cot_out, b.cot_lse, **b.oracle_kw)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-12, atol=1e-12)
    for g, w in zip(got[2], want[2], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


def test_numpy_backward_matches_finite_differences():
    """Central differences in float64 of the NumPy forward, every coordinate, all features."""
    case = Case("fd", B=2, T=5, S=7, N=2, K=1, H=4, Hv=3, bias=(1, 2, 5, 7), mask=(2, 1, 5, 7),
                empty_rows=(1,), is_causal=True, causal_alignment="bottom_right",
                window=(3, 1), alibi="BN", soft_cap=2.0, segments="cross", dropout=0.3,
                scale=0.9)
    b = build(case, seed=18)
    args = [np64(x) for x in (b.q, b.k, b.v, b.bias)]
    cot_out, cot_lse = np64(b.cot_out), np64(b.cot_lse)
    _, lse, grads = oracle_vjp(*args, cot_out, cot_lse, **b.oracle_kw)
    finite = np.isfinite(lse)
    assert (~finite).any() and finite.any()

    def objective(*a):
        out, lse = naive_attention(np, *a, **b.oracle_kw)
        return np.sum(out * cot_out) + np.sum(np.where(finite, lse, 0.0) * cot_lse)

    eps = 1e-6
    for which, grad in enumerate(grads):
        numeric = np.zeros_like(args[which])
        for idx in np.ndindex(args[which].shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            numeric[idx] = (objective(*plus) - objective(*minus)) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-7, err_msg=str(which))


def check_grads(fn, case: Case, seed: int):
    b = build(case, seed=seed)
    out, lse, grads = lib_vjp(fn, b.q, b.k, b.v, b.bias, b.cot_out, b.cot_lse, **b.lib_kw)
    Hv = case.Hv or case.H
    lead = (case.B,) if case.batched else ()
    assert out.shape == (*lead, case.T, case.N, Hv) and out.dtype == jnp.float32
    assert lse.shape == (*lead, case.T, case.N) and lse.dtype == jnp.float32
    assert_no_nan(out, lse, *grads)
    q, k, v, cot_out, cot_lse = canon(case, b.q, b.k, b.v, b.cot_out, b.cot_lse)
    want_out, want_lse, want = oracle_vjp(q, k, v, b.bias, cot_out, cot_lse, **b.oracle_kw)
    out, lse = canon(case, out, lse)
    np.testing.assert_allclose(out, want_out, **FWD_TOL)
    np.testing.assert_allclose(lse, want_lse, **FWD_TOL)
    names = ("dq", "dk", "dv", "dbias")
    for name, g, w in zip(names, grads, want, strict=False):
        g = canon(case, g)[0] if name != "dbias" else np.asarray(g)
        assert g.shape == w.shape, name
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, rtol=GRAD_TOL["rtol"], atol=GRAD_TOL["atol"] * scale,
                                   err_msg=name)


@pytest.mark.parametrize("impl", list(IMPLS))
@feature_params
def test_gradients_match_float64_oracle(impl, case):
    """out and lse, and dq, dk, dv (and dbias) with random cotangents on both out and lse."""
    check_grads(IMPLS[impl], case, seed=11)


BIAS_SHAPES = [(2, 4, 16, 40), (1, 4, 16, 40), (2, 1, 16, 40), (2, 4, 1, 40),
               (2, 4, 16, 1), (1, 1, 1, 40), (4, 16, 40), (16, 40), (2, 1, 1, 1)]


@pytest.mark.parametrize("bias_shape", BIAS_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bias_gradient_broadcast_shapes(bias_shape):
    """dbias is reduced to the bias's own shape (GQA, causal, mask, soft cap)."""
    case = Case("bias", **WIDE, **BR, bias=bias_shape, mask=(2, 1, 16, 40), is_causal=True,
                soft_cap=6.0)
    check_grads(XLA, case, seed=12)


def test_gradients_without_residual():
    """The plain output path (no lse) has the same q/k/v/bias gradients as the oracle."""
    b = build(Case("plain", bias=(2, 4, 24, 24), is_causal=True, alibi="BN"), seed=13)
    args = (b.q, b.k, b.v, b.bias)
    got = jax.grad(lambda *a: jnp.sum(XLA(*a, **b.lib_kw)
                                      * b.cot_out), argnums=(0, 1, 2, 3))(*args)
    _, _, want = oracle_vjp(*args, b.cot_out, jnp.zeros_like(b.cot_lse), **b.oracle_kw)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **GRAD_TOL)


def test_lse_gradient_alone():
    """A cotangent on lse only: d lse / d logits = softmax (dropout does not touch it)."""
    b = build(Case("lse", bias=(1, 4, 24, 24), window=5, dropout=0.5, alibi="N"), seed=14)
    _, _, grads = lib_vjp(XLA, b.q, b.k, b.v, b.bias,
                          jnp.zeros_like(b.cot_out), b.cot_lse, **b.lib_kw)
    _, _, want = oracle_vjp(b.q, b.k, b.v, b.bias, np.zeros(b.cot_out.shape), b.cot_lse,
                            **b.oracle_kw)
    np.testing.assert_array_equal(grads[2], 0.0)  # v does not enter lse
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(g, w, **GRAD_TOL)


@pytest.mark.parametrize("qk_scale", [1.0, 100.0], ids=["normal_logits", "logits_1e4"])
def test_fully_masked_rows_zero_gradients(qk_scale):
    """Rows with no visible key: out 0, lse -inf, zero dq/dbias; unseen keys: zero dk/dv."""
    B, T, S, N, K, H = 2, 16, 40, 4, 2, 16
    ks = keys(15, 6)
    q = normal(ks[0], (B, T, N, H), qk_scale)
    k = normal(ks[1], (B, S, K, H), qk_scale)
    v = normal(ks[2], (B, S, K, H))
    bias = normal(ks[3], (B, N, T, S))
    mask = np.ones((B, N, T, S), bool)
    mask[0, :, 3] = False  # row 3 of batch 0: nothing visible, every head
    mask[1, 2, 7] = False  # one head of one row
    kw = dict(mask=jnp.asarray(mask), query_seq_lengths=jnp.array([16, 13], jnp.int32),
              key_value_seq_lengths=jnp.array([30, 40], jnp.int32), is_causal=True,
              causal_alignment="bottom_right")
    cot_out, cot_lse = normal(ks[4], (B, T, N, H)), normal(ks[5], (B, T, N))
    out, lse, (dq, dk, dv, db) = lib_vjp(XLA, q, k, v, bias,
                                         cot_out, cot_lse, **kw)
    assert_no_nan(out, lse, dq, dk, dv, db)
    if qk_scale > 1:
        logits = np.einsum("btnh,bsnh->bnts", np.asarray(q), np.repeat(np.asarray(k), 2, 2))
        assert np.abs(logits / 4).max() > 1e4  # scale = 1/sqrt(16)
    out, lse, dq, dk, dv, db = map(np.asarray, (out, lse, dq, dk, dv, db))
    assert np.all(out[0, 3] == 0) and np.all(lse[0, 3] == -np.inf) and np.all(dq[0, 3] == 0)
    assert np.all(db[0, :, 3] == 0)
    assert np.all(out[1, 7, 2] == 0) and lse[1, 7, 2] == -np.inf and np.all(db[1, 2, 7] == 0)
    assert np.all(out[1, 13:] == 0) and np.all(dq[1, 13:] == 0) and np.all(db[1, :, 13:] == 0)
    assert np.all(lse[1, 13:] == -np.inf)
    assert np.all(dk[0, 30:] == 0) and np.all(dv[0, 30:] == 0)  # keys past kv length
    assert np.all(db[0, ..., 30:] == 0)
    assert np.isfinite(lse[0, :3]).all() and np.isfinite(lse[1, :7]).all()
    # Visible rows still agree with float64 (loosely for logits ~1e4: float32 logits
    # carry an absolute error ~1e-3 there).
    vis_kw = {name: np.asarray(val) if hasattr(val, "shape") else val for name, val in kw.items()}
    want_out, want_lse, want = oracle_vjp(q, k, v, bias, cot_out, cot_lse, **vis_kw)
    tol = dict(rtol=2e-4, atol=2e-4) if qk_scale == 1 else dict(rtol=1e-2, atol=5e-2)
    np.testing.assert_allclose(out, want_out, **tol)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(
        want_lse[np.isfinite(want_lse)]).max()))
    if qk_scale == 1:
        for g, w in zip((dq, dk, dv, db), want, strict=True):
            np.testing.assert_allclose(g, w, **GRAD_TOL)


def test_extreme_bias_logits_stable():
    """Logits ~1e4 from the bias (no q.k precision loss): matches float64 tightly."""
    b = build(Case("xb", bias=(2, 4, 24, 24), mask=(2, 4, 24, 24), empty_rows=(2,)), seed=16)
    bias = b.bias * 3e3
    check = oracle_vjp(b.q, b.k, b.v, bias, b.cot_out, b.cot_lse, **b.oracle_kw)
    out, lse, grads = lib_vjp(XLA, b.q, b.k, b.v, bias, b.cot_out,
                              b.cot_lse, **b.lib_kw)
    assert_no_nan(out, lse, *grads)
    np.testing.assert_allclose(out, check[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(lse, check[1], rtol=1e-6)
    for g, w in zip(grads, check[2], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("extra", ["none", "bias", "alibi_causal", "mask"])
def test_huge_product_logits_stay_finite_under_jit(extra):
    """Logits ~4e9 from q.k (alone, or with a bias, ALiBi under causal masking, a mask):
    under jit, XLA:CPU must not fold the product into exp(logits - max) rounding apart
    from the max (exp of ulps of the logits would overflow): out, lse and the gradients
    equal the eager call's."""
    keys = jax.random.split(jax.random.key(23), 5)
    q, k = (jax.random.normal(x, (1, 64, 2, 32), jnp.float32) * 3e4 for x in keys[:2])
    v = jax.random.normal(keys[2], (1, 64, 2, 32), jnp.float32)
    ct = jax.random.normal(keys[3], v.shape, jnp.float32)
    kwargs = {"none": {}, "bias": dict(bias=jax.random.normal(keys[4], (1, 2, 64, 64)) * 1e3),
              "alibi_causal": dict(alibi_slopes=jnp.array([0.5, 2.0]), is_causal=True),
              "mask": dict(mask=jax.random.bernoulli(keys[4], 0.8, (1, 1, 64, 64)))}[extra]

    def loss(q, k, v):
        out, lse = XLA(q, k, v, return_residual=True, **kwargs)
        return jnp.sum(out * ct) + jnp.sum(lse) * 1e-9, (out, lse)

    step = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, jitted), jit_grads = jax.jit(step)(q, k, v)
    (_, eager), eager_grads = step(q, k, v)
    assert float(jnp.max(jnp.abs(jitted[1]))) > 1e9  # logits of that size
    for got, want in zip((*jitted, *jit_grads), (*eager, *eager_grads), strict=True):
        assert_no_nan(got)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# --------------------------------------------------------------------------------------
# 4. jit, vmap, grad; dropout determinism and statistics
# --------------------------------------------------------------------------------------

JIT_CASE = Case("jit", **WIDE, **BR, bias=(1, 4, 16, 40), mask=(2, 1, 16, 40), is_causal=True,
                window=(8, 2), alibi="BN", soft_cap=5.0, segments="cross", q_lengths=(16, 13),
                kv_lengths=(35, 40), dropout=0.2)


def _array_kwargs(lib_kw):
    arrays = {k: v for k, v in lib_kw.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in lib_kw.items() if k not in arrays}
    return arrays, static


@impl_params
def test_jit_matches_eager(impl):
    fn = IMPLS[impl]
    b = build(JIT_CASE, seed=20)
    arrays, static = _array_kwargs(b.lib_kw)

    @jax.jit
    def jitted(q, k, v, bias, arrays):
        return fn(q, k, v, bias, return_residual=True, **arrays, **static)

    out, lse = jitted(b.q, b.k, b.v, b.bias, arrays)
    want_out, want_lse = fn(b.q, b.k, b.v, b.bias, return_residual=True, **b.lib_kw)
    np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)


def test_grad_under_jit_matches_eager_and_oracle():
    b = build(JIT_CASE, seed=21)
    arrays, static = _array_kwargs(b.lib_kw)

    def loss(q, k, v, bias, arrays):
        out, lse = XLA(q, k, v, bias, return_residual=True,
                                                   **arrays, **static)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out * b.cot_out) + jnp.sum(lse * b.cot_lse)

    jit_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(b.q, b.k, b.v, b.bias, arrays)
    eager = jax.grad(loss, argnums=(0, 1, 2, 3))(b.q, b.k, b.v, b.bias, arrays)
    _, _, want = oracle_vjp(b.q, b.k, b.v, b.bias, b.cot_out, b.cot_lse, **b.oracle_kw)
    for g, e, w in zip(jit_grads, eager, want, strict=True):
        assert_no_nan(g)
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g, w, **GRAD_TOL)


def test_vmap_over_extra_leading_axis():
    """vmap over a leading axis of every array input equals a Python loop."""
    V = 3
    built = [build(JIT_CASE, seed=30 + i) for i in range(V)]
    stack = lambda xs: jnp.stack(list(xs))
    q, k, v, bias = (stack(getattr(b, n) for b in built) for n in ("q", "k", "v", "bias"))
    names, static = _array_kwargs(built[0].lib_kw)
    arrays = {n: stack(b.lib_kw[n] for b in built) for n in names if n != "dropout_rng"}
    rngs = stack(b.lib_kw["dropout_rng"] for b in built)

    def f(q, k, v, bias, arrays, rng):
        return XLA(q, k, v, bias, dropout_rng=rng,
                                               return_residual=True, **arrays, **static)

    out, lse = jax.jit(jax.vmap(f))(q, k, v, bias, arrays, rngs)
    for i, b in enumerate(built):
        want_out, want_lse = XLA(
            b.q, b.k, b.v, b.bias, return_residual=True, **b.lib_kw)
        np.testing.assert_allclose(out[i], want_out, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(lse[i], want_lse, rtol=1e-6, atol=1e-6)


def test_vmap_of_unbatched_layout_equals_batched_call():
    """vmap of [T, N, H] calls over the batch axis equals one [B, T, N, H] call."""
    b = build(Case("vm", bias=(2, 4, 24, 24), is_causal=True, alibi="N", window=3), seed=32)
    kw = {n: x for n, x in b.lib_kw.items()}
    slopes = kw.pop("alibi_slopes")
    f = lambda q, k, v, bias: XLA(q, k, v, bias, alibi_slopes=slopes,
                                                              return_residual=True, **kw)
    out, lse = jax.jit(jax.vmap(f))(b.q, b.k, b.v, b.bias)
    want_out, want_lse = f(b.q, b.k, b.v, b.bias)
    np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)


def test_grad_of_vmap():
    V = 2
    built = [build(Case("gv", bias=(1, 4, 24, 24), is_causal=True), seed=40 + i)
             for i in range(V)]
    q, k, v, bias, cot = (jnp.stack([getattr(b, n) for b in built])
                          for n in ("q", "k", "v", "bias", "cot_out"))
    f = functools.partial(XLA, is_causal=True)
    loss = lambda q, k, v, bias: jnp.sum(jax.vmap(f)(q, k, v, bias) * cot)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for i, b in enumerate(built):
        _, _, want = oracle_vjp(b.q, b.k, b.v, b.bias, b.cot_out, np.zeros(b.cot_lse.shape),
                                is_causal=True)
        for g, w in zip(grads, want, strict=True):
            np.testing.assert_allclose(g[i], w, **GRAD_TOL)


DROP_SHAPE = dict(batch=2, num_heads=4, q_len=48, kv_len=40)


def _dropout_inputs():
    ks = keys(50, 3)
    return normal(ks[0], (2, 16, 4, 16)), normal(ks[1], (2, 40, 2, 16)), normal(ks[2],
                                                                              (2, 40, 2, 16))


def _dropout_call(rng, rate=0.3, inputs=None, **kw):
    q, k, v = _dropout_inputs() if inputs is None else inputs
    return XLA(q, k, v, dropout_rate=rate, dropout_rng=rng, **kw)


def test_dropout_same_rng_identical_different_rng_different():
    a = _dropout_call(jax.random.key(1))
    b = _dropout_call(jax.random.key(1))
    c = _dropout_call(jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert np.mean(np.asarray(a) != np.asarray(c)) > 0.5
    ma = pallas_attn.dropout_keep_mask(jax.random.key(1), rate=0.3, **DROP_SHAPE)
    mc = pallas_attn.dropout_keep_mask(jax.random.key(2), rate=0.3, **DROP_SHAPE)
    np.testing.assert_array_equal(ma, pallas_attn.dropout_keep_mask(jax.random.key(1), rate=0.3,
                                                                    **DROP_SHAPE))
    assert 0.3 < np.mean(np.asarray(ma) != np.asarray(mc)) < 0.5  # ~ 2 * 0.3 * 0.7 = 0.42


def test_dropout_jit_matches_eager():
    rng = jax.random.key(3)
    eager = _dropout_call(rng, is_causal=True)
    inputs = _dropout_inputs()
    jitted = jax.jit(lambda r, x: _dropout_call(r, inputs=x, is_causal=True))(rng, inputs)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-6)


def test_dropout_rate_zero_is_identical_to_no_dropout():
    no_dropout = _dropout_call(None, rate=0.0)
    with_rng = _dropout_call(jax.random.key(4), rate=0.0)
    np.testing.assert_array_equal(with_rng, no_dropout)
    np.testing.assert_array_equal(
        pallas_attn.dropout_keep_mask(jax.random.key(4), rate=0.0, **DROP_SHAPE), True)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.85])
@pytest.mark.parametrize("broadcast", [False, True])
def test_dropout_keep_fraction_within_5_sigma(rate, broadcast):
    shape = dict(batch=2, num_heads=4, q_len=64, kv_len=64)
    mask = np.asarray(pallas_attn.dropout_keep_mask(jax.random.key(5), rate=rate,
                                                    broadcast_batch_heads=broadcast, **shape))
    assert mask.shape == (2, 4, 64, 64) and mask.dtype == np.bool_
    n = 64 * 64 if broadcast else mask.size  # a broadcast mask has 64*64 independent draws
    sigma = math.sqrt(rate * (1 - rate) / n)
    assert abs(mask.mean() - (1 - rate)) < 5 * sigma
    # Per query row too (64 draws each): no row is wildly off (8 sigma, many rows).
    row_sigma = math.sqrt(rate * (1 - rate) / 64)
    assert np.all(np.abs(mask.mean(-1) - (1 - rate)) < 8 * row_sigma)


def test_dropout_masks_differ_across_batch_and_heads_unless_broadcast():
    m = np.asarray(pallas_attn.dropout_keep_mask(jax.random.key(6), rate=0.5, **DROP_SHAPE))
    flat = m.reshape(8, -1)
    for a in range(8):
        for c in range(a + 1, 8):
            assert 0.35 < np.mean(flat[a] != flat[c]) < 0.65
    mb = np.asarray(pallas_attn.dropout_keep_mask(jax.random.key(6), rate=0.5,
                                                  broadcast_batch_heads=True, **DROP_SHAPE))
    assert np.all(mb == mb[:1, :1])


def test_dropout_mask_depends_only_on_indices():
    """keep(seed, b, n, i, j): a smaller problem sees the corner of a larger one's mask."""
    rng = jax.random.key(7)
    big = pallas_attn.dropout_keep_mask(rng, batch=2, num_heads=4, q_len=48, kv_len=48, rate=0.4)
    small = pallas_attn.dropout_keep_mask(rng, batch=2, num_heads=4, q_len=17, kv_len=33,
                                          rate=0.4)
    np.testing.assert_array_equal(small, big[:, :, :17, :33])


def test_dropout_broadcast_output_uses_shared_mask():
    """With broadcast_dropout every (b, n) uses mask[0, 0]; the oracle confirms the output."""
    case = Case("bd", dropout=0.5, broadcast_dropout=True)
    b = build(case, seed=60)
    out = XLA(b.q, b.k, b.v, **b.lib_kw)
    keep = pallas_attn.dropout_keep_mask(b.lib_kw["dropout_rng"], batch=1, num_heads=1, q_len=24,
                                         kv_len=24, rate=0.5)
    want, _ = oracle_forward(b.q, b.k, b.v, keep=np.asarray(keep), dropout_rate=0.5)
    np.testing.assert_allclose(out, want, **FWD_TOL)
    assert not np.allclose(out, XLA(
        b.q, b.k, b.v, dropout_rate=0.5, dropout_rng=b.lib_kw["dropout_rng"]))
