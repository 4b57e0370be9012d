"""What the Hopper (Pallas, Mosaic GPU) kernels share: the work items and key-tile
walk of the forward and dQ kernels, the consumers' turns, bias streams, wgmma
accumulation, scratch allocation, the row residuals and the launch.

Every Mosaic kernel is persistent (at most one program per multiprocessor, the
plan's `programs`) and warp-specialised: consumer warpgroups of ROWS_PER_CONSUMER
rows each (two; three in the dQ kernel where they fit) and one producer warpgroup
that issues bulk copies. What they can run and what they allocate is config.py's.

* `Walk`: the forward's and dQ kernel's items (64 query rows per consumer, of one
  batch entry and head) over the programs, each item's band of key tiles and the
  producer's K/V ring; `own_band`, `run_band` and `release_slot` give each consumer
  its part of a band while keeping the ring's barriers and the turns in step.
* `Turns`, `pass_turn` / `await_turn`: two consumers' alternation on the tensor
  cores; `take_turn`: consumers meeting.
* `BiasTiles`: a consumer's bias rows read tile by tile through its own buffer;
  `KeyRows` / `RowEntries`: a bias or mask per key / per row, read from global memory;
  `mask_tile`: its rows of a mask tile from the producer's ring (or per key or row).
* `tile_scores` / `tile_gradient`: the shared score rules (`core.logit_scores`,
  semantics/scores.py) on a WGMMA-layout tile.
* `accumulate`: acc + A B with wgmma; `head_slope`: a head's ALiBi slope;
  `row_residuals`: the backward kernels' stacked row residuals; `scoped`: a
  kernel's scratch (config.Scratch) allocated and handed over by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith

from pallas_attn.kernels import cast_varying_like, int32_indices
from pallas_attn.kernels.core import (
    Problem,
    TileRanges,
    log2_row_shift,
    logit_scores,
    normalised,
    run_tile_loops,
    whole_tiles,
)
from pallas_attn.kernels.mosaic import config
from pallas_attn.kernels.mosaic.config import (
    CONSUMERS,
    ITEM_ROWS,
    ROWS_PER_CONSUMER,
    Scratch,
    producer_registers,
)
from pallas_attn.semantics import dropout as dropout_lib
from pallas_attn.semantics import scores


def unsupported(problem: Problem, role: str) -> str:
    """Why the role's Mosaic kernel cannot run the problem (config.unsupported), or ""."""
    return config.unsupported(problem.dtype, problem.spec, problem.present, problem.head_dim,
                              problem.value_head_dim, role)


def smem_tiles(shape: tuple[int, ...], dtype: Any, swizzle: int = 128) -> Any:
    # Swizzled tiles of 8 rows of `swizzle` bytes: the wgmma operand layout (both
    # operands of one wgmma share the swizzle).
    row = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, row)),
                                                plgpu.SwizzleTransform(swizzle)))


def along(dim: int) -> Any:
    """The layout of a vector laid along dimension dim of a WGMMA tile."""
    return plgpu.Layout.WGMMA.reduce(1 - dim)


@dataclasses.dataclass(frozen=True)
class Band:
    """Key tiles [first, stop) of some query rows; [full_first, full_stop) need no
    band mask, and where whole (`core.whole_tiles`; None: always) is true no id or mask
    either."""
    first: Any
    stop: Any
    full_first: Any
    full_stop: Any
    whole: Any = None

    def idle_unless(self, active, first) -> Band:
        """This band where active, else the empty band at first (rows with no work)."""
        return Band(*(jnp.where(active, x, first)
                      for x in (self.first, self.stop, self.full_first, self.full_stop)),
                    self.whole)


@dataclasses.dataclass(frozen=True)
class Item:
    """One unit of work: the query rows from q0 (64 per consumer) of batch entry b,
    head n. q0 may be negative in a head's first item (`Walk`)."""
    valid: Any
    q0: Any
    b: Any
    n: Any


@dataclasses.dataclass(frozen=True)
class Segments:
    """Segment ids in global memory ([B, Tp] and [B, Sp] int32; None where only a mask
    narrows what rows see) and the limits of what each chunk of ROWS_PER_CONSUMER
    positions may see (`chunk_limits`: keys per chunk of query rows in the forward and
    dQ kernels, query rows per chunk of keys in the dK/dV kernel); inner: what every
    position of a chunk sees whole (`chunk_inner`: no id or mask hides anything there)."""

    q_ids: Any
    kv_ids: Any
    limits: Any
    inner: Any

    @classmethod
    def of(cls, refs: tuple[Any, ...]) -> Segments | None:
        """From the refs of `segments_of`'s operands: (ids, ids, limits, inner),
        (limits, inner) or ()."""
        return None if not refs else cls(*refs) if len(refs) == 4 else cls(None, None, *refs)

    def rows(self, b, row0, query_dim: int = 0) -> jax.Array | None:
        """The query ids of rows [row0, row0 + 64) along a WGMMA tile's dimension
        query_dim (`tile_gradient`), or None without ids."""
        if self.q_ids is None:
            return None
        return plgpu.load(self.q_ids.at[b, pl.ds(jnp.maximum(row0, 0), ROWS_PER_CONSUMER)],
                          layout=along(query_dim), optimized=False)

    def cols(self, b, k0, size: int, query_dim: int = 0) -> jax.Array | None:
        """The key ids of keys [k0, k0 + size) along a WGMMA tile's other dimension, or
        None without ids."""
        if self.kv_ids is None:
            return None
        return plgpu.load(self.kv_ids.at[b, pl.ds(k0, size)],
                          layout=along(1 - query_dim), optimized=False)

    def span(self, b, start, size: int) -> tuple[Any, Any]:
        """(lo, hi): what positions [start, start + size) see, from their chunks (a
        multiple of 64 positions; chunks before position 0 see nothing)."""
        lo, hi = jnp.int32(2**30), jnp.int32(0)
        for first, chunk in _chunks(start, size):
            lo = jnp.where(first >= 0, jnp.minimum(lo, self.limits[b, 0, chunk]), lo)
            hi = jnp.where(first >= 0, jnp.maximum(hi, self.limits[b, 1, chunk]), hi)
        return lo, hi

    def common(self, b, start, size: int) -> tuple[Any, Any]:
        """(lo, hi): what every position of [start, start + size) sees whole, from their
        chunks (empty if one lies before position 0). Tiles inside it compare no ids
        and read no mask (`core.TileRanges.key_tiles`' inner)."""
        lo, hi = jnp.int32(0), jnp.int32(2**30)
        for first, chunk in _chunks(start, size):
            lo = jnp.maximum(lo, self.inner[b, 0, chunk])
            hi = jnp.where(first >= 0, jnp.minimum(hi, self.inner[b, 1, chunk]), 0)
        return lo, hi


