"""Backward kernels (Pallas, Triton backend): FlashAttention-2's backward pass.

1. Preprocess (in jnp, fused by XLA): delta = rowsum(dO * O) per query row, minus
   the logsumexp cotangent when the caller differentiates through it.
2. dK/dV kernel, grid (key tile, batch, kv head): keeps its K, V tiles resident and
   loops over the query heads of its group and their query tiles, so GQA/MQA
   gradients are summed in registers, never through repeated K/V in memory.
   When the bias needs a gradient it also writes dbias from the dS tiles it
   computes anyway (BlockSizes.fuse_dbias): axes the bias broadcasts along move from
   the grid into the program's own loops (batch entries, kv heads) so that one
   program owns every contribution to its dbias tiles, and sums them in a fixed
   order: in registers over query rows, through a float32 buffer over batch
   entries and heads (read, add, write back; the last contribution writes the
   bias's dtype).
3. dQ kernel, grid (query tile, batch, head): loops over key tiles.
4. dbias kernel, when dbias is not fused (a bias broadcast along keys, or too few
   fused programs to fill the device): grid over the bias's own tiles; recomputes
   dS and sums it over the axes the bias broadcasts along.

Under causal masking the dK/dV and dQ programs take a tile and its mirror
(common.schedule_tiles). Every output element is written by exactly one program,
with a fixed loop order: gradients are bitwise deterministic.
"""

from __future__ import annotations

import dataclasses
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
    schedule_tiles,
    scheduled_grid_size,
    whole_array_specs,
)


@dataclasses.dataclass(frozen=True)
class FusedDbias:
    """How the dK/dV kernel writes dbias (static; derived from the Problem).

    batch_loop / head_loop: the bias broadcasts over batch entries / heads, so the
    program loops over every batch entry / kv head instead of the grid.
    accumulates: a dbias element gets contributions from several (batch entry,
    head) pairs of the program, summed through the float32 buffer `acc_name`
    ("dbias" itself for a float32 bias, else a scratch output "dbias_acc").
    """

    batch_loop: bool
    head_loop: bool
    accumulates: bool
    rows_broadcast: bool
    acc_name: str

    @staticmethod
    def of(problem: Problem, bias_dtype: Any) -> FusedDbias:
        Bb, Nb, Tb, _ = problem.spec.bias_shape
        batch_loop = Bb == 1 and problem.batch > 1
        head_loop = Nb == 1 and problem.num_kv_heads > 1
        accumulates = batch_loop or (Nb == 1 and problem.num_heads > 1)
        acc_name = "dbias" if jnp.dtype(bias_dtype) == jnp.float32 else "dbias_acc"
        return FusedDbias(batch_loop, head_loop, accumulates, Tb == 1,
                          acc_name if accumulates else "dbias")

    def grid(self, problem: Problem) -> tuple[int, int]:
        """Grid axes 1 and 2 of the dK/dV kernel (batch, kv head)."""
        return (1 if self.batch_loop else problem.batch,
                1 if self.head_loop else problem.num_kv_heads)

    def members(self, problem: Problem) -> tuple[int, int]:
        """(batch entries, kv heads) one program loops over."""
        return (problem.batch if self.batch_loop else 1,
                problem.num_kv_heads if self.head_loop else 1)


def _accumulate_dbias(r: dict, plan: FusedDbias, index: tuple, value: jax.Array,
                      first: Any, last: Any) -> None:
    """Adds value to a dbias slice: the first contribution writes, the others read,
    add and write back; the last writes the bias's dtype (masked loads and stores:
    a contribution that is not first reads nothing from memory)."""
    shape = value.shape
    if not plan.accumulates:
        r["dbias"][index] = value.astype(r["dbias"].dtype)
        return
    acc_ref = r[plan.acc_name].at[index]
    value = value + plgpu.load(acc_ref, mask=jnp.broadcast_to(jnp.logical_not(first), shape),
                               other=0.0)
    if plan.acc_name == "dbias":
        plgpu.store(acc_ref, value)
        return
    plgpu.store(acc_ref, value, mask=jnp.broadcast_to(jnp.logical_not(last), shape))
    plgpu.store(r["dbias"].at[index], value.astype(r["dbias"].dtype),
                mask=jnp.broadcast_to(last, shape))


