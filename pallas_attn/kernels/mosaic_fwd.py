"""Forward kernel for Hopper (Pallas, Mosaic GPU backend): warp-specialised.

Each program owns 2 * 64 query rows of one (batch entry, head) and runs three
warpgroups. Warpgroup 2 is the producer: it streams K and V tiles from global
into a ring of `num_stages` shared-memory slots with the bulk copy engine, each
slot guarded by a "loaded" barrier (copy completion) and a "consumed" barrier
(both consumers done with it). Warpgroups 0 and 1 are the consumers: each owns
64 query rows, computes S = Q K^T with wgmma into registers, applies the shared
visibility rules (kernels/scores.py) and the same online softmax as the Triton
forward (log2 units, row reference starting at MAX_FLOOR), stages P in shared
memory and accumulates P V with a second wgmma.

It writes the same outputs as triton_fwd.forward: the output and the per-row
residuals (row reference, +inf for rows that see no key, and log2 of the row
sum), so the Triton backward kernels consume them unchanged.

Scope (`unsupported` says what lies outside it): 16-bit inputs, padded head dims
64 or 128, no operand besides q, k and v (no bias, mask, ALiBi, segments, lengths
or dropout) and no soft cap; causal and local windows in both alignments, GQA and
ragged lengths are covered. Everything else runs the Triton forward.

One query tile per program, the heaviest causal tiles launched first. (Pairing
each causal tile with its mirror, as the Triton forward does, was measured no
faster here: BENCHMARKS.md, session 5.) Key tiles outside the tile's band are
never loaded. A consumer whose own band is narrower than the tile's (causal:
warpgroup 0 can end a key tile earlier) still waits on and releases the slots it
skips, so the barrier phases of both consumers stay in step with the producer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.kernels import scores
from pallas_attn.kernels.common import LOG2E, MAX_FLOOR, Problem, TileContext
from pallas_attn.tuning import MOSAIC_BLOCK_Q, padded_head_dim

# Query rows per program (BlockSizes.block_q) and per consumer warpgroup (the wgmma
# M dimension), and so the consumers per program.
PROGRAM_ROWS = MOSAIC_BLOCK_Q
ROWS_PER_CONSUMER = 64
CONSUMERS = PROGRAM_ROWS // ROWS_PER_CONSUMER
# Register budgets (per thread) after the warpgroups specialise: consumers hold the
# accumulator and the score tile, the producer only issues copies.
_CONSUMER_REGISTERS = 232
_PRODUCER_REGISTERS = 40
_HEAD_DIMS = (64, 128)
_DTYPES = ("bfloat16", "float16")


def unsupported(problem: Problem) -> str:
    """Why this kernel cannot run the problem, or "" when it can."""
    spec = problem.spec
    if problem.dtype not in _DTYPES:
        return f"inputs must be bfloat16 or float16, got {problem.dtype}"
    if problem.present:
        return f"it takes no operand besides q, k and v, got {', '.join(problem.present)}"
    if spec.logits_soft_cap is not None:
        return f"no logits_soft_cap, got {spec.logits_soft_cap}"
    if spec.has_dropout:
        return f"no dropout, got dropout_rate={spec.dropout_rate}"
    dims = (padded_head_dim(problem.head_dim), padded_head_dim(problem.value_head_dim))
    if not set(dims) <= set(_HEAD_DIMS):
        return (f"head dims must pad to {_HEAD_DIMS}, got {problem.head_dim} and "
                f"{problem.value_head_dim}")
    return ""


def supports(problem: Problem) -> bool:
    """Whether this kernel covers the problem (else the Triton forward runs)."""
    return not unsupported(problem)


def _smem(shape: tuple[int, ...], dtype: Any) -> Any:
    # 128-byte swizzled tiles of 64 16-bit elements: the wgmma operand layout.
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                                plgpu.SwizzleTransform(128)))


@dataclasses.dataclass(frozen=True)
class _Band:
    """Key tiles [first, stop) of some query rows; [full_first, full_stop) need no
    band mask."""
    first: Any
    stop: Any
    full_first: Any
    full_stop: Any


def _kernel(q_ref, k_ref, v_ref, out_ref, row_max_ref, log2_sum_ref, scratch, *,
            problem: Problem):
    (q_smem, o_smem, k_smem, v_smem, p_smem, stats_smem), barriers = scratch
    q_loaded, k_loaded, v_loaded, k_consumed, v_consumed = barriers
    blocks = problem.blocks
    block_k, stages = blocks.block_k, blocks.num_stages
    b, n = lax.axis_index("batch"), lax.axis_index("head")
    kh = lax.div(n, jnp.int32(problem.group))
    num_tiles = problem.q_pad // PROGRAM_ROWS
    q0 = (num_tiles - 1 - lax.axis_index("tile")) * PROGRAM_ROWS  # heavy causal tiles first
    ctx = TileContext(problem, {}, b, n)
    program = _Band(*ctx.key_tiles(q0, q0 + PROGRAM_ROWS, block_k))
    wg = lax.axis_index("wg")

    def slot_of(t):
        return lax.rem(t - program.first, jnp.int32(stages))

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

        def load(t, slot):
            rows = pl.ds(t * block_k, block_k)
            plgpu.copy_gmem_to_smem(k_ref.at[b, rows, kh], k_smem.at[slot], k_loaded.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, rows, kh], v_smem.at[slot], v_loaded.at[slot])

        for i in range(stages):
            pl.when(program.first + i < program.stop)(lambda i=i: load(program.first + i, i))

        @pl.loop(program.first + stages, jnp.maximum(program.stop, program.first + stages))
        def _refill(t):
            slot = slot_of(t)
            plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.barrier_wait(v_consumed.at[slot])
            load(t, slot)

        # Observe the last releases too, so every barrier ends in a phase this
        # warpgroup has seen (the interpreter checks it; it costs the tail of the
        # program nothing on the GPU).
        @pl.loop(jnp.maximum(program.first, program.stop - stages),
                 jnp.maximum(program.stop, program.first))
        def _drain(t):
            plgpu.barrier_wait(k_consumed.at[slot_of(t)])
            plgpu.barrier_wait(v_consumed.at[slot_of(t)])

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
        _consume(problem, ctx, program, slot_of, q0 + wg * ROWS_PER_CONSUMER,
                 q_ref.at[b, pl.ds(q0 + wg * ROWS_PER_CONSUMER, ROWS_PER_CONSUMER), n],
                 out_ref.at[b, pl.ds(q0 + wg * ROWS_PER_CONSUMER, ROWS_PER_CONSUMER), n],
                 row_max_ref.at[b, n, pl.ds(q0 + wg * ROWS_PER_CONSUMER, ROWS_PER_CONSUMER)],
                 log2_sum_ref.at[b, n, pl.ds(q0 + wg * ROWS_PER_CONSUMER, ROWS_PER_CONSUMER)],
                 q_smem.at[wg], o_smem.at[wg] if o_smem is not None else q_smem.at[wg],
                 k_smem, v_smem, p_smem.at[wg], stats_smem.at[wg], q_loaded.at[wg],
                 (k_loaded, v_loaded, k_consumed, v_consumed))


def _consume(problem: Problem, ctx: TileContext, program: _Band, slot_of, row0,
             q_gmem, out_gmem, row_max_gmem, log2_sum_gmem, q_smem, o_smem, k_smem, v_smem,
             p_smem, stats_smem, q_loaded, ring) -> None:
    """One consumer warpgroup: rows [row0, row0 + 64) against the program's key tiles."""
    k_loaded, v_loaded, k_consumed, v_consumed = ring
    spec, blocks = problem.spec, problem.blocks
    block_k = blocks.block_k
    rows_n, hv = ROWS_PER_CONSUMER, o_smem.shape[-1]
    dtype = q_smem.dtype
    own = _Band(*ctx.key_tiles(row0, row0 + rows_n, block_k))
    # The consumer's own band, clipped into the program's (they agree except at the ends).
    own_first = jnp.clip(own.first, program.first, program.stop)
    own_stop = jnp.clip(own.stop, own_first, program.stop)

    plgpu.copy_gmem_to_smem(q_gmem, q_smem, q_loaded)
    plgpu.barrier_wait(q_loaded)

    def release(t):
        slot = slot_of(t)
        plgpu.barrier_wait(k_loaded.at[slot])
        plgpu.barrier_arrive(k_consumed.at[slot])
        plgpu.barrier_wait(v_loaded.at[slot])
        plgpu.barrier_arrive(v_consumed.at[slot])

    def step(t, carry, masked: bool):
        acc, m_prev, l_prev = carry
        slot = slot_of(t)
        plgpu.barrier_wait(k_loaded.at[slot])

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((rows_n, block_k), jnp.float32))
        plgpu.barrier_arrive(k_consumed.at[slot])
        s = s * (spec.scale * LOG2E)  # log2 units
        if masked:
            rows = row0 + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
            cols = t * block_k + plgpu.broadcasted_iota(jnp.int32, s.shape, 1,
                                                        layout=plgpu.Layout.WGMMA)
            visible = scores.visibility(
                rows, cols, spec, problem.offset,
                kv_bound=problem.kv_len if problem.kv_pad != problem.kv_len else None)
            if visible is not None:
                s = jnp.where(visible, s, -jnp.inf)
        m_next = jnp.maximum(m_prev, s.max(axis=1))  # stays >= MAX_FLOOR
        alpha = jnp.exp2(m_prev - m_next)
        prob = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
        l_next = l_prev * alpha + prob.sum(axis=1)
        p_smem[...] = prob.astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(v_loaded.at[slot])

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]

        update = pl.run_scoped(pv, plgpu.ACC((rows_n, hv), jnp.float32))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + update
        plgpu.barrier_arrive(v_consumed.at[slot])
        return acc, m_next, l_next

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    carry = (plgpu.layout_cast(jnp.zeros((rows_n, hv), jnp.float32), plgpu.Layout.WGMMA),
             plgpu.layout_cast(jnp.full((rows_n,), MAX_FLOOR, jnp.float32), row_layout),
             plgpu.layout_cast(jnp.zeros((rows_n,), jnp.float32), row_layout))
    full_first = jnp.clip(own.full_first, own_first, own_stop)
    full_stop = jnp.clip(own.full_stop, full_first, own_stop)

    def skip(lo, hi):
        @pl.loop(lo, jnp.maximum(hi, lo))
        def _(t):
            release(t)

    def compute(lo, hi, masked, c):
        return lax.fori_loop(lo, hi, lambda t, c: step(t, c, masked), c)

    skip(program.first, own_first)
    carry = compute(own_first, full_first, True, carry)
    carry = compute(full_first, full_stop, False, carry)
    acc, m, l_sum = compute(full_stop, own_stop, True, carry)
    skip(own_stop, program.stop)

    rows = row0 + plgpu.broadcasted_iota(jnp.int32, (rows_n,), 0, layout=row_layout)
    valid = (l_sum > 0.0) & (rows < problem.q_len)
    inv = jnp.where(valid, 1.0 / jnp.where(valid, l_sum, 1.0), 0.0)
    o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
    stats_smem.at[0][...] = jnp.where(valid, m, jnp.inf)
    stats_smem.at[1][...] = jnp.log2(jnp.where(valid, l_sum, 1.0))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_gmem)
    plgpu.copy_smem_to_gmem(stats_smem.at[0], row_max_gmem)
    plgpu.copy_smem_to_gmem(stats_smem.at[1], log2_sum_gmem)
    plgpu.wait_smem_to_gmem(0)


