"""Context parallelism: ring attention over a mesh axis that splits the sequence.

Called inside jax.shard_map, each device holds a slice of the queries, keys and
values. K/V blocks travel around the ring (lax.ppermute) while the local queries
attend to the block at hand; the partial results merge through their logsumexp
(the online softmax, one block at a time). Positions are global: each block call
carries its origin (the global positions of its first query and key), so causal,
window, ALiBi, lengths and dropout mean what they mean in dot_product_attention
on the gathered arrays. The backward sends dK/dV around the ring with their block
and returns them home. No device holds more than two K/V blocks (the one in use
and the one arriving).

Layouts: "contiguous" (device i holds positions [i c, (i + 1) c)) and "zigzag"
(device i holds chunks i and 2P - 1 - i of 2P equal chunks, so that every device
does the same causal work). Blocks that the causal/window band hides entirely are
not computed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from pallas_attn import dispatch, sharding
from pallas_attn.plan import BlockSizes
from pallas_attn.primals import first_order_only, is_perturbed, primal_values
from pallas_attn.semantics import chunked, reference, scores
from pallas_attn.spec import AttentionSpec, Operands, check_bool, normalize, static_int

LAYOUTS = ("contiguous", "zigzag")
RING_IMPLEMENTATIONS = ("pallas", "xla_chunked")


def zigzag(x: jax.Array, num_devices: int, axis: int = 1) -> jax.Array:
    """Reorders a global array's `axis` into the zigzag layout: of 2P equal chunks,
    device i's slice holds chunks i and 2P - 1 - i (split the result evenly over P)."""
    chunks = _chunks(x, num_devices, axis)
    order = [c for i in range(num_devices) for c in (i, 2 * num_devices - 1 - i)]
    return jnp.concatenate([chunks[c] for c in order], axis=axis)


def unzigzag(x: jax.Array, num_devices: int, axis: int = 1) -> jax.Array:
    """The inverse of `zigzag`: global order from the zigzag layout."""
    chunks = _chunks(x, num_devices, axis)
    order = [c for i in range(num_devices) for c in (i, 2 * num_devices - 1 - i)]
    inverse = sorted(range(2 * num_devices), key=order.__getitem__)
    return jnp.concatenate([chunks[c] for c in inverse], axis=axis)


