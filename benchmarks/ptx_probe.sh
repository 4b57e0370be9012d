#!/usr/bin/env bash
# Which tensor-core instructions does Triton emit for the kernels? (wgmma = Hopper's
# warpgroup MMA; mma.sync = the Ampere-style path.) Dumps XLA's compilation of one
# forward+backward step and counts them per kernel.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}; dump=$(mktemp -d)
XLA_FLAGS="--xla_dump_to=$dump --xla_dump_hlo_pass_re=NONE" python3 - <<'PY'
import jax, jax.numpy as jnp, pallas_attn
q = jax.random.normal(jax.random.key(0), (1, 1024, 4, 128), jnp.bfloat16)
f = jax.jit(jax.grad(lambda q: jnp.sum(pallas_attn.dot_product_attention(q, q, q).astype(jnp.float32) ** 2)))
jax.block_until_ready(f(q))
PY
for f in $(ls "$dump"/*.ptx 2>/dev/null); do
  echo "$(basename "$f"): wgmma=$(grep -c 'wgmma.mma_async' "$f") mma.sync=$(grep -c 'mma.sync' "$f")"
done | sort | uniq | head -20
ls "$dump" | grep -v "\.txt$" | head -5
cp "$dump"/*.ptx "$OUT"/ 2>/dev/null || true
