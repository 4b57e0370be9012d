#!/usr/bin/env bash
# One device call: environment facts, numerics check at realistic sizes, then timings.
# Usage (repo root, on the GPU machine): bash benchmarks/gpu_session.sh [bench args...]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import jax, pallas_attn; print('jax', jax.__version__, pallas_attn.DeviceInfo.current())"
python3 -m pallas_attn check --jobs 6 --json "$OUT/check.json" 2>&1 | tee "$OUT/check.log" | grep -v "^  "
python3 -m pallas_attn bench --json "$OUT/bench.json" --plot "$OUT/bench.png" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^{'
