"""dK/dV kernel (Pallas, Triton backend): FlashAttention-2's backward, keys outside.

Grid (key tile, batch, kv head): a program keeps its K, V tiles resident and loops
over the query heads of its group and their query tiles, so GQA/MQA gradients are
summed in registers, never through repeated K/V in memory. The backward's
preprocess, delta = rowsum(dO * O) per query row (minus the logsumexp cotangent),
runs in jnp before it (kernels/vjp.py).

When the bias needs a gradient and has its own entry for every batch entry and head
(the plan's fused dbias), it also writes dbias from the dS tiles it computes anyway:
each dbias element belongs to one program (summed over query rows in registers for a
per-key bias), so it is written once, with no extra matrix work. Every output element
is written by exactly one program, with a fixed loop order: bitwise deterministic.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn.kernels.core import Problem, run_tile_loops
from pallas_attn.kernels.triton.context import (
    TileContext,
    head_tile,
    launch,
    launch_repair,
    name_refs,
    repair_marked_tiles,
    store_head_tile,
)


def _store_dbias_outside(r: dict, bb, nb, cols, tiles: tuple[tuple[Any, Any], ...],
                         block_q: int) -> None:
    """Zeros into the dbias tiles of key tile `cols` that the program skipped (outside
    the causal/window band or the sequence lengths): their dS is 0."""
    def tile(t, carry):
        zeros = jnp.zeros((block_q, cols.size), r["dbias"].dtype)
        r["dbias"][bb, nb, pl.ds(t * block_q, block_q), cols] = zeros
        return carry

    for lo, hi in tiles:
        lax.fori_loop(lo, hi, tile, 0)


def dkdv_kernel(*refs, problem: Problem, names: tuple[str, ...], fused_dbias: bool):
    """dK, dV of one key tile; with fused_dbias also its dbias columns (the bias has its
    own entry for every (b, n) then, so each dbias element is written once, here)."""
    r = name_refs(names, refs)
    _dkdv_tile(problem, r, pl.program_id(0), pl.program_id(1), pl.program_id(2), fused_dbias)


def _dkdv_tile(problem: Problem, r: dict, j, b, kh, fused_dbias: bool) -> None:
    """dK, dV (and with fused_dbias its dbias columns) of key tile j of (b, kv head kh)."""
    route = problem.plan.dkdv
    block_q, block_k = route.block_q, route.block_k
    k0 = j * block_k
    cols = pl.ds(k0, block_k)
    k = head_tile(r["k"], b, cols, kh)
    v = head_tile(r["v"], b, cols, kh)
    bias_shape = problem.spec.bias_shape
    rows_broadcast = fused_dbias and bias_shape[2] == 1

    # Keys past the length are zeroed once: hidden, they meet no product (other hidden
    # keys' NaN values reach only dS, which score_gradient zeroes).
    first_head = TileContext(problem, r, b, kh * problem.group)
    k, v = first_head.hide_keys(k, k0), first_head.hide_keys(v, k0)
    # float16: dS times a power of two per key tile stays below 65504 (core.ds_scales);
    # not with a fused dbias, which is dS itself.
    scaled = "key_scales" in r
    # The scales' key tiles may be wider than this kernel's (its repair of a Mosaic dK/dV).
    unit = lax.div(k0, problem.kv_pad // r["key_scales"].shape[3]) if scaled else None
    key_scale = r["key_scales"][b, kh, 0, unit] if scaled else None

    def head_body(h, carry):
        n = kh * problem.group + h
        ctx = TileContext(problem, r, b, n)
        bb = b if fused_dbias and bias_shape[0] > 1 else 0
        nb = n if fused_dbias and bias_shape[1] > 1 else 0

        def body(t, carry, masked):
            dk, dv, *column_sum = carry  # column_sum: only for a per-key fused dbias
            q0 = t * block_q
            q = head_tile(r["q"], b, pl.ds(q0, block_q), n)
            do = head_tile(r["do"], b, pl.ds(q0, block_q), n)
            if masked:  # the tile the query length crosses: its hidden rows stay out
                q, do = ctx.hide_queries(q, q0), ctx.hide_queries(do, q0)
            residuals = ctx.row_residuals(q0, block_q)
            dropped, ds = ctx.score_gradient(q, k, v, do, residuals, q0, k0, masked,
                                             key_scale)
            dv = dv + plgpu.dot(dropped.astype(do.dtype), do, trans_a=True,
                                precision=problem.precision)
            dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True,
                                precision=problem.precision)
            if fused_dbias:
                ds = ds * problem.dropout_scale if problem.spec.has_dropout else ds
                if rows_broadcast:  # a per-key bias: dbias sums dS over the rows
                    column_sum = [column_sum[0] + jnp.sum(ds, axis=0, keepdims=True)]
                else:
                    r["dbias"][bb, nb, pl.ds(q0, block_q), cols] = ds.astype(r["dbias"].dtype)
            return (dk, dv, *column_sum)

        first, stop, full_first, full_stop = ctx.query_tiles(k0, k0 + block_k, block_q,
                                                             ctx.query_limits(k0, block_k))
        if rows_broadcast:
            carry = (*carry, jnp.zeros((1, block_k), jnp.float32))
        dk, dv, *column_sum = run_tile_loops(first, stop, full_first, full_stop, body, carry)
        if rows_broadcast:
            r["dbias"][bb, nb, pl.ds(0, 1), cols] = column_sum[0].astype(r["dbias"].dtype)
        elif fused_dbias:
            _store_dbias_outside(r, bb, nb, cols,
                                 ((0, first), (stop, problem.q_pad // block_q)), block_q)
        return dk, dv

    init = (jnp.zeros((block_k, k.shape[-1]), jnp.float32),
            jnp.zeros((block_k, v.shape[-1]), jnp.float32))
    dk, dv = lax.fori_loop(0, problem.group, head_body, init)
    if scaled:
        dk = dk * r["key_scales"][b, kh, 1, unit]
    keep_scale = problem.dropout_scale  # score_gradient leaves it out
    store_head_tile(r["dk"], b, cols, kh, dk * (problem.spec.scale * keep_scale))
    store_head_tile(r["dv"], b, cols, kh, dv * keep_scale)


def repair_kernel(*refs, problem: Problem, names: tuple[str, ...], chunk: int):
    """Recomputes the key tiles of (b, kv head kh) in its run that hold a marked key
    (its dk or dv holds a NaN)."""
    r = name_refs(names, refs)
    b, kh = pl.program_id(1), pl.program_id(2)
    repair_marked_tiles(lambda rows: r["dkdv_marks"][b, kh, :, rows], problem.plan.dkdv.block_k,
                        chunk, lambda j: _dkdv_tile(problem, r, j, b, kh, False))


def repair(problem: Problem, names: tuple[str, ...], inputs: list, dk: jax.Array,
           dv: jax.Array, marks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """dk, dv of a Mosaic dK/dV kernel with its marked keys' tiles recomputed here, in
    place: that kernel takes the mask and the ids into the scores alone, so a row that
    saw a NaN key, or a hidden non-finite value, reaches the keys it does not see; this
    kernel keeps them out. marks [B, K, W, Sp]: NaN for the keys whose dk or dv holds
    one. A program finding no mark only reads its marks."""
    return tuple(launch_repair(repair_kernel, problem, "dkdv",
                               (*names, "dkdv_marks", "dk_in", "dv_in", "dk", "dv"),
                               [*inputs, marks], [dk, dv], "pallas_attn_repair_dkdv"))


def dkdv(problem: Problem, names: tuple[str, ...], inputs: list,
         bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(dk, dv, dbias or None); bias: given when dbias is fused into this kernel."""
    route = problem.plan.dkdv
    k, v = inputs[1], inputs[2]
    if bias is not None and "key_scales" in names:
        raise AssertionError("triton.dkdv scales no dS that is also a fused dbias")
    outputs = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    out_names = ["dk", "dv"]
    if bias is not None:
        outputs.append(jax.ShapeDtypeStruct(bias.shape, bias.dtype))
        out_names.append("dbias")
    grid = (problem.kv_pad // route.block_k, problem.batch, problem.num_kv_heads)
    results = launch(dkdv_kernel, problem, (*names, *out_names), inputs, outputs, grid,
                      route.num_warps, route.num_stages, "pallas_attn_dkdv",
                      fused_dbias=bias is not None)
    return results[0], results[1], results[2] if bias is not None else None
