"""What every kernel shares, whatever its backend: the problem, tile spans, score
units and the online-softmax step.

`Problem` is the hashable description of one padded attention call and its plan;
kernels are specialised on it. `Band` finds the key tiles a block of query rows
can see (and the query tiles a block of keys is seen by), skipping tiles outside
the causal/window band and past the lengths. `logit_scores` builds every kernel's
scores from the shared modifiers of semantics/scores.py, and `softmax_step` is
the forward's online softmax, so the kernels cannot disagree on the semantics.

Score units: probabilities are p = exp2((s - m) * problem.exp2_factor), with -inf
for invisible entries. Plain scores (scale * q.k) are kept in log2 units (scale and
log2(e) folded into one multiply, factor 1), as FlashAttention does; so are ALiBi
scores (slope * log2(e) folded likewise) and soft-capped scores, which are bounded
by the cap (cap * log2(e) folded into the multiply after the tanh). Only scores
with a bias and no cap stay natural (factor log2(e)) and are converted after the
subtraction, so logits near the float32 minimum (a finfo.min bias) cannot overflow.
The forward keeps two per-row residuals instead of the logsumexp alone: the row
reference m (problem units) and log2 of the row sum l taken against it. The
backward recomputes p = exp2((s - m) * exp2_factor - log2 l), so rows whose logits
are all hugely negative (a row hidden by a finfo.min bias) keep exact gradients,
where m + ln l would round to m. A row that sees no key has m = +inf (and
log2 l = 0), so every backward p is 0 there without a select; its public lse is
+inf until the API turns it into -inf.

The reference m is the running row maximum, soft-capped scores included: a row's
largest weight is then exactly 1, so a row of one visible key outputs that key's value
exactly and the backward's delta = dO . O matches its dP (docs/decisions.md, "The
running row maximum under a soft cap").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_attn.plan import Plan
from pallas_attn.semantics import reference, scores
from pallas_attn.spec import OPTIONAL_INPUTS, AttentionSpec

# The kernels' optional operands, in order: the call's, then what the Pallas path derives
# from them (the keys each query row can see, the queries each key is seen by: from
# sorted segment ids, segment_ranges, and from a mask, mask_ranges).
KERNEL_INPUTS = (*OPTIONAL_INPUTS, "key_ranges", "query_ranges")

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# NOTE: the running row maximum starts at, and never falls below, the most negative
# finite float32: exp2((s - m) * log2(e)) then never sees inf - inf, a fully masked
# row keeps zero probabilities (its s are -inf), and logits as low as finfo.min
# still form a proper softmax.
MAX_FLOOR = float(jnp.finfo(jnp.float32).min)
# float16 dS scaled by ds_scales' factors stays at most 2**DS_MAX_LOG2.
DS_MAX_LOG2 = 15


@dataclasses.dataclass(frozen=True)
class Problem:
    """Static description of one padded call (hashable, a custom_vjp nondiff arg).

    q_len / kv_len are the caller's lengths; the arrays are padded to
    q_pad / kv_pad (multiples of every power-of-two tile; the Mosaic forward's 96-key
    tiles may end past kv_pad) and head dims to the plan's (`Plan.head_dims`). plan:
    each role's backend and tiles (dispatch.py).
    """

    spec: AttentionSpec
    batch: int
    num_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    q_pad: int
    kv_pad: int
    head_dim: int
    value_head_dim: int
    dtype: str
    plan: Plan
    present: tuple[str, ...]  # which spec.OPTIONAL_INPUTS are passed
    interpret: bool = False

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def offset(self) -> int:
        return self.spec.offset(self.q_len, self.kv_len)

    @property
    def precision(self) -> Any:
        # NOTE: float32 inputs get exact float32 products (Triton would default to tf32).
        return lax.Precision.HIGHEST if self.dtype == "float32" else None

    @property
    def dropout_scale(self) -> float:
        """1 / (1 - rate): the weight of a kept entry (1.0 without dropout)."""
        return 1.0 / (1.0 - self.spec.dropout_rate) if self.spec.has_dropout else 1.0

    @property
    def exp2_factor(self) -> float:
        """Scores s give probabilities exp2((s - m) * exp2_factor) (see the module doc)."""
        natural = self.has("bias") and self.spec.logits_soft_cap is None
        return LOG2E if natural else 1.0

    def exp2_of(self, difference: jax.Array) -> jax.Array:
        """exp2(difference * exp2_factor): probabilities from score differences."""
        factor = self.exp2_factor
        return jnp.exp2(difference if factor == 1.0 else difference * factor)

    def probabilities(self, s: jax.Array, row_max: jax.Array, log2_sum: jax.Array,
                      rows: Callable[[jax.Array], jax.Array] = lambda x: x[:, None]
                      ) -> jax.Array:
        """Normalised probabilities of a score tile from the forward's row residuals;
        rows(x) broadcasts a per-row vector against the tile. Never above 1: a backward
        kernel's products may round a logit up from the forward's, by an ulp of 64 at
        |logit| ~ 1e9, which would make P 2^64 (`normalised`)."""
        if self.exp2_factor == 1.0:
            return normalised(s - rows(row_max + log2_sum))
        return normalised((s - rows(row_max)) * self.exp2_factor - rows(log2_sum))

    def logsumexp(self, row_max: jax.Array, log2_sum: jax.Array) -> jax.Array:
        """Natural-log lse from the row residuals (+inf for a row that sees no key).

        Natural units add ln l to m without scaling m, which may lie near finfo.min.
        """
        if self.exp2_factor == 1.0:
            return (row_max + log2_sum) * LN2
        return row_max + log2_sum * LN2

    @property
    def exact_float_positions(self) -> bool:
        """Whether every query and key position, and their distance with the offset,
        is an exact float32 (below 2**24). ALiBi then takes positions as floats,
        converted once per row and per column instead of once per score: int-to-float
        conversions run at a quarter of the float rate, on the unit exp2 needs too."""
        if self.has("origin"):  # the offset is only known at run time
            return False
        return max(self.q_pad, self.kv_pad) + abs(self.offset) < 2**24

    @property
    def pairs_causal_tiles(self) -> bool:
        """Causal attention without a window: a tile's work grows or falls linearly with
        its index, so programs take tiles in mirror pairs (i and num_tiles - 1 - i) and
        each does the same work: the Triton forward's query tiles
        (schedule_query_tiles), the Mosaic kernels' query or key tiles
        (`mosaic.common.work_order`). The Triton backward gained nothing from it
        (docs/decisions.md, "Pairing causal tiles in the Triton forward")."""
        return self.spec.is_causal and self.spec.local_window is None

    def has(self, name: str) -> bool:
        return name in self.present


def normalised(x: jax.Array) -> jax.Array:
    """exp2(x) for log2 probabilities x <= 0, at most 1 where rounding put x above 0; NaN
    stays NaN (a select: the Triton lowering's minimum returns the operand not NaN)."""
    return jnp.exp2(jnp.where(x > 0.0, 0.0, x))


# NOTE: kernel index arithmetic uses lax.div / lax.rem on non-negative ints, never jnp's
# // and %: those add sign-fixing selects that the Triton lowering of JAX 0.11.2 types
# wrongly (see _zero_unless).
def cdiv(a: Any, b: int) -> Any:
    """Ceiling division of a non-negative traced int by a static int."""
    return lax.div(a + (b - 1), b)


def tile_span(lo: Any, hi: Any, block: int) -> tuple[Any, Any]:
    """Tiles [first, stop) covering positions [lo, hi) (empty when hi <= lo)."""
    lo = jnp.maximum(lo, 0)
    first = lax.div(lo, block)
    # NOTE: an empty range starting inside a tile would otherwise still cover it.
    return first, first + _zero_unless(hi > lo, cdiv(jnp.maximum(hi, lo), block) - first)


def full_tile_span(lo: Any, hi: Any, block: int, first: Any, stop: Any) -> tuple[Any, Any]:
    """Tiles lying entirely inside positions [lo, hi), clipped into [first, stop)."""
    lo = jnp.maximum(lo, 0)
    hi = jnp.maximum(hi, 0)
    full_first = jnp.clip(cdiv(lo, block), first, stop)
    full_stop = jnp.clip(lax.div(hi, block), full_first, stop)
    return full_first, full_stop


def _zero_unless(condition: Any, value: Any) -> Any:
    """value where condition holds, else 0, for scalar ints.

    NOTE: not jnp.where: the Triton lowering types Python-int branches of a scalar
    select like its boolean predicate (i1), which breaks the arithmetic after it.
    """
    return value * condition.astype(jnp.int32)


def finite(x: jax.Array) -> jax.Array:
    """x with its non-finite entries zeroed: a key or value a row does not see then
    meets that row's products as zeros, where 0 * NaN would poison the row."""
    return jnp.where(jnp.abs(x) < jnp.inf, x, jnp.zeros_like(x))


def nonfinite_rows(x: jax.Array) -> jax.Array:
    """[rows] of x [rows, D]: NaN where the row holds a non-finite entry, else 0. Added
    to a key's score column, it turns the rows that see the key NaN (the visibility
    rules then hide it from the others), as the reference's `nonfinite_keys` does."""
    return jnp.sum(jnp.where(jnp.abs(x) < jnp.inf, 0.0, jnp.nan), axis=1)


def nonfinite_marks(raw: jax.Array) -> jax.Array:
    """0 where an entry of the raw product Q K^T is finite, NaN where not (0 x inf and
    0 x NaN are NaN, on the tensor cores' results too). Added to the scores before the
    visibility rules, a visible key whose K holds a NaN or inf turns its rows NaN, as the
    reference's poison does, without a pass over the key tile; a hidden one stays hidden.
    V is not covered: a program that runs such tiles checks its accumulator
    (`again_cleaned`)."""
    return raw * 0.0


def again_cleaned(acc: jax.Array, rest: tuple[Any, ...], rerun: Callable[[], Any],
                  ran: Any) -> Any:
    """(acc, *rest), or rerun()'s results where acc holds a NaN or inf after `ran` (any)
    tiles ran without cleaning the keys a mask (or ids) hides (`nonfinite_marks`): a
    hidden V's NaN or inf reaches acc through 0 x NaN; rerun, every tile cleaned, keeps
    it out (and turns a visible one's inf into the reference's NaN). Branches inside the
    program: the sum only where such tiles ran."""
    def keep():
        return (acc, *rest)

    def check():
        return jax.lax.cond(jnp.isnan(jnp.sum(acc * 0.0)), rerun, keep)

    return jax.lax.cond(ran, check, keep)


def run_tile_loops(first: Any, stop: Any, full_first: Any, full_stop: Any,
                   body: Callable[[Any, Any, bool | None], Any], carry: Any,
                   whole: Any = None) -> Any:
    """Loops tiles [first, stop): body(t, carry, masked) with masked True at the edges
    (the band's rules, the ids and the mask), False in the middle (nothing hidden);
    where `whole` (`whole_tiles`; or the constant False) is false at run time, None in the
    middle (the ids and the mask, not the band)."""
    def loop(lo, hi, masked, c):
        return lax.fori_loop(lo, hi, lambda t, c: body(t, c, masked), c)

    carry = loop(first, full_first, True, carry)
    if whole is None:
        carry = loop(full_first, full_stop, False, carry)
    elif whole is False:  # never whole: no loop of full tiles is built
        carry = loop(full_first, full_stop, None, carry)
    else:
        carry = loop(full_first, jnp.where(whole, full_stop, full_first), False, carry)
        carry = loop(full_first, jnp.where(whole, full_first, full_stop), None, carry)
    return loop(full_stop, stop, True, carry)


def whole_tiles(band: tuple[Any, Any, Any, Any], inside: tuple[Any, Any, Any, Any]
                ) -> tuple[tuple[Any, Any, Any, Any], Any]:
    """((first, stop, full_first, full_stop), whole) from the same tiles' `key_tiles` or
    `query_tiles` without and with what the positions see whole (inner): the full tiles
    are the whole ones where there is one (whole true), else the band's (whole false:
    they compare ids and read the mask, as before any tile was whole, rather than run
    every tile with the band's rules)."""
    whole = inside[3] > inside[2]
    return (band[0], band[1], jnp.where(whole, inside[2], band[2]),
            jnp.where(whole, inside[3], band[3])), whole


def logit_scores(problem: Problem, s: jax.Array, rows: Any, cols: Any, *,
                 bias: jax.Array | None = None, slope: Any = None,
                 tanh: Callable[[jax.Array], jax.Array] = jnp.tanh,
                 row_shift: jax.Array | None = None, offset: Any = None
                 ) -> tuple[jax.Array, jax.Array | None]:
    """(scores in the problem's units, t = tanh(logits / cap) or None) of a tile from
    the raw products s = q.k (float32), before any visibility rule.

    rows / cols: the tile's query and key positions, broadcasting against s (only
    read with ALiBi); bias: the tile's bias or None; slope: the head's ALiBi slope or
    None. Every kernel builds its scores here (the module doc describes the units).
    row_shift: a tile-shaped per-row term subtracted from the scores right after the
    scale's multiply (one fused multiply-add), only in log2 units without a bias or
    cap (`log2_row_shift`): the backward's row reference, before the ALiBi term.
    offset: the alignment of rows and cols (TileRanges.offset), problem.offset if None.
    """
    spec, cap = problem.spec, problem.spec.logits_soft_cap
    offset = problem.offset if offset is None else offset
    if row_shift is not None and not log2_row_shift(problem, bias):
        raise AssertionError("logit_scores: row_shift needs log2 units without a bias or cap")
    cap_tanh = None
    # Natural units where a bias may be near finfo.min, or where ALiBi must be added
    # before the cap; otherwise log2 factors fold into the multiplies.
    if bias is not None or (cap is not None and slope is not None):
        s = scores.add_logit_terms(s * spec.scale, rows, cols, offset, bias=bias,
                                   alibi_slope=slope)  # natural units
        if cap is not None:
            cap_tanh = scores.soft_cap_tanh(s, cap, tanh)
    elif cap is not None:
        cap_tanh = scores.soft_cap_tanh(s, cap / spec.scale, tanh)  # scale folded in
    else:  # log2 units, log2(e) folded into the scale and the ALiBi slope
        s = s * (spec.scale * LOG2E)
        if row_shift is not None:
            s = s - row_shift
        s = scores.add_logit_terms(s, rows, cols, offset,
                                   alibi_slope=None if slope is None else slope * LOG2E)
    if cap_tanh is not None:
        s = cap_tanh * (cap * LOG2E)  # log2 units: capped scores are bounded
    return s, cap_tanh


def log2_row_shift(problem: Problem, bias: Any) -> bool:
    """Whether `logit_scores` can take a row_shift: scores in log2 units (no bias, no
    soft cap, probabilities exp2(s - row reference))."""
    return (bias is None and problem.spec.logits_soft_cap is None
            and problem.exp2_factor == 1.0)



def softmax_step(problem: Problem, s: jax.Array, m_prev: jax.Array, l_prev: jax.Array,
                 rows: Callable[[jax.Array], jax.Array] = lambda x: x[:, None]
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One key tile of the online softmax: (probabilities against the new reference,
    new row reference, new row sum, alpha) from the tile's scores s (invisible entries
    -inf) and the running reference (the row maximum, from MAX_FLOOR) and sum. The
    caller rescales its accumulator by alpha. rows(x) broadcasts a per-row vector
    against the tile."""
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = problem.exp2_of(m_prev - m_next)  # natural units: times log2(e)
    prob = problem.exp2_of(s - rows(m_next))  # invisible: s = -inf, prob = 0
    return prob, m_next, l_prev * alpha + jnp.sum(prob, axis=1), alpha


def segment_ranges(q_segments: jax.Array, kv_segments: jax.Array, q_len: int, kv_len: int,
                   same: bool = False) -> tuple[jax.Array, jax.Array]:
    """(key_ranges [B, 4, Tp], query_ranges [B, 4, Sp]) int32 of padded segment ids.

    key_ranges[b, :2, i] = [lo, hi): the keys of query row i's segment, where a batch
    entry's key segment ids are sorted (packed sequences); [0, S + 1) otherwise, which
    skips nothing but stays correct (rows see only part of it). key_ranges[b, 2:, i]:
    the keys row i sees whole, the same range where it is exact, else empty.
    query_ranges likewise for each key. Padded rows and keys get empty ranges [len, 0),
    neutral under a tile's min / max. same: the queries' and keys' ids are one array
    (self-attention), whose segments are then its runs, found in one pass (cummax)
    instead of binary searches.
    """
    def ordered(ids):
        return jnp.all(ids[:, 1:] >= ids[:, :-1], axis=1)[:, None]

    if same:
        ids = q_segments[:, :q_len]
        index = jnp.arange(q_len, dtype=jnp.int32)[None, :]
        change = ids[:, 1:] != ids[:, :-1]
        starts = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), change], axis=1)
        ends = jnp.concatenate([change, jnp.ones_like(ids[:, :1], bool)], axis=1)
        lo = lax.cummax(jnp.where(starts, index, 0), axis=1)
        hi = lax.cummin(jnp.where(ends, index + 1, q_len), axis=1, reverse=True)
        runs = _with_whole(jnp.stack([jnp.where(ordered(ids), lo, 0),
                                      jnp.where(ordered(ids), hi, q_len + 1)], axis=1), q_len)
        return (_pad_ranges(runs, q_segments.shape[1], kv_len),
                _pad_ranges(runs, kv_segments.shape[1], q_len))

    def search(rows, cols, n_rows, n_cols):
        cols = cols[:, :n_cols]

        def one(row_ids, col_ids):
            # NOTE: the unrolled search; the default loop took 0.5 ms at 4 x 4096 on an H100.
            lo, hi = (jnp.searchsorted(col_ids, row_ids, side=side, method="scan_unrolled")
                      for side in ("left", "right"))
            return jnp.stack([lo, hi]).astype(jnp.int32)

        found = jax.vmap(one)(rows[:, :n_rows], cols)
        sorted_ = ordered(cols)[:, :, None]
        found = jnp.where(sorted_, found, jnp.array([0, n_cols + 1], jnp.int32)[None, :, None])
        return _pad_ranges(_with_whole(found, n_cols), rows.shape[1], n_cols)

    return (search(q_segments, kv_segments, q_len, kv_len),
            search(kv_segments, q_segments, kv_len, q_len))


# mask_ranges reads the mask once, into whether each chunk of this many keys holds a
# visible one and whether it is visible whole; the ranges come from those arrays, a
# sixteenth of the mask (the keys' from its rows taken in groups of as many).
MASK_RANGE_CHUNK = 16


def mask_ranges(mask: jax.Array, batch: int, q_len: int, kv_len: int, q_pad: int,
                kv_pad: int) -> tuple[jax.Array, jax.Array]:
    """(key_ranges [B, 4, Tp], query_ranges [B, 4, Sp]) int32 of a boolean mask
    [B or 1, N or 1, T or 1, S or 1], as `segment_ranges` gives them, in chunks of
    MASK_RANGE_CHUNK keys: for each query row the keys from its first chunk holding a
    visible key (in any head) to its last, and the first run of chunks it sees whole
    (in every head); for each key the query rows from the first group of
    MASK_RANGE_CHUNK rows that sees a key of its chunk to the last, and the first run
    of groups that see its chunk whole (tiles made of whole groups skip as with exact
    rows); empty [n, 0) where nothing is visible and for padding. Tiles outside the
    first range hold no visible entry, so the kernels skip them; tiles inside the
    second hide nothing, so the kernels read no mask there."""
    size = MASK_RANGE_CHUNK

    def in_groups(x, axis, whole=False):
        """Whether each group of `size` along `axis` (padded) holds a visible entry (whole:
        holds only visible ones, the padding counted visible); an axis the mask
        broadcasts along stays whole."""
        n = x.shape[axis]
        if n == 1:
            return x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, -(-n // size) * size - n)
        shape = list(x.shape)
        shape[axis:axis + 1] = [-1, size]
        reduce = jnp.all if whole else jnp.any
        return reduce(jnp.pad(x, widths, constant_values=whole).reshape(shape), axis=axis + 1)

    # [B or 1, T or 1, S / size or 1]: a visible key of the chunk in some head, the chunk
    # visible in every head; the rows too in groups for each key's ranges (a column
    # reduction over all of T is slow).
    seen = in_groups(jnp.any(mask, axis=1), 2)
    whole = in_groups(jnp.all(mask, axis=1), 2, whole=True)
    groups, whole_groups = in_groups(seen, 1), in_groups(whole, 1, whole=True)

    def bounds(visible, axis, n, scale):
        """[B or 1, 2, m or 1]: first and last + 1 visible index along `axis`, times
        scale (at most n), or [n, 0]."""
        if visible.shape[axis] == 1:  # broadcast along this axis: all of it or nothing
            lo, hi = jnp.where(visible, 0, n), jnp.where(visible, n, 0)
        else:
            index = lax.broadcasted_iota(jnp.int32, visible.shape, axis)
            lo = jnp.min(jnp.where(visible, index * scale, n), axis=axis, keepdims=True)
            hi = jnp.max(jnp.where(visible, jnp.minimum((index + 1) * scale, n), 0),
                         axis=axis, keepdims=True)
        return jnp.moveaxis(jnp.concatenate([lo, hi], axis=axis), axis, 1)

    def first_run(full, axis, n, scale):
        """[B or 1, 2, m or 1]: the first run of full indices along `axis` times scale (at
        most n), or [n, 0]; two reductions, where the longest run would need a scan."""
        if full.shape[axis] == 1:
            return bounds(full, axis, n, scale)
        index = lax.broadcasted_iota(jnp.int32, full.shape, axis)
        count = full.shape[axis]
        start = jnp.min(jnp.where(full, index, count), axis=axis, keepdims=True)
        stop = jnp.min(jnp.where(~full & (index > start), index, count), axis=axis,
                       keepdims=True)
        lo = jnp.where(start < count, start * scale, n)
        hi = jnp.where(start < count, jnp.minimum(stop * scale, n), 0)
        return jnp.moveaxis(jnp.concatenate([lo, hi], axis=axis), axis, 1)

    def padded(found, rows, pad, n):
        return _pad_ranges(jnp.broadcast_to(found, (batch, 4, rows)).astype(jnp.int32), pad, n)

    per_key = jnp.concatenate([bounds(groups, 1, q_len, size),
                               first_run(whole_groups, 1, q_len, size)], axis=1)
    if per_key.shape[2] > 1:  # per chunk: one range for each of its keys
        per_key = jnp.repeat(per_key, size, axis=2)[:, :, :kv_len]
    per_row = jnp.concatenate([bounds(seen, 2, kv_len, size),
                               first_run(whole, 2, kv_len, size)], axis=1)
    return padded(per_row, q_len, q_pad, kv_len), padded(per_key, kv_len, kv_pad, q_len)


def _with_whole(ranges: jax.Array, n: int) -> jax.Array:
    """[B, 4, m]: segment ranges [B, 2, m] over n positions on the other side, then what
    each position sees whole: the same range, or empty where its stop lies past the n
    positions (unsorted ids: the range is not exact)."""
    return jnp.concatenate([ranges, ranges[:, :1], jnp.where(ranges[:, 1:] > n, 0,
                                                              ranges[:, 1:])], axis=1)


def _pad_ranges(ranges: jax.Array, size: int, n: int) -> jax.Array:
    """Ranges [B, 4, m] padded to [B, 4, size] with empty ranges [n, 0), neutral under a
    tile's min of starts and max of stops."""
    fill = jnp.broadcast_to(jnp.array([n, 0, n, 0], jnp.int32)[None, :, None],
                            (ranges.shape[0], 4, size - ranges.shape[2]))
    return jnp.concatenate([ranges, fill], axis=2)


def intersect_ranges(a: jax.Array, b: jax.Array) -> jax.Array:
    """The ranges [B, 4, n] that both a and b allow: what a position may see, within
    both; what it sees whole, in both."""
    return jnp.stack([jnp.maximum(a[:, 0], b[:, 0]), jnp.minimum(a[:, 1], b[:, 1]),
                      jnp.maximum(a[:, 2], b[:, 2]), jnp.minimum(a[:, 3], b[:, 3])], axis=1)


class DsScales(NamedTuple):
    """Powers of two that keep float16 dS below 65504 in its products (`ds_scales`)."""
    rows: jax.Array  # [B, N, 2, Tp]: per query row e >= 0 and 2^e, for the dQ kernels
    keys: jax.Array  # [B, K, 2, Sp / block_k]: per key tile 2^-c and 2^c, for dK/dV


def ds_scales(problem: Problem, do_norms: jax.Array, v_norms: jax.Array, delta: jax.Array,
              lengths: tuple[Any, Any], origin: jax.Array | None) -> DsScales:
    """The powers of two by which the float16 backward multiplies dS before rounding it to
    float16 for dS K (2^-e of a query row: the dQ kernels add e to the row's log2 row sum,
    so P comes out times it) and dS^T Q (2^-c of a dK/dV key tile: folded into
    dP - delta), and then the sum of the products by the inverse.

    |dS_ij| = P_ij |dP_ij - delta_i| <= |dO_i| |V_j| * keep_scale + |delta_i| (P <= 1,
    Cauchy-Schwarz; a soft cap's slope only shrinks it): a row's bound takes the kv
    head's largest |V_j|, a key tile's its largest |V_j| and the group's largest |dO_i|
    and |delta_i|; each power of two is the smallest that keeps its bound at most 2^15,
    below float16's 65504 with room for float32 rounding. Ordinary inputs get 2^0: the
    kernels compute what they compute unscaled. Positions past the lengths and
    non-finite norms count 0 (a NaN row or key is NaN whatever its scale). do_norms
    [B, N, Tp]: |dO_i|; v_norms [B, K, Sp]: |V_j| of the padded keys; delta [B, N, Tp];
    lengths: (query, key) [B] or None; origin: the positions of query 0 and key 0 or
    None."""
    q0, k0 = (0, 0) if origin is None else (origin[0], origin[1])

    def visible(n, length, start):  # n [B, L, H] -> [B, H, L], 0 past the length
        return jnp.swapaxes(reference.hide_past(finite(n), length, start), 1, 2)

    B, N, Tp = do_norms.shape
    K, Sp = v_norms.shape[1:]
    do_norms = visible(jnp.swapaxes(do_norms, 1, 2), lengths[0], q0) * problem.dropout_scale
    v_norms = visible(jnp.swapaxes(v_norms, 1, 2), lengths[1], k0)
    size = finite(jnp.abs(delta))
    by_group = (B, K, problem.group * Tp)
    row_bound = (do_norms * jnp.repeat(jnp.max(v_norms, axis=2), problem.group, axis=1)[..., None]
                 + size)
    block = problem.plan.dkdv.block_k
    v_tiles = jnp.max(v_norms.reshape(B, K, Sp // block, block), axis=3)
    key_bound = (v_tiles * jnp.max(do_norms.reshape(by_group), axis=2)[..., None]
                 + jnp.max(size.reshape(by_group), axis=2)[..., None])
    e, c = _exponent_above(row_bound, DS_MAX_LOG2), _exponent_above(key_bound, DS_MAX_LOG2)
    return DsScales(jnp.stack([e.astype(jnp.float32), _power_of_two(e)], axis=2),
                    jnp.stack([_power_of_two(-c), _power_of_two(c)], axis=2))


def bias_row_gradient(problem: Problem, ds_sum: Any, p_dp: Any, p_slope: Any, delta: Any,
                      lse_grad: Any) -> Any:
    """The gradient of a bias entry broadcast along keys, per query row, from the row's
    sums of dS, P dP and cP (c: the soft cap's slope, 1 without one), in the units
    `score_gradient` leaves them (times `dropout_scale` to finish). A row's dS sums to
    sum cP dP - (D - g) sum cP (D = dO . out, g: the lse cotangent, delta = D - g), near
    zero without sinks, a cap or g: summed entry by entry it would be the stored output's
    rounding in D. D is taken as the row's own sum P dP, which cancels exactly."""
    kept = 1.0 - problem.spec.dropout_rate
    return ds_sum + ((delta + lse_grad) * kept - p_dp) * p_slope


def _exponent_above(bound: jax.Array, max_log2: int) -> jax.Array:
    """The integer e >= 0 that brings bound * 2^-e into [2^(max_log2 - 1), 2^max_log2),
    or 0 if it is below (bound finite, >= 0), from the exponent bits."""
    biased = lax.shift_right_logical(lax.bitcast_convert_type(bound, jnp.int32), 23)
    return jnp.maximum(biased - 126 - max_log2, 0)  # bound < 2^(biased - 126)


def _power_of_two(e: jax.Array) -> jax.Array:
    """2^e, float32, exact, for integers e in [-126, 127]."""
    return lax.bitcast_convert_type(lax.shift_left(e + 127, 23), jnp.float32)


def merge_sink(problem: Problem, sink: Any, m: jax.Array, l_sum: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(alpha, row reference, row sum) after a row's softmax gains the head's sink (a
    natural-units logit with no value); the caller scales its accumulator by alpha. A
    row that saw no key ends with reference = the sink and sum 1: output 0, lse = sink."""
    sink = sink * LOG2E if problem.exp2_factor == 1.0 else sink  # the problem's units
    merged = jnp.maximum(m, sink)
    alpha = problem.exp2_of(m - merged)
    return alpha, merged, l_sum * alpha + problem.exp2_of(sink - merged)


class TileRanges:
    """The tiles that query head n of batch entry b needs: key tiles for a block of
    query rows, query tiles for a block of keys, and which of them the causal/window
    band and the sequence lengths cross (masked) or leave whole (unmasked).

    q_length / kv_length: the call's sequence lengths of batch entry b (traced
    scalars) or None; origin: the positions of query 0 and key 0 (traced) or None.
    Tiles count positions from 0: the origin moves into the offset and the lengths."""

    def __init__(self, problem: Problem, b: Any, n: Any, *, q_length: Any = None,
                 kv_length: Any = None, origin: tuple[Any, Any] | None = None):
        self.p = problem
        self.b = b
        self.n = n
        self.origin = origin
        self.offset = problem.offset
        if origin is not None:
            self.offset = problem.offset + (origin[0] - origin[1])
            q_length = None if q_length is None else q_length - origin[0]
            kv_length = None if kv_length is None else kv_length - origin[1]
        self.q_length = q_length
        self.kv_length = kv_length

    def kv_stop(self) -> Any:
        """Keys at or past this position are invisible to every query."""
        stop = self.p.kv_len
        if self.kv_length is not None:
            stop = jnp.minimum(stop, self.kv_length)
        return stop

    def key_tiles(self, q0: Any, q_stop: Any, block_k: int,
                  limits: tuple[Any, Any] | None = None,
                  inner: tuple[Any, Any] | None = None) -> tuple[Any, Any, Any, Any]:
        """(first, stop, full_first, full_stop) key tiles for queries [q0, q_stop);
        limits: keys [lo, hi) outside which these queries see nothing (their segments);
        inner: keys [lo, hi) that every one of them sees (where their segments overlap),
        or None: tiles outside it are not full."""
        spec, off = self.p.spec, self.offset
        kv_stop = self.kv_stop()
        lo, hi = scores.key_range(q0, q_stop, spec, off, kv_stop)
        if limits is not None:
            lo, hi = jnp.maximum(lo, limits[0]), jnp.minimum(hi, limits[1])
        first, stop = tile_span(lo, hi, block_k)
        # A tile is fully visible (no band mask) if every (i, j) passes causal/window/length.
        full_lo, full_hi = 0, kv_stop
        if spec.is_causal:
            full_hi = jnp.minimum(full_hi, q0 + off + 1)
        if spec.local_window is not None:
            left, right = spec.local_window
            full_lo = jnp.maximum(full_lo, q_stop - 1 + off - left)
            full_hi = jnp.minimum(full_hi, q0 + off + right + 1)
        if inner is not None:
            full_lo, full_hi = jnp.maximum(full_lo, inner[0]), jnp.minimum(full_hi, inner[1])
        return (first, stop, *full_tile_span(full_lo, full_hi, block_k, first, stop))

    def query_tiles(self, k0: Any, k_stop: Any, block_q: int,
                    limits: tuple[Any, Any] | None = None,
                    inner: tuple[Any, Any] | None = None) -> tuple[Any, Any, Any, Any]:
        """(first, stop, full_first, full_stop) query tiles for keys [k0, k_stop);
        limits: queries [lo, hi) outside which none sees these keys (their segments);
        inner: queries [lo, hi) that see every one of them, or None."""
        spec, off = self.p.spec, self.offset
        q_stop = self.p.q_len
        if self.q_length is not None:
            q_stop = jnp.minimum(q_stop, self.q_length)
        lo, hi = scores.query_range(k0, k_stop, spec, off, q_stop)
        if limits is not None:
            lo, hi = jnp.maximum(lo, limits[0]), jnp.minimum(hi, limits[1])
        hi = _zero_unless(k0 < self.kv_stop(), hi)  # keys all past the length: nothing to do
        first, stop = tile_span(lo, hi, block_q)
        full_lo, full_hi = 0, q_stop
        if spec.is_causal:
            full_lo = jnp.maximum(full_lo, k_stop - 1 - off)
        if spec.local_window is not None:
            left, right = spec.local_window
            full_lo = jnp.maximum(full_lo, k_stop - 1 - off - right)
            full_hi = jnp.minimum(full_hi, k0 - off + left + 1)
        if inner is not None:
            full_lo, full_hi = jnp.maximum(full_lo, inner[0]), jnp.minimum(full_hi, inner[1])
        full_hi = _zero_unless(k_stop <= self.kv_stop(), full_hi)  # a ragged key tile
        return (first, stop, *full_tile_span(full_lo, full_hi, block_q, first, stop))