def _chunks(x: jax.Array, num_devices: int, axis: int) -> list[jax.Array]:
    num_devices = static_int("num_devices", num_devices, low=1)
    axis = static_int("axis", axis)
    x = jnp.asarray(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis must name one of the array's {x.ndim} axes, got {axis}")
    length = x.shape[axis]
    if length % (2 * num_devices):
        raise ValueError(f"the zigzag layout splits axis {axis} of length {length} into "
                         f"2 * num_devices = {2 * num_devices} equal chunks")
    return jnp.split(x, 2 * num_devices, axis=axis)


def ring_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    axis_name: str,
    sequence_layout: str = "contiguous",
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    alibi_slopes: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    broadcast_dropout: bool = False,
    sinks: jax.Array | None = None,
    return_residual: bool = False,
    implementation: str | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """dot_product_attention over a sequence split along mesh axis `axis_name`.

    Call inside jax.shard_map with the sequence axes of query, key, value (and of
    q_segment_ids / kv_segment_ids) split over `axis_name`; every other argument is
    whole on each device (lengths are global lengths). Query and key slices must
    have the same length (self-attention). The result (output, logsumexp, gradients
    and the dropout mask) equals dot_product_attention on the gathered arrays; the
    batch and heads must not be split across devices when dropout is on (its mask
    is numbered by the local batch entries and heads).

    sequence_layout: "contiguous" or "zigzag" (see `zigzag`); implementation: None
    (the Pallas kernels on an NVIDIA GPU, else "xla_chunked"), "pallas" or
    "xla_chunked". Other arguments as in dot_product_attention.
    """
    if sequence_layout not in LAYOUTS:
        raise ValueError(f"sequence_layout must be one of {LAYOUTS}, got {sequence_layout!r}")
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be a mesh axis name (str), got {axis_name!r}")
    return_residual = check_bool("return_residual", return_residual)
    interpret = check_bool("interpret", interpret)
    sharding.check_interpretable(interpret)
    implementation = dispatch.ring_implementation(implementation, interpret)
    if implementation not in RING_IMPLEMENTATIONS:
        raise ValueError(f"ring_attention's implementation must be None or one of "
                         f"{RING_IMPLEMENTATIONS}, got {implementation!r}")
    if (block_sizes is not None or interpret) and implementation != "pallas":
        raise ValueError(f"block_sizes and interpret apply to implementation='pallas', "
                         f"got {implementation!r}")
    try:
        devices = lax.axis_size(axis_name)
    except NameError:
        raise ValueError(f"ring_attention runs inside jax.shard_map over a mesh axis named "
                         f"{axis_name!r}; no such axis is bound here") from None
    spec, ops, batched = normalize(
        query, key, value, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, alibi_slopes=alibi_slopes,
        logits_soft_cap=logits_soft_cap, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        broadcast_dropout=broadcast_dropout, sinks=sinks, sequence_ways=devices)
    T, S = ops.query.shape[1], ops.key.shape[1]
    if T != S:
        raise ValueError(f"ring_attention needs query and key slices of one length, got "
                         f"{T} and {S}")
    if sequence_layout == "zigzag" and T % 2:
        raise ValueError(f"the zigzag layout needs an even slice length, got {T}")
    if T == 0 or ops.query.shape[0] == 0:
        return reference.finish(*reference.empty(ops), batched, return_residual)
    ring = _Ring(spec, implementation, sequence_layout, devices, axis_name, block_sizes,
                 interpret)
    constants = {name: getattr(ops, name) for name in
                 ("alibi_slopes", "q_segment_ids", "kv_segment_ids", "query_seq_lengths",
                  "key_value_seq_lengths", "dropout_keys") if getattr(ops, name) is not None}
    # Through jit: shard_map outside jit takes no custom_vjp with symbolic zeros.
    out, lse = jax.jit(_ring, static_argnums=0)(ring, ops.query, ops.key, ops.value,
                                                ops.sinks, constants)
    return reference.finish(out, lse, batched, return_residual)


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static description of one ring call (hashable: the custom_vjp's nondiff arg)."""

    spec: AttentionSpec
    implementation: str
    layout: str
    devices: int
    axis_name: str
    block_sizes: BlockSizes | None
    interpret: bool

    @property
    def parts(self) -> int:
        """Chunks per device slice."""
        return 2 if self.layout == "zigzag" else 1

    def starts(self, device: Any, length: int) -> list[Any]:
        """Global positions of the first element of each chunk of device's slice."""
        if self.layout == "contiguous":
            return [device * length]
        chunk = length // 2
        return [device * chunk, (2 * self.devices - 1 - device) * chunk]

    def visible(self, q_start: Any, k_start: Any, length: int) -> Any:
        """Whether a query chunk at q_start can see any key of the chunk at k_start
        through the causal/window band; None: the block always runs (no band, or the
        kernels, which skip the tiles it hides themselves: a lax.cond on a GPU reads its
        predicate on the host, a wait per block and step)."""
        spec = self.spec
        if (not spec.is_causal and spec.local_window is None) or (
                self.implementation != "xla_chunked"):
            return None
        lo, hi = scores.key_range(q_start, q_start + length, spec, 0, k_start + length)
        return jnp.maximum(lo, k_start) < hi

    def zeros(self, shape: tuple[int, ...], fill: float = 0.0) -> jax.Array:
        """A float32 constant that varies over the ring's axis like the blocks' results."""
        return self.vary(jnp.full(shape, fill, jnp.float32))

    def vary(self, x: jax.Array) -> jax.Array:
        """x typed as varying over the ring's axis (it is combined with per-device data)."""
        if self.axis_name in jax.typeof(x).mat.varying:
            return x
        return lax.pcast(x, (self.axis_name,), to="varying")

    def forward(self, q, k, v, constants: dict, origin) -> tuple[jax.Array, jax.Array]:
        """(out f32, lse) of one block with its origin."""
        ops = self.operands(q, k, v, constants, origin)
        if self.implementation == "xla_chunked":
            out, lse = chunked.attention(self.spec, ops)
        else:
            from pallas_attn.kernels import vjp

            out, lse = vjp.attention(self.spec, ops, self.plan(ops))
        return out.astype(jnp.float32), lse

    def gradients(self, q, k, v, constants: dict, origin, out, lse, d_out, d_lse):
        """(dq, dk, dv) of one block, from the whole softmax's out and lse."""
        ops = self.operands(q, k, v, constants, origin)
        if self.implementation == "xla_chunked":
            return chunked.gradients(self.spec, ops, out, lse, d_out, d_lse)
        from pallas_attn.kernels import vjp

        return vjp.gradients(self.spec, ops, self.plan(ops), out, lse, d_out, d_lse)

    def sink_gradient(self, sinks, lse, out, d_out, d_lse) -> jax.Array:
        """d sinks [N] from this device's rows (`scores.sink_gradient`); with the kernels
        its sums run in one order on a GPU (`vjp.fixed_sums`), the same in every process."""
        if self.implementation == "xla_chunked":
            delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(jnp.float32),
                               out.astype(jnp.float32))
            total = None
        else:
            from pallas_attn.kernels import vjp

            delta = vjp.fixed_sums(self.interpret, d_out, out)
            total = functools.partial(vjp.row_total, self.interpret)
        return scores.sink_gradient(sinks, lse, delta - d_lse, total=total)

    def operands(self, q, k, v, constants: dict, origin) -> Operands:
        return Operands(q, k, v, origin=jnp.stack(origin).astype(jnp.int32), **constants)

    def plan(self, ops: Operands):
        """The kernels' plan for one block (the routing table's)."""
        return dispatch.plan(dispatch.Call.of(self.spec, ops), block_sizes=self.block_sizes,
                             interpret=self.interpret)


def _split(x: jax.Array, parts: int) -> list[jax.Array]:
    return jnp.split(x, parts, axis=1) if parts > 1 else [x]


def _kv_constants(constants: dict, segments) -> dict:
    """The block's constants: the traveling kv segment ids in place of the local ones."""
    if segments is None:
        return constants
    return {**constants, "kv_segment_ids": segments}


def _q_constants(constants: dict, part: int, parts: int) -> dict:
    if "q_segment_ids" not in constants:
        return constants
    return {**constants, "q_segment_ids": _split(constants["q_segment_ids"], parts)[part]}


def _ring_blocks(ring: _Ring, length: int, step: int):
    """(query part, key part, origin, visible) of every block at ring step `step`."""
    device = lax.axis_index(ring.axis_name)
    devices = jnp.int32(ring.devices)  # int32 under jax_enable_x64 too
    source = lax.rem(device - step + devices, devices)
    chunk = length // ring.parts
    q_starts, k_starts = ring.starts(device, length), ring.starts(source, length)
    for a, q_start in enumerate(q_starts):
        for b, k_start in enumerate(k_starts):
            yield a, b, (q_start, k_start), ring.visible(q_start, k_start, chunk)


def _hide_rows_past(ring: _Ring, x: jax.Array, lengths: jax.Array | None) -> jax.Array:
    """x [B, T, ...] of this device's rows zeroed at the global positions past the query
    lengths (`reference.hide_rows_past`: rows that see no key, whose output cotangents
    reach no gradient)."""
    if lengths is None:
        return x
    starts = ring.starts(lax.axis_index(ring.axis_name), x.shape[1])
    parts = [reference.hide_past(part, lengths, start)
             for part, start in zip(_split(x, ring.parts), starts, strict=True)]
    return jnp.concatenate(parts, axis=1) if ring.parts > 1 else parts[0]


def _shift(tree: Any, ring: _Ring) -> Any:
    """Every device sends to the next one around the ring."""
    perm = [(i, (i + 1) % ring.devices) for i in range(ring.devices)]
    return jax.tree.map(lambda x: lax.ppermute(x, ring.axis_name, perm), tree)


def _when(visible: Any, compute, skipped, *operands):
    """compute(*operands), or skipped(*operands) where the band hides the block."""
    if visible is None:
        return compute(*operands)
    return lax.cond(visible, compute, skipped, *operands)


def _ring_forward(ring: _Ring, q, k, v, sinks, constants):
    B, T, N, _ = q.shape
    Hv, parts = v.shape[-1], ring.parts
    c = T // parts
    travel = (k, v, constants.get("kv_segment_ids"))
    outs = [ring.zeros((B, c, N, Hv)) for _ in range(parts)]
    # The sinks are each row's softmax before any key: lse = sink, output 0.
    lses = [ring.zeros((B, N, c), -jnp.inf) if sinks is None else
            ring.vary(jnp.broadcast_to(sinks[None, :, None], (B, N, c))) for _ in range(parts)]
    q_parts = _split(q, parts)
    for step in range(ring.devices):
        nxt = _shift(travel, ring) if step + 1 < ring.devices else None
        k_now, v_now, segs = travel
        k_parts, v_parts = _split(k_now, parts), _split(v_now, parts)
        seg_parts = _split(segs, parts) if segs is not None else [None] * parts
        for a, b, origin, visible in _ring_blocks(ring, T, step):
            block_constants = _q_constants(_kv_constants(constants, seg_parts[b]), a, parts)

            def skipped(*_):
                return ring.zeros((B, c, N, Hv)), ring.zeros((B, N, c), -jnp.inf)

            out_b, lse_b = _when(visible, ring.forward, skipped, q_parts[a], k_parts[b],
                                 v_parts[b], block_constants, origin)
            outs[a], lses[a] = _merge(outs[a], lses[a], out_b, lse_b)
        travel = nxt
    out = jnp.concatenate(outs, axis=1) if parts > 1 else outs[0]
    lse = jnp.concatenate(lses, axis=2) if parts > 1 else lses[0]
    return out.astype(q.dtype), lse


def _merge(out, lse, out_b, lse_b):
    """Online-softmax merge of two partial results over disjoint keys."""
    new = jnp.logaddexp(lse, lse_b)
    empty = new == -jnp.inf

    def weight(x):  # [B, N, c] -> [B, c, N, 1]
        w = jnp.where(empty, 0.0, jnp.exp(x - jnp.where(empty, 0.0, new)))
        return jnp.swapaxes(w, 1, 2)[..., None]

    return weight(lse) * out + weight(lse_b) * out_b, new


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, sinks, constants):
    return _ring_forward(ring, q, k, v, sinks, constants)


