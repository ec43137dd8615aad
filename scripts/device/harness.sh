#!/usr/bin/env bash
# Device script of the comparison harness (issue 11 parts 1 and 5): ours vs torchtitan 0.2.2 DeepSeek-V3 on one GPU.
#   bash scripts/device/harness.sh check             ~80-90 s: the compile (graph reuse on this torch) and FLOP
#                                                    tests; tiny shape: ours@eager, torchtitan@eager and @compiled,
#                                                    and (side by side, 80 s limit) ours@compiled, one step each
#   bash scripts/device/harness.sh bench [SEL]       the table at the motif3_proxy shape; SEL = comma-separated groups
#                                                    (eager, compiled, accum, all) or case names; default "compiled".
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
    # side by side (compilation is CPU-bound, the GPU work is tiny): the compile/FLOP tests, our compiled tiny step
    # (our compile is what item 5 targets: on a timeout the line says so), and the serial tiny cases
    ( "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/distributed/test_compile.py tests/motif/test_flops.py \
        > "$tmp/tests.log" 2>&1; echo $? > "$tmp/tests.rc" ) &
    ( "$PY" bench/bench_vs_torchtitan.py --size tiny --cases ours@compiled --steps 1 --warmup 1 --timeout 80 \
        --out "$tmp/ours_compiled.json" > "$tmp/ours_compiled.log" 2>&1; echo $? > "$tmp/ours_compiled.rc" ) &
    step "tiny ours@eager, torchtitan@eager, torchtitan@compiled" \
      "$PY" bench/bench_vs_torchtitan.py --size tiny --cases ours@eager,torchtitan@eager,torchtitan@compiled \
      --steps 1 --warmup 1 --timeout 60 --out "$tmp/tiny.json"
    wait
    tail -n 3 "$tmp/tests.log"
    [ "$(cat "$tmp/tests.rc")" = "0" ] && echo "ok compile + FLOP tests" || { echo "FAIL compile + FLOP tests"; status=1; }
    grep -E "^\[|FAIL" "$tmp/ours_compiled.log" | head -n 3
    [ "$(cat "$tmp/ours_compiled.rc")" = "0" ] && echo "ok tiny ours@compiled" \
      || { echo "FAIL tiny ours@compiled (a timeout here means our first compiled step of motif3_debug took > 80 s)"; status=1; }
    "$PY" - "$tmp/tiny.json" "$tmp/ours_compiled.json" > "$OUT/harness.json" <<'PYEOF'
import json, os, sys
print(json.dumps([json.load(open(p)) if os.path.exists(p) else None for p in sys.argv[1:]], indent=1))
PYEOF
    ;;
  bench)
    sel="${2:-compiled}"
    step "bench_vs_torchtitan --cases $sel" \
      "$PY" bench/bench_vs_torchtitan.py --cases "$sel" --timeout 450 --out "$OUT/harness.json"
    ;;
  *) echo "usage: $0 check | bench [eager|compiled|accum|all|CASE,...]"; exit 2 ;;
esac
exit $status
