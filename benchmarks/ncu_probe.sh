#!/usr/bin/env bash
# Tensor-core instruction mix of each kernel from ncu's hardware counters: Hopper's
# warpgroup MMA (gmma, HGMMA in SASS) against the Ampere-style path (hmma), plus
# registers and shared memory per program. One d128 forward+backward step.
# Usage (repo root, on the GPU machine): bash benchmarks/ncu_probe.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
script=$(mktemp --suffix=.py)
cat > "$script" <<'PY'
import jax, jax.numpy as jnp, pallas_attn
q = jax.random.normal(jax.random.key(0), (1, 2048, 4, 128), jnp.bfloat16)
loss = lambda q: jnp.sum(pallas_attn.dot_product_attention(q, q, q).astype(jnp.float32) ** 2)
jax.block_until_ready(jax.jit(jax.grad(loss))(q))
PY
want='^(sm|smsp)__inst_executed_pipe_tensor_op_(gmma|hmma)$|^(sm|smsp)__pipe_tensor_op_(gmma|hmma)_cycles_active$'
names=$(ncu --query-metrics 2>/dev/null | awk '{print $1}' | grep -E "$want" | sed 's/$/.sum/' | paste -sd, -)
echo "tensor metrics found: ${names:-none}"
ncu --clock-control none --kernel-name regex:pallas --launch-count 6 \
  --metrics "${names:+$names,}launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__block_size,gpu__time_duration.sum" \
  python3 "$script" 2>&1 | grep -vE "^==PROF==|Warning|warn" | tee "$OUT/ncu.txt" | tail -60
