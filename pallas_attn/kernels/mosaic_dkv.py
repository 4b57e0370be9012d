"""dK/dV kernel for Hopper (Pallas, Mosaic GPU backend): warp-specialised, persistent,
with the gradient of a bias written from the dS tiles it computes anyway.

A unit of work is the dK and dV rows of UNIT_KEYS keys of one (batch entry, KV
head), summed over the group's query heads and every visible query tile. The two
consumer warpgroups each own 64 of the keys (the wgmma M dimension) and keep their
dK and dV in registers. Per step (the STEP_ROWS query rows of one tile, one head):

* S = Q K^T and dP = dO V^T with wgmma ([64 queries, 64 keys] per consumer);
* P and dS from the forward's row residuals and the shared score rules
  (`mosaic_common.tile_gradient`, kernels/scores.py);
* P and dS go to shared memory (16-bit), and dV += P^T dO, dK += dS^T Q take them
  as transposed wgmma operands;
* with a bias that needs a gradient, the dS tile in shared memory is also the
  bias's gradient for that (query tile, key tile, head): a bulk copy stores it.

The producer warpgroup streams each step's Q, dO, row residuals and bias tile
into a ring of `num_stages_dkv` slots ("loaded" / "consumed" barriers, the ring
running on across units) and each unit's K and V into one buffer per consumer.

dbias. A bias with its own entry per batch entry ([B, N, T, S]) gets each dS tile
stored once; tiles outside the causal/window band get zeros (the producer
bulk-copies a zeroed tile). A bias shared by the batch entries ([1, N, T, S]) gets
its batch sum in place: every unit adds its dS tiles into one buffer of the bias's
shape with the bulk copy engine's reduce-add. The buffer starts as batch entry 0's
dbias when the Mosaic dQ kernel has stored it (`mosaic_dq.dq_and_dbias`,
`dbias_first`; entry 0's units then add nothing), else as zeros. Units run key
tiles fastest (concurrent programs read neighbouring bias columns), then batch
entries, so the programs working on one (KV head, key tile) for several batch
entries run at the same time: they read each bias tile once from memory and the
rest from L2, and their additions meet in L2. Under causal masking key tiles run
slowest, the heaviest first; lanes reverse on odd rounds. The sum never needs a
[B, N, T, S] buffer or a second pass over S and dP; each addition rounds to the
bias dtype (the bulk copy adds in it), in whatever order the programs reach a tile,
so this dbias is not bit-reproducible from run to run (`BlockSizes(fuse_dbias=False)`
gives the separate, deterministic dbias kernel). Measured (BENCHMARKS.md, session
13, H100, d128, B=4, N=16, T=S=4096): forward and backward with a [1, N, T, S] bias
5.37 ms, against 5.85-5.97 when one program ran an item's batch entries one after
another.

The Pallas interpreter has neither reduce-add copies nor accumulators initialised
from registers: interpreted, the kernel adds dbias tiles and each step's dK/dV
products through registers (`_store_dbias`, `mosaic_common.accumulate`), and one
program runs an item's batch entries one after another as passes (so that no two
programs add to one tile), the only places where it differs from the compiled
kernel.

dQ too (`dq_dkdv`, an experiment; dot_product_attention does not call it). Each
step, once both consumers' dS tiles are in shared memory, each consumer computes its
half of the columns of dS K over the unit's 128 keys and reduce-adds it, staged in
float32, into a zeroed float32 dQ with a bulk copy, so that a score's soft-cap tanh
and exponential run once in the backward instead of twice. Q and K then sit in shared
memory as column halves, each a wgmma operand. Measured slower than the separate
dQ kernel (BENCHMARKS.md, session 15).

Scope: the Mosaic kernels' (`mosaic_common.unsupported`), and a bias gradient only
for a bias of shape [B, N, T, S] or [1, N, T, S] in the inputs' dtype
(`tuning.mosaic_fusable_dbias`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import tuning
from pallas_attn.kernels import mosaic_common
from pallas_attn.kernels.common import Problem, TileContext, run_tile_loops
from pallas_attn.kernels.mosaic_common import (
    CONSUMER_REGISTERS,
    CONSUMERS,
    PRODUCER_REGISTERS,
    ROWS_PER_CONSUMER,
    accumulate,
    head_slope,
    optional_refs,
    smem_tiles,
    tile_gradient,
    zero_tile_init,
    zero_tiles_outside,
)

STEP_ROWS = 64  # query rows per step (the K dimension of dV's and dK's products)
KEYS_PER_CONSUMER = ROWS_PER_CONSUMER
UNIT_KEYS = CONSUMERS * KEYS_PER_CONSUMER


def unsupported(problem: Problem) -> str:
    """Why this kernel cannot compute the problem's dK and dV, or "" when it can."""
    return mosaic_common.unsupported(problem)


