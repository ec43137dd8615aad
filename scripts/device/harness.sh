#!/usr/bin/env bash
# Device script of the harness branch (issue 11 parts 1 and 5): ours vs torchtitan 0.2.2 DeepSeek-V3 on one GPU.
#   bash scripts/device/harness.sh check             ~60-90 s: CPU-side compile test (graph reuse on this torch) +
#                                                    tiny ours@compiled and torchtitan@compiled, one compiled step
#                                                    each, run side by side
#   bash scripts/device/harness.sh bench [SEL]       the table at the motif3_proxy shape; SEL = comma-separated groups
#                                                    (eager, compiled, accum, all) or case names; default "eager".
#                                                    Expected: eager ~2.5 min, compiled ~6-7 min, accum ~6-7 min,
#                                                    all ~15 min (over one 10-minute command: run groups separately)
# Needs torchtitan 0.2.2 importable (bench/README.md: its wheel and pure-python needs, carried in .whl/).
# Writes $OUT/harness.json (the bench table's JSON; check writes the two smoke runs' JSON there) and prints a summary.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH=$PWD:$PWD/activations:$PWD/optimizer${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/harness_out}"
mkdir -p "$OUT"
PY=${PYTHON:-python3}
mode="${1:-check}"
status=0
step() {  # step NAME CMD...: run a guarded sub-step, print its time and a FAIL line on error
  local name="$1"; shift
  local t0=$SECONDS
  "$@"; local rc=$?
  if [ "$rc" -ne 0 ]; then echo "FAIL $name (rc=$rc, $((SECONDS - t0)) s)"; status=1; else echo "ok $name ($((SECONDS - t0)) s)"; fi
}
case "$mode" in
  check)
    "$PY" -c "import torch, torchtitan; print('torch', torch.__version__, 'gpu', torch.cuda.get_device_name())" \
      || { echo "FAIL torchtitan or CUDA not importable"; status=1; }
    tmp=$(mktemp -d)
    # the two tiny compiled runs and the compile test in parallel (compilation is CPU-bound; the GPU work is tiny)
    ( "$PY" bench/bench_vs_torchtitan.py --size tiny --cases ours@compiled --steps 1 --warmup 1 --timeout 85 \
        --out "$tmp/ours.json" > "$tmp/ours.log" 2>&1; echo $? > "$tmp/ours.rc" ) &
    ( "$PY" bench/bench_vs_torchtitan.py --size tiny --cases torchtitan@compiled --steps 1 --warmup 1 --timeout 85 \
        --out "$tmp/tt.json" > "$tmp/tt.log" 2>&1; echo $? > "$tmp/tt.rc" ) &
    step "compile test (tests/distributed/test_compile.py)" \
      "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/distributed/test_compile.py tests/motif/test_flops.py
    wait
    for sys in ours tt; do
      tail -n 4 "$tmp/$sys.log"
      [ "$(cat "$tmp/$sys.rc" 2>/dev/null)" = "0" ] && echo "ok tiny $sys compiled" || { echo "FAIL tiny $sys compiled"; status=1; }
    done
    "$PY" - "$tmp/ours.json" "$tmp/tt.json" > "$OUT/harness.json" <<'PYEOF'
import json, os, sys
print(json.dumps([json.load(open(p)) if os.path.exists(p) else None for p in sys.argv[1:]], indent=1))
PYEOF
    ;;
  bench)
    sel="${2:-eager}"
    step "bench_vs_torchtitan --cases $sel" \
      "$PY" bench/bench_vs_torchtitan.py --cases "$sel" --timeout 450 --out "$OUT/harness.json"
    ;;
  *) echo "usage: $0 check | bench [eager|compiled|accum|all|CASE,...]"; exit 2 ;;
esac
exit $status
