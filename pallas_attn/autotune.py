"""Autotuning: time the candidate tiles on the GPU and cache the winners.

The cache is one small JSON file per device kind, in $PALLAS_ATTN_CACHE_DIR
(default ~/.cache/pallas_attn). Entries are keyed by (dtype, head dims, sequence
bucket, feature set); `tuning.choose_block_sizes` consults them before its
heuristic. A corrupt or stale file is ignored with a warning.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

CACHE_VERSION = 2  # 2: BlockSizes gained the dbias kernel's fields
_FEATURES = ("is_causal", "has_bias", "has_dropout", "has_window")


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("PALLAS_ATTN_CACHE_DIR",
                                       pathlib.Path.home() / ".cache" / "pallas_attn"))


def _device_kind(device: Any) -> str:
    cc = "x".join(str(c) for c in device.compute_capability)
    return f"sm{cc}_smem{device.max_shared_memory_per_block}"


def cache_path(device: Any) -> pathlib.Path:
    return cache_dir() / f"tiles_{_device_kind(device)}.json"


def _bucket(length: int) -> int:
    """Sequence bucket: the next power of two (at least 128)."""
    return max(128, 1 << (int(length) - 1).bit_length())


def entry_key(dtype: Any, head_dim: int, value_head_dim: int, q_len: int, kv_len: int,
              features: dict[str, Any]) -> str:
    flags = ",".join(f for f in _FEATURES if features.get(f))
    return (f"{jnp.dtype(dtype).name}|h{head_dim}|hv{value_head_dim}|"
            f"t{_bucket(q_len)}|s{_bucket(kv_len)}|{flags or 'plain'}")


_loaded: dict[pathlib.Path, tuple[float, dict[str, Any]]] = {}


def _read(path: pathlib.Path) -> dict[str, Any]:
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return {}
    if path in _loaded and _loaded[path][0] == mtime:
        return _loaded[path][1]
    entries: dict[str, Any] = {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            raise ValueError(f"version {data.get('version') if isinstance(data, dict) else None}"
                             f" != {CACHE_VERSION}")
        if data.get("jax") != jax.__version__:
            raise ValueError(f"tuned with jax {data.get('jax')}, running {jax.__version__}")
        entries = dict(data["entries"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"ignoring pallas_attn tile cache {path}: {e}", stacklevel=3)
    _loaded[path] = (mtime, entries)
    return entries


def lookup(device: Any, dtype: Any, head_dim: int, value_head_dim: int, q_len: int,
           kv_len: int, features: dict[str, Any]):
    """The cached BlockSizes for this problem, or None."""
    from pallas_attn.tuning import BlockSizes

    entries = _read(cache_path(device))
    if not entries:
        return None
    raw = entries.get(entry_key(dtype, head_dim, value_head_dim, q_len, kv_len, features))
    if raw is None:
        return None
    try:
        return BlockSizes(**raw)
    except (TypeError, ValueError) as e:
        warnings.warn(f"ignoring stale pallas_attn tile cache entry {raw}: {e}", stacklevel=3)
        return None


def store(device: Any, key: str, block_sizes: Any) -> pathlib.Path:
    path = cache_path(device)
    entries = dict(_read(path))
    entries[key] = dataclasses.asdict(block_sizes)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": CACHE_VERSION, "jax": jax.__version__,
                               "entries": entries}, indent=1, sort_keys=True))
    tmp.replace(path)
    _loaded.pop(path, None)
    return path


def time_call(fn: Callable[[], Any], *, min_seconds: float = 0.3, warmup: int = 2,
              samples: int = 7) -> float:
    """Seconds per call of a jitted function: the median over `samples` batches.

    Each batch queues its calls back to back and synchronises once, at its end, so a
    sample is the device's time per call. Synchronising after every call would add
    the host's dispatch-and-wait round trip to each sample (0.2-0.3 ms for a jitted
    attention call on an H100, BENCHMARKS.md session 6); it weighs more on short
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


