#!/usr/bin/env bash
# The forward kernel of pallas_attn next to cuDNN's (jax.nn.dot_product_attention) on one
# problem, from ncu's counters: each kernel's name (cuDNN's names its tiles, e.g.
# ..._64x128x256_...), launch shape, time, warp instructions issued, L2 and DRAM bytes and
# its largest stall reasons. One warm forward per implementation, each in its own process
# (cudaProfilerStart/Stop around the third call); clocks and caches left alone.
# Usage (repo root, on the GPU machine):
#   bash benchmarks/forward_ncu.sh B T N K H [causal]     e.g. 4 4096 8 8 256 causal
set -uo pipefail
export PYTHONPATH=.:benchmarks PYTHONUNBUFFERED=1
# ncu's replayed passes need device memory XLA's preallocation would hold.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ $# -lt 5 ] || [ $# -gt 6 ]; then
  echo "forward_ncu.sh: usage: B T N K H [causal], got '$*'" >&2; exit 2
fi
for n in "$1" "$2" "$3" "$4" "$5"; do
  case "$n" in ''|*[!0-9]*) echo "forward_ncu.sh: B T N K H must be whole numbers, got '$n'" >&2; exit 2 ;; esac
done
causal=0
case "${6:-}" in "") ;; causal) causal=1 ;; *)
  echo "forward_ncu.sh: the sixth argument must be 'causal', got '$6'" >&2; exit 2 ;;
esac
script=$(mktemp --suffix=.py)
cat > "$script" <<'PY'
import sys
import jax, jax.numpy as jnp
from ncu_report import profile_one_call
import pallas_attn
impl, (B, T, N, K, H), causal = sys.argv[1], map(int, sys.argv[2:7]), sys.argv[7] == "1"
keys = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
k, v = (jax.random.normal(x, (B, T, K, H), jnp.bfloat16) for x in keys[1:])
if impl == "cudnn":
    call = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"))
else:
    call = jax.jit(lambda q, k, v: pallas_attn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="pallas"))
profile_one_call(lambda: call(q, k, v))
PY
metrics="gpu__time_duration.sum,smsp__inst_executed.sum,smsp__inst_executed_pipe_xu.sum,lts__t_bytes.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum"
metrics+=",regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"
for impl in pallas_attn cudnn; do
  csv_out="$OUT/forward_ncu_${impl}_B$1_T$2_N$3_K$4_H$5$( [ "$causal" = 1 ] && echo _causal).csv"
  ncu --clock-control none --profile-from-start off --metrics "$metrics" --csv \
    --print-units base --print-metric-name name python3 "$script" "$impl" "$1" "$2" "$3" "$4" "$5" "$causal" \
    > "$csv_out" 2> "${csv_out%.csv}.stderr" || {
      echo "forward_ncu.sh: ncu failed for $impl, see ${csv_out%.csv}.stderr" >&2
      tail -5 "${csv_out%.csv}.stderr" >&2; continue; }
  python3 - "$csv_out" "$impl" <<'PY'
import sys
from ncu_report import read_kernels
print(f"== {sys.argv[2]}")
for kernel in read_kernels(sys.argv[1]):
    print(f"{kernel.us:9.1f} us  {kernel.name[:100]}  block {kernel.block} grid {kernel.grid}")
    for k, v in kernel.counts().items():
        print(f"{'':14s}{v:11.4g}  {k}")
    print(f"{'':14s}stalls: " + ", ".join(
        f"{k.split('stalled_')[1].split('_per')[0]} {v:.2f}" for v, k in kernel.stalls()))
PY
done
