#!/usr/bin/env bash
# GPU checks and benchmarks of Muon, the linear cross-entropy loss and PolyNorm memory, one H200.
#   bash scripts/device/perf.sh check   (~60-90 s) gpu tests of optimizer/ and the loss, the PolyNorm
#                                        saved-tensor test, and a tiny smoke run of each benchmark
#   bash scripts/device/perf.sh bench   (~3 min) bench_optimizer (motif3_small Muon vs AdamW step; motif3_proxy
#                                        Muon step: per-shape vs batched vs fused vs NS-only), bench_loss
#                                        (T=16384, V=220160, H=4096: old vs new chunked vs liger, 1 and 2 heads,
#                                        fwd+bwd ms and peak memory), bench_polynorm_memory (MoE expert shape)
# Writes $OUT/perf.json (all benchmark JSON merged; check mode: the smoke runs' JSON) and prints a summary.
# Assumes torch 2.11+cu130, triton, liger-kernel 0.8.5 (optional: its rows are skipped without it).
set -uo pipefail
MODE="${1:-check}"
export PYTHONPATH="$PWD:$PWD/activations:$PWD/optimizer:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/perf_out}"
mkdir -p "$OUT"
TMP="$(mktemp -d)"
PY="${PYTHON:-python}"
FAILS=0

step() {  # step NAME TIMEOUT_S FILTER CMD...: a guarded sub-step; FILTER all | pytest (summary lines only)
  local name="$1" limit="$2" filter="$3" rc
  shift 3
  echo "== $name"
  timeout "$limit" "$@" >"$TMP/log" 2>&1
  rc=$?
  if [ "$filter" = pytest ]; then
    grep -E "passed|failed|error|FAILED|ERROR|SKIPPED|Error" "$TMP/log" | tail -15
  else
    grep -v -E "^\s*$|Warning|warnings.warn" "$TMP/log" | tail -40
  fi
  if [ "$rc" -ne 0 ]; then
    echo "FAIL $name (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out'))"
    FAILS=$((FAILS + 1))
  fi
}

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs)

case "$MODE" in
  check)
    step "gpu tests: optimizer (Muon CUDA) + loss (CUDA fp32-out GEMMs)" 75 pytest \
      "${PYTEST[@]}" optimizer/tests/test_muon_cuda.py \
      tests/trainer/test_losses.py tests/trainer/test_cross_entropy_kernels.py optimizer/tests/test_muon.py
    step "PolyNorm saved-for-backward test" 30 pytest "${PYTEST[@]}" activations/tests/test_reference.py -k saves
    step "smoke bench_optimizer (motif3_debug)" 60 all \
      "$PY" bench/bench_optimizer.py --flavor motif3_debug --muon-flavor motif3_debug --repeats 2 --skip-ns-table \
      --out "$TMP/bench_optimizer.json"
    step "smoke bench_loss (T=2048, V=8192, H=512)" 45 all \
      "$PY" bench/bench_loss.py --tokens 2048 --vocab 8192 --hidden 512 --repeats 2 --out "$TMP/bench_loss.json"
    step "smoke bench_polynorm_memory (8192 rows)" 30 all \
      "$PY" bench/bench_polynorm_memory.py --rows 8192 --repeats 2 --out "$TMP/bench_polynorm_memory.json"
    ;;
  bench)
    step "bench_optimizer (motif3_small; Muon step motif3_proxy)" 150 all \
      "$PY" bench/bench_optimizer.py --flavor motif3_small --muon-flavor motif3_proxy --repeats 5 --skip-ns-table \
      --out "$TMP/bench_optimizer.json"
    step "bench_loss (T=16384, V=220160, H=4096)" 75 all \
      "$PY" bench/bench_loss.py --repeats 5 --out "$TMP/bench_loss.json"
    step "bench_polynorm_memory (131072 rows x 1280, 64 experts)" 30 all \
      "$PY" bench/bench_polynorm_memory.py --out "$TMP/bench_polynorm_memory.json"
    ;;
  *)
    echo "usage: bash scripts/device/perf.sh check|bench"
    exit 2
    ;;
esac

"$PY" - "$TMP" "$OUT/perf.json" "$MODE" <<'EOF'
import json, pathlib, sys
tmp, out, mode = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
merged = {"mode": mode}
for f in sorted(tmp.glob("*.json")):
    merged[f.stem] = json.loads(f.read_text())
pathlib.Path(out).write_text(json.dumps(merged, indent=1))
print(f"wrote {out} ({', '.join(k for k in merged if k != 'mode') or 'no results'})")
EOF
rm -rf "$TMP"
echo "perf.sh $MODE: $FAILS failed step(s)"
[ "$FAILS" -eq 0 ]
