#!/usr/bin/env bash
# Runs the GPU checks and benchmarks on a CUDA machine (the H200 test machine of docs/architecture.md §4).
# Usage: bash scripts/gpu_check.sh STAGE [STAGE ...]; logs and JSON go to ${OUT:-bench/results}.
# Stages: env, tests (pytest -m gpu over every test folder), bench_activation, bench_model,
#         bench_optimizer, bench_train.
# Uses the machine's own python3 + torch; our three packages come from the checkout via PYTHONPATH, and
# optional wheels from .whl/ (and .cu13/) when present: scripts/device/wheels.sh.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/bench/results}"
mkdir -p "$OUT"
# shellcheck source=device/wheels.sh
source "$ROOT/scripts/device/wheels.sh"  # our packages + the optional wheels carried in .whl/ (and .cu13/)
# The whole GPU suite (every test marked gpu, in every test folder): the log, and a summary (machine, library
# versions, pytest's closing line, each failure) in $OUT/gpu_suite_summary.txt. Its exit status is pytest's.
# The tests run in GPU_SUITE_WORKERS pytest-xdist processes (default 4) sharing the one GPU: most of the suite's
# time is torch.compile / Triton compilation on the CPU, which the machine's cores then do side by side (each test
# takes at most a few GiB of the GPU's memory; GPU_SUITE_WORKERS=0 runs them in one process).
gpu_suite() {
  local workers=()
  if [ "${GPU_SUITE_WORKERS:-4}" -gt 0 ] && python3 -c "import xdist" 2>/dev/null; then
    workers=(-n "${GPU_SUITE_WORKERS:-4}" --dist worksteal)
  fi
  python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="-ra" --timeout 300 --durations=15 "${workers[@]}" \
    tests activations/tests optimizer/tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -60
  local rc=${PIPESTATUS[0]}
  {
    echo "GPU suite, $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 - <<'PY'
import importlib
for name in ("torch", "triton", "torchao", "liger_kernel", "flash_attn.cute"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', 'present')}")
    except Exception as e:  # noqa: BLE001 - a missing optional library is reported, its tests skip
        print(f"{name} not importable ({type(e).__name__})")
PY
    grep -E "^(FAILED|ERROR) " "$OUT/gpu_tests.log"
    tail -n 1 "$OUT/gpu_tests.log"
    sed -n '/slowest .* durations/,/short test summary/p' "$OUT/gpu_tests.log" | grep -v "short test summary"
  } > "$OUT/gpu_suite_summary.txt"
  cat "$OUT/gpu_suite_summary.txt"
  return "$rc"
}

status=0
for stage in "$@"; do
  echo "===== $stage ($(date +%T))"
  case "$stage" in
    env) nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
         python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
         rc=$? ;;
    tests) gpu_suite; rc=$? ;;
    bench_*) python3 "bench/$stage.py" --out "$OUT/$stage.json" 2>&1 | tee "$OUT/$stage.log" | tail -60
             rc=${PIPESTATUS[0]} ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
  [ "$rc" -ne 0 ] && { echo "stage $stage failed: rc=$rc"; status=1; }
done
exit $status