# Candidate grids timed by `python -m pallas_attn tune`, per kernel:
# (block_q, block_k) pairs x warps x stages, filtered by the shared-memory estimate.
SWEEP = {
    "forward": (((128, 64), (128, 128), (64, 64), (64, 128)), (4, 8), (2, 3, 4)),
    "dkdv": (((32, 128), (64, 128), (64, 64), (128, 128), (32, 64)), (4, 8), (1, 2, 3)),
    "dq": (((128, 64), (128, 32), (64, 64), (128, 128), (64, 128)), (4, 8), (1, 2, 3)),
}
SWEEP["dbias"] = SWEEP["dq"]  # the same four tiles per step as the dQ kernel


def sweep_entries(kernel: str, head_dim: int, value_head_dim: int, dtype: Any, budget: int,
                  q_len: int, kv_len: int, bias_dtype: Any = None
                  ) -> list[tuple[int, int, int, int]]:
    from pallas_attn import tuning

    pairs, warps, stages = SWEEP[kernel]
    if kernel == "dbias" and bias_dtype is None:
        bias_dtype = dtype  # the dbias kernel exists only with a bias
    grid = [((bq, bk, w, st)) for (bq, bk) in pairs for w in warps for st in stages]
    entries = []
    for entry in (*grid, *tuning.ladder(kernel, head_dim, value_head_dim)):
        bq, bk = entry[:2]
        if entry in entries or bq > max(16, q_len) or bk > max(16, kv_len):
            continue
        candidate = tuning.with_kernel(tuning.BlockSizes(), kernel, entry)
        estimate = tuning.shared_memory_estimate(candidate, head_dim, value_head_dim, dtype,
                                                 bias_dtype=bias_dtype)
        if estimate[kernel] <= budget:
            entries.append(entry)
    return entries


