"""What the Triton kernels share: named refs, the grid's query-tile schedule, a
program's score tiles, head-dim tiles of any width, and the launch.

`TileContext` holds what a kernel program reads once (ALiBi slope, sequence
lengths, dropout key) and computes a [block_q, block_k] tile of scores and score
gradients with the shared rules (core.logit_scores, semantics/scores.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn.kernels import int32_indices, padded_head_dim, varying_like
from pallas_attn.kernels.core import (
    KERNEL_INPUTS,
    Problem,
    TileRanges,
    logit_scores,
    whole_tiles,
)
from pallas_attn.semantics import dropout as dropout_lib
from pallas_attn.semantics import scores


def head_tile(ref: Any, b: Any, rows: Any, head: Any) -> jax.Array:
    """ref[b, rows, head, :] (rows a pl.ds) at a power-of-two width, Triton's tiles: where
    the array's head dim is none (a Mosaic kernel's whole wgmma tiles, 48 or 160, which
    the repairs read in place) the columns past it come as zeros."""
    width = padded_head_dim(ref.shape[-1])
    if width == ref.shape[-1]:
        return ref[b, rows, head, :]
    return plgpu.load(ref.at[b, rows, head, pl.ds(0, width)],
                      mask=_head_columns(rows.size, width, ref.shape[-1]), other=0)


def store_head_tile(ref: Any, b: Any, rows: Any, head: Any, value: jax.Array) -> None:
    """ref[b, rows, head, :] = value, a `head_tile` of ref's rows: its zero columns past
    the array's head dim left out."""
    width = value.shape[-1]
    if width == ref.shape[-1]:
        ref[b, rows, head, :] = value.astype(ref.dtype)
        return
    plgpu.store(ref.at[b, rows, head, pl.ds(0, width)], value.astype(ref.dtype),
                mask=_head_columns(rows.size, width, ref.shape[-1]))


def _head_columns(rows: int, width: int, head_dim: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, (rows, width), 1) < head_dim


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


