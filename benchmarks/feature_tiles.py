"""End-to-end timings of a few tile choices per score feature (GPU only).

`tune` sweeps each kernel alone for plain and bias problems; this checks whether
the extra per-score work of a feature (dropout hash, soft cap tanh) moves the best
forward / dK-dV / dQ tiles, by timing the whole jitted forward and forward+backward
with one kernel's tiles changed at a time. Usage (repo root, GPU machine):

    PYTHONPATH=. python benchmarks/feature_tiles.py [--features softcap dropout]
"""

from __future__ import annotations

import argparse
import functools

import jax

import pallas_attn
from pallas_attn import autotune, bench, tuning

VARIANTS = {
    "forward": ((128, 64, 4, 3), (128, 64, 8, 4), (128, 64, 8, 3)),
    "dkdv": ((64, 64, 4, 2), (64, 64, 8, 2), (64, 128, 8, 2)),
    "dq": ((128, 64, 8, 3), (64, 64, 4, 2), (128, 64, 4, 3)),
}
FEATURES = {"plain": (), "softcap": (("softcap", 30.0),), "dropout": (("dropout", 0.1),),
            "alibi": (("alibi", None),), "bias": (("bias", None),)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", nargs="+", default=["plain", "softcap", "dropout"],
                        choices=sorted(FEATURES))
    args = parser.parse_args()
    if not bench.on_gpu():
        raise SystemExit("feature_tiles times kernels on an NVIDIA GPU; none found")
    print(bench.describe_device())
    print("| feature | kernel | tiles | fwd ms | fwd+bwd ms |\n|---|---|---|---|---|")
    for feature in args.features:
        shape = bench.Shape(4, 4096, 4096, 16, 16, 128, features=FEATURES[feature])
        inputs = bench.make_inputs(shape)
        kwargs = inputs["kwargs"]
        base = tuning.choose_block_sizes(
            128, q_len=4096, kv_len=4096, is_causal=False,
            bias_dtype=kwargs["bias"].dtype if "bias" in kwargs else None)
        for kernel, entries in VARIANTS.items():
            for entry in entries:
                blocks = tuning.with_kernel(base, kernel, entry)
                fn = functools.partial(pallas_attn.dot_product_attention, block_sizes=blocks,
                                       implementation="pallas")
                arrays = {x: y for x, y in kwargs.items() if isinstance(y, jax.Array)}
                static = {x: y for x, y in kwargs.items() if x not in arrays}
                q, k, v = inputs["query"], inputs["key"], inputs["value"]
                try:
                    fwd = jax.jit(lambda q, k, v, arrays, fn=fn, static=static: fn(
                        q, k, v, **arrays, **static))
                    t_fwd = autotune.time_call(functools.partial(fwd, q, k, v, arrays))
                    grad = bench._loss_and_grad(fn, inputs)
                    t_both = autotune.time_call(functools.partial(
                        grad, q, k, v, kwargs.get("bias"), inputs["cotangent"]))
                    times = f"{t_fwd * 1e3:.3f} | {t_both * 1e3:.3f}"
                except Exception as e:  # noqa: BLE001 - report and go on
                    times = f"fails: {type(e).__name__} | "
                mark = " (default)" if entry == base.tiles(kernel) else ""
                print(f"| {feature} | {kernel} | {entry}{mark} | {times} |", flush=True)


if __name__ == "__main__":
    main()
