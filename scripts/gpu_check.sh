#!/usr/bin/env bash
# Runs the GPU checks and benchmarks on a CUDA machine (the H200 test machine of ARCHITECTURE.md §4).
# Usage: bash scripts/gpu_check.sh STAGE [STAGE ...]; logs and JSON go to ${OUT:-bench/results}.
# Stages: env, tests (pytest -m gpu over every test folder), bench_activation, bench_model,
#         bench_optimizer, bench_train, dist2 (2-GPU NCCL tests: tests marked gpu that need 2 devices).
# Uses the machine's own python3 + torch; our three packages come from the checkout via PYTHONPATH, and
# optional wheels from .whl/ (and .cu13/) when present: scripts/device/wheels.sh.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/bench/results}"
mkdir -p "$OUT"
# shellcheck source=device/wheels.sh
source "$ROOT/scripts/device/wheels.sh"  # our packages + the optional wheels carried in .whl/ (and .cu13/)
status=0
for stage in "$@"; do
  echo "===== $stage ($(date +%T))"
  case "$stage" in
    env) nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
         python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" ;;
    tests) python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" --timeout 300 tests activations/tests optimizer/tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -60 ;;
    bench_*) python3 "bench/$stage.py" --out "$OUT/$stage.json" 2>&1 | tee "$OUT/$stage.log" | tail -60 ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && { echo "stage $stage failed: rc=$rc"; status=1; }
done
exit $status
