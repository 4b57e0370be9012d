"""Forward kernel for Hopper (Pallas, Mosaic GPU backend): warp-specialised, persistent.

The work is items of 128 query rows of one (batch entry, head), two per 64-row
consumer. One program per multiprocessor loops over items (`_kernel.item_of`:
round-robin, lanes reversed every other round, query tiles fastest and the
heaviest causal tile first) with three warpgroups:

* Warpgroup 2, the producer, streams K and V tiles with the bulk copy engine into
  a ring of `num_stages` shared-memory slots. Each slot has a "loaded" barrier
  (copy completion) and a "consumed" barrier (both consumers are done with it).
  The ring runs on across items, so the next item's first tiles load while the
  consumers finish the current one.
* Warpgroups 0 and 1, the consumers, each take 64 rows. They compute S = Q K^T
  with wgmma into registers, apply the shared score and visibility rules
  (kernels/scores.py) and the Triton forward's online softmax (log2 units, row
  reference starting at MAX_FLOOR, or the soft cap's bound), stage P in shared
  memory and accumulate P V with a second wgmma. A two-arrival barrier makes the
  consumers take turns on the tensor cores (FlashAttention-3's ping-pong), so one
  consumer's softmax overlaps the other's products. The next item's Q is loaded as
  soon as the last Q K^T of an item is done, and the output leaves through a bulk
  copy (staged in P's buffer when shapes agree) that overlaps the next item; the
  row residuals are stored from registers.
* With a bias, each consumer copies its 64 rows of the next key tile's bias into a
  buffer of its own while it works on the current tile (`_consume`), and its
  scores stay in natural units, as in the Triton forward.

It writes the same outputs as triton_fwd.forward: the output and the per-row
residuals (row reference, +inf for rows that see no key, and log2 of the row
sum), so the Triton backward kernels consume them unchanged.

Scope (`unsupported` says what lies outside it): 16-bit inputs, padded head dims
64 or 128, no operand besides q, k, v, a bias with its own entry per query and key
and ALiBi slopes (no mask, segments, lengths or dropout); causal, local windows in
both alignments, soft cap (with the Triton forward's fixed row reference where it
applies), ALiBi (each consumer reads its item's slope), GQA and ragged lengths are
covered. Everything else runs the Triton
forward. With the default tiles (block_k 128) a float32 bias does not fit the shared
memory next to two K/V slots (tuning.shared_memory_estimate), so the heuristic gives
it the Triton forward; explicit tiles with block_k 64 run it here.

Key tiles outside an item's band are never loaded. A consumer whose own band is
narrower than the item's (causal: warpgroup 0 can end a key tile earlier) still
waits on and releases the slots it skips, so the barrier phases of both consumers
stay in step with the producer. Measured (BENCHMARKS.md, session 5): persistence
took d128 from 1.40 to 1.30 ms; the consumers' turns took a further 2-5% off the
full and causal forwards (session 6); pairing causal tiles with their mirrors, as
the Triton forward does, gained nothing here and is not done. With a bfloat16
[1, N, T, S] bias at d128 this forward took 1.30 ms against the Triton forward's
1.58 (session 7); loading the bias from global memory straight into registers
instead took 1.82.
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
from pallas_attn.kernels import scores
from pallas_attn.kernels.common import (
    MAX_FLOOR,
    Problem,
    TileContext,
    logit_scores,
    run_tile_loops,
)
from pallas_attn.spec import AttentionSpec
from pallas_attn.tuning import MOSAIC_BLOCK_Q, padded_head_dim

# Query rows per item (BlockSizes.block_q) and per consumer warpgroup (the wgmma
# M dimension), and so the consumers per item.
ITEM_ROWS = MOSAIC_BLOCK_Q
ROWS_PER_CONSUMER = 64
CONSUMERS = ITEM_ROWS // ROWS_PER_CONSUMER
# Register budgets (per thread) after the warpgroups specialise: consumers hold the
# accumulator and the score tile, the producer only issues copies.
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40
_HEAD_DIMS = (64, 128)
_DTYPES = ("bfloat16", "float16")


def unsupported_scores(spec: AttentionSpec, present: tuple[str, ...]) -> str:
    """Why this kernel cannot compute these scores, or "" when it can (the part of
    `unsupported` known before tiles are chosen)."""
    if spec.has_dropout:
        return f"no dropout, got dropout_rate={spec.dropout_rate}"
    others = [name for name in present if name not in ("bias", "alibi_slopes")]
    if others:
        return (f"it takes no operand besides q, k, v, a bias and ALiBi slopes, got "
                f"{', '.join(others)}")
    if spec.has_bias and 1 in spec.bias_shape[2:]:
        return (f"the bias needs its own entry per query and key, got a bias of shape "
                f"{spec.bias_shape} (broadcast along queries or keys)")
    return ""


def unsupported(problem: Problem) -> str:
    """Why this kernel cannot run the problem, or "" when it can."""
    if problem.dtype not in _DTYPES:
        return f"inputs must be bfloat16 or float16, got {problem.dtype}"
    if why := unsupported_scores(problem.spec, problem.present):
        return why
    dims = (padded_head_dim(problem.head_dim), padded_head_dim(problem.value_head_dim))
    if not set(dims) <= set(_HEAD_DIMS):
        return (f"head dims must pad to {_HEAD_DIMS}, got {problem.head_dim} and "
                f"{problem.value_head_dim}")
    return ""


def smem_tiles(shape: tuple[int, ...], dtype: Any) -> Any:
    # 128-byte swizzled tiles (64 16-bit elements): the wgmma operand layout.
    row = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, row)),
                                                plgpu.SwizzleTransform(128)))


@dataclasses.dataclass(frozen=True)
class _Band:
    """Key tiles [first, stop) of some query rows; [full_first, full_stop) need no
    band mask."""
    first: Any
    stop: Any
    full_first: Any
    full_stop: Any


@dataclasses.dataclass(frozen=True)
class _Item:
    """One unit of work: 128 query rows from q0 of batch entry b, head n."""
    valid: Any
    q0: Any
    b: Any
    n: Any


@dataclasses.dataclass(frozen=True)
class Walk:
    """The persistent programs' walk over items of ITEM_ROWS query rows, each with its
    band of key tiles streamed through a ring of shared-memory slots (the forward's
    and the dQ kernel's).

    Round r gives program pid item r * programs + pid, the lanes reversed on odd
    rounds so that heavy and light causal tiles even out over the rounds. Items run
    query tiles fastest (heaviest first), so concurrent programs share K/V.
    """

    problem: Problem
    programs: int
    block_k: int
    stages: int

    @property
    def num_tiles(self) -> int:
        return self.problem.q_pad // ITEM_ROWS

    @property
    def items(self) -> int:
        return self.num_tiles * self.problem.batch * self.problem.num_heads

    @property
    def rounds(self) -> int:
        return -(-self.items // self.programs)

    def item(self, r) -> _Item:
        pid = lax.axis_index("program")
        lane = jnp.where(lax.rem(r, 2) == 0, pid, self.programs - 1 - pid)
        idx = r * self.programs + lane
        batch_head = lax.div(idx, self.num_tiles)
        return _Item(idx < self.items,
                     (self.num_tiles - 1 - lax.rem(idx, self.num_tiles)) * ITEM_ROWS,
                     lax.rem(batch_head, self.problem.batch),
                     lax.div(batch_head, self.problem.batch))

    def band(self, item: _Item) -> tuple[TileContext, _Band, Any]:
        """(context, key tiles, ring steps) of an item; no steps for an invalid one."""
        ctx = TileContext(self.problem, {}, item.b, item.n)
        tiles = _Band(*ctx.key_tiles(item.q0, item.q0 + ITEM_ROWS, self.block_k))
        steps = jnp.where(item.valid, jnp.maximum(tiles.stop - tiles.first, 0), 0)
        return ctx, tiles, steps

    def slot(self, step):
        return lax.rem(step, jnp.int32(self.stages))

    def stream(self, k_ref, v_ref, k_smem, v_smem, ring) -> None:
        """The producer: bulk-copies every item's K and V tiles into the ring.

        ring: the (k_loaded, v_loaded, k_consumed, v_consumed) barriers, one of each
        per slot; a slot is refilled once both consumers released it."""
        k_loaded, v_loaded, k_consumed, v_consumed = ring
        block_k, stages, problem = self.block_k, self.stages, self.problem

        def stream(r, step):
            item = self.item(r)
            _, tiles, steps = self.band(item)
            kh = lax.div(item.n, jnp.int32(problem.group))

            @pl.loop(0, steps)
            def _load(i):
                slot = self.slot(step + i)

                @pl.when(step + i >= stages)
                def _wait_released():
                    plgpu.barrier_wait(k_consumed.at[slot])
                    plgpu.barrier_wait(v_consumed.at[slot])

                rows = pl.ds((tiles.first + i) * block_k, block_k)
                plgpu.copy_gmem_to_smem(k_ref.at[item.b, rows, kh], k_smem.at[slot],
                                        k_loaded.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[item.b, rows, kh], v_smem.at[slot],
                                        v_loaded.at[slot])

            return step + steps

        total = lax.fori_loop(0, self.rounds, stream, jnp.int32(0))

        # Observe the last releases too, so every barrier ends in a phase this
        # warpgroup has seen (the interpreter checks it; it costs the tail of the
        # program nothing on the GPU).
        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _drain(step):
            plgpu.barrier_wait(k_consumed.at[self.slot(step)])
            plgpu.barrier_wait(v_consumed.at[self.slot(step)])

    def bias_rows(self, bias_ref, item: _Item, row0, buffers, barriers) -> Any:
        """This consumer's bias stream (`BiasTiles`) over its rows of the item, through
        its own buffer and barrier (of one per consumer), or None without a bias."""
        if bias_ref is None:
            return None
        wg = lax.axis_index("wg")
        Bb, Nb = self.problem.spec.bias_shape[:2]
        rows = bias_ref.at[item.b if Bb > 1 else 0, item.n if Nb > 1 else 0,
                           pl.ds(row0, ROWS_PER_CONSUMER)]
        return BiasTiles(rows, buffers.at[wg], barriers.at[wg], self.block_k)


@dataclasses.dataclass(frozen=True)
class BiasTiles:
    """One consumer's bias rows in global memory, read tile by tile through its own
    shared-memory buffer: each tile's copy is issued as soon as the previous tile is in
    registers, one step ahead."""

    rows: Any
    buffer: Any
    loaded: Any
    block_k: int

    def start(self, t) -> None:
        plgpu.copy_gmem_to_smem(self.rows.at[:, pl.ds(t * self.block_k, self.block_k)],
                                self.buffer, self.loaded)

    def take(self, t, stop) -> jax.Array:
        """Key tile t of the bias (float32, WGMMA layout); starts tile t + 1 below stop."""
        plgpu.barrier_wait(self.loaded)
        bias = plgpu.load(self.buffer, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        plgpu.commit_smem()  # the reads are done before the next copy overwrites
        pl.when(t + 1 < stop)(lambda: self.start(t + 1))
        return bias


def own_band(ctx: TileContext, tiles: _Band, row0, stop, block_k: int) -> _Band:
    """A consumer's key tiles (its 64 rows from row0), clipped into the item's
    [tiles.first, stop) (they agree except at the band's ends)."""
    own = _Band(*ctx.key_tiles(row0, row0 + ROWS_PER_CONSUMER, block_k))
    first = jnp.clip(own.first, tiles.first, stop)
    last = jnp.clip(own.stop, first, stop)
    full_first = jnp.clip(own.full_first, first, last)
    return _Band(first, last, full_first, jnp.clip(own.full_stop, full_first, last))


def run_band(first, stop, own: _Band, release, step, carry) -> Any:
    """A consumer's pass over the item's key tiles [first, stop): step(t, carry, masked)
    on its own tiles (band masks only where `own` says), release(t) on the others.

    Every key tile is two turns of the consumers' alternation for each consumer,
    skipped tiles included (`release_slot`), so the turns stay paired."""
    def skip(lo, hi):
        @pl.loop(lo, jnp.maximum(hi, lo))
        def _(t):
            release(t)

    skip(first, own.first)
    carry = run_tile_loops(own.first, own.stop, own.full_first, own.full_stop, step, carry)
    skip(own.stop, stop)
    return carry


def release_slot(slot, ring, schedule) -> None:
    """A consumer's part in a key tile it skips: wait for the slot's K and V, give each
    back and take the tile's two turns."""
    k_loaded, v_loaded, k_consumed, v_consumed = ring
    plgpu.barrier_wait(k_loaded.at[slot])
    plgpu.barrier_arrive(k_consumed.at[slot])
    take_turn(schedule)
    plgpu.barrier_wait(v_loaded.at[slot])
    plgpu.barrier_arrive(v_consumed.at[slot])
    take_turn(schedule)


def _kernel(q_ref, k_ref, v_ref, bias_ref, slopes_ref, out_ref, row_max_ref, log2_sum_ref,
            scratch, *, problem: Problem, programs: int):
    (q_smem, o_smem, k_smem, v_smem, p_smem, bias_smem), barriers = scratch
    o_smem = p_smem if o_smem is None else o_smem
    q_loaded, k_loaded, v_loaded, k_consumed, v_consumed, schedule, bias_loaded = barriers
    ring = (k_loaded, v_loaded, k_consumed, v_consumed)
    walk = Walk(problem, programs, problem.blocks.block_k, problem.blocks.num_stages)
    wg = lax.axis_index("wg")

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        walk.stream(k_ref, v_ref, k_smem, v_smem, ring)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        rows_n = ROWS_PER_CONSUMER
        q_mine, o_mine, p_mine = q_smem.at[wg], o_smem.at[wg], p_smem.at[wg]

        def load_q(item: _Item):
            @pl.when(item.valid)
            def _():
                plgpu.copy_gmem_to_smem(
                    q_ref.at[item.b, pl.ds(item.q0 + wg * rows_n, rows_n), item.n], q_mine,
                    q_loaded.at[wg])

        load_q(walk.item(0))
        # Consumer 1 starts half a turn behind consumer 0 (see _consume) and
        # consumer 0 takes that half turn at the end.
        pl.when(wg == 1)(lambda: take_turn(schedule))

        def work(r, step):
            item = walk.item(r)
            ctx, tiles, steps = walk.band(item)
            row0 = item.q0 + wg * rows_n
            # The previous item's output copies read o_mine, which may be p_mine.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            pl.when(item.valid)(lambda: plgpu.barrier_wait(q_loaded.at[wg]))
            bias = walk.bias_rows(bias_ref, item, row0, bias_smem, bias_loaded)
            acc, m, l_sum = _consume(
                problem, ctx, tiles, lambda t: walk.slot(step + t - tiles.first), row0,
                tiles.first + steps, q_mine, k_smem, v_smem, p_mine, o_mine.shape[-1],
                ring, schedule, bias, head_slope(slopes_ref, item.valid, item.b, item.n))
            load_q(walk.item(r + 1))  # every Q K^T of this item is done: q_mine is free

            @pl.when(item.valid)
            def _store():
                rows = row0 + plgpu.broadcasted_iota(jnp.int32, (rows_n,), 0,
                                                     layout=plgpu.Layout.WGMMA.reduce(1))
                valid = (l_sum > 0.0) & (rows < problem.q_len)
                inv = jnp.where(valid, 1.0 / jnp.where(valid, l_sum, 1.0), 0.0)
                o_mine[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(
                    o_mine.dtype)
                plgpu.commit_smem()
                out_rows = pl.ds(row0, rows_n)
                plgpu.copy_smem_to_gmem(o_mine, out_ref.at[item.b, out_rows, item.n])
                row_max_ref.at[item.b, item.n, out_rows][...] = jnp.where(valid, m, jnp.inf)
                log2_sum_ref.at[item.b, item.n, out_rows][...] = jnp.log2(
                    jnp.where(valid, l_sum, 1.0))

            return step + steps

        lax.fori_loop(0, walk.rounds, work, jnp.int32(0))
        pl.when(wg == 0)(lambda: take_turn(schedule))
        plgpu.wait_smem_to_gmem(0)


def take_turn(schedule) -> None:
    """Both consumers arrive, then both wait: one step of their alternation."""
    plgpu.barrier_arrive(schedule)
    plgpu.barrier_wait(schedule)


def _consume(problem: Problem, ctx: TileContext, tiles: _Band, slot_of, row0, stop,
             q_smem, k_smem, v_smem, p_smem, hv: int, ring, schedule,
             bias: BiasTiles | None, slope) -> tuple[Any, Any, Any]:
    """One consumer warpgroup: (acc, row reference, row sum) of rows [row0, row0 + 64)
    against key tiles [tiles.first, stop) (stop = tiles.first for no work).

    The two consumers take turns on the tensor cores through the `schedule` barrier
    (two-arrival, FlashAttention-3's ping-pong): a consumer issues its P V and its
    next Q K^T, then waits until the other has finished its softmax, so one's
    softmax runs while the other's products do (`run_band` keeps the turns paired).

    bias: None, or this consumer's bias stream (`BiasTiles`); scores with a bias stay
    in natural units (Problem.exp2_factor), as in the Triton forward. slope: the
    head's ALiBi slope or None.
    """
    k_loaded, v_loaded, k_consumed, v_consumed = ring
    block_k = problem.blocks.block_k
    fixed = problem.fixed_row_reference
    rows_n = ROWS_PER_CONSUMER
    dtype = q_smem.dtype
    own = own_band(ctx, tiles, row0, stop, block_k)

    def step(t, carry, masked: bool):
        acc, m_prev, l_prev = carry
        slot = slot_of(t)
        tile_bias = None if bias is None else bias.take(t, own.stop)
        plgpu.barrier_wait(k_loaded.at[slot])

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            take_turn(schedule)  # the other consumer's softmax is done
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((rows_n, block_k), jnp.float32))
        plgpu.barrier_arrive(k_consumed.at[slot])
        s, _ = tile_scores(problem, s, row0, t * block_k, masked, bias=tile_bias, slope=slope)
        if fixed is not None:  # bounded scores: the bound is every row's reference
            m_next, alpha = m_prev, None
            prob = jnp.exp2(s - fixed)
            l_next = l_prev + prob.sum(axis=1)
        else:
            m_next = jnp.maximum(m_prev, s.max(axis=1))  # stays >= MAX_FLOOR
            alpha = problem.exp2_of(m_prev - m_next)  # natural units: times log2(e)
            prob = problem.exp2_of(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
            l_next = l_prev * alpha + prob.sum(axis=1)
        p_smem[...] = prob.astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_arrive(schedule)  # this softmax is done
        plgpu.barrier_wait(v_loaded.at[slot])
        plgpu.barrier_wait(schedule)  # the other consumer has issued its Q K^T

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]

        update = pl.run_scoped(pv, plgpu.ACC((rows_n, hv), jnp.float32))
        acc = acc + update if alpha is None else (
            acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + update)
        plgpu.barrier_arrive(v_consumed.at[slot])
        return acc, m_next, l_next

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    carry = (plgpu.layout_cast(jnp.zeros((rows_n, hv), jnp.float32), plgpu.Layout.WGMMA),
             plgpu.layout_cast(jnp.full((rows_n,), MAX_FLOOR if fixed is None else fixed,
                                        jnp.float32), row_layout),
             plgpu.layout_cast(jnp.zeros((rows_n,), jnp.float32), row_layout))
    if bias is not None:
        pl.when(own.first < own.stop)(lambda: bias.start(own.first))
    return run_band(tiles.first, stop, own, lambda t: release_slot(slot_of(t), ring, schedule),
                    step, carry)


def tile_scores(problem: Problem, s: jax.Array, row0, k0, masked: bool, *,
                bias: jax.Array | None = None, slope: Any = None
                ) -> tuple[jax.Array, jax.Array | None]:
    """(scores, t = tanh(logits / cap) or None) of a [rows, keys] tile in the WGMMA
    layout from the raw products s = Q K^T: common.logit_scores, then the band masks
    (causal, window, padded keys) of rows from row0 and keys from k0 where masked,
    invisible entries at -inf. bias: the tile's bias (float32) or None; slope: the
    head's ALiBi slope (a scalar) or None. The Mosaic kernels' one score rule."""
    rows = cols = None
    if masked or slope is not None:
        def iota(dim):
            return plgpu.broadcasted_iota(jnp.int32, s.shape, dim, layout=plgpu.Layout.WGMMA)
        rows, cols = row0 + iota(0), k0 + iota(1)
    s, cap_tanh = logit_scores(problem, s, rows, cols, bias=bias, slope=slope)
    if masked:
        visible = scores.visibility(
            rows, cols, problem.spec, problem.offset,
            kv_bound=problem.kv_len if problem.kv_pad != problem.kv_len else None)
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
    return s, cap_tanh


def forward(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array,
            optional: dict[str, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """(out [B, Tp, N, Hvp], (row_max, log2_sum) [B, N, Tp]) for padded inputs."""
    if (set(optional) - {"bias", "alibi_slopes"} or unsupported(problem)
            or problem.blocks.block_q != ITEM_ROWS):
        raise AssertionError(f"mosaic_fwd.forward called for an unsupported problem: "
                             f"{unsupported(problem) or problem.blocks}")
    B, Tp, N, hp = q.shape
    hvp = v.shape[-1]
    blocks = problem.blocks
    block_k, stages = blocks.block_k, blocks.num_stages
    dtype = q.dtype
    row = jax.ShapeDtypeStruct((B, N, Tp), jnp.float32)
    out_type = (jax.ShapeDtypeStruct((B, Tp, N, hvp), dtype), row, row)

    bias, slopes = optional.get("bias"), optional.get("alibi_slopes")

    def entry(q_ref, k_ref, v_ref, *refs):
        bias_ref, slopes_ref = optional_refs(refs, bias, slopes)
        out_ref, row_max_ref, log2_sum_ref = refs[-3:]
        buffers = (
            smem_tiles((CONSUMERS, ROWS_PER_CONSUMER, hp), dtype),
            # The output is staged in P's buffer when the shapes agree.
            smem_tiles((CONSUMERS, ROWS_PER_CONSUMER, hvp), dtype) if hvp != block_k else None,
            smem_tiles((stages, block_k, hp), dtype),
            smem_tiles((stages, block_k, hvp), dtype),
            smem_tiles((CONSUMERS, ROWS_PER_CONSUMER, block_k), dtype),
            None if bias is None else smem_tiles((CONSUMERS, ROWS_PER_CONSUMER, block_k),
                                            bias.dtype),
        )
        barriers = (
            plgpu.Barrier(num_barriers=CONSUMERS),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMERS),  # the consumers' turns
            None if bias is None else plgpu.Barrier(num_barriers=CONSUMERS),
        )
        pl.run_scoped(
            lambda *scratch: _kernel(q_ref, k_ref, v_ref, bias_ref, slopes_ref, out_ref,
                                     row_max_ref, log2_sum_ref, (scratch[:6], scratch[6:]),
                                     problem=problem, programs=programs),
            *buffers, *barriers, collective_axes="wg")

    programs = tuning.persistent_programs(Tp // ITEM_ROWS * B * N, problem.interpret)
    out, row_max, log2_sum = launch(entry, out_type, programs, problem.interpret)(
        q, k, v, *(x for x in (bias, slopes) if x is not None))
    return out, (row_max, log2_sum)


def optional_refs(refs, *operands) -> list[Any]:
    """The refs of the optional operands among a kernel's refs (which start with them, in
    this order), None for an operand that is None."""
    refs = iter(refs)
    return [None if x is None else next(refs) for x in operands]


def row_residuals(row_stats: tuple[jax.Array, jax.Array], delta: jax.Array) -> jax.Array:
    """The backward kernels' row residuals [B, N, 3, Tp] float32: (row reference, log2
    row sum, delta) stacked, so a consumer copies its rows' three in one bulk copy.

    delta passes an optimization barrier first. Without it XLA fuses the reduction
    that computes delta (sum over the head dim of dO * out) into the stack, one thread
    per row reading strided entries: 0.29 ms instead of 0.05 at B=4, N=16, T=4096,
    d128 (BENCHMARKS.md, session 12)."""
    return jnp.stack([*row_stats, lax.optimization_barrier(delta)], axis=2)


def head_slope(slopes_ref, valid, b, n) -> Any:
    """The ALiBi slope of head n of batch entry b (a scalar loaded from global memory),
    or None without ALiBi; (b, n) of an invalid work item may lie past the arrays, so
    it reads entry (0, 0) instead."""
    if slopes_ref is None:
        return None
    return slopes_ref[jnp.where(valid, b, 0), jnp.where(valid, n, 0)]


def accumulate(products, interpret: bool) -> tuple[jax.Array, ...]:
    """acc + A B with wgmma for each (acc, A, B) of products (A and B in shared memory),
    one wait for all. The interpreter has no accumulator initialised from registers
    (pl.run_state over plgpu.ACC.init): there the products start from zero and the
    sums happen in registers."""
    if not interpret:
        def run(refs):
            for ref, (_, a, b) in zip(refs, products, strict=True):
                plgpu.wgmma(ref, a, b)

        return pl.run_state(run)(tuple(plgpu.ACC.init(acc) for acc, _, _ in products))

    def run_fresh(*refs):
        for ref, (_, a, b) in zip(refs, products, strict=True):
            plgpu.wgmma(ref, a, b)
        return tuple(ref[...] for ref in refs)

    fresh = pl.run_scoped(run_fresh, *(plgpu.ACC(acc.shape, jnp.float32)
                                       for acc, _, _ in products))
    return tuple(acc + x for (acc, _, _), x in zip(products, fresh, strict=True))


def launch(entry, out_type: Any, programs: int, interpret: bool) -> Any:
    """The persistent warp-specialised kernel `entry` (consumers and a producer, named
    "wg") on `programs` programs (named "program"), as a function of its operands.

    The interpreter poisons every buffer it allocates (outputs included) with NaN and
    runs its happens-before race detector (the Mosaic tests check its verdict).
    """
    params = (plgpu.InterpretGPUParams(uninitialized_memory="nan", detect_races=True)
              if interpret else None)
    return plgpu.kernel(
        entry, out_type=out_type, grid=(programs,), grid_names=("program",),
        num_threads=CONSUMERS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=params)
