"""dbias kernel (Pallas, Triton backend), for a bias whose gradient the dK/dV kernel
does not write (broadcast over batch entries, heads or keys: its gradient sums dS
across programs). Grid over the bias's own tiles; each program recomputes dS for
every (b, n) pair its entry is broadcast to and sums it over the broadcast axes, in a
fixed order: bitwise deterministic. Only the tiles a member's rows can see run
(`TileRanges.key_tiles`: the causal or window band, the lengths, segment ids and a
mask's ranges), each with every rule (tiles run whole without ids or mask measured
slower: docs/decisions.md, "Triton dbias skips the tiles no row sees").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn.kernels.core import Problem, bias_row_gradient
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
    out_q = block_q if Tb > 1 else 1
    out_k = block_k if Sb > 1 else 1

    def member_body(m, acc):
        b = bb if Bb > 1 else lax.div(m, heads_per)
        n = nb if Nb > 1 else lax.rem(m, heads_per)
        ctx = TileContext(problem, r, b, n)
        kh = lax.div(n, problem.group)

        def row_tile(ti, acc):
            q0 = ti * block_q
            # Rows and keys past the lengths are zeroed: hidden, they meet no product.
            q = ctx.hide_queries(r["q"][b, pl.ds(q0, block_q), n, :], q0)
            do = ctx.hide_queries(r["do"][b, pl.ds(q0, block_q), n, :], q0)
            residuals = ctx.row_residuals(q0, block_q)

            def tile_body(tj, acc):
                k0 = tj * block_k
                k = ctx.hide_keys(r["k"][b, pl.ds(k0, block_k), kh, :], k0)
                v = ctx.hide_keys(r["v"][b, pl.ds(k0, block_k), kh, :], k0)
                if Sb == 1:  # the rows' sums: dS's, P dP's and P's (cap slope included)
                    _, ds, p_dp, p_slope = ctx.score_gradient(q, k, v, do, residuals, q0, k0,
                                                              True, row_terms=True)
                    return (acc[0] + jnp.sum(ds, axis=1), acc[1] + p_dp, acc[2] + p_slope)
                _, ds = ctx.score_gradient(q, k, v, do, residuals, q0, k0, True)
                if Tb == 1:
                    ds = jnp.sum(ds, axis=0, keepdims=True)
                return acc + ds

            # Only the key tiles these rows can see (their band, lengths, segments, the
            # mask's ranges), every rule applied; a bias with its own keys: this
            # program's tile, if they see it.
            first, stop, _, _ = ctx.key_tiles(q0, q0 + block_q, block_k,
                                              ctx.key_limits(q0, block_q))
            if Sb > 1:
                first, stop = jnp.clip(first, kt, kt + 1), jnp.clip(stop, kt, kt + 1)
                return lax.fori_loop(first, stop, tile_body, acc)
            zeros = jnp.zeros((block_q,), jnp.float32)
            ds_sum, p_dp, p_slope = lax.fori_loop(first, stop, tile_body, (zeros,) * 3)
            rows = bias_row_gradient(problem, ds_sum, p_dp, p_slope, residuals[2],
                                     r["lse_grad"][b, n, pl.ds(q0, block_q)])[:, None]
            return acc + (jnp.sum(rows, axis=0, keepdims=True) if Tb == 1 else rows)

        if Tb > 1:
            return row_tile(qt, acc)
        return lax.fori_loop(0, problem.q_pad // block_q, row_tile, acc)

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
