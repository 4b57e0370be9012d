"""CPU time and peak memory: the reference (implementation="xla") vs "xla_chunked".

Every case (implementation x length x forward / forward+backward x causal) runs in a
fresh Python process, so its ru_maxrss is its own. Per case:

* compiled temp bytes: `jax.jit(f).lower(...).compile().memory_analysis()`, the XLA
  scratch memory of the program (inputs and outputs not included);
* time: wall and process CPU seconds of the compiled call, best of --repeats after one
  warm-up run (XLA uses several cores where it can: CPU s > wall s);
* peak RSS: the peak resident set of the process (VmHWM, i.e. ru_maxrss of this
  process image), and its growth over the resident set just before the first call
  (the runtime, the inputs and the compiled program are resident by then).

A case whose compiled temp size exceeds --max-run-gib is compiled but not run (its
memory is reported from the compiled analysis only).

    .venv/bin/python benchmarks/cpu_chunked.py                 # the table in CPU_RESULTS.md
    .venv/bin/python benchmarks/cpu_chunked.py --lengths 1024 --repeats 1

fwd+bwd is one jitted jax.grad of sum(out * dO) with respect to q, k and v.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

IMPLEMENTATIONS = ("xla", "xla_chunked")
MODES = ("fwd", "fwd+bwd")


def run_case(impl: str, length: int, mode: str, causal: bool, batch: int, heads: int,
             head_dim: int, repeats: int, max_run_bytes: int, tiles: dict) -> dict:
    """One case in this process; returns its measurements.

    tiles: block_q / block_k / chunk overrides for xla_chunked (empty: its defaults).
    """
    import jax
    import jax.numpy as jnp

    import pallas_attn
    from pallas_attn.semantics import chunked
    from pallas_attn.spec import normalize

    shape = (batch, length, heads, head_dim)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, d_out = (jax.random.normal(key, shape, jnp.float32) for key in keys)

    def attention(q, k, v):
        if impl == "xla_chunked" and tiles:
            spec, ops, _ = normalize(q, k, v, is_causal=causal)
            return chunked.attention(spec, ops, **tiles)[0]
        return pallas_attn.dot_product_attention(q, k, v, is_causal=causal,
                                                 implementation=impl)

    if mode == "fwd":
        fn, args = attention, (q, k, v)
    else:
        def loss(q, k, v, d_out):
            return jnp.sum(attention(q, k, v) * d_out)
        fn, args = jax.grad(loss, argnums=(0, 1, 2)), (q, k, v, d_out)

    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    temp = compiled.memory_analysis().temp_size_in_bytes
    if impl == "xla_chunked":
        B, T, N, _ = shape
        block_q, block_k = chunked.choose_tiles(T, T, 1)
        block_q, block_k = tiles.get("block_q", block_q), tiles.get("block_k", block_k)
        chunk = tiles.get("chunk") or chunked.choose_chunk(B, N, block_q * block_k)
        impl = f"xla_chunked {block_q}x{block_k}, chunk {tuple(chunk)}"
    result = dict(impl=impl, length=length, mode=mode, causal=causal, temp_bytes=temp,
                  compile_s=compile_s, ran=False)
    if temp > max_run_bytes:
        return result
    rss_before = _rss_kib("VmRSS")
    jax.block_until_ready(compiled(*args))  # warm-up
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(compiled(*args))
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    rss_after = _rss_kib("VmHWM")
    result.update(ran=True, wall_s=min(walls), cpu_s=min(cpus),
                  peak_rss_mib=rss_after / 1024, rss_growth_mib=(rss_after - rss_before) / 1024)
    return result


def _rss_kib(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process in KiB; ru_maxrss without /proc.

    NOTE: not ru_maxrss on Linux: a child's ru_maxrss starts at its parent's RSS at
    fork time (the kernel carries it across exec), so it would not be this case's own.
    """
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field))
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def table(results: list[dict]) -> str:
    lines = [
        "| T = S | causal | pass | impl | wall s | CPU s | compiled temp | peak RSS | "
        "RSS growth | speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["length"], r["causal"], r["mode"], r["impl"]): r for r in results}
    for r in results:
        ref = by_key.get((r["length"], r["causal"], r["mode"], "xla"))
        chunked = r["impl"].startswith("xla_chunked")
        if r["ran"]:
            timing = f"{r['wall_s']:.3f} | {r['cpu_s']:.3f}"
            rss = f"{r['peak_rss_mib']:.0f} MiB | {r['rss_growth_mib']:.0f} MiB"
        else:
            timing, rss = "not run | not run", "not run | not run"
        speedup = ""
        if chunked and ref and ref["ran"] and r["ran"]:
            speedup = f"{ref['wall_s'] / r['wall_s']:.1f}x"
        lines.append(f"| {r['length']} | {'yes' if r['causal'] else 'no'} | {r['mode']} | "
                     f"{r['impl']} | {timing} | {_fmt_bytes(r['temp_bytes'])} | {rss} | "
                     f"{speedup} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    parser.add_argument("--impls", nargs="+", choices=IMPLEMENTATIONS, default=IMPLEMENTATIONS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-run-gib", type=float, default=16.0,
                        help="compile but do not run a case whose temp size exceeds this")
    parser.add_argument("--block-q", type=int, help="xla_chunked query tile (default: auto)")
    parser.add_argument("--block-k", type=int, help="xla_chunked key tile (default: auto)")
    parser.add_argument("--chunk", type=int, nargs=2, metavar=("BATCH", "KV_HEADS"),
                        help="xla_chunked (batch entries, kv heads) per chunk (default: auto)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case
    args = parser.parse_args()

    tiles = {name: value for name, value in (("block_q", args.block_q),
                                             ("block_k", args.block_k),
                                             ("chunk", tuple(args.chunk or ()) or None))
             if value is not None}
    if args.case:
        impl, length, mode, causal = json.loads(args.case)
        result = run_case(impl, length, mode, causal, args.batch, args.heads, args.head_dim,
                          args.repeats, int(args.max_run_gib * 2**30), tiles)
        print("RESULT " + json.dumps(result))
        return

    import jax

    causal_options = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    print(f"# jax {jax.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; B={args.batch}, N={args.heads}, H={args.head_dim}, "
          f"float32", file=sys.stderr)
    results = []
    for length in args.lengths:
        for causal in causal_options:
            for mode in MODES:
                for impl in args.impls:
                    case = json.dumps([impl, length, mode, causal])
                    command = [sys.executable, __file__, "--case", case,
                               "--batch", str(args.batch), "--heads", str(args.heads),
                               "--head-dim", str(args.head_dim), "--repeats", str(args.repeats),
                               "--max-run-gib", str(args.max_run_gib)]
                    for name, value in tiles.items():
                        command += [f"--{name.replace('_', '-')}",
                                    *map(str, value if name == "chunk" else [value])]
                    proc = subprocess.run(command, capture_output=True, text=True)
                    lines = [line for line in proc.stdout.splitlines()
                             if line.startswith("RESULT ")]
                    if proc.returncode or not lines:
                        print(f"case {case} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                        continue
                    result = json.loads(lines[-1][len("RESULT "):])
                    results.append(result)
                    print(f"# {case}: {result}", file=sys.stderr, flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
