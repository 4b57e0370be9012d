"""dQ kernel (Pallas, Triton backend): grid (query tile, batch, head), each program
looping over the key tiles its rows can see, heavy (late) causal tiles first. Every
output element is written by exactly one program: bitwise deterministic. In tiles that
may hide a key, K's non-finite entries are zeroed for dS K (and dS is 0 wherever P is:
`TileContext.score_gradient`); `repair` recomputes the tiles the Mosaic dQ kernel marks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn.kernels.core import Problem, finite, run_tile_loops
from pallas_attn.kernels.triton.context import (
    TileContext,
    head_tile,
    launch,
    launch_repair,
    name_refs,
    repair_marked_tiles,
    store_head_tile,
)


def dq_kernel(*refs, problem: Problem, names: tuple[str, ...]):
    r = name_refs(names, refs)
    i = pl.num_programs(0) - 1 - pl.program_id(0)  # heavy (late) query tiles first
    _dq_tile(problem, r, i, pl.program_id(1), pl.program_id(2))


def _dq_tile(problem: Problem, r: dict, i, b, n) -> None:
    """dq of query tile i of (b, n)."""
    route = problem.plan.dq
    block_q, block_k = route.block_q, route.block_k
    kh = lax.div(n, problem.group)
    q0 = i * block_q
    ctx = TileContext(problem, r, b, n, folds_segments=True)
    # Rows past the query length are zeroed: hidden, they meet no product.
    q = ctx.hide_queries(head_tile(r["q"], b, pl.ds(q0, block_q), n), q0)
    do = ctx.hide_queries(head_tile(r["do"], b, pl.ds(q0, block_q), n), q0)
    residuals = ctx.row_residuals(q0, block_q)
    if "row_scales" in r:  # float16: e joins the log2 row sums, P and dS come out times 2^-e
        row_max, log2_sum, delta = residuals
        residuals = (row_max, log2_sum + r["row_scales"][b, n, 0, pl.ds(q0, block_q)], delta)

    def body(t, dq, masked):
        k0 = t * block_k
        k = head_tile(r["k"], b, pl.ds(k0, block_k), kh)
        v = head_tile(r["v"], b, pl.ds(k0, block_k), kh)
        if ctx.hides_in_tile(masked):  # hidden keys stay out of dS K (and dP: score_gradient)
            k, v = finite(ctx.hide_keys(k, k0)), ctx.hide_keys(v, k0)
        _, ds = ctx.score_gradient(q, k, v, do, residuals, q0, k0, masked)
        return dq + plgpu.dot(ds.astype(k.dtype), k, precision=problem.precision)

    tiles, whole = ctx.key_tiles_of(q0, block_q, block_k)
    dq = run_tile_loops(*tiles, body, jnp.zeros((block_q, q.shape[-1]), jnp.float32),
                        whole=whole)
    if "row_scales" in r:  # times 2^e (core.ds_scales)
        dq = dq * r["row_scales"][b, n, 1, pl.ds(q0, block_q)][:, None]
    dq = dq * (problem.spec.scale * problem.dropout_scale)  # score_gradient leaves it out
    dq = ctx.hide_queries(dq, q0)  # rows past the length: 0, whatever a hidden key held
    store_head_tile(r["dq"], b, pl.ds(q0, block_q), n, dq)


def repair_kernel(*refs, problem: Problem, names: tuple[str, ...], chunk: int):
    """Recomputes the query tiles of (b, n) in its run that hold a marked row (its dq
    holds a NaN)."""
    r = name_refs(names, refs)
    b, n = pl.program_id(1), pl.program_id(2)
    repair_marked_tiles(lambda rows: r["dq_marks"][b, n, :, rows], problem.plan.dq.block_q,
                        chunk, lambda i: _dq_tile(problem, r, i, b, n))


def repair(problem: Problem, names: tuple[str, ...], inputs: list, dq_out: jax.Array,
           marks: jax.Array) -> jax.Array:
    """dq of a Mosaic dQ kernel with its marked rows' tiles recomputed here, in place
    (as `fwd.repair` does for the forward: a non-finite key hidden from a row reaches
    its dq through dS K with dS = 0; this kernel keeps hidden keys out of the product);
    marks [B, N, W, Tp]: NaN for the rows whose dq holds one. A program finding no mark
    only reads its marks."""
    return launch_repair(repair_kernel, problem, "dq", (*names, "dq_marks", "dq_in", "dq"),
                         [*inputs, marks], [dq_out], "pallas_attn_repair_dq")[0]


def dq(problem: Problem, names: tuple[str, ...], inputs: list) -> jax.Array:
    route = problem.plan.dq
    q = inputs[0]
    grid = (problem.q_pad // route.block_q, problem.batch, problem.num_heads)
    return launch(dq_kernel, problem, (*names, "dq"), inputs,
                   [jax.ShapeDtypeStruct(q.shape, q.dtype)], grid, route.num_warps,
                   route.num_stages, "pallas_attn_dq")[0]
