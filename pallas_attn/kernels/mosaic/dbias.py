"""dbias kernel for Hopper (Pallas, Mosaic GPU backend): warp-specialised, persistent.

It serves a bias broadcast over batch entries or heads (a [1, N, T, S], [B, 1, T, S]
or [1, 1, T, S] bias), whose gradient sums dS over the (b, n) pairs that share one
bias entry: the members of that entry. The dK/dV kernel cannot write it (its
programs would each hold a partial sum), so dbias recomputes S and dP per member,
as the Triton dbias kernel does, streaming Q, dO, K and V once per member and
tile. Here bulk copies run that stream ahead of the consumers, whose registers
hold only the tile's accumulator and products (measured faster than the Triton
dbias kernel; 128-key tiles do not fit a consumer's registers: docs/decisions.md,
"Hopper dbias").

Work items are [128, block_k] tiles of the bias (queries x keys), keys fastest.
One program per multiprocessor loops over items round-robin with three warpgroups:

* Warpgroup 2, the producer, streams each member's operands with the bulk copy
  engine: Q and K into one ring of the route's slots, dO, V and the
  member's row residuals (row reference, log2 row sum, delta) into another. Each
  slot has a "loaded" barrier (every copy into it landed) and a
  "consumed" barrier (both consumers are done with it); the rings run on across
  items.
* Warpgroups 0 and 1, the consumers, each take 64 rows of the item. Per member they
  compute S = Q K^T and dP = dO V^T with wgmma, the probabilities from the
  forward's row residuals and the shared score rules (semantics/scores.py), and add
  dS = P (dP - delta) (times the soft cap's derivative) into a float32 accumulator
  in registers. Each consumer copies its 64 rows of the item's bias into a buffer
  of its own once per item (the copy for the next item is issued as soon as the
  last member's bias is in registers) and writes its accumulated dbias rows from
  registers.

Items outside the causal/window band or past the keys get zeros and stream
nothing; items the band crosses apply the band masks, the others do not. Scope:
the Mosaic kernels' (`config.unsupported`: 16-bit inputs, padded head dims 64
or 128, no operand besides q, k, v, the bias and ALiBi slopes, no dropout; causal,
windows, soft cap, ALiBi (each member's own slope), GQA and ragged lengths are
covered), with a bias that has its own entry per query and key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.kernels.core import Problem, TileRanges
from pallas_attn.kernels.mosaic.common import (
    head_slope,
    launch,
    scoped,
    tile_gradient,
    unsupported,
)
from pallas_attn.kernels.mosaic.config import (
    CONSUMERS,
    ITEM_ROWS,
    ROWS_PER_CONSUMER,
    consumer_registers,
    dbias_scratch,
    producer_registers,
)


def _kernel(q_ref, k_ref, v_ref, do_ref, stats_ref, bias_ref, slopes_ref, dbias_ref, smem,
            barriers, *, problem: Problem, programs: int):
    q_smem, k_smem, do_smem, v_smem, stats_smem, bias_smem = (
        smem[name] for name in ("q", "k", "do", "v", "stats", "bias"))
    qk_loaded, qk_consumed, dov_loaded, dov_consumed, bias_loaded = (
        barriers[name] for name in ("qk_loaded", "qk_consumed", "dov_loaded", "dov_consumed",
                                    "bias_loaded"))
    block_k = problem.plan.dbias.block_k
    stages_qk, stages_dov = q_smem.shape[0], do_smem.shape[0]
    Bb, Nb = problem.spec.bias_shape[:2]
    heads_per = problem.num_heads // Nb
    members = (problem.batch // Bb) * heads_per
    q_tiles, k_tiles = problem.q_pad // ITEM_ROWS, problem.kv_pad // block_k
    items = q_tiles * k_tiles * Bb * Nb
    rounds = -(-items // programs)
    pid, wg = lax.axis_index("program"), lax.axis_index("wg")
    rows_n = ROWS_PER_CONSUMER

    def item_of(r):
        """(valid, q0, k0, bb, nb, plain, masked): the item of round r, and how many
        of its members run without and with the band masks (all or none of them)."""
        idx = r * programs + pid
        kt = lax.rem(idx, k_tiles)
        qt = lax.rem(lax.div(idx, k_tiles), q_tiles)
        bn = lax.div(idx, k_tiles * q_tiles)
        q0, k0 = qt * ITEM_ROWS, kt * block_k
        ctx = TileRanges(problem, 0, 0)
        first, stop, full_first, full_stop = ctx.key_tiles(q0, q0 + ITEM_ROWS, block_k)
        valid = idx < items
        visible = valid & (first <= kt) & (kt < stop)
        full = (full_first <= kt) & (kt < full_stop)
        plain = jnp.where(visible & full, members, 0)
        masked = jnp.where(visible & ~full, members, 0)
        return valid, q0, k0, lax.div(bn, Nb), lax.rem(bn, Nb), plain, masked

    def member_of(bb, nb, m):
        """(b, n) of member m of bias entry (bb, nb)."""
        b = bb if Bb > 1 else lax.div(m, heads_per)
        n = nb if Nb > 1 else lax.rem(m, heads_per)
        return b, n

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(producer_registers(CONSUMERS), action="decrease")

        def stream(r, step):
            valid, q0, k0, bb, nb, plain, masked = item_of(r)
            del valid
            steps = plain + masked

            @pl.loop(0, steps)
            def _load(i):
                b, n = member_of(bb, nb, i)
                kh = lax.div(n, jnp.int32(problem.group))
                keys = pl.ds(k0, block_k)
                slot = lax.rem(step + i, jnp.int32(stages_qk))

                @pl.when(step + i >= stages_qk)
                def _wait_released():
                    plgpu.barrier_wait(qk_consumed.at[slot])

                for c in range(CONSUMERS):
                    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0 + c * rows_n, rows_n), n],
                                            q_smem.at[slot, c], qk_loaded.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kh], k_smem.at[slot],
                                        qk_loaded.at[slot])
                slot = lax.rem(step + i, jnp.int32(stages_dov))

                @pl.when(step + i >= stages_dov)
                def _wait_dov_released():
                    plgpu.barrier_wait(dov_consumed.at[slot])

                for c in range(CONSUMERS):
                    rows = pl.ds(q0 + c * rows_n, rows_n)
                    plgpu.copy_gmem_to_smem(do_ref.at[b, rows, n], do_smem.at[slot, c],
                                            dov_loaded.at[slot])
                    plgpu.copy_gmem_to_smem(stats_ref.at[b, n, :, rows], stats_smem.at[slot, c],
                                            dov_loaded.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kh], v_smem.at[slot],
                                        dov_loaded.at[slot])

            return step + steps

        total = lax.fori_loop(0, rounds, stream, jnp.int32(0))

        # Observe the last releases too, so every barrier ends in a phase this
        # warpgroup has seen (the interpreter checks it).
        @pl.loop(jnp.maximum(total - stages_qk, 0), total)
        def _drain_qk(step):
            plgpu.barrier_wait(qk_consumed.at[lax.rem(step, jnp.int32(stages_qk))])

        @pl.loop(jnp.maximum(total - stages_dov, 0), total)
        def _drain_dov(step):
            plgpu.barrier_wait(dov_consumed.at[lax.rem(step, jnp.int32(stages_dov))])

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(consumer_registers(CONSUMERS), action="increase")
        bias_mine, bias_ready = bias_smem.at[wg], bias_loaded.at[wg]

        def load_bias(item):
            _, q0, k0, bb, nb, plain, masked = item

            @pl.when(plain + masked > 0)
            def _():
                rows = pl.ds(q0 + wg * rows_n, rows_n)
                plgpu.copy_gmem_to_smem(bias_ref.at[bb, nb, rows, pl.ds(k0, block_k)],
                                        bias_mine, bias_ready)

        load_bias(item_of(0))

        def work(r, step):
            item = item_of(r)
            valid, q0, k0, bb, nb, plain, masked = item
            following = item_of(r + 1)
            steps = plain + masked
            row0 = q0 + wg * rows_n
            pl.when(steps > 0)(lambda: plgpu.barrier_wait(bias_ready))
            member = _member_step(problem, wg, row0, k0, steps,
                                  (q_smem, k_smem, do_smem, v_smem, stats_smem, bias_mine),
                                  (qk_loaded, qk_consumed, dov_loaded, dov_consumed),
                                  lambda: load_bias(following),
                                  lambda i: head_slope(slopes_ref, valid, *member_of(bb, nb, i)))
            acc = plgpu.layout_cast(jnp.zeros((rows_n, block_k), jnp.float32),
                                    plgpu.Layout.WGMMA)
            acc = lax.fori_loop(0, plain, lambda i, a: member(step, i, a, False), acc)
            acc = lax.fori_loop(plain, steps, lambda i, a: member(step, i, a, True), acc)
            pl.when(steps == 0)(lambda: load_bias(following))

            @pl.when(valid)
            def _store():
                dbias_ref.at[bb, nb, pl.ds(row0, rows_n), pl.ds(k0, block_k)][...] = (
                    acc.astype(dbias_ref.dtype))

            return step + steps

        lax.fori_loop(0, rounds, work, jnp.int32(0))


def _member_step(problem: Problem, wg, row0, k0, steps, buffers, barriers, load_next_bias,
                 slope_of):
    """The consumer's work on one member of an item: a function
    (ring step of the item's first member, member index, acc, masked) -> acc.
    slope_of(i): member i's ALiBi slope or None."""
    q_smem, k_smem, do_smem, v_smem, stats_smem, bias_mine = buffers
    qk_loaded, qk_consumed, dov_loaded, dov_consumed = barriers
    rows_n = ROWS_PER_CONSUMER
    block_k = problem.plan.dbias.block_k
    stages_qk, stages_dov = q_smem.shape[0], do_smem.shape[0]
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def step(first, i, acc, masked: bool):
        slot_qk = lax.rem(first + i, jnp.int32(stages_qk))
        slot_dov = lax.rem(first + i, jnp.int32(stages_dov))
        plgpu.barrier_wait(qk_loaded.at[slot_qk])

        def products(s_ref, dp_ref):
            plgpu.wgmma(s_ref, q_smem.at[slot_qk, wg], k_smem.at[slot_qk].transpose((1, 0)))
            plgpu.barrier_wait(dov_loaded.at[slot_dov])
            plgpu.wgmma(dp_ref, do_smem.at[slot_dov, wg], v_smem.at[slot_dov].transpose((1, 0)))
            return s_ref[...], dp_ref[...]

        s, dp = pl.run_scoped(products, plgpu.ACC((rows_n, block_k), jnp.float32),
                              plgpu.ACC((rows_n, block_k), jnp.float32))
        plgpu.barrier_arrive(qk_consumed.at[slot_qk])
        stats = stats_smem.at[slot_dov, wg]
        row_max, log2_sum, delta = (plgpu.load(stats.at[j], layout=row_layout)
                                    for j in range(3))
        bias = plgpu.load(bias_mine, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        plgpu.commit_smem()  # the reads are done before the next copies overwrite them
        plgpu.barrier_arrive(dov_consumed.at[slot_dov])
        pl.when(i == steps - 1)(load_next_bias)

        _, ds = tile_gradient(problem, s, dp, bias, (row_max, log2_sum, delta), row0, k0,
                              masked, slope_of(i))
        return acc + ds
    return step


def dbias(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array,
          stats: jax.Array, bias: jax.Array, slopes: jax.Array | None = None
          ) -> jax.Array:
    """dbias of the bias's (padded) shape for padded inputs; stats: the row residuals
    (`common.row_residuals`, one bulk copy per consumer); slopes: ALiBi slopes [B, N] or
    None."""
    if why := unsupported(problem, "dbias"):
        raise AssertionError(f"mosaic.dbias.dbias called for an unsupported problem: {why}")
    route = problem.plan.dbias
    if route.block_q != ITEM_ROWS:
        raise AssertionError(f"mosaic.dbias.dbias needs block_q={ITEM_ROWS}: {route}")
    scratch = dbias_scratch(q.shape[-1], v.shape[-1], route.block_k, route.num_stages,
                            q.dtype, bias.dtype)

    def entry(q_ref, k_ref, v_ref, do_ref, stats_ref, bias_ref, *refs):
        slopes_ref = refs[0] if slopes is not None else None
        scoped(scratch, lambda smem, barriers: _kernel(
            q_ref, k_ref, v_ref, do_ref, stats_ref, bias_ref, slopes_ref, refs[-1], smem,
            barriers, problem=problem, programs=programs))

    Bb, Nb, Tb, Sb = bias.shape
    programs = problem.plan.programs_for(Tb // ITEM_ROWS * (Sb // route.block_k) * Bb * Nb)
    return launch(entry, jax.ShapeDtypeStruct(bias.shape, bias.dtype), programs,
                  problem.interpret)(q, k, v, do, stats, bias,
                                     *([] if slopes is None else [slopes]))
