"""The Pallas implementation: tile choice, padding and the jax.custom_vjp.

Sequence lengths are padded up to a multiple of every tile and head dims to a
power of two (Triton tiles are powers of two); the kernels mask the padded keys
and the padded rows are sliced off, so callers never pad. Padding copies q, k, v
only when a length is ragged or a head dim is not a power of two: O(T) memory.

Residuals: the (padded) inputs, the output and the forward's per-row statistics
(row maximum and log2 of the row sum, kernels/common.py), not just the logsumexp.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from pallas_attn import tuning
from pallas_attn.kernels import (
    mosaic_common,
    mosaic_dbias,
    mosaic_dkv,
    mosaic_dq,
    mosaic_fwd,
    triton_bwd,
    triton_fwd,
)
from pallas_attn.kernels.common import OPTIONAL_INPUTS, Problem
from pallas_attn.spec import AttentionSpec, Operands
from pallas_attn.tuning import BlockSizes, DeviceInfo
from pallas_attn.vjp import is_perturbed, primal_values


def _pad_axis(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def resolve_block_sizes(spec: AttentionSpec, ops: Operands, block_sizes: BlockSizes | None,
                        interpret: bool) -> BlockSizes:
    B, T, N, H = ops.query.shape
    S, Hv = ops.key.shape[1], ops.value.shape[-1]
    device = DeviceInfo() if interpret else DeviceInfo.current()
    smem = dict(bias_dtype=None if ops.bias is None else ops.bias.dtype,
                has_mask=ops.mask is not None)
    if block_sizes is None:
        # NOTE: the interpreter runs the Triton forward unless block_sizes ask for the
        # Mosaic one: interpreting it is slower, and its tests ask for it explicitly.
        present = tuple(name for name in OPTIONAL_INPUTS if getattr(ops, name) is not None)
        mosaic_scores = not interpret and not mosaic_common.unsupported_scores(spec, present)
        features = dict(smem, is_causal=spec.is_causal, has_bias=spec.has_bias,
                        has_dropout=spec.has_dropout, has_window=spec.local_window is not None,
                        has_soft_cap=spec.logits_soft_cap is not None,
                        mosaic_scores=mosaic_scores)
        block_sizes = tuning.choose_block_sizes(H, ops.query.dtype, q_len=T, kv_len=S,
                                                value_head_dim=Hv, device=device, **features)
    elif not interpret:
        tuning.check_fits(block_sizes, H, Hv, ops.query.dtype, device, **smem)
        for field in ("forward_backend", "dbias_backend", "dkv_backend", "dq_backend"):
            if getattr(block_sizes, field) == "mosaic" and device.compute_capability != (9, 0):
                raise ValueError(
                    f"block_sizes.{field}='mosaic' needs an sm90 (Hopper) GPU, this one "
                    f"has compute capability {device.compute_capability}")
    if ops.bias is not None:
        block_sizes = tuning.resolve_fuse_dbias(block_sizes, ops.bias.shape, batch=B,
                                                num_heads=N, num_kv_heads=ops.key.shape[2],
                                                kv_len=S, device=device,
                                                bias_dtype=ops.bias.dtype, dtype=ops.query.dtype)
    return block_sizes


def prepare(spec: AttentionSpec, ops: Operands, blocks: BlockSizes, interpret: bool):
    """(problem, q, k, v, differentiable, optional): padded operands and their Problem."""
    q, k, v = ops.query, ops.key, ops.value
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[-1]
    kernels = ("forward", "dkdv", "dq", *(("dbias",) if ops.bias is not None else ()))
    q_tile = max(blocks.tiles(kernel)[0] for kernel in kernels)
    kv_tile = max(blocks.tiles(kernel)[1] for kernel in kernels)
    q_pad = tuning.ceil_div(T, q_tile) * q_tile
    kv_pad = tuning.ceil_div(S, kv_tile) * kv_tile
    hp, hvp = tuning.padded_head_dim(H), tuning.padded_head_dim(Hv)

    optional = {name: getattr(ops, name) for name in OPTIONAL_INPUTS
                if getattr(ops, name) is not None}
    for name, fill in (("bias", 0), ("mask", False)):
        if name in optional:
            x = optional[name]
            x = _pad_axis(x, 2, q_pad, fill) if x.shape[2] > 1 else x
            optional[name] = _pad_axis(x, 3, kv_pad, fill) if x.shape[3] > 1 else x
    if "q_segment_ids" in optional:
        optional["q_segment_ids"] = _pad_axis(optional["q_segment_ids"], 1, q_pad)
        optional["kv_segment_ids"] = _pad_axis(optional["kv_segment_ids"], 1, kv_pad)

    problem = Problem(
        spec=spec, batch=B, num_heads=N, num_kv_heads=K, q_len=T, kv_len=S, q_pad=q_pad,
        kv_pad=kv_pad, head_dim=H, value_head_dim=Hv, dtype=jnp.dtype(q.dtype).name,
        blocks=blocks, present=tuple(optional), interpret=interpret)
    differentiable = {"bias": optional.pop("bias")} if "bias" in optional else {}
    qp = _pad_axis(_pad_axis(q, 1, q_pad), 3, hp)
    kp = _pad_axis(_pad_axis(k, 1, kv_pad), 3, hp)
    vp = _pad_axis(_pad_axis(v, 1, kv_pad), 3, hvp)
    return problem, qp, kp, vp, differentiable, optional


def attention(spec: AttentionSpec, ops: Operands, *, block_sizes: BlockSizes | None = None,
              interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Canonical-layout attention through the kernels: (out [B,T,N,Hv], lse [B,N,T])."""
    blocks = resolve_block_sizes(spec, ops, block_sizes, interpret)
    problem, qp, kp, vp, differentiable, optional = prepare(spec, ops, blocks, interpret)
    if blocks.forward_backend == "mosaic" and (why := mosaic_common.unsupported(problem)):
        raise ValueError(f"block_sizes.forward_backend='mosaic' does not cover this call: {why}")
    if _mosaic_dbias(problem) and (why := mosaic_dbias.unsupported(problem)):
        raise ValueError(f"block_sizes.dbias_backend='mosaic' does not cover this call: {why}")
    if blocks.dkv_backend == "mosaic" and (why := mosaic_dkv.unsupported(problem)):
        raise ValueError(f"block_sizes.dkv_backend='mosaic' does not cover this call: {why}")
    if blocks.dq_backend == "mosaic" and (why := mosaic_dq.unsupported(problem)):
        raise ValueError(f"block_sizes.dq_backend='mosaic' does not cover this call: {why}")
    out, lse = _fused(problem, qp, kp, vp, differentiable, optional)
    T, Hv = ops.query.shape[1], ops.value.shape[-1]
    lse = jnp.where(lse == jnp.inf, -jnp.inf, lse)[:, :, :T]  # public: -inf for empty rows
    return out[:, :T, :, :Hv], lse


