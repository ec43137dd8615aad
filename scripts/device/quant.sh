#!/usr/bin/env bash
# Low-precision (issue 12) checks and benchmarks on one CUDA GPU (the H200: SM90, so mxfp8 is skipped there).
# Usage (from the repo root):
#   bash scripts/device/quant.sh check            ~60-90 s: the gpu-marked tests of tests/quantization (fp8_rowwise /
#                                                  fp8_blockwise linear + grouped GEMM vs the emulation and bf16, a
#                                                  converted MoE layer) + a tiny smoke run of every bench part
#   bash scripts/device/quant.sh bench [PARTS]    up to 9 min: bench/bench_quantization.py PARTS (default: layers step
#                                                  curve): per-layer speed-ups at motif3_proxy shapes, the motif3_proxy
#                                                  step bf16 vs fp8_rowwise, motif3_small loss curves (200 steps, seq 1024)
# Assumes torchao 0.18.0 importable. Writes one file: $OUT/quant.json (bench) or $OUT/quant.log (check).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH=$PWD:$PWD/activations:$PWD/optimizer:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/quant_out}"
mkdir -p "$OUT"
mode="${1:-check}"
shift || true
status=0
step() {  # step NAME CMD...: run one guarded sub-step, print a PASS / FAIL line
  local name="$1"
  shift
  local t0=$SECONDS
  if "$@"; then echo "PASS $name ($((SECONDS - t0)) s)"; else echo "FAIL $name rc=$? ($((SECONDS - t0)) s)"; status=1; fi
}
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())" 2>&1 | grep -v "Failed to load\|register_constant"
case "$mode" in
  check)
    LOG="$OUT/quant.log"
    : > "$LOG"
    step "gpu tests" bash -c "timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts='' tests/quantization/test_quantization_gpu.py -x -q 2>&1 | tee -a '$LOG' | grep -E 'passed|failed|skipped|Error|error|assert' | tail -25; exit \${PIPESTATUS[0]}"
    step "bench smoke" bash -c "timeout 120 python3 bench/bench_quantization.py layers step curve --tiny --repeats 3 --steps 2 --curve-steps 20 --out /tmp/quant_smoke.json 2>&1 | grep -v 'Failed to load\|register_constant' | tee -a '$LOG' | tail -30; exit \${PIPESTATUS[0]}"
    ;;
  bench)
    step "bench ${*:-layers step curve}" bash -c "timeout 540 python3 bench/bench_quantization.py $* --out '$OUT/quant.json' 2>&1 | grep -v 'Failed to load\|register_constant' | tail -45; exit \${PIPESTATUS[0]}"
    ;;
  *) echo "usage: bash scripts/device/quant.sh check|bench [layers] [step] [curve]"; exit 2 ;;
esac
exit $status