def _kernel(q_ref, k_ref, v_ref, do_ref, stats_ref, bias_ref, slopes_ref, dk_ref, dv_ref,
            dbias_ref, dq_ref, smem, barriers, *, problem: Problem, programs: int,
            passes: int, add_dbias: bool, first_entry: int):
    q_smem, do_smem, stats_smem, k_smem, v_smem = (
        smem[name] for name in ("q", "do", "stats", "k", "v"))
    bias_smem, zero_tile = smem.get("bias"), smem.get("zeros")
    step_loaded, step_consumed, kv_loaded, kv_consumed = barriers[:4]
    stages = q_smem.shape[0]
    group = problem.group
    k_tiles = problem.kv_pad // UNIT_KEYS
    batch_items = problem.batch // passes
    items = k_tiles * problem.num_kv_heads * batch_items
    units = -(-items // programs) * passes
    pid, wg = lax.axis_index("program"), lax.axis_index("wg")
    has_bias = bias_ref is not None

    def unit_of(u):
        """(valid, b, kh, k0, first, stop, full_first, full_stop) of unit u of this
        program (its item's pass u % passes): query tiles [first, stop) of the band,
        [full_first, full_stop) without band masks."""
        # Round r gives program pid item r * programs + pid, the lanes reversed on odd
        # rounds. Under causal masking items run key tiles slowest, the first (the
        # heaviest) first, so heavy and light items even out over the rounds; else
        # key tiles fastest, so concurrent programs read neighbouring bias columns.
        # Batch entries come next: the programs running one (KV head, key tile) for
        # several batch entries read a shared bias tile at about the same time, once
        # from memory and the rest from L2, and add their dbias tiles there.
        r = lax.div(u, passes)
        lane = jnp.where(lax.rem(r, 2) == 0, pid, programs - 1 - pid)
        idx = r * programs + lane
        p = lax.rem(u, passes)
        per_tile = problem.num_kv_heads * batch_items
        if problem.spec.is_causal:
            kt, rest = lax.div(idx, per_tile), lax.rem(idx, per_tile)
        else:
            kt, rest = lax.rem(idx, k_tiles), lax.div(idx, k_tiles)
        kh = lax.div(rest, batch_items)
        b = lax.rem(rest, batch_items) * passes + p
        k0 = kt * UNIT_KEYS
        valid = idx < items
        ctx = TileContext(problem, {}, b, kh)
        first, stop, full_first, full_stop = ctx.query_tiles(k0, k0 + UNIT_KEYS, STEP_ROWS)
        # An invalid unit (past the last item) gets an empty band.
        stop, full_first, full_stop = (jnp.where(valid, x, first)
                                       for x in (stop, full_first, full_stop))
        return valid, b, kh, k0, first, stop, full_first, full_stop

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        if zero_tile is not None:
            zero_tile_init(zero_tile)

        def stream(u, carry):
            step, loaded_units = carry
            valid, b, kh, k0, first, stop, _, _ = unit_of(u)
            tiles = stop - first
            steps = tiles * group
            if zero_tile is not None:
                _zeros_outside_band(zero_tile, dbias_ref, valid, b, kh, k0, first, stop,
                                    group)

            @pl.when(steps > 0)
            def _load_kv():
                @pl.when(loaded_units > 0)
                def _wait_released():
                    plgpu.barrier_wait(kv_consumed)

                for c in range(CONSUMERS):
                    keys = pl.ds(k0 + c * KEYS_PER_CONSUMER, KEYS_PER_CONSUMER)
                    for j, cols in enumerate(_parts(k_smem)):
                        plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kh, cols], k_smem.at[c, j],
                                                kv_loaded)
                    plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kh], v_smem.at[c], kv_loaded)

            @pl.loop(0, steps)
            def _load(i):
                n = kh * group + lax.div(i, tiles)
                rows = pl.ds((first + lax.rem(i, tiles)) * STEP_ROWS, STEP_ROWS)
                slot = lax.rem(step + i, jnp.int32(stages))

                @pl.when(step + i >= stages)
                def _wait_released():
                    plgpu.barrier_wait(step_consumed.at[slot])

                loaded = step_loaded.at[slot]
                for j, cols in enumerate(_parts(q_smem)):
                    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, n, cols], q_smem.at[slot, j],
                                            loaded)
                plgpu.copy_gmem_to_smem(do_ref.at[b, rows, n], do_smem.at[slot], loaded)
                plgpu.copy_gmem_to_smem(stats_ref.at[b, n, :, rows], stats_smem.at[slot],
                                        loaded)
                if has_bias:
                    bb = b if bias_ref.shape[0] > 1 else 0
                    for c in range(CONSUMERS):
                        keys = pl.ds(k0 + c * KEYS_PER_CONSUMER, KEYS_PER_CONSUMER)
                        plgpu.copy_gmem_to_smem(bias_ref.at[bb, n, rows, keys],
                                                bias_smem.at[slot, c], loaded)

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
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        dq_parts = None
        if dq_ref is not None:
            dq_parts = _DqParts(dq_ref, smem["ds"], k_smem, smem["dq"].at[wg], barriers[4])
        _consume(problem, wg, unit_of, units, add_dbias, first_entry,
                 (slopes_ref, dk_ref, dv_ref, dbias_ref),
                 (q_smem, do_smem, stats_smem, bias_smem,
                  k_smem.at[wg], v_smem.at[wg], smem["p"].at[wg], smem["ds"].at[wg]),
                 barriers[:4], dq_parts)