def _mosaic_dbias(problem: Problem) -> bool:
    """Whether a separate dbias kernel runs, and it is the Mosaic one."""
    blocks = problem.blocks
    return (problem.has("bias") and blocks.dbias_backend == "mosaic"
            and not blocks.fuse_dbias)


def _operands(differentiable: dict, optional: dict) -> dict:
    return {**optional, **differentiable}


def _forward(problem: Problem, q, k, v, operands: dict):
    backend = mosaic_fwd if problem.blocks.forward_backend == "mosaic" else triton_fwd
    return backend.forward(problem, q, k, v, operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(problem: Problem, q, k, v, differentiable: dict, optional: dict):
    out, row_stats = _forward(problem, q, k, v, _operands(differentiable, optional))
    return out, problem.logsumexp(*row_stats)


def _fused_fwd(problem: Problem, q, k, v, differentiable, optional):
    if is_perturbed(optional.get("alibi_slopes")):
        raise NotImplementedError(
            "the Pallas kernels treat alibi_slopes as constants and do not differentiate "
            "them; wrap them in jax.lax.stop_gradient or use implementation='xla'")
    bias_grad = is_perturbed(differentiable)
    q, k, v, differentiable, optional = primal_values((q, k, v, differentiable, optional))
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
    q, k, v, differentiable, optional, out, row_stats, marker = residuals
    d_out, d_lse = cotangents
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(out.shape, out.dtype)
    delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    if not isinstance(d_lse, SymbolicZero):
        # d lse / d logits = P, so an lse cotangent folds into delta as -d_lse (rows
        # that see no key, row max +inf, have P = 0 and their cotangent is dropped).
        delta = delta - jnp.where(row_stats[0] == jnp.inf, 0.0, d_lse)
    operands = _operands(differentiable, optional)
    d_out = d_out.astype(q.dtype)
    bias_grad = bool(marker)
    dq, dk, dv, dbias = _backward(problem, q, k, v, operands, row_stats, d_out, delta,
                                  bias_grad)
    d_differentiable = {"bias": dbias} if dbias is not None else jax.tree.map(
        jnp.zeros_like, differentiable)
    d_optional = jax.tree.map(_zeros_like_tangent, optional)
    return dq, dk, dv, d_differentiable, d_optional


def _backward(problem: Problem, q, k, v, operands: dict, row_stats, do, delta,
              bias_grad: bool):
    """(dq, dk, dv, dbias or None) for padded inputs from the backends the tiles name."""
    blocks = problem.blocks
    bias = operands.get("bias")
    fused = bias_grad and bool(blocks.fuse_dbias)
    names, inputs = triton_bwd.backward_inputs(q, k, v, operands, row_stats, do, delta)
    mosaic_dbias_kernel = bias_grad and not fused and _mosaic_dbias(problem)
    stats = (mosaic_common.row_residuals(row_stats, delta)
             if "mosaic" in (blocks.dkv_backend, blocks.dq_backend) or mosaic_dbias_kernel
             else None)
    slopes = operands.get("alibi_slopes")
    # Both Mosaic kernels and a fused dbias of a bias shared by the batch entries: the
    # dQ kernel stores batch entry 0's dS tiles as dbias, the dK/dV kernel adds the
    # others' to them (no zeroed buffer to start from).
    dbias_first = None
    if blocks.dq_backend == "mosaic":
        if blocks.dkv_backend == "mosaic" and mosaic_dkv.sums_batch(problem, bias, fused):
            dq, dbias_first = mosaic_dq.dq_and_dbias(problem, q, k, v, do, stats, bias, slopes)
        else:
            dq = mosaic_dq.dq(problem, q, k, v, do, stats, bias, slopes)
    else:
        dq = triton_bwd.dq(problem, names, inputs)
    if blocks.dkv_backend == "mosaic":
        dk, dv, dbias = mosaic_dkv.dkdv(problem, q, k, v, do, stats, bias, fused, slopes,
                                        dbias_first)
    else:
        dk, dv, dbias = triton_bwd.dkdv(problem, names, inputs, bias if fused else None)
    if mosaic_dbias_kernel:
        dbias = mosaic_dbias.dbias(problem, q, k, v, do, stats, bias, slopes)
    elif bias_grad and not fused:
        dbias = triton_bwd.dbias(problem, names, inputs, bias)
    return dq, dk, dv, dbias


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)
