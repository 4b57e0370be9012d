#!/usr/bin/env bash
# Which tensor-core instructions does Triton emit for the kernels? (wgmma = Hopper's
# warpgroup MMA; mma.sync = the Ampere-style path.) Dumps XLA's compilation of one
# forward+backward step (HLO, LLVM IR and PTX where XLA writes them) and counts both
# instruction kinds in every dumped file that mentions either.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}; dump=$(mktemp -d)
XLA_FLAGS="--xla_dump_to=$dump --xla_gpu_dump_llvmir=true" python3 - <<'PY'
import jax, jax.numpy as jnp, pallas_attn
q = jax.random.normal(jax.random.key(0), (1, 1024, 4, 128), jnp.bfloat16)
f = jax.jit(jax.grad(lambda q: jnp.sum(pallas_attn.dot_product_attention(q, q, q).astype(jnp.float32) ** 2)))
jax.block_until_ready(f(q))
PY
echo "dumped $(ls "$dump" | wc -l) files; kinds: $(ls "$dump" | sed 's/.*\.//' | sort | uniq -c | tr '\n' ' ')"
grep -rlE "wgmma|mma\.sync|nvvm\.mma|HGMMA" "$dump" | while read -r f; do
  echo "$(basename "$f"): wgmma=$(grep -c wgmma "$f") mma.sync=$(grep -cE 'mma\.sync|nvvm\.mma' "$f")"
done | head -20
tar czf "$OUT/dump.tgz" -C "$dump" . 2>/dev/null || true
