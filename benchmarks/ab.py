"""Time two source trees of pallas_attn in one GPU session: before/after a change.

Run-to-run spread on the GPU machines (4-15%, docs/decisions.md) is as large as most
changes, so a change is judged against its parent measured minutes apart on the
same machine, not against last session's table. Each tree runs in its own process
(`PYTHONPATH=<tree>`), through that tree's own `pallas_attn.bench` (the shapes,
inputs and timer of `python -m pallas_attn bench`), pallas_attn rows only; the
trees run in turn, `--rounds` times, and the table keeps each row's best time.

Usage (repository root, on the GPU machine):

    git archive <commit> pallas_attn | tar -x -C /tmp/base     # the "before" tree
    python benchmarks/ab.py /tmp/base . --set all --match "H128" --json out/ab.json
    python benchmarks/ab.py /tmp/base . --shape 8,4096,4096,16,16,64,dropout=0.1 \
        --shape 4,4096,4096,16,16,128,causal,bias     # rows outside the sets
    python benchmarks/ab.py . .:dkv_backend=mosaic --shape 4,4096,4096,16,16,128,causal,packed=4
        # one tree as routed and with BlockSizes fields given (TREE:field=value,...)

The table lists, per shape, each tree's forward and forward+backward milliseconds
and the ratio of the last tree to the first (below 1: the last tree is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

_WORKER = r"""
import dataclasses, json, os, re, sys
import pallas_attn
from pallas_attn import bench
assert os.path.dirname(os.path.dirname(pallas_attn.__file__)) == os.getcwd(), pallas_attn.__file__
which, pattern, dtype, given, blocks = sys.argv[1:6]
if given:
    shapes = [bench.Shape(**{**d, "features": tuple(map(tuple, d["features"]))})
              for d in json.loads(given)]
else:
    shapes = {"standard": bench.standard_shapes, "features": bench.feature_shapes,
              "all": lambda: bench.standard_shapes() + bench.feature_shapes(),
              "wide": bench.wide_shapes, "long": bench.long_shapes}[which]()
shapes = [dataclasses.replace(s, dtype=dtype or s.dtype) for s in shapes
          if re.search(pattern, s.label)]
implementations = bench.implementations
blocks = json.loads(blocks)
if blocks:
    bench.implementations = lambda interpret: {
        "pallas_attn": lambda q, k, v, **kw: pallas_attn.dot_product_attention(
            q, k, v, implementation="pallas", interpret=interpret,
            block_sizes=pallas_attn.BlockSizes(**blocks), **kw)}
else:
    bench.implementations = lambda interpret: {
        k: v for k, v in implementations(interpret).items() if k == "pallas_attn"}
rows = bench.benchmark(shapes, log=lambda line: None)
print("ROWS " + json.dumps(rows))
"""


def parse_shape(text: str) -> dict:
    """A bench.Shape's fields from "B,T,S,N,K,H[,causal][,feature[=value]]..."."""
    parts = text.split(",")
    try:
        sizes = [int(x) for x in parts[:6]]
    except ValueError:
        sizes = []
    if len(sizes) != 6:
        raise argparse.ArgumentTypeError(f"--shape wants B,T,S,N,K,H first, got {text!r}")
    fields = dict(zip(("batch", "q_len", "kv_len", "heads", "kv_heads", "head_dim"), sizes,
                      strict=True))
    features = []
    for part in parts[6:]:
        if part == "causal":
            fields["causal"] = True
            continue
        name, _, value = part.partition("=")
        number = None if not value else float(value)
        features.append((name, int(number) if number is not None and number.is_integer()
                         else number))
    return {**fields, "features": features}


def parse_tree(text: str) -> tuple[str, dict]:
    """(directory, BlockSizes fields) from "TREE" or "TREE:field=value,...": the fields
    are passed to every pallas_attn call of that tree."""
    tree, _, fields = text.partition(":")
    blocks = {}
    for item in filter(None, fields.split(",")):
        name, _, value = item.partition("=")
        if not value:
            raise argparse.ArgumentTypeError(f"tree {text!r}: want field=value, got {item!r}")
        blocks[name] = (int(value) if value.lstrip("-").isdigit()
                        else {"True": True, "False": False, "None": None}.get(value, value))
    return tree, blocks


