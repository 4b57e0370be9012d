"""python -m pallas_attn {bench,check,tune}: see `python -m pallas_attn --help`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_attn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="speed table vs jax.nn (GPU); interpreter check (CPU)")
    bench.add_argument("--quick", action="store_true", help="head dim 128 only")
    bench.add_argument("--features", action="store_true", help="also time bias, ALiBi, ...")
    bench.add_argument("--json", help="write the rows to this file")
    bench.add_argument("--plot", help="write a TFLOP/s bar chart (PNG) to this file")
    check = sub.add_parser("check", help="kernel numerics vs the reference")
    check.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)

    from pallas_attn import bench as bench_lib

    gpu = bench_lib.on_gpu()
    if args.command == "check" or (args.command == "bench" and not gpu):
        if not gpu:
            print("No GPU: checking the Pallas kernels in the Pallas interpreter (CPU) against "
                  "the reference at small sizes. Speed needs an NVIDIA GPU.")
        results = bench_lib.check(bench_lib.check_shapes(gpu), interpret=not gpu)
        ok = all(r["ok"] for r in results)
        print(f"{sum(r['ok'] for r in results)} passed, {sum(not r['ok'] for r in results)} failed")
        if getattr(args, "json", None):
            bench_lib.write_json(args.json, results)
        return 0 if ok else 1
    shapes = bench_lib.standard_shapes(args.quick)
    if args.features:
        shapes += bench_lib.feature_shapes()
    rows = bench_lib.benchmark(shapes)
    print(bench_lib.describe_device())
    print(bench_lib.format_table(rows))
    if args.json:
        bench_lib.write_json(args.json, rows)
    if args.plot:
        bench_lib.plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
