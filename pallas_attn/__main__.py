"""pallas_attn's commands.

  bench    speed next to jax.nn's cuDNN and XLA attention on a GPU (TFLOP/s of the
           forward and of forward+backward); on a CPU, a labelled interpreter check
  check    every kernel's outputs and gradients against the reference at realistic
           sizes (FlashAttention's rule: at most twice the same-dtype reference's error)
  tune     time Triton tile candidates on the GPU and cache the fastest
  explain  the plan for one problem: which kernel runs each role, with which tiles, and
           why a faster one was not taken (plans for an H100 on a machine without a GPU)
  plot     a TFLOP/s bar chart of bench's results (--json), on any machine
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_attn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="speed table vs jax.nn (GPU); interpreter check (CPU)",
                           description="Times pallas_attn next to jax.nn's cuDNN and XLA "
                           "attention in one process (TFLOP/s of the forward and of "
                           "forward+backward). On a machine without an NVIDIA GPU it runs "
                           "the kernels in the interpreter against the reference instead.")
    bench.add_argument("--quick", action="store_true", help="head dim 128 only")
    bench.add_argument("--set", choices=["standard", "features", "all", "wide", "long",
                                         "decode"],
                       default="standard",
                       help="standard shapes (head dims 64/128/256), feature costs, both, "
                            "wide (head dims 32-256, lengths 512-32768, T != S, GQA), long "
                            "(one sequence of 16k-128k tokens, with the fwd+bwd program's "
                            "memory), or decode (a few query tokens against a KV cache: "
                            "forward ms and K/V read bandwidth)")
    bench.add_argument("--match", help="only shapes whose label matches this regex (re.search)")
    bench.add_argument("--impl", nargs="+", metavar="NAME",
                       help="only these implementations: pallas_attn, cudnn, xla, mgpu "
                            "(JAX's own Mosaic GPU kernel: float16, causal masking only)")
    bench.add_argument("--dtype", choices=["bfloat16", "float16"],
                       help="run every shape in this dtype instead of its own")
    bench.add_argument("--rounds", type=int, default=1,
                       help="time every row this many times, the implementations taking "
                            "turns, and keep each row's best")
    bench.add_argument("--json", help="write the rows to this file")
    bench.add_argument("--plot", help="write a TFLOP/s bar chart (PNG) to this file")
    check = sub.add_parser("check", help="kernel numerics vs the reference",
                           description="Outputs, logsumexp and every gradient of the kernels "
                           "against the reference on float32-upcast inputs, at realistic "
                           "sizes on a GPU (small ones in the interpreter on a CPU).")
    check.add_argument("--match", help="only shapes whose label matches this regex (re.search)")
    check.add_argument("--json", help="write the results to this file")
    check.add_argument("--random", type=int, metavar="N",
                       help="check N random combinations of every feature instead of the "
                            "fixed shapes (the same N for the same --seed)")
    check.add_argument("--seed", type=int, default=0, help="--random's seed")
    check.add_argument("--jobs", type=int, default=1,
                       help="run the shapes in this many processes at once, sharing the "
                            "GPU's memory (compiling dominates a shape's time)")
    check.add_argument("--rounds", type=int, default=1,
                       help="run every shape this many times, each time in new worker "
                            "processes, and fail a shape whose results differ in a bit "
                            "between them (the second call in one process is always "
                            "compared)")
    check.add_argument("--shard", help=argparse.SUPPRESS)  # I/N: a --jobs worker's part
    tune = sub.add_parser("tune", help="time tile candidates on the GPU and cache the best",
                          description="Times each Triton kernel's tile candidates alone on "
                          "the GPU and stores the fastest in the tile cache "
                          "($PALLAS_ATTN_CACHE_DIR, default ~/.cache/pallas_attn).")
    tune.add_argument("--head-dim", type=int, nargs="+", default=[64, 128, 256])
    tune.add_argument("--seq-len", type=int, default=4096)
    tune.add_argument("--batch", type=int, default=4)
    tune.add_argument("--heads", type=int, default=16)
    tune.add_argument("--kv-heads", type=int, default=None)
    tune.add_argument("--dtype", default="bfloat16")
    tune.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    tune.add_argument("--bias", action="store_true", help="with a [1, N, T, S] bias (+ dbias)")
    tune.add_argument("--json", help="write every timing to this file")
    explain = sub.add_parser("explain", help="the plan for one problem (which kernel runs "
                             "each role, and why)",
                             description="Prints which implementation runs the problem and, "
                             "for the kernels, the backend and tiles of each role (forward, "
                             "dQ, dK/dV, dbias) with the reason each faster one was not "
                             "taken. Needs no GPU: it plans for this machine's or the one "
                             "--capability names.")
    explain.add_argument("--batch", type=int, default=4)
    explain.add_argument("--q-len", type=int, default=4096)
    explain.add_argument("--kv-len", type=int, default=None, help="default: --q-len")
    explain.add_argument("--heads", type=int, default=16)
    explain.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    explain.add_argument("--head-dim", type=int, default=128)
    explain.add_argument("--value-head-dim", type=int, default=None)
    explain.add_argument("--dtype", default="bfloat16")
    explain.add_argument("--causal", action="store_true")
    explain.add_argument("--alignment", choices=["top_left", "bottom_right"],
                         default="top_left")
    explain.add_argument("--window", metavar="LEFT[,RIGHT]", help="local_window_size")
    explain.add_argument("--softcap", type=float, help="logits_soft_cap")
    explain.add_argument("--alibi", action="store_true", help="ALiBi slopes per head")
    explain.add_argument("--bias", metavar="SHAPE",
                         help="Bb,Nb for a [Bb, Nb, T, S] bias, or Bb,Nb,Tb,Sb")
    explain.add_argument("--bias-dtype", help="default: --dtype")
    explain.add_argument("--mask", action="store_true", help="a boolean mask [B, 1, T, S]")
    explain.add_argument("--segments", action="store_true", help="segment ids")
    explain.add_argument("--lengths", action="store_true", help="sequence lengths")
    explain.add_argument("--dropout", type=float, default=0.0, help="dropout_rate")
    explain.add_argument("--implementation", choices=["pallas", "xla", "xla_chunked"])
    explain.add_argument("--capability", help="plan for this compute capability, e.g. 8.0 "
                         "(default: this machine's GPU, or an H100 without one)")
    explain.add_argument("--sms", type=int, help="multiprocessors of that device")
    plot = sub.add_parser("plot", help="a TFLOP/s bar chart of bench's --json results",
                          description="Draws the forward and forward+backward TFLOP/s of "
                          "each shape and implementation in a file `bench --json` wrote "
                          "(on the GPU machine), titled with the device it names; needs "
                          "matplotlib, not a GPU.")
    plot.add_argument("results", help="a JSON file written by `bench --json`")
    plot.add_argument("out", help="the PNG file to write")
    args = parser.parse_args(argv)
    if args.command == "plot":
        return _plot(args, parser)
    if args.command == "check":
        _without_gpu_autotuning()
    if args.command == "tune":
        return _tune(args)
    if args.command == "explain":
        return _explain(args, parser)

    from pallas_attn import bench as bench_lib

    if args.command == "bench":
        if args.rounds < 1:
            parser.error(f"--rounds must be at least 1, got {args.rounds}")
        shapes = _bench_shapes(args, parser, bench_lib)
        only = _bench_implementations(args, parser, bench_lib)
    gpu = bench_lib.on_gpu()
    if args.command == "bench" and not gpu:
        given = [flag for flag, on in (("--plot", args.plot), ("--quick", args.quick),
                                       ("--impl", args.impl), ("--match", args.match),
                                       ("--dtype", args.dtype),
                                       ("--rounds", args.rounds != 1),
                                       ("--set", args.set != "standard")) if on]
        if given:
            parser.error(f"{' '.join(given)} time shapes on an NVIDIA GPU; this machine has "
                         f"none (bench alone runs the interpreter check here)")
    if args.command == "check" or (args.command == "bench" and not gpu):
        if not gpu:
            print("No GPU: checking the Pallas kernels in the Pallas interpreter (CPU) against "
                  "the reference at small sizes. Speed needs an NVIDIA GPU"
                  + (", and so do the shapes --set/--match select." if args.command == "bench"
                     else "."))
        shapes = bench_lib.check_shapes(gpu)
        if args.command == "check" and args.random is not None:
            if args.random < 1:
                parser.error(f"--random must be at least 1, got {args.random}")
            shapes = bench_lib.random_check_shapes(args.random, args.seed, gpu)
        if args.command == "check":
            shapes = _matching(shapes, args.match, parser, "check's shapes")
            for flag, value in (("--jobs", args.jobs), ("--rounds", args.rounds)):
                if value < 1:
                    parser.error(f"{flag} must be at least 1, got {value}")
            if args.shard:
                part, _, parts = args.shard.partition("/")
                if not (part.isdigit() and parts.isdigit() and int(part) < int(parts)):
                    parser.error(f"--shard takes I/N with 0 <= I < N, got {args.shard!r}")
                shapes = shapes[int(part)::int(parts)]
        print("Each value: the relative error against the reference run on float32-upcast "
              "inputs, with the same-dtype reference's own error as (ref); a shape passes "
              "when every value is at most 2 x ref + a floor.")
        if args.command == "check" and args.rounds > 1:
            results = bench_lib.across_processes(
                [_check_in_jobs(args, gpu) for _ in range(args.rounds)])
        elif args.command == "check" and args.jobs > 1:
            results = _check_in_jobs(args, gpu)
        else:
            results = bench_lib.check(shapes, interpret=not gpu)
        ok = all(r["ok"] for r in results)
        print(f"{sum(r['ok'] for r in results)} passed, {sum(not r['ok'] for r in results)} failed")
        if getattr(args, "json", None):
            bench_lib.write_json(args.json, results)
        return 0 if ok else 1
    if args.set == "decode":
        rows = bench_lib.decode_benchmark(shapes, only=only, rounds=args.rounds)
        print(_bench_header(args, bench_lib))
        print(bench_lib.format_decode_table(rows, bench_lib.copy_bandwidth() / 1e12))
        if args.json:
            bench_lib.write_json(args.json, rows)
        return 0
    rows = bench_lib.benchmark(shapes, only=only, memory=args.set == "long",
                               rounds=args.rounds)
    print(_bench_header(args, bench_lib))
    print(bench_lib.format_table(rows))
    if args.json:
        bench_lib.write_json(args.json, rows)
    if args.plot:
        bench_lib.plot(rows, args.plot, bench_lib.describe_device())
    return 0


def _plot(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`plot`: bench's JSON rows (their device named in the file) as a bar chart."""
    import importlib.util
    import json
    import os

    try:
        with open(args.results) as f:
            results = json.load(f)
    except (OSError, ValueError) as e:
        parser.error(f"cannot read bench results from {args.results!r}: {e}")
    rows = results.get("rows") if isinstance(results, dict) else None
    rows = [r for r in rows if isinstance(r, dict) and {"shape", "impl", "fwd_tflops"} <= set(r)
            ] if isinstance(rows, list) else []
    if not rows:  # rows of failed calls have no times: they are left out
        parser.error(f"{args.results!r} holds no TFLOP/s rows (bench --json of --set "
                     f"standard, features, all, wide or long writes them)")
    folder = os.path.dirname(args.out) or "."
    if not os.path.isdir(folder):
        parser.error(f"plot's out {args.out!r}: no folder {folder!r} to write it in")
    if importlib.util.find_spec("matplotlib") is None:
        parser.error("plot needs matplotlib (pip install matplotlib, or the project's "
                     "'examples' extra)")
    from pallas_attn import bench as bench_lib

    bench_lib.plot(rows, args.out, str(results.get("device", "device not recorded")))
    print(f"wrote {args.out}")
    return 0