def forward(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array,
            optional: dict[str, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """(out [B, Tp, N, Hvp], (row_max, log2_sum) [B, N, Tp]) for padded inputs."""
    if optional or unsupported(problem) or problem.blocks.block_q != PROGRAM_ROWS:
        raise AssertionError(f"mosaic_fwd.forward called for an unsupported problem: "
                             f"{unsupported(problem) or problem.blocks}")
    B, Tp, N, hp = q.shape
    hvp = v.shape[-1]
    blocks = problem.blocks
    block_k, stages = blocks.block_k, blocks.num_stages
    dtype = q.dtype
    row = jax.ShapeDtypeStruct((B, N, Tp), jnp.float32)
    out_type = (jax.ShapeDtypeStruct((B, Tp, N, hvp), dtype), row, row)

    def entry(q_ref, k_ref, v_ref, out_ref, row_max_ref, log2_sum_ref):
        buffers = (
            _smem((CONSUMERS, ROWS_PER_CONSUMER, hp), dtype),
            _smem((CONSUMERS, ROWS_PER_CONSUMER, hvp), dtype) if hvp != hp else None,
            _smem((stages, block_k, hp), dtype),
            _smem((stages, block_k, hvp), dtype),
            _smem((CONSUMERS, ROWS_PER_CONSUMER, block_k), dtype),
            plgpu.SMEM((CONSUMERS, 2, ROWS_PER_CONSUMER), jnp.float32),
        )
        barriers = (
            plgpu.Barrier(num_barriers=CONSUMERS),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        )
        pl.run_scoped(
            lambda *scratch: _kernel(q_ref, k_ref, v_ref, out_ref, row_max_ref, log2_sum_ref,
                                     (scratch[:6], scratch[6:]), problem=problem),
            *buffers, *barriers, collective_axes="wg")

    interpret = plgpu.InterpretGPUParams() if problem.interpret else None
    out, row_max, log2_sum = plgpu.kernel(
        entry, out_type=out_type, grid=(Tp // PROGRAM_ROWS, B, N),
        grid_names=("tile", "batch", "head"), num_threads=CONSUMERS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret,
    )(q, k, v)
    return out, (row_max, log2_sum)