def kernel_runner(*, batch: int, q_len: int, kv_len: int, heads: int, kv_heads: int,
                  head_dim: int, dtype: Any = jnp.bfloat16, is_causal: bool = False,
                  bias: bool = False, bias_per_batch: bool = False, alibi: bool = False,
                  soft_cap: float | None = None, mosaic_forward: bool = False,
                  interpret: bool = False
                  ) -> tuple[Any, Callable[[str, Any], Callable[[], Any]]]:
    """(heuristic BlockSizes, runner) for one problem on the current device.

    bias: a [1, N, T, S] bias ([B, N, T, S] with bias_per_batch). alibi: ALiBi slopes
    per head; soft_cap: logits_soft_cap. mosaic_forward: the
    heuristic may pick the Mosaic forward, as dot_product_attention's does (off for
    tuning, which sweeps the Triton forward's tiles). interpret: run the kernels in
    the Pallas interpreter (the CPU tests).

    runner(kernel, blocks) compiles one kernel alone ("forward", "dkdv", "dkdv_dbias"
    (dK/dV writing dbias), "dq", "dq_dkdv" (the Mosaic dK/dV kernel computing dQ too,
    `mosaic_dkv.dq_dkdv`) or "dbias") with those tiles and backends on random
    inputs and returns a function that runs it once and returns its outputs.
    """
    if not isinstance(interpret, bool):
        raise TypeError(f"kernel_runner: interpret must be a bool, got {interpret!r}")
    from pallas_attn import tuning
    from pallas_attn.kernels import attention as kernel_attention
    from pallas_attn.kernels import (
        mosaic_common,
        mosaic_dbias,
        mosaic_dkv,
        mosaic_dq,
        mosaic_fwd,
        triton_bwd,
        triton_fwd,
    )
    from pallas_attn.spec import normalize

    device = tuning.DeviceInfo.current()
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (batch, q_len, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, kv_len, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, kv_len, kv_heads, head_dim), dtype)
    bias_array = (jax.random.normal(keys[4], (batch if bias_per_batch else 1, heads, q_len,
                                              kv_len), dtype) if bias else None)
    slopes = 2.0 ** (-8.0 * jnp.arange(1, heads + 1) / heads) if alibi else None
    spec, ops, _ = normalize(q, k, v, bias_array, is_causal=is_causal, alibi_slopes=slopes,
                             logits_soft_cap=soft_cap)
    features = {"is_causal": is_causal, "has_bias": bias, "has_soft_cap": soft_cap is not None,
                "bias_dtype": None if bias_array is None else bias_array.dtype}
    triton_tiles = tuning.choose_block_sizes(head_dim, dtype, q_len=q_len, kv_len=kv_len,
                                             device=device, **features)
    heuristic = triton_tiles
    if mosaic_forward:
        present = ("bias",) * bias + ("alibi_slopes",) * alibi
        scores = not mosaic_common.unsupported_scores(spec, present)
        heuristic = tuning.choose_block_sizes(head_dim, dtype, q_len=q_len, kv_len=kv_len,
                                              device=device, mosaic_scores=scores,
                                              **features)
    problem, qp, kp, vp, differentiable, optional = kernel_attention.prepare(
        spec, ops, tuning.BlockSizes(*(128,) * 6), interpret=interpret)
    optional = {**optional, **differentiable}
    if problem.q_pad != q_len or problem.kv_pad != kv_len:
        raise ValueError(f"kernel timings need lengths that are multiples of 128, got "
                         f"{q_len}/{kv_len}")
    out, row_stats = jax.jit(lambda q, k, v, o: triton_fwd.forward(
        dataclasses.replace(problem, blocks=triton_tiles), q, k, v, o))(qp, kp, vp, optional)
    do = jax.random.normal(keys[3], out.shape, dtype)
    delta = jnp.einsum("btnh,btnh->bnt", do.astype(jnp.float32), out.astype(jnp.float32))
    names, bwd_inputs = triton_bwd.backward_inputs(qp, kp, vp, optional, row_stats, do, delta)
    mosaic_inputs = (qp, kp, vp, do, mosaic_common.row_residuals(row_stats, delta),
                     optional.get("bias"), optional.get("alibi_slopes"))

    def runner(kernel: str, blocks: Any) -> Callable[[], Any]:
        p = dataclasses.replace(problem, blocks=blocks)

        def mosaic_kernel(kernel_fn: Callable[..., Any], *flags: bool) -> tuple[Callable, tuple]:
            """A Mosaic backward kernel (mosaic_dkv.dkdv, mosaic_dq.dq or
            mosaic_dbias.dbias) on the inputs, and those inputs."""
            return (lambda q, k, v, do, stats, bias, slopes: kernel_fn(
                p, q, k, v, do, stats, bias, *flags, slopes)), mosaic_inputs

        if kernel == "forward":
            backend = mosaic_fwd if blocks.forward_backend == "mosaic" else triton_fwd
            # The operands are arguments, not constants folded into the program.
            fn, args = ((lambda q, k, v, o: backend.forward(p, q, k, v, o)),
                        (qp, kp, vp, optional))
        elif kernel in ("dkdv", "dkdv_dbias"):
            fused = None
            mosaic = blocks.dkv_backend == "mosaic"
            if kernel == "dkdv_dbias":
                fusable = (tuning.mosaic_fusable_dbias(
                    bias_array.shape, batch=batch, num_heads=heads, bias_dtype=dtype,
                    dtype=dtype) if mosaic else
                    tuning.fusable_dbias(bias_array.shape, batch=batch, num_heads=heads))
                if not fusable:
                    raise ValueError(f"dkdv_dbias: this dK/dV kernel cannot write the dbias of "
                                     f"a bias of shape {bias_array.shape}")
                fused = optional["bias"]
            if mosaic:
                fn, args = mosaic_kernel(mosaic_dkv.dkdv, fused is not None)
            else:
                fn, args = (lambda *a: triton_bwd.dkdv(p, names, list(a), fused)), bwd_inputs
        elif kernel == "dq_dkdv":
            if blocks.dkv_backend != "mosaic":
                raise ValueError(f"dq_dkdv: dQ is computed by the Mosaic dK/dV kernel only, "
                                 f"got blocks.dkv_backend={blocks.dkv_backend!r}")
            if why := mosaic_dkv.fuses_dq(p, optional.get("bias")):
                raise ValueError(f"dq_dkdv: {why}")
            fn, args = (lambda q, k, v, do, stats, bias, slopes: mosaic_dkv.dq_dkdv(
                p, q, k, v, do, stats, slopes)), mosaic_inputs
        elif kernel == "dq" and blocks.dq_backend == "mosaic":
            fn, args = mosaic_kernel(mosaic_dq.dq)
        elif kernel == "dq":
            fn, args = (lambda *a: triton_bwd.dq(p, names, list(a))), bwd_inputs
        elif blocks.dbias_backend == "mosaic":
            fn, args = mosaic_kernel(mosaic_dbias.dbias)
        else:
            fn, args = (lambda *a: triton_bwd.dbias(p, names, list(a), optional["bias"])), \
                bwd_inputs
        compiled = jax.jit(fn).lower(*args).compile()
        return lambda: compiled(*args)

    return heuristic, runner


