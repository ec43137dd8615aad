#!/usr/bin/env bash
# mHC / fp32-projection GPU checks and benchmark. Run from the repo root on one H200.
#   bash scripts/device/mhc.sh check   ~100-150 s: gpu-marked tests of the split-bf16 GEMM, router and fused mHC
#                                       (eager; then torch.compile, <= 55 s), of the fused backward kernels
#                                       (test_mhc_kernels.py, ~45 s), plus a 4K-token eager smoke run of bench/bench_mhc.py
#   bash scripts/device/mhc.sh bench   ~4-5 min: bench/bench_mhc.py, legacy vs fused mHC at motif3_proxy
#                                       width, 16K and 64K tokens eager, 16K compiled; router gate rows; then
#                                       bench/bench_mhc_kernels.py (the backward kernels, tensor_ops vs fused)
# Writes $OUT/mhc.log (check) or $OUT/mhc.json and $OUT/mhc_kernels.json (bench); prints a compact summary.
set -u
export PYTHONPATH=$PWD:$PWD/activations:$PWD/optimizer:${PYTHONPATH:-}
OUT=${OUT:-/tmp/mhc_out}
mkdir -p "$OUT"
mode=${1:-check}
PY=${PYTHON:-python}

step() {  # step NAME TIMEOUT CMD...: run guarded, print PASS/FAIL with the tail on failure
  local name=$1 limit=$2
  shift 2
  local log
  log=$(mktemp)
  local t0=$SECONDS
  if timeout "$limit" "$@" >"$log" 2>&1; then
    echo "PASS $name ($((SECONDS - t0)) s)"
    grep -E "passed|failed|skipped|FAIL|Error|^mHC|^router|^  |^(legacy|fused) |^variant" "$log" | tail -n 30
  else
    echo "FAIL $name (rc $?, $((SECONDS - t0)) s)"
    tail -n 25 "$log"
  fi
  cat "$log" >>"$OUT/mhc.log.tmp"
  rm -f "$log"
}

case "$mode" in
  check)
    step "gpu tests, eager (test_mhc_gpu.py)" 40 $PY -m pytest -q -p no:cacheprovider tests/layers/mhc/test_mhc_gpu.py \
      -m gpu -k "not True"
    step "gpu test, torch.compile of the fused mHC pair" 55 $PY -m pytest -q -p no:cacheprovider \
      tests/layers/mhc/test_mhc_gpu.py -m gpu -k "True"
    step "gpu tests, the fused backward kernels (test_mhc_kernels.py)" 60 $PY -m pytest -q -p no:cacheprovider \
      tests/layers/mhc/test_mhc_kernels.py -m gpu
    step "bench smoke (4K tokens, eager)" 30 $PY bench/bench_mhc.py --tokens 4096 --compile-tokens "" --iters 2 \
      --out "$OUT/mhc_smoke.json"
    rm -f "$OUT/mhc_smoke.json"
    mv "$OUT/mhc.log.tmp" "$OUT/mhc.log"
    ;;
  bench)
    step "bench_mhc" 200 $PY bench/bench_mhc.py --tokens 16384,65536 --compile-tokens 16384 --iters 10 \
      --out "$OUT/mhc.json"
    step "bench_mhc_kernels" 150 $PY bench/bench_mhc_kernels.py --out "$OUT/mhc_kernels.json"
    rm -f "$OUT/mhc.log.tmp"
    ;;
  *)
    echo "usage: bash scripts/device/mhc.sh check|bench"
    exit 2
    ;;
esac
