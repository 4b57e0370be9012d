"""Plumbing shared by every Pallas kernel: the static problem, named refs, tile math.

`Problem` is the hashable description of one padded attention call; kernels are
specialised on it. `TileContext` holds what a kernel program reads once (ALiBi
slope, sequence lengths, dropout key) and computes a [block_q, block_k] tile of
scores and score gradients with the shared modifiers of `scores.py`, so the
forward, dK/dV, dQ and dbias kernels cannot disagree on the semantics.

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

The reference m is the running row maximum, except for soft-capped scores: they
are bounded by cap * log2(e), and where that bound is small enough
(Problem.fixed_row_reference) the bound itself is every row's reference, so the
forward needs no row maximum and never rescales its accumulator.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn import dropout as dropout_lib
from pallas_attn.kernels import scores
from pallas_attn.spec import AttentionSpec
from pallas_attn.tuning import BlockSizes

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# NOTE: the running row maximum starts at, and never falls below, the most negative
# finite float32: exp2((s - m) * log2(e)) then never sees inf - inf, a fully masked
# row keeps zero probabilities (its s are -inf), and logits as low as finfo.min
# still form a proper softmax.
MAX_FLOOR = float(jnp.finfo(jnp.float32).min)
# NOTE: a fixed reference (the soft cap's bound) leaves probabilities as small as
# 2**(-2 * bound); a bound up to 50 keeps them above 2**-100, normal in float32 and
# bfloat16. float16 P (min normal 2**-14) never uses the fixed reference.
FIXED_REFERENCE_MAX_LOG2 = 50.0

# Names of the optional operands, in the order kernels receive them.
OPTIONAL_INPUTS = ("bias", "mask", "alibi_slopes", "q_segment_ids", "kv_segment_ids",
                   "query_seq_lengths", "key_value_seq_lengths", "dropout_seed")


@dataclasses.dataclass(frozen=True)
class Problem:
    """Static description of one padded call (hashable, a custom_vjp nondiff arg).

    q_len / kv_len are the caller's lengths; the arrays are padded to
    q_pad / kv_pad (multiples of every tile) and head dims to powers of two.
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
    blocks: BlockSizes
    present: tuple[str, ...]  # which OPTIONAL_INPUTS are passed
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
        rows(x) broadcasts a per-row vector against the tile."""
        if self.exp2_factor == 1.0:
            return jnp.exp2(s - rows(row_max + log2_sum))
        return jnp.exp2((s - rows(row_max)) * self.exp2_factor - rows(log2_sum))

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
        return max(self.q_pad, self.kv_pad) + abs(self.offset) < 2**24

    @property
    def fixed_row_reference(self) -> float | None:
        """A constant row reference when every score is bounded, else None.

        Soft-capped scores lie in [-cap * log2(e), cap * log2(e)] (log2 units), so
        exp2(s - cap * log2(e)) <= 1 for every row without a row maximum, as long as
        the smallest probability, 2**(-2 * cap * log2(e)), stays a normal number of
        P's dtype (not float16, cap * log2(e) <= FIXED_REFERENCE_MAX_LOG2).
        """
        cap = self.spec.logits_soft_cap
        if cap is None or self.dtype == "float16":
            return None
        bound = cap * LOG2E
        return bound if bound <= FIXED_REFERENCE_MAX_LOG2 else None

    @property
    def pairs_query_tiles(self) -> bool:
        """Causal attention without a window: a query tile's work grows linearly with
        its index, so each forward program takes tile i and its mirror
        num_tiles - 1 - i and every program does the same work (schedule_query_tiles).
        Measured (BENCHMARKS.md): 5% faster causal d128 forward; the backward kernels
        gained nothing from it and keep one tile per program."""
        return self.spec.is_causal and self.spec.local_window is None

    @property
    def tanh(self) -> Any:
        # NOTE: 16-bit inputs on the GPU use the hardware tanh.approx.f32 (relative error
        # about 2^-11, below bfloat16/float16 rounding) for the soft cap; float32 inputs
        # and the interpreter use the exact tanh.
        if self.interpret or self.dtype == "float32":
            return jnp.tanh
        return plgpu.approx_tanh

    def has(self, name: str) -> bool:
        return name in self.present


def name_refs(names: Sequence[str], refs: Sequence[Any]) -> dict[str, Any]:
    if len(names) != len(refs):
        raise AssertionError(f"expected refs {names}, got {len(refs)}")
    return dict(zip(names, refs, strict=True))


def whole_array_specs(arrays: Sequence[Any]) -> list[pl.BlockSpec]:
    """Each operand as one block; kernels index it explicitly with program ids."""
    def spec(x):
        zeros = (0,) * x.ndim
        return pl.BlockSpec(x.shape, lambda *_: zeros)
    return [spec(x) for x in arrays]


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


def scheduled_grid_size(num_tiles: int, paired: bool) -> int:
    """Programs along grid axis 0 for num_tiles query tiles (see schedule_query_tiles)."""
    return (num_tiles + 1) // 2 if paired else num_tiles


def schedule_query_tiles(num_tiles: int, paired: bool,
                         tile_body: Callable[[Any], None]) -> None:
    """Runs tile_body(tile) for the query tiles of this program (grid axis 0).

    Under causal masking a query tile's work grows with its index. Unpaired, program
    p takes tile num_tiles - 1 - p: the heavy tiles start first and the launch ends
    on light ones. Paired, program p takes tile num_tiles - 1 - p, then its mirror p
    (the middle tile alone when num_tiles is odd): every program does the same work.
    """
    pid = pl.program_id(0)
    heavy = num_tiles - 1 - pid
    if not paired:
        tile_body(heavy)
        return

    def step(slot, carry):
        tile_body(heavy + slot * (pid - heavy))
        return carry

    lax.fori_loop(0, 1 + (pid < heavy).astype(jnp.int32), step, 0)


def run_tile_loops(first: Any, stop: Any, full_first: Any, full_stop: Any,
                   body: Callable[[Any, Any, bool], Any], carry: Any) -> Any:
    """Loops tiles [first, stop): edge tiles with band masking, the middle without."""
    def loop(lo, hi, masked, c):
        return lax.fori_loop(lo, hi, lambda t, c: body(t, c, masked), c)

    carry = loop(first, full_first, True, carry)
    carry = loop(full_first, full_stop, False, carry)
    return loop(full_stop, stop, True, carry)


def logit_scores(problem: Problem, s: jax.Array, rows: Any, cols: Any, *,
                 bias: jax.Array | None = None, slope: Any = None,
                 tanh: Callable[[jax.Array], jax.Array] = jnp.tanh,
                 row_shift: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array | None]:
    """(scores in the problem's units, t = tanh(logits / cap) or None) of a tile from
    the raw products s = q.k (float32), before any visibility rule.

    rows / cols: the tile's query and key positions, broadcasting against s (only
    read with ALiBi); bias: the tile's bias or None; slope: the head's ALiBi slope or
    None. Every kernel builds its scores here (the module doc describes the units).
    row_shift: a tile-shaped per-row term subtracted from the scores right after the
    scale's multiply (one fused multiply-add), only in log2 units without a bias or
    cap (`log2_row_shift`): the backward's row reference, before the ALiBi term.
    """
    spec, cap = problem.spec, problem.spec.logits_soft_cap
    if row_shift is not None and not log2_row_shift(problem, bias):
        raise AssertionError("logit_scores: row_shift needs log2 units without a bias or cap")
    cap_tanh = None
    # Natural units where a bias may be near finfo.min, or where ALiBi must be added
    # before the cap; otherwise log2 factors fold into the multiplies.
    if bias is not None or (cap is not None and slope is not None):
        s = scores.add_logit_terms(s * spec.scale, rows, cols, problem.offset, bias=bias,
                                   alibi_slope=slope)  # natural units
        if cap is not None:
            cap_tanh = scores.soft_cap_tanh(s, cap, tanh)
    elif cap is not None:
        cap_tanh = scores.soft_cap_tanh(s, cap / spec.scale, tanh)  # scale folded in
    else:  # log2 units, log2(e) folded into the scale and the ALiBi slope
        s = s * (spec.scale * LOG2E)
        if row_shift is not None:
            s = s - row_shift
        s = scores.add_logit_terms(s, rows, cols, problem.offset,
                                   alibi_slope=None if slope is None else slope * LOG2E)
    if cap_tanh is not None:
        s = cap_tanh * (cap * LOG2E)  # log2 units: capped scores are bounded
    return s, cap_tanh


def log2_row_shift(problem: Problem, bias: Any) -> bool:
    """Whether `logit_scores` can take a row_shift: scores in log2 units (no bias, no
    soft cap, probabilities exp2(s - row reference))."""
    return (bias is None and problem.spec.logits_soft_cap is None
            and problem.exp2_factor == 1.0)


class TileContext:
    """Per-program state for computing score tiles of query head n of batch entry b."""

    def __init__(self, problem: Problem, refs: dict[str, Any], b: Any, n: Any):
        self.p = problem
        self.refs = refs
        self.b = b
        self.n = n
        spec = problem.spec
        # The Mosaic kernels build contexts without refs, for the tile ranges only.
        self.slope = refs["alibi_slopes"][b, n] if "alibi_slopes" in refs else None
        self.kv_length = (refs["key_value_seq_lengths"][b]
                          if problem.has("key_value_seq_lengths") else None)
        self.q_length = (refs["query_seq_lengths"][b]
                         if problem.has("query_seq_lengths") else None)
        self.drop_key = None
        if spec.has_dropout:
            seed = (refs["dropout_seed"][0], refs["dropout_seed"][1])
            batch_head = 0 if spec.broadcast_dropout else b * problem.num_heads + n
            self.drop_key = dropout_lib.program_key(seed, batch_head)

    # -- ranges -------------------------------------------------------------------
    def kv_stop(self) -> Any:
        """Keys at or past this position are invisible to every query."""
        stop = self.p.kv_len
        if self.kv_length is not None:
            stop = jnp.minimum(stop, self.kv_length)
        return stop

    def key_tiles(self, q0: Any, q_stop: Any, block_k: int) -> tuple[Any, Any, Any, Any]:
        """(first, stop, full_first, full_stop) key tiles for queries [q0, q_stop)."""
        spec, off = self.p.spec, self.p.offset
        kv_stop = self.kv_stop()
        lo, hi = scores.key_range(q0, q_stop, spec, off, kv_stop)
        first, stop = tile_span(lo, hi, block_k)
        # A tile is fully visible (no band mask) if every (i, j) passes causal/window/length.
        full_lo, full_hi = 0, kv_stop
        if spec.is_causal:
            full_hi = jnp.minimum(full_hi, q0 + off + 1)
        if spec.local_window is not None:
            left, right = spec.local_window
            full_lo = jnp.maximum(full_lo, q_stop - 1 + off - left)
            full_hi = jnp.minimum(full_hi, q0 + off + right + 1)
        return (first, stop, *full_tile_span(full_lo, full_hi, block_k, first, stop))

    def query_tiles(self, k0: Any, k_stop: Any, block_q: int) -> tuple[Any, Any, Any, Any]:
        """(first, stop, full_first, full_stop) query tiles for keys [k0, k_stop)."""
        spec, off = self.p.spec, self.p.offset
        q_stop = self.p.q_len
        if self.q_length is not None:
            q_stop = jnp.minimum(q_stop, self.q_length)
        lo, hi = scores.query_range(k0, k_stop, spec, off, q_stop)
        hi = _zero_unless(k0 < self.kv_stop(), hi)  # keys all past the length: nothing to do
        first, stop = tile_span(lo, hi, block_q)
        full_lo, full_hi = 0, q_stop
        if spec.is_causal:
            full_lo = jnp.maximum(full_lo, k_stop - 1 - off)
        if spec.local_window is not None:
            left, right = spec.local_window
            full_lo = jnp.maximum(full_lo, k_stop - 1 - off - right)
            full_hi = jnp.minimum(full_hi, k0 - off + left + 1)
        full_hi = _zero_unless(k_stop <= self.kv_stop(), full_hi)  # a ragged key tile
        return (first, stop, *full_tile_span(full_lo, full_hi, block_q, first, stop))

    # -- tiles --------------------------------------------------------------------
    def _load_broadcast(self, name: str, shape: tuple[int, ...], q0: Any, k0: Any,
                        block_q: int, block_k: int) -> jax.Array:
        bb = self.b if shape[0] > 1 else 0
        nb = self.n if shape[1] > 1 else 0
        rows = pl.ds(q0, block_q) if shape[2] > 1 else pl.ds(0, 1)
        cols = pl.ds(k0, block_k) if shape[3] > 1 else pl.ds(0, 1)
        return self.refs[name][bb, nb, rows, cols]

    def scores(self, q: jax.Array, k: jax.Array, q0: Any, k0: Any, masked: bool
               ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """Float32 scores [bq, bk] in the problem's units, invisible entries at -inf.

        Returns (scores, visible or None, tanh(logits / cap) or None).
        masked=False skips the band masks (causal, window, lengths), for tiles the
        caller proved fully inside the band.
        """
        p, spec = self.p, self.p.spec
        block_q, block_k = q.shape[0], k.shape[0]
        s = plgpu.dot(q, k, trans_b=True, precision=p.precision)
        rows = (q0 + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0))
        cols = (k0 + lax.broadcasted_iota(jnp.int32, (1, block_k), 1))
        bias = (self._load_broadcast("bias", spec.bias_shape, q0, k0, block_q, block_k)
                if p.has("bias") else None)
        alibi_rows, alibi_cols = rows, cols
        if self.slope is not None and p.exact_float_positions:
            alibi_rows, alibi_cols = rows.astype(jnp.float32), cols.astype(jnp.float32)
        s, cap_tanh = logit_scores(p, s, alibi_rows, alibi_cols, bias=bias, slope=self.slope,
                                   tanh=p.tanh)
        mask = (self._load_broadcast("mask", spec.mask_shape, q0, k0, block_q, block_k)
                if p.has("mask") else None)
        q_seg = kv_seg = None
        if p.has("q_segment_ids"):
            q_seg = self.refs["q_segment_ids"][self.b, pl.ds(q0, block_q)][:, None]
            kv_seg = self.refs["kv_segment_ids"][self.b, pl.ds(k0, block_k)][None, :]
        band_spec = spec if masked else dataclasses.replace(spec, is_causal=False,
                                                            local_window=None)
        visible = scores.visibility(
            rows, cols, band_spec, p.offset, mask=mask, q_segments=q_seg, kv_segments=kv_seg,
            kv_length=self.kv_length if masked else None,
            kv_bound=p.kv_len if masked and p.kv_pad != p.kv_len else None)
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
        return s, visible, cap_tanh

    def keep(self, q0: Any, k0: Any, block_q: int, block_k: int) -> jax.Array:
        """Dropout keep decisions for the tile (same hash as the reference)."""
        rows = q0 + lax.iota(jnp.int32, block_q)
        cols = k0 + lax.iota(jnp.int32, block_k)
        return dropout_lib.keep(dropout_lib.row_keys(self.drop_key, rows), cols,
                                self.p.spec.dropout_rate)

    def row_residuals(self, q0: Any, block_q: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(row_max, log2_sum, delta) of query rows [q0, q0 + block_q)."""
        rows = pl.ds(q0, block_q)
        return tuple(self.refs[name][self.b, self.n, rows]
                     for name in ("row_max", "log2_sum", "delta"))

    def score_gradient(self, q, k, v, do, residuals, q0, k0, masked
                       ) -> tuple[jax.Array, jax.Array]:
        """(dropped probabilities P~, score gradient dS) of one tile, float32, both
        divided by problem.dropout_scale: callers multiply what they accumulate from
        them by it once, at the end, instead of every score.

        residuals: row_residuals() of the tile's rows. P = exp(s - lse);
        dP~ = dO V^T; dP = dP~ * keep / (1 - rate); dS = P * (dP - delta) times the
        soft-cap derivative, computed as P * (dP~ * keep - delta * (1 - rate)).
        """
        spec = self.p.spec
        row_max, log2_sum, delta = residuals
        s, _, cap_tanh = self.scores(q, k, q0, k0, masked)
        prob = self.p.probabilities(s, row_max, log2_sum)
        dp = plgpu.dot(do, v, trans_b=True, precision=self.p.precision)
        dropped = prob
        if spec.has_dropout:
            keep = self.keep(q0, k0, q.shape[0], k.shape[0])
            dropped = jnp.where(keep, prob, 0.0)
            dp = jnp.where(keep, dp, 0.0)
            delta = delta * (1.0 - spec.dropout_rate)
        ds = prob * (dp - delta[:, None])
        if cap_tanh is not None:
            ds = ds * scores.soft_cap_slope(cap_tanh)
        return dropped, ds
