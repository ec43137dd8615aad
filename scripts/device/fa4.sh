#!/usr/bin/env bash
# flash-attn-4 backend and the long-context path on one H200 (issue 16). Run from the repo root.
#
#   bash scripts/device/fa4.sh check            ~4 min on a fresh machine (FA4 compiles ~10 s per kernel variant): GPU tests of the fa4 backend (values +
#                                               gradients vs the reference: windows, documents, expand_kv layout,
#                                               auto, torch.compile), a tiny attention bench (fa4, sdpa at 4K),
#                                               a 4K long-context training smoke (motif3_small_256k)
#   bash scripts/device/fa4.sh bench [PARTS]    ~4 min: PARTS (default "attention long"), any of
#       attention   bench/bench_attention.py: fwd+bwd per backend at 4K/16K/64K/128K, full + sliding (~110 s)
#       long        bench/bench_long_context.py: motif3_small_256k at 32K and 64K, then 128K if 64K trained (~2 min)
#       long32 long64 long128   one length only
#
# Assumes flash_attn.cute (flash-attn-4 4.0.0b36) importable (installed, or carried and set up by wheels.sh); caches compiled FA4 kernels on disk
# (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED) so that bench reuses what check compiled. Writes $OUT/fa4.log (the
# full output and the JSON results); prints a compact summary. Each step is guarded: a failure prints FAIL and
# the next step runs.
set -u
export PYTHONPATH=$PWD:$PWD/activations:$PWD/optimizer:${PYTHONPATH:-}
# the optional wheels carried in .whl/ (and .cu13/), when this checkout has them: flash-attn-4 and its cutlass libs
if [ -f scripts/device/wheels.sh ]; then source scripts/device/wheels.sh; fi
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/fa4_out}
mkdir -p "$OUT"
LOG=$OUT/fa4.log
RES=/tmp/fa4_results
mkdir -p "$RES"
: >"$LOG"
MODE=${1:-check}
shift || true

step() {  # step NAME TIMEOUT_S CMD... : run guarded, full output to the log, its last lines to stdout
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name" >>"$LOG"
  timeout "$limit" "$@" >"$RES/$name.out" 2>&1
  local rc=$?
  cat "$RES/$name.out" >>"$LOG"
  if [ $rc -eq 0 ]; then echo "OK   $name ($((SECONDS - t0)) s)"; else echo "FAIL $name rc=$rc ($((SECONDS - t0)) s)"; fi
  return $rc
}

python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import torch
try:
    import flash_attn.cute as fa
    v = getattr(fa, "__version__", "?")
except Exception as e:  # noqa: BLE001
    v = f"NOT IMPORTABLE ({type(e).__name__}: {e})"
print(f"torch {torch.__version__}, GPU {torch.cuda.get_device_name()}, SM{''.join(map(str, torch.cuda.get_device_capability()))}, flash_attn.cute {v}")
EOF

case "$MODE" in
check)
  # the pad_v layout's kernels are compiled and checked against the reference by the bench (check_backend)
  step gpu_tests 200 python3 -m pytest -q -m gpu tests/layers/attention/test_fa4_attention.py -k "not pad_v" -p no:cacheprovider
  tail -n 3 "$RES/gpu_tests.out" | sed 's/^/  /'
  grep -E "^(FAILED|ERROR)" "$RES/gpu_tests.out" | head -n 12 | sed 's/^/  /'
  step attention_smoke 30 python3 bench/bench_attention.py --seq-lens 4096 --tokens 8192 \
    --backends fa4,sdpa --budget-s 20 --out "$RES/bench_attention_smoke.json"
  grep -vE "^wrote" "$RES/attention_smoke.out" | tail -n 8 | sed 's/^/  /'
  step long_smoke 40 python3 bench/bench_long_context.py --seq-lens 4096 --steps 1 --warmup 1 \
    --out "$RES/bench_long_context_smoke.json"
  grep -vE "Warning|sliced_mesh|^wrote" "$RES/long_smoke.out" | tail -n 5 | sed 's/^/  /'
  ;;
bench)
  PARTS=${*:-attention long}
  for part in $PARTS; do
    case "$part" in
    attention)
      step attention 130 python3 bench/bench_attention.py --budget-s 100 --out "$RES/bench_attention.json"
      grep -vE "^wrote" "$RES/attention.out" | tail -n 16 | sed 's/^/  /'
      cat "$RES/bench_attention.json" >>"$LOG" 2>/dev/null
      ;;
    long | long32 | long64 | long128)
      case "$part" in
      long) lens="32768,65536" ;; long32) lens=32768 ;; long64) lens=65536 ;; long128) lens=131072 ;;
      esac
      step "long_$lens" 150 python3 bench/bench_long_context.py --seq-lens "$lens" --steps 2 --warmup 1 \
        --out "$RES/bench_long_context_$lens.json"
      grep -vE "Warning|sliced_mesh|^wrote" "$RES/long_$lens.out" | tail -n 4 | sed 's/^/  /'
      cat "$RES/bench_long_context_$lens.json" >>"$LOG" 2>/dev/null
      if [ "$part" = long ] && grep -qE "^ +65536 .* ok$" "$RES/long_$lens.out"; then
        step long_131072 110 python3 bench/bench_long_context.py --seq-lens 131072 --steps 1 --warmup 1 \
          --out "$RES/bench_long_context_131072.json"
        grep -vE "Warning|sliced_mesh|^wrote" "$RES/long_131072.out" | tail -n 3 | sed 's/^/  /'
        cat "$RES/bench_long_context_131072.json" >>"$LOG" 2>/dev/null
      fi
      ;;
    *) echo "FAIL unknown part $part (attention, long, long32, long64, long128)" ;;
    esac
  done
  ;;
*)
  echo "usage: bash scripts/device/fa4.sh check | bench [attention] [long|long32|long64|long128]"
  exit 2
  ;;
esac
echo "log: $LOG"