def _bench_header(args: argparse.Namespace, bench_lib) -> str:
    """The device line over a bench table, with the dtype --dtype gave every shape."""
    return bench_lib.describe_device() + (f", every shape in {args.dtype}" if args.dtype else "")


def _bench_shapes(args: argparse.Namespace, parser: argparse.ArgumentParser,
                  bench_lib) -> list:
    if args.set == "decode":
        shapes = bench_lib.decode_shapes()
    elif args.set == "wide":
        shapes = bench_lib.wide_shapes()
    elif args.set == "long":
        shapes = bench_lib.long_shapes()
    else:
        shapes = [] if args.set == "features" else bench_lib.standard_shapes(args.quick)
        if args.set != "standard":
            shapes += bench_lib.feature_shapes()
    if args.dtype:
        shapes = [dataclasses.replace(shape, dtype=args.dtype) for shape in shapes]
    return _matching(shapes, args.match, parser, f"--set {args.set}")


def _without_gpu_autotuning() -> None:
    """XLA's GPU autotuning off for this process and its workers, unless XLA_FLAGS sets
    it: it times the reference's fusions and matmuls at every compile, and with several
    check processes on one GPU that took most of check's time (the kernels checked are
    Pallas calls it does not tune; docs/decisions.md, "check without XLA's autotuning")."""
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_autotune_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_autotune_level=0".strip()