def _ring_fwd(ring: _Ring, q, k, v, sinks, constants):
    if is_perturbed(constants.get("alibi_slopes")):
        raise NotImplementedError(
            "ring_attention treats alibi_slopes as constants and does not differentiate "
            "them; wrap them in jax.lax.stop_gradient")
    q, k, v, sinks, constants = first_order_only(primal_values((q, k, v, sinks, constants)),
                                                 "ring_attention")
    out, lse = _ring_forward(ring, q, k, v, sinks, constants)
    return (out, lse), (q, k, v, sinks, constants, out, lse)


def _ring_bwd(ring: _Ring, residuals, cotangents):
    q, k, v, sinks, constants, out, lse = first_order_only(residuals, "ring_attention")
    d_out, d_lse = cotangents
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(out.shape, out.dtype)
    d_out = _hide_rows_past(ring, d_out, constants.get("query_seq_lengths"))
    if isinstance(d_lse, SymbolicZero):
        d_lse = jnp.zeros(lse.shape, jnp.float32)
    T, parts = q.shape[1], ring.parts
    q_parts, out_parts, do_parts = _split(q, parts), _split(out, parts), _split(d_out, parts)
    lse_parts = jnp.split(lse, parts, axis=2) if parts > 1 else [lse]
    dlse_parts = jnp.split(d_lse, parts, axis=2) if parts > 1 else [d_lse]
    dq = [ring.zeros(x.shape) for x in q_parts]
    travel = (k, v, constants.get("kv_segment_ids"))
    dkv = (ring.zeros(k.shape), ring.zeros(v.shape))
    for step in range(ring.devices):
        k_now, v_now, segs = travel
        k_parts, v_parts = _split(k_now, parts), _split(v_now, parts)
        seg_parts = _split(segs, parts) if segs is not None else [None] * parts
        dk_parts, dv_parts = _split(dkv[0], parts), _split(dkv[1], parts)
        for a, b, origin, visible in _ring_blocks(ring, T, step):
            block_constants = _q_constants(_kv_constants(constants, seg_parts[b]), a, parts)

            def compute(*operands):
                return tuple(g.astype(jnp.float32) for g in ring.gradients(*operands))

            def skipped(q_a, k_b, v_b, *_):
                return tuple(ring.zeros(x.shape) for x in (q_a, k_b, v_b))

            dq_b, dk_b, dv_b = _when(visible, compute, skipped, q_parts[a], k_parts[b],
                                     v_parts[b], block_constants, origin, out_parts[a],
                                     lse_parts[a], do_parts[a], dlse_parts[a])
            dq[a] = dq[a] + dq_b
            dk_parts[b] = dk_parts[b] + dk_b
            dv_parts[b] = dv_parts[b] + dv_b
        dkv = (jnp.concatenate(dk_parts, axis=1) if parts > 1 else dk_parts[0],
               jnp.concatenate(dv_parts, axis=1) if parts > 1 else dv_parts[0])
        # dK/dV travel with their block; after the last step they reach its home.
        if step + 1 < ring.devices:
            travel, dkv = _shift((travel, dkv), ring)
        else:
            dkv = _shift(dkv, ring)
    dq = jnp.concatenate(dq, axis=1) if parts > 1 else dq[0]
    dsinks = None
    if sinks is not None:
        dsinks = ring.sink_gradient(sinks, lse, out, d_out, d_lse)
        # Every device's rows, summed around the ring where shard_map types them (its
        # check_vma); unchecked, shard_map's transpose sums a replicated input's part.
        if ring.axis_name in jax.typeof(q).mat.varying:
            dsinks = lax.psum(dsinks, ring.axis_name)
    return (dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), dsinks,
            jax.tree.map(lambda _: None, constants))


_ring.defvjp(_ring_fwd, _ring_bwd, symbolic_zeros=True)
