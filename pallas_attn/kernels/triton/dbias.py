"""dbias kernel (Pallas, Triton backend), for a bias whose gradient the dK/dV kernel
does not write (broadcast over batch entries, heads or keys: its gradient sums dS
across programs). Grid over the bias's own tiles; each program recomputes dS for
every (b, n) pair its entry is broadcast to and sums it over the broadcast axes, in a
fixed order: bitwise deterministic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn.kernels.core import Problem
from pallas_attn.kernels.triton.context import TileContext, launch, name_refs


def dbias_kernel(*refs, problem: Problem, names: tuple[str, ...]):
    """dbias for one tile of the bias's own shape, summed over its broadcast axes."""
    r = name_refs(names, refs)
    Bb, Nb, Tb, Sb = problem.spec.bias_shape
    route = problem.plan.dbias
    block_q, block_k = route.block_q, route.block_k
    qt, kt, bn = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bb, nb = lax.div(bn, Nb), lax.rem(bn, Nb)
    # Members: the (b, n) pairs this bias entry is broadcast to; tiles: the query
    # tiles (if Tb == 1) and key tiles (if Sb == 1) it is broadcast along.
    heads_per = problem.num_heads // Nb
    members = (problem.batch // Bb) * heads_per
    q_tiles = problem.q_pad // block_q if Tb == 1 else 1
    k_tiles = problem.kv_pad // block_k if Sb == 1 else 1
    out_q = block_q if Tb > 1 else 1
    out_k = block_k if Sb > 1 else 1

    def member_body(m, acc):
        b = bb if Bb > 1 else lax.div(m, heads_per)
        n = nb if Nb > 1 else lax.rem(m, heads_per)
        ctx = TileContext(problem, r, b, n)
        kh = lax.div(n, problem.group)

        def tile_body(step, acc):
            ti = qt if Tb > 1 else lax.div(step, k_tiles)
            tj = kt if Sb > 1 else lax.rem(step, k_tiles)
            q0, k0 = ti * block_q, tj * block_k
            # Rows and keys past the lengths are zeroed: hidden, they meet no product.
            q = ctx.hide_queries(r["q"][b, pl.ds(q0, block_q), n, :], q0)
            do = ctx.hide_queries(r["do"][b, pl.ds(q0, block_q), n, :], q0)
            k = ctx.hide_keys(r["k"][b, pl.ds(k0, block_k), kh, :], k0)
            v = ctx.hide_keys(r["v"][b, pl.ds(k0, block_k), kh, :], k0)
            _, ds = ctx.score_gradient(q, k, v, do, ctx.row_residuals(q0, block_q), q0, k0,
                                       True)
            if Tb == 1:
                ds = jnp.sum(ds, axis=0, keepdims=True)
            if Sb == 1:
                ds = jnp.sum(ds, axis=1, keepdims=True)
            return acc + ds

        return lax.fori_loop(0, q_tiles * k_tiles, tile_body, acc)

    acc = lax.fori_loop(0, members, member_body, jnp.zeros((out_q, out_k), jnp.float32))
    rows = pl.ds(qt * block_q, out_q)
    cols = pl.ds(kt * block_k, out_k)
    acc = acc * problem.dropout_scale  # score_gradient leaves it out
    r["dbias"][bb, nb, rows, cols] = acc.astype(r["dbias"].dtype)


def dbias(problem: Problem, names: tuple[str, ...], inputs: list, bias: jax.Array) -> jax.Array:
    route = problem.plan.dbias
    Bb, Nb, Tb, Sb = bias.shape
    grid = (Tb // route.block_q if Tb > 1 else 1, Sb // route.block_k if Sb > 1 else 1,
            Bb * Nb)
    return launch(dbias_kernel, problem, (*names, "dbias"), inputs,
                   [jax.ShapeDtypeStruct(bias.shape, bias.dtype)], grid, route.num_warps,
                   route.num_stages, "pallas_attn_dbias")[0]
