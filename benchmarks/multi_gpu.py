"""Multi-GPU scaling over every local device: data- and head-parallel steps, ring attention.

1. Data parallel: examples/train_lm.py's training step (model and AdamW) with the batch
   split over the devices, against one device with the per-device batch: the compiled
   step's collectives and tokens/s per device.
2. Head parallel: the op's fwd+bwd with query and kv heads split over the devices,
   against one device holding the per-device heads: collectives and the time ratio.
3. Ring attention, causal, fwd+bwd: T split over the devices in both layouts, against one
   device running T / devices (TFLOP/s per device, scaling efficiency) and against the
   same shard_map with K/V all-gathered (each device runs its queries against every key);
   each with XLA's compiled memory per device.

Numerics of the ring and of the sharded op against the single-device op are
benchmarks/multi_device_check.py's. Usage (repository root):
    python benchmarks/multi_gpu.py [--json out.json] [--lengths 131072 524288] [--rounds 2]
On a CPU (XLA_FLAGS=--xla_force_host_platform_device_count=N) it runs small shapes
through the interpreter: a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from row_log import RowLog

import pallas_attn
from pallas_attn import dispatch
from pallas_attn.device import on_nvidia_gpu
from pallas_attn.kernels import vjp
from pallas_attn.spec import normalize
from pallas_attn.tuning.autotune import time_call

ROOT = Path(__file__).resolve().parents[1]
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter", "all-reduce")


def _example():
    spec = importlib.util.spec_from_file_location("train_lm", ROOT / "examples" / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _collectives(compiled) -> dict[str, int]:
    text = compiled.as_text()
    found = {op: len(re.findall(rf" {op}(?:-start)?\(", text)) for op in COLLECTIVES}
    return {op: count for op, count in found.items() if count}


def _memory_gb(compiled) -> float:
    """XLA's per-device footprint of a compiled program: arguments, outputs, temporaries."""
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return (total - m.alias_size_in_bytes) / 1e9


def _mesh(devices, name: str) -> Mesh:
    return Mesh(np.array(devices), (name,), axis_types=(AxisType.Auto,))


