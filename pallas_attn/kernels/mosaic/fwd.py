"""Forward kernel for Hopper (Pallas, Mosaic GPU backend): warp-specialised, persistent.

The work is items of 64 query rows per consumer warpgroup of one (batch entry,
head): two consumers (items of 128 rows), or three (192 rows) where each one's
accumulator and scores fit a third of the registers and there is no bias
(`config.forward_consumers`: head dims up to 64, or up to 160 with values up to 64 or
with 64-key tiles). One
program per multiprocessor loops over items (`common.Walk`: query tiles fastest,
causal tiles in mirror pairs so that every program does the same work; items
end at the padded length, so with three consumers a head's first item may start
before row 0, and the consumers whose rows lie there only release the ring's
slots) with a producer warpgroup and the consumers:

* The last warpgroup, the producer, streams K and V tiles with the bulk copy engine
  into a ring of `num_stages` shared-memory slots. Each slot has a "loaded" barrier
  (copy completion) and a "consumed" barrier (every consumer is done with it).
  The ring runs on across items, so the next item's first tiles load while the
  consumers finish the current one.
* The consumers each take 64 rows. They compute S = Q K^T with wgmma into
  registers, apply the shared score and visibility rules
  (semantics/scores.py) and the online softmax step (`core.softmax_step`: log2
  units, the running row maximum or the soft cap's bound) and accumulate P V onto
  the output accumulator with a second wgmma that takes P from registers (the
  interpreter's wgmma reads shared memory only: there P goes through P's buffer,
  which otherwise only stages the output). Two consumers take turns on the tensor
  cores (`common.Turns`, FlashAttention-3's ping-pong), so one
  consumer's softmax overlaps the other's products; three take no turns (while two
  compute exponentials, the third's products keep the tensor cores busy). The next
  item's Q is loaded as soon as the last Q K^T of an item is done, and the output
  leaves through a bulk copy (staged in P's buffer when shapes agree) that overlaps
  the next item; the row residuals are stored from registers. Where the output has no
  room of its own (head dim 256; 160 on 128-key tiles, 192 and 224 on 96-key ones,
  `config.forward_output_staging`) it is staged in Q's buffer and the next Q loads
  once it has left.
* With segment ids (or a mask), each item's and each consumer's band narrows to the
  keys its rows see (`common.Segments`: chunk limits from core.segment_ranges or
  core.mask_ranges); the tiles inside what every row of a consumer sees whole (sorted
  ids, runs of whole mask chunks) run like unmasked ones, and the others compare the
  rows' ids (read once per item) with the key tile's and apply the mask.
* With dropout, P V takes the kept probabilities (`common.Dropout`: the keep hash
  of semantics/dropout.py on each tile) while the row sum takes all of them; the
  output is scaled by 1 / (1 - rate) once per row.
* With a bias, each consumer copies its 64 rows of the next key tile's bias into a
  buffer of its own while it works on the current tile (`_consume`), and its
  scores stay in natural units, as in the Triton forward. A bias per key ([B or 1,
  N or 1, 1, S]) is read from global memory, the key tile's row (`common.KeyRows`); one
  broadcast along keys ([..., T or 1, 1]), the consumer's rows (`common.RowEntries`).
* With a boolean mask, the producer copies each consumer's rows of the key tile's
  mask, as int8 (`config.MASK_DTYPE`: the mask is converted once per call), into the
  ring slot with K, except in the tiles every row of the item sees whole, and the
  other tiles hide the entries the mask clears. A mask per key (a key padding mask,
  [B or 1, N or 1, 1, S]) or per row is read like a bias per key or per row.

It writes the same outputs as the Triton forward: the output and the per-row
residuals (row reference, +inf for rows that see no key, and log2 of the row
sum), so the Triton backward kernels consume them unchanged. Where keys can be hidden
inside a tile (causal, a window, a mask, segments), a NaN or inf value of a hidden key
poisons the products of the rows sharing its tile: a row whose output holds a NaN gets a
NaN log2 row sum, and `triton/fwd.py` repair recomputes the tiles holding such marks.

Scope (config.unsupported): 16-bit inputs, padded head dims 16 to 256 (Plan.head_dims), no
operand besides q, k, v, a bias and a mask with their own entry per key, ALiBi
slopes, sinks, segment ids, sequence lengths, dropout keys and an origin (positions past
the lengths are zeroed before the call, vjp.prepare; ring attention's blocks count every
position from their origin: `core.TileRanges`, `common.Dropout`); causal, local windows in
both alignments, soft cap, ALiBi (each consumer reads its item's slope), GQA and ragged
lengths are covered. Key tiles hold 128 keys, or 64 where 128-key slots do not fit (a
float32 bias tile at head dim 128, config.forward_scratch); above head dim 128 the
widest of 128, 96 and 64 that fits (`config.forward_block_k_options`; 96 not with a
bias, mask or segment ids). A 96-key tile may end past the keys' padding (a multiple of
the power-of-two tiles): its bulk copies fill zeros there and the scores' bound hides
those keys (`common.tile_scores`).

Key tiles outside an item's band are never loaded. A consumer whose own band is
narrower than the item's (causal: warpgroup 0 can end a key tile earlier) still
waits on and releases the slots it skips, so the barrier phases of both consumers
stay in step with the producer. Persistence, the turns and the bias buffers were
each measured faster; pairing causal tiles with their mirrors, as the Triton forward
does, was not (docs/decisions.md, "Hopper forward").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.kernels.core import (
    MAX_FLOOR,
    Problem,
    TileRanges,
    merge_sink,
    softmax_step,
)
from pallas_attn.kernels.mosaic.common import (
    Band,
    BiasTiles,
    Dropout,
    Item,
    KeyRows,
    Segments,
    Turns,
    Walk,
    accumulate,
    await_turn,
    head_slope,
    launch,
    lengths_of,
    mask_of,
    mask_tile,
    optional_refs,
    origin_of,
    own_band,
    pass_turn,
    release_slot,
    run_band,
    scoped,
    segments_of,
    tile_scores,
    unsupported,
)
from pallas_attn.kernels.mosaic.config import (
    ITEM_ROWS,
    OPERANDS,
    ROWS_PER_CONSUMER,
    bias_tiles_dtype,
    consumer_registers,
    forward_output_staging,
    forward_scratch,
    mask_tiles,
    with_hash_tables,
)

# From this value head dim on the accumulator is rescaled after the turn's barriers, not
# before them (measured faster at 256, slower at 64 and 128: docs/decisions.md).
LATE_RESCALE_HEAD_DIM = 256


def _kernel(q_ref, k_ref, v_ref, bias_ref, mask_ref, slopes_ref, sinks_ref, lengths, origin,
            segments, dropout, out_ref, row_max_ref, log2_sum_ref, smem, barriers, *,
            problem: Problem, programs: int, staging: str):
    q_smem, k_smem, v_smem, p_smem = (smem[name] for name in ("q", "k", "v", "p"))
    o_smem = smem[staging]  # the output tile: its own buffer, or P's or Q's
    q_loaded = barriers["q_loaded"]
    turns = Turns.of(barriers["schedule"], problem)
    ring = tuple(barriers[name] for name in ("k_loaded", "v_loaded", "k_consumed",
                                              "v_consumed"))
    route = problem.plan.forward
    consumers = route.consumers
    rows_n = ROWS_PER_CONSUMER
    early_q = route.early_q
    walk = Walk(problem, programs, route.block_k, route.num_stages, consumers * rows_n,
                segments=segments, lengths=lengths, origin=origin)
    wg = lax.axis_index("wg")
    dropout = None if dropout is None else dropout.mine(smem["hashes"], wg)
    walk.produce(wg, k_ref, v_ref, k_smem, v_smem, ring,
                 mask=None if smem["mask"] is None else (mask_ref, smem["mask"]))

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(consumer_registers(consumers), action="increase")
        q_mine, o_mine = q_smem.at[wg], o_smem.at[wg]
        p_mine = None if p_smem is None else p_smem.at[wg]

        def rows_of(item: Item):
            return item.q0 + wg * rows_n

        def mine(item: Item):  # rows before 0 (a head's first item of 192): nothing to do
            return item.valid & (rows_of(item) >= 0)

        def load_q(item: Item):
            @pl.when(mine(item))
            def _():
                plgpu.copy_gmem_to_smem(q_ref.at[item.b, pl.ds(rows_of(item), rows_n), item.n],
                                        q_mine, q_loaded.at[wg])

        load_q(walk.item(0))
        # Two consumers take turns: consumer 1 starts a turn behind consumer 0 (see
        # _consume) and consumer 0 passes that turn at the end.
        pl.when(wg == 1)(lambda: await_turn(turns))

        def work(r, step):
            item = walk.item(r)
            ctx, tiles, steps = walk.band(item)
            row0 = rows_of(item)
            active = mine(item)
            # The previous item's output copies read o_mine, which may be p_mine.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            pl.when(active)(lambda: plgpu.barrier_wait(q_loaded.at[wg]))
            bias = walk.bias_rows(bias_ref, item, row0, smem["bias"], barriers["bias_loaded"])
            acc, m, l_sum = _consume(
                problem, ctx, tiles, lambda t: walk.slot(step + t - tiles.first), row0,
                tiles.first + steps, active, q_mine, k_smem, v_smem, p_mine,
                o_mine.shape[-1], ring, turns, bias,
                walk.mask_rows(mask_ref, item, smem["mask"], row0),
                head_slope(slopes_ref, item.valid, item.b, item.n), segments, dropout, item.b,
                item.n, (lambda: load_q(walk.item(r + 1))) if early_q else None)

            if sinks_ref is not None:  # the head's sink: one more logit, no value
                sink = sinks_ref[jnp.where(item.valid, item.n, 0)]
                alpha, m, l_sum = merge_sink(problem, sink, m, l_sum)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            @pl.when(active)
            def _store():
                rows = row0 + plgpu.broadcasted_iota(jnp.int32, (rows_n,), 0,
                                                     layout=plgpu.Layout.WGMMA.reduce(1))
                valid = (l_sum != 0.0) & (rows < problem.q_len)  # NaN shows
                if ctx.q_length is not None:
                    valid = valid & (rows < ctx.q_length)
                # Kept weights are scaled by 1 / (1 - rate) here, once per row.
                inv = jnp.where(valid, problem.dropout_scale / jnp.where(valid, l_sum, 1.0),
                                0.0)
                out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
                # 0 * NaN: a NaN key in a row that sees nothing (hidden, or the row past its
                # length, whose zeroed Q still meets every key)
                if problem.spec.hides_keys or problem.spec.has_q_lengths:
                    out = jnp.where(lax.broadcast_in_dim(valid, acc.shape, [0]), out, 0.0)
                o_mine[...] = out.astype(o_mine.dtype)
                plgpu.commit_smem()
                out_rows = pl.ds(row0, rows_n)
                plgpu.copy_smem_to_gmem(o_mine, out_ref.at[item.b, out_rows, item.n])
                row_max_ref.at[item.b, item.n, out_rows][...] = jnp.where(valid, m, jnp.inf)
                log2_sum = jnp.log2(jnp.where(valid, l_sum, 1.0))
                if problem.plan.forward.repair is not None:  # a NaN row: the repair route reruns it
                    log2_sum = jnp.where(valid & jnp.isnan(jnp.sum(acc, axis=1)), jnp.nan,
                                         log2_sum)
                log2_sum_ref.at[item.b, item.n, out_rows][...] = log2_sum

            if not early_q:  # after the output (which, staged in Q, has just left its buffer)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                load_q(walk.item(r + 1))
            return step + steps

        lax.fori_loop(0, walk.rounds, work, jnp.int32(0))
        pl.when(wg == 0)(lambda: pass_turn(turns))
        plgpu.wait_smem_to_gmem(0)


def _consume(problem: Problem, ctx: TileRanges, tiles: Band, slot_of, row0, stop, active,
             q_smem, k_smem, v_smem, p_smem, hv: int, ring, turns,
             bias: BiasTiles | KeyRows | None, mask, slope, segments: Segments | None,
             dropout: Dropout | None, b, n, next_q) -> tuple[Any, Any, Any]:
    """One consumer warpgroup: (acc, row reference, row sum) of rows [row0, row0 + 64)
    against key tiles [tiles.first, stop) (stop = tiles.first for no work); active false
    (rows before 0): it only releases the tiles.

    Two consumers take turns on the tensor cores (`common.Turns`, FlashAttention-3's
    ping-pong; None for three, which take no turns): a consumer
    issues its Q K^T and passes the turn; after its softmax it waits until the other
    has issued its Q K^T, then issues its P V and waits for it. So one's softmax runs
    while the other's products do (`run_band` keeps the turns paired).

    bias: None, or this consumer's bias stream (`BiasTiles`, or `KeyRows` per key);
    scores with a bias stay in natural units (Problem.exp2_factor), as in the Triton
    forward. mask: the ring of the caller's mask rows (`Walk.stream`), the mask per key
    (`KeyRows`) or None (`Walk.mask_rows`). slope: the
    head's ALiBi slope or None. segments: the segment ids (batch entry b's rows are
    read once, each key tile's ids per step) or None. dropout: P V takes the kept
    probabilities (head n's mask), the row sum all of them; or None. next_q(): loads the
    next item's rows into q_smem, called once the last Q K^T has read it; or None.
    """
    k_loaded, v_loaded, k_consumed, v_consumed = ring
    block_k = problem.plan.forward.block_k
    rows_n = ROWS_PER_CONSUMER
    dtype = q_smem.dtype
    own = own_band(ctx, tiles, row0, stop, block_k, segments)
    own = own.idle_unless(active, tiles.first)
    row_ids = None if segments is None else segments.rows(b, row0)
    row_keys = None if dropout is None else dropout.row_keys(b, n, row0)

    def step(t, carry, masked: bool | None):
        acc, m_prev, l_prev = carry
        slot = slot_of(t)
        tile_bias = None if bias is None else bias.take(t, own.stop)
        ids = (None if row_ids is None or masked is False
               else (row_ids, segments.cols(b, t * block_k, block_k)))
        plgpu.barrier_wait(k_loaded.at[slot])
        tile_mask = mask_tile(mask, slot, t, masked)

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            pass_turn(turns)
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((rows_n, block_k), jnp.float32))
        plgpu.barrier_arrive(k_consumed.at[slot])
        if next_q is not None:
            pl.when(t == own.stop - 1)(next_q)
        s, _ = tile_scores(problem, s, row0, t * block_k, masked, bias=tile_bias, slope=slope,
                           segments=ids, kv_length=ctx.kv_length, mask=tile_mask,
                           offset=ctx.offset)
        prob, m_next, l_next, alpha = softmax_step(
            problem, s, m_prev, l_prev, rows=lambda x: lax.broadcast_in_dim(x, s.shape, [0]))
        if dropout is not None:
            prob = jnp.where(dropout.keep(row_keys, dropout.multipliers(t * block_k, block_k)),
                             prob, 0.0)
        p = prob.astype(dtype)
        if problem.interpret:  # its wgmma reads both operands from shared memory
            p_smem[...] = p
            plgpu.commit_smem()
            p = p_smem
        late = hv >= LATE_RESCALE_HEAD_DIM
        if not late:
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        if not (late or problem.interpret):
            # NOTE: keeps the rescale and P's conversion ahead of the turn's barriers.
            acc, p = lax.optimization_barrier((acc, p))
        plgpu.barrier_wait(v_loaded.at[slot])
        await_turn(turns)  # the other consumer has issued its Q K^T
        if late:
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        (acc,) = accumulate(((acc, ((p, v_smem.at[slot]),)),), problem.interpret)
        plgpu.barrier_arrive(v_consumed.at[slot])
        return acc, m_next, l_next

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    carry = (plgpu.layout_cast(jnp.zeros((rows_n, hv), jnp.float32), plgpu.Layout.WGMMA),
             plgpu.layout_cast(jnp.full((rows_n,), MAX_FLOOR, jnp.float32), row_layout),
             plgpu.layout_cast(jnp.zeros((rows_n,), jnp.float32), row_layout))
    if bias is not None:
        pl.when(own.first < own.stop)(lambda: bias.start(own.first))
    carry = run_band(tiles.first, stop, own, lambda t: release_slot(slot_of(t), ring, turns),
                     step, carry)
    if next_q is not None:
        pl.when(own.first >= own.stop)(next_q)
    return carry


def forward(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array,
            optional: dict[str, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """(out [B, Tp, N, Hvp], (row_max, log2_sum) [B, N, Tp]) for padded inputs."""
    route = problem.plan.forward
    if (set(optional) - set(OPERANDS["forward"]) or unsupported(problem, "forward")
            or route.block_q != ITEM_ROWS or route.consumers not in (2, 3)):
        raise AssertionError(f"mosaic.fwd.forward called for an unsupported problem: "
                             f"{unsupported(problem, 'forward') or route}")
    B, Tp, N, hp = q.shape
    hvp = v.shape[-1]
    dtype = q.dtype
    row = jax.ShapeDtypeStruct((B, N, Tp), jnp.float32)
    out_type = (jax.ShapeDtypeStruct((B, Tp, N, hvp), dtype), row, row)
    bias, slopes, sinks = (optional.get(x) for x in ("bias", "alibi_slopes", "sinks"))
    mask = mask_of(optional)
    segments = segments_of(optional, "key_ranges")
    lengths = lengths_of(optional)
    origin = origin_of(optional)
    keys = optional.get("dropout_keys")
    bias_dtype = bias_tiles_dtype(problem.spec, None if bias is None else bias.dtype)
    consumers = route.consumers
    has_mask = mask_tiles(problem.spec)
    staging = forward_output_staging(hp, hvp, route.block_k, route.num_stages, dtype,
                                     bias_dtype, problem.plan.device.max_shared_memory_per_block,
                                     consumers, has_mask)
    def scratch_of(tables: bool, p_buffer: bool = False):
        return forward_scratch(hp, hvp, route.block_k, route.num_stages, dtype, bias_dtype,
                               staging=staging, consumers=consumers, has_mask=has_mask,
                               dropout=tables, p_buffer=p_buffer)

    # Hash tables where the GPU's buffers leave room: the interpreter's P adds none.
    scratch = with_hash_tables(scratch_of, keys is not None,
                               problem.plan.device.max_shared_memory_per_block)
    if problem.interpret:
        scratch = scratch_of(dict(scratch.buffers)["hashes"] is not None, p_buffer=True)

    def entry(q_ref, k_ref, v_ref, *refs):
        bias_ref, mask_ref, slopes_ref, sinks_ref, keys_ref, origin_ref, *length_refs = (
            optional_refs(refs, bias, mask, slopes, sinks, keys, origin, *lengths))
        segment_refs = refs[-3 - len(segments):-3]
        out_ref, row_max_ref, log2_sum_ref = refs[-3:]
        scoped(scratch, lambda smem, barriers: _kernel(
            q_ref, k_ref, v_ref, bias_ref, mask_ref, slopes_ref, sinks_ref, tuple(length_refs),
            origin_ref, Segments.of(tuple(segment_refs)),
            None if keys is None else Dropout(keys_ref, problem.spec.dropout_rate, origin_ref),
            out_ref, row_max_ref,
            log2_sum_ref, smem, barriers, problem=problem, programs=programs, staging=staging))

    items = -(-Tp // (consumers * ROWS_PER_CONSUMER)) * B * N
    programs = problem.plan.programs_for(items)
    out, row_max, log2_sum = launch(entry, out_type, programs, problem.interpret, consumers)(
        q, k, v, *(x for x in (bias, mask, slopes, sinks, keys, origin, *lengths)
                   if x is not None),
        *segments)
    return out, (row_max, log2_sum)
