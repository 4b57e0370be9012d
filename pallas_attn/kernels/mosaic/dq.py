"""dQ kernel for Hopper (Pallas, Mosaic GPU backend): warp-specialised, persistent.

It walks work items of 64 query rows per consumer warpgroup (`common.Walk`: rows
of one batch entry and head, one program per multiprocessor), with the plan's
consumer warpgroups: three, or two with a bias or a local window
(`config.dq_consumers`):

* The producer warpgroup streams each item's band of K and V tiles
  (`config.DQ_TILES`: 64 keys) into a ring of the route's slots, as the forward
  does.
* Each consumer takes 64 rows. Per item it copies its rows of Q, dO and the row
  residuals (row reference, log2 row sum, delta) into buffers of its own; per key
  tile it computes S = Q K^T and dP = dO V^T with wgmma, P and dS from the residuals
  and the shared score rules (`common.tile_gradient`), and adds dS K into its dQ
  accumulator with a third wgmma that takes dS from registers (from shared memory
  where a dbias copy reads it too, and in the interpreter). The bias comes
  through each consumer's own buffer one tile ahead (`common.BiasTiles`); a bias or a
  mask per key from global memory, the key tile's row (`common.KeyRows`); per row, the
  consumer's rows (`common.RowEntries`).
* Three consumers (items of 192 rows) run without turns: while two compute their
  exponentials and soft-cap tanh, the third's products keep the tensor cores busy
  (docs/decisions.md, "Three dQ consumers"). Items end at the padded length, so the first item of
  a head may start before row 0; the consumers whose rows lie there only release
  the ring's slots. Two consumers (items of 128 rows) take turns on the tensor cores
  (`common.Turns`, meeting on one barrier: the forward's looser turns measured slower
  here).

At a padded head dim above 128 (`config.is_wide`) one consumer's dQ rows over them
and its Q and dO would not fit: both consumers work on items of 64 rows, each
computing S, dP and dS for half of a tile's keys (over the whole head dim), writing
its half of the tile's dS (two tiles used in turn, swizzled so a half is whole tiles,
`config.operand_swizzle`) and, after an exchange (a barrier both pass once per tile),
adding dS K for its half of dQ's columns. They meet once more at the end of each item
before its rows' buffers are refilled.

dQ (times the softmax scale) is stored from registers. Rows that see no key get
zeros. With segment ids (or a mask: its ranges), items and consumers narrow their key
tiles to what their rows see, and the tiles outside what they see whole compare ids
and read the mask (`common.Segments`, `common.own_band`); with sequence lengths,
bands stop at the key length (positions past the lengths are zeroed in q, k, v and dO
before the call); with dropout, dS takes the kept dP (`common.Dropout`); with a
boolean mask,
the producer copies each consumer's rows (wide: its keys) of the key tile's mask (int8)
into the ring slot with K where a consumer reads it (`Walk.stream`), and the entries it
clears give P = 0 through the scores (`common.mask_tile`). Scope: the Mosaic kernels'
(`config.unsupported`).

`dq_and_dbias` also starts the gradient of a bias shared by the batch entries: the
consumers bulk-copy batch entry 0's dS tiles (already staged in shared memory for
dS K) into a dbias of the bias's shape, running the whole band of the item for it
(tiles outside a consumer's own rows' band masked, so their dS is 0), and the
producer bulk-copies a zeroed tile to the tiles outside the band. The Mosaic dK/dV
kernel then adds the other entries' dS tiles to it (`dkv.dkdv`), so the sum needs
no zeroed buffer and entry 0's tiles are written, not added.

`dq_and_score_rows` also sums, per row over its keys, dS, P times the soft cap's slope
and (under a cap) P dP, for the gradient of a bias broadcast along keys, which
`kernels.vjp` forms from them (the dbias kernel would recompute S and dP for it).

A NaN or inf key hidden from a row inside a tile reaches its dq through dS K, and a
hidden value through dP (P is 0 there, but dS = P dP is not selected again: one select
per entry, the score's, is all the mask, the ids and the band cost in this kernel):
each consumer marks its rows whose dq holds a NaN (a NaN row sum, an output of its own)
and the Triton kernel `triton/dq.py` repair recomputes the tiles holding a mark. Where
the dS tiles are also the bias's gradient (`dq_and_dbias`), hidden entries' dS are
zeroed as in the other kernels, and so are they where its rows' sums are taken.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.kernels.core import Problem
from pallas_attn.kernels.mosaic.common import (
    Dropout,
    Segments,
    Turns,
    Walk,
    accumulate,
    await_turn,
    head_slope,
    launch,
    mask_tile,
    optional_refs,
    own_band,
    pass_turn,
    release_slot,
    run_band,
    scoped,
    take_turn,
    tile_gradient,
    unsupported,
    zero_tile_init,
    zero_tiles_outside,
)
from pallas_attn.kernels.mosaic.config import (
    ROWS_PER_CONSUMER,
    bias_tiles_dtype,
    consumer_registers,
    dq_scratch,
    dq_tiles,
    fusable_dbias,
    is_wide,
    mask_tiles,
    with_hash_tables,
)


def _kernel(q_ref, k_ref, v_ref, do_ref, stats_ref, bias_ref, mask_ref, slopes_ref, lengths,
            origin, segments, dropout, dq_ref, dbias_ref, rows_ref, marks_ref, smem, barriers, *,
            problem: Problem, programs: int, consumers: int, wide: bool):
    rows_loaded = barriers["rows_loaded"]
    turns = Turns.of(barriers["schedule"], problem, "meet")
    scaled = stats_ref.shape[2] == 4  # float16 dS's row scales (common.row_residuals)
    exchange = barriers["exchange"]
    ring = tuple(barriers[name] for name in ("k_loaded", "v_loaded", "k_consumed",
                                              "v_consumed"))
    route = problem.plan.dq
    block_k = route.block_k
    rows_n = ROWS_PER_CONSUMER
    # Wide: both consumers work on one item's 64 rows, else each on 64 of its own.
    row_blocks = 1 if wide else consumers
    walk = Walk(problem, programs, block_k, route.num_stages, row_blocks * rows_n, segments,
                lengths, origin, shared=wide)
    wg = lax.axis_index("wg")
    dropout = None if dropout is None else dropout.mine(smem["hashes"], wg)
    owner = 0 if wide else wg  # of the rows' buffers and barrier
    on_item = None
    if dbias_ref is not None:
        # The producer writes batch entry 0's dbias tiles outside each item's band.
        zero_tile = smem["zeros"]
        pl.when(wg == consumers)(lambda: zero_tile_init(zero_tile))

        def on_item(item, tiles, steps):
            for c in range(row_blocks):  # rows before 0: a consumer idle in the first item
                row0 = item.q0 + c * rows_n

                @pl.when(item.valid & (item.b == 0) & (row0 >= 0))
                def _(row0=row0):
                    rows = dbias_ref.at[0, item.n, pl.ds(row0, rows_n)]
                    zero_tiles_outside(
                        zero_tile, lambda t: rows.at[:, pl.ds(t * block_k, block_k)],
                        tiles.first, tiles.first + steps, dbias_ref.shape[3] // block_k)

    walk.produce(wg, k_ref, v_ref, smem["k"], smem["v"], ring, on_item,
                 None if smem["mask"] is None else (mask_ref, smem["mask"]))
    if dbias_ref is not None:
        pl.when(wg == consumers)(lambda: plgpu.wait_smem_to_gmem(0))

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(consumer_registers(consumers), action="increase")
        mine = {name: smem[name].at[owner] for name in ("q", "do", "stats")}
        # dS: two tiles both consumers fill, used in turn (wide), else its own.
        ds_tiles = smem["ds"] if wide else smem["ds"].at[wg]
        hp = mine["q"].shape[-1]
        dims = hp // consumers if wide else hp  # this consumer's columns of dQ
        cols = pl.ds(wg * dims, dims) if wide else slice(None)

        def rows_of(item):
            return item.q0 + (0 if wide else wg * rows_n)

        def load_rows(item):
            row0 = rows_of(item)
            issue = item.valid & (row0 >= 0)
            if wide:
                issue = issue & (wg == 0)

            @pl.when(issue)
            def _():
                rows = pl.ds(row0, rows_n)
                loaded = rows_loaded.at[owner]
                plgpu.copy_gmem_to_smem(q_ref.at[item.b, rows, item.n], mine["q"], loaded)
                plgpu.copy_gmem_to_smem(do_ref.at[item.b, rows, item.n], mine["do"], loaded)
                plgpu.copy_gmem_to_smem(stats_ref.at[item.b, item.n, :, rows], mine["stats"],
                                        loaded)

        load_rows(walk.item(0))
        # Two consumers take turns: consumer 1 starts a turn behind consumer 0 and
        # consumer 0 takes that turn at the end.
        pl.when(wg == 1)(lambda: await_turn(turns))
        row_layout = plgpu.Layout.WGMMA.reduce(1)

        def work(r, step):
            item = walk.item(r)
            ctx, tiles, steps = walk.band(item)
            row0 = rows_of(item)
            mine_valid = item.valid & (row0 >= 0)  # rows before 0: nothing to do
            pl.when(mine_valid)(lambda: plgpu.barrier_wait(rows_loaded.at[owner]))
            residuals = tuple(plgpu.load(mine["stats"].at[j], layout=row_layout)
                              for j in range(3))
            # float16: 2^e, the power of two P and dS came out divided by (core.ds_scales)
            unscale = (plgpu.load(mine["stats"].at[3], layout=row_layout)
                       if scaled else None)
            plgpu.commit_smem()  # the reads are done before the next item's copy lands
            bias = walk.bias_rows(bias_ref, item, row0, smem["bias"], barriers["bias_loaded"])
            dbias = None
            if dbias_ref is not None:  # batch entry 0 writes its dS tiles as dbias
                dbias = (mine_valid & (item.b == 0),
                         dbias_ref.at[0, item.n, pl.ds(row0, rows_n)])
            dq, sums = _consume(problem, ctx, tiles, lambda t: step + t - tiles.first, row0,
                                tiles.first + steps, mine, ds_tiles, smem["k"], smem["v"],
                                ring, (turns, exchange),
                                (bias, walk.mask_rows(mask_ref, item, smem["mask"], row0)),
                                head_slope(slopes_ref, item.valid, item.b, item.n), residuals,
                                dbias, row0 >= 0, segments, dropout, item.b, item.n, cols,
                                repaired=marks_ref is not None,
                                score_rows=None if rows_ref is None else rows_ref.shape[3])
            if scaled:
                dq = dq * lax.broadcast_in_dim(unscale, dq.shape, [0])
            if dropout is not None and dbias_ref is None:  # left out of dS (_consume)
                dq = dq * problem.dropout_scale
            # Every product of this item is done: its rows' buffers are free (wide: for
            # both consumers once they meet here).
            take_turn(exchange)
            load_rows(walk.item(r + 1))

            @pl.when(mine_valid)
            def _store():
                dq_ref.at[item.b, pl.ds(row0, rows_n), item.n, cols][...] = (
                    dq * problem.spec.scale).astype(dq_ref.dtype)
                if marks_ref is not None:  # a NaN row sum: the repair route reruns its tile
                    marks = marks_ref.at[item.b, item.n, wg if wide else 0]
                    marks.at[pl.ds(row0, rows_n)][...] = jnp.sum(dq, axis=1)
                for j, x in enumerate(sums):  # wide: each consumer's keys apart
                    rows_ref.at[item.b, item.n, wg if wide else 0, j,
                                pl.ds(row0, rows_n)][...] = x

            return step + steps

        lax.fori_loop(0, walk.rounds, work, jnp.int32(0))
        pl.when(wg == 0)(lambda: pass_turn(turns))
        if dbias_ref is not None:
            plgpu.wait_smem_to_gmem(0)


def _consume(problem: Problem, ctx, tiles, step_of, row0, stop, mine: dict, ds_tiles,
             k_smem, v_smem, ring, barriers, streams, slope, residuals, dbias, active,
             segments: Segments | None, dropout: Dropout | None, b, n, cols,
             repaired: bool = False, score_rows: int | None = None
             ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """One consumer warpgroup: dQ / scale of rows [row0, row0 + 64) (float32) over key
    tiles [tiles.first, stop), its columns `cols` of it; step_of(t): the ring step of
    tile t (counted over the program's items); active false (rows before 0): it only
    releases the tiles. barriers: (`Turns`, exchange), either None. streams: (its bias
    stream (`BiasTiles`, or `KeyRows` per key), the mask as it reads it
    (`Walk.mask_rows`)), either None.

    With `Turns` (two consumers, kind "meet") it takes turns with the other consumer: a
    consumer issues S and dP, waits for the other's gradient math, computes its own P
    and dS while the other's products run, then adds dS K once the other has issued its
    S and dP.
    With an `exchange` (wide: both consumers on the same rows) each computes S, dP and
    dS for half of a tile's keys, writes its half of the tile's dS (two tiles used in
    turn) and, once both halves are in, adds dS K for its columns of dQ; consumer 0
    stores the dbias tiles.

    dbias: (when, its rows of the dbias) or None; when, the consumer stores its dS
    tiles of the item's band there, running every tile of the band (those outside its
    own rows' band masked: dS = 0). segments: the segment ids (of batch entry b) or
    None; dropout: head n's keep decisions or None. repaired: rows whose dQ holds a NaN
    are marked and recomputed, so dS is not selected again (`tile_gradient`'s hidden_ds
    "none": a hidden non-finite value leaves a NaN in the row, which the repair redoes),
    except where its tiles are also the bias's gradient or summed along its rows.
    score_rows: how many of `tile_gradient`'s row terms to sum over the tiles (a bias
    per row's gradient, `dq_and_score_rows`), or None. Returns (dQ / scale, the sums)."""
    k_loaded, v_loaded, k_consumed, v_consumed = ring
    turns, exchange = barriers
    bias, mask = streams
    wide = exchange is not None
    block_k = problem.plan.dq.block_k
    rows_n = ROWS_PER_CONSUMER
    wg = lax.axis_index("wg")
    keys_n = block_k // 2 if wide else block_k  # this consumer's keys of S and dP
    key0 = wg * keys_n if wide else 0
    copier = wg == 0 if wide else True  # of the dbias tiles
    own = own_band(ctx, tiles, row0, stop, block_k, segments)
    own = own.idle_unless(active, tiles.first)
    if dbias is not None:
        whole = dbias[0]
        own = dataclasses.replace(own, first=jnp.where(whole, tiles.first, own.first),
                                  stop=jnp.where(whole, stop, own.stop))
    shape = (rows_n, keys_n)
    row_ids = None if segments is None else segments.rows(b, row0)
    row_keys = None if dropout is None else dropout.row_keys(b, n, row0)
    stages = k_smem.shape[0]

    def slot_of(t):
        return lax.rem(step_of(t), jnp.int32(stages))

    def step(t, carry, masked: bool | None):
        dq, sums = carry
        slot = slot_of(t)
        k0 = t * block_k + key0
        tile_bias = None if bias is None else bias.take(t, own.stop)
        ids = (None if row_ids is None or masked is False
               else (row_ids, segments.cols(b, k0, keys_n)))
        plgpu.barrier_wait(k_loaded.at[slot])
        plgpu.barrier_wait(v_loaded.at[slot])
        tile_mask = mask_tile(mask, slot, t, masked)
        keys = pl.ds(key0, keys_n)

        def products(s_ref, dp_ref):
            plgpu.wgmma(s_ref, mine["q"], k_smem.at[slot, keys].transpose((1, 0)))
            plgpu.wgmma(dp_ref, mine["do"], v_smem.at[slot, keys].transpose((1, 0)))
            pass_turn(turns)
            return s_ref[...], dp_ref[...]

        s, dp = pl.run_scoped(products, plgpu.ACC(shape, jnp.float32),
                              plgpu.ACC(shape, jnp.float32))
        plgpu.barrier_arrive(v_consumed.at[slot])
        keep = (None if dropout is None
                else dropout.keep(row_keys, dropout.multipliers(k0, keys_n)))
        clean = dbias is not None or score_rows is not None  # hidden entries' dS selected
        _, ds, *terms = tile_gradient(problem, s, dp, tile_bias, residuals, row0, k0, masked,
                                      slope, ids, ctx.kv_length, keep, mask=tile_mask,
                                      offset=ctx.offset, gain_later=dbias is None,
                                      hidden_ds="none" if repaired and not clean else "mask",
                                      row_terms=score_rows is not None,
                                      unseen_rows=clean and ctx.q_length is not None)
        if terms:
            sums = tuple(x + y for x, y in zip(sums, terms[0], strict=True))
        ds_tile = ds_tiles.at[lax.rem(step_of(t), 2)] if wide else ds_tiles
        if dbias is not None and not wide:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last dbias copy read ds
        ds_operand = ds.astype(ds_tile.dtype)
        # dS is dS K's A operand from registers, unless both consumers' halves meet in
        # shared memory (wide), a dbias copy reads it there, or the interpreter (whose
        # wgmma reads shared memory only) runs it.
        if wide or dbias is not None or problem.interpret:
            ds_tile.at[:, keys][...] = ds_operand
            plgpu.commit_smem()
            ds_operand = ds_tile
        if dbias is not None and wide:  # last tile's copy has read what the other fills next
            pl.when(copier)(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))
        # Wide: both halves are in, and the products that last read this tile (two
        # steps back) are done.
        take_turn(exchange)
        if dbias is not None:
            pl.when(dbias[0] & copier)(lambda: plgpu.copy_smem_to_gmem(
                ds_tile, dbias[1].at[:, pl.ds(t * block_k, block_k)]))
        await_turn(turns)  # the other consumer has issued its products
        # NOTE: not left in flight across tiles: ptxas then injects waits of its own
        # (docs/decisions.md, "dS K left in flight").
        (dq,) = accumulate(((dq, ((ds_operand, k_smem.at[slot, :, cols]),)),),
                           problem.interpret)
        plgpu.barrier_arrive(k_consumed.at[slot])
        return dq, sums

    dims = k_smem.shape[-1] // 2 if wide else k_smem.shape[-1]
    dq = plgpu.layout_cast(jnp.zeros((rows_n, dims), jnp.float32), plgpu.Layout.WGMMA)
    row_zeros = plgpu.layout_cast(jnp.zeros((rows_n,), jnp.float32),
                                  plgpu.Layout.WGMMA.reduce(1))
    sums = (row_zeros,) * (score_rows or 0)
    if bias is not None:
        pl.when(own.first < own.stop)(lambda: bias.start(own.first))
    return run_band(tiles.first, stop, own, lambda t: release_slot(slot_of(t), ring, turns),
                    step, (dq, sums))


