#!/usr/bin/env bash
# Per-kernel GPU times inside one jitted forward+backward step (the bench problem:
# B=4, T=S=4096, N=16, d128, bf16), from ncu's gpu__time_duration with clocks and
# caches left alone. Only the third (warm) call is profiled (cudaProfilerStart/Stop).
# Usage (repo root, on the GPU machine):
#   [STALLS=1] [COUNTS=1] [CAUSAL=1] bash benchmarks/step_kernels.sh [FEATURE [DQ]]
#   FEATURE: plain (default), softcap, bias, alibi, mask, dropout, segments, packed4,
#   packed16 or mask_documents4 (the bench features at d128: a random mask 90% visible,
#   rate 0.1, ragged ids about 4 per row, K equal documents as ids or as a mask);
#   CAUSAL=1: causal masking too; DQ: the dQ backend to force (mosaic or triton;
#   default: the plan's). Every kernel of the step is listed, XLA's fusions included.
set -uo pipefail
export PYTHONPATH=.:benchmarks PYTHONUNBUFFERED=1
# ncu's replayed passes (STALLS=1, COUNTS=1) need device memory XLA's preallocation would hold.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-out}; mkdir -p "$OUT"
feature=${1:-plain}; dq=${2:-}
case "$feature" in
  plain|softcap|bias|alibi|mask|dropout|segments|packed4|packed16|mask_documents4) ;;
  *) echo "step_kernels.sh: FEATURE must be plain, softcap, bias, alibi, mask, dropout," \
          "segments, packed4, packed16 or mask_documents4, got '$feature'" >&2
     exit 2 ;;
esac
causal=${CAUSAL:-0}
case "$causal" in 0|1) ;; *) echo "step_kernels.sh: CAUSAL must be 0 or 1, got '$causal'" >&2; exit 2 ;; esac
case "$dq" in ""|mosaic|triton) ;; *)
  echo "step_kernels.sh: DQ must be mosaic or triton, got '$dq'" >&2; exit 2 ;;
esac
script=$(mktemp --suffix=.py)
cat > "$script" <<'PY'
import functools, sys
from ncu_report import profile_one_call
import pallas_attn
from pallas_attn import bench

feature, dq, causal = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
feats = {"plain": (), "softcap": (("softcap", 30.0),), "bias": (("bias", None),),
         "alibi": (("alibi", None),), "mask": (("mask", None),),
         "dropout": (("dropout", 0.1),), "segments": (("segments", None),),
         "packed4": (("packed", 4),), "packed16": (("packed", 16),),
         "mask_documents4": (("mask_documents", 4),)}[feature]
inputs = bench.make_inputs(bench.Shape(4, 4096, 4096, 16, 16, 128, causal, feats))
kw = inputs["kwargs"]
blocks = pallas_attn.BlockSizes(dq_backend=dq or None)
att = functools.partial(pallas_attn.dot_product_attention, implementation="pallas",
                        block_sizes=blocks)
step = bench._loss_and_grad(att, inputs)
call = lambda: step(inputs["query"], inputs["key"], inputs["value"], kw.get("bias"),
                    inputs["cotangent"])
profile_one_call(call)
PY
# STALLS=1: also each kernel's warp stall reasons, the five largest in warps stalled per
# issued instruction (the section WarpStateStats shows only their sum).
metrics=gpu__time_duration.sum
[ "${STALLS:-0}" = 1 ] && metrics+=",regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"
# COUNTS=1: also instructions issued, local-memory (spill) bytes loaded and shared-memory
# load bank conflicts, to tell instruction-bound from spill- or conflict-bound kernels.
[ "${COUNTS:-0}" = 1 ] && metrics+=",smsp__inst_executed.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"
csv_out="$OUT/step_kernels_${feature}${dq:+_$dq}$( [ "$causal" = 1 ] && echo _causal)$( [ "${STALLS:-0}" = 1 ] && echo _stalls)$( [ "${COUNTS:-0}" = 1 ] && echo _counts).csv"
ncu --clock-control none --cache-control none --profile-from-start off \
  --metrics "$metrics" --csv --print-units base \
  --print-metric-name name python3 "$script" "$feature" "$dq" "$causal" > "$csv_out" \
  2> "${csv_out%.csv}.stderr" || { echo "step_kernels.sh: ncu failed, see ${csv_out%.csv}.stderr" >&2
                                   tail -5 "${csv_out%.csv}.stderr" >&2; exit 1; }
python3 - "$csv_out" <<'PY'
import sys
from ncu_report import read_kernels
kernels = read_kernels(sys.argv[1])
for kernel in kernels:
    print(f"{kernel.us:9.1f} us  {kernel.name[:40]:40s} grid {kernel.grid}")
    for k, v in kernel.counts().items():  # COUNTS=1's
        print(f"{'':14s}{v:11.4g}  {k}")
    for v, k in kernel.stalls():
        print(f"{'':14s}{v:7.2f}  {k}")
print(f"{sum(kernel.us for kernel in kernels) / 1e3:9.3f} ms in {len(kernels)} kernels")
PY