class TileContext(TileRanges):
    """Per-program state for computing score tiles of query head n of batch entry b."""

    def __init__(self, problem: Problem, refs: dict[str, Any], b: Any, n: Any,
                 folds_segments: bool = False):
        super().__init__(
            problem, b, n,
            q_length=(refs["query_seq_lengths"][b]
                      if problem.has("query_seq_lengths") else None),
            kv_length=(refs["key_value_seq_lengths"][b]
                       if problem.has("key_value_seq_lengths") else None),
            origin=((refs["origin"][0], refs["origin"][1]) if problem.has("origin") else None))
        self.refs = refs
        # Segment ids and a mask bound the key tiles that a block of query rows sees
        # whole (`key_tiles`): the kernels that loop key tiles (folds_segments) compare
        # ids and read the mask only in the others, the tiles they run with masked=True.
        self.folds_segments = folds_segments and problem.has("key_ranges")
        spec = problem.spec
        self.slope = refs["alibi_slopes"][b, n] if "alibi_slopes" in refs else None
        self.drop_key = None
        if spec.has_dropout:
            shared = spec.broadcast_dropout
            self.drop_key = refs["dropout_keys"][0 if shared else b, 0 if shared else n]

    @property
    def tanh(self) -> Any:
        # NOTE: 16-bit inputs on the GPU use the hardware tanh.approx.f32 (relative error
        # about 2^-11, below bfloat16/float16 rounding) for the soft cap; float32 inputs
        # and the interpreter use the exact tanh.
        if self.p.interpret or self.p.dtype == "float32":
            return jnp.tanh
        return plgpu.approx_tanh

    # -- tiles --------------------------------------------------------------------
    def _load_broadcast(self, name: str, shape: tuple[int, ...], q0: Any, k0: Any,
                        block_q: int, block_k: int) -> jax.Array:
        bb = self.b if shape[0] > 1 else 0
        nb = self.n if shape[1] > 1 else 0
        rows = pl.ds(q0, block_q) if shape[2] > 1 else pl.ds(0, 1)
        cols = pl.ds(k0, block_k) if shape[3] > 1 else pl.ds(0, 1)
        return self.refs[name][bb, nb, rows, cols]

    def scores(self, q: jax.Array, k: jax.Array, q0: Any, k0: Any, masked: bool | None,
               poison: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """Float32 scores [bq, bk] in the problem's units, invisible entries at -inf.

        Returns (scores, visible or None, tanh(logits / cap) or None).
        masked (`core.run_tile_loops`): True applies the band masks (causal, window,
        lengths), the ids and the mask; None (inside the band) the ids and the mask;
        False, for tiles the rows see whole, nothing where folds_segments (else the ids
        and the mask still). poison: [bk] added to the score columns
        before the visibility rules (core.nonfinite_rows), or None.
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
                                   tanh=self.tanh, offset=self.offset)
        if poison is not None:
            s = s + poison[None, :]
        hidden = masked is not False or not self.folds_segments  # ids and mask apply
        mask = (self._load_broadcast("mask", spec.mask_shape, q0, k0, block_q, block_k)
                if p.has("mask") and hidden else None)
        if mask is not None and mask.dtype != jnp.bool_:  # int8 where Mosaic roles run too
            mask = mask != 0
        q_seg = kv_seg = None
        if p.has("q_segment_ids") and hidden:
            q_seg = self.refs["q_segment_ids"][self.b, pl.ds(q0, block_q)][:, None]
            kv_seg = self.refs["kv_segment_ids"][self.b, pl.ds(k0, block_k)][None, :]
        band_spec = spec if masked else dataclasses.replace(spec, is_causal=False,
                                                            local_window=None)
        # Rows past the query length and padded rows see nothing in masked tiles: a NaN
        # key must not reach dK/dV through them.
        visible = scores.visibility(
            rows, cols, band_spec, self.offset, mask=mask, q_segments=q_seg, kv_segments=kv_seg,
            q_length=self.q_length if masked else None,
            kv_length=self.kv_length if masked else None,
            q_bound=p.q_len if masked and p.q_pad != p.q_len else None,
            kv_bound=p.kv_len if masked and p.kv_pad != p.kv_len else None)
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
        return s, visible, cap_tanh

    def hide_keys(self, x: jax.Array, k0: Any) -> jax.Array:
        """x (a key or value tile from k0) with the rows past the key length zeroed: a
        key the caller hid (uninitialised cache memory, say) never meets a product,
        where 0 * NaN would poison the visible rows."""
        return _zero_rows_from(x, k0, self.kv_length)

    def hide_queries(self, x: jax.Array, q0: Any) -> jax.Array:
        """x (a query or output-gradient tile from q0) with rows past the query length
        zeroed, for the same reason."""
        return _zero_rows_from(x, q0, self.q_length)

    def key_limits(self, q0: Any, block_q: int) -> tuple[Any, Any] | None:
        """The keys that query rows [q0, q0 + block_q) can see (their segments, the mask)."""
        return self._limits("key_ranges", q0, block_q)

    def key_tiles_of(self, q0: Any, block_q: int, block_k: int
                     ) -> tuple[tuple[Any, Any, Any, Any], Any]:
        """(`key_tiles` of query rows [q0, q0 + block_q), whole): where folds_segments,
        the full tiles are those the rows see whole (`core.whole_tiles`), else whole
        is None."""
        limits = self.key_limits(q0, block_q)
        band = self.key_tiles(q0, q0 + block_q, block_k, limits)
        if not self.folds_segments:
            return band, None
        rows = pl.ds(q0, block_q)
        inner = (jnp.max(self.refs["key_ranges"][self.b, 2, rows]),
                 jnp.min(self.refs["key_ranges"][self.b, 3, rows]))
        return whole_tiles(band, self.key_tiles(q0, q0 + block_q, block_k, limits, inner))

    def hides_in_tile(self, masked: bool | None) -> bool:
        """Whether a key tile run with `masked` may hide a key from one of its rows."""
        return masked is not False or (self.p.has("key_ranges") and not self.folds_segments)

    def query_limits(self, k0: Any, block_k: int) -> tuple[Any, Any] | None:
        """The query rows that see keys [k0, k0 + block_k) (their segments, the mask)."""
        return self._limits("query_ranges", k0, block_k)

    def _limits(self, name: str, start: Any, size: int) -> tuple[Any, Any] | None:
        if name not in self.refs:
            return None
        lo = self.refs[name][self.b, 0, pl.ds(start, size)]
        hi = self.refs[name][self.b, 1, pl.ds(start, size)]
        return jnp.min(lo), jnp.max(hi)

    def keep(self, q0: Any, k0: Any, block_q: int, block_k: int) -> jax.Array:
        """Dropout keep decisions for the tile (same hash as the reference)."""
        if self.origin is not None:  # the mask of global positions
            q0, k0 = q0 + self.origin[0], k0 + self.origin[1]
        rows = q0 + lax.iota(jnp.int32, block_q)
        cols = k0 + lax.iota(jnp.int32, block_k)
        return dropout_lib.keep(dropout_lib.row_keys(self.drop_key, rows), cols,
                                self.p.spec.dropout_rate)

    def row_residuals(self, q0: Any, block_q: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(row_max, log2_sum, delta) of query rows [q0, q0 + block_q)."""
        rows = pl.ds(q0, block_q)
        return tuple(self.refs[name][self.b, self.n, rows]
                     for name in ("row_max", "log2_sum", "delta"))

    def score_gradient(self, q, k, v, do, residuals, q0, k0, masked, ds_factor=None,
                       row_terms: bool = False) -> tuple[jax.Array, ...]:
        """(dropped probabilities P~, score gradient dS) of one tile, float32, both
        divided by problem.dropout_scale: callers multiply what they accumulate from
        them by it once, at the end, instead of every score.

        residuals: row_residuals() of the tile's rows. P = exp(s - lse);
        dP~ = dO V^T; dP = dP~ * keep / (1 - rate); dS = P * (dP - delta) times the
        soft-cap derivative, computed as P * (dP~ * keep - delta * (1 - rate)).
        ds_factor: float16 dS's power of two for this key tile (`core.ds_scales`) or None;
        dS comes out times it. row_terms: also each row's sums of P * dP and of P times
        the soft-cap derivative, for dS's row sums (`dbias.dbias_kernel`).
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
        if ds_factor is not None:  # folded into dP - delta
            dp, delta = dp * ds_factor, delta * ds_factor
        slope = None if cap_tanh is None else scores.soft_cap_slope(cap_tanh)
        ds = prob * (dp - delta[:, None])
        if slope is not None:
            ds = ds * slope
        hides = self.hides_in_tile(masked)
        if hides:  # a hidden key's NaN value (in dP) gives exact zeros
            ds = jnp.where(prob == 0.0, 0.0, ds)
        if not row_terms:
            return dropped, ds
        terms = [prob * dp, prob if slope is None else prob * slope]
        if hides:
            terms = [jnp.where(prob == 0.0, 0.0, x) for x in terms]
        return dropped, ds, *(jnp.sum(x, axis=1) for x in terms)


# Tiles whose marks one repair program reads at once: almost every call has none
# marked, so the programs are few and each reads a long run of marks.
REPAIR_TILES = 64


def launch_repair(kernel: Callable[..., None], problem: Problem, role: str,
                  names: tuple[str, ...], inputs: list[jax.Array], results: list[jax.Array],
                  name: str) -> Any:
    """The role's repair kernel (its route's `repair`) over every tile of the rows the
    role owns (query tiles; key tiles of each kv head for "dkdv"), a run of `chunk` tiles
    per program (`repair_marked_tiles`): the role runs those tiles; names: the inputs',
    then the results' as inputs, then as outputs; the results (a Mosaic kernel's,
    [B, rows, ...] first) are rewritten in place."""
    route = problem.plan.route(role).repair
    keys = role == "dkdv"
    block = route.block_k if keys else route.block_q
    warps, stages = route.num_warps, route.num_stages
    problem = dataclasses.replace(problem, plan=dataclasses.replace(problem.plan,
                                                                    **{role: route}))
    B, rows = results[0].shape[:2]
    tiles = rows // block
    chunk = math.gcd(tiles, REPAIR_TILES)  # a power of two: whole blocks of marks
    first = len(inputs)
    heads = problem.num_kv_heads if keys else problem.num_heads
    return launch(kernel, problem, names, [*inputs, *results],
                  [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in results],
                  (tiles // chunk, B, heads), warps, stages, name,
                  aliases={first + i: i for i in range(len(results))}, chunk=chunk)


def repair_marked_tiles(marks: Callable[[Any], jax.Array], block: int, chunk: int,
                        repair_tile: Callable[[Any], None]) -> None:
    """A repair program's run of tiles of `block` rows (program 0 of the grid: the run's
    index): marks(rows) reads the marks of rows (a pl.ds); repair_tile(i) recomputes tile
    i. The run's marks are read at once; only a run holding a mark looks at its tiles."""
    first = pl.program_id(0) * chunk

    @pl.when(any_nan(marks(pl.ds(first * block, chunk * block))))
    def _marked_run():
        def tile(j, carry):
            i = first + j
            pl.when(any_nan(marks(pl.ds(i * block, block))))(lambda: repair_tile(i))
            return carry

        lax.fori_loop(0, chunk, tile, 0)


