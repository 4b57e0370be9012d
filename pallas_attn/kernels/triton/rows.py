"""Row sums the backward takes outside the attention kernels (Pallas, Triton backend):
delta = rowsum(dO * out), the row norms of the float16 backward's dS scales, and the
sums over rows of the sinks' and a bias-per-row's gradients.

Each is summed in an order this kernel fixes, so the gradients are bitwise the same in
every process: an XLA reduction's order is that of the emitter XLA picks for it, and on
a GPU it picks by timing the candidates, so the same program compiled twice can round
delta differently (and with it dS, dQ, dK and dbias).

Grid (row tile, batch entry, head): a program loads its rows' entries `width` at a
time, masked past the array's ends, and accumulates their products in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn.kernels import int32_indices, next_power_of_2, varying_like
from pallas_attn.kernels.triton.context import whole_array_specs

ROWS = 32  # rows per program
WIDTH = 256  # entries of a row per step


def _kernel(*refs, rows: int, width: int, steps: int, product: bool):
    x_ref, *y_ref, o_ref = refs
    i, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length, depth = x_ref.shape[1], x_ref.shape[3]
    at = i * rows + lax.iota(jnp.int32, rows)

    def step(j, acc):
        cols = j * width + lax.iota(jnp.int32, width)
        inside = (at < length)[:, None] & (cols < depth)[None, :]
        where = (b, at[:, None], h, cols[None, :])
        x = plgpu.load(x_ref.at[where], mask=inside, other=0).astype(jnp.float32)
        if product:
            x = x * plgpu.load(y_ref[0].at[where], mask=inside, other=0).astype(jnp.float32)
        return acc + jnp.sum(x, axis=1)

    total = lax.fori_loop(0, steps, step, jnp.zeros((rows,), jnp.float32))
    plgpu.store(o_ref.at[b, h, at], total, mask=at < length)


def row_sums(x: jax.Array, y: jax.Array | None = None, *, interpret: bool = False
             ) -> jax.Array:
    """[B, H, L] float32: each row's sum over the last axis of x * y (of x alone without
    y), x and y [B, L, H, D], in float32 and one fixed order."""
    B, L, H, D = x.shape
    if y is not None and y.shape != x.shape:
        raise ValueError(f"row_sums: y {y.shape} must match x {x.shape}")
    rows = min(ROWS, next_power_of_2(max(L, 1)))
    width = min(WIDTH, max(16, next_power_of_2(D)))
    operands = [x] if y is None else [x, y]
    out = jax.ShapeDtypeStruct((B, H, L), jnp.float32)
    kernel = functools.partial(_kernel, rows=rows, width=width, steps=pl.cdiv(D, width),
                               product=y is not None)
    with int32_indices():
        return pl.pallas_call(
            kernel, grid=(pl.cdiv(L, rows), B, H),
            in_specs=whole_array_specs(operands), out_specs=whole_array_specs([out])[0],
            out_shape=varying_like(out, operands),
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
            interpret=interpret, name="pallas_attn_row_sums")(*operands)
