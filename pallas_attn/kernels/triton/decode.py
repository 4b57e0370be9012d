"""Decode kernel (Pallas, Triton backend): few query rows against a long key cache.

Decoding (T = 1), speculative decoding and small chunks of prefill leave the
forward kernel's grid nearly empty: one query tile per (batch, head), and every
query head of a kv group reading the same K/V again. Here the query rows of one
kv group, T new tokens times G query heads, form a single tile (row r is token
r // G of head r % G), so K/V are read once per group; and the keys are split
across programs (flash-decoding), so a short batch still fills the device.

Grid (split, batch, kv head). A program runs the forward's online softmax over its
share of the visible key tiles and writes its unnormalised accumulator, row
reference and row sum; `combine` merges the splits (a second, small pass in jnp)
into the forward's own output and row residuals, so the backward kernels run
unchanged on a decoded call.

Paged caches (pallas_attn.paged_attention, the problem's present names "page_table"):
K/V are [pages, page_size, K, H]; a key tile lies in one page where block_k divides
page_size, else each of its rows is read from its own page (smaller pages are
gathered into full tiles), the pages found through the page table; each sequence's T
new tokens sit at positions cache_length - T .. cache_length - 1: the kernel's origin.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn.kernels.core import (
    Problem,
    TileRanges,
    logit_scores,
    merge_sink,
    softmax_reference_init,
    softmax_step,
)
from pallas_attn.kernels.triton.config import DECODE_OPERANDS
from pallas_attn.kernels.triton.context import launch, name_refs
from pallas_attn.semantics import scores


def rows(problem: Problem) -> int:
    """The tile's query rows: T tokens x G heads, padded to a power of two >= 16."""
    count = problem.q_len * problem.group
    return max(16, 1 << (count - 1).bit_length())


def decode_kernel(*refs, problem: Problem, names: tuple[str, ...]):
    r = name_refs(names, refs)
    split, b, kh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    spec, route = problem.spec, problem.plan.forward
    block_k, G, R = route.block_k, problem.group, rows(problem)
    row = lax.broadcasted_iota(jnp.int32, (R, 1), 0)
    token = lax.div(row, G)
    kv_length = (r["key_value_seq_lengths"][b]
                 if problem.has("key_value_seq_lengths") else None)
    paged = problem.has("page_table")
    ctx = TileRanges(
        problem, b, kh,
        q_length=r["query_seq_lengths"][b] if problem.has("query_seq_lengths") else None,
        kv_length=kv_length,
        origin=(kv_length - problem.q_len, 0) if paged else None)
    first, stop, _, _ = ctx.key_tiles(0, problem.q_len, block_k)
    per_split = lax.div(stop - first + (route.splits - 1), route.splits)
    lo = jnp.minimum(first + split * per_split, stop)
    hi = jnp.minimum(lo + per_split, stop)
    q = r["q"][b, kh, :, :]
    slope = r["row_slopes"][b, kh, :][:, None] if problem.has("alibi_slopes") else None
    tanh = (jnp.tanh if problem.interpret or problem.dtype == "float32"
            else plgpu.approx_tanh)

    def load(name, k0):
        if not paged:
            return r[name][b, pl.ds(k0, block_k), kh, :]
        page_size = r[name].shape[1]
        table = r["page_table"]
        if page_size % block_k == 0:  # the tile lies in one page
            page = table[b, lax.div(k0, page_size)]
            return r[name][page, pl.ds(lax.rem(k0, page_size), block_k), kh, :]
        # The tile spans pages: each row's page from the table (past the table's last
        # page, rows past every length: any page, masked).
        at = k0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        pages = table[b, jnp.minimum(lax.div(at, page_size), table.shape[1] - 1)]
        return r[name][pages, lax.rem(at, page_size), kh, :]

    def body(t, carry):
        acc, m_prev, l_prev = carry
        k0 = t * block_k
        k = load("k", k0)
        s = plgpu.dot(q, k, trans_b=True, precision=problem.precision)
        cols = k0 + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        s, _ = logit_scores(problem, s, token, cols, slope=slope, tanh=tanh, offset=ctx.offset)
        visible = scores.visibility(
            token, cols, spec, ctx.offset, q_bound=problem.q_len,
            kv_bound=problem.kv_len if problem.kv_pad != problem.kv_len else None,
            q_length=ctx.q_length, kv_length=ctx.kv_length)
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
        prob, m_next, l_next, alpha = softmax_step(problem, s, m_prev, l_prev)
        if alpha is not None:
            acc = acc * alpha[:, None]
        v = load("v", k0)
        if ctx.kv_length is not None:  # values past the length (unwritten cache) stay out
            rows = k0 + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
            v = jnp.where(rows < ctx.kv_length, v, jnp.zeros_like(v))
        acc = acc + plgpu.dot(prob.astype(v.dtype), v, precision=problem.precision)
        return acc, m_next, l_next

    init = (jnp.zeros((R, r["v"].shape[-1]), jnp.float32),
            jnp.full((R,), softmax_reference_init(problem), jnp.float32),
            jnp.zeros((R,), jnp.float32))
    acc, m, l_sum = lax.fori_loop(lo, hi, body, init)
    r["acc"][split, b, kh, :, :] = acc
    r["row_max"][split, b, kh, :] = m
    r["row_sum"][split, b, kh, :] = l_sum