def _consume(problem: Problem, wg, unit_of, units, add_dbias: bool, first_entry: int, refs,
             buffers, barriers, dq_parts: _DqParts | None):
    """A consumer's loop over its program's units: dK and dV of its 64 keys per unit;
    dbias tiles from batch entries first_entry on; with dq_parts, each step's part of
    dQ (its columns of dS K over the unit's keys) reduce-added into dq_parts.out."""
    slopes_ref, dk_ref, dv_ref, dbias_ref = refs
    has_dbias = dbias_ref is not None
    q_smem, do_smem, stats_smem, bias_smem, k_mine, v_mine, p_mine, ds_mine = buffers
    step_loaded, step_consumed, kv_loaded, kv_consumed = barriers
    stages = q_smem.shape[0]
    group = problem.group
    dtype = q_smem.dtype
    keys_n = KEYS_PER_CONSUMER
    parts, hvp = k_mine.shape[0], v_mine.shape[-1]
    part_cols = k_mine.shape[-1]
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    shape = (STEP_ROWS, keys_n)
    reduce_in_registers = problem.interpret  # the interpreter has no reduce-add copies

    def unit(u, step):
        valid, b, kh, k0, first, stop, full_first, full_stop = unit_of(u)
        k_own = k0 + wg * keys_n
        tiles = stop - first
        bb = b if dbias_ref is not None and dbias_ref.shape[0] > 1 else 0

        def dbias_tile(n, t):
            return dbias_ref.at[bb, n, pl.ds(t * STEP_ROWS, STEP_ROWS), pl.ds(k_own, keys_n)]

        pl.when(tiles > 0)(lambda: plgpu.barrier_wait(kv_loaded))

        def step_fn(i, carry, masked: bool, slope):
            """Query tile i of head h (ring step `at`), the head's ALiBi slope."""
            dks, dv, at, h = carry
            slot = lax.rem(at, jnp.int32(stages))
            n = kh * group + h
            row0 = i * STEP_ROWS
            plgpu.barrier_wait(step_loaded.at[slot])

            def products(s_ref, dp_ref):
                for j in range(parts):
                    plgpu.wgmma(s_ref, q_smem.at[slot, j], k_mine.at[j].transpose((1, 0)))
                plgpu.wgmma(dp_ref, do_smem.at[slot], v_mine.transpose((1, 0)))
                # The row residuals and the bias tile come into registers while the
                # products run.
                stats = stats_smem.at[slot]
                residuals = tuple(plgpu.load(stats.at[j], layout=row_layout)
                                  for j in range(3))
                bias = None
                if bias_smem is not None:
                    bias = plgpu.load(bias_smem.at[slot, wg],
                                      layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                # NOTE: reading S first (a wait for one product in flight) and running
                # the soft cap's tanh before reading dP did not overlap the two: ptxas
                # places the wait for dP itself, after a few of the tanh, whatever the
                # source order (BENCHMARKS.md, session 16).
                return s_ref[...], dp_ref[...], residuals, bias

            s, dp, residuals, bias = pl.run_scoped(products, plgpu.ACC(shape, jnp.float32),
                                                   plgpu.ACC(shape, jnp.float32))
            prob, ds = tile_gradient(problem, s, dp, bias, residuals, row0, k_own, masked,
                                     slope)
            ds_slot = ds_mine.at[lax.rem(at, 2)]
            if has_dbias and not reduce_in_registers:
                # The dbias copy issued two steps ago has read this buffer.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            p_mine[...] = prob.astype(dtype)
            ds_slot[...] = ds.astype(dtype)
            plgpu.commit_smem()

            updates = ((dv, ((p_mine.transpose((1, 0)), do_smem.at[slot]),)),
                       *((dk, ((ds_slot.transpose((1, 0)), q_smem.at[slot, _index(j, wg)]),))
                         for j, dk in enumerate(dks)))
            if dq_parts is None:
                dv, *dks = accumulate(updates, problem.interpret)
            else:
                dv, *dks = dq_parts.step(problem, wg, updates, lax.rem(at, 2), b, n, row0)
            plgpu.barrier_arrive(step_consumed.at[slot])
            if has_dbias:
                def store():
                    _store_dbias(ds_slot, dbias_tile(n, i), ds, add_dbias,
                                 reduce_in_registers)

                pl.when(b >= first_entry)(store)  # entry 0's may be in already
            return tuple(dks), dv, at + 1, h

        def head(h, carry):
            slope = head_slope(slopes_ref, valid, b, kh * group + h)
            dks, dv, at, _ = run_tile_loops(
                first, stop, full_first, full_stop,
                lambda i, c, masked: step_fn(i, c, masked, slope), (*carry, h))
            return dks, dv, at

        dks = tuple(plgpu.layout_cast(jnp.zeros((keys_n, part_cols), jnp.float32),
                                      plgpu.Layout.WGMMA) for _ in range(parts))
        dv = plgpu.layout_cast(jnp.zeros((keys_n, hvp), jnp.float32), plgpu.Layout.WGMMA)
        dks, dv, step = lax.fori_loop(0, jnp.where(tiles > 0, group, 0), head,
                                      (dks, dv, step))
        pl.when(tiles > 0)(lambda: plgpu.barrier_arrive(kv_consumed))

        @pl.when(valid)
        def _store():
            keys = pl.ds(k_own, keys_n)
            for j, dk in enumerate(dks):
                dk_ref.at[b, keys, kh, pl.ds(j * part_cols, part_cols)][...] = (
                    dk * problem.spec.scale).astype(dk_ref.dtype)
            dv_ref.at[b, keys, kh][...] = dv.astype(dv_ref.dtype)

        return step

    lax.fori_loop(0, units, unit, jnp.int32(0))
    if (has_dbias or dq_parts is not None) and not reduce_in_registers:
        plgpu.wait_smem_to_gmem(0)  # every dbias/dQ copy has landed before the program ends


@dataclasses.dataclass(frozen=True)
class _DqParts:
    """dQ computed by the dK/dV kernel. Each step, once both consumers' dS tiles
    are in shared memory (the `ready` barrier), consumer c computes columns
    [c * hp / 2, (c + 1) * hp / 2) of dS K over the unit's 128 keys (two wgmmas, one
    per consumer's dS tile and K rows), stages them in its float32 buffer `stage`
    and reduce-adds them into `out` (float32 [B, Tp, N, hp], zeroed) with a bulk
    copy. A consumer's dS slot is written again two steps later, after the other
    consumer has passed the next step's barrier, so after its product read it."""
    out: Any
    ds: Any  # [CONSUMERS, 2, STEP_ROWS, KEYS_PER_CONSUMER], both consumers' dS slots
    k: Any  # [CONSUMERS, CONSUMERS, KEYS_PER_CONSUMER, hp / CONSUMERS]: both consumers'
    # K rows in column parts
    stage: Any  # this consumer's [STEP_ROWS, hp / CONSUMERS] float32 buffer
    ready: Any

    def step(self, problem: Problem, wg, updates, ds_index, b, n, row0):
        """dV and dK += the step's products (updates, as `accumulate` takes them), and
        this consumer's part of the step's dQ reduce-added into out."""
        cols = self.stage.shape[-1]
        plgpu.barrier_arrive(self.ready)
        dq_products = [(self.ds.at[_index(c, wg), ds_index], self.k.at[_index(c, wg), wg])
                       for c in range(CONSUMERS)]
        dq_zero = plgpu.layout_cast(jnp.zeros((STEP_ROWS, cols), jnp.float32),
                                    plgpu.Layout.WGMMA)
        plgpu.barrier_wait(self.ready)  # the other consumer's dS is in
        *sums, dq = accumulate((*updates, (dq_zero, dq_products)), problem.interpret)
        dst = self.out.at[b, pl.ds(row0, STEP_ROWS), n, pl.ds(wg * cols, cols)]
        if problem.interpret:  # no reduce-add copies: one program, through registers
            dst[...] = dst[...] + dq
        else:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last copy read stage
            self.stage[...] = dq
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(self.stage, dst, reduction_op="add")
        return sums


def _zeros_outside_band(zero_tile, dbias_ref, when, b, kh, k0, first, stop, group: int):
    """Bulk-copy zeros into the item's dbias tiles outside the band (query tiles
    before first or from stop), for every head of the KV head's group."""
    q_tiles = dbias_ref.shape[2] // STEP_ROWS
    bb = b if dbias_ref.shape[0] > 1 else 0

    @pl.when(when)
    def _():
        @pl.loop(0, group)
        def _head(h):
            for c in range(CONSUMERS):
                keys = pl.ds(k0 + c * KEYS_PER_CONSUMER, KEYS_PER_CONSUMER)
                rows = dbias_ref.at[bb, kh * group + h]
                zero_tiles_outside(zero_tile,
                                   lambda t, rows=rows, keys=keys:
                                   rows.at[pl.ds(t * STEP_ROWS, STEP_ROWS), keys],
                                   first, stop, q_tiles)


def _store_dbias(ds_smem, dst, ds, add: bool, reduce_in_registers: bool):
    """Store the dS tile (staged in ds_smem) into dst, or add it to dst's contents."""
    if reduce_in_registers:
        if add:
            old = plgpu.load(dst, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
            dst[...] = (old + ds.astype(dst.dtype).astype(jnp.float32)).astype(dst.dtype)
        else:
            dst[...] = ds.astype(dst.dtype)
    else:
        plgpu.copy_smem_to_gmem(ds_smem, dst, reduction_op="add" if add else None)


def _index(i: int, wg) -> jax.Array:
    """The static index i as a traced value. `mosaic_common.accumulate` runs its
    products in a run_state, which returns the indices its operands close over, and
    its lowering fails on a literal one."""
    return wg * 0 + i


def _parts(ref) -> list[Any]:
    """The column slices of the global arrays that the column parts of a Q or K
    buffer ([..., parts, rows, columns]) hold."""
    cols = ref.shape[-1]
    return [pl.ds(j * cols, cols) for j in range(ref.shape[-3])]


def sums_batch(problem: Problem, bias: jax.Array | None, bias_grad: bool) -> bool:
    """Whether `dkdv` writes dbias as a sum over the batch entries (a bias shared by
    more than one), the case `dbias_first` can start."""
    return bias_grad and bias.shape[0] == 1 and problem.batch > 1


def dkdv(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array,
         stats: jax.Array, bias: jax.Array | None, bias_grad: bool,
         slopes: jax.Array | None = None, dbias_first: jax.Array | None = None
         ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(dk, dv, dbias or None) for padded inputs; stats: the row residuals
    (`mosaic_common.row_residuals`); slopes: ALiBi slopes [B, N] or None. bias_grad:
    also write the gradient of the (present) bias (`tuning.mosaic_fusable_dbias`).
    dbias_first: for a bias shared by the batch entries, batch entry 0's part of its
    gradient (`mosaic_dq.dq_and_dbias`), to which the kernel adds the others'."""
    dk, dv, dbias, _ = _launch(problem, q, k, v, do, stats, bias, bias_grad, slopes,
                               dbias_first, with_dq=False)
    return dk, dv, dbias


def fuses_dq(problem: Problem, bias: jax.Array | None) -> str:
    """Why `dq_dkdv` cannot compute the problem's gradients, or "" when it can."""
    if why := unsupported(problem):
        return why
    if bias is not None:
        return "a bias needs the shared memory that dQ's staging buffers take"
    if tuning.padded_head_dim(problem.head_dim) != 128:
        return f"dQ in the dK/dV kernel needs a head dim padding to 128, got {problem.head_dim}"
    return ""


def dq_dkdv(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array,
            stats: jax.Array, slopes: jax.Array | None = None
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) for padded inputs without a bias (`fuses_dq`), dQ computed by the
    dK/dV kernel: each step's dS tiles times the unit's K rows, added in float32."""
    if why := fuses_dq(problem, None):
        raise AssertionError(f"mosaic_dkv.dq_dkdv called for an unsupported problem: {why}")
    dk, dv, _, dq = _launch(problem, q, k, v, do, stats, None, False, slopes, None,
                            with_dq=True)
    return (dq * problem.spec.scale).astype(q.dtype), dk, dv


def _launch(problem: Problem, q, k, v, do, stats, bias, bias_grad: bool, slopes,
            dbias_first, with_dq: bool):
    name = f"mosaic_dkv.{'dq_dkdv' if with_dq else 'dkdv'}"  # the caller, for the errors
    if why := unsupported(problem):
        raise AssertionError(f"{name} called for an unsupported problem: {why}")
    if bias_grad and not tuning.mosaic_fusable_dbias(
            bias.shape, batch=problem.batch, num_heads=problem.num_heads,
            bias_dtype=bias.dtype, dtype=problem.dtype):
        raise AssertionError(f"{name} cannot write the dbias of a {bias.dtype} "
                             f"bias of shape {bias.shape}")
    blocks = problem.blocks
    if (blocks.block_q_dkv, blocks.block_k_dkv) != (STEP_ROWS, UNIT_KEYS):
        raise AssertionError(
            f"{name} needs block_q_dkv={STEP_ROWS}, block_k_dkv={UNIT_KEYS}: {blocks}")
    B, Tp, N, hp = q.shape
    _, Sp, KH, hvp = v.shape
    stages = blocks.num_stages_dkv
    dtype = q.dtype
    # Q and K in shared memory as column parts (one normally; CONSUMERS with dQ, so
    # that each consumer's part of dQ takes one part of K as a wgmma operand).
    parts = CONSUMERS if with_dq else 1
    has_bias = bias is not None
    # A bias shared by the batch entries gets their dS tiles added into one buffer
    # (dbias_first, else zeros), a mutable operand of the kernel; the interpreter (no
    # reduce-add copies) runs an item's batch entries as passes of one program.
    add_dbias = sums_batch(problem, bias, bias_grad)
    if dbias_first is not None and not (add_dbias and dbias_first.shape == bias.shape):
        raise AssertionError(f"{name} takes dbias_first only for a bias shared by "
                             f"{B} batch entries and of its shape, got {dbias_first.shape} "
                             f"for a bias of shape {bias.shape}")
    passes = B if add_dbias and problem.interpret else 1
    first_entry = int(dbias_first is not None)
    dbias_sum = (jax.new_ref(jnp.zeros(bias.shape, bias.dtype) if dbias_first is None
                             else dbias_first) if add_dbias else None)
    dq_sum = jax.new_ref(jnp.zeros(q.shape, jnp.float32)) if with_dq else None

    def entry(*refs):
        q_ref, k_ref, v_ref, do_ref, stats_ref, *rest = refs
        bias_ref, slopes_ref, sum_ref, dq_ref = optional_refs(rest, bias, slopes,
                                                              dbias_sum, dq_sum)
        dk_ref, dv_ref, *dbias_ref = rest[sum(x is not None for x in (bias, slopes,
                                                                      dbias_sum, dq_sum)):]
        dbias_ref = sum_ref if add_dbias else (dbias_ref[0] if dbias_ref else None)
        kinds = dict(
            q=smem_tiles((stages, parts, STEP_ROWS, hp // parts), dtype),
            do=smem_tiles((stages, STEP_ROWS, hvp), dtype),
            stats=plgpu.SMEM((stages, 3, STEP_ROWS), jnp.float32),
            bias=(smem_tiles((stages, CONSUMERS, STEP_ROWS, KEYS_PER_CONSUMER), bias.dtype)
                  if has_bias else None),
            k=smem_tiles((CONSUMERS, parts, KEYS_PER_CONSUMER, hp // parts), dtype),
            v=smem_tiles((CONSUMERS, KEYS_PER_CONSUMER, hvp), dtype),
            p=smem_tiles((CONSUMERS, STEP_ROWS, KEYS_PER_CONSUMER), dtype),
            ds=smem_tiles((CONSUMERS, 2, STEP_ROWS, KEYS_PER_CONSUMER), dtype),
            zeros=(smem_tiles((STEP_ROWS, KEYS_PER_CONSUMER), dtype)
                   if bias_grad and not add_dbias else None),
            dq=(smem_tiles((CONSUMERS, STEP_ROWS, hp // CONSUMERS), jnp.float32)
                if with_dq else None),
        )
        kinds = {key: kind for key, kind in kinds.items() if kind is not None}
        copies = 2 + parts + (CONSUMERS if has_bias else 0)
        barriers = (
            plgpu.Barrier(num_arrivals=copies, num_barriers=stages),  # Q, dO, stats, bias
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=(1 + parts) * CONSUMERS),  # K (in parts) and V halves
            plgpu.Barrier(num_arrivals=CONSUMERS),
        ) + ((plgpu.Barrier(num_arrivals=CONSUMERS),) if with_dq else ())  # dS tiles in

        def body(*scratch):
            smem = dict(zip(kinds, scratch, strict=False))
            _kernel(q_ref, k_ref, v_ref, do_ref, stats_ref, bias_ref, slopes_ref, dk_ref,
                    dv_ref, dbias_ref, dq_ref, smem, scratch[len(kinds):], problem=problem,
                    programs=programs, passes=passes, add_dbias=add_dbias,
                    first_entry=first_entry)

        pl.run_scoped(body, *kinds.values(), *barriers, collective_axes="wg")

    items = Sp // UNIT_KEYS * KH * (B // passes)
    # Interpreted, dQ parts are added through registers: one program, so that no two
    # add to one tile.
    programs = 1 if with_dq and problem.interpret else tuning.persistent_programs(
        items, problem.interpret)
    out_type = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if bias_grad and not add_dbias:
        out_type.append(jax.ShapeDtypeStruct(bias.shape, bias.dtype))
    operands = [q, k, v, do, stats] + [x for x in (bias, slopes, dbias_sum, dq_sum)
                                       if x is not None]
    dk, dv, *dbias = mosaic_common.launch(entry, out_type, programs,
                                          problem.interpret)(*operands)
    dq = jax.freeze(dq_sum) if with_dq else None
    if add_dbias:
        return dk, dv, jax.freeze(dbias_sum), dq
    return dk, dv, dbias[0] if dbias else None, dq
