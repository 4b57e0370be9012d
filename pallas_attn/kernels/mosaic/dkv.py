"""dK/dV kernel for Hopper (Pallas, Mosaic GPU backend): warp-specialised, persistent,
with the gradient of a bias written from the dS tiles it computes anyway.

A unit of work is the dK and dV rows of a unit's keys (128) of one (batch entry, KV
head), summed over the group's query heads and every visible query tile. The two
consumer warpgroups each own 64 of the keys (the wgmma M dimension) and keep their
dK and dV in registers. Per step (the 64 query rows of one tile, one head):

* S and dP with wgmma, 64 queries by 64 keys per consumer; where the route says so
  (`Route.keys_major`, `config.dkv_keys_major`: head dims up to 64 without a bias or ALiBi)
  transposed, S^T = K Q^T and dP^T = V dO^T (keys by queries);
* P and dS from the forward's row residuals and the shared score rules
  (`common.tile_gradient`, semantics/scores.py);
* transposed, P^T and dS^T (16-bit) are the A operands of dV += P^T dO and
  dK += dS^T Q straight from registers; otherwise P and dS go through shared memory
  and those products read them transposed (the interpreter, whose wgmma reads shared
  memory only, stages P^T and dS^T there too);
* with a bias that needs a gradient, the dS tile in shared memory is also the
  bias's gradient for that (query tile, key tile, head): a bulk copy stores it. A bias
  per key ([B or 1, N or 1, 1, S], read from global memory like a mask per key) needs
  dS summed over the queries instead: one more product, dS^T times a tile of ones
  (16 columns, each the sums), beside dK's, taken per head; the sums over the bias's
  broadcast axes follow the kernel.

At a padded head dim above 128 one consumer's dK and dV would take every register it
has, so the consumers split the work of units of 64 keys (`config.is_wide`): each
computes S and dP for 32 of the keys (over the whole head dim) and writes its half
of the unit's P and dS tiles; after an exchange (a barrier both consumers pass once
per step) each adds P^T dO and dS^T Q for its half of the head dims. P and dS have
two buffers each, used in turn, so that the one exchange suffices: the products
that last read a buffer, two steps back, finished before the last exchange. The
buffers use 64-byte swizzled tiles (32-byte at 160 and 224, `config.operand_swizzle`),
so that half of a 64-key tile and half of the head dims are whole tiles.

The producer warpgroup streams each step's Q, dO, row residuals and bias tile
into a ring of the route's slots ("loaded" / "consumed" barriers, the ring
running on across units) and each unit's K and V into one buffer per consumer. With
segment ids, whose units are short, the consumers give K and V back after the unit's
last S and dP, so that the next unit's load overlaps its last step.

dbias. A bias with its own entry per batch entry ([B, N, T, S]) gets each dS tile
stored once; tiles outside the causal/window band get zeros (the producer
bulk-copies a zeroed tile). A bias shared by the batch entries ([1, N, T, S]) gets
its batch sum in place: units add their dS tiles into one buffer of the bias's
shape with the bulk copy engine's reduce-add, each addition rounding to the bias
dtype. The buffer starts as batch entry 0's dbias when the Mosaic dQ kernel has
stored it (`dq.dq_and_dbias`, `dbias_first`; entry 0's units then add nothing), else
as zeros. By default one program runs an item's batch entries as passes, each
pass's additions landed before the next one's, so the sum is bitwise the same from
run to run. With the route's any_order (`BlockSizes(deterministic=False)`) the
batch entries are separate units, key tiles fastest, then batch entries, so the
programs working on one (KV head, key tile) for several batch entries run at the
same time: they read each bias tile once from memory and the rest from L2, and
their additions meet there in whatever order the programs reach a tile. Under
causal masking the key tiles run in mirror pairs, so every program does the same
work per pair. The sum never needs a [B, N, T, S] buffer or a second pass over S
and dP (docs/decisions.md, "Batch-shared dbias summed in turn").

The Pallas interpreter has neither reduce-add copies nor accumulators initialised
from registers: interpreted, the kernel adds dbias tiles and each step's dK/dV
products through registers (`_add_dbias_in_registers`, `common.accumulate`), and
always runs an item's batch entries as passes (so that no two programs add to one
tile), the only places where it differs from the compiled kernel.

With segment ids (or a mask: its ranges), a unit's query tiles narrow to the rows that
see its keys, and the steps outside the rows that see every key of the unit whole
(sorted ids, runs of whole mask chunks) compare ids and read the mask; entries of
other segments give exact zeros (`common.tile_gradient`).
With sequence lengths, keys past the length are masked and units past it have no steps
(positions past the lengths are zeroed in q, k, v and dO before the call). With a
boolean mask, each step's slot also holds each consumer's tile of the mask (int8, queries
by keys: the tiles stay queries by keys, as with a bias) unless the unit's keys are seen
whole there, and the entries it clears give P = 0 through the scores, and dS = 0
where P is (a hidden value's NaN dP; `common.tile_gradient`'s hidden_ds "p": the tile
is dead once the scores have it; the keys that a row with NaN residuals or a hidden
non-finite value reached are marked, and the Triton dK/dV recomputes them), or P = dS
= 0 selected again where dS is also a bias's gradient. A
mask per key (a key padding mask) or per row is read from global memory instead, each
consumer's keys (`common.KeyRows`) or the step's rows (`common.RowEntries`).

Scope: the Mosaic kernels' (`config.unsupported`), and a bias gradient for a bias of
shape [B, N, T, S] or [1, N, T, S] in the inputs' dtype, or one per key of any broadcast
and dtype (`config.fusable_dbias`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.kernels import cast_varying_like
from pallas_attn.kernels.core import Problem, TileRanges, run_tile_loops, whole_tiles
from pallas_attn.kernels.mosaic.common import (
    Dropout,
    KeyRows,
    RowEntries,
    Segments,
    accumulate,
    along,
    copy_where,
    head_entries,
    head_slope,
    launch,
    optional_refs,
    origin_pair,
    scoped,
    take_turn,
    tile_gradient,
    unsupported,
    work_order,
    work_rounds,
    zero_tile_init,
    zero_tiles_outside,
)
from pallas_attn.kernels.mosaic.config import (
    CONSUMERS,
    ONES_COLUMNS,
    bias_tiles_dtype,
    consumer_registers,
    dkv_scratch,
    dkv_tiles,
    fusable_dbias,
    is_wide,
    key_sums,
    mask_tiles,
    per_row,
    producer_registers,
    sums_batch_tiles,
    with_hash_tables,
)


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """The kernel's geometry: query rows per step, keys per unit, and whether the
    consumers share each unit's keys (`config.is_wide`)."""

    rows: int
    unit: int
    wide: bool

    @staticmethod
    def of(hp: int, hvp: int) -> _Tiles:
        return _Tiles(*dkv_tiles(hp, hvp), is_wide(hp, hvp))

    @property
    def keys(self) -> int:
        """Each consumer's keys of S and dP."""
        return self.unit // CONSUMERS

    @property
    def dbias_keys(self) -> int:
        """The keys of one dbias tile copy: the unit's (wide) or a consumer's."""
        return self.unit if self.wide else self.keys