def run_tree(tree: str, which: str, pattern: str, dtype: str = "",
             shapes: list[dict] | None = None) -> list[dict]:
    # NOTE: `python -c` puts the working directory first on sys.path, ahead of
    # PYTHONPATH: the worker runs inside the tree, so each tree imports its own code.
    tree, blocks = parse_tree(tree)
    tree = os.path.abspath(tree)
    env = dict(os.environ, PYTHONPATH=tree)
    given = json.dumps(shapes) if shapes else ""
    result = subprocess.run([sys.executable, "-c", _WORKER, which, pattern, dtype, given,
                             json.dumps(blocks)],
                            env=env,
                            cwd=tree, capture_output=True, text=True, check=False)
    for line in result.stdout.splitlines():
        if line.startswith("ROWS "):
            return json.loads(line[5:])
    raise RuntimeError(f"tree {tree} failed:\n{result.stderr[-4000:]}")


def best(rows_per_round: list[list[dict]]) -> dict[str, dict]:
    """Per shape label: the best forward and forward+backward time over the rounds."""
    table: dict[str, dict] = {}
    for rows in rows_per_round:
        for row in rows:
            entry = table.setdefault(row["shape"], {})
            if "error" in row:
                entry.setdefault("error", row["error"])
                continue
            for key in ("fwd_ms", "fwdbwd_ms"):
                entry[key] = min(entry.get(key, float("inf")), row[key])
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+",
                        help="source trees (directories holding pallas_attn/), each "
                             "optionally TREE:field=value,... (BlockSizes fields)")
    parser.add_argument("--set", choices=["standard", "features", "all", "wide", "long"],
                        default="standard")
    parser.add_argument("--shape", action="append", type=parse_shape, default=[],
                        help="B,T,S,N,K,H[,causal][,feature[=value]]...: time these "
                             "shapes instead of a set (repeatable)")
    parser.add_argument("--match", default="", help="regex over shape labels")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dtype", default="", choices=["", "bfloat16", "float16", "float32"],
                        help="the shapes' dtype (default: the set's)")
    parser.add_argument("--json", help="write every round's rows here")
    args = parser.parse_args(argv)
    if len(args.trees) < 2:
        parser.error("give at least two trees")
    for tree in args.trees:
        try:
            parse_tree(tree)
        except argparse.ArgumentTypeError as e:
            parser.error(str(e))
    re.compile(args.match)
    rounds: dict[str, list[list[dict]]] = {tree: [] for tree in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            rounds[tree].append(run_tree(tree, args.set, args.match, args.dtype, args.shape))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounds, f, indent=1)
    tables = {tree: best(r) for tree, r in rounds.items()}
    first, last = args.trees[0], args.trees[-1]
    header = " | ".join(f"{t} fwd ms | {t} fwd+bwd ms" for t in args.trees)
    print(f"| shape | {header} | fwd ratio | fwd+bwd ratio |")
    print("|---" * (3 + 2 * len(args.trees)) + "|")
    for shape in tables[first]:
        cells, ok = [], True
        for tree in args.trees:
            entry = tables[tree].get(shape, {})
            if "fwd_ms" not in entry or "fwdbwd_ms" not in entry:
                cells.append(f"fails: {entry.get('error', 'missing')[:60]} | ")
                ok = False
            else:
                cells.append(f"{entry['fwd_ms']:.3f} | {entry['fwdbwd_ms']:.3f}")
        ratios = " | "
        if ok:
            a, b = tables[first][shape], tables[last][shape]
            ratios = f"{b['fwd_ms'] / a['fwd_ms']:.3f} | {b['fwdbwd_ms'] / a['fwdbwd_ms']:.3f}"
        print(f"| {shape} | {' | '.join(cells)} | {ratios} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
