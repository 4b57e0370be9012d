"""Forward kernel (Pallas, Triton backend): FlashAttention-2 algorithm 1.

Grid (query tile, batch, head); under causal masking each program takes a query
tile and its mirror (common.schedule_query_tiles), so every program does the same
work. A program keeps its query tile resident and loops over key/value tiles with
an online softmax in float32: row reference m (the running maximum), running sum
l, unnormalised accumulator acc. Key tiles outside the causal/window band or past
the key length are skipped; tiles crossing the band edge are masked. Writes the
output and the per-row residuals: the reference (+inf for rows that see no key)
and log2 of the row sum (common.py says why not the lse).

In a tile that may hide a key from one of its rows (`TileContext.hides_in_tile`), a
key whose K or V row holds a NaN or inf gets a NaN score column before the visibility
rules and V's non-finite entries are zeroed: the rows that see it are NaN, the others
unchanged. `repair` recomputes the rows a Mosaic forward marked for the same reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn.kernels import padded_head_dim
from pallas_attn.kernels.core import (
    KERNEL_INPUTS,
    MAX_FLOOR,
    Problem,
    finite,
    merge_sink,
    nonfinite_rows,
    run_tile_loops,
    softmax_step,
)
from pallas_attn.kernels.triton.context import (
    TileContext,
    head_tile,
    launch,
    launch_repair,
    name_refs,
    repair_marked_tiles,
    schedule_query_tiles,
    scheduled_grid_size,
    store_head_tile,
)

# Every optional operand but the ranges of the queries that see each key, which only
# dK/dV reads: a call that runs the forward alone then never computes them.
FORWARD_INPUTS = tuple(x for x in KERNEL_INPUTS if x != "query_ranges")


def forward_kernel(*refs, problem: Problem, names: tuple[str, ...]):
    r = name_refs(names, refs)
    b, n = pl.program_id(1), pl.program_id(2)
    num_tiles = problem.q_pad // problem.plan.forward.block_q
    schedule_query_tiles(num_tiles, problem.pairs_causal_tiles,
                         lambda i: _forward_tile(problem, r, _context(problem, r, b, n), i))


def _context(problem: Problem, r: dict, b, n) -> TileContext:
    return TileContext(problem, r, b, n, folds_segments=True)


def _forward_tile(problem: Problem, r: dict, ctx: TileContext, i) -> None:
    """Output rows and row residuals of query tile i."""
    spec, route = problem.spec, problem.plan.forward
    block_q, block_k = route.block_q, route.block_k
    b, n = ctx.b, ctx.n
    kh = lax.div(n, problem.group)
    q0 = i * block_q
    q = head_tile(r["q"], b, pl.ds(q0, block_q), n)

    def body(t, carry, masked):
        acc, m_prev, l_prev = carry
        k0 = t * block_k
        k = head_tile(r["k"], b, pl.ds(k0, block_k), kh)
        v = poison = None
        if ctx.hides_in_tile(masked):  # hidden keys' values stay out
            v = head_tile(r["v"], b, pl.ds(k0, block_k), kh)
            poison = nonfinite_rows(k) + nonfinite_rows(v)
            v = finite(ctx.hide_keys(v, k0))
        s, _, _ = ctx.scores(q, k, q0, k0, masked, poison)
        prob, m_next, l_next, alpha = softmax_step(problem, s, m_prev, l_prev)
        acc = acc * alpha[:, None]
        if spec.has_dropout:
            prob = jnp.where(ctx.keep(q0, k0, block_q, block_k), prob, 0.0)
        if v is None:
            v = head_tile(r["v"], b, pl.ds(k0, block_k), kh)
        acc = acc + plgpu.dot(prob.astype(v.dtype), v, precision=problem.precision)
        return acc, m_next, l_next

    init = (
        jnp.zeros((block_q, padded_head_dim(r["v"].shape[-1])), jnp.float32),
        jnp.full((block_q,), MAX_FLOOR, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    tiles, whole = ctx.key_tiles_of(q0, block_q, block_k)
    acc, m, l_sum = run_tile_loops(*tiles, body, init, whole=whole)
    if problem.has("sinks"):
        alpha, m, l_sum = merge_sink(problem, r["sinks"][n], m, l_sum)
        acc = acc * alpha[:, None]

    rows = q0 + jax.lax.iota(jnp.int32, block_q)
    valid = (l_sum != 0.0) & (rows < problem.q_len)  # NaN: seen, so the NaN shows
    if ctx.q_length is not None:
        valid = valid & (rows < ctx.q_length)
    scale = problem.dropout_scale
    out = jnp.where(valid[:, None], acc * (scale / jnp.where(valid, l_sum, 1.0))[:, None], 0.0)
    store_head_tile(r["out"], b, pl.ds(q0, block_q), n, out)
    r["row_max"][b, n, pl.ds(q0, block_q)] = jnp.where(valid, m, jnp.inf)
    r["log2_sum"][b, n, pl.ds(q0, block_q)] = jnp.log2(jnp.where(valid, l_sum, 1.0))


def repair_kernel(*refs, problem: Problem, names: tuple[str, ...], chunk: int):
    """Recomputes the query tiles of (b, n) in its run that hold a marked row (a NaN log2
    row sum)."""
    r = name_refs(names, refs)
    b, n = pl.program_id(1), pl.program_id(2)
    repair_marked_tiles(lambda rows: r["sum_in"][b, n, rows], problem.plan.forward.block_q,
                        chunk, lambda i: _forward_tile(problem, r, _context(problem, r, b, n),
                                                       i))


def repair(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array,
           optional: dict[str, jax.Array], out: jax.Array,
           row_stats: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, tuple[jax.Array,
                                                                             jax.Array]]:
    """The results of a Mosaic forward with its marked rows recomputed here, in place.

    The Mosaic kernels read whole key tiles into products with the probabilities, where
    a NaN or inf key hidden from a row poisons it (0 * NaN); they mark such rows (any row
    whose output holds a NaN) with a NaN log2 row sum. This kernel recomputes the tiles
    holding a mark with the Triton forward, which keeps hidden keys out of its products:
    a row that sees a non-finite key stays NaN, the others get their true values. A
    program finding no mark only reads its marks."""
    present = [x for x in FORWARD_INPUTS if x in optional]
    names = ("q", "k", "v", *present, "out_in", "max_in", "sum_in", "out", "row_max",
             "log2_sum")
    out, row_max, log2_sum = launch_repair(
        repair_kernel, problem, "forward", names,
        [q, k, v, *(optional[x] for x in present)], [out, *row_stats],
        "pallas_attn_repair_forward")
    return out, (row_max, log2_sum)


def forward(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array,
            optional: dict[str, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """(out [B, Tp, N, Hvp], (row_max, log2_sum) [B, N, Tp]) for padded inputs."""
    present = [x for x in FORWARD_INPUTS if x in optional]
    names = ("q", "k", "v", *present, "out", "row_max", "log2_sum")
    inputs = [q, k, v, *(optional[x] for x in present)]
    B, Tp, N, _ = q.shape
    row = jax.ShapeDtypeStruct((B, N, Tp), jnp.float32)
    out_shape = [jax.ShapeDtypeStruct((B, Tp, N, v.shape[-1]), q.dtype), row, row]
    route = problem.plan.forward
    grid = (scheduled_grid_size(Tp // route.block_q, problem.pairs_causal_tiles), B, N)
    out, row_max, log2_sum = launch(forward_kernel, problem, names, inputs, out_shape, grid,
                                    route.num_warps, route.num_stages, "pallas_attn_forward")
    return out, (row_max, log2_sum)