def _settle_dbias_outside(r: dict, plan: FusedDbias, bb, nb, cols, first, last,
                          tiles: tuple[tuple[Any, Any], ...], block_q: int) -> None:
    """dbias tiles a contribution skips (outside its causal/window/length range):
    the first contribution writes zeros there, the last one converts what the
    others summed (zeros if none did)."""
    def tile(t, carry):
        index = (bb, nb, pl.ds(t * block_q, block_q), cols)
        zeros = jnp.zeros((block_q, cols.size), jnp.float32)
        if not plan.accumulates:
            r["dbias"][index] = zeros.astype(r["dbias"].dtype)
            return carry
        acc_ref = r[plan.acc_name].at[index]
        if plan.acc_name == "dbias":  # float32: the first zeroes, the rest leave it
            plgpu.store(acc_ref, zeros, mask=jnp.broadcast_to(first, zeros.shape))
            return carry
        value = plgpu.load(acc_ref, mask=jnp.broadcast_to(jnp.logical_not(first),
                                                          zeros.shape), other=0.0)
        plgpu.store(acc_ref, value,
                    mask=jnp.broadcast_to(first & jnp.logical_not(last), zeros.shape))
        plgpu.store(r["dbias"].at[index], value.astype(r["dbias"].dtype),
                    mask=jnp.broadcast_to(last, zeros.shape))
        return carry

    for lo, hi in tiles:
        lax.fori_loop(lo, hi, tile, 0)


def dkdv_kernel(*refs, problem: Problem, names: tuple[str, ...], plan: FusedDbias | None):
    r = name_refs(names, refs)
    num_tiles = problem.kv_pad // problem.blocks.block_k_dkv
    # NOTE: program ids are read here, at the kernel's top level: the interpreter
    # resolves them only there, not inside loop bodies.
    grid_b, grid_kh = pl.program_id(1), pl.program_id(2)
    schedule_tiles(num_tiles, problem.pairs_tiles, False,
                   lambda j: _dkdv_tile(problem, r, plan, j, grid_b, grid_kh))