def forward(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array,
            optional: dict[str, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """(out [B, Tp, N, Hvp], (row_max, log2_sum) [B, N, Tp]), as the forward kernel's;
    k, v [B, S, K, H] or, with optional["page_table"], the caches [pages, size, K, H]."""
    B, Tp, N, Hp = q.shape
    T, K, G, R = problem.q_len, problem.num_kv_heads, problem.group, rows(problem)
    Hvp = v.shape[-1]
    route = problem.plan.forward
    # Rows of one kv group: token-major, head-minor, padded to R.
    grouped = q[:, :T].reshape(B, T, K, G, Hp).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, Hp)
    names, inputs = ["q", "k", "v"], [_pad_rows(grouped, R), k, v]
    for name in (*DECODE_OPERANDS, "page_table"):
        if name == "sinks":  # merged by `combine`, not read by the kernel
            continue
        if name in optional:
            names.append(name)
            inputs.append(optional[name])
    if "alibi_slopes" in optional:  # each row's head's slope
        slopes = jnp.broadcast_to(optional["alibi_slopes"].reshape(B, K, 1, G),
                                  (B, K, T, G)).reshape(B, K, T * G)
        names.append("row_slopes")
        inputs.append(_pad_rows(slopes, R))
    splits = route.splits
    out_shape = [jax.ShapeDtypeStruct((splits, B, K, R, Hvp), jnp.float32),
                 jax.ShapeDtypeStruct((splits, B, K, R), jnp.float32),
                 jax.ShapeDtypeStruct((splits, B, K, R), jnp.float32)]
    acc, row_max, row_sum = launch(decode_kernel, problem, (*names, "acc", "row_max", "row_sum"),
                                   inputs, out_shape, (splits, B, K), route.num_warps,
                                   route.num_stages, "pallas_attn_decode")
    sinks = None
    if "sinks" in optional:  # each row's head's sink
        sinks = jnp.broadcast_to(optional["sinks"].reshape(1, K, 1, G), (B, K, T, G))
        sinks = _pad_rows(sinks.reshape(B, K, T * G), R)
    out, row_max, log2_sum = combine(problem, acc, row_max, row_sum, sinks)
    # Back to [B, Tp, N, Hvp] and [B, N, Tp]; padded rows see nothing (row max +inf).
    out = out[:, :, :T * G].reshape(B, K, T, G, Hvp).transpose(0, 2, 1, 3, 4)
    out = jnp.pad(out.reshape(B, T, N, Hvp), ((0, 0), (0, Tp - T), (0, 0), (0, 0)))

    def stats(x, fill):
        x = x[:, :, :T * G].reshape(B, K, T, G).transpose(0, 1, 3, 2).reshape(B, N, T)
        return jnp.pad(x, ((0, 0), (0, 0), (0, Tp - T)), constant_values=fill)

    return out.astype(q.dtype), (stats(row_max, jnp.inf), stats(log2_sum, 0.0))


def combine(problem: Problem, acc: jax.Array, row_max: jax.Array, row_sum: jax.Array,
            sinks: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Merges the splits' partial softmaxes (and each row's sink, [B, K, R]): (out, row
    reference, log2 row sum), the forward kernel's row residuals (+inf and 0 for rows
    that see no key)."""
    m = jnp.max(row_max, axis=0)
    weight = problem.exp2_of(row_max - m)  # a split without keys: sum 0, weight <= 1
    total = jnp.sum(row_sum * weight, axis=0)
    acc = jnp.sum(acc * weight[..., None], axis=0)
    if sinks is not None:
        alpha, m, total = merge_sink(problem, sinks, m, total)
        acc = acc * alpha[..., None]
    seen = total != 0.0  # NaN: seen, so a NaN in a visible input shows
    out = acc / jnp.where(seen, total, 1.0)[..., None]
    return out, jnp.where(seen, m, jnp.inf), jnp.log2(jnp.where(seen, total, 1.0))


def _pad_rows(x: jax.Array, rows_: int) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[2] = (0, rows_ - x.shape[2])
    return jnp.pad(x, widths)
