"""The memory-efficient CPU path: blockwise attention in jnp with lax loops.

`implementation="xla_chunked"`. Same contract and results as `reference.attention`
(out [B, T, N, Hv] in the query dtype, lse [B, N, T] float32, natural log, -inf and
output 0 for a row that sees no key, zero gradients there), but no [T, S] array is
ever built: the forward walks query tiles x key tiles with an online softmax in
float32 and saves only the output and two per-row statistics, the row maximum m
and ln(row sum) (lse = m + ln(sum) would lose the sum for rows of logits near
-1e7 and below); the backward (a `jax.custom_vjp`) recomputes each tile's
probabilities from them.

Supported: everything the spec has (bias of any broadcast shape with its gradient,
boolean mask, causal in both alignments, local window, ALiBi with slope gradients,
soft cap, segment ids, sequence lengths, GQA/MQA, Hv != H, dropout, any lengths).

Loops, outermost first:

* chunks: groups of (batch entry, key/value head) pairs, as many as keep one
  [chunk, G, block_q, block_k] tile near TILE_ELEMENTS (`choose_chunk`);
* query tiles (forward) or key tiles (backward);
* key tiles (forward, online softmax) or query tiles (backward).

GQA/MQA: query heads are grouped as [K, G] (G = N // K), so the G query heads of a
key/value head share every K/V tile and K/V are never repeated in memory.

Semantics are not restated here: score modifiers and visibility come from
`scores.py` and the dropout decision from `dropout.py`, evaluated on the
tile's global (b, n, i, j) indices, so results do not depend on tiles or chunks
(dropout included).

Backward, per key tile j (outer loop) and query tile i (inner loop):

    P   = exp(logits - m - ln(sum))            recomputed, 0 where invisible
    dP~ = dO V^T;  dP = dP~ * keep / (1 - rate)
    dS  = P * (dP - delta) * softcap'(logits)  delta = rowsum(dO * O) - dlse
    dV_j += P~^T dO;  dK_j += scale dS^T Q;  dQ_i += scale dS K   (dQ in a carried buffer)
    dbias += dS summed over the bias's broadcast dims;  dslope -= sum dS * |i + off - j|

Memory: residuals are q, k, v, the optional inputs, out and the row stats (O(T)); the loops
hold a few [chunk, G, block_q, block_k] tiles and O(T) accumulators. Ragged lengths
are padded to tile multiples for q, k, v and the segment ids (O(T) copies); a bias
or mask with a full T or S dim is never copied: ragged edge tiles are read (and the
bias gradient written) through a clamped window.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from pallas_attn.primals import first_order_only, is_perturbed, primal_values
from pallas_attn.semantics import dropout as dropout_lib
from pallas_attn.semantics import reference, scores
from pallas_attn.spec import AttentionSpec, Operands

# Elements of one [chunk, G, block_q, block_k] float32 tile (512 KiB). Large enough
# that XLA splits each tile's elementwise work across cores (smaller tiles ran on one
# core of two), small enough to stay near the cache; measured on a 2-core x86 VM,
# 256 x 512 tiles of one head beat 64 x 512 ones by ~1.5x in wall time and 64 x 512
# tiles of four heads by ~1.1x (benchmarks/CPU_RESULTS.md).
TILE_ELEMENTS = 1 << 17
_MIN_BLOCK_Q = 8
_HIGHEST = lax.Precision.HIGHEST

# Non-differentiable operands, in the order the custom_vjp receives them.
_CONSTANTS = ("mask", "q_segment_ids", "kv_segment_ids", "query_seq_lengths",
              "key_value_seq_lengths", "dropout_keys", "origin")


def choose_tiles(q_len: int, kv_len: int, group: int = 1) -> tuple[int, int]:
    """(block_q, block_k) by sequence length, like PyTorch's CPU flash attention.

    Query tiles of 32 / 64 / 256 rows for T < 192 / < 768 / longer and key tiles of
    512, then block_q halves (down to 8) until the `group` query heads sharing a
    key/value head fit TILE_ELEMENTS per tile (G = 8: 32 x 512). Never longer than
    the sequence.
    """
    block_q = 32 if q_len < 192 else 64 if q_len < 768 else 256
    block_k = 512
    while group * block_q * block_k > TILE_ELEMENTS and block_q > _MIN_BLOCK_Q:
        block_q //= 2
    return min(block_q, q_len), min(block_k, kv_len)


def choose_chunk(batch: int, kv_heads: int, tile_elements: int) -> tuple[int, int]:
    """(batch entries, key/value heads) processed together in one tile.

    The largest group with chunk * tile_elements <= TILE_ELEMENTS (at least one
    head), taken as a divisor of K within one batch entry, or all K heads of a
    divisor of B entries, so every chunk is a contiguous slice of every input.
    """
    best, best_size = (1, 1), 1
    candidates = [(1, h) for h in range(1, kv_heads + 1) if kv_heads % h == 0]
    candidates += [(b, kv_heads) for b in range(2, batch + 1) if batch % b == 0]
    for chunk_batch, chunk_heads in candidates:
        size = chunk_batch * chunk_heads
        if size * tile_elements <= TILE_ELEMENTS and size > best_size:
            best, best_size = (chunk_batch, chunk_heads), size
    return best


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static description of one call (hashable; the custom_vjp's nondiff argument).

    A chunk is chunk_batch batch entries x chunk_heads key/value heads (with their
    G query heads each); chunk c covers batch entries from (c // (K / chunk_heads)) *
    chunk_batch and key/value heads from (c % (K / chunk_heads)) * chunk_heads.
    """

    spec: AttentionSpec
    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    block_q: int
    block_k: int
    chunk_batch: int
    chunk_heads: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def batch_chunks(self) -> int:
        return self.batch // self.chunk_batch

    @property
    def head_chunks(self) -> int:
        return self.num_kv_heads // self.chunk_heads

    @property
    def num_chunks(self) -> int:
        return self.batch_chunks * self.head_chunks

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

    def tile_shape(self) -> tuple[int, int, int]:
        """[chunk_batch, chunk_heads, G] leading dims of every tile."""
        return self.chunk_batch, self.chunk_heads, self.group


