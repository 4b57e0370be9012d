"""dQ kernel (Pallas, Triton backend): grid (query tile, batch, head), each program
looping over the key tiles its rows can see, heavy (late) causal tiles first. Every
output element is written by exactly one program: bitwise deterministic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn.kernels.core import Problem, run_tile_loops
from pallas_attn.kernels.triton.context import TileContext, launch, name_refs


def dq_kernel(*refs, problem: Problem, names: tuple[str, ...]):
    r = name_refs(names, refs)
    route = problem.plan.dq
    block_q, block_k = route.block_q, route.block_k
    i = pl.num_programs(0) - 1 - pl.program_id(0)  # heavy (late) query tiles first
    b, n = pl.program_id(1), pl.program_id(2)
    kh = lax.div(n, problem.group)
    q0 = i * block_q
    ctx = TileContext(problem, r, b, n)
    # Rows past the query length are zeroed: hidden, they meet no product.
    q = ctx.hide_queries(r["q"][b, pl.ds(q0, block_q), n, :], q0)
    do = ctx.hide_queries(r["do"][b, pl.ds(q0, block_q), n, :], q0)
    residuals = ctx.row_residuals(q0, block_q)

    def body(t, dq, masked):
        k0 = t * block_k
        k = r["k"][b, pl.ds(k0, block_k), kh, :]
        v = r["v"][b, pl.ds(k0, block_k), kh, :]
        if masked:  # the tile the key length crosses: its hidden keys stay out
            k, v = ctx.hide_keys(k, k0), ctx.hide_keys(v, k0)
        _, ds = ctx.score_gradient(q, k, v, do, residuals, q0, k0, masked)
        return dq + plgpu.dot(ds.astype(k.dtype), k, precision=problem.precision)

    tiles = ctx.key_tiles(q0, q0 + block_q, block_k, ctx.key_limits(q0, block_q))
    dq = run_tile_loops(*tiles, body, jnp.zeros((block_q, q.shape[-1]), jnp.float32))
    dq = dq * (problem.spec.scale * problem.dropout_scale)  # score_gradient leaves it out
    r["dq"][b, pl.ds(q0, block_q), n, :] = dq.astype(r["dq"].dtype)


def dq(problem: Problem, names: tuple[str, ...], inputs: list) -> jax.Array:
    route = problem.plan.dq
    q = inputs[0]
    grid = (problem.q_pad // route.block_q, problem.batch, problem.num_heads)
    return launch(dq_kernel, problem, (*names, "dq"), inputs,
                   [jax.ShapeDtypeStruct(q.shape, q.dtype)], grid, route.num_warps,
                   route.num_stages, "pallas_attn_dq")[0]