def data_parallel(devices, gpu: bool, per_device: int | None = None) -> dict:
    lm = _example()
    cfg = lm.Config(layers=4, d_model=1024, heads=8, kv_heads=2, seq_len=2048,
                    dtype="bfloat16") if gpu else lm.Config(**lm.TINY)
    per_device = per_device or (8 if gpu else 2)

    def run(devs):
        mesh = _mesh(devs, "data")
        model = lm.TransformerLM(cfg, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
        graph, state = nnx.split((model, optimizer))

        def step(state, batch):
            model, optimizer = nnx.merge(graph, state)
            loss, grads = nnx.value_and_grad(lm.loss_fn)(model, batch)
            optimizer.update(model, grads)
            return loss, nnx.state((model, optimizer))

        state = jax.device_put(state, NamedSharding(mesh, P()))
        tokens = np.random.default_rng(0).integers(
            0, lm.VOCAB, (per_device * len(devs), cfg.seq_len + 1), dtype=np.int32)
        batch = jax.device_put(tokens, NamedSharding(mesh, P("data")))
        compiled = jax.jit(step).lower(state, batch).compile()
        seconds = time_call(lambda: compiled(state, batch))
        return compiled, per_device * len(devs) * cfg.seq_len / seconds / len(devs)

    _, single = run(devices[:1])
    compiled, many = run(devices)
    return dict(check="data parallel", devices=len(devices), per_device_batch=per_device,
                seq_len=cfg.seq_len, tokens_s_per_device_1=single,
                tokens_s_per_device=many, ratio=many / single,
                collectives=_collectives(compiled))


def _loss_and_grad(options: dict):
    def loss(q, k, v, ct):
        out = pallas_attn.dot_product_attention(q, k, v, **options)
        return jnp.sum(out.astype(jnp.float32) * ct)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _normal(shapes, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(key, shape, jnp.float32).astype(dtype)
            for key, shape in zip(keys, shapes, strict=True)]


def head_parallel(devices, gpu: bool) -> dict:
    B, T, N, K, H = (4, 4096, 16, 4, 128) if gpu else (2, 64, 2, 1, 32)
    dtype = jnp.bfloat16 if gpu else jnp.float32
    options = dict(is_causal=True, implementation="pallas", interpret=not gpu)
    fn = _loss_and_grad(options)

    def run(devs):
        n = len(devs)
        mesh = _mesh(devs, "model")
        lay = NamedSharding(mesh, P(None, None, "model", None))
        q, k, v, ct = (jax.device_put(x, lay) for x in _normal(
            ((B, T, N * n, H), (B, T, K * n, H), (B, T, K * n, H), (B, T, N * n, H)), dtype))
        compiled = jax.jit(fn).lower(q, k, v, ct).compile()
        return compiled, time_call(lambda: compiled(q, k, v, ct))

    _, single = run(devices[:1])
    compiled, many = run(devices)
    return dict(check="head parallel", devices=len(devices), B=B, T=T,
                heads_per_device=f"{N}/{K}", H=H, ms_1=single * 1e3, ms=many * 1e3,
                ratio=single / many, collectives=_collectives(compiled))


def _causal_tflop(B, T, N, H) -> float:
    """fwd+bwd of causal attention: 2 matmuls forward, 5 backward, half the score matrix."""
    return 7 * 2 * B * N * T * T * H / 2 / 1e12


def _gathered_fn(mesh, layout: str, interpret: bool):
    """shard_map: each device's queries against every key, K/V all-gathered."""
    devices = mesh.devices.size
    seq = P(None, "sp")

    def inner(q, k, v, ct):
        keys = [lax.all_gather(x, "sp", axis=1, tiled=True) for x in (k, v)]
        if layout == "zigzag":
            keys = [pallas_attn.unzigzag(x, devices, 1) for x in keys]
        device = lax.axis_index("sp")
        L = q.shape[1]
        parts = 2 if layout == "zigzag" else 1
        chunk = L // parts
        starts = ([device * L] if parts == 1 else
                  [device * chunk, (2 * devices - 1 - device) * chunk])
        total = jnp.float32(0)
        for i, start in enumerate(starts):
            qc, ctc = (x[:, i * chunk:(i + 1) * chunk] for x in (q, ct))
            spec, ops, _ = normalize(qc, keys[0], keys[1], is_causal=True)
            ops = ops._replace(origin=jnp.stack([start, 0]).astype(jnp.int32))
            plan = dispatch.plan(dispatch.Call.of(spec, ops), interpret=interpret)
            out, _ = vjp.attention(spec, ops, plan)
            total = total + jnp.sum(out.astype(jnp.float32) * ctc)
        return lax.psum(total, "sp")

    def loss(q, k, v, ct):
        return jax.shard_map(inner, mesh=mesh, in_specs=(seq,) * 4, out_specs=P(),
                             check_vma=False)(q, k, v, ct)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _ring_fn(mesh, layout: str, interpret: bool):
    seq = P(None, "sp")

    def inner(q, k, v, ct):
        out = pallas_attn.ring_attention(q, k, v, axis_name="sp", sequence_layout=layout,
                                         is_causal=True, interpret=interpret)
        return lax.psum(jnp.sum(out.astype(jnp.float32) * ct), "sp")

    def loss(q, k, v, ct):
        return jax.shard_map(inner, mesh=mesh, in_specs=(seq,) * 4, out_specs=P(),
                             check_vma=not interpret)(q, k, v, ct)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def ring(devices, gpu: bool, lengths: list[int], rounds: int = 1) -> list[dict]:
    B, N, H = 1, 16, 128
    if not gpu:
        N, H = 2, 32
    dtype = jnp.bfloat16 if gpu else jnp.float32
    n = len(devices)
    mesh = _mesh(devices, "sp")
    lay = NamedSharding(mesh, P(None, "sp"))
    rows = []
    for T in lengths:
        warm = dict(warmup=1, samples=3) if T >= 262144 else {}
        # One device running T / n: the per-device baseline.
        q, k, v, ct = _normal([(B, T // n, N, H)] * 4, dtype)
        one = jax.jit(_loss_and_grad(dict(is_causal=True, implementation="pallas",
                                          interpret=not gpu)))
        one_c = one.lower(q, k, v, ct).compile()
        t_one = time_call(lambda c=one_c, a=(q, k, v, ct): c(*a), **warm)
        tflops_one = _causal_tflop(B, T // n, N, H) / t_one
        del q, k, v, ct
        inputs = [jax.device_put(x, lay) for x in _normal([(B, T, N, H)] * 4, dtype, seed=1)]
        steps = {(layout, method): jax.jit(make(mesh, layout, not gpu)).lower(*inputs).compile()
                 for layout in ("contiguous", "zigzag")
                 for method, make in (("ring", _ring_fn), ("all-gather", _gathered_fn))}
        # Rounds take the steps in turn, so a slow spell of the machine falls on all of them.
        times = {key: [] for key in steps}
        for _ in range(rounds):
            for key, compiled in steps.items():
                times[key].append(time_call(lambda c=compiled, a=inputs: c(*a), **warm))
        for (layout, method), compiled in steps.items():
            t = min(times[layout, method])
            per_device = _causal_tflop(B, T, N, H) / t / n
            rows.append(dict(
                check="ring", method=method, layout=layout, devices=n, T=T, rounds=rounds,
                ms=t * 1e3, tflops_per_device=per_device, one_device_ms=t_one * 1e3,
                one_device_tflops=tflops_one, efficiency=per_device / tflops_one,
                memory_gb=_memory_gb(compiled), collectives=_collectives(compiled)))
        del inputs, steps
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="ring sequence lengths (default: 131072 and 524288 on a GPU)")
    parser.add_argument("--only", choices=("data", "heads", "ring"), nargs="+",
                        default=("data", "heads", "ring"))
    parser.add_argument("--rounds", type=int, default=1,
                        help="ring attention: time its four steps (two layouts, ring and "
                             "all-gather) in turn this many times and keep each one's best")
    parser.add_argument("--batch", type=int, default=None,
                        help="the data-parallel step's batch per device (default 8 on a GPU)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    gpu = on_nvidia_gpu()
    devices = jax.devices()
    lengths = args.lengths or ([131072, 524288] if gpu else [64 * len(devices)])
    print(f"{devices[0].device_kind}, jax {jax.__version__}, {len(devices)} device(s)",
          flush=True)
    emit = RowLog(args.json)

    if "data" in args.only:
        emit(data_parallel(devices, gpu, args.batch))
    if "heads" in args.only:
        emit(head_parallel(devices, gpu))
    if "ring" in args.only:
        for T in lengths:
            for row in ring(devices, gpu, [T], args.rounds):
                emit(row)

if __name__ == "__main__":
    main()