def tune_problem(*, batch: int, q_len: int, kv_len: int, heads: int, kv_heads: int,
                 head_dim: int, dtype: Any = jnp.bfloat16, is_causal: bool = False,
                 bias: bool = False,
                 kernels: tuple[str, ...] = ("forward", "dkdv", "dq"), save: bool = True,
                 log: Callable[[str], None] = print, workers: int = 8) -> dict[str, Any]:
    """Times every sweep candidate of each kernel alone on the current GPU.

    Returns {"best": BlockSizes, "heuristic": BlockSizes, "results": {kernel: [...]}}
    and (save=True) stores the winner in the cache for this problem's key.
    """
    from concurrent.futures import ThreadPoolExecutor

    from pallas_attn import tuning

    try:
        from tqdm import tqdm as progress
    except ImportError:  # pragma: no cover - tqdm is in the example/test extras
        def progress(x, **_):
            return x

    device = tuning.DeviceInfo.current()
    heuristic, runner = kernel_runner(
        batch=batch, q_len=q_len, kv_len=kv_len, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, dtype=dtype, is_causal=is_causal, bias=bias)
    bias_dtype = jnp.dtype(dtype) if bias else None
    features = {"is_causal": is_causal, "has_bias": bias, "bias_dtype": bias_dtype}

    best = heuristic
    results: dict[str, list] = {}
    for kernel in kernels:
        entries = sweep_entries(kernel, head_dim, head_dim, dtype,
                                device.max_shared_memory_per_block, q_len, kv_len,
                                bias_dtype=features["bias_dtype"])
        current = heuristic.tiles(kernel)
        if current not in entries:
            entries.insert(0, current)
        # Compile in parallel threads (compilation is CPU work), then time one by one.
        with ThreadPoolExecutor(workers) as pool:
            futures = {e: pool.submit(runner, kernel,
                                      tuning.with_kernel(heuristic, kernel, e))
                       for e in entries}
        try:
            _, rows = tune(lambda e, done=futures: done[e].result(), entries,
                           functools.partial(progress, desc=f"timing {kernel}"))
        except RuntimeError as e:  # no candidate compiled
            log(f"  {kernel}: {e}")
            continue
        results[kernel] = rows
        for entry, _, error in rows:
            if error:
                log(f"  {kernel} {entry}: {error}")
        winner = min((r for r in rows if r[1] is not None), key=lambda r: r[1])
        base = next((r[1] for r in rows if r[0] == current), None)
        best = tuning.with_kernel(best, kernel, winner[0])
        log(f"{kernel}: heuristic {current} {base * 1e3 if base else float('nan'):.3f} ms, "
            f"best {winner[0]} {winner[1] * 1e3:.3f} ms")
    if save:
        key = entry_key(dtype, head_dim, head_dim, q_len, kv_len, features)
        log(f"cached as {key} in {store(device, key, best)}")
    return {"best": best, "heuristic": heuristic, "results": results}
