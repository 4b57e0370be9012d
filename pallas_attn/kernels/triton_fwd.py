"""Forward kernel (Pallas, Triton backend): FlashAttention-2 algorithm 1.

Grid (query tile, batch, head); under causal masking each program takes a query
tile and its mirror (common.schedule_query_tiles), so every program does the same
work. A program keeps its query tile resident and loops over key/value tiles with
an online softmax in float32: row reference m, running sum l, unnormalised
accumulator acc. The row reference is the running maximum, or, for soft-capped
scores, the cap's bound (common.py's module doc): no maximum, no rescaling. Key
tiles outside the causal/window band or past the key length are skipped; tiles
crossing the band edge are masked. Writes the output and the per-row residuals:
the reference (+inf for rows that see no key) and log2 of the row sum (common.py
says why not the lse).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn.kernels.common import (
    MAX_FLOOR,
    OPTIONAL_INPUTS,
    Problem,
    TileContext,
    name_refs,
    run_tile_loops,
    schedule_query_tiles,
    scheduled_grid_size,
    whole_array_specs,
)


def forward_kernel(*refs, problem: Problem, names: tuple[str, ...]):
    r = name_refs(names, refs)
    b, n = pl.program_id(1), pl.program_id(2)
    num_tiles = problem.q_pad // problem.blocks.block_q
    schedule_query_tiles(num_tiles, problem.pairs_query_tiles,
                         lambda i: _forward_tile(problem, r, TileContext(problem, r, b, n), i))


def _forward_tile(problem: Problem, r: dict, ctx: TileContext, i) -> None:
    """Output rows and row residuals of query tile i."""
    spec, blocks = problem.spec, problem.blocks
    block_q, block_k = blocks.block_q, blocks.block_k
    b, n = ctx.b, ctx.n
    kh = lax.div(n, problem.group)
    q0 = i * block_q
    q = r["q"][b, pl.ds(q0, block_q), n, :]
    fixed = problem.fixed_row_reference

    def body(t, carry, masked):
        acc, m_prev, l_prev = carry
        k0 = t * block_k
        k = r["k"][b, pl.ds(k0, block_k), kh, :]
        s, _, _ = ctx.scores(q, k, q0, k0, masked)
        if fixed is not None:  # bounded scores: the bound is every row's reference
            m_next = m_prev
            prob = jnp.exp2(s - fixed)  # invisible: s = -inf, prob = 0
            l_next = l_prev + jnp.sum(prob, axis=1)
        else:  # the reference is the running row maximum, acc rescaled every tile
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))  # stays >= MAX_FLOOR
            alpha = problem.exp2_of(m_prev - m_next)
            prob = problem.exp2_of(s - m_next[:, None])  # invisible: s = -inf, prob = 0
            l_next = l_prev * alpha + jnp.sum(prob, axis=1)
            acc = acc * alpha[:, None]
        if spec.has_dropout:
            prob = jnp.where(ctx.keep(q0, k0, block_q, block_k), prob, 0.0)
        v = r["v"][b, pl.ds(k0, block_k), kh, :]
        acc = acc + plgpu.dot(prob.astype(v.dtype), v, precision=problem.precision)
        return acc, m_next, l_next

    init = (
        jnp.zeros((block_q, r["v"].shape[-1]), jnp.float32),
        jnp.full((block_q,), MAX_FLOOR if fixed is None else fixed, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    acc, m, l_sum = run_tile_loops(*ctx.key_tiles(q0, q0 + block_q, block_k), body, init)

    rows = q0 + jax.lax.iota(jnp.int32, block_q)
    valid = (l_sum > 0.0) & (rows < problem.q_len)
    if ctx.q_length is not None:
        valid = valid & (rows < ctx.q_length)
    scale = problem.dropout_scale
    out = jnp.where(valid[:, None], acc * (scale / jnp.where(valid, l_sum, 1.0))[:, None], 0.0)
    r["out"][b, pl.ds(q0, block_q), n, :] = out.astype(r["out"].dtype)
    r["row_max"][b, n, pl.ds(q0, block_q)] = jnp.where(valid, m, jnp.inf)
    r["log2_sum"][b, n, pl.ds(q0, block_q)] = jnp.log2(jnp.where(valid, l_sum, 1.0))


def forward(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array,
            optional: dict[str, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """(out [B, Tp, N, Hvp], (row_max, log2_sum) [B, N, Tp]) for padded inputs."""
    names = ("q", "k", "v", *(x for x in OPTIONAL_INPUTS if x in optional), "out",
             "row_max", "log2_sum")
    inputs = [q, k, v, *(optional[x] for x in OPTIONAL_INPUTS if x in optional)]
    B, Tp, N, _ = q.shape
    row = jax.ShapeDtypeStruct((B, N, Tp), jnp.float32)
    out_shape = [jax.ShapeDtypeStruct((B, Tp, N, v.shape[-1]), q.dtype), row, row]
    blocks = problem.blocks
    out, row_max, log2_sum = pl.pallas_call(
        functools.partial(forward_kernel, problem=problem, names=names),
        grid=(scheduled_grid_size(Tp // blocks.block_q, problem.pairs_query_tiles), B, N),
        in_specs=whole_array_specs(inputs),
        out_specs=whole_array_specs(out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=problem.interpret,
        name="pallas_attn_forward",
    )(*inputs)
    return out, (row_max, log2_sum)