def attention(spec: AttentionSpec, ops: Operands, *, block_q: int | None = None,
              block_k: int | None = None, chunk: tuple[int, int] | None = None
              ) -> tuple[jax.Array, jax.Array]:
    """Canonical-layout attention: (out [B, T, N, Hv] in query dtype, lse [B, N, T] float32).

    block_q / block_k override `choose_tiles` and chunk = (batch entries, key/value
    heads) overrides `choose_chunk` (chunk[0] > 1 needs chunk[1] = K). Results do not
    depend on them beyond float rounding.
    """
    plan = _plan(spec, ops, block_q, block_k, chunk)
    ops, constants = _hide(ops)
    # Through jit: shard_map outside jit takes no custom_vjp with symbolic zeros.
    out, lse = jax.jit(_attention, static_argnums=0)(plan, ops.query, ops.key, ops.value,
                                                     ops.bias, ops.alibi_slopes, ops.sinks,
                                                     constants)
    return reference.hide_rows_past(out, ops), lse


def gradients(spec: AttentionSpec, ops: Operands, out: jax.Array, lse: jax.Array,
              d_out: jax.Array, d_lse: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) of a call whose keys are one block of a larger softmax (ring
    attention): out [B, T, N, Hv] and lse [B, N, T] are the whole softmax's, d_out and
    d_lse their cotangents. No bias; ALiBi slopes are constants."""
    if ops.bias is not None:
        raise AssertionError("chunked.gradients takes no bias")
    plan = _plan(spec, ops, None, None, None)
    ops, constants = _hide(ops)
    row_stats = (jnp.where(lse == -jnp.inf, jnp.inf, lse), jnp.zeros_like(lse))
    dq, dk, dv, _, _ = _backward(plan, ops.query, ops.key, ops.value, None, ops.alibi_slopes,
                                 constants, out, row_stats, d_out, d_lse,
                                 bias_grad=False, slope_grad=False)
    return dq, dk, dv


def _hide(ops: Operands) -> tuple[Operands, dict[str, jax.Array]]:
    """The operands with positions past the lengths and non-finite keys and values
    zeroed (`reference.hide_past_lengths`, `reference.nonfinite_keys`), and the tiles'
    constants, which flag the non-finite keys."""
    ops = reference.hide_past_lengths(ops)
    key, value, poison = reference.nonfinite_keys(ops.key, ops.value)
    ops = ops._replace(key=key, value=value)
    constants = {name: getattr(ops, name) for name in _CONSTANTS
                 if getattr(ops, name) is not None}
    return ops, {**constants, "nonfinite_keys": poison}


def _plan(spec: AttentionSpec, ops: Operands, block_q: int | None, block_k: int | None,
          chunk: tuple[int, int] | None) -> _Plan:
    B, T, N, _ = ops.query.shape
    S, K = ops.key.shape[1], ops.key.shape[2]
    auto_q, auto_k = choose_tiles(T, S, N // K)
    block_q = auto_q if block_q is None else block_q
    block_k = auto_k if block_k is None else block_k
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
            raise ValueError(f"{name} must be a positive int, got {block!r}")
    block_q, block_k = min(block_q, T), min(block_k, S)
    if chunk is None:
        chunk = choose_chunk(B, K, (N // K) * block_q * block_k)
    if not (isinstance(chunk, tuple) and len(chunk) == 2
            and all(isinstance(c, int) for c in chunk)):
        raise ValueError(f"chunk must be a (batch entries, kv heads) pair of ints, got {chunk!r}")
    chunk_batch, chunk_heads = chunk
    if (min(chunk) <= 0 or B % chunk_batch or K % chunk_heads
            or (chunk_batch > 1 and chunk_heads != K)):
        raise ValueError(f"chunk must be (batch entries, kv heads) dividing (B, K) = "
                         f"({B}, {K}), with all K heads when batch entries > 1; got {chunk}")
    return _Plan(spec=spec, batch=B, q_len=T, kv_len=S, num_heads=N, num_kv_heads=K,
                 block_q=block_q, block_k=block_k, chunk_batch=chunk_batch,
                 chunk_heads=chunk_heads)


# -- layout: [chunk, tile, ...] views of q, k, v, out, lse ------------------------------


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _split_rows(p: _Plan, x: jax.Array) -> jax.Array:
    """[B, T, N, D] -> [chunks, nq, chunk_batch, chunk_heads, G, block_q, D] (padded)."""
    D = x.shape[-1]
    x = _pad_axis(x, 1, p.q_pad).reshape(p.batch_chunks, p.chunk_batch, p.num_q_tiles,
                                         p.block_q, p.head_chunks, p.chunk_heads, p.group, D)
    x = x.transpose(0, 4, 2, 1, 5, 6, 3, 7)
    return x.reshape(p.num_chunks, p.num_q_tiles, *p.tile_shape(), p.block_q, D)


def _merge_rows(p: _Plan, x: jax.Array) -> jax.Array:
    """Inverse of _split_rows: -> [B, T, N, D]."""
    D = x.shape[-1]
    x = x.reshape(p.batch_chunks, p.head_chunks, p.num_q_tiles, *p.tile_shape(), p.block_q, D)
    x = x.transpose(0, 3, 2, 6, 1, 4, 5, 7).reshape(p.batch, p.q_pad, p.num_heads, D)
    return x[:, :p.q_len]


def _split_stats(p: _Plan, x: jax.Array) -> jax.Array:
    """[B, N, T] -> [chunks, nq, chunk_batch, chunk_heads, G, block_q] (padded)."""
    x = _pad_axis(x, 2, p.q_pad).reshape(p.batch_chunks, p.chunk_batch, p.head_chunks,
                                         p.chunk_heads, p.group, p.num_q_tiles, p.block_q)
    x = x.transpose(0, 2, 5, 1, 3, 4, 6)
    return x.reshape(p.num_chunks, p.num_q_tiles, *p.tile_shape(), p.block_q)


def _merge_stats(p: _Plan, x: jax.Array) -> jax.Array:
    """Inverse of _split_stats: -> [B, N, T]."""
    x = x.reshape(p.batch_chunks, p.head_chunks, p.num_q_tiles, *p.tile_shape(), p.block_q)
    x = x.transpose(0, 3, 1, 4, 5, 2, 6).reshape(p.batch, p.num_heads, p.q_pad)
    return x[:, :, :p.q_len]


def _split_keys(p: _Plan, x: jax.Array) -> jax.Array:
    """[B, S, K, D] -> [chunks, nk, chunk_batch, chunk_heads, block_k, D] (padded)."""
    D = x.shape[-1]
    x = _pad_axis(x, 1, p.kv_pad).reshape(p.batch_chunks, p.chunk_batch, p.num_k_tiles,
                                          p.block_k, p.head_chunks, p.chunk_heads, D)
    x = x.transpose(0, 4, 2, 1, 5, 3, 6)
    return x.reshape(p.num_chunks, p.num_k_tiles, p.chunk_batch, p.chunk_heads, p.block_k, D)


def _merge_keys(p: _Plan, x: jax.Array) -> jax.Array:
    """Inverse of _split_keys: -> [B, S, K, D]."""
    D = x.shape[-1]
    x = x.reshape(p.batch_chunks, p.head_chunks, p.num_k_tiles, p.chunk_batch, p.chunk_heads,
                  p.block_k, D)
    x = x.transpose(0, 3, 2, 5, 1, 4, 6).reshape(p.batch, p.kv_pad, p.num_kv_heads, D)
    return x[:, :p.kv_len]


# -- windows into broadcast [Bx, Nx, Tx, Sx] inputs (bias, mask, bias gradient) ---------


def _window(x: jax.Array, starts: tuple, sizes: tuple) -> tuple[jax.Array, tuple, tuple]:
    """dynamic_slice with the start clamped in bounds; returns (slice, starts, shifts).

    A tile that runs past a ragged end is read shifted back by `shift` rows/columns.
    """
    clamped, shifts = [], []
    for start, size, dim in zip(starts, sizes, x.shape, strict=True):
        start = jnp.asarray(start, jnp.int32)  # Python ints too (int64 under x64)
        if dim % size:
            start_in = jnp.minimum(start, dim - size)
            clamped.append(start_in)
            shifts.append(start - start_in)
        else:
            clamped.append(start)
            shifts.append(None)
    return lax.dynamic_slice(x, clamped, sizes), tuple(clamped), tuple(shifts)


def _read_tile(x: jax.Array, starts: tuple, sizes: tuple) -> jax.Array:
    """The tile at `starts`; past a ragged end it holds other (finite) entries, which
    the visibility bounds mask."""
    tile, _, shifts = _window(x, starts, sizes)
    for axis, shift in enumerate(shifts):
        if shift is not None:
            tile = jnp.roll(tile, -shift, axis=axis)
    return tile


def _add_tile(x: jax.Array, tile: jax.Array, starts: tuple) -> jax.Array:
    """x with `tile` added at `starts`. Entries of the tile past a ragged end must be 0
    (score gradients of masked entries are): they wrap onto rows already written."""
    window, clamped, shifts = _window(x, starts, tile.shape)
    for axis, shift in enumerate(shifts):
        if shift is not None:
            tile = jnp.roll(tile, shift, axis=axis)
    return lax.dynamic_update_slice(x, window + tile, clamped)


# -- tiles --------------------------------------------------------------------------


class _Tiles:
    """What chunk c's tiles read: bias, mask, slopes, segments, lengths, dropout keys."""

    def __init__(self, p: _Plan, c: Any, bias: jax.Array | None, slopes: jax.Array | None,
                 constants: dict[str, jax.Array]):
        self.plan = p
        self.batch0 = (c // p.head_chunks) * p.chunk_batch
        self.head0 = (c % p.head_chunks) * p.chunk_heads * p.group  # first query head
        mb, kb, G = p.tile_shape()
        self.bias = bias
        self.mask = constants.get("mask")
        self.slope = None
        if slopes is not None:
            slope = lax.dynamic_slice(slopes, (self.batch0, self.head0), (mb, kb * G))
            self.slope = slope.reshape(mb, kb, G, 1, 1)
        self.q_segments = self.kv_segments = None
        if "q_segment_ids" in constants:
            self.q_segments = self._batch_rows(_pad_axis(constants["q_segment_ids"], 1, p.q_pad))
            self.kv_segments = self._batch_rows(
                _pad_axis(constants["kv_segment_ids"], 1, p.kv_pad))
        # Tiles count positions from 0: an origin moves into the offset and the lengths.
        self.origin = constants.get("origin")
        q0, k0 = (0, 0) if self.origin is None else (self.origin[0], self.origin[1])
        self.offset = p.offset if self.origin is None else p.offset + (q0 - k0)
        self.q_lengths = self.kv_lengths = None
        if "query_seq_lengths" in constants:
            self.q_lengths = self._batch_rows(constants["query_seq_lengths"]) - q0
        if "key_value_seq_lengths" in constants:
            self.kv_lengths = self._batch_rows(constants["key_value_seq_lengths"]) - k0
        poison = _pad_axis(constants["nonfinite_keys"], 2, p.kv_pad)
        self.nonfinite_keys = lax.dynamic_slice(
            poison, (self.batch0, self.head0 // p.group, jnp.int32(0)),  # int32 under x64 too
            (mb, kb, p.kv_pad))
        self.drop_keys = None
        if p.spec.has_dropout:
            keys = constants["dropout_keys"]
            if p.spec.broadcast_dropout:
                self.drop_keys = keys[0, 0]
            else:
                keys = lax.dynamic_slice(keys, (self.batch0, self.head0), (mb, kb * G))
                self.drop_keys = keys.reshape(mb, kb, G)

    def head_rows(self, x: jax.Array) -> jax.Array:
        """This chunk's entries of a per-head [N] array, shaped [1, kb, G, 1] for tiles."""
        p = self.plan
        heads = lax.dynamic_slice_in_dim(x, self.head0, p.chunk_heads * p.group)
        return heads.reshape(1, p.chunk_heads, p.group, 1)

    def _batch_rows(self, x: jax.Array) -> jax.Array:
        """Rows batch0 .. batch0 + chunk_batch of a [B, ...] array."""
        return lax.dynamic_slice_in_dim(x, self.batch0, self.plan.chunk_batch, 0)

    # -- index ranges -----------------------------------------------------------------
    def key_tiles(self, i: Any) -> tuple[Any, Any]:
        """Key tiles [first, stop) that query tile i can see through causal/window/lengths."""
        p = self.plan
        kv_stop = p.kv_len
        if self.kv_lengths is not None:
            kv_stop = jnp.minimum(kv_stop, jnp.max(self.kv_lengths))
        q0 = i * p.block_q
        lo, hi = scores.key_range(q0, q0 + p.block_q, p.spec, self.offset, kv_stop)
        return self._span(lo, hi, p.block_k, p.num_k_tiles)

    def query_tiles(self, j: Any) -> tuple[Any, Any]:
        """Query tiles [first, stop) that can see some key of key tile j."""
        p = self.plan
        q_stop = p.q_len
        if self.q_lengths is not None:
            q_stop = jnp.minimum(q_stop, jnp.max(self.q_lengths))
        k0 = j * p.block_k
        lo, hi = scores.query_range(k0, k0 + p.block_k, p.spec, self.offset, q_stop)
        if self.kv_lengths is not None:  # keys all past every length: nothing to do
            hi = jnp.where(k0 < jnp.max(self.kv_lengths), hi, 0)
        return self._span(lo, hi, p.block_q, p.num_q_tiles)

    @staticmethod
    def _span(lo: Any, hi: Any, block: int, count: int) -> tuple[Any, Any]:
        lo = jnp.maximum(jnp.asarray(lo, jnp.int32), 0)
        hi = jnp.maximum(jnp.asarray(hi, jnp.int32), lo)
        first = jnp.minimum(lo // block, count)
        return first, jnp.clip((hi + block - 1) // block, first, count)

    # -- one tile -----------------------------------------------------------------------
    def positions(self, i: Any, j: Any) -> tuple[jax.Array, jax.Array]:
        p = self.plan
        rows = i * p.block_q + lax.broadcasted_iota(jnp.int32, (p.block_q, 1), 0)
        cols = j * p.block_k + lax.broadcasted_iota(jnp.int32, (1, p.block_k), 1)
        return rows, cols

    def broadcast_window(self, shape: tuple[int, ...], i: Any, j: Any) -> tuple[tuple, tuple]:
        """(starts, sizes) of tile (i, j) of this chunk in a [Bx, Nx, Tx, Sx] input."""
        p = self.plan
        mb, kb, G = p.tile_shape()
        starts = (self.batch0, self.head0, i * p.block_q, j * p.block_k)
        sizes = (mb, kb * G, p.block_q, p.block_k)
        return (tuple(s if d > 1 else 0 for s, d in zip(starts, shape, strict=True)),
                tuple(z if d > 1 else 1 for z, d in zip(sizes, shape, strict=True)))

    def _broadcast_tile(self, x: jax.Array, i: Any, j: Any) -> jax.Array:
        """[mb | 1, kb | 1, G | 1, bq | 1, bk | 1] tile of a bias or mask."""
        starts, sizes = self.broadcast_window(x.shape, i, j)
        tile = _read_tile(x, starts, sizes)
        if tile.shape[1] == 1:
            return tile[:, :, None]
        return tile.reshape(tile.shape[0], self.plan.chunk_heads, self.plan.group,
                            *tile.shape[2:])

    def logits(self, q: jax.Array, k_t: jax.Array, i: Any, j: Any
               ) -> tuple[jax.Array, jax.Array | None]:
        """Float32 logits [mb, kb, G, bq, bk] after bias/ALiBi/soft cap, and visibility.

        q [mb, kb, G, bq, H]; k_t [mb, kb, H, bk] (the key tile transposed).
        """
        p = self.plan
        spec = p.spec
        s = jnp.einsum("bkgqh,bkht->bkgqt", q, k_t, precision=_HIGHEST) * spec.scale
        poison = lax.dynamic_slice_in_dim(self.nonfinite_keys, j * p.block_k, p.block_k, 2)
        s = reference.with_nonfinite_keys(s, poison[:, :, None, None, :])
        rows, cols = self.positions(i, j)
        bias = None if self.bias is None else self._broadcast_tile(self.bias, i, j)
        mask = None if self.mask is None else self._broadcast_tile(self.mask, i, j)
        q_seg = kv_seg = None
        if self.q_segments is not None:
            q_seg = lax.dynamic_slice_in_dim(self.q_segments, i * p.block_q, p.block_q, 1)
            kv_seg = lax.dynamic_slice_in_dim(self.kv_segments, j * p.block_k, p.block_k, 1)
            q_seg, kv_seg = q_seg[:, None, None, :, None], kv_seg[:, None, None, None, :]
        visible = scores.visibility(
            rows, cols, spec, self.offset,
            q_bound=p.q_len if p.q_pad != p.q_len else None,
            kv_bound=p.kv_len if p.kv_pad != p.kv_len else None,
            mask=mask, q_segments=q_seg, kv_segments=kv_seg,
            q_length=None if self.q_lengths is None
            else self.q_lengths[:, None, None, None, None],
            kv_length=None if self.kv_lengths is None
            else self.kv_lengths[:, None, None, None, None])
        logits = scores.modify_logits(s, rows, cols, spec, self.offset, bias=bias,
                                      alibi_slope=self.slope, visible=visible)
        return logits, visible

    def keep(self, i: Any, j: Any) -> jax.Array:
        """Dropout keep decisions of tile (i, j): [bq, bk] or [mb, kb, G, bq, bk]."""
        p = self.plan
        rows = i * p.block_q + lax.iota(jnp.int32, p.block_q)
        cols = j * p.block_k + lax.iota(jnp.int32, p.block_k)
        if self.origin is not None:  # the mask of global positions
            rows, cols = rows + self.origin[0], cols + self.origin[1]
        rate = p.spec.dropout_rate
        if p.spec.broadcast_dropout:
            return dropout_lib.keep(dropout_lib.row_keys(self.drop_keys, rows), cols, rate)
        row_keys = dropout_lib.row_keys(self.drop_keys[..., None], rows)  # [mb, kb, G, bq]
        keep = dropout_lib.keep(row_keys.reshape(-1), cols, rate)
        return keep.reshape(*row_keys.shape, p.block_k)


# -- forward ------------------------------------------------------------------------


def _varying(*arrays: Any) -> Callable[[jax.Array], jax.Array]:
    """Makes a loop's initial carry vary over the manual mesh axes its inputs vary over:
    inside jax.shard_map a carry must have its body's type."""
    axes = tuple(sorted(set().union(*(jax.typeof(x).mat.varying for x in arrays
                                      if x is not None))))
    return (lambda x: lax.pcast(x, axes, to="varying")) if axes else (lambda x: x)


def _forward(p: _Plan, q, k, v, bias, slopes, sinks, constants):
    spec = p.spec
    varying = _varying(q, k, v, bias, slopes, sinks, *constants.values())
    q_all, v_all = _split_rows(p, q), _split_keys(p, v)
    k_all = jnp.swapaxes(_split_keys(p, k), -1, -2)  # [chunks, nk, mb, kb, H, bk]
    inv_keep = 1.0 / (1.0 - spec.dropout_rate)

    def chunk(c):
        tiles = _Tiles(p, c, bias, slopes, constants)
        q_c, k_c, v_c = q_all[c], k_all[c], v_all[c]

        def query_tile(i):
            q_i = q_c[i].astype(jnp.float32)

            def key_tile(j, carry):  # online softmax (FlashAttention-2, algorithm 1)
                m, total, acc = carry
                logits, visible = tiles.logits(q_i, k_c[j].astype(jnp.float32), i, j)
                if visible is not None:
                    logits = jnp.where(visible, logits, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
                # NOTE: a row with nothing visible so far keeps m = -inf; using 0 as its
                # reference point makes every exp(-inf - 0) = 0, never inf - inf = NaN.
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                prob = jnp.exp(logits - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                total = alpha * total + jnp.sum(prob, axis=-1)
                if spec.has_dropout:  # lse sums the undropped weights, as the reference
                    prob = jnp.where(tiles.keep(i, j), prob * inv_keep, 0.0)
                pv = jnp.einsum("bkgqt,bktd->bkgqd", prob, v_c[j].astype(jnp.float32),
                                precision=_HIGHEST)
                return m_new, total, alpha[..., None] * acc + pv

            shape = (*p.tile_shape(), p.block_q)
            init = varying((jnp.full(shape, -jnp.inf, jnp.float32),
                            jnp.zeros(shape, jnp.float32),
                            jnp.zeros((*shape, v.shape[-1]), jnp.float32)))
            m, total, acc = lax.fori_loop(*tiles.key_tiles(i), key_tile, init)
            if sinks is not None:  # one more logit per row, with no value
                sink = tiles.head_rows(sinks)
                merged = jnp.maximum(m, sink)
                alpha = jnp.exp(jnp.where(m == -jnp.inf, 0.0, m) - merged)
                total = total * alpha + jnp.exp(sink - merged)
                acc, m = acc * alpha[..., None], merged
            seen = total != 0.0  # NaN: seen, so a NaN in a visible input shows
            total = jnp.where(seen, total, 1.0)
            out = (acc / total[..., None]).astype(q.dtype)
            return out, jnp.where(seen, m, jnp.inf), jnp.log(total)

        return lax.map(query_tile, jnp.arange(p.num_q_tiles, dtype=jnp.int32))

    out, row_max, log_sum = lax.map(chunk, jnp.arange(p.num_chunks, dtype=jnp.int32))
    return _merge_rows(p, out), (_merge_stats(p, row_max), _merge_stats(p, log_sum))


def _logsumexp(row_max: jax.Array, log_sum: jax.Array) -> jax.Array:
    """lse [B, N, T] from the forward's row statistics; -inf for rows that see no key."""
    return jnp.where(row_max == jnp.inf, -jnp.inf, row_max + log_sum)


# -- backward -----------------------------------------------------------------------


def _reduce_to(ds: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """[mb, kb, G, bq, bk] -> sizes = [mb | 1, kb * G | 1, bq | 1, bk | 1] (sums)."""
    mb, kb, G, bq, bk = ds.shape
    if sizes[1] == 1:
        ds = jnp.sum(ds, axis=(1, 2), keepdims=True)
    ds = ds.reshape(mb, -1, bq, bk)
    axes = tuple(axis for axis in (0, 2, 3) if sizes[axis] == 1 and ds.shape[axis] > 1)
    return jnp.sum(ds, axis=axes, keepdims=True) if axes else ds


def _backward(p: _Plan, q, k, v, bias, slopes, constants, out, row_stats, d_out, d_lse,
              bias_grad: bool, slope_grad: bool):
    spec = p.spec
    varying = _varying(q, k, v, bias, slopes, out, d_out, *constants.values())
    q_all, k_all, v_all = _split_rows(p, q), _split_keys(p, k), _split_keys(p, v)
    do_all = _split_rows(p, d_out)
    # Preprocess: delta = rowsum(dO * O) - dlse. A row that sees nothing has row max
    # +inf, which makes its recomputed P = exp(s - inf) = 0 everywhere.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta = jnp.swapaxes(delta, 1, 2)  # [B, N, T]
    row_max, log_sum = row_stats
    if d_lse is not None:
        delta = delta - jnp.where(row_max == jnp.inf, 0.0, d_lse.astype(jnp.float32))
    delta_all = _split_stats(p, delta)
    max_all, log_sum_all = _split_stats(p, row_max), _split_stats(p, log_sum)
    inv_keep = 1.0 / (1.0 - spec.dropout_rate)
    mb, kb, G = p.tile_shape()
    H, Hv = q.shape[-1], v.shape[-1]

    def chunk(dbias, c):
        tiles = _Tiles(p, c, bias, slopes, constants)
        q_c, k_c, v_c, do_c = q_all[c], k_all[c], v_all[c], do_all[c]
        max_c, log_sum_c, delta_c = max_all[c], log_sum_all[c], delta_all[c]

        def key_tile(carry, j):
            dq, dbias, dslope = carry
            k_j = k_c[j].astype(jnp.float32)
            k_j_t = jnp.swapaxes(k_j, -1, -2)
            v_j = v_c[j].astype(jnp.float32)

            def query_tile(i, carry):
                dk, dv, dq, dbias, dslope = carry
                q_i = q_c[i].astype(jnp.float32)
                do_i = do_c[i].astype(jnp.float32)
                logits, visible = tiles.logits(q_i, k_j_t, i, j)
                s = logits if visible is None else jnp.where(visible, logits, -jnp.inf)
                # NOTE: from the row max and log-sum, never their sum: at logits near
                # -1e7 and below, max + ln(sum) rounds to the max.
                prob = jnp.exp((s - max_c[i][..., None]) - log_sum_c[i][..., None])
                dp = jnp.einsum("bkgqd,bktd->bkgqt", do_i, v_j, precision=_HIGHEST)
                dropped = prob
                if spec.has_dropout:
                    keep = tiles.keep(i, j)
                    dropped = jnp.where(keep, prob * inv_keep, 0.0)
                    dp = jnp.where(keep, dp * inv_keep, 0.0)
                ds = prob * (dp - delta_c[i][..., None])
                if spec.logits_soft_cap is not None:
                    ds = ds * scores.soft_cap_derivative(logits, spec.logits_soft_cap)
                dv = dv + jnp.einsum("bkgqt,bkgqd->bktd", dropped, do_i, precision=_HIGHEST)
                dk = dk + jnp.einsum("bkgqt,bkgqh->bkth", ds, q_i, precision=_HIGHEST)
                dq_i = dq[i] + jnp.einsum("bkgqt,bkth->bkgqh", ds, k_j, precision=_HIGHEST)
                dq = lax.dynamic_update_index_in_dim(dq, dq_i, i, 0)
                if bias_grad:
                    starts, sizes = tiles.broadcast_window(bias.shape, i, j)
                    dbias = _add_tile(dbias, _reduce_to(ds, sizes), starts)
                if slope_grad:
                    rows, cols = tiles.positions(i, j)
                    distance = scores.alibi_bias(1.0, rows, cols, tiles.offset)  # -|i+off-j|
                    dslope = dslope + jnp.sum(ds * distance, axis=(-2, -1))
                return dk, dv, dq, dbias, dslope

            init = (*varying((jnp.zeros((mb, kb, p.block_k, H), jnp.float32),
                              jnp.zeros((mb, kb, p.block_k, Hv), jnp.float32))),
                    dq, dbias, dslope)
            dk, dv, dq, dbias, dslope = lax.fori_loop(*tiles.query_tiles(j), query_tile, init)
            return (dq, dbias, dslope), (dk * spec.scale, dv)

        dq = varying(jnp.zeros((p.num_q_tiles, mb, kb, G, p.block_q, H), jnp.float32))
        dslope = varying(jnp.zeros((mb, kb, G) if slope_grad else (), jnp.float32))
        (dq, dbias, dslope), (dk, dv) = lax.scan(
            key_tile, (dq, dbias, dslope), jnp.arange(p.num_k_tiles, dtype=jnp.int32))
        return dbias, (dq * spec.scale, dk, dv, dslope)

    dbias = varying(jnp.zeros(bias.shape if bias_grad else (), jnp.float32))
    dbias, (dq, dk, dv, dslope) = lax.scan(chunk, dbias,
                                           jnp.arange(p.num_chunks, dtype=jnp.int32))
    dq = _merge_rows(p, dq).astype(q.dtype)
    dk = _merge_keys(p, dk).astype(k.dtype)
    dv = _merge_keys(p, dv).astype(v.dtype)
    dbias = dbias.astype(bias.dtype) if bias_grad else None
    if slope_grad:  # [chunks, mb, kb, G] -> [B, N]
        dslope = dslope.reshape(p.batch_chunks, p.head_chunks, *p.tile_shape())
        dslope = dslope.transpose(0, 2, 1, 3, 4).reshape(p.batch, p.num_heads)
        dslope = dslope.astype(slopes.dtype)
    else:
        dslope = None
    return dq, dk, dv, dbias, dslope


# -- custom_vjp glue ----------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(p: _Plan, q, k, v, bias, slopes, sinks, constants):
    out, row_stats = _forward(p, q, k, v, bias, slopes, sinks, constants)
    return out, _logsumexp(*row_stats)


def _attention_fwd(p: _Plan, q, k, v, bias, slopes, sinks, constants):
    # The pytree structure of `needs` carries the static "which optional gradients".
    needs = {name: () for name, x in (("bias", bias), ("slopes", slopes)) if is_perturbed(x)}
    q, k, v, bias, slopes, sinks, constants = first_order_only(
        primal_values((q, k, v, bias, slopes, sinks, constants)), "implementation='xla_chunked'")
    out, row_stats = _forward(p, q, k, v, bias, slopes, sinks, constants)
    residuals = (q, k, v, bias, slopes, sinks, constants, out, row_stats, needs)
    return (out, _logsumexp(*row_stats)), residuals


def _attention_bwd(p: _Plan, residuals, cotangents):
    q, k, v, bias, slopes, sinks, constants, out, row_stats, needs = first_order_only(
        residuals, "implementation='xla_chunked'")
    d_out, d_lse = cotangents
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(out.shape, out.dtype)
    if isinstance(d_lse, SymbolicZero):
        d_lse = None
    dq, dk, dv, dbias, dslope = _backward(
        p, q, k, v, bias, slopes, constants, out, row_stats, d_out, d_lse,
        bias_grad="bias" in needs, slope_grad="slopes" in needs)
    dsinks = None
    if sinks is not None:
        delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
        if d_lse is not None:
            delta = delta - d_lse
        dsinks = scores.sink_gradient(sinks, _logsumexp(*row_stats), delta)
    # None: a zero cotangent for an input that was not differentiated (or has none).
    return dq, dk, dv, dbias, dslope, dsinks, jax.tree.map(lambda _: None, constants)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
