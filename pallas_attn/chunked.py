"""The memory-efficient CPU path: blockwise attention in jnp with lax loops.

`implementation="xla_chunked"`. Same contract and results as `reference.attention`
(out [B, T, N, Hv] in the query dtype, lse [B, N, T] float32, natural log, -inf and
output 0 for a row that sees no key, zero gradients there), but no [T, S] array is
ever built: the forward walks query tiles x key tiles with an online softmax in
float32 and saves only the output and the logsumexp; the backward (a
`jax.custom_vjp`) recomputes each tile's probabilities from the logsumexp.

Layout: query heads are grouped as [K, G] (G = N // K query heads per key/value
head), so GQA/MQA read each key/value tile once and never repeat K or V in memory.
Every tile holds all batch entries and heads: [B, K, G, block_q, block_k].

Semantics are not restated here: score modifiers and visibility come from
`kernels/scores.py` and the dropout decision from `dropout.py`, evaluated on the
tile's global row/column indices, so results do not depend on the tile sizes
(dropout included).

Backward, per key tile j (outer loop) and query tile i (inner loop):

    P   = exp(logits - lse)                    recomputed, 0 where invisible
    dP~ = dO V^T;  dP = dP~ * keep / (1 - rate)
    dS  = P * (dP - delta) * softcap'(logits)  delta = rowsum(dO * O) - dlse
    dV_j += P~^T dO;  dK_j += scale dS^T Q;  dQ_i += scale dS K   (dQ in a carried buffer)
    dbias += dS summed over the bias's broadcast dims;  dslope -= sum dS * |i + off - j|
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from pallas_attn import dropout as dropout_lib
from pallas_attn.kernels import scores
from pallas_attn.spec import AttentionSpec, Operands

# T * S at which the reference's [B, N, T, S] float32 intermediates (several of them,
# 16 MiB each per batch entry and head at this size) start to cost more than the
# loop overhead of the blockwise path.
PREFER_CHUNKED_ELEMENTS = 1 << 22

# Upper bound on the elements of one [B, K, G, block_q, block_k] tile (16 MiB of
# float32): query tiles shrink when many batch entries and heads share a tile.
_TILE_BUDGET = 1 << 22
_MIN_BLOCK = 8
_HIGHEST = lax.Precision.HIGHEST

# Non-differentiable operands, in the order the custom_vjp receives them.
_CONSTANTS = ("mask", "q_segment_ids", "kv_segment_ids", "query_seq_lengths",
              "key_value_seq_lengths", "dropout_seed")


def prefer_chunked(q_len: int, kv_len: int) -> bool:
    """Whether the blockwise path should be the CPU default for these lengths.

    True once T * S >= 2**22 (e.g. 2048 x 2048), where each of the reference's
    T x S float32 matrices reaches 16 MiB per batch entry and head.
    """
    return int(q_len) * int(kv_len) >= PREFER_CHUNKED_ELEMENTS


def choose_tiles(q_len: int, kv_len: int, batch_heads: int = 1) -> tuple[int, int]:
    """(block_q, block_k) by sequence length, like PyTorch's CPU flash attention.

    Query tiles of 32 / 64 / 128 rows for T < 192 / < 768 / longer; key tiles of
    256 for S < 1024, else 512; never longer than the sequence. When many batch
    entries and heads share a tile, block_q (then block_k) halves until a tile has
    at most 2**22 elements.
    """
    block_q = 32 if q_len < 192 else 64 if q_len < 768 else 128
    block_k = 256 if kv_len < 1024 else 512
    while batch_heads * block_q * block_k > _TILE_BUDGET and block_q > _MIN_BLOCK:
        block_q //= 2
    while batch_heads * block_q * block_k > _TILE_BUDGET and block_k > _MIN_BLOCK:
        block_k //= 2
    return min(block_q, q_len), min(block_k, kv_len)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static description of one call (hashable; the custom_vjp's nondiff argument)."""

    spec: AttentionSpec
    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    block_q: int
    block_k: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_q_tiles(self) -> int:
        return _cdiv(self.q_len, self.block_q)

    @property
    def num_k_tiles(self) -> int:
        return _cdiv(self.kv_len, self.block_k)

    @property
    def q_pad(self) -> int:
        return self.num_q_tiles * self.block_q

    @property
    def kv_pad(self) -> int:
        return self.num_k_tiles * self.block_k

    @property
    def offset(self) -> int:
        return self.spec.offset(self.q_len, self.kv_len)


