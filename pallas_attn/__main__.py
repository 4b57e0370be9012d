"""python -m pallas_attn {bench,check,tune}: see `python -m pallas_attn --help`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_attn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="speed table vs jax.nn (GPU); interpreter check (CPU)")
    bench.add_argument("--quick", action="store_true", help="head dim 128 only")
    bench.add_argument("--set", choices=["standard", "features", "all"], default="standard",
                       help="standard shapes (head dims 64/128/256), feature costs, or both")
    bench.add_argument("--match", help="only shapes whose label matches this regex (re.search)")
    bench.add_argument("--impl", nargs="+", metavar="NAME",
                       help="only these implementations: pallas_attn, cudnn, xla")
    bench.add_argument("--json", help="write the rows to this file")
    bench.add_argument("--plot", help="write a TFLOP/s bar chart (PNG) to this file")
    check = sub.add_parser("check", help="kernel numerics vs the reference")
    check.add_argument("--match", help="only shapes whose label matches this regex (re.search)")
    check.add_argument("--json", help="write the results to this file")
    tune = sub.add_parser("tune", help="time tile candidates on the GPU and cache the best")
    tune.add_argument("--head-dim", type=int, nargs="+", default=[64, 128, 256])
    tune.add_argument("--seq-len", type=int, default=4096)
    tune.add_argument("--batch", type=int, default=4)
    tune.add_argument("--heads", type=int, default=16)
    tune.add_argument("--kv-heads", type=int, default=None)
    tune.add_argument("--dtype", default="bfloat16")
    tune.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    tune.add_argument("--bias", action="store_true", help="with a [1, N, T, S] bias (+ dbias)")
    tune.add_argument("--json", help="write every timing to this file")
    args = parser.parse_args(argv)
    if args.command == "tune":
        return _tune(args)

    from pallas_attn import bench as bench_lib

    if args.command == "bench":
        shapes = _bench_shapes(args, parser, bench_lib)
        only = _bench_implementations(args, parser, bench_lib)
    gpu = bench_lib.on_gpu()
    if args.command == "check" or (args.command == "bench" and not gpu):
        if not gpu:
            print("No GPU: checking the Pallas kernels in the Pallas interpreter (CPU) against "
                  "the reference at small sizes. Speed needs an NVIDIA GPU"
                  + (", and so do the shapes --set/--match select." if args.command == "bench"
                     else "."))
        shapes = bench_lib.check_shapes(gpu)
        if args.command == "check":
            shapes = _matching(shapes, args.match, parser, "check's shapes")
        results = bench_lib.check(shapes, interpret=not gpu)
        ok = all(r["ok"] for r in results)
        print(f"{sum(r['ok'] for r in results)} passed, {sum(not r['ok'] for r in results)} failed")
        if getattr(args, "json", None):
            bench_lib.write_json(args.json, results)
        return 0 if ok else 1
    rows = bench_lib.benchmark(shapes, only=only)
    print(bench_lib.describe_device())
    print(bench_lib.format_table(rows))
    if args.json:
        bench_lib.write_json(args.json, rows)
    if args.plot:
        bench_lib.plot(rows, args.plot)
    return 0


def _bench_shapes(args: argparse.Namespace, parser: argparse.ArgumentParser,
                  bench_lib) -> list:
    shapes = [] if args.set == "features" else bench_lib.standard_shapes(args.quick)
    if args.set != "standard":
        shapes += bench_lib.feature_shapes()
    return _matching(shapes, args.match, parser, f"--set {args.set}")


def _matching(shapes: list, match: str | None, parser: argparse.ArgumentParser,
              where: str) -> list:
    """The shapes whose label (dtype included) matches the regex (all when None)."""
    if not match:
        return shapes
    import re

    try:
        pattern = re.compile(match)
    except re.error as e:
        parser.error(f"--match {match!r} is not a regex: {e}")
    shapes = [s for s in shapes if pattern.search(f"{s.label} {s.dtype}")]
    if not shapes:
        parser.error(f"--match {match!r} selects no shape of {where}")
    return shapes


def _bench_implementations(args: argparse.Namespace, parser: argparse.ArgumentParser,
                           bench_lib) -> list[str] | None:
    if not args.impl:
        return None
    names = {name.split()[-1]: name for name in bench_lib.IMPLEMENTATIONS}
    unknown = [x for x in args.impl if x not in names]
    if unknown:
        parser.error(f"--impl {' '.join(unknown)}: choose from {', '.join(names)}")
    return [names[x] for x in args.impl]


def _tune(args: argparse.Namespace) -> int:
    import json

    from pallas_attn import autotune, bench

    if not bench.on_gpu():
        print("tune times kernels on an NVIDIA GPU; none found", file=sys.stderr)
        return 2
    report = []
    causal = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    for head_dim in args.head_dim:
        for is_causal in causal:
            print(f"== head dim {head_dim}, causal {is_causal}, T=S={args.seq_len}")
            result = autotune.tune_problem(
                batch=args.batch, q_len=args.seq_len, kv_len=args.seq_len, heads=args.heads,
                kv_heads=args.kv_heads or args.heads, head_dim=head_dim, dtype=args.dtype,
                is_causal=is_causal, bias=args.bias,
                kernels=("forward", "dkdv", "dq", "dbias") if args.bias else
                ("forward", "dkdv", "dq"))
            report.append({"head_dim": head_dim, "causal": is_causal, "bias": args.bias,
                           "best": str(result["best"]), "heuristic": str(result["heuristic"]),
                           "results": {k: [(list(e), t, err) for e, t, err in rows]
                                       for k, rows in result["results"].items()}})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
