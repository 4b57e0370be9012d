"""Where the time of one problem goes: each Pallas kernel timed alone (GPU only).

For a problem (bf16 by default, B x N heads, T = S, with a bias, ALiBi or a soft
cap as asked), prints the plan dot_product_attention runs and the milliseconds of
its forward, dK/dV, dQ and (with --bias) dbias kernels, and of the dK/dV kernel
writing dbias itself where it can (the Mosaic one for either bias, the Triton one
for a bias per batch entry and head, --bias-per-batch); then one jitted
forward+backward as `python -m pallas_attn bench` times it (for a per-batch bias
fused and not; for a batch-shared one summed in turn, in no fixed order and by the
dbias kernel), so the kernels' sum can be checked against the whole.

    PYTHONPATH=. python benchmarks/kernel_times.py --head-dim 128 --bias
    PYTHONPATH=. python benchmarks/kernel_times.py --alibi   # or --soft-cap 30
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--bias", action="store_true", help="a [1, N, T, S] bias with dbias")
    parser.add_argument("--bias-per-batch", action="store_true",
                        help="a [B, N, T, S] bias instead (implies --bias)")
    parser.add_argument("--alibi", action="store_true", help="ALiBi slopes per head")
    parser.add_argument("--soft-cap", type=float, default=None, help="logits_soft_cap")
    parser.add_argument("--end-to-end-only", action="store_true",
                        help="skip the per-kernel timings")
    args = parser.parse_args(argv)
    args.bias = args.bias or args.bias_per_batch
    if jax.devices()[0].platform != "gpu":
        print("kernel_times needs an NVIDIA GPU", file=sys.stderr)
        return 2

    import pallas_attn
    from pallas_attn import bench
    from pallas_attn.tuning import autotune

    plan, runner = autotune.kernel_runner(
        batch=args.batch, q_len=args.seq_len, kv_len=args.seq_len, heads=args.heads,
        kv_heads=args.heads, head_dim=args.head_dim, is_causal=args.causal, bias=args.bias,
        bias_per_batch=args.bias_per_batch, alibi=args.alibi, soft_cap=args.soft_cap)
    roles = ["forward", "dkdv", "dq"] + (["dbias"] if args.bias else [])
    # dK/dV writing dbias: the Mosaic kernel for either bias, the Triton one only for
    # a bias per batch entry.
    if args.bias_per_batch or (args.bias and plan.dkdv.backend == "mosaic"):
        roles.append("dkdv_dbias")
    if args.end_to_end_only:
        roles = []
    print(plan)
    if args.bias and plan.dbias.fused:  # time the separate dbias kernel too
        separate, _ = autotune.kernel_runner(
            batch=args.batch, q_len=args.seq_len, kv_len=args.seq_len, heads=args.heads,
            kv_heads=args.heads, head_dim=args.head_dim, is_causal=args.causal,
            bias=args.bias, bias_per_batch=args.bias_per_batch, alibi=args.alibi,
            soft_cap=args.soft_cap, block_sizes=pallas_attn.BlockSizes(fuse_dbias=False))
        plan = dataclasses.replace(plan, dbias=separate.dbias)
    print("| kernel | route | ms |\n|---|---|---|")
    for role in roles:
        route = plan.route("dkdv" if role == "dkdv_dbias" else role)
        try:
            ms = autotune.time_call(runner(role, route)) * 1e3
            print(f"| {role} | {route.describe()} | {ms:.3f} |")
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            print(f"| {role} | {route.describe()} | fails: {type(e).__name__}: "
                  f"{str(e)[:200]} |")
    # End to end: one jitted forward+backward (as `bench` times it), for a bias both
    # ways of computing dbias.
    features = []
    if args.bias:
        features.append(("bias_per_batch" if args.bias_per_batch else "bias", None))
    if args.alibi:
        features.append(("alibi", None))
    if args.soft_cap is not None:
        features.append(("softcap", args.soft_cap))
    shape = bench.Shape(args.batch, args.seq_len, args.seq_len, args.heads, args.heads,
                        args.head_dim, args.causal, tuple(features))
    inputs = bench.make_inputs(shape)
    # A per-batch bias's dbias both ways; a batch-shared one's summed in turn (the
    # default), in no fixed order, and by the dbias kernel.
    variants = {"": pallas_attn.BlockSizes()}
    if args.bias_per_batch:
        variants = {f", fuse_dbias={fuse}": pallas_attn.BlockSizes(fuse_dbias=fuse)
                    for fuse in (False, True)}
    elif args.bias:
        variants.update({", deterministic=False": pallas_attn.BlockSizes(deterministic=False),
                         ", fuse_dbias=False": pallas_attn.BlockSizes(fuse_dbias=False)})
    for label, block_sizes in variants.items():
        attention = functools.partial(pallas_attn.dot_product_attention,
                                      implementation="pallas", block_sizes=block_sizes)
        step = bench._loss_and_grad(attention, inputs)
        seconds = autotune.time_call(lambda step=step: step(
            inputs["query"], inputs["key"], inputs["value"], inputs["kwargs"].get("bias"),
            inputs["cotangent"]))
        print(f"end to end forward+backward{label}: {seconds * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
