"""Autotuning: time candidate tiles of the Triton kernels on the GPU, cache the winners.

`time_call` is the project's timer (the benchmark uses it too); `kernel_runner`
compiles one role's kernel alone on a route of one's choosing; `tune_problem`
sweeps each role's candidates and stores the fastest in the tile cache
(tuning/cache.py). The Mosaic kernels' tiles are fixed by their warpgroups and
are not swept.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_attn import dispatch
from pallas_attn.device import DeviceInfo
from pallas_attn.kernels import vjp
from pallas_attn.kernels.mosaic import config as mosaic_config
from pallas_attn.kernels.mosaic import dbias as mosaic_dbias
from pallas_attn.kernels.mosaic import dkv as mosaic_dkv
from pallas_attn.kernels.mosaic import dq as mosaic_dq
from pallas_attn.kernels.mosaic import fwd as mosaic_fwd
from pallas_attn.kernels.mosaic.common import mask_of, row_residuals
from pallas_attn.kernels.triton import config as triton_config
from pallas_attn.kernels.triton import dbias as triton_dbias
from pallas_attn.kernels.triton import dkdv as triton_dkdv
from pallas_attn.kernels.triton import dq as triton_dq
from pallas_attn.kernels.triton import fwd as triton_fwd
from pallas_attn.kernels.triton.context import backward_inputs
from pallas_attn.plan import TILE_FIELDS, BlockSizes, Plan, Route
from pallas_attn.spec import check_bool, normalize
from pallas_attn.tuning import cache

# Every role on Triton: what `tune` sweeps.
TRITON_ONLY = BlockSizes(forward_backend="triton", dkv_backend="triton", dq_backend="triton",
                         dbias_backend="triton")


def time_call(fn: Callable[[], Any], *, min_seconds: float = 0.3, warmup: int = 2,
              samples: int = 7) -> float:
    """Seconds per call of a jitted function: the median over `samples` batches.

    Each batch queues its calls back to back and synchronises once, at its end, so a
    sample is the device's time per call. Synchronising after every call would add
    the host's dispatch-and-wait round trip to each sample (0.2-0.3 ms for a jitted
    attention call on an H100, docs/decisions.md); it weighs more on short
    calls (a causal forward) than long ones and so shrinks the ratios between them.
    A call slower than a batch's share of `min_seconds` (the interpreter on a CPU)
    runs alone in each of at least 3 samples.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable taking no arguments, got {fn!r}")
    if isinstance(min_seconds, bool) or not isinstance(min_seconds, (int, float)) or \
            not min_seconds > 0:
        raise ValueError(f"min_seconds must be a positive number, got {min_seconds!r}")
    for name, value, least in (("warmup", warmup, 0), ("samples", samples, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    for _ in range(warmup):
        jax.block_until_ready(fn())
    start = time.perf_counter()
    jax.block_until_ready(fn())
    single = max(time.perf_counter() - start, 1e-6)
    per_batch = max(1, min(100, round(min_seconds / (samples * single))))
    if per_batch == 1:
        samples = max(3, min(samples, int(min_seconds / single)))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        out = None
        for _ in range(per_batch):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / per_batch)
    times.sort()
    return times[len(times) // 2]


def tune(make_step: Callable[[Any], Callable[[], Any]], candidates: Iterable[Any],
         progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda x: x,
         ) -> tuple[Any, list[tuple[Any, float | None, str]]]:
    """Times make_step(candidate) for each candidate; returns (best, results).

    A candidate that fails to compile (e.g. out of shared memory) is recorded
    with its error and skipped.
    """
    results: list[tuple[Any, float | None, str]] = []
    for candidate in progress(list(candidates)):
        try:
            seconds = time_call(make_step(candidate), min_seconds=0.1)
            results.append((candidate, seconds, ""))
        except Exception as e:  # noqa: BLE001 - any compile failure disqualifies it
            first_line = (str(e).splitlines() or [""])[0]
            results.append((candidate, None, f"{type(e).__name__}: {first_line[:200]}"))
    timed = [r for r in results if r[1] is not None]
    if not timed:
        raise RuntimeError("no candidate block size compiled: " +
                           "; ".join(r[2] for r in results))
    best = min(timed, key=lambda r: r[1])[0]
    return best, results


# Candidate grids timed by `python -m pallas_attn tune`, per role:
# (block_q, block_k) pairs x warps x stages, filtered by the shared-memory estimate.
SWEEP = {
    "forward": (((128, 64), (128, 128), (64, 64), (64, 128)), (4, 8), (2, 3, 4)),
    "dkdv": (((32, 128), (64, 128), (64, 64), (128, 128), (32, 64)), (4, 8), (1, 2, 3)),
    "dq": (((128, 64), (128, 32), (64, 64), (128, 128), (64, 128)), (4, 8), (1, 2, 3)),
}
SWEEP["dbias"] = SWEEP["dq"]  # the same four tiles per step as the dQ kernel


def sweep_entries(role: str, head_dim: int, value_head_dim: int, dtype: Any, budget: int,
                  q_len: int, kv_len: int, bias_dtype: Any = None, hides_keys: bool = False
                  ) -> list[tuple[int, int, int, int]]:
    """The Triton tiles `tune` times for one role: the sweep grid and the ladder, within
    the lengths and the shared-memory budget (`hides_keys`: AttentionSpec.hides_keys)."""
    pairs, warps, stages = SWEEP[role]
    if role == "dbias" and bias_dtype is None:
        bias_dtype = dtype  # the dbias kernel exists only with a bias
    grid = [((bq, bk, w, st)) for (bq, bk) in pairs for w in warps for st in stages]
    entries = []
    for entry in (*grid, *triton_config.ladder(role, head_dim, value_head_dim)):
        bq, bk = entry[:2]
        if entry in entries or bq > max(16, q_len) or bk > max(16, kv_len):
            continue
        cleaned = triton_config.cleaned_tiles(role, hides_keys, False, False, kv_len, bk)
        need = triton_config.shared_memory(role, entry, head_dim, value_head_dim, dtype,
                                           bias_dtype=bias_dtype, cleaned=cleaned)
        if need <= budget:
            entries.append(entry)
    return entries


def route_tiles(route: Route) -> tuple[int, int, int, int]:
    return (route.block_q, route.block_k, route.num_warps, route.num_stages)


def kernel_runner(*, batch: int, q_len: int, kv_len: int, heads: int, kv_heads: int,
                  head_dim: int, dtype: Any = jnp.bfloat16, is_causal: bool = False,
                  bias: bool = False, bias_per_batch: bool = False, alibi: bool = False,
                  soft_cap: float | None = None, mask: bool = False,
                  block_sizes: BlockSizes | None = None, interpret: bool = False
                  ) -> tuple[Plan, Callable[[str, Route], Callable[[], Any]]]:
    """(plan, runner) for one problem on the current device (lengths multiples of 128).

    bias: a [1, N, T, S] bias ([B, N, T, S] with bias_per_batch). alibi: ALiBi slopes
    per head; soft_cap: logits_soft_cap; mask: a random boolean mask [B, 1, T, S] (90%
    visible). plan: what dot_product_attention runs with
    these block_sizes (TRITON_ONLY: the Triton kernels `tune` sweeps). interpret: run
    the kernels in the Pallas interpreter (the CPU tests).

    runner(role, route) compiles one kernel alone ("forward", "dkdv", "dkdv_dbias"
    (dK/dV writing dbias), "dq" or "dbias") on the route's backend and tiles, on random
    inputs, and returns a function that runs it once and returns its outputs.
    """
    is_causal, bias, bias_per_batch, alibi, mask, interpret = (
        check_bool(name, value) for name, value in (
            ("is_causal", is_causal), ("bias", bias), ("bias_per_batch", bias_per_batch),
            ("alibi", alibi), ("mask", mask), ("interpret", interpret)))
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (batch, q_len, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, kv_len, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, kv_len, kv_heads, head_dim), dtype)
    bias_array = (jax.random.normal(keys[4], (batch if bias_per_batch else 1, heads, q_len,
                                              kv_len), dtype) if bias else None)
    slopes = 2.0 ** (-8.0 * jnp.arange(1, heads + 1) / heads) if alibi else None
    mask_array = (jax.random.bernoulli(keys[4], 0.9, (batch, 1, q_len, kv_len)) if mask
                  else None)
    spec, ops, _ = normalize(q, k, v, bias_array, mask_array, is_causal=is_causal,
                             alibi_slopes=slopes, logits_soft_cap=soft_cap)
    plan = dispatch.plan(dispatch.Call.of(spec, ops), block_sizes=block_sizes,
                         interpret=interpret)
    if q_len % 128 or kv_len % 128:
        raise ValueError(f"kernel timings need lengths that are multiples of 128, got "
                         f"{q_len}/{kv_len}")
    problem, qp, kp, vp, differentiable, optional = vjp.prepare(spec, ops, plan)
    optional = {**optional, **differentiable}
    out, row_stats = jax.jit(lambda q, k, v, o: vjp._forward(problem, q, k, v, o))(
        qp, kp, vp, optional)
    do = jax.random.normal(keys[3], out.shape, dtype)
    delta = jnp.einsum("btnh,btnh->bnt", do.astype(jnp.float32), out.astype(jnp.float32))
    names, bwd_inputs = backward_inputs(qp, kp, vp, optional, row_stats, do, delta)
    mosaic_inputs = (qp, kp, vp, do, row_residuals(row_stats, delta), optional.get("bias"),
                     optional.get("alibi_slopes"), mask_of(optional))

    def runner(role: str, route: Route) -> Callable[[], Any]:
        if role not in ("forward", "dkdv", "dkdv_dbias", "dq", "dbias"):
            raise ValueError(f"unknown kernel {role!r}: choose forward, dkdv, dkdv_dbias, dq "
                             f"or dbias")
        plan_role = "dkdv" if role == "dkdv_dbias" else role
        if plan_role == "dbias" and plan.dbias is None:
            raise ValueError("dbias: the problem has no bias")
        if plan_role == "dbias" and route.in_dq:
            raise ValueError("dbias: a route summed from the dQ kernel's row sums is no kernel "
                             "of its own (a bias broadcast along keys); time dq")
        routes = {plan_role: route}
        if role == "dkdv_dbias":
            routes["dbias"] = dataclasses.replace(route, fused=True)
        p = dataclasses.replace(problem, plan=dataclasses.replace(plan, **routes))

        def mosaic_kernel(kernel_fn: Callable[..., Any], *flags: bool) -> tuple[Callable, tuple]:
            """A Mosaic backward kernel (mosaic dkv.dkdv, dq.dq or dbias.dbias) on the
            inputs, and those inputs."""
            def call(q, k, v, do, stats, bias, slopes, mask):
                masked = {} if mask is None else {"mask": mask}
                return kernel_fn(p, q, k, v, do, stats, bias, *flags, slopes, **masked)

            return call, mosaic_inputs

        mosaic = route.backend == "mosaic"
        if role == "forward":
            backend = mosaic_fwd if mosaic else triton_fwd
            # The operands are arguments, not constants folded into the program.
            fn, args = ((lambda q, k, v, o: backend.forward(p, q, k, v, o)),
                        (qp, kp, vp, optional))
        elif role in ("dkdv", "dkdv_dbias"):
            fused = None
            if role == "dkdv_dbias":
                fusable = (mosaic_config.fusable_dbias(
                    bias_array.shape, batch=batch, num_heads=heads, bias_dtype=dtype,
                    dtype=dtype) if mosaic else
                    triton_config.fusable_dbias(bias_array.shape, batch=batch, num_heads=heads))
                if not fusable:
                    raise ValueError(f"dkdv_dbias: this dK/dV kernel cannot write the dbias of "
                                     f"a bias of shape {bias_array.shape}")
                fused = optional["bias"]
            if mosaic:
                fn, args = mosaic_kernel(mosaic_dkv.dkdv, fused is not None)
            else:
                fn, args = (lambda *a: triton_dkdv.dkdv(p, names, list(a), fused)), bwd_inputs
        elif role == "dq" and mosaic:
            fn, args = mosaic_kernel(mosaic_dq.dq)
        elif role == "dq":
            fn, args = (lambda *a: triton_dq.dq(p, names, list(a))), bwd_inputs
        elif role == "dbias" and mosaic:
            fn, args = mosaic_kernel(mosaic_dbias.dbias)
        else:
            fn, args = ((lambda *a: triton_dbias.dbias(p, names, list(a), optional["bias"])),
                        bwd_inputs)
        compiled = jax.jit(fn).lower(*args).compile()
        return lambda: compiled(*args)

    return plan, runner


def tune_problem(*, batch: int, q_len: int, kv_len: int, heads: int, kv_heads: int,
                 head_dim: int, dtype: Any = jnp.bfloat16, is_causal: bool = False,
                 bias: bool = False,
                 kernels: tuple[str, ...] = ("forward", "dkdv", "dq"), save: bool = True,
                 log: Callable[[str], None] = print, workers: int = 8) -> dict[str, Any]:
    """Times every sweep candidate of each role's Triton kernel alone on the current GPU.

    Returns {"best": BlockSizes (tiles), "heuristic": the Triton plan's BlockSizes,
    "results": {role: [...]}} and (save=True) stores the winner in the tile cache for
    this problem's key.
    """
    from concurrent.futures import ThreadPoolExecutor

    try:
        from tqdm import tqdm as progress
    except ImportError:  # pragma: no cover - tqdm is in the example/test extras
        def progress(x, **_):
            return x

    device = DeviceInfo.current()
    plan, runner = kernel_runner(
        batch=batch, q_len=q_len, kv_len=kv_len, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, dtype=dtype, is_causal=is_causal, bias=bias,
        block_sizes=TRITON_ONLY)
    bias_dtype = jnp.dtype(dtype) if bias else None
    features = {"is_causal": is_causal, "has_bias": bias, "has_dropout": False,
                "has_window": False}
    tiles = {role: route_tiles(plan.route(role)) for role in TILE_FIELDS
             if plan.route(role) is not None}
    heuristic = tiles_block_sizes(tiles)
    results: dict[str, list] = {}
    for role in kernels:
        entries = sweep_entries(role, head_dim, head_dim, dtype,
                                device.max_shared_memory_per_block, q_len, kv_len,
                                bias_dtype=bias_dtype, hides_keys=is_causal)
        current = tiles[role]
        if current not in entries:
            entries.insert(0, current)
        # Compile in parallel threads (compilation is CPU work), then time one by one.
        with ThreadPoolExecutor(workers) as pool:
            futures = {e: pool.submit(runner, role, Route("triton", *e)) for e in entries}
        try:
            _, rows = tune(lambda e, done=futures: done[e].result(), entries,
                           functools.partial(progress, desc=f"timing {role}"))
        except RuntimeError as e:  # no candidate compiled
            log(f"  {role}: {e}")
            continue
        results[role] = rows
        for entry, _, error in rows:
            if error:
                log(f"  {role} {entry}: {error}")
        winner = min((r for r in rows if r[1] is not None), key=lambda r: r[1])
        base = next((r[1] for r in rows if r[0] == current), None)
        tiles[role] = winner[0]
        log(f"{role}: heuristic {current} {base * 1e3 if base else float('nan'):.3f} ms, "
            f"best {winner[0]} {winner[1] * 1e3:.3f} ms")
    best = tiles_block_sizes(tiles)
    if save:
        key = cache.entry_key(dtype, head_dim, head_dim, q_len, kv_len, features)
        log(f"cached as {key} in {cache.store(device, key, best)}")
    return {"best": best, "heuristic": heuristic, "results": results}


def tiles_block_sizes(tiles: dict[str, tuple[int, int, int, int]]) -> BlockSizes:
    """A BlockSizes holding each role's (block_q, block_k, warps, stages)."""
    fields = {}
    for role, entry in tiles.items():
        fields.update(zip(TILE_FIELDS[role], entry, strict=True))
    return BlockSizes(**fields)