def _chunks(start, size: int) -> list[tuple[Any, Any]]:
    """(first position, chunk index) of the chunks of ROWS_PER_CONSUMER positions in
    [start, start + size); a first position before 0 reads chunk 0."""
    firsts = [start + c * ROWS_PER_CONSUMER for c in range(size // ROWS_PER_CONSUMER)]
    return [(first, lax.div(jnp.maximum(first, 0), ROWS_PER_CONSUMER)) for first in firsts]


@dataclasses.dataclass(frozen=True)
class Dropout:
    """Dropout's keep decisions on WGMMA tiles (semantics/dropout.py's hash): the
    program keys in global memory ([B, N] uint32, or [1, 1] for one shared mask).

    With a table (the consumer's HASH_TABLE uint32 entries of shared memory, `mine`),
    each thread of the warpgroup hashes one position and the tile's layout reads the
    hashes back: in a WGMMA tile each thread holds a quarter of a tile's columns, so it
    would hash 32 of 128 positions itself, which costs more than the keep tests."""

    keys: Any
    rate: float
    origin: Any = None  # the origin ref [2] (positions of query 0 and key 0) or None
    table: Any = None

    def mine(self, tables: Any, wg: Any) -> Dropout:
        """This consumer's decisions, through its table among tables (None: none)."""
        return self if tables is None else dataclasses.replace(self, table=tables.at[wg])

    def _hashed(self, hash_fn, first, size: int, dim: int) -> jax.Array:
        """hash_fn of positions [first, first + size) along a WGMMA tile's dimension dim."""
        if self.table is None:
            return hash_fn(first + plgpu.broadcasted_iota(jnp.int32, (size,), 0,
                                                          layout=along(dim)))
        spread = self.table.shape[0]
        if size > spread:
            raise AssertionError(f"{size} positions in a hash table of {spread}")
        # The stores and loads of the table are fenced by the warpgroup's barriers.
        self.table[...] = hash_fn(first + plgpu.broadcasted_iota(
            jnp.int32, (spread,), 0, layout=plgpu.Layout.WG_STRIDED((spread,), 1)))
        return plgpu.load(self.table.at[pl.ds(0, size)], layout=along(dim), optimized=False)

    def row_keys(self, b, n, row0, size: int = ROWS_PER_CONSUMER,
                 query_dim: int = 0) -> jax.Array:
        """The hash keys of rows [row0, row0 + size) of head n, batch entry b, along a
        WGMMA tile's dimension query_dim."""
        shared = self.keys.shape[0] == 1 and self.keys.shape[1] == 1
        # An invalid work item's head may lie past the keys: it reads the last one.
        key = self.keys[0 if shared else b,
                        0 if shared else jnp.minimum(n, self.keys.shape[1] - 1)]
        if self.origin is not None:  # the mask of global positions
            row0 = row0 + self.origin[0]
        return self._hashed(lambda rows: dropout_lib.row_keys(key, rows), row0, size,
                            query_dim)

    def multipliers(self, k0, size: int, query_dim: int = 0) -> jax.Array:
        """The hash multipliers of keys [k0, k0 + size) along a WGMMA tile's other
        dimension."""
        if self.origin is not None:
            k0 = k0 + self.origin[1]
        return self._hashed(dropout_lib.col_multipliers, k0, size, 1 - query_dim)

    def keep(self, row_keys: jax.Array, multipliers: jax.Array,
             query_dim: int = 0) -> jax.Array:
        """The tile's keep decisions from its rows' keys and its keys' multipliers (the
        queries along dimension query_dim)."""
        shape = (row_keys.shape[0], multipliers.shape[0])[::1 - 2 * query_dim]
        return dropout_lib.keep_words(lax.broadcast_in_dim(row_keys, shape, [query_dim])
                                      * lax.broadcast_in_dim(multipliers, shape, [1 - query_dim]),
                                      self.rate)


def chunk_limits(ranges: jax.Array) -> jax.Array:
    """[B, 2, n / 64] int32 from per-position ranges [B, 4, n] (core.segment_ranges):
    per chunk of 64 positions, the lowest start and the highest stop of what they may
    see."""
    B, _, n = ranges.shape
    chunks = ranges[:, :2].reshape(B, 2, n // ROWS_PER_CONSUMER, ROWS_PER_CONSUMER)
    return jnp.stack([chunks[:, 0].min(axis=-1), chunks[:, 1].max(axis=-1)], axis=1)


def chunk_inner(ranges: jax.Array) -> jax.Array:
    """[B, 2, n / 64] int32 from per-position ranges [B, 4, n] (core.segment_ranges):
    per chunk of 64 positions, the highest start and the lowest stop of what they see
    whole, what every position of the chunk sees."""
    B, _, n = ranges.shape
    chunks = ranges[:, 2:].reshape(B, 2, n // ROWS_PER_CONSUMER, ROWS_PER_CONSUMER)
    return jnp.stack([chunks[:, 0].max(axis=-1), chunks[:, 1].min(axis=-1)], axis=1)


def lengths_of(operands: dict[str, Any]) -> tuple[jax.Array | None, jax.Array | None]:
    """The query and key lengths [B] among a kernel's operands (None where absent)."""
    return tuple(operands.get(name) for name in config.LENGTHS)


def origin_of(operands: dict[str, Any]) -> jax.Array | None:
    """The origin [2] int32 among a kernel's operands (ring attention's blocks), or None."""
    return operands.get("origin")


def mask_of(operands: dict[str, Any]) -> jax.Array | None:
    """The caller's boolean mask among a kernel's operands as the Mosaic kernels read it
    (`config.MASK_DTYPE`: bulk copies and register layouts take no 1-bit type), or None."""
    mask = operands.get("mask")
    return None if mask is None else mask.astype(config.MASK_DTYPE)


def dropout_of(operands: dict[str, Any]) -> jax.Array | None:
    """The dropout keys among a kernel's operands, or None."""
    return operands.get("dropout_keys")


def segments_of(operands: dict[str, Any], limits: str) -> tuple[jax.Array, ...]:
    """The segment operands of a Mosaic kernel (`Segments.of`): the ids (where given),
    then the chunk limits and inner limits of `limits` ("key_ranges" or
    "query_ranges"); () without ranges."""
    if limits not in operands:
        return ()
    ranges = operands[limits]
    ids = ((operands["q_segment_ids"], operands["kv_segment_ids"])
           if "q_segment_ids" in operands else ())
    return (*ids, chunk_limits(ranges), chunk_inner(ranges))


def work_rounds(tiles: int, heads: int, programs: int, paired: bool) -> int:
    """The rounds of `work_order`."""
    if paired:  # two per round of pairs
        return 2 * -(-heads * -(-tiles // 2) // programs)
    return -(-heads * tiles // programs)


def work_order(r: Any, pid: Any, tiles: int, heads: int, programs: int, paired: bool
               ) -> tuple[Any, Any, Any]:
    """(valid, rank, head) of program pid's item in round r, over heads x tiles items of
    tile ranks 0..tiles-1, ranks fastest; rank 0 is the heaviest causal tile (a head's
    last query tile in the forward and dQ kernels, its first key tile in the dK/dV
    kernel).

    Paired (causal without a window, `Problem.pairs_causal_tiles`): pair j is ranks s and
    tiles - 1 - s (one tile where they meet) of head j // ceil(tiles / 2); program pid
    runs pair r // 2 * programs + pid, the heavy tile on even rounds and its mirror on
    odd ones, so that every program does the same causal work per two rounds (a
    round-robin of heaviest-first tiles was 1.5x out of balance at 256 tiles over 16
    heads on 132 programs). Else round r gives program pid item r * programs + pid, the
    lanes reversed on odd rounds."""
    if not paired:
        idx = r * programs + jnp.where(lax.rem(r, 2) == 0, pid, programs - 1 - pid)
        return idx < heads * tiles, lax.rem(idx, tiles), lax.div(idx, tiles)
    half = -(-tiles // 2)
    j = lax.div(r, 2) * programs + pid
    s = lax.rem(j, half)
    mirror = lax.rem(r, 2) == 1
    rank = jnp.where(mirror, tiles - 1 - s, s)
    valid = (j < heads * half) & jnp.logical_not(mirror & (rank == s))
    return valid, rank, lax.div(j, half)


@dataclasses.dataclass(frozen=True)
class Walk:
    """The persistent programs' walk over items of item_rows query rows, each with its
    band of key tiles streamed through a ring of shared-memory slots (the forward's
    and the dQ kernel's). Items end at the padded length; where item_rows does not
    divide it, a head's first item starts before row 0 and its consumers for those
    rows have nothing to do.

    Query tiles run fastest, so concurrent programs share K/V (`work_order`: causal
    items in mirror pairs, so every program does the same work per pair whatever the
    tile and head counts).
    """

    problem: Problem
    programs: int
    block_k: int
    stages: int
    item_rows: int = ITEM_ROWS
    segments: Segments | None = None
    lengths: tuple[Any, Any] = (None, None)  # query and key length refs [B] or None
    origin: Any = None  # the origin ref [2] or None
    shared: bool = False  # the consumers share each item's rows (the wide dQ kernel)

    @property
    def consumers(self) -> int:
        return CONSUMERS if self.shared else self.item_rows // ROWS_PER_CONSUMER

    @property
    def num_tiles(self) -> int:
        return -(-self.problem.q_pad // self.item_rows)

    @property
    def rounds(self) -> int:
        return work_rounds(self.num_tiles, self.problem.batch * self.problem.num_heads,
                           self.programs, self.problem.pairs_causal_tiles)

    def item(self, r) -> Item:
        valid, rank, batch_head = work_order(
            r, lax.axis_index("program"), self.num_tiles,
            self.problem.batch * self.problem.num_heads, self.programs,
            self.problem.pairs_causal_tiles)
        return Item(valid, self.problem.q_pad - (rank + 1) * self.item_rows,
                    lax.rem(batch_head, self.problem.batch),
                    lax.div(batch_head, self.problem.batch))

    def band(self, item: Item, whole: bool = False) -> tuple[TileRanges, Band, Any]:
        """(context, key tiles, ring steps) of an item; no steps for an invalid one.
        whole: its full tiles are only those every row of the item sees whole."""
        q_lengths, kv_lengths = self.lengths
        ctx = TileRanges(self.problem, item.b, item.n,
                         q_length=None if q_lengths is None else q_lengths[item.b],
                         kv_length=None if kv_lengths is None else kv_lengths[item.b],
                         origin=origin_pair(self.origin))
        limits = inner = None
        if self.segments is not None:
            limits = self.segments.span(item.b, item.q0, self.item_rows)
            if whole:
                inner = self.segments.common(item.b, item.q0, self.item_rows)
        tiles = Band(*ctx.key_tiles(jnp.maximum(item.q0, 0), item.q0 + self.item_rows,
                                    self.block_k, limits, inner))
        steps = jnp.where(item.valid, jnp.maximum(tiles.stop - tiles.first, 0), 0)
        return ctx, tiles, steps

    def slot(self, step):
        return lax.rem(step, jnp.int32(self.stages))

    def stream(self, k_ref, v_ref, k_smem, v_smem, ring, on_item=None, mask=None) -> None:
        """The producer: bulk-copies every item's K and V tiles into the ring.

        ring: the (k_loaded, v_loaded, k_consumed, v_consumed) barriers, one of each
        per slot; a slot's K refills once every consumer released its K (the forward's
        consumers release K after Q K^T, V after P V), then its V once they released
        V; the mask's rows land with K after both. on_item(item,
        tiles, steps), if given, runs before each item's copies. mask: (the mask ref
        [B or 1, N or 1, Tp, Sp], its ring [stages, consumers, 64, block_k, or half of it
        where the consumers share the rows]) or None; each consumer's rows (shared: its
        keys) of the key tile's mask land with K (`mask_tile`), except in the tiles every
        row of the item sees whole, which no consumer masks (`own_band`)."""
        k_loaded, v_loaded, k_consumed, v_consumed = ring
        block_k, stages, problem = self.block_k, self.stages, self.problem

        def copy_mask(mask, item, t, slot, needed):
            mask_ref, mask_smem = mask
            heads = mask_ref.at[item.b if mask_ref.shape[0] > 1 else 0,
                                item.n if mask_ref.shape[1] > 1 else 0]
            width = mask_smem.shape[-1]  # the tile's keys, or (shared) each consumer's half
            for c in range(self.consumers):
                # Rows before 0 (an idle consumer's): any in range, never read.
                row0 = jnp.maximum(item.q0 + (0 if self.shared else c * ROWS_PER_CONSUMER), 0)
                keys = pl.ds(t * block_k + (c * width if self.shared else 0), width)
                copy_where(needed, heads.at[pl.ds(row0, ROWS_PER_CONSUMER), keys],
                           mask_smem.at[slot, c], k_loaded.at[slot])

        def stream(r, step):
            item = self.item(r)
            # With a mask, the full tiles are those whose mask no consumer reads.
            _, tiles, steps = self.band(item, whole=mask is not None)
            if on_item is not None:
                on_item(item, tiles, steps)
            kh = lax.div(item.n, jnp.int32(problem.group))

            @pl.loop(0, steps)
            def _load(i):
                slot = self.slot(step + i)

                reused = step + i >= stages
                rows = pl.ds((tiles.first + i) * block_k, block_k)
                # K first: its copy overlaps the consumers' last products of the slot.
                pl.when(reused)(lambda: plgpu.barrier_wait(k_consumed.at[slot]))
                plgpu.copy_gmem_to_smem(k_ref.at[item.b, rows, kh], k_smem.at[slot],
                                        k_loaded.at[slot])
                pl.when(reused)(lambda: plgpu.barrier_wait(v_consumed.at[slot]))
                plgpu.copy_gmem_to_smem(v_ref.at[item.b, rows, kh], v_smem.at[slot],
                                        v_loaded.at[slot])
                if mask is not None:
                    t = tiles.first + i
                    copy_mask(mask, item, t, slot,
                              (t < tiles.full_first) | (t >= tiles.full_stop))

            return step + steps

        total = lax.fori_loop(0, self.rounds, stream, jnp.int32(0))

        # Observe the last releases too, so every barrier ends in a phase this
        # warpgroup has seen (the interpreter checks it; it costs the tail of the
        # program nothing on the GPU).
        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _drain(step):
            plgpu.barrier_wait(k_consumed.at[self.slot(step)])
            plgpu.barrier_wait(v_consumed.at[self.slot(step)])

    def produce(self, wg, k_ref, v_ref, k_smem, v_smem, ring, on_item=None,
                mask=None) -> None:
        """The producer warpgroup's part (wg == consumers, wg the warpgroup index): it
        gives up registers, then streams every item's K and V tiles (`stream`)."""
        @pl.when(wg == self.consumers)
        def _producer():
            plgpu.set_max_registers(producer_registers(self.consumers), action="decrease")
            self.stream(k_ref, v_ref, k_smem, v_smem, ring, on_item, mask)

    def bias_rows(self, bias_ref, item: Item, row0, buffers, barriers) -> Any:
        """This consumer's bias stream (`BiasTiles`) over its rows of the item (shared:
        its half of each tile's keys), through its own buffer and barrier (of one per
        consumer); a bias per key (`config.per_key`) read from global memory
        (`KeyRows`); or None without a bias."""
        if bias_ref is None:
            return None
        wg = lax.axis_index("wg")
        head = head_entries(bias_ref, item.b, item.n)
        if config.per_key(self.problem.spec.bias_shape):
            return KeyRows(head.at[0], self.block_k, *self._own_keys())
        if config.per_row(self.problem.spec.bias_shape):
            return RowEntries(head, row0, self._own_keys()[1])
        return BiasTiles(head.at[pl.ds(row0, ROWS_PER_CONSUMER)], buffers.at[wg],
                         barriers.at[wg], self.block_k, *self._own_keys())

    def mask_rows(self, mask_ref, item: Item, ring, row0) -> Any:
        """The mask as this consumer (its rows from row0) reads it: the producer's ring of
        mask tiles (`mask_tile`), a row per key read from global memory (`KeyRows`, a
        mask per key), its rows' entries (`RowEntries`, a mask per row), or None
        without a mask."""
        if mask_ref is None:
            return ring
        shape, head = self.problem.spec.mask_shape, head_entries(mask_ref, item.b, item.n)
        if config.per_key(shape):
            return KeyRows(head.at[0], self.block_k, *self._own_keys())
        if config.per_row(shape):
            return RowEntries(head, row0, self._own_keys()[1])
        return ring

    def _own_keys(self) -> tuple[Any, int]:
        """(offset, width) of the keys of each tile this consumer reads: its half where
        the consumers share the rows, else the whole tile."""
        width = self.block_k // CONSUMERS if self.shared else self.block_k
        return (lax.axis_index("wg") * width if self.shared else 0), width


def head_entries(ref, b, n) -> Any:
    """A bias's or mask's [T or 1, S or 1] entries of batch entry b and head n (either
    broadcast)."""
    return ref.at[b if ref.shape[0] > 1 else 0, n if ref.shape[1] > 1 else 0]


@dataclasses.dataclass(frozen=True)
class KeyRows:
    """A bias or mask with one entry per key that every row shares (`config.per_key`):
    of key tile t, `width` keys from `offset`, read from global memory and broadcast
    over the consumer's 64 rows (along dimension query_dim of the tile: 1 in tiles of
    keys by queries); nothing is staged in shared memory."""

    row: Any  # the entries of one batch entry and head [Sp]
    block_k: int
    offset: Any = 0
    width: int | None = None
    query_dim: int = 0

    def tile(self, t) -> jax.Array:
        """Key tile t's entries over the rows (WGMMA layout, the ref's dtype)."""
        width = self.width or self.block_k
        key_dim = 1 - self.query_dim
        keys = plgpu.load(self.row.at[pl.ds(t * self.block_k + self.offset, width)],
                          layout=along(key_dim), optimized=False)
        shape = (width, ROWS_PER_CONSUMER) if self.query_dim else (ROWS_PER_CONSUMER, width)
        return lax.broadcast_in_dim(keys, shape, [key_dim])

    def start(self, t) -> None:
        """Nothing to stage ahead (`BiasTiles.start`)."""

    def take(self, t, stop) -> jax.Array:
        """Key tile t of the bias (float32, WGMMA layout), as `BiasTiles.take`."""
        return self.tile(t).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class RowEntries:
    """A bias or mask broadcast along keys (`config.per_row`): of `rows` query rows from
    row0, their entries read from global memory (one for every row where the ref has a
    single one) and broadcast over `width` keys (along dimension 1 - query_dim of the
    tile: queries along dimension 1 in tiles of keys by queries); nothing is staged."""

    column: Any  # the entries of one batch entry and head [Tp or 1, 1]
    row0: Any
    width: int
    rows: int = ROWS_PER_CONSUMER
    query_dim: int = 0

    def tile(self, t=None) -> jax.Array:
        """The rows' entries over any key tile (WGMMA layout, the ref's dtype)."""
        shape = (self.width, self.rows) if self.query_dim else (self.rows, self.width)
        if self.column.shape[0] == 1:  # one entry for every row
            return lax.broadcast_in_dim(self.column[0, 0], shape, ())
        # Rows before row 0 (a head's first item) read row 0's: nothing of theirs is kept.
        first = jnp.maximum(self.row0, 0)
        entries = plgpu.load(self.column.at[pl.ds(first, self.rows), 0],
                             layout=along(self.query_dim), optimized=False)
        return lax.broadcast_in_dim(entries, shape, [self.query_dim])

    def start(self, t) -> None:
        """Nothing to stage ahead (`BiasTiles.start`)."""

    def take(self, t, stop) -> jax.Array:
        """The bias over key tile t (float32, WGMMA layout), as `BiasTiles.take`."""
        return self.tile(t).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class BiasTiles:
    """One consumer's bias rows in global memory, read tile by tile through its own
    shared-memory buffer: each tile's copy is issued as soon as the previous tile is in
    registers, one step ahead. Of key tile t the consumer reads `width` keys from
    `offset` (the whole tile by default)."""

    rows: Any
    buffer: Any
    loaded: Any
    block_k: int
    offset: Any = 0
    width: int | None = None

    def start(self, t) -> None:
        width = self.width or self.block_k
        plgpu.copy_gmem_to_smem(self.rows.at[:, pl.ds(t * self.block_k + self.offset, width)],
                                self.buffer, self.loaded)

    def take(self, t, stop) -> jax.Array:
        """Key tile t of the bias (float32, WGMMA layout); starts tile t + 1 below stop."""
        plgpu.barrier_wait(self.loaded)
        bias = plgpu.load(self.buffer, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        plgpu.commit_smem()  # the reads are done before the next copy overwrites
        pl.when(t + 1 < stop)(lambda: self.start(t + 1))
        return bias


def copy_where(needed, src, dst, barrier) -> None:
    """Bulk-copies src into dst on barrier where needed; elsewhere only arrives on the
    barrier, as the copy would have, so its arrivals stay what it expects."""
    pl.when(needed)(lambda: plgpu.copy_gmem_to_smem(src, dst, barrier))
    pl.when(~needed)(lambda: plgpu.barrier_arrive(barrier))


def origin_pair(origin_ref) -> tuple[Any, Any] | None:
    """(query 0's position, key 0's position) from the origin ref, or None."""
    return None if origin_ref is None else (origin_ref[0], origin_ref[1])


def mask_tile(mask, slot, t, masked: bool | None) -> jax.Array | None:
    """This consumer's rows of key tile t's mask as booleans in the WGMMA layout: from
    ring slot `slot` of the mask tiles (`Walk.stream`; landed with K), per key
    (`KeyRows`) or per row (`RowEntries`); None without a mask, or in a tile its rows
    see whole (masked False: `core.run_tile_loops`)."""
    if mask is None or masked is False:
        return None
    if isinstance(mask, (KeyRows, RowEntries)):
        return mask.tile(t) != 0
    return plgpu.load(mask.at[slot, lax.axis_index("wg")], layout=plgpu.Layout.WGMMA) != 0


def own_band(ctx: TileRanges, tiles: Band, row0, stop, block_k: int,
             segments: Segments | None = None) -> Band:
    """A consumer's key tiles (its 64 rows from row0, within their segments' keys; full
    ones those all of them see whole where there is one, `core.whole_tiles`), clipped
    into the item's [tiles.first, stop) (they agree except at the band's ends)."""
    rows_stop = row0 + ROWS_PER_CONSUMER
    if segments is None:
        own, whole = ctx.key_tiles(row0, rows_stop, block_k), None
    else:
        limits = segments.span(ctx.b, row0, ROWS_PER_CONSUMER)
        own, whole = whole_tiles(
            ctx.key_tiles(row0, rows_stop, block_k, limits),
            ctx.key_tiles(row0, rows_stop, block_k, limits,
                          segments.common(ctx.b, row0, ROWS_PER_CONSUMER)))
    first = jnp.clip(own[0], tiles.first, stop)
    last = jnp.clip(own[1], first, stop)
    full_first = jnp.clip(own[2], first, last)
    return Band(first, last, full_first, jnp.clip(own[3], full_first, last), whole)


def run_band(first, stop, own: Band, release, step, carry) -> Any:
    """A consumer's pass over the item's key tiles [first, stop): step(t, carry, masked)
    on its own tiles (masked as `core.run_tile_loops` gives it), release(t) on the
    others.

    Every key tile is two turns of the consumers' alternation for each consumer,
    skipped tiles included (`release_slot`), so the turns stay paired."""
    def skip(lo, hi):
        @pl.loop(lo, jnp.maximum(hi, lo))
        def _(t):
            release(t)

    skip(first, own.first)
    carry = run_tile_loops(own.first, own.stop, own.full_first, own.full_stop, step, carry,
                           own.whole)
    skip(own.stop, stop)
    return carry


def release_slot(slot, ring, turns: Turns | None) -> None:
    """A consumer's part in a key tile it skips: wait for the slot's K and V, give each
    back and pass and await the tile's turn."""
    k_loaded, v_loaded, k_consumed, v_consumed = ring
    plgpu.barrier_wait(k_loaded.at[slot])
    plgpu.barrier_arrive(k_consumed.at[slot])
    pass_turn(turns)
    plgpu.barrier_wait(v_loaded.at[slot])
    plgpu.barrier_arrive(v_consumed.at[slot])
    await_turn(turns)


def take_turn(barrier) -> None:
    """Both consumers arrive, then both wait: they meet. None: nothing to meet on."""
    if barrier is None:
        return
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


# The turns' named barriers: Mosaic GPU's own take 0 and one per warpgroup from 1.
TURN_BARRIER = 8


@dataclasses.dataclass(frozen=True)
class Turns:
    """Two consumers' alternation on the tensor cores (FlashAttention-3's ping-pong):
    each passes the turn once it has issued its first products of a tile (`pass_turn`)
    and waits for the other's pass before issuing its last (`await_turn`).

    kind "named": the forward on the GPU, two named barriers (bar.arrive / bar.sync from
    TURN_BARRIER), which cost less than shared-memory barriers on the consumers'
    critical path; "pair": the same through `barriers`, one one-arrival barrier per
    consumer (the interpreter has no named barriers); "meet": the dQ kernel, where
    passing and awaiting both meet the other consumer on one two-arrival barrier (the
    forward's looser turns cost its windowed problems 3-4%; docs/decisions.md)."""
    barriers: Any
    kind: str

    @staticmethod
    def of(barriers: Any, problem: Problem, kind: str = "named") -> Turns | None:
        """The turns of a kernel whose scratch has these barriers (None: no turns)."""
        if barriers is None:
            return None
        return Turns(barriers, "pair" if kind == "named" and problem.interpret else kind)


def _named_barrier(operation: str, other: bool) -> None:
    """bar.<operation> for both consumers' threads on this consumer's turn barrier, or
    on the other consumer's (consumers are warpgroups 0 and 1)."""
    @plgpu.inline_mgpu()
    def emit(_):
        wg = mgpu_utils.warpgroup_idx(sync=True)
        i32 = ir.IntegerType.get_signless(32)
        index = (arith.subi(mgpu_utils.c(TURN_BARRIER + 1, i32), wg) if other
                 else arith.addi(mgpu_utils.c(TURN_BARRIER, i32), wg))
        mgpu_utils.inline_ptx(f"bar.{operation} $0, {2 * mgpu_utils.WARPGROUP_SIZE};",
                              index, has_side_effects=True, convergent=True)

    emit()


def pass_turn(turns: Turns | None) -> None:
    """This consumer has issued its first products of a tile: the other may issue its
    last ones. None: consumers that take no turns."""
    if turns is None:
        return
    if turns.kind == "named":
        _named_barrier("arrive", other=True)
    elif turns.kind == "pair":
        plgpu.barrier_arrive(turns.barriers.at[1 - lax.axis_index("wg")])
    else:
        take_turn(turns.barriers)


def await_turn(turns: Turns | None) -> None:
    """Wait until the other consumer has issued its first products of its current tile
    (`pass_turn`), before issuing this one's last."""
    if turns is None:
        return
    if turns.kind == "named":
        _named_barrier("sync", other=False)
    elif turns.kind == "pair":
        plgpu.barrier_wait(turns.barriers.at[lax.axis_index("wg")])
    else:
        take_turn(turns.barriers)


def tile_scores(problem: Problem, s: jax.Array, row0, k0, masked: bool, *,
                bias: jax.Array | None = None, slope: Any = None,
                row_shift: jax.Array | None = None,
                segments: tuple[jax.Array, jax.Array] | None = None, kv_length: Any = None,
                mask: jax.Array | None = None, query_dim: int = 0, offset: Any = None,
                q_length: Any = None) -> tuple[jax.Array, jax.Array | None]:
    """(scores, t = tanh(logits / cap) or None) of a [rows, keys] tile in the WGMMA
    layout from the raw products s = Q K^T: common.logit_scores, then the band masks
    (causal, window, padded keys) of rows from row0 and keys from k0 where masked,
    invisible entries at -inf. bias: the tile's bias (float32) or None; slope: the
    head's ALiBi slope (a scalar) or None; row_shift: `common.logit_scores`';
    segments: the rows' and the keys' segment ids (`Segments.rows` / `cols`) or None
    (the kernels pass them for masked tiles: full ones lie inside `Segments.common`);
    kv_length / q_length: the batch entry's key / query length (masked tiles; rows past
    the query length and padded rows see nothing there);
    mask: the tile of the caller's boolean mask or None, applied on every tile;
    offset: the rows' alignment with the keys (TileRanges.offset; problem.offset if None).
    query_dim 1: the tile is [keys, rows] (s = K Q^T; `tile_gradient`).
    The Mosaic kernels' one score rule."""
    key_dim = 1 - query_dim
    offset = problem.offset if offset is None else offset

    def iota(dim):
        return plgpu.broadcasted_iota(jnp.int32, s.shape, dim, layout=plgpu.Layout.WGMMA)

    rows = cols = None
    if slope is not None and problem.exact_float_positions:
        # ALiBi positions as float32: one conversion per row and per column a thread
        # holds, broadcast over the tile, instead of one per entry.
        def positions(start, dim):
            vector = start + plgpu.broadcasted_iota(jnp.int32, (s.shape[dim],), 0,
                                                    layout=along(dim))
            return lax.broadcast_in_dim(vector.astype(jnp.float32), s.shape, [dim])
        rows, cols = positions(row0, query_dim), positions(k0, key_dim)
    elif slope is not None:
        rows, cols = row0 + iota(query_dim), k0 + iota(key_dim)
    s, cap_tanh = logit_scores(problem, s, rows, cols, bias=bias, slope=slope,
                               row_shift=row_shift, offset=offset)
    if masked:
        rows, cols = row0 + iota(query_dim), k0 + iota(key_dim)
        visible = scores.visibility(
            rows, cols, problem.spec, offset, kv_length=kv_length, q_length=q_length,
            q_bound=problem.q_len if problem.q_pad != problem.q_len else None,
            # A 96-key tile may also end past the padding (vjp.prepare).
            kv_bound=(problem.kv_len if problem.kv_pad != problem.kv_len
                      or problem.kv_len % s.shape[key_dim] else None))
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
    if segments is not None:
        s = jnp.where(same_segment(segments, s.shape, query_dim), s, -jnp.inf)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    return s, cap_tanh


def band_may_hide(problem: Problem, kv_length: Any = None, q_length: Any = None) -> bool:
    """Whether a band rule (causal, window, lengths, padding) can hide an entry of a
    masked tile: a tile that only the mask or the ids keep from being whole has none."""
    spec = problem.spec
    return (spec.is_causal or spec.local_window is not None or kv_length is not None
            or q_length is not None or problem.q_pad != problem.q_len
            or problem.kv_pad != problem.kv_len)


def same_segment(segments: tuple[jax.Array, jax.Array], shape: tuple[int, ...],
                 query_dim: int = 0) -> jax.Array:
    """Whether each entry's query and key share a segment, from the rows' and the keys'
    ids (`Segments.rows` / `cols`), the queries along dimension query_dim."""
    row_ids, col_ids = segments
    return (lax.broadcast_in_dim(row_ids, shape, [query_dim])
            == lax.broadcast_in_dim(col_ids, shape, [1 - query_dim]))


def tile_gradient(problem: Problem, s: jax.Array, dp: jax.Array, bias: jax.Array | None,
                  residuals: tuple[jax.Array, jax.Array, jax.Array], row0, k0,
                  masked: bool, slope: Any = None,
                  segments: tuple[jax.Array, jax.Array] | None = None, kv_length: Any = None,
                  keep: jax.Array | None = None, query_dim: int = 0,
                  mask: jax.Array | None = None, offset: Any = None, q_length: Any = None,
                  ds_factor: Any = None, gain_later: bool = False, hidden_ds: str = "mask",
                  row_terms: bool = False, unseen_rows: bool = False) -> tuple[jax.Array, ...]:
    """(P, dS) of a [rows, keys] tile in the WGMMA layout, float32, from the raw
    products s = Q K^T and dp = dO V^T, the tile's bias (or None), the head's ALiBi
    slope (or None) and its rows' residuals (row reference, log2 row sum, delta;
    `along(query_dim)`). masked applies the band masks (causal, window, padded
    keys) of rows from row0 and keys from k0; segments, kv_length, mask, offset:
    `tile_scores`'.
    keep: dropout's keep decisions or None; then P is the dropped P (kept entries
    scaled by 1 / (1 - rate), for dV) and dS uses dP scaled likewise (the true dS);
    gain_later: neither is scaled, both come out times 1 - rate, and the caller scales
    dK, dV and dQ once (one multiply per entry fewer each).
    query_dim 1: every tile is transposed, [keys, rows] (s = K Q^T, dp = V dO^T), and
    so are P and dS. ds_factor: float16 dS's power of two for the tile's keys
    (`core.ds_scales`) or None; dS comes out times it.
    hidden_ds: how the entries the band, the ids or the mask hide (P = 0 there from the
    scores' select) keep a hidden value's NaN dP out of dS. "mask": P and dS are
    selected again, exact zeros even in a row whose residuals are NaN (dS tiles that are
    also the bias's gradient, kernels without a repair); "p": dS is zeroed where P is 0,
    and a row whose residuals are NaN reaches hidden keys through P, for a dK/dV whose
    keys holding a NaN are recomputed (`Route.repair`); "none": nothing, for a dQ whose
    rows holding a NaN are recomputed. The mask's tile is dead after the scores' select
    in the last two.
    row_terms: also the rows' sums (`score_rows`), the terms of a bias per row's gradient;
    hidden_ds "mask", query_dim 0 and no ds_factor only. unseen_rows: P, dS and the row
    terms are 0 in the rows that see no key (row reference +inf) whatever their scores:
    rows past the query length, which a dQ kernel's tiles do not mask, may hold NaN in
    their bias entries (and a soft cap's slope of them)."""
    if hidden_ds not in ("mask", "p", "none"):
        raise AssertionError(f"tile_gradient: hidden_ds must be mask, p or none, got {hidden_ds!r}")
    if row_terms and (hidden_ds != "mask" or query_dim or ds_factor is not None):
        raise AssertionError("tile_gradient: row_terms needs hidden_ds='mask', query_dim 0 "
                             "and no ds_factor")
    row_max, log2_sum, delta = residuals

    def rows_of(x):
        return lax.broadcast_in_dim(x, s.shape, [query_dim])

    # NOTE: ptxas schedules this math by the order of its steps: delta after P only in
    # log2 units, where it measured faster (docs/decisions.md, "tile_gradient delta order").
    log2_units = log2_row_shift(problem, bias)
    later = keep is not None and gain_later
    gain = problem.dropout_scale if keep is not None and not later else None
    if ds_factor is not None:  # folded into dP - delta
        delta = delta * ds_factor
        gain = ds_factor if gain is None else ds_factor * gain
    if later:  # dS / gain = P (dP kept - delta / gain)
        delta = delta * (1.0 / problem.dropout_scale)
    if keep is not None:
        dp = jnp.where(keep, dp if gain is None else dp * gain, 0.0)
    elif gain is not None:
        dp = dp * gain
    kept_dp = dp  # for P dP's row sums (row_terms with a soft cap)
    if not log2_units:
        dp = dp - rows_of(delta)
    # ALiBi in log2 units: the row reference goes in with the scale's multiply, before
    # the ALiBi term (one operation fewer per entry), and P = exp2(s).
    shifted = slope is not None and log2_units
    s, cap_tanh = tile_scores(problem, s, row0, k0, masked, bias=bias, slope=slope,
                              row_shift=rows_of(row_max + log2_sum) if shifted else None,
                              segments=segments, kv_length=kv_length, mask=mask,
                              query_dim=query_dim, offset=offset, q_length=q_length)
    cap_slope = None if cap_tanh is None else scores.soft_cap_slope(cap_tanh)
    if cap_slope is not None:  # dS picks up the cap's derivative 1 - t^2
        dp = dp * cap_slope
    prob = (normalised(s) if shifted
            else problem.probabilities(s, row_max, log2_sum, rows=rows_of))
    if unseen_rows:
        prob = jnp.where(rows_of(row_max) == jnp.inf, 0.0, prob)
    if log2_units:
        dp = dp - rows_of(delta)
    ds = prob * dp
    band = masked and band_may_hide(problem, kv_length, q_length)
    hides = band or unseen_rows or segments is not None or mask is not None
    if (hidden_ds == "p" and hides) or (hidden_ds == "mask" and (band or unseen_rows)):
        ds = jnp.where(prob == 0.0, 0.0, ds)  # a hidden key: exact zeros, NaN dP too
    terms = []
    if row_terms:
        terms = [prob if cap_slope is None else prob * cap_slope]
        if cap_slope is not None:
            terms.append(prob * kept_dp)
        if hides:  # P = 0 at a hidden entry; its key's or value's NaN stays out
            terms = [jnp.where(prob == 0.0, 0.0, x) for x in terms]
    if keep is not None:
        prob = jnp.where(keep, prob if later else prob * problem.dropout_scale, 0.0)
    # A row may carry NaN residuals (a visible key of its was NaN): the entries another
    # segment or the mask hides must still give exact zeros to these keys' dK and dV.
    if hidden_ds != "mask":
        return prob, ds
    if segments is not None:
        same = same_segment(segments, s.shape, query_dim)
        prob, ds = jnp.where(same, prob, 0.0), jnp.where(same, ds, 0.0)
    if mask is not None:
        prob, ds = jnp.where(mask, prob, 0.0), jnp.where(mask, ds, 0.0)
    if row_terms:
        return prob, ds, tuple(jnp.sum(x, axis=1) for x in (ds, *terms))
    return prob, ds


def zero_tiles_outside(zero_tile, tile_ref, first, stop, count: int) -> None:
    """Bulk-copy the zeroed shared-memory tile into tile_ref(t) for the tiles t in
    [0, count) outside [first, stop) (dbias tiles outside a band)."""
    for lo, hi in ((0, first), (stop, count)):
        pl.loop(lo, hi)(lambda t: plgpu.copy_smem_to_gmem(zero_tile, tile_ref(t)))


def zero_tile_init(zero_tile) -> None:
    """Fill a shared-memory tile with zeros for the bulk copies that read it."""
    zero_tile[...] = plgpu.layout_cast(jnp.zeros(zero_tile.shape, zero_tile.dtype),
                                       plgpu.Layout.WGMMA)
    plgpu.commit_smem()


def optional_refs(refs, *operands) -> list[Any]:
    """The refs of the optional operands among a kernel's refs (which start with them, in
    this order), None for an operand that is None."""
    refs = iter(refs)
    return [None if x is None else next(refs) for x in operands]


def row_residuals(row_stats: tuple[jax.Array, jax.Array], delta: jax.Array,
                  row_scales: jax.Array | None = None) -> jax.Array:
    """The backward kernels' row residuals [B, N, 3, Tp] float32: (row reference, log2
    row sum, delta) stacked, so a consumer copies its rows' three in one bulk copy. With
    float16 dS's row scales (`core.DsScales` rows: e, 2^e), the dQ kernel's [B, N, 4, Tp]:
    e added to the log2 row sum (P and dS come out times 2^-e), 2^e fourth."""
    row_max, log2_sum = row_stats
    rows = [row_max, log2_sum, delta]
    if row_scales is not None:
        rows[1] = log2_sum + row_scales[:, :, 0]
        rows.append(row_scales[:, :, 1])
    return jnp.stack(rows, axis=2)


def head_slope(slopes_ref, valid, b, n) -> Any:
    """The ALiBi slope of head n of batch entry b (a scalar loaded from global memory),
    or None without ALiBi; (b, n) of an invalid work item may lie past the arrays, so
    it reads entry (0, 0) instead."""
    if slopes_ref is None:
        return None
    return slopes_ref[jnp.where(valid, b, 0), jnp.where(valid, n, 0)]


def accumulate(products, interpret: bool) -> tuple[jax.Array, ...]:
    """acc + sum of A B over its pairs, with wgmma, for each (acc, ((A, B), ...)) of
    products (B in shared memory, A there or in registers in the WGMMA layout), one
    wait for all. The interpreter has no accumulator initialised from registers
    (pl.run_state over plgpu.ACC.init) and no A in registers: there the products start
    from zero, A is in shared memory and the sums happen in registers."""
    def issue(refs):
        for ref, (_, pairs) in zip(refs, products, strict=True):
            for a, b in pairs:
                plgpu.wgmma(ref, a, b)

    if not interpret:
        return pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc, _ in products))

    def run_fresh(*refs):
        issue(refs)
        return tuple(ref[...] for ref in refs)

    fresh = pl.run_scoped(run_fresh, *(plgpu.ACC(acc.shape, jnp.float32)
                                       for acc, _ in products))
    return tuple(acc + x for (acc, _), x in zip(products, fresh, strict=True))


def scoped(scratch: Scratch, body: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
    """Allocates a kernel's scratch (buffers, then barriers, in config's order) for every
    warpgroup and runs body(buffers, barriers), dicts of refs by name (None: absent)."""
    buffers = [(name, b) for name, b in scratch.buffers if b is not None]
    barriers = [(name, b) for name, b in scratch.barriers if b is not None]
    kinds = [smem_tiles(b.shape, b.dtype, b.swizzle) if b.swizzle
             else plgpu.SMEM(b.shape, b.dtype) for _, b in buffers]
    kinds += [plgpu.Barrier(num_arrivals=b.arrivals, num_barriers=b.count)
              for _, b in barriers]

    def run(*refs):
        named = dict(zip([name for name, _ in buffers + barriers], refs, strict=True))
        body({name: named.get(name) for name, _ in scratch.buffers},
             {name: named.get(name) for name, _ in scratch.barriers})

    pl.run_scoped(run, *kinds, collective_axes="wg")


def launch(entry, out_type: Any, programs: int, interpret: bool,
           consumers: int = CONSUMERS) -> Any:
    """The persistent warp-specialised kernel `entry` (consumers and a producer, named
    "wg") on `programs` programs (named "program"), as a function of its operands.
    Every kernel reduces only along the rows of wgmma's layout, within a warp: no shared
    memory is set aside for reductions across warps, so a kernel holds exactly the
    buffers config describes (the routing table's budget; in the interpreter also the
    forward's P, `config.forward_scratch`).

    The interpreter poisons every buffer it allocates (outputs included) with NaN and
    runs its happens-before race detector (the Mosaic tests check its verdict).
    """
    params = (plgpu.InterpretGPUParams(uninitialized_memory="nan", detect_races=True)
              if interpret else None)

    def run(*operands):
        with int32_indices():
            results = plgpu.kernel(
                entry, out_type=out_type, grid=(programs,),
                grid_names=("program",), num_threads=consumers + 1, thread_name="wg",
                compiler_params=plgpu.CompilerParams(approx_math=True,
                                                     reduction_scratch_bytes=0),
                interpret=params)(*operands)
        return cast_varying_like(results, operands)

    return run
