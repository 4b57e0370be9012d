"""The Pallas implementation: padding, and the jax.custom_vjp that runs a plan.

Sequence lengths are padded up to a multiple of every tile and head dims to the
plan's (`Plan.head_dims`: powers of two, or whole wgmma tiles where only Mosaic
kernels run); the kernels mask the padded keys and the padded rows are sliced off,
so callers never pad. Padding copies q, k, v only when a length is ragged or a head
dim is not the plan's: O(T) memory.

Residuals: the (padded) inputs, the output and the forward's per-row statistics
(row maximum and log2 of the row sum, kernels/core.py), not just the logsumexp.
Which kernel runs each role, with which tiles, is the plan's (dispatch.py); this
module only executes it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from pallas_attn.kernels import pad_axis
from pallas_attn.kernels.core import (
    KERNEL_INPUTS,
    LOG2E,
    Problem,
    bias_row_gradient,
    ds_scales,
    intersect_ranges,
    mask_ranges,
    segment_ranges,
)
from pallas_attn.kernels.mosaic import dbias as mosaic_dbias
from pallas_attn.kernels.mosaic import dkv as mosaic_dkv
from pallas_attn.kernels.mosaic import dq as mosaic_dq
from pallas_attn.kernels.mosaic import fwd as mosaic_fwd
from pallas_attn.kernels.mosaic.common import (
    dropout_of,
    lengths_of,
    mask_of,
    origin_of,
    row_residuals,
    segments_of,
)
from pallas_attn.kernels.triton import dbias as triton_dbias
from pallas_attn.kernels.triton import decode as triton_decode
from pallas_attn.kernels.triton import dkdv as triton_dkdv
from pallas_attn.kernels.triton import dq as triton_dq
from pallas_attn.kernels.triton import fwd as triton_fwd
from pallas_attn.kernels.triton import rows as triton_rows
from pallas_attn.kernels.triton.context import backward_inputs
from pallas_attn.plan import Plan
from pallas_attn.primals import first_order_only, is_perturbed, primal_values
from pallas_attn.semantics import reference, scores
from pallas_attn.sharding import per_shard
from pallas_attn.spec import OPTIONAL_INPUTS, AttentionSpec, Operands


def prepare(spec: AttentionSpec, ops: Operands, plan: Plan):
    """(problem, q, k, v, differentiable, optional): padded operands and their Problem
    (q keeps its T rows where the decode kernel runs the forward)."""
    if _mosaic_roles(plan) and (ops.query_seq_lengths is not None
                                or ops.key_value_seq_lengths is not None):
        # The Mosaic kernels bulk-copy whole tiles, so positions past a length are zeroed
        # here (fused with the padding), as the Triton kernels zero them in tiles.
        ops = reference.hide_past_lengths(ops)
    q, k, v = ops.query, ops.key, ops.value
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[-1]
    # The decode kernel's tiles are rows of tokens x heads over a cache read in place:
    # only the backward's tiles pad T and S (and the bias and mask with them).
    routes = [*(() if plan.forward.backend == "decode" else (plan.forward,)), plan.dkdv,
              plan.dq, *(() if plan.dbias is None else (plan.dbias,))]
    q_tile = max(route.block_q for route in routes)
    # Power-of-two tiles only: a 96-key forward tile past the padding reads zeros it hides.
    kv_tile = max(route.block_k for route in routes if route.block_k & (route.block_k - 1) == 0)
    q_pad = -(-T // q_tile) * q_tile
    kv_pad = -(-S // kv_tile) * kv_tile
    hp, hvp = plan.head_dims

    optional = {name: getattr(ops, name) for name in OPTIONAL_INPUTS
                if getattr(ops, name) is not None}
    if "mask" in optional and _mosaic_roles(plan):
        # The Mosaic kernels read the mask as int8 (mask_of): converted once per call,
        # with the padding, for the forward and the backward alike.
        optional["mask"] = mask_of(optional)
    for name, fill in (("bias", 0), ("mask", False)):
        if name in optional:
            x = optional[name]
            x = pad_axis(x, 2, q_pad, fill) if x.shape[2] > 1 else x
            optional[name] = pad_axis(x, 3, kv_pad, fill) if x.shape[3] > 1 else x
    if "q_segment_ids" in optional:
        optional["q_segment_ids"] = pad_axis(optional["q_segment_ids"], 1, q_pad)
        optional["kv_segment_ids"] = pad_axis(optional["kv_segment_ids"], 1, kv_pad)
        # Packed sequences: the Triton kernels skip the key tiles outside each query
        # tile's segments, and the query tiles outside each key tile's.
        optional["key_ranges"], optional["query_ranges"] = segment_ranges(
            optional["q_segment_ids"], optional["kv_segment_ids"], T, S,
            same=ops.kv_segment_ids is ops.q_segment_ids)
    if ops.mask is not None:
        # A mask's tiles outside each row's first-to-last visible key hold nothing the
        # row sees: every kernel skips them, as it skips other segments' tiles.
        ranges = mask_ranges(ops.mask, B, T, S, q_pad, kv_pad)
        for name, r in zip(("key_ranges", "query_ranges"), ranges, strict=True):
            optional[name] = intersect_ranges(optional[name], r) if name in optional else r

    problem = Problem(
        spec=spec, batch=B, num_heads=N, num_kv_heads=K, q_len=T, kv_len=S, q_pad=q_pad,
        kv_pad=kv_pad, head_dim=H, value_head_dim=Hv, dtype=jnp.dtype(q.dtype).name,
        plan=plan, present=tuple(optional), interpret=plan.interpret)
    differentiable = {name: optional.pop(name) for name in ("bias", "sinks") if name in optional}
    if plan.forward.backend == "decode":
        # The decode kernel gathers its rows from the T queries and reads the cache in
        # place (padding it would copy it on every step); the backward pads them.
        return problem, pad_axis(q, 3, hp), k, v, differentiable, optional
    qp = pad_axis(pad_axis(q, 1, q_pad), 3, hp)
    kp = pad_axis(pad_axis(k, 1, kv_pad), 3, hp)
    vp = pad_axis(pad_axis(v, 1, kv_pad), 3, hvp)
    return problem, qp, kp, vp, differentiable, optional


def attention(spec: AttentionSpec, ops: Operands, plan: Plan) -> tuple[jax.Array, jax.Array]:
    """Canonical-layout attention through the plan's kernels: (out [B,T,N,Hv], lse [B,N,T])."""
    problem, qp, kp, vp, differentiable, optional = prepare(spec, ops, plan)
    try:
        out, lse = _fused(problem, qp, kp, vp, differentiable, optional)
    except NotImplementedError as error:
        if "symbolic_zeros" not in str(error):
            raise
        raise ValueError(
            "implementation='pallas' inside jax.shard_map needs the shard_map under "
            "jax.jit (its custom_vjp does not run in shard_map's eager mode)") from None
    T, Hv = ops.query.shape[1], ops.value.shape[-1]
    # Public: -inf for rows that see no key; with sinks, the head's sink (the kernels mark
    # rows past a query length +inf even then, so that the backward skips them).
    empty = -jnp.inf if ops.sinks is None else ops.sinks[None, :, None]
    lse = jnp.where(lse == jnp.inf, empty, lse)[:, :, :T]
    return out[:, :T, :, :Hv], lse