def _kernel(q_ref, k_ref, v_ref, do_ref, stats_ref, bias_ref, mask_ref, slopes_ref, lengths,
            origin, segments, dropout, scale_ref, dk_ref, dv_ref, dbias_ref, key_sums_ref,
            marks_ref, smem,
            barriers, *,
            problem: Problem, tiles_of: _Tiles, programs: int, passes: int, add_dbias: bool,
            first_entry: int):
    q_smem, do_smem, stats_smem, k_smem, v_smem = (
        smem[name] for name in ("q", "do", "stats", "k", "v"))
    bias_smem, mask_smem, zero_tile = smem["bias"], smem["mask"], smem["zeros"]
    step_loaded, step_consumed, kv_loaded, kv_consumed = (
        barriers[name] for name in ("step_loaded", "step_consumed", "kv_loaded",
                                    "kv_consumed"))
    stages = q_smem.shape[0]
    group = problem.group
    rows_n, unit_n, keys_n = tiles_of.rows, tiles_of.unit, tiles_of.keys
    k_tiles = problem.kv_pad // unit_n
    batch_items = problem.batch // passes
    heads = problem.num_kv_heads * batch_items
    units = work_rounds(k_tiles, heads, programs, problem.pairs_causal_tiles) * passes
    pid, wg = lax.axis_index("program"), lax.axis_index("wg")
    dropout = None if dropout is None else dropout.mine(smem["hashes"], wg)

    def unit_of(u):
        """(valid, b, kh, k0, (first, stop, full_first, full_stop), whole, ranges) of
        unit u of this program (its item's pass u % passes): query tiles [first, stop)
        of the band, [full_first, full_stop) without band masks, and where whole
        (`core.whole_tiles`; None: always) without ids or mask either; the batch entry's
        TileRanges (its key length and offset)."""
        # Key tiles run fastest, so concurrent programs read the same Q and dO and
        # neighbouring bias columns; then batch entries, so the programs running one
        # (KV head, key tile) for several batch entries read a shared bias tile at
        # about the same time, once from memory and the rest from L2, and add their
        # dbias tiles there. Causal: key tiles in mirror pairs, the first (the
        # heaviest) with the last (`common.work_order`).
        r = lax.div(u, passes)
        p = lax.rem(u, passes)
        valid, kt, rest = work_order(r, pid, k_tiles, heads, programs,
                                     problem.pairs_causal_tiles)
        kh = lax.div(rest, batch_items)
        b = lax.rem(rest, batch_items) * passes + p
        k0 = kt * unit_n
        q_lengths, kv_lengths = lengths
        ctx = TileRanges(problem, b, kh,
                         q_length=None if q_lengths is None else q_lengths[b],
                         kv_length=None if kv_lengths is None else kv_lengths[b],
                         origin=origin_pair(origin))
        whole = None
        if segments is None:
            tiles = ctx.query_tiles(k0, k0 + unit_n, rows_n)
        else:
            limits = segments.span(b, k0, unit_n)
            tiles, whole = whole_tiles(
                ctx.query_tiles(k0, k0 + unit_n, rows_n, limits),
                ctx.query_tiles(k0, k0 + unit_n, rows_n, limits,
                                segments.common(b, k0, unit_n)))
        first, stop, full_first, full_stop = tiles
        # An invalid unit (past the last item) gets an empty band.
        stop, full_first, full_stop = (jnp.where(valid, x, first)
                                       for x in (stop, full_first, full_stop))
        return valid, b, kh, k0, (first, stop, full_first, full_stop), whole, ctx

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(producer_registers(CONSUMERS), action="decrease")

        if zero_tile is not None:
            zero_tile_init(zero_tile)

        def stream(u, carry):
            step, loaded_units = carry
            valid, b, kh, k0, (first, stop, full_first, full_stop), whole, _ = unit_of(u)
            tiles = stop - first
            steps = tiles * group
            if zero_tile is not None:
                _zeros_outside_band(zero_tile, dbias_ref, tiles_of, valid, b, kh, k0, first,
                                    stop, group)

            @pl.when(steps > 0)
            def _load_kv():
                @pl.when(loaded_units > 0)
                def _wait_released():
                    plgpu.barrier_wait(kv_consumed)

                for c in range(CONSUMERS):
                    keys = pl.ds(k0 + c * keys_n, keys_n)
                    plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kh], k_smem.at[c], kv_loaded)
                    plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kh], v_smem.at[c], kv_loaded)

            @pl.loop(0, steps)
            def _load(i):
                n = kh * group + lax.div(i, tiles)
                rows = pl.ds((first + lax.rem(i, tiles)) * rows_n, rows_n)
                slot = lax.rem(step + i, jnp.int32(stages))

                @pl.when(step + i >= stages)
                def _wait_released():
                    plgpu.barrier_wait(step_consumed.at[slot])

                loaded = step_loaded.at[slot]
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, n], q_smem.at[slot], loaded)
                plgpu.copy_gmem_to_smem(do_ref.at[b, rows, n], do_smem.at[slot], loaded)
                plgpu.copy_gmem_to_smem(stats_ref.at[b, n, :, rows], stats_smem.at[slot],
                                        loaded)
                masked = None
                if mask_ref is not None:  # a tile the unit's keys see whole reads no mask
                    tile = first + lax.rem(i, tiles)
                    masked = (tile < full_first) | (tile >= full_stop) | ~whole
                for ref, tiles_smem, needed in ((bias_ref, bias_smem, None),
                                                (mask_ref, mask_smem, masked)):
                    if tiles_smem is None:  # none, or a mask per key (read by the consumers)
                        continue
                    bb = b if ref.shape[0] > 1 else 0
                    nb = n if ref.shape[1] > 1 else 0  # one shared by the heads
                    for c in range(CONSUMERS):
                        src = ref.at[bb, nb, rows, pl.ds(k0 + c * keys_n, keys_n)]
                        if needed is None:
                            plgpu.copy_gmem_to_smem(src, tiles_smem.at[slot, c], loaded)
                        else:
                            copy_where(needed, src, tiles_smem.at[slot, c], loaded)

            return step + steps, loaded_units + jnp.where(steps > 0, 1, 0)

        total, loaded_units = lax.fori_loop(0, units, stream, (jnp.int32(0), jnp.int32(0)))

        # Observe the last releases too, so every barrier ends in a phase this
        # warpgroup has seen (the interpreter checks it).
        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _drain(step):
            plgpu.barrier_wait(step_consumed.at[lax.rem(step, jnp.int32(stages))])

        pl.when(loaded_units > 0)(lambda: plgpu.barrier_wait(kv_consumed))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(consumer_registers(CONSUMERS), action="increase")
        # P and dS: the unit's tiles that both consumers fill (wide), else their own.
        p_tiles, ds_tiles = ((smem["p"], smem["ds"]) if tiles_of.wide
                             else (smem["p"].at[wg], smem["ds"].at[wg]))
        ones = None
        if key_sums_ref is not None:  # dS^T times ones: the column sums
            ones = smem["ones"].at[wg]
            ones[...] = plgpu.layout_cast(jnp.ones(ones.shape, ones.dtype), plgpu.Layout.WGMMA)
            plgpu.commit_smem()
        _consume(problem, tiles_of, wg, unit_of, units, add_dbias, first_entry, passes,
                 (slopes_ref, dk_ref, dv_ref, dbias_ref, key_sums_ref, segments, dropout,
                  scale_ref, bias_ref if bias_smem is None else None,
                  mask_ref if mask_smem is None else None, marks_ref),
                 (q_smem, do_smem, stats_smem, bias_smem, mask_smem,
                  k_smem.at[wg], v_smem.at[wg], p_tiles, ds_tiles, ones),
                 (step_loaded, step_consumed, kv_loaded, kv_consumed, barriers["exchange"]))