def _check_in_jobs(args: argparse.Namespace, gpu: bool) -> list:
    """`check` over args.jobs worker processes, each running every jobs-th shape with its
    share of the GPU's memory; their lines are printed as each worker ends."""
    import json
    import os
    import subprocess
    import tempfile

    env = dict(os.environ)
    if gpu:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / args.jobs:.3f}")
    with tempfile.TemporaryDirectory() as tmp:
        workers = []
        for part in range(args.jobs):
            out = os.path.join(tmp, f"{part}.json")
            argv = [sys.executable, "-m", "pallas_attn", "check", "--shard",
                    f"{part}/{args.jobs}", "--json", out]
            argv += ["--match", args.match] if args.match else []
            if args.random is not None:
                argv += ["--random", str(args.random), "--seed", str(args.seed)]
            workers.append((subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True), out))
        results = []
        for part, (worker, out) in enumerate(workers):
            text, _ = worker.communicate()
            lines = [line for line in text.splitlines() if line.startswith(("PASS", "FAIL"))]
            print("\n".join(lines) if lines else f"worker {part}: no shape")
            if os.path.exists(out):
                with open(out) as f:
                    results += json.load(f)["rows"]
            elif worker.returncode:
                print(f"worker {part} failed (exit {worker.returncode}):\n{text[-2000:]}")
                results.append({"shape": f"worker {part}", "ok": False})
    return results


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