def any_nan(x: jax.Array) -> jax.Array:
    """Whether x holds a NaN (the Triton lowering has no boolean reductions)."""
    return jnp.max(jnp.isnan(x).astype(jnp.int32)) > 0


def _zero_rows_from(x: jax.Array, start: Any, length: Any) -> jax.Array:
    if length is None:
        return x
    rows = start + lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0)
    return jnp.where(rows < length, x, jnp.zeros_like(x))


def launch(kernel: Callable[..., None], problem: Problem, names: tuple[str, ...],
           inputs: list[jax.Array], outputs: list[jax.ShapeDtypeStruct], grid: tuple[int, ...],
           warps: int, stages: int, name: str, aliases: dict[int, int] | None = None,
           **params: Any) -> Any:
    """One pallas_call; names: the kernel's ref names, inputs then outputs; aliases: input
    index -> output index of the outputs written in place."""
    with int32_indices():
        return pl.pallas_call(
            functools.partial(kernel, problem=problem, names=names, **params),
            grid=grid,
            in_specs=whole_array_specs(inputs),
            out_specs=whole_array_specs(outputs),
            out_shape=varying_like(outputs, inputs),
            compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
            interpret=problem.interpret,
            input_output_aliases=aliases or {},
            name=name,
        )(*inputs)


def backward_inputs(q, k, v, optional, row_stats, do, delta, *, row_scales=None,
                    key_scales=None) -> tuple[tuple[str, ...], list]:
    """The backward kernels' ref names and operands; row_stats: the forward's (row_max,
    log2_sum); row_scales, key_scales: float16 dS's powers of two (`core.DsScales`) or
    None."""
    present = [x for x in KERNEL_INPUTS if x in optional]
    scaled = [(name, x) for name, x in (("row_scales", row_scales),
                                        ("key_scales", key_scales)) if x is not None]
    names = ("q", "k", "v", "do", "row_max", "log2_sum", "delta", *present,
             *(name for name, _ in scaled))
    return names, [q, k, v, do, *row_stats, delta, *(optional[x] for x in present),
                   *(x for _, x in scaled)]