def _entries(ref, b, n, row0, keys_n: int, rows_n: int, query_dim: int, t) -> jax.Array:
    """A bias's or mask's entries over the step's tile, as stored, where they are read from
    global memory: per key (`KeyRows`, key tile t) or per row (`RowEntries`, the rows
    from row0)."""
    entries = head_entries(ref, b, n)
    if per_row(entries.shape):
        return RowEntries(entries, row0, keys_n, rows_n, query_dim).tile()
    return KeyRows(entries.at[0], keys_n, query_dim=query_dim).tile(t)


def _consume(problem: Problem, tiles_of: _Tiles, wg, unit_of, units, add_dbias: bool,
             first_entry: int, passes: int, refs, buffers, barriers):
    """A consumer's loop over its program's units: dK and dV of its 64 keys per unit
    (wide: of the unit's 64 keys, its half of the head dims); dbias tiles from batch
    entries first_entry on, each pass's additions landed before the next pass's; or,
    for a bias per key, its gradient's column sums into key_sums_ref [B, N, Sp] (float32,
    zeros where a unit sees no query): dS^T times `ones` beside dK's product (each of its
    columns the sums), taken per head; scale_ref: float16 dS's powers of two (`core.DsScales`
    key_scales) or None. key_bias / key_mask: a bias / mask per key or per row, read from
    global memory (`_entries`), or None. marks_ref: [B, K, W, Sp] or None; given, the mask
    and the ids reach only the scores (`tile_gradient`'s hidden_ds "p") and each key's
    row sum of its dk and dv (NaN if either holds one) marks it for the repair."""
    (slopes_ref, dk_ref, dv_ref, dbias_ref, key_sums_ref, segments, dropout, scale_ref,
     key_bias, key_mask, marks_ref) = refs
    has_dbias = dbias_ref is not None
    # Without a dbias or its sums, no output needs the true dS of a tile.
    gain_later = dropout is not None and not has_dbias and key_sums_ref is None
    early_release = problem.plan.dkdv.early_release
    (q_smem, do_smem, stats_smem, bias_smem, mask_smem, k_mine, v_mine, p_tiles, ds_tiles,
     ones) = buffers
    step_loaded, step_consumed, kv_loaded, kv_consumed, exchange = barriers
    stages = q_smem.shape[0]
    group = problem.group
    dtype = q_smem.dtype
    rows_n, keys_n, wide = tiles_of.rows, tiles_of.keys, tiles_of.wide
    hp, hvp = k_mine.shape[-1], v_mine.shape[-1]
    # The head dims of this consumer's dK and dV: all, or its half (wide).
    dk_dims, dv_dims = (hp // CONSUMERS, hvp // CONSUMERS) if wide else (hp, hvp)
    dk_cols, dv_cols = ((pl.ds(wg * dk_dims, dk_dims), pl.ds(wg * dv_dims, dv_dims)) if wide
                        else (slice(None), slice(None)))
    # Keys by queries (S^T = K Q^T; the route's choice): P^T and dS^T are then dV's and
    # dK's A operands straight from registers.
    query_dim = 1 if problem.plan.dkdv.keys_major else 0
    row_layout = along(query_dim)
    shape = (keys_n, rows_n) if query_dim else (rows_n, keys_n)
    reduce_in_registers = problem.interpret  # the interpreter has no reduce-add copies
    # dbias tiles by bulk copy, each whole dS tile by one consumer (wide: both fill it).
    copies_dbias = has_dbias and not reduce_in_registers
    copier = wg == 0 if wide else None

    def as_copier(body):
        if copier is None:
            body()
        else:
            pl.when(copier)(body)

    def half(ref):
        """This consumer's keys of a unit's P or dS tile (wide), else the whole tile."""
        return ref.at[:, pl.ds(wg * keys_n, keys_n)] if wide else ref

    def unit(u, step):
        valid, b, kh, k0, (first, stop, full_first, full_stop), whole, ranges = unit_of(u)
        k_own = k0 + wg * keys_n
        tiles = stop - first
        bb = b if dbias_ref is not None and dbias_ref.shape[0] > 1 else 0

        def dbias_tile(n, t, k_start, size):
            return dbias_ref.at[bb, n, pl.ds(t * rows_n, rows_n), pl.ds(k_start, size)]

        pl.when(tiles > 0)(lambda: plgpu.barrier_wait(kv_loaded))
        last_at = step + tiles * group - 1 if early_release else None
        key_ids = None if segments is None else segments.cols(b, k_own, keys_n, query_dim)
        multipliers = (None if dropout is None
                       else dropout.multipliers(k_own, keys_n, query_dim))

        # float16 dS's power of two for the unit, and its inverse (clamped: a unit past
        # the last item reads one in bounds, for nothing).
        ds_scale = unscale = None
        if scale_ref is not None:
            kh_in = jnp.minimum(kh, problem.num_kv_heads - 1)
            unit_in = jnp.minimum(lax.div(k0, tiles_of.unit), problem.kv_pad // tiles_of.unit - 1)
            ds_scale, unscale = scale_ref[b, kh_in, 0, unit_in], scale_ref[b, kh_in, 1, unit_in]

        def step_fn(i, carry, masked: bool | None, slope):
            """Query tile i of head h (ring step `at`), the head's ALiBi slope."""
            dk, dv, at, h, sums = carry
            slot = lax.rem(at, jnp.int32(stages))
            n = kh * group + h
            row0 = i * rows_n
            ids = (None if key_ids is None or masked is False
                   else (segments.rows(b, row0, query_dim), key_ids))
            row_keys = (None if dropout is None
                        else dropout.row_keys(b, n, row0, rows_n, query_dim))
            plgpu.barrier_wait(step_loaded.at[slot])

            def products(s_ref, dp_ref):
                if query_dim:
                    plgpu.wgmma(s_ref, k_mine, q_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(dp_ref, v_mine, do_smem.at[slot].transpose((1, 0)))
                else:
                    plgpu.wgmma(s_ref, q_smem.at[slot], k_mine.transpose((1, 0)))
                    plgpu.wgmma(dp_ref, do_smem.at[slot], v_mine.transpose((1, 0)))
                # The row residuals and the bias tile come into registers while the
                # products run.
                stats = stats_smem.at[slot]
                residuals = tuple(plgpu.load(stats.at[j], layout=row_layout)
                                  for j in range(3))
                bias = mask = None
                if bias_smem is not None:
                    bias = plgpu.load(bias_smem.at[slot, wg],
                                      layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                if key_bias is not None:
                    bias = _entries(key_bias, b, n, row0, keys_n, rows_n, query_dim,
                                    lax.div(k_own, keys_n)).astype(jnp.float32)
                if mask_smem is not None and masked is not False:
                    mask = plgpu.load(mask_smem.at[slot, wg], layout=plgpu.Layout.WGMMA) != 0
                if key_mask is not None and masked is not False:
                    entries = head_entries(key_mask, b, n)
                    if 1 in entries.shape:  # a mask per key or per row
                        mask = _entries(key_mask, b, n, row0, keys_n, rows_n, query_dim,
                                        lax.div(k_own, keys_n)) != 0
                    else:  # the wide kernel's tiles, which stage none
                        tile = entries.at[pl.ds(row0, rows_n), pl.ds(k_own, keys_n)]
                        mask = plgpu.load(tile, layout=plgpu.Layout.WGMMA,
                                          optimized=False) != 0
                # NOTE: both read here: ptxas places the wait for dP itself, whatever
                # the source order (docs/decisions.md, "Soft cap tanh during dP").
                return s_ref[...], dp_ref[...], residuals, bias, mask

            s, dp, residuals, bias, mask = pl.run_scoped(
                products, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))
            # Dropout's decisions after S and dP, as in the dQ: not live across the products.
            keep = (None if dropout is None
                    else dropout.keep(row_keys, multipliers, query_dim))
            if early_release:  # the last S and dP have read K and V
                pl.when(at == last_at)(lambda: plgpu.barrier_arrive(kv_consumed))
            prob, ds = tile_gradient(problem, s, dp, bias, residuals, row0, k_own, masked,
                                     slope, ids, ranges.kv_length, keep, query_dim, mask,
                                     ranges.offset, ranges.q_length, ds_scale, gain_later,
                                     "mask" if marks_ref is None else "p")
            parity = lax.rem(at, 2)
            ds_tile = ds_tiles.at[parity]
            p_buf = p_tiles.at[parity] if wide else p_tiles
            if query_dim and not problem.interpret:  # P^T and dS^T stay in registers
                p_operand, ds_operand = prob.astype(dtype), ds.astype(dtype)
            else:
                if copies_dbias and not wide:  # the copy issued two steps ago has read it
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                # Wide: these buffers were last read two steps ago, by products that both
                # consumers finished before the last exchange.
                half(p_buf)[...] = prob.astype(dtype)
                half(ds_tile)[...] = ds.astype(dtype)
                plgpu.commit_smem()
                if copies_dbias and wide:  # last step's copy has read what the other fills
                    as_copier(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))
                take_turn(exchange)  # wide: the other consumer's halves are in too
                p_operand, ds_operand = ((p_buf, ds_tile) if query_dim else
                                         (p_buf.transpose((1, 0)), ds_tile.transpose((1, 0))))

            products = [(dv, ((p_operand, do_smem.at[slot, :, dv_cols]),)),
                        (dk, ((ds_operand, q_smem.at[slot, :, dk_cols]),))]
            if sums is not None:
                products.append((sums, ((ds_operand,
                                         ones.at[:ONES_COLUMNS].transpose((1, 0))),)))
            dv, dk, *sums = accumulate(tuple(products), problem.interpret)
            sums = sums[0] if sums else None
            plgpu.barrier_arrive(step_consumed.at[slot])
            if has_dbias:
                def store():
                    if reduce_in_registers:  # each consumer its keys, from registers
                        _add_dbias_in_registers(dbias_tile(n, i, k_own, keys_n), ds,
                                                add_dbias)
                    else:
                        as_copier(lambda: plgpu.copy_smem_to_gmem(
                            ds_tile, dbias_tile(n, i, k0 if wide else k_own,
                                                tiles_of.dbias_keys),
                            reduction_op="add" if add_dbias else None))

                pl.when(b >= first_entry)(store)  # entry 0's may be in already
            return dk, dv, at + 1, h, sums

        acc_rows = tiles_of.unit if wide else keys_n

        def head(h, carry):
            slope = head_slope(slopes_ref, valid, b, kh * group + h)
            sums = None
            if key_sums_ref is not None:
                sums = plgpu.layout_cast(jnp.zeros((acc_rows, ONES_COLUMNS), jnp.float32),
                                         plgpu.Layout.WGMMA)
            dk, dv, at, _, sums = run_tile_loops(
                first, stop, full_first, full_stop,
                lambda i, c, masked: step_fn(i, c, masked, slope), (*carry, h, sums), whole)
            if sums is not None:
                @pl.when(valid if copier is None else valid & copier)
                def _store_sums():  # every column holds the sums (max: NaN shows)
                    keys = pl.ds(k0, acc_rows) if wide else pl.ds(k_own, keys_n)
                    key_sums_ref.at[b, kh * group + h, keys][...] = jnp.max(sums, axis=1)
            return dk, dv, at

        dk = plgpu.layout_cast(jnp.zeros((acc_rows, dk_dims), jnp.float32), plgpu.Layout.WGMMA)
        dv = plgpu.layout_cast(jnp.zeros((acc_rows, dv_dims), jnp.float32), plgpu.Layout.WGMMA)
        dk, dv, step = lax.fori_loop(0, jnp.where(tiles > 0, group, 0), head, (dk, dv, step))
        if not early_release:
            pl.when(tiles > 0)(lambda: plgpu.barrier_arrive(kv_consumed))

        if unscale is not None:
            dk = dk * unscale
        if gain_later:  # dropout's 1 / (1 - rate), left out of P and dS
            dk, dv = dk * problem.dropout_scale, dv * problem.dropout_scale

        @pl.when(valid)
        def _store():
            keys = pl.ds(k0, acc_rows) if wide else pl.ds(k_own, keys_n)
            dk_ref.at[b, keys, kh, dk_cols][...] = (dk * problem.spec.scale).astype(dk_ref.dtype)
            dv_ref.at[b, keys, kh, dv_cols][...] = dv.astype(dv_ref.dtype)
            if marks_ref is not None:  # a NaN row sum: the repair route redoes its tile
                marks_ref.at[b, kh, wg if wide else 0, keys][...] = (
                    jnp.sum(dk, axis=1) + jnp.sum(dv, axis=1))

        if copies_dbias and passes > 1:  # additions in the order of the passes
            as_copier(lambda: plgpu.wait_smem_to_gmem(0))
        return step

    lax.fori_loop(0, units, unit, jnp.int32(0))
    if copies_dbias:  # every dbias copy has landed before the program ends
        as_copier(lambda: plgpu.wait_smem_to_gmem(0))


def _zeros_outside_band(zero_tile, dbias_ref, tiles_of: _Tiles, when, b, kh, k0, first, stop,
                        group: int):
    """Bulk-copy zeros into the item's dbias tiles outside the band (query tiles
    before first or from stop), for every head of the KV head's group."""
    rows_n, width = tiles_of.rows, tiles_of.dbias_keys
    q_tiles = dbias_ref.shape[2] // rows_n
    bb = b if dbias_ref.shape[0] > 1 else 0

    @pl.when(when)
    def _():
        @pl.loop(0, group)
        def _head(h):
            for c in range(tiles_of.unit // width):
                keys = pl.ds(k0 + c * width, width)
                rows = dbias_ref.at[bb, kh * group + h]
                zero_tiles_outside(zero_tile,
                                   lambda t, rows=rows, keys=keys:
                                   rows.at[pl.ds(t * rows_n, rows_n), keys],
                                   first, stop, q_tiles)


def _add_dbias_in_registers(dst, ds, add: bool):
    """Store the dS tile (registers) into dst, or add it to dst's contents (the
    interpreter's stand-in for the bulk copies' reduce-add)."""
    if add:
        old = plgpu.load(dst, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        dst[...] = (old + ds.astype(dst.dtype).astype(jnp.float32)).astype(dst.dtype)
    else:
        dst[...] = ds.astype(dst.dtype)


def sums_batch(problem: Problem, bias_grad: bool) -> bool:
    """Whether `dkdv` writes dbias as a sum over the batch entries in dS tiles
    (`config.sums_batch_tiles`), the case `dbias_first` can start."""
    return bias_grad and sums_batch_tiles(problem.spec, problem.batch)


def dkdv(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array,
         stats: jax.Array, bias: jax.Array | None, bias_grad: bool,
         slopes: jax.Array | None = None, dbias_first: jax.Array | None = None,
         segments: tuple[jax.Array, ...] = (), lengths: tuple[Any, Any] = (None, None),
         dropout_keys: jax.Array | None = None, mask: jax.Array | None = None,
         origin: jax.Array | None = None, ds_scale: jax.Array | None = None
         ) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """(dk, dv, dbias or None, marks or None) for padded inputs; stats: the row residuals
    (`common.row_residuals`); slopes: ALiBi slopes [B, N] or None. bias_grad: also write
    the gradient of the (present) bias (`config.fusable_dbias`). dbias_first: for a bias
    shared by the batch entries, batch entry 0's part of its gradient
    (`dq.dq_and_dbias`), to which the kernel adds the others'. segments: the segment
    operands (`common.segments_of`, query limits) or (); lengths: the query and key
    lengths (`common.lengths_of`), positions past them zeroed in q, k, v and do;
    dropout_keys: dropout's program keys or None; mask: the caller's mask as int8
    (`config.MASK_DTYPE`) or None; origin: the positions of query 0 and key 0 [2] or None;
    ds_scale: with float16, dS's power of two for each unit's keys and its inverse [B, K,
    2, Sp / 128, or 64 at padded head dims above 128] (`core.DsScales` key_scales) or
    None, not with a bias gradient (dbias is dS itself). marks: where the route has a
    repair and no bias gradient is asked for, [B, K, 2 if wide else 1, Sp] float32, NaN
    for the keys whose dk or dv holds one (the mask and the ids then reach only the
    scores: their tile is dead before the gradient math, and the keys a NaN row or a
    hidden non-finite value reached are recomputed by `triton.dkdv.repair`)."""
    name = "mosaic.dkv.dkdv"
    if why := unsupported(problem, "dkdv"):
        raise AssertionError(f"{name} called for an unsupported problem: {why}")
    if bias_grad and not fusable_dbias(bias.shape, batch=problem.batch,
                                       num_heads=problem.num_heads, bias_dtype=bias.dtype,
                                       dtype=problem.dtype):
        raise AssertionError(f"{name} cannot write the dbias of a {bias.dtype} "
                             f"bias of shape {bias.shape}")
    route = problem.plan.dkdv
    B, Tp, N, hp = q.shape
    _, Sp, KH, hvp = v.shape
    tiles_of = _Tiles.of(hp, hvp)
    if (route.block_q, route.block_k) != (tiles_of.rows, tiles_of.unit):
        raise AssertionError(f"{name} needs (block_q, block_k) = "
                             f"{(tiles_of.rows, tiles_of.unit)}: {route}")
    if route.keys_major and (bias is not None or mask_tiles(problem.spec) or tiles_of.wide):
        raise AssertionError(f"{name} computes keys by queries only without a bias or "
                             f"mask tiles, and not above head dim 128: {route}")
    if ds_scale is not None and bias_grad:
        raise AssertionError(f"{name} scales no dS that is also the bias's gradient")
    marked = route.repair is not None and not bias_grad
    # A bias shared by the batch entries gets their dS tiles added into one buffer
    # (dbias_first, else zeros), a mutable operand of the kernel: by one program running
    # an item's batch entries as passes (a fixed order of additions; the interpreter,
    # without reduce-add copies, always), or by concurrent programs (the route's
    # any_order).
    add_dbias = sums_batch(problem, bias_grad)
    if dbias_first is not None and not (add_dbias and dbias_first.shape == bias.shape):
        raise AssertionError(f"{name} takes dbias_first only for a bias shared by "
                             f"{B} batch entries and of its shape, got {dbias_first.shape} "
                             f"for a bias of shape {bias.shape}")
    passes = B if add_dbias and (problem.interpret or not problem.plan.dbias.any_order) else 1
    first_entry = int(dbias_first is not None)
    dbias_sum = (jax.new_ref(jnp.zeros(bias.shape, bias.dtype) if dbias_first is None
                             else dbias_first) if add_dbias else None)
    # A bias per key: dS's column sums per batch entry and head, summed over the bias's
    # broadcast axes below; zeros where a unit sees no query.
    per_key_grad = bias_grad and key_sums(problem.spec)
    sums = jax.new_ref(jnp.zeros((B, N, Sp), jnp.float32)) if per_key_grad else None
    optional = (bias, mask, slopes, dbias_sum, sums, dropout_keys, origin, ds_scale, *lengths)
    scratch = with_hash_tables(
        lambda tables: dkv_scratch(
            hp, hvp, route.num_stages, q.dtype,
            bias_tiles_dtype(problem.spec, None if bias is None else bias.dtype),
            zeros=bias_grad and not (add_dbias or per_key_grad),
            has_mask=mask_tiles(problem.spec), ones=per_key_grad, dropout=tables),
        dropout_keys is not None, problem.plan.device.max_shared_memory_per_block)

    def entry(*refs):
        q_ref, k_ref, v_ref, do_ref, stats_ref, *rest = refs
        (bias_ref, mask_ref, slopes_ref, sum_ref, sums_ref, keys_ref, origin_ref, scale_ref,
         *length_refs) = optional_refs(rest, *optional)
        rest = rest[sum(x is not None for x in optional):]
        segment_refs, (dk_ref, dv_ref, *outputs) = rest[:len(segments)], rest[len(segments):]
        marks_ref = outputs.pop() if marked else None
        dbias_ref = sum_ref if add_dbias else (outputs[0] if outputs else None)
        scoped(scratch, lambda smem, barriers: _kernel(
            q_ref, k_ref, v_ref, do_ref, stats_ref, bias_ref, mask_ref, slopes_ref,
            tuple(length_refs), origin_ref,
            Segments.of(tuple(segment_refs)),
            None if dropout_keys is None else Dropout(keys_ref, problem.spec.dropout_rate,
                                                      origin_ref),
            scale_ref, dk_ref, dv_ref, dbias_ref, sums_ref, marks_ref, smem, barriers,
            problem=problem, tiles_of=tiles_of, programs=programs, passes=passes,
            add_dbias=add_dbias, first_entry=first_entry))

    programs = problem.plan.programs_for(Sp // tiles_of.unit * KH * (B // passes))
    out_type = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if bias_grad and not (add_dbias or per_key_grad):
        out_type.append(jax.ShapeDtypeStruct(bias.shape, bias.dtype))
    if marked:
        out_type.append(jax.ShapeDtypeStruct((B, KH, 2 if tiles_of.wide else 1, Sp),
                                             jnp.float32))
    operands = [q, k, v, do, stats, *(x for x in optional if x is not None), *segments]
    dk, dv, *outputs = launch(entry, out_type, programs, problem.interpret)(*operands)
    marks = outputs.pop() if marked else None
    if add_dbias:  # summed through a mutable ref, not one of the kernel's typed results
        return dk, dv, cast_varying_like(jax.freeze(dbias_sum), operands), marks
    if per_key_grad:
        broadcast = tuple(axis for axis in (0, 1) if bias.shape[axis] == 1)
        dbias = jnp.sum(jax.freeze(sums), axis=broadcast, keepdims=True)[:, :, None]
        return dk, dv, cast_varying_like(dbias.astype(bias.dtype), operands), marks
    return dk, dv, outputs[0] if outputs else None, marks