def gradients(spec: AttentionSpec, ops: Operands, plan: Plan, out: jax.Array, lse: jax.Array,
              d_out: jax.Array, d_lse: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) of a call whose keys are one block of a larger softmax (ring
    attention): out [B, T, N, Hv] and lse [B, N, T] are the whole softmax's, d_out and
    d_lse their cotangents. No bias; ALiBi slopes are constants."""
    problem, qp, kp, vp, differentiable, optional = prepare(spec, ops, plan)
    if differentiable:
        raise AssertionError("vjp.gradients takes no bias and no sinks")
    B, T, N, H = ops.query.shape
    S, Hv = ops.key.shape[1], ops.value.shape[-1]
    delta, do_norms = _row_sums(problem, d_out, out, _scales_ds(problem, False))
    if do_norms is not None:
        optional = {**optional, "do_norms": do_norms}
    if d_lse is not None:
        delta = delta - jnp.where(lse == -jnp.inf, 0.0, d_lse)
    # The whole softmax's lse as the row statistics: row maximum lse (in the problem's
    # units), row sum 1; +inf for rows that see no key anywhere.
    units = LOG2E if problem.exp2_factor == 1.0 else 1.0
    row_max = pad_axis(jnp.where(lse == -jnp.inf, jnp.inf, lse * units), 2, problem.q_pad,
                        jnp.inf)
    row_stats = (row_max, jnp.zeros_like(row_max))
    do = pad_axis(pad_axis(d_out.astype(ops.query.dtype), 1, problem.q_pad), 3,
                   plan.head_dims[1])
    dq, dk, dv, _ = _backward((problem, False), qp, kp, vp, optional, row_stats, do,
                              pad_axis(delta, 2, problem.q_pad))
    return dq[:, :T, :, :H], dk[:, :S, :, :H], dv[:, :S, :, :Hv]


def _operands(differentiable: dict, optional: dict) -> dict:
    return {**optional, **differentiable}


# Dimension names of the kernels' operands and results (sharding.py).
_OPERAND_DIMS = {"bias": "b n t s", "mask": "b n t s", "alibi_slopes": "b n",
                 "q_segment_ids": "b t", "kv_segment_ids": "b s", "query_seq_lengths": "b",
                 "key_value_seq_lengths": "b", "dropout_keys": "b n", "origin": "_",
                 "sinks": "n", "key_ranges": "b _ t", "query_ranges": "b _ s"}


def _operand_labels(problem: Problem) -> dict[str, str]:
    spec = problem.spec
    shapes = {"bias": spec.bias_shape, "mask": spec.mask_shape,
              "dropout_keys": (1, 1) if spec.broadcast_dropout else None}

    def label(name: str) -> str:
        dims = _OPERAND_DIMS[name].split()
        shape = shapes.get(name)
        return " ".join(d if shape is None or shape[i] > 1 else "_" for i, d in enumerate(dims))

    return {name: label(name) for name in KERNEL_INPUTS if problem.has(name)}


def _localize(problem: Problem, q, k, operands: dict) -> Problem:
    """The Problem of one shard: its batch entries and heads (and broadcast shapes)."""
    spec = problem.spec
    if spec.has_bias:
        spec = dataclasses.replace(spec, bias_shape=tuple(operands["bias"].shape))
    if spec.has_mask:
        spec = dataclasses.replace(spec, mask_shape=tuple(operands["mask"].shape))
    return dataclasses.replace(problem, spec=spec, batch=q.shape[0], num_heads=q.shape[2],
                               num_kv_heads=k.shape[2])


def _run_forward(problem: Problem, q, k, v, operands: dict):
    backend = {"mosaic": mosaic_fwd, "decode": triton_decode}.get(
        problem.plan.forward.backend, triton_fwd)
    out, row_stats = backend.forward(problem, q, k, v, operands)
    if problem.plan.forward.repair is not None:  # rows a hidden NaN key reached
        # In place at any head dim (`triton.context.head_tile`): a lax.cond on the marks
        # would stop the host on every call to read them (docs/decisions.md).
        out, row_stats = triton_fwd.repair(problem, q, k, v, operands, out, row_stats)
    return out, row_stats


def _mosaic_roles(plan: Plan) -> bool:
    """Whether any role of the plan runs a Mosaic kernel."""
    routes = (plan.forward, plan.dq, plan.dkdv, plan.dbias)
    return any(r is not None and r.backend == "mosaic" for r in routes)


def _interprets_mosaic(problem: Problem) -> bool:
    """The Mosaic GPU interpreter simulates barriers with ordered host callbacks, which
    a custom partitioning cannot lower: interpreted Mosaic kernels run unpartitioned."""
    return problem.interpret and _mosaic_roles(problem.plan)


_forward = per_shard(
    _run_forward,
    lambda problem: (("b t n h", "b s k h", "b s k v", _operand_labels(problem)),
                     ("b t n v", ("b n t", "b n t"))),
    lambda problem, arrays: _localize(problem, arrays[0], arrays[1], arrays[3]),
    _interprets_mosaic)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(problem: Problem, q, k, v, differentiable: dict, optional: dict):
    out, row_stats = _forward(problem, q, k, v, _operands(differentiable, optional))
    return out, problem.logsumexp(*row_stats)


def _fused_fwd(problem: Problem, q, k, v, differentiable, optional):
    if is_perturbed(optional.get("alibi_slopes")):
        raise NotImplementedError(
            "the Pallas kernels treat alibi_slopes as constants and do not differentiate "
            "them; wrap them in jax.lax.stop_gradient or use implementation='xla'")
    bias_grad = is_perturbed(differentiable.get("bias"))
    q, k, v, differentiable, optional = first_order_only(
        primal_values((q, k, v, differentiable, optional)), "implementation='pallas'")
    out, row_stats = _forward(problem, q, k, v, _operands(differentiable, optional))
    # The pytree structure of this marker carries the static "bias needs a gradient".
    marker = (jnp.zeros((), jnp.int8),) if bias_grad else ()
    residuals = (q, k, v, differentiable, optional, out, row_stats, marker)
    return (out, problem.logsumexp(*row_stats)), residuals


def _zeros_like_tangent(x: jax.Array) -> Any:
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros_like(x)
    return jnp.zeros(x.shape, jax.dtypes.float0)


def _fused_bwd(problem: Problem, residuals, cotangents):
    q, k, v, differentiable, optional, out, row_stats, marker = first_order_only(
        residuals, "implementation='pallas'")
    d_out, d_lse = cotangents
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(out.shape, out.dtype)
    bias_grad = bool(marker)
    delta, do_norms = _row_sums(problem, d_out, out, _scales_ds(problem, bias_grad))
    query_lengths, origin = lengths_of(optional)[0], origin_of(optional)
    if query_lengths is not None:  # the caller's dO past them is hidden, whatever it holds
        start = 0 if origin is None else origin[0]
        delta = reference.hide_past(delta.swapaxes(1, 2), query_lengths, start).swapaxes(1, 2)
    lse_grad = jnp.zeros_like(delta)
    if not isinstance(d_lse, SymbolicZero):
        # d lse / d logits = P, so an lse cotangent folds into delta as -d_lse (rows
        # that see no key, row max +inf, have P = 0 and their cotangent is dropped).
        lse_grad = jnp.where(row_stats[0] == jnp.inf, 0.0, d_lse)
        delta = delta - lse_grad
    operands = _operands(differentiable, optional)
    if do_norms is not None:
        operands["do_norms"] = do_norms
    if _sums_score_rows(problem, bias_grad):
        operands["lse_grad"] = lse_grad
    d_out = d_out.astype(q.dtype)
    dq, dk, dv, dbias = _backward((problem, bias_grad), q, k, v, operands, row_stats, d_out,
                                  delta)
    d_differentiable = jax.tree.map(jnp.zeros_like, differentiable)
    if dbias is not None:
        d_differentiable["bias"] = dbias
    if "sinks" in differentiable:
        d_differentiable["sinks"] = scores.sink_gradient(
            differentiable["sinks"], problem.logsumexp(*row_stats), delta,
            total=functools.partial(row_total, problem.interpret))
    d_optional = jax.tree.map(_zeros_like_tangent, optional)
    return dq, dk, dv, d_differentiable, d_optional


def _run_backward(static: tuple[Problem, bool], q, k, v, operands: dict, row_stats, do, delta):
    """(dq, dk, dv, dbias or None) for padded inputs, each role on the plan's backend;
    q, dO and the row statistics may hold only the T rows of a decoded forward (dq comes
    back at q's rows). static: (problem, whether the bias needs a gradient)."""
    problem, bias_grad = static
    plan = problem.plan
    # A decoded forward leaves q, its output and row statistics at T rows and K, V as
    # the caller's: padded here, and the gradients returned at their shapes.
    rows, keys, hk, hv = q.shape[1], k.shape[1], k.shape[3], v.shape[3]
    hp, hvp = plan.head_dims
    q, do = (pad_axis(x, 1, problem.q_pad) for x in (q, do))
    k = pad_axis(pad_axis(k, 1, problem.kv_pad), 3, hp)
    v = pad_axis(pad_axis(v, 1, problem.kv_pad), 3, hvp)
    row_stats = (pad_axis(row_stats[0], 2, problem.q_pad, jnp.inf),
                 pad_axis(row_stats[1], 2, problem.q_pad))
    delta = pad_axis(delta, 2, problem.q_pad)
    bias = operands.get("bias")
    fused = bias_grad and plan.dbias.fused
    in_dq = bias_grad and plan.dbias.in_dq
    separate_dbias = bias_grad and not fused and not in_dq
    lengths = lengths_of(operands)
    origin = origin_of(operands)
    scales = None
    if _scales_ds(problem, bias_grad):
        do_norms = pad_axis(operands["do_norms"], 2, problem.q_pad)
        v_norms = jnp.sqrt(fixed_sums(problem.interpret, v, v))
        scales = ds_scales(problem, do_norms, v_norms, delta, lengths, origin)
    row_scales, key_scales = (None, None) if scales is None else scales
    names, inputs = backward_inputs(q, k, v, operands, row_stats, do, delta,
                                    row_scales=row_scales, key_scales=key_scales)
    mosaic_roles = [plan.dq.backend, plan.dkdv.backend,
                    plan.dbias.backend if separate_dbias else None]
    stats = row_residuals(row_stats, delta) if "mosaic" in mosaic_roles else None
    dq_stats = stats
    if row_scales is not None and plan.dq.backend == "mosaic":
        dq_stats = row_residuals(row_stats, delta, row_scales)
    slopes = operands.get("alibi_slopes")
    dropout_keys = dropout_of(operands)
    if lengths[0] is not None and "mosaic" in (plan.dq.backend, plan.dkdv.backend):
        # dO too: the Mosaic kernels read whole tiles of it (P = 0 past the length).
        do = reference.hide_past(do, lengths[0], 0 if origin is None else origin[0])
    mask = mask_of(operands) if "mosaic" in (plan.dq.backend, plan.dkdv.backend) else None
    dq_segments = (segments_of(operands, "key_ranges")
                   if plan.dq.backend == "mosaic" else ())
    dkv_segments = (segments_of(operands, "query_ranges")
                    if plan.dkdv.backend == "mosaic" else ())
    # Both Mosaic kernels and a fused dbias of a bias shared by the batch entries: the
    # dQ kernel stores batch entry 0's dS tiles as dbias, the dK/dV kernel adds the
    # others' to them (no zeroed buffer to start from).
    dbias_first = score_rows = None
    if plan.dq.backend == "mosaic":
        if plan.dkdv.backend == "mosaic" and mosaic_dkv.sums_batch(problem, fused):
            dq, dbias_first, marks = mosaic_dq.dq_and_dbias(
                problem, q, k, v, do, stats, bias, slopes, dq_segments, lengths, dropout_keys,
                mask, origin)
        elif in_dq:
            dq, score_rows, marks = mosaic_dq.dq_and_score_rows(
                problem, q, k, v, do, stats, bias, slopes, dq_segments, lengths, dropout_keys,
                mask, origin)
        else:
            dq, marks = mosaic_dq.dq(problem, q, k, v, do, dq_stats, bias, slopes,
                                     dq_segments, lengths, dropout_keys, mask, origin)
        if plan.dq.repair is not None:  # rows a hidden non-finite key or value reached
            dq = triton_dq.repair(problem, names, inputs, dq, marks)
    else:
        dq = triton_dq.dq(problem, names, inputs)
    if plan.dkdv.backend == "mosaic":
        dk, dv, dbias, marks = mosaic_dkv.dkdv(problem, q, k, v, do, stats, bias, fused,
                                               slopes, dbias_first, dkv_segments, lengths,
                                               dropout_keys, mask, origin, key_scales)
        if marks is not None:  # keys a NaN row or a hidden non-finite value reached
            dk, dv = triton_dkdv.repair(problem, names, inputs, dk, dv, marks)
    else:
        dk, dv, dbias = triton_dkdv.dkdv(problem, names, inputs, bias if fused else None)
    if in_dq:
        dbias = _bias_from_rows(problem, score_rows, delta,
                                pad_axis(operands["lse_grad"], 2, problem.q_pad), bias,
                                row_stats[0])
    if separate_dbias and plan.dbias.backend == "mosaic":
        dbias = mosaic_dbias.dbias(problem, q, k, v, do, stats, bias, slopes)
    elif separate_dbias:
        extra = {}
        if _sums_score_rows(problem, bias_grad):
            extra["lse_grad"] = pad_axis(operands["lse_grad"], 2, problem.q_pad)
        dbias = triton_dbias.dbias(problem, (*names, *extra), [*inputs, *extra.values()], bias)
    return dq[:, :rows], dk[:, :keys, :, :hk], dv[:, :keys, :, :hv], dbias


def _bias_from_rows(problem: Problem, score_rows: jax.Array, delta: jax.Array,
                    lse_grad: jax.Array, bias: jax.Array, row_max: jax.Array) -> jax.Array:
    """dbias of a bias broadcast along keys ([B or 1, N or 1, Tp or 1, 1]) from the Mosaic
    dQ kernel's row sums (`mosaic.dq.dq_and_score_rows`), summed over the bias's broadcast
    axes in a fixed order (`fixed_sums`). Without a cap the kernel stores no
    sum P dP: it is sum dS + delta sum P. A row that sees no key (row_max +inf: past the
    query length, say) gets 0, whatever its hidden bias entry held."""
    sums = jnp.sum(score_rows, axis=2)  # wide consumers' keys apart
    ds_sum, p_slope = sums[:, :, 0], sums[:, :, 1]
    kept = 1.0 - problem.spec.dropout_rate  # dS's units (gain_later)
    p_dp = sums[:, :, 2] if sums.shape[2] == 3 else ds_sum + delta * kept * p_slope
    rows = (bias_row_gradient(problem, ds_sum, p_dp, p_slope, delta, lse_grad)
            * problem.dropout_scale)
    rows = jnp.where(row_max == jnp.inf, 0.0, rows)
    B, N, Tp = rows.shape
    Bb, Nb, Tb, _ = bias.shape
    rows = rows.reshape(Bb, B // Bb, Nb, N // Nb, Tp)
    # [Bb, Tb, Nb, the entries each dbias entry sums] for `fixed_sums`
    rows = (rows.transpose(0, 4, 2, 1, 3).reshape(Bb, Tp, Nb, -1) if Tb > 1
            else rows.transpose(0, 2, 1, 3, 4).reshape(Bb, 1, Nb, -1))
    return fixed_sums(problem.interpret, rows)[..., None].astype(bias.dtype)


def fixed_sums(interpret: bool, x: jax.Array, y: jax.Array | None = None) -> jax.Array:
    """[B, H, L] float32: x [B, L, H, D]'s row sums over D of x * y (x alone without y).
    On a GPU a kernel of its own sums them in one order (`triton.rows`); XLA:CPU, which
    runs the interpreters, always sums in one order."""
    if not interpret:
        return triton_rows.row_sums(x, y)
    x = x.astype(jnp.float32)
    return jnp.sum(x if y is None else x * y.astype(jnp.float32), axis=-1).swapaxes(1, 2)


def _row_sums(problem: Problem, d_out: jax.Array, out: jax.Array, norms: bool
              ) -> tuple[jax.Array, jax.Array | None]:
    """(delta = rowsum(dO * O), |dO| per row or None) [B, N, T] float32, the backward's
    preprocessing."""
    delta = fixed_sums(problem.interpret, d_out, out)
    return delta, jnp.sqrt(fixed_sums(problem.interpret, d_out, d_out)) if norms else None


def row_total(interpret: bool, terms: jax.Array) -> jax.Array:
    """[N]: terms [B, N, T] summed over B and T (`fixed_sums`)."""
    B, N, T = terms.shape
    return fixed_sums(interpret, terms.transpose(1, 0, 2).reshape(1, N, 1, B * T))[0, 0]


def _scales_ds(problem: Problem, bias_grad: bool) -> bool:
    """Whether the backward scales dS by powers of two (`core.ds_scales`): float16 dS
    rounds to float16 for its products and could pass 65504; not with a bias gradient,
    whose dS is the float16 dbias itself (as in the reference)."""
    return problem.dtype == "float16" and not bias_grad


def _sums_score_rows(problem: Problem, bias_grad: bool) -> bool:
    """Whether the bias gradient sums dS along keys (a bias [..., T or 1, 1]): the dbias
    kernel then takes the lse cotangent apart from delta (`dbias.dbias_kernel`)."""
    return bias_grad and problem.spec.bias_shape[-1] == 1


def _backward_labels(static: tuple[Problem, bool]):
    problem, bias_grad = static
    operands = _operand_labels(problem)
    if _scales_ds(problem, bias_grad):
        operands["do_norms"] = "b n t"
    if _sums_score_rows(problem, bias_grad):
        operands["lse_grad"] = "b n t"
    args = ("b t n h", "b s k h", "b s k v", operands, ("b n t", "b n t"), "b t n v", "b n t")
    return args, ("b t n h", "b s k h", "b s k v", operands["bias"] if bias_grad else None)


_backward = per_shard(
    _run_backward, _backward_labels,
    lambda static, arrays: (_localize(static[0], arrays[0], arrays[1], arrays[3]), static[1]),
    lambda static: _interprets_mosaic(static[0]))

_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)