def _explain(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import jax
    import jax.numpy as jnp

    import pallas_attn
    from pallas_attn.device import on_nvidia_gpu

    B, T, N, H = args.batch, args.q_len, args.heads, args.head_dim
    S, K, Hv = args.kv_len or T, args.kv_heads or N, args.value_head_dim or H
    try:
        dtype = jnp.dtype(args.dtype)
        bias_dtype = jnp.dtype(args.bias_dtype or args.dtype)
    except TypeError as e:
        parser.error(f"--dtype/--bias-dtype: {e}")

    def shape(*dims, dtype=dtype):
        return jax.ShapeDtypeStruct(dims, dtype)

    kwargs = dict(is_causal=args.causal, causal_alignment=args.alignment,
                  logits_soft_cap=args.softcap, dropout_rate=args.dropout,
                  implementation=args.implementation)
    if args.window:
        try:
            window = tuple(int(x) for x in args.window.split(","))
        except ValueError:
            parser.error(f"--window {args.window!r}: expected LEFT or LEFT,RIGHT")
        kwargs["local_window_size"] = window[0] if len(window) == 1 else window
    if args.alibi:
        kwargs["alibi_slopes"] = shape(N, dtype=jnp.float32)
    if args.bias:
        try:
            dims = tuple(int(x) for x in args.bias.split(","))
        except ValueError:
            dims = ()
        if len(dims) not in (2, 4):
            parser.error(f"--bias {args.bias!r}: expected Bb,Nb or Bb,Nb,Tb,Sb")
        kwargs["bias"] = shape(*(dims if len(dims) == 4 else (*dims, T, S)), dtype=bias_dtype)
    if args.mask:
        kwargs["mask"] = shape(B, 1, T, S, dtype=jnp.bool_)
    if args.segments:
        kwargs["q_segment_ids"] = shape(B, T, dtype=jnp.int32)
        kwargs["kv_segment_ids"] = shape(B, S, dtype=jnp.int32)
    if args.lengths:
        kwargs["query_seq_lengths"] = kwargs["key_value_seq_lengths"] = shape(
            B, dtype=jnp.int32)
    if args.dropout:
        kwargs["dropout_rng"] = jax.random.key(0)
    device = None
    if args.capability or not on_nvidia_gpu():
        try:
            major, minor = (int(x) for x in (args.capability or "9.0").split("."))
        except ValueError:
            parser.error(f"--capability {args.capability!r}: expected MAJOR.MINOR, e.g. 9.0")
        device = pallas_attn.DeviceInfo.for_capability((major, minor), args.sms or 132)
        if not args.capability:
            print("No NVIDIA GPU here: planning for an H100 (sm90, 132 SMs); "
                  "--capability plans for another.")
    try:
        plan = pallas_attn.explain(shape(B, T, N, H), shape(B, S, K, H), shape(B, S, K, Hv),
                                   device=device, **kwargs)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    print(plan)
    return 0


def _tune(args: argparse.Namespace) -> int:
    import json

    from pallas_attn import bench
    from pallas_attn.tuning import autotune

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