def attention(spec: AttentionSpec, ops: Operands, *, block_q: int | None = None,
              block_k: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Canonical-layout attention: (out [B, T, N, Hv] in query dtype, lse [B, N, T] float32).

    block_q / block_k override the tiles of `choose_tiles` (results do not depend on them).
    """
    B, T, N, _ = ops.query.shape
    S, K = ops.key.shape[1], ops.key.shape[2]
    auto_q, auto_k = choose_tiles(T, S, B * N)
    block_q, block_k = block_q or auto_q, block_k or auto_k
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(block, int) or block <= 0:
            raise ValueError(f"{name} must be a positive int, got {block!r}")
    plan = _Plan(spec=spec, batch=B, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K,
                 block_q=min(block_q, T), block_k=min(block_k, S))
    constants = {name: getattr(ops, name) for name in _CONSTANTS
                 if getattr(ops, name) is not None}
    return _attention(plan, ops.query, ops.key, ops.value, ops.bias, ops.alibi_slopes,
                      constants)


# -- layout -------------------------------------------------------------------------


def _pad_axis(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _tile_rows(plan: _Plan, x: jax.Array) -> jax.Array:
    """[B, T, N, D] -> [nq, B, K, G, block_q, D] (padded)."""
    B, _, _, D = x.shape
    x = _pad_axis(x, 1, plan.q_pad)
    x = x.reshape(B, plan.num_q_tiles, plan.block_q, plan.num_kv_heads, plan.group, D)
    return x.transpose(1, 0, 3, 4, 2, 5)


def _untile_rows(plan: _Plan, x: jax.Array) -> jax.Array:
    """[nq, B, K, G, block_q, D] -> [B, T, N, D]."""
    D = x.shape[-1]
    x = x.transpose(1, 0, 4, 2, 3, 5).reshape(plan.batch, plan.q_pad, plan.num_heads, D)
    return x[:, :plan.q_len]


def _tile_stats(plan: _Plan, x: jax.Array) -> jax.Array:
    """[B, N, T] -> [nq, B, K, G, block_q] (padded)."""
    x = _pad_axis(x, 2, plan.q_pad)
    x = x.reshape(plan.batch, plan.num_kv_heads, plan.group, plan.num_q_tiles, plan.block_q)
    return x.transpose(3, 0, 1, 2, 4)


def _untile_stats(plan: _Plan, x: jax.Array) -> jax.Array:
    """[nq, B, K, G, block_q] -> [B, N, T]."""
    x = x.transpose(1, 2, 3, 0, 4).reshape(plan.batch, plan.num_heads, plan.q_pad)
    return x[:, :, :plan.q_len]


def _tile_keys(plan: _Plan, x: jax.Array) -> jax.Array:
    """[B, S, K, D] -> [nk, B, K, block_k, D] (padded)."""
    B, _, K, D = x.shape
    x = _pad_axis(x, 1, plan.kv_pad).reshape(B, plan.num_k_tiles, plan.block_k, K, D)
    return x.transpose(1, 0, 3, 2, 4)


def _untile_keys(plan: _Plan, x: jax.Array) -> jax.Array:
    """[nk, B, K, block_k, D] -> [B, S, K, D]."""
    _, B, K, _, D = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(B, plan.kv_pad, K, D)[:, :plan.kv_len]


def _pad_broadcast(plan: _Plan, x: jax.Array, value: Any) -> jax.Array:
    """Pads the full (non-broadcast) T and S dims of a [Bx, Nx, Tx, Sx] bias or mask."""
    if x.shape[2] > 1:
        x = _pad_axis(x, 2, plan.q_pad, value)
    if x.shape[3] > 1:
        x = _pad_axis(x, 3, plan.kv_pad, value)
    return x


def _heads(plan: _Plan, x: jax.Array) -> jax.Array:
    """[Bx, Nx, ...] -> [Bx, K, G, ...] (or [Bx, 1, 1, ...] when Nx = 1)."""
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], plan.num_kv_heads, plan.group, *x.shape[2:])


def _broadcast_tile(x: jax.Array, i: Any, j: Any, block_q: int, block_k: int) -> jax.Array:
    """The [Bx, Nx, block_q | 1, block_k | 1] tile (i, j) of a padded bias or mask."""
    if x.shape[2] > 1:
        x = lax.dynamic_slice_in_dim(x, i * block_q, block_q, axis=2)
    if x.shape[3] > 1:
        x = lax.dynamic_slice_in_dim(x, j * block_k, block_k, axis=3)
    return x


class _Tiles:
    """What every tile reads: padded broadcast inputs, slopes, lengths, dropout keys."""

    def __init__(self, plan: _Plan, bias: jax.Array | None, slopes: jax.Array | None,
                 constants: dict[str, jax.Array]):
        self.plan = plan
        spec = plan.spec
        self.bias = None if bias is None else _pad_broadcast(plan, bias, 0)
        mask = constants.get("mask")
        self.mask = None if mask is None else _pad_broadcast(plan, mask, False)
        self.slope = None if slopes is None else _heads(plan, slopes)[..., None, None]
        self.q_segments = self.kv_segments = None
        if "q_segment_ids" in constants:
            self.q_segments = _pad_axis(constants["q_segment_ids"], 1, plan.q_pad)
            self.kv_segments = _pad_axis(constants["kv_segment_ids"], 1, plan.kv_pad)
        self.q_lengths = constants.get("query_seq_lengths")
        self.kv_lengths = constants.get("key_value_seq_lengths")
        self.drop_keys = None
        if spec.has_dropout:
            seed = constants["dropout_seed"]
            if spec.broadcast_dropout:
                self.drop_keys = dropout_lib.program_key(seed, 0)
            else:
                batch_head = jnp.arange(plan.batch * plan.num_heads, dtype=jnp.int32)
                keys = dropout_lib.program_key(seed, batch_head)
                self.drop_keys = keys.reshape(plan.batch, plan.num_kv_heads, plan.group)

    # -- index ranges -----------------------------------------------------------------
    def key_tiles(self, i: Any) -> tuple[Any, Any]:
        """Key tiles [first, stop) that query tile i can see through causal/window/lengths."""
        p = self.plan
        kv_stop = p.kv_len
        if self.kv_lengths is not None:
            kv_stop = jnp.minimum(kv_stop, jnp.max(self.kv_lengths))
        q0 = i * p.block_q
        lo, hi = scores.key_range(q0, q0 + p.block_q, p.spec, p.offset, kv_stop)
        return self._span(lo, hi, p.block_k, p.num_k_tiles)

    def query_tiles(self, j: Any) -> tuple[Any, Any]:
        """Query tiles [first, stop) that can see some key of key tile j."""
        p = self.plan
        q_stop = p.q_len
        if self.q_lengths is not None:
            q_stop = jnp.minimum(q_stop, jnp.max(self.q_lengths))
        k0 = j * p.block_k
        lo, hi = scores.query_range(k0, k0 + p.block_k, p.spec, p.offset, q_stop)
        if self.kv_lengths is not None:  # keys all past every length: nothing to do
            hi = jnp.where(k0 < jnp.max(self.kv_lengths), hi, 0)
        return self._span(lo, hi, p.block_q, p.num_q_tiles)

    @staticmethod
    def _span(lo: Any, hi: Any, block: int, count: int) -> tuple[Any, Any]:
        lo = jnp.clip(jnp.asarray(lo, jnp.int32), 0, None)
        hi = jnp.maximum(jnp.asarray(hi, jnp.int32), lo)
        first = jnp.minimum(lo // block, count)
        return first, jnp.clip((hi + block - 1) // block, first, count)

    # -- one tile -----------------------------------------------------------------------
    def positions(self, i: Any, j: Any) -> tuple[jax.Array, jax.Array]:
        p = self.plan
        rows = i * p.block_q + lax.broadcasted_iota(jnp.int32, (p.block_q, 1), 0)
        cols = j * p.block_k + lax.broadcasted_iota(jnp.int32, (1, p.block_k), 1)
        return rows, cols

    def logits(self, q: jax.Array, k: jax.Array, i: Any, j: Any
               ) -> tuple[jax.Array, jax.Array | None]:
        """Float32 logits [B, K, G, bq, bk] after bias/ALiBi/soft cap, and visibility."""
        p = self.plan
        spec = p.spec
        s = jnp.einsum("bkgqh,bkth->bkgqt", q, k, precision=_HIGHEST) * spec.scale
        rows, cols = self.positions(i, j)
        bias = None
        if self.bias is not None:
            bias = _heads(p, _broadcast_tile(self.bias, i, j, p.block_q, p.block_k))
        logits = scores.modify_logits(s, rows, cols, spec, p.offset, bias=bias,
                                      alibi_slope=self.slope)
        mask = None
        if self.mask is not None:
            mask = _heads(p, _broadcast_tile(self.mask, i, j, p.block_q, p.block_k))
        q_seg = kv_seg = None
        if self.q_segments is not None:
            q_seg = lax.dynamic_slice_in_dim(self.q_segments, i * p.block_q, p.block_q, 1)
            kv_seg = lax.dynamic_slice_in_dim(self.kv_segments, j * p.block_k, p.block_k, 1)
            q_seg, kv_seg = q_seg[:, None, None, :, None], kv_seg[:, None, None, None, :]
        visible = scores.visibility(
            rows, cols, spec, p.offset,
            q_bound=p.q_len if p.q_pad != p.q_len else None,
            kv_bound=p.kv_len if p.kv_pad != p.kv_len else None,
            mask=mask, q_segments=q_seg, kv_segments=kv_seg,
            q_length=None if self.q_lengths is None
            else self.q_lengths[:, None, None, None, None],
            kv_length=None if self.kv_lengths is None
            else self.kv_lengths[:, None, None, None, None])
        return logits, visible

    def keep(self, i: Any, j: Any) -> jax.Array:
        """Dropout keep decisions of tile (i, j): [bq, bk] or [B, K, G, bq, bk]."""
        p = self.plan
        rows = i * p.block_q + lax.iota(jnp.int32, p.block_q)
        cols = j * p.block_k + lax.iota(jnp.int32, p.block_k)
        rate = p.spec.dropout_rate
        if p.spec.broadcast_dropout:
            return dropout_lib.keep(dropout_lib.row_keys(self.drop_keys, rows), cols, rate)
        row_keys = dropout_lib.row_keys(self.drop_keys[..., None], rows)  # [B, K, G, bq]
        keep = dropout_lib.keep(row_keys.reshape(-1), cols, rate)
        return keep.reshape(*row_keys.shape, p.block_k)


# -- forward ------------------------------------------------------------------------


def _forward(plan: _Plan, q, k, v, bias, slopes, constants):
    spec = plan.spec
    tiles = _Tiles(plan, bias, slopes, constants)
    q_t, k_t, v_t = _tile_rows(plan, q), _tile_keys(plan, k), _tile_keys(plan, v)
    B, K, G, Hv = plan.batch, plan.num_kv_heads, plan.group, v.shape[-1]
    inv_keep = 1.0 / (1.0 - spec.dropout_rate)

    def query_tile(i):
        q_i = q_t[i].astype(jnp.float32)

        def key_tile(j, carry):
            m, l, acc = carry
            logits, visible = tiles.logits(q_i, k_t[j].astype(jnp.float32), i, j)
            if visible is not None:
                logits = jnp.where(visible, logits, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(logits - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            l = alpha * l + jnp.sum(p, axis=-1)
            if spec.has_dropout:
                p = jnp.where(tiles.keep(i, j), p * inv_keep, 0.0)
            pv = jnp.einsum("bkgqt,bktd->bkgqd", p, v_t[j].astype(jnp.float32),
                            precision=_HIGHEST)
            return m_new, l, alpha[..., None] * acc + pv

        shape = (B, K, G, plan.block_q)
        init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros((*shape, Hv), jnp.float32))
        first, stop = tiles.key_tiles(i)
        m, l, acc = lax.fori_loop(first, stop, key_tile, init)
        seen = l > 0.0
        l_safe = jnp.where(seen, l, 1.0)
        out = (acc / l_safe[..., None]).astype(q.dtype)
        lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)
        return out, lse

    out_t, lse_t = lax.map(query_tile, jnp.arange(plan.num_q_tiles, dtype=jnp.int32))
    return _untile_rows(plan, out_t), _untile_stats(plan, lse_t)


# -- backward -----------------------------------------------------------------------


def _reduce_to_bias(plan: _Plan, ds: jax.Array, bias_shape: tuple[int, ...]) -> jax.Array:
    """[B, K, G, bq, bk] -> [Bb, Nb, bq | 1, bk | 1]: sum over the bias's broadcast dims."""
    Bb, Nb, Tb, Sb = bias_shape
    if Bb == 1:
        ds = jnp.sum(ds, axis=0, keepdims=True)
    if Nb == 1:
        ds = jnp.sum(ds, axis=(1, 2), keepdims=True)
    ds = ds.reshape(ds.shape[0], ds.shape[1] * ds.shape[2], *ds.shape[3:])
    if Tb == 1:
        ds = jnp.sum(ds, axis=2, keepdims=True)
    if Sb == 1:
        ds = jnp.sum(ds, axis=3, keepdims=True)
    return ds


def _backward(plan: _Plan, q, k, v, bias, slopes, constants, out, lse, d_out, d_lse,
              bias_grad: bool, slope_grad: bool):
    spec = plan.spec
    tiles = _Tiles(plan, bias, slopes, constants)
    q_t, k_t, v_t = _tile_rows(plan, q), _tile_keys(plan, k), _tile_keys(plan, v)
    do_t = _tile_rows(plan, d_out)
    o_t = _tile_rows(plan, out)
    # delta = rowsum(dO * O) - dlse; rows with lse = -inf see nothing: P = exp(s - inf) = 0.
    delta = jnp.sum(do_t.astype(jnp.float32) * o_t.astype(jnp.float32), axis=-1)
    dead = jnp.isneginf(lse)
    if d_lse is not None:
        delta = delta - _tile_stats(plan, jnp.where(dead, 0.0, d_lse.astype(jnp.float32)))
    lse_t = _tile_stats(plan, jnp.where(dead, jnp.inf, lse))
    inv_keep = 1.0 / (1.0 - spec.dropout_rate)
    B, K, G, H = plan.batch, plan.num_kv_heads, plan.group, q.shape[-1]
    bq, bk = plan.block_q, plan.block_k

    def key_tile(carry, j):
        dq, dbias, dslope = carry
        k_j = k_t[j].astype(jnp.float32)
        v_j = v_t[j].astype(jnp.float32)

        def query_tile(i, carry):
            dk, dv, dq, dbias, dslope = carry
            q_i = q_t[i].astype(jnp.float32)
            do_i = do_t[i].astype(jnp.float32)
            logits, visible = tiles.logits(q_i, k_j, i, j)
            s = logits if visible is None else jnp.where(visible, logits, -jnp.inf)
            p = jnp.exp(s - lse_t[i][..., None])
            dp = jnp.einsum("bkgqd,bktd->bkgqt", do_i, v_j, precision=_HIGHEST)
            p_dropped = p
            if spec.has_dropout:
                keep = tiles.keep(i, j)
                p_dropped = jnp.where(keep, p * inv_keep, 0.0)
                dp = jnp.where(keep, dp * inv_keep, 0.0)
            ds = p * (dp - delta[i][..., None])
            if spec.logits_soft_cap is not None:
                ds = ds * scores.soft_cap_derivative(logits, spec.logits_soft_cap)
            dv = dv + jnp.einsum("bkgqt,bkgqd->bktd", p_dropped, do_i, precision=_HIGHEST)
            dk = dk + jnp.einsum("bkgqt,bkgqh->bkth", ds, q_i, precision=_HIGHEST)
            dq_i = dq[i] + jnp.einsum("bkgqt,bkth->bkgqh", ds, k_j, precision=_HIGHEST)
            dq = lax.dynamic_update_index_in_dim(dq, dq_i, i, 0)
            if bias_grad:
                tile = _reduce_to_bias(plan, ds, spec.bias_shape)
                start = (0, 0, i * bq if tile.shape[2] > 1 else 0,
                         j * bk if tile.shape[3] > 1 else 0)
                tile = tile + lax.dynamic_slice(dbias, start, tile.shape)
                dbias = lax.dynamic_update_slice(dbias, tile, start)
            if slope_grad:
                rows, cols = tiles.positions(i, j)
                distance = scores.alibi_bias(1.0, rows, cols, plan.offset)  # -|i + off - j|
                dslope = dslope + jnp.sum(ds * distance, axis=(-2, -1))
            return dk, dv, dq, dbias, dslope

        init = (jnp.zeros((B, K, bk, H), jnp.float32),
                jnp.zeros((B, K, bk, v.shape[-1]), jnp.float32), dq, dbias, dslope)
        first, stop = tiles.query_tiles(j)
        dk, dv, dq, dbias, dslope = lax.fori_loop(first, stop, query_tile, init)
        return (dq, dbias, dslope), (dk * spec.scale, dv)

    dq = jnp.zeros((plan.num_q_tiles, B, K, G, bq, H), jnp.float32)
    dbias = dslope = jnp.zeros((), jnp.float32)
    if bias_grad:
        dbias = jnp.zeros(tiles.bias.shape, jnp.float32)
    if slope_grad:
        dslope = jnp.zeros((B, K, G), jnp.float32)
    (dq, dbias, dslope), (dk, dv) = lax.scan(
        key_tile, (dq, dbias, dslope), jnp.arange(plan.num_k_tiles, dtype=jnp.int32))
    dq = _untile_rows(plan, dq * spec.scale).astype(q.dtype)
    dk = _untile_keys(plan, dk).astype(k.dtype)
    dv = _untile_keys(plan, dv).astype(v.dtype)
    if bias_grad:
        Tb, Sb = spec.bias_shape[2:]
        dbias = dbias[:, :, :Tb, :Sb].astype(bias.dtype)
    else:
        dbias = None
    dslope = dslope.reshape(B, plan.num_heads).astype(slopes.dtype) if slope_grad else None
    return dq, dk, dv, dbias, dslope


# -- custom_vjp glue ----------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan: _Plan, q, k, v, bias, slopes, constants):
    return _forward(plan, q, k, v, bias, slopes, constants)


def _value(x):
    return jax.tree.map(lambda leaf: leaf.value, x,
                        is_leaf=lambda leaf: hasattr(leaf, "perturbed"))


def _perturbed(x) -> bool:
    return any(leaf.perturbed for leaf in jax.tree.leaves(
        x, is_leaf=lambda leaf: hasattr(leaf, "perturbed")))


def _attention_fwd(plan: _Plan, q, k, v, bias, slopes, constants):
    # The pytree structure of `needs` carries the static "which optional gradients".
    needs = {name: () for name, x in (("bias", bias), ("slopes", slopes)) if _perturbed(x)}
    q, k, v, bias, slopes, constants = (_value(x) for x in (q, k, v, bias, slopes, constants))
    out, lse = _forward(plan, q, k, v, bias, slopes, constants)
    return (out, lse), (q, k, v, bias, slopes, constants, out, lse, needs)


def _zero_cotangent(x: jax.Array) -> jax.Array:
    return jnp.zeros(x.shape, jax.dtypes.float0)


def _attention_bwd(plan: _Plan, residuals, cotangents):
    q, k, v, bias, slopes, constants, out, lse, needs = residuals
    d_out, d_lse = cotangents
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(out.shape, out.dtype)
    if isinstance(d_lse, SymbolicZero):
        d_lse = None
    dq, dk, dv, dbias, dslope = _backward(
        plan, q, k, v, bias, slopes, constants, out, lse, d_out, d_lse,
        bias_grad="bias" in needs, slope_grad="slopes" in needs)
    if bias is not None and dbias is None:
        dbias = jnp.zeros_like(bias)
    if slopes is not None and dslope is None:
        dslope = jnp.zeros_like(slopes)
    return dq, dk, dv, dbias, dslope, jax.tree.map(_zero_cotangent, constants)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