def _dkdv_tile(problem: Problem, r: dict, plan: FusedDbias | None, j, grid_b, grid_kh
               ) -> None:
    """dK, dV of key tile j (and its dbias columns when plan is given); grid_b, grid_kh:
    the program's batch entry and kv head, unless plan loops over them."""
    blocks = problem.blocks
    block_q, block_k = blocks.block_q_dkv, blocks.block_k_dkv
    k0 = j * block_k
    cols = pl.ds(k0, block_k)
    group = problem.group
    batches, kv_heads = plan.members(problem) if plan is not None else (1, 1)
    bias_shape = problem.spec.bias_shape

    def member_body(m, carry):
        b = lax.div(m, kv_heads) if batches > 1 else grid_b
        kh = lax.rem(m, kv_heads) if kv_heads > 1 else grid_kh
        k = r["k"][b, cols, kh, :]
        v = r["v"][b, cols, kh, :]

        def head_body(h, carry):
            n = kh * group + h
            ctx = TileContext(problem, r, b, n)
            first = last = None
            if plan is not None:
                zero = jnp.int32(0)  # plgpu.load/store index with arrays, not Python ints
                bb = b if bias_shape[0] > 1 else zero
                nb = n if bias_shape[1] > 1 else zero
                # This (batch entry, head) pair's place among the contributions to
                # dbias[bb, nb]: all batch entries when the bias broadcasts over them,
                # all heads of the program when it broadcasts over heads.
                first, last = jnp.bool_(True), jnp.bool_(True)
                if batches > 1:
                    first, last = first & (b == 0), last & (b == batches - 1)
                if bias_shape[1] == 1:
                    first = first & (kh == 0) & (h == 0) if kv_heads > 1 else first & (h == 0)
                    last = (last & (kh == kv_heads - 1) & (h == group - 1) if kv_heads > 1
                            else last & (h == group - 1))
                if plan.accumulates and not problem.interpret:
                    # Stores of the previous contribution are visible to this one's loads
                    # (the interpreter runs one thread per program and needs no barrier).
                    plgpu.debug_barrier()

            def body(t, carry, masked):
                dk, dv, col = carry
                q0 = t * block_q
                q = r["q"][b, pl.ds(q0, block_q), n, :]
                do = r["do"][b, pl.ds(q0, block_q), n, :]
                residuals = ctx.row_residuals(q0, block_q)
                dropped, ds = ctx.score_gradient(q, k, v, do, residuals, q0, k0, masked)
                dv = dv + plgpu.dot(dropped.astype(do.dtype), do, trans_a=True,
                                    precision=problem.precision)
                dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True,
                                    precision=problem.precision)
                if plan is not None:
                    ds = ds * problem.dropout_scale if problem.spec.has_dropout else ds
                    if plan.rows_broadcast:
                        col = col + jnp.sum(ds, axis=0, keepdims=True)
                    else:
                        _accumulate_dbias(r, plan, (bb, nb, pl.ds(q0, block_q), cols), ds,
                                          first, last)
                return dk, dv, col

            dk, dv = carry
            col = jnp.zeros((1, block_k), jnp.float32)
            first_tile, stop_tile, full_first, full_stop = ctx.query_tiles(
                k0, k0 + block_k, block_q)
            dk, dv, col = run_tile_loops(first_tile, stop_tile, full_first, full_stop, body,
                                         (dk, dv, col))
            if plan is not None and plan.rows_broadcast:
                _accumulate_dbias(r, plan, (bb, nb, pl.ds(0, 1), cols), col, first, last)
            elif plan is not None:
                _settle_dbias_outside(r, plan, bb, nb, cols, first, last,
                                      ((0, first_tile),
                                       (stop_tile, problem.q_pad // block_q)), block_q)
            return dk, dv

        init = (jnp.zeros((block_k, k.shape[-1]), jnp.float32),
                jnp.zeros((block_k, v.shape[-1]), jnp.float32))
        dk, dv = lax.fori_loop(0, group, head_body, init)
        keep_scale = problem.dropout_scale  # score_gradient leaves it out
        r["dk"][b, cols, kh, :] = (dk * (problem.spec.scale * keep_scale)).astype(r["dk"].dtype)
        r["dv"][b, cols, kh, :] = (dv * keep_scale).astype(r["dv"].dtype)
        return carry

    if batches * kv_heads == 1:
        member_body(0, 0)
    else:
        lax.fori_loop(0, batches * kv_heads, member_body, 0)


def dq_kernel(*refs, problem: Problem, names: tuple[str, ...]):
    r = name_refs(names, refs)
    b, n = pl.program_id(1), pl.program_id(2)
    num_tiles = problem.q_pad // problem.blocks.block_q_dq
    schedule_tiles(num_tiles, problem.pairs_tiles, True,
                   lambda i: _dq_tile(problem, r, TileContext(problem, r, b, n), i))


def _dq_tile(problem: Problem, r: dict, ctx: TileContext, i) -> None:
    blocks = problem.blocks
    block_q, block_k = blocks.block_q_dq, blocks.block_k_dq
    b, n = ctx.b, ctx.n
    kh = lax.div(n, problem.group)
    q0 = i * block_q
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
    plan = None
    if bias is not None:
        plan = FusedDbias.of(problem, bias.dtype)
        outputs.append(jax.ShapeDtypeStruct(bias.shape, bias.dtype))
        out_names.append("dbias")
        if plan.acc_name != "dbias":  # float32 partial sums of a lower-precision bias
            outputs.append(jax.ShapeDtypeStruct(bias.shape, jnp.float32))
            out_names.append(plan.acc_name)
    grid = (scheduled_grid_size(problem.kv_pad // b.block_k_dkv, problem.pairs_tiles),
            *(plan.grid(problem) if plan is not None
              else (problem.batch, problem.num_kv_heads)))
    results = _launch(dkdv_kernel, problem, (*names, *out_names), inputs, outputs, grid,
                      b.num_warps_dkv, b.num_stages_dkv, "pallas_attn_dkdv", plan=plan)
    return results[0], results[1], results[2] if plan is not None else None


def dq(problem: Problem, names: tuple[str, ...], inputs: list) -> jax.Array:
    b = problem.blocks
    q = inputs[0]
    grid = (scheduled_grid_size(problem.q_pad // b.block_q_dq, problem.pairs_tiles),
            problem.batch, problem.num_heads)
    return _launch(dq_kernel, problem, (*names, "dq"), inputs,
                   [jax.ShapeDtypeStruct(q.shape, q.dtype)], grid, b.num_warps_dq,
                   b.num_stages_dq, "pallas_attn_dq")[0]


def dbias(problem: Problem, names: tuple[str, ...], inputs: list, bias: jax.Array) -> jax.Array:
    b = problem.blocks
    Bb, Nb, Tb, Sb = bias.shape
    grid = (Tb // b.block_q_dbias if Tb > 1 else 1, Sb // b.block_k_dbias if Sb > 1 else 1,
            Bb * Nb)
    out = _launch(dbias_kernel, problem, (*names, "dbias"), inputs,
                  [jax.ShapeDtypeStruct(bias.shape, jnp.float32)], grid, b.num_warps_dbias,
                  b.num_stages_dbias, "pallas_attn_dbias")[0]
    return out.astype(bias.dtype)


def backward(problem: Problem, q, k, v, optional, row_stats, do, delta, bias_grad: bool):
    """(dq, dk, dv, dbias or None) for padded inputs; delta [B, N, Tp] float32."""
    names, inputs = backward_inputs(q, k, v, optional, row_stats, do, delta)
    fused = bias_grad and problem.blocks.fuse_dbias
    dk, dv, dbias_ = dkdv(problem, names, inputs, optional["bias"] if fused else None)
    dq_ = dq(problem, names, inputs)
    if bias_grad and not fused:
        dbias_ = dbias(problem, names, inputs, optional["bias"])
    return dq_, dk, dv, dbias_
