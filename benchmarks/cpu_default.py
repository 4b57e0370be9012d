"""The CPU default against jax.nn's XLA attention: forward+backward milliseconds.

For each length (T = S) and causal or not, one jitted `jax.grad` of `sum(out * dO)` with
respect to q, k and v, float32, B=2, N=8, head dim 64, through
`jax.nn.dot_product_attention(implementation="xla")` and through
`pallas_attn.dot_product_attention` with no implementation given (the path the routing
table picks on a CPU, named in the table); the best of rounds that call the two in
turn (20 rounds up to T = 512, 8 up to 2048, then 3).

    .venv/bin/python benchmarks/cpu_default.py 256 512 768 1024 2048 4096 8192
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

import pallas_attn


def best_ms(fns, *args, repeats: int) -> list[float]:
    """Each function's best time over `repeats` rounds that call them in turn, so that the
    shared machine's slow spells fall on both alike."""
    for fn in fns:
        jax.block_until_ready(fn(*args))
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            spent.append(time.perf_counter() - start)
    return [min(spent) * 1e3 for spent in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lengths", type=int, nargs="+")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int,
                        help="rounds per case (default: 20 to T = 512, 8 to 2048, then 3)")
    args = parser.parse_args()
    print("| T = S | causal | jax.nn xla ms | pallas_attn default ms | default | ratio |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        for causal in (False, True):
            keys = jax.random.split(jax.random.key(0), 4)
            shape = (args.batch, length, args.heads, args.head_dim)
            q, k, v, d_out = (jax.random.normal(key, shape, jnp.float32) for key in keys)
            grads = []
            for attention in (
                    functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                      implementation="xla"),
                    functools.partial(pallas_attn.dot_product_attention, is_causal=causal)):
                def loss(q, k, v, d_out, attention=attention):
                    return jnp.sum(attention(q, k, v) * d_out)

                grads.append(jax.jit(jax.grad(loss, argnums=(0, 1, 2))))
            times = best_ms(grads, q, k, v, d_out, repeats=args.repeats or
                            (20 if length <= 512 else 8 if length <= 2048 else 3))
            default = pallas_attn.explain(q, k, v, is_causal=causal).implementation
            print(f"| {length} | {'yes' if causal else 'no'} | {times[0]:.1f} | {times[1]:.1f} "
                  f"| {default} | {times[1] / times[0]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
