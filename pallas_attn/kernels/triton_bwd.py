"""Backward kernels (Pallas, Triton backend): FlashAttention-2's backward pass.

1. Preprocess (in jnp, fused by XLA): delta = rowsum(dO * O) per query row, minus
   the logsumexp cotangent when the caller differentiates through it.
2. dK/dV kernel, grid (key tile, batch, kv head): keeps its K, V tiles resident and
   loops over the query heads of its group and their query tiles, so GQA/MQA
   gradients are summed in registers, never through repeated K/V in memory.
   When the bias needs a gradient and has its own entry for every batch entry and
   head (BlockSizes.fuse_dbias), it also writes dbias from the dS tiles it computes
   anyway: each dbias element belongs to one program (summed over query rows in
   registers for a per-key bias), so it is written once, with no extra matrix work.
3. dQ kernel, grid (query tile, batch, head): loops over key tiles.
4. dbias kernel, when dbias is not fused (a bias broadcast over batch entries,
   heads or keys, whose gradient sums dS across programs): grid over the bias's own
   tiles; recomputes dS and sums it over the axes the bias broadcasts along.

Every output element is written by exactly one program, with a fixed loop order:
gradients are bitwise deterministic.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn.kernels.common import (
    OPTIONAL_INPUTS,
    Problem,
    TileContext,
    name_refs,
    run_tile_loops,
    whole_array_specs,
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
    blocks = problem.blocks
    block_q, block_k = blocks.block_q_dkv, blocks.block_k_dkv
    j, b, kh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k0 = j * block_k
    cols = pl.ds(k0, block_k)
    k = r["k"][b, cols, kh, :]
    v = r["v"][b, cols, kh, :]
    bias_shape = problem.spec.bias_shape
    rows_broadcast = fused_dbias and bias_shape[2] == 1

    def head_body(h, carry):
        n = kh * problem.group + h
        ctx = TileContext(problem, r, b, n)
        bb = b if fused_dbias and bias_shape[0] > 1 else 0
        nb = n if fused_dbias and bias_shape[1] > 1 else 0

        def body(t, carry, masked):
            dk, dv, *column_sum = carry  # column_sum: only for a per-key fused dbias
            q0 = t * block_q
            q = r["q"][b, pl.ds(q0, block_q), n, :]
            do = r["do"][b, pl.ds(q0, block_q), n, :]
            residuals = ctx.row_residuals(q0, block_q)
            dropped, ds = ctx.score_gradient(q, k, v, do, residuals, q0, k0, masked)
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

        first, stop, full_first, full_stop = ctx.query_tiles(k0, k0 + block_k, block_q)
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
    keep_scale = problem.dropout_scale  # score_gradient leaves it out
    r["dk"][b, cols, kh, :] = (dk * (problem.spec.scale * keep_scale)).astype(r["dk"].dtype)
    r["dv"][b, cols, kh, :] = (dv * keep_scale).astype(r["dv"].dtype)


def dq_kernel(*refs, problem: Problem, names: tuple[str, ...]):
    r = name_refs(names, refs)
    blocks = problem.blocks
    block_q, block_k = blocks.block_q_dq, blocks.block_k_dq
    i = pl.num_programs(0) - 1 - pl.program_id(0)  # heavy (late) query tiles first
    b, n = pl.program_id(1), pl.program_id(2)
    kh = lax.div(n, problem.group)
    q0 = i * block_q
    ctx = TileContext(problem, r, b, n)
    q = r["q"][b, pl.ds(q0, block_q), n, :]
    do = r["do"][b, pl.ds(q0, block_q), n, :]
    residuals = ctx.row_residuals(q0, block_q)

    def body(t, dq, masked):
        k0 = t * block_k
        k = r["k"][b, pl.ds(k0, block_k), kh, :]
        v = r["v"][b, pl.ds(k0, block_k), kh, :]
        _, ds = ctx.score_gradient(q, k, v, do, residuals, q0, k0, masked)
        return dq + plgpu.dot(ds.astype(k.dtype), k, precision=problem.precision)

    dq = run_tile_loops(*ctx.key_tiles(q0, q0 + block_q, block_k), body,
                        jnp.zeros((block_q, q.shape[-1]), jnp.float32))
    dq = dq * (problem.spec.scale * problem.dropout_scale)  # score_gradient leaves it out
    r["dq"][b, pl.ds(q0, block_q), n, :] = dq.astype(r["dq"].dtype)


def dbias_kernel(*refs, problem: Problem, names: tuple[str, ...]):
    """dbias for one tile of the bias's own shape, summed over its broadcast axes."""
    r = name_refs(names, refs)
    Bb, Nb, Tb, Sb = problem.spec.bias_shape
    blocks = problem.blocks
    block_q, block_k = blocks.block_q_dbias, blocks.block_k_dbias
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
            q = r["q"][b, pl.ds(q0, block_q), n, :]
            do = r["do"][b, pl.ds(q0, block_q), n, :]
            k = r["k"][b, pl.ds(k0, block_k), kh, :]
            v = r["v"][b, pl.ds(k0, block_k), kh, :]
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


