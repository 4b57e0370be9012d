"""Multi-device paths on the devices at hand (one GPU is enough): numbers and overhead.

1. ring_attention over a mesh of every local device, both layouts, against
   dot_product_attention on the same (gathered) inputs: output, logsumexp and
   gradients, plain causal and every feature at once.
2. The jitted op on inputs laid out by NamedSharding over batch and heads: equal to
   the plain call, and its time next to the plain call's.
3. Ring attention's time next to the op's (on one device: the ring's own overhead).

Usage (repository root): python benchmarks/multi_device_check.py [--json out.json]
    [--only causal all sharded] [--layouts contiguous zigzag]
On a CPU it runs small shapes through the interpreter (a smoke test).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from row_log import RowLog

import pallas_attn
from pallas_attn.device import on_nvidia_gpu
from pallas_attn.tuning.autotune import time_call


def _inputs(B, T, N, K, H, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H))
    return [jax.random.normal(key, shape, jnp.float32).astype(dtype)
            for key, shape in zip(ks, shapes, strict=True)]


def _features(B, T, N, everything):
    if not everything:
        return {"is_causal": True}, None
    segments = (jnp.arange(T)[None, :] // (T // 4) + jnp.arange(B)[:, None]) % 3
    return dict(is_causal=True, local_window_size=(T // 3, 0), logits_soft_cap=30.0,
                alibi_slopes=jnp.linspace(0.001, 0.01, N), dropout_rate=0.1,
                dropout_rng=jax.random.key(3),
                key_value_seq_lengths=jnp.full((B,), T - T // 16, jnp.int32)), segments


def _ring_fn(mesh, layout, options, interpret):
    seq = P(None, "sp")

    def inner(q, k, v, ct, segments):
        out, lse = pallas_attn.ring_attention(
            q, k, v, axis_name="sp", sequence_layout=layout, q_segment_ids=segments,
            return_residual=True, interpret=interpret, **options)
        return jax.lax.psum(jnp.sum(out.astype(jnp.float32) * ct), "sp"), (out, lse)

    def loss(q, k, v, ct, segments):
        return jax.shard_map(inner, mesh=mesh, in_specs=(seq,) * 5,
                             out_specs=(P(), (seq, seq)), check_vma=not interpret)(
                                 q, k, v, ct, segments)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _op_fn(options, interpret):
    def loss(q, k, v, ct, segments):
        out, lse = pallas_attn.dot_product_attention(
            q, k, v, q_segment_ids=segments, return_residual=True, interpret=interpret,
            implementation="pallas", **options)
        return jnp.sum(out.astype(jnp.float32) * ct), (out, lse)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _max_diff(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    both_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    return float(np.max(np.where(both_inf, 0.0, np.abs(a - b))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--only", nargs="+", choices=("causal", "all", "sharded"),
                        default=("causal", "all", "sharded"),
                        help="ring attention with causal masking only, with every feature, "
                             "and the op on sharded inputs (a time-limited run's next call "
                             "can take the rows it missed)")
    parser.add_argument("--layouts", nargs="+", choices=("contiguous", "zigzag"),
                        default=("contiguous", "zigzag"), help="ring attention's layouts")
    args = parser.parse_args()
    gpu = on_nvidia_gpu()
    interpret = not gpu
    devices = jax.devices()
    P_ = len(devices)
    B, T, N, K, H = (1, 8192 * P_, 16, 8, 128) if gpu else (1, 64 * P_, 4, 2, 32)
    dtype = jnp.bfloat16 if gpu else jnp.float32
    mesh = jax.make_mesh((P_,), ("sp",), axis_types=(AxisType.Auto,))
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {P_} device(s)", flush=True)
    emit = RowLog(args.json)

    for everything in [x == "all" for x in ("causal", "all") if x in args.only]:
        options, segments = _features(B, T, N, everything)
        if segments is None:
            segments = jnp.zeros((B, T), jnp.int32)
        q, k, v, ct = _inputs(B, T, N, K, H, dtype)
        op = _op_fn(options, interpret)
        (_, (o_ref, l_ref)), g_ref = op(q, k, v, ct, segments)
        t_op = time_call(lambda op=op, q=q, k=k, v=v, ct=ct, s=segments: op(q, k, v, ct, s))
        for layout in args.layouts:
            ring = _ring_fn(mesh, layout, options, interpret)
            into = (lambda x: pallas_attn.zigzag(x, P_, 1)) if layout == "zigzag" else (
                lambda x: x)
            back = (lambda x: pallas_attn.unzigzag(x, P_, 1)) if layout == "zigzag" else (
                lambda x: x)
            a = [into(x) for x in (q, k, v, ct, segments)]
            (_, (o, lse)), g = ring(*a)
            t_ring = time_call(lambda ring=ring, a=a: ring(*a))
            emit(dict(
                check="ring", layout=layout, features="all" if everything else "causal",
                devices=P_, T=T, out=_max_diff(back(o), o_ref), lse=_max_diff(back(lse), l_ref),
                dq=_max_diff(back(g[0]), g_ref[0]), dk=_max_diff(back(g[1]), g_ref[1]),
                dv=_max_diff(back(g[2]), g_ref[2]), op_ms=t_op * 1e3, ring_ms=t_ring * 1e3))
    if "sharded" not in args.only:
        return
    # The op on batch- and head-sharded inputs (a (devices, 1) mesh over batch, heads).
    q, k, v, ct = _inputs(2 * P_, 4096 if gpu else 64, N, K, H, dtype, seed=1)
    segments = jnp.zeros(q.shape[:2], jnp.int32)
    op = _op_fn({"is_causal": True}, interpret)
    plain = op(q, k, v, ct, segments)
    grid = jax.make_mesh((P_, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    lay = NamedSharding(grid, P("data", None, "model", None))
    sq, sk, sv, sct = (jax.device_put(x, lay) for x in (q, k, v, ct))
    ss = jax.device_put(segments, NamedSharding(grid, P("data")))
    sharded = op(sq, sk, sv, sct, ss)
    diff = max(_max_diff(a, b) for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain),
                                               strict=True))
    emit(dict(check="sharded", devices=P_, T=q.shape[1], max_diff=diff,
              plain_ms=time_call(lambda: op(q, k, v, ct, segments)) * 1e3,
              sharded_ms=time_call(lambda: op(sq, sk, sv, sct, ss)) * 1e3))


if __name__ == "__main__":
    main()
