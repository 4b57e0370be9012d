"""Decode kernel (Pallas, Triton backend): few query rows against a long key cache.

Decoding (T = 1), speculative decoding and small chunks of prefill leave the
forward kernel's grid nearly empty: one query tile per (batch, head), and every
query head of a kv group reading the same K/V again. Here the query rows of one
kv group, T new tokens times G query heads, form one tile (row r is token r // G of
head r % G), so K/V are read once per group; more rows than a tile holds (a chunk of
prefill against a paged cache) form several, each reading the keys its tokens see;
and the keys are split across programs (flash-decoding), so a short batch still
fills the device.

A bias or a mask ([B or 1, N or 1, T or 1, S or 1]) is read per key tile beside K,
gathered row by row where its entries differ by token or head. With a mask the tiles
inside the band run as if its hidden keys were finite (`core.nonfinite_marks` for the
visible ones' K); a program whose accumulator then holds a NaN or inf runs its tiles
again, each keeping the NaN of the keys it hides out of its products (a hidden NaN is
rare, and cleaning every tile costs as much as the step's reads).

Grid (split and row tile, batch, kv head). A program gathers its tile's rows from q,
runs the forward's online softmax over its share of the visible key tiles and writes its
unnormalised accumulator, row reference and row sum; `combine_kernel` merges the
splits (one program per query row) into the forward's own output and row residuals,
so the backward kernels run unchanged on a decoded call. With one split the decode
program writes those itself: one kernel per call.

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

from pallas_attn.kernels import next_power_of_2
from pallas_attn.kernels.core import (
    MAX_FLOOR,
    Problem,
    TileRanges,
    again_cleaned,
    finite,
    logit_scores,
    merge_sink,
    nonfinite_marks,
    run_tile_loops,
    softmax_step,
)
from pallas_attn.kernels.triton.config import DECODE_OPERANDS
from pallas_attn.kernels.triton.context import launch, name_refs
from pallas_attn.semantics import scores

# The merge of the splits: each program takes one query row and reads this many splits
# of it per step (one step up to 64 splits: the device's SMs times the programs per SM
# over the batch's kv heads rarely exceeds it).
COMBINE_CHUNK = 64
COMBINE_WARPS = 4


def row_blocks(problem: Problem) -> int:
    """Tiles of the route's block_q rows that a kv group's T x G query rows fill."""
    return -(-problem.q_len * problem.group // problem.plan.forward.block_q)


def _row_positions(problem: Problem, kh, first, count: int) -> tuple[jax.Array, jax.Array]:
    """(token, query head) of the `count` rows from row `first` (token-major, head-minor);
    rows past T x G repeat the last one, so they compute and store its exact values."""
    G = problem.group
    row = jnp.minimum(first + lax.iota(jnp.int32, count), problem.q_len * G - 1)
    return lax.div(row, G), kh * G + lax.rem(row, G)


def decode_kernel(*refs, problem: Problem, names: tuple[str, ...]):
    r = name_refs(names, refs)
    spec, route = problem.spec, problem.plan.forward
    block_k, R = route.block_k, route.block_q
    # Program (split and row tile, batch entry, kv head).
    split, tile = lax.rem(pl.program_id(0), route.splits), lax.div(pl.program_id(0), route.splits)
    b, kh = pl.program_id(1), pl.program_id(2)
    token, head = _row_positions(problem, kh, tile * R, R)
    token_col = token[:, None]
    kv_length = (r["key_value_seq_lengths"][b]
                 if problem.has("key_value_seq_lengths") else None)
    paged = problem.has("page_table")
    ctx = TileRanges(
        problem, b, kh,
        q_length=r["query_seq_lengths"][b] if problem.has("query_seq_lengths") else None,
        kv_length=kv_length,
        origin=(kv_length - problem.q_len, 0) if paged else None)
    # The keys the tile's tokens can see (its rows span whole tokens but the last).
    first_token = lax.div(tile * R, problem.group)
    stop_token = jnp.minimum(lax.div((tile + 1) * R - 1, problem.group) + 1, problem.q_len)
    limits = None
    if "mask_keys" in r:  # the keys from the mask's first visible one to its last
        at = b if r["mask_keys"].shape[0] > 1 else 0
        limits = (r["mask_keys"][at, 0], r["mask_keys"][at, 1])
    first, stop, full_first, full_stop = ctx.key_tiles(first_token, stop_token, block_k,
                                                       limits=limits)
    per_split = lax.div(stop - first + (route.splits - 1), route.splits)
    lo = jnp.minimum(first + split * per_split, stop)
    hi = jnp.minimum(lo + per_split, stop)
    full_lo = jnp.clip(full_first, lo, hi)
    q = r["q"][b, token, head, :]  # the group's rows, gathered from [B, T, N, H]
    slope = r["alibi_slopes"][b, head][:, None] if problem.has("alibi_slopes") else None
    tanh = (jnp.tanh if problem.interpret or problem.dtype == "float32"
            else plgpu.approx_tanh)

    def pages_of(k0):
        """The page (or each row's page) of the key tile from k0; None unpaged."""
        if not paged:
            return None
        page_size, table = r["k"].shape[1], r["page_table"]
        if page_size % block_k == 0:  # the tile lies in one page
            return table[b, jnp.minimum(lax.div(k0, page_size), table.shape[1] - 1)]
        # The tile spans pages: each row's page from the table (past the table's last
        # page, rows past every length: any page, masked).
        at = k0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        return table[b, jnp.minimum(lax.div(at, page_size), table.shape[1] - 1)]

    def load(name, k0, pages):
        """A key tile of K or V [block_k, the padded head dim], read in place: head dims
        past the cache's and keys past an unpadded cache's length come as zeros."""
        ref = r[name]
        width = problem.plan.head_dims[name == "v"]
        # A contiguous cache of a partial last tile: that tile runs past its end.
        short = not paged and ref.shape[1] % block_k != 0
        if not paged:
            at = (b, pl.ds(k0, block_k))
        elif ref.shape[1] % block_k == 0:
            at = (pages, pl.ds(lax.rem(k0, ref.shape[1]), block_k))
        else:  # each row from its page
            at = (pages, lax.rem(k0 + lax.iota(jnp.int32, block_k), ref.shape[1]))
        if ref.shape[-1] == width and not short:
            return ref[(*at, kh, slice(None))]
        tile = (block_k, width)
        inside = lax.broadcasted_iota(jnp.int32, tile, 1) < ref.shape[-1]
        if short:
            inside = inside & (k0 + lax.broadcasted_iota(jnp.int32, tile, 0) < ref.shape[1])
        dims = pl.ds(0, width)
        if paged and ref.shape[1] % block_k:  # a gather: every index an array, rows x dims
            at, dims = (at[0][:, None], at[1][:, None]), lax.iota(jnp.int32, width)[None, :]
        return plgpu.load(ref.at[(*at, kh, dims)], mask=inside, other=0)

    def entries(name, k0):
        """The rows' entries of a bias or mask [B or 1, N or 1, T or 1, keys or 1] for
        key tile k0, broadcasting against the [rows, block_k] scores (a dimension of 1
        where every row or every key shares them); None without it."""
        if not problem.has(name):
            return None
        ref = r[name]
        batch = b if ref.shape[0] > 1 else 0
        keys = (k0 + lax.iota(jnp.int32, block_k) if ref.shape[3] > 1
                else jnp.zeros((1,), jnp.int32))
        inside = keys < ref.shape[3]  # its keys are padded to the backward's tiles only
        if ref.shape[1] == ref.shape[2] == 1:
            return plgpu.load(ref.at[batch, 0, 0, keys], mask=inside, other=0)[None, :]
        return plgpu.load(ref.at[batch, head[:, None] if ref.shape[1] > 1 else 0,
                                 token_col if ref.shape[2] > 1 else 0, keys[None, :]],
                          mask=inside[None, :], other=0)

    def body(t, carry, masked):
        acc, m_prev, l_prev, pages = carry
        k0 = t * block_k
        # The next tile's pages are read a step ahead: its K/V loads need not wait on them.
        next_pages = pages_of(k0 + block_k)
        k = load("k", k0, pages)
        v = load("v", k0, pages) if masked else None
        raw = plgpu.dot(q, k, trans_b=True, precision=problem.precision)
        cols = k0 + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        bias = entries("bias", k0)
        s, _ = logit_scores(problem, raw, token_col, cols,
                            bias=None if bias is None else bias.astype(jnp.float32),
                            slope=slope, tanh=tanh, offset=ctx.offset)
        if masked:  # a band's or a length's edge tile, or the rerun: hidden keys stay out
            s, v = _nonfinite_keys(problem, s, k, v, k0, ctx.kv_length)
        elif masked is None:  # inside the band with a mask: not cleaned (see the end)
            s = s + nonfinite_marks(raw)
        visible = scores.visibility(
            token_col, cols, spec, ctx.offset,
            kv_bound=problem.kv_len if problem.kv_len % block_k else None,
            q_length=ctx.q_length, kv_length=ctx.kv_length)
        keep = entries("mask", k0)
        if keep is not None:
            visible = keep != 0 if visible is None else visible & (keep != 0)
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
        prob, m_next, l_next, alpha = softmax_step(problem, s, m_prev, l_prev)
        acc = acc * alpha[:, None]
        if v is None:
            v = load("v", k0, pages)
        acc = acc + plgpu.dot(prob.astype(v.dtype), v, precision=problem.precision)
        return acc, m_next, l_next, next_pages

    init = (jnp.zeros((R, problem.plan.head_dims[1]), jnp.float32),
            jnp.full((R,), MAX_FLOOR, jnp.float32),
            jnp.zeros((R,), jnp.float32), pages_of(lo * block_k))
    full_hi = jnp.clip(full_stop, full_lo, hi)
    # With a mask the tiles inside the band run without cleaning the keys it hides.
    acc, m, l_sum, _ = run_tile_loops(lo, hi, full_lo, full_hi, body, init,
                                      whole=False if problem.has("mask") else None)
    if problem.has("mask"):  # a hidden V's NaN or inf reached the accumulator: again, cleaned
        acc, m, l_sum = again_cleaned(
            acc, (m, l_sum),
            lambda: lax.fori_loop(lo, hi, lambda t, c: body(t, c, True), init)[:3],
            ran=full_hi > full_lo)
    if route.splits == 1:  # the program holds whole rows: it writes the results
        sink = r["sinks"][head] if problem.has("sinks") else None
        _store_rows(r, b, token, head,
                    *_normalise(problem, acc, m, l_sum, sink, _past_length(r, b, token)))
        return
    rows = pl.ds(tile * R, R)
    r["acc"][b, kh, rows, split, :] = acc
    r["part_max"][b, kh, rows, split] = m
    r["part_sum"][b, kh, rows, split] = l_sum


def _nonfinite_keys(problem: Problem, s, k, v, k0, kv_length):
    """(scores, V) of a tile that may hide keys: the score column of a key whose K or V
    row holds a NaN or inf turns NaN (the visibility rules then hide it from the rows
    that do not see it) and V's non-finite entries, and the rows past the length, are
    zeroed where the tile holds any. The marks are products with zero on the tensor
    cores (0 * inf and 0 * NaN are NaN), so a tile of finite keys costs two small
    products, not a pass over its K and V."""
    marks = sum(plgpu.dot(jnp.zeros((s.shape[0], x.shape[1]), x.dtype), x, trans_b=True,
                          precision=problem.precision) for x in (k, v))
    s = s + marks

    def clean(v):
        if kv_length is not None:
            keys = k0 + lax.broadcasted_iota(jnp.int32, (v.shape[0], 1), 0)
            v = jnp.where(keys < kv_length, v, jnp.zeros_like(v))
        return finite(v)

    return s, lax.cond(jnp.isnan(jnp.sum(marks)), clean, lambda v: v, v)


def combine_kernel(*refs, problem: Problem, names: tuple[str, ...], chunk: int):
    """One query row (program (b, kv head, row)): merges the splits' partial softmaxes,
    `chunk` splits per step against a running row reference, then the head's sink,
    into the results."""
    r = name_refs(names, refs)
    b, kh, row = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    splits = problem.plan.forward.splits
    token, head = lax.div(row, problem.group), kh * problem.group + lax.rem(row, problem.group)
    empty = MAX_FLOOR  # a split without keys: sum 0, weight <= 1

    def merge(c, carry):
        acc, m, total = carry
        at = pl.ds(c * chunk, chunk)
        kept = c * chunk + lax.iota(jnp.int32, chunk) < splits
        part_max = plgpu.load(r["part_max"].at[b, kh, row, at], mask=kept, other=empty)
        part_sum = plgpu.load(r["part_sum"].at[b, kh, row, at], mask=kept, other=0.0)
        part_acc = plgpu.load(r["acc"].at[b, kh, row, at, :], mask=kept[:, None], other=0.0)
        m_next = jnp.maximum(m, jnp.max(part_max))
        alpha, weight = problem.exp2_of(m - m_next), problem.exp2_of(part_max - m_next)
        return (acc * alpha + jnp.sum(part_acc * weight[:, None], axis=0), m_next,
                total * alpha + jnp.sum(part_sum * weight))

    acc, m, total = lax.fori_loop(0, -(-splits // chunk), merge, (
        jnp.zeros((r["acc"].shape[-1],), jnp.float32), jnp.float32(empty), jnp.float32(0.0)))
    sink = r["sinks"][head] if problem.has("sinks") else None
    _store_rows(r, b, token, head,
                *_normalise(problem, acc, m, total, sink, _past_length(r, b, token)))


def mask_keys(mask: jax.Array) -> jax.Array:
    """[B or 1, 2] int32: the first key the mask shows to any row of a batch entry and
    one past the last (0, 0 where it shows none). One small reduction per step, over the
    mask alone, so that the kernel reads only the tiles between them: Flax's cached
    decoding hides the cache's slots past the current position with its mask."""
    seen = jnp.any(mask != 0, axis=(1, 2))  # [B or 1, S]
    keys = lax.broadcasted_iota(jnp.int32, seen.shape, 1)
    stop = jnp.max(jnp.where(seen, keys + 1, 0), axis=1)
    start = jnp.min(jnp.where(seen, keys, seen.shape[1]), axis=1)
    return jnp.stack([jnp.where(stop > 0, start, 0), stop], axis=1)


def _past_length(r: dict, b, token) -> jax.Array | None:
    """Whether each row's token lies past its sequence's query length (None without)."""
    if "query_seq_lengths" not in r:
        return None
    return token >= r["query_seq_lengths"][b]


def _normalise(problem: Problem, acc: jax.Array, m: jax.Array, total: jax.Array,
               sink: jax.Array | None, past: jax.Array | None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(output, row reference, log2 row sum) of rows (or one row) from their merged
    accumulator, reference and sum, after the head's sink: the forward kernel's results
    (+inf and 0 for rows that see no key, and for rows past the query length even with
    a sink, so that the backward skips them)."""
    if sink is not None:
        alpha, m, total = merge_sink(problem, sink, m, total)
        acc = acc * alpha[..., None]
    seen = total != 0.0  # NaN: seen, so a NaN in a visible input shows
    if past is not None:
        seen = seen & ~past
    # Unseen rows: 0, whatever a hidden key's NaN made of their accumulator.
    out = jnp.where(seen[..., None], acc / jnp.where(seen, total, 1.0)[..., None], 0.0)
    return out, jnp.where(seen, m, jnp.inf), jnp.log2(jnp.where(seen, total, 1.0))


def _store_rows(r: dict, b, token, head, out, m, log2_sum) -> None:
    """The results of rows (or one row) at their tokens and query heads."""
    r["out"][b, token, head, :] = out.astype(r["out"].dtype)
    r["row_max"][b, head, token] = m
    r["log2_sum"][b, head, token] = log2_sum


def forward(problem: Problem, q: jax.Array, k: jax.Array, v: jax.Array,
            optional: dict[str, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """(out [B, T, N, Hvp], (row_max, log2_sum) [B, N, T]): the forward kernel's results
    for the T query rows, from q [B, T or more, N, Hp] (the plan's padded head dims);
    k, v [B, S or kv_pad, K, H or Hp] or, with optional["page_table"], the caches
    [pages, size, K, H]: read in place, never padded (a copy of the whole cache per
    step). With the keys split over several programs, a second kernel merges their
    partial results."""
    B, N = q.shape[0], q.shape[2]
    T, K = problem.q_len, problem.num_kv_heads
    R = problem.plan.forward.block_q * row_blocks(problem)  # every tile's rows
    Hvp = problem.plan.head_dims[1]
    route = problem.plan.forward
    names, inputs = ["q", "k", "v"], [q, k, v]
    for name in (*DECODE_OPERANDS, "page_table"):
        if name in optional:
            names.append(name)
            inputs.append(optional[name])
    if "mask" in optional and optional["mask"].shape[3] > 1:
        names.append("mask_keys")
        inputs.append(mask_keys(optional["mask"]))
    stats = jax.ShapeDtypeStruct((B, N, T), jnp.float32)
    results = [jax.ShapeDtypeStruct((B, T, N, Hvp), q.dtype), stats, stats]
    result_names = ("out", "row_max", "log2_sum")
    splits = route.splits
    if splits == 1:
        out, row_max, log2_sum = launch(
            decode_kernel, problem, (*names, *result_names), inputs, results,
            (row_blocks(problem), B, K), route.num_warps, route.num_stages,
            "pallas_attn_decode")
        return out, (row_max, log2_sum)
    chunk = min(COMBINE_CHUNK, next_power_of_2(splits))
    slots = -(-splits // chunk) * chunk  # slots past `splits` are never written or read
    partial = jax.ShapeDtypeStruct((B, K, R, slots), jnp.float32)
    acc, part_max, part_sum = launch(
        decode_kernel, problem, (*names, "acc", "part_max", "part_sum"), inputs,
        [jax.ShapeDtypeStruct((B, K, R, slots, Hvp), jnp.float32), partial, partial],
        (splits * row_blocks(problem), B, K), route.num_warps, route.num_stages,
        "pallas_attn_decode")
    extra = [name for name in ("sinks", "query_seq_lengths") if name in optional]
    merged = [acc, part_max, part_sum, *(optional[name] for name in extra)]
    merged_names = ("acc", "part_max", "part_sum", *extra)
    out, row_max, log2_sum = launch(
        combine_kernel, problem, (*merged_names, *result_names), merged, results,
        (B, K, T * problem.group), COMBINE_WARPS, 1, "pallas_attn_decode_combine",
        chunk=chunk)
    return out, (row_max, log2_sum)