def _launch(kernel, problem: Problem, names: tuple[str, ...], inputs: list[jax.Array],
            outputs: list[jax.ShapeDtypeStruct], grid: tuple[int, ...], warps: int,
            stages: int, name: str, **params: Any):
    """One pallas_call; names: the kernel's ref names, inputs then outputs."""
    return pl.pallas_call(
        functools.partial(kernel, problem=problem, names=names, **params),
        grid=grid,
        in_specs=whole_array_specs(inputs),
        out_specs=whole_array_specs(outputs),
        out_shape=outputs,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=problem.interpret,
        name=name,
    )(*inputs)


def backward_inputs(q, k, v, optional, row_stats, do, delta) -> tuple[tuple[str, ...], list]:
    """Kernel names and operands; row_stats: the forward's (row_max, log2_sum)."""
    present = [x for x in OPTIONAL_INPUTS if x in optional]
    names = ("q", "k", "v", "do", "row_max", "log2_sum", "delta", *present)
    return names, [q, k, v, do, *row_stats, delta, *(optional[x] for x in present)]


def dkdv(problem: Problem, names: tuple[str, ...], inputs: list,
         bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(dk, dv, dbias or None); bias: given when dbias is fused into this kernel."""
    b = problem.blocks
    k, v = inputs[1], inputs[2]
    outputs = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    out_names = ["dk", "dv"]
    if bias is not None:
        outputs.append(jax.ShapeDtypeStruct(bias.shape, bias.dtype))
        out_names.append("dbias")
    grid = (problem.kv_pad // b.block_k_dkv, problem.batch, problem.num_kv_heads)
    results = _launch(dkdv_kernel, problem, (*names, *out_names), inputs, outputs, grid,
                      b.num_warps_dkv, b.num_stages_dkv, "pallas_attn_dkdv",
                      fused_dbias=bias is not None)
    return results[0], results[1], results[2] if bias is not None else None


def dq(problem: Problem, names: tuple[str, ...], inputs: list) -> jax.Array:
    b = problem.blocks
    q = inputs[0]
    grid = (problem.q_pad // b.block_q_dq, problem.batch, problem.num_heads)
    return _launch(dq_kernel, problem, (*names, "dq"), inputs,
                   [jax.ShapeDtypeStruct(q.shape, q.dtype)], grid, b.num_warps_dq,
                   b.num_stages_dq, "pallas_attn_dq")[0]


def dbias(problem: Problem, names: tuple[str, ...], inputs: list, bias: jax.Array) -> jax.Array:
    b = problem.blocks
    Bb, Nb, Tb, Sb = bias.shape
    grid = (Tb // b.block_q_dbias if Tb > 1 else 1, Sb // b.block_k_dbias if Sb > 1 else 1,
            Bb * Nb)
    return _launch(dbias_kernel, problem, (*names, "dbias"), inputs,
                   [jax.ShapeDtypeStruct(bias.shape, bias.dtype)], grid, b.num_warps_dbias,
                   b.num_stages_dbias, "pallas_attn_dbias")[0]