def dq(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array,
       stats: jax.Array, bias: jax.Array | None, slopes: jax.Array | None = None,
       segments: tuple[jax.Array, ...] = (), lengths: tuple[Any, Any] = (None, None),
       dropout_keys: jax.Array | None = None, mask: jax.Array | None = None,
       origin: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """(dq [B, Tp, N, Hp], marks) for padded inputs; marks: where the plan's dQ route has a
    repair, float32 [B, N, 2 if wide else 1, Tp], NaN for rows whose dq holds one (each
    wide consumer's columns apart), else None; stats: the row residuals
    (`common.row_residuals`); slopes: ALiBi slopes [B, N] or None; segments: the
    segment operands (`common.segments_of`, key limits) or (); lengths: the query and
    key lengths (`common.lengths_of`), positions past them zeroed in q, k, v and do;
    dropout_keys: dropout's program keys or None; mask: the caller's mask as int8
    (`config.MASK_DTYPE`) or None; origin: the positions of query 0 and key 0 [2] or None;
    stats with a fourth row (`common.row_residuals` with float16 dS's row scales): P and
    dS come out times 2^-e, dq rows are multiplied by 2^e, the fourth row."""
    dq_out, _, marks = _launch(problem, q, k, v, do, stats, bias, slopes, segments, lengths,
                               dropout_keys, mask, origin, False)
    return dq_out, marks


def dq_and_score_rows(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array,
                      do: jax.Array, stats: jax.Array, bias: jax.Array,
                      slopes: jax.Array | None = None, segments: tuple[jax.Array, ...] = (),
                      lengths: tuple[Any, Any] = (None, None),
                      dropout_keys: jax.Array | None = None, mask: jax.Array | None = None,
                      origin: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(dq, rows, marks) for padded inputs: `dq`, with each row's sums over its keys of
    dS, of P times the soft cap's slope and, with a soft cap, of P dP (float32
    [B, N, 2 if wide else 1, 2 or 3, Tp]: wide consumers' keys apart; in dS's units,
    `tile_gradient` with gain_later), from which a bias broadcast along keys takes its
    gradient (`kernels.vjp`)."""
    return _launch(problem, q, k, v, do, stats, bias, slopes, segments, lengths,
                   dropout_keys, mask, origin, False, score_rows=True)


def dq_and_dbias(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array,
                 stats: jax.Array, bias: jax.Array, slopes: jax.Array | None = None,
                 segments: tuple[jax.Array, ...] = (), lengths: tuple[Any, Any] = (None, None),
                 dropout_keys: jax.Array | None = None, mask: jax.Array | None = None,
                 origin: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(dq, batch entry 0's part of the gradient of a bias shared by the batch entries,
    marks) for padded inputs: `dq`, with the dS tiles of batch entry 0 stored as a dbias of
    the bias's shape [1, N, Tp, Sp] (and zeros outside the bands). The dK/dV kernel
    adds the other entries' to it (`dkv.dkdv`'s dbias_first)."""
    if not fusable_dbias(bias.shape, batch=1, num_heads=problem.num_heads,
                         bias_dtype=bias.dtype, dtype=problem.dtype):
        raise AssertionError(f"mosaic.dq.dq_and_dbias cannot write the dbias of a "
                             f"{bias.dtype} bias of shape {bias.shape}")
    return _launch(problem, q, k, v, do, stats, bias, slopes, segments, lengths,
                   dropout_keys, mask, origin, True)


def _launch(problem: Problem, q, k, v, do, stats, bias, slopes, segments: tuple,
            lengths: tuple, keys, mask, origin, with_dbias: bool, score_rows: bool = False
            ) -> tuple:
    if why := unsupported(problem, "dq"):
        raise AssertionError(f"mosaic.dq.dq called for an unsupported problem: {why}")
    route = problem.plan.dq
    B, Tp, N, hp = q.shape
    hvp = v.shape[-1]
    tiles = dq_tiles(hp, hvp)
    if (route.block_q, route.block_k) != tiles:
        raise AssertionError(f"mosaic.dq.dq needs (block_q, block_k) = {tiles}: {route}")
    consumers = route.consumers
    wide = is_wide(hp, hvp)
    marked = route.repair is not None
    optional = (bias, mask, slopes, keys, origin, *lengths)
    scratch = with_hash_tables(
        lambda tables: dq_scratch(
            hp, hvp, route.block_k, route.num_stages, consumers, q.dtype,
            bias_tiles_dtype(problem.spec, None if bias is None else bias.dtype),
            dbias=with_dbias, has_mask=mask_tiles(problem.spec), stats_rows=stats.shape[2],
            dropout=tables),
        keys is not None, problem.plan.device.max_shared_memory_per_block)

    def entry(q_ref, k_ref, v_ref, do_ref, stats_ref, *refs):
        bias_ref, mask_ref, slopes_ref, keys_ref, origin_ref, *length_refs = (
            optional_refs(refs, *optional))
        refs = refs[sum(x is not None for x in optional):]
        segment_refs, (dq_ref, *outputs) = refs[:len(segments)], refs[len(segments):]
        dbias_ref = outputs.pop(0) if with_dbias else None
        rows_ref = outputs.pop(0) if score_rows else None
        marks_ref = outputs.pop(0) if marked else None
        scoped(scratch, lambda smem, barriers: _kernel(
            q_ref, k_ref, v_ref, do_ref, stats_ref, bias_ref, mask_ref, slopes_ref,
            tuple(length_refs), origin_ref,
            Segments.of(tuple(segment_refs)),
            None if keys is None else Dropout(keys_ref, problem.spec.dropout_rate, origin_ref),
            dq_ref, dbias_ref, rows_ref, marks_ref, smem, barriers, problem=problem,
            programs=programs, consumers=consumers, wide=wide))

    item_rows = tiles[0] if wide else consumers * ROWS_PER_CONSUMER
    items = -(-Tp // item_rows) * B * N
    programs = problem.plan.programs_for(items)
    operands = [q, k, v, do, stats, *(x for x in optional if x is not None), *segments]
    out_type = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if with_dbias:
        out_type.append(jax.ShapeDtypeStruct(bias.shape, bias.dtype))
    if score_rows:
        terms = 2 if problem.spec.logits_soft_cap is None else 3
        out_type.append(jax.ShapeDtypeStruct((B, N, consumers if wide else 1, terms, Tp),
                                             jnp.float32))
    if marked:
        out_type.append(jax.ShapeDtypeStruct((B, N, consumers if wide else 1, Tp), jnp.float32))
    results = list(launch(entry, out_type, programs, problem.interpret, consumers)(*operands))
    return (results.pop(0), results.pop(0) if with_dbias or score_rows else None,
            results.pop(0) if marked else None)
