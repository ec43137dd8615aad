#!/usr/bin/env bash
# The multi-GPU issues' runs on one host of 2+ GPUs (nvidia-h200-x2 / -x4 / -x8). Run from the repo root.
#   bash scripts/device/multi_gpu.sh parity    ~5-8 min: tests/test_multi_gpu_training.py on 2 GPUs: 1 GPU vs FSDP 2,
#                                               EP 2, Ulysses CP 2, ring CP 2 (20 steps of motif3_debug each), and an
#                                               EP 2 checkpoint resumed on 1 GPU (same step-11 loss); on 4 / 8 GPUs
#                                               also their layouts
#   bash scripts/device/multi_gpu.sh parity FLAVOR [K]   the same runs on FLAVOR (the issues ask motif3_proxy), only
#                                               the tests pytest's `-k K` selects (e.g. ep2_checkpoint, ring_cp2):
#                                               each proxy run loads a 17 GiB checkpoint, so one layout per call
#   bash scripts/device/multi_gpu.sh ep        ~1-2 min: bench/bench_ep_dispatch.py on every GPU of the host
#                                               (motif3_proxy's 16K tokens x top-8 of 64 experts per rank, H 4096),
#                                               uniform and skewed routing: dispatch + combine vs the plain all-to-all
#   bash scripts/device/multi_gpu.sh long      ~3-5 min: bench/bench_long_context.py --cp 2 (ulysses, then ring) on
#                                               motif3_small_256k at 64K and 128K tokens per sequence
#   bash scripts/device/multi_gpu.sh scaling [ARGS]   ~1-2 min per size: bench/bench_train.py on 1, 2, 4, 8 GPUs (up
#                                               to the host's) for motif3_proxy, 2 x 4096 tokens per data rank, full
#                                               recompute, experts split over every GPU (EP = GPUs): tok/s and MFU
#                                               per GPU and the weak-scaling efficiency vs 1 GPU; ARGS go to every run
#                                               (e.g. --compile)
# NVLink multicast stays off (KINDS.md: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
# NVSHMEM_DISABLE_NVLS=1); the optional wheels carried in .whl/ are installed first when present (wheels.sh).
# Writes $OUT/multi_gpu.log (everything) and the benchmarks' JSON under $OUT; prints PASS / FAIL per step.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ -f scripts/device/wheels.sh ]; then source scripts/device/wheels.sh >/dev/null; fi
export PYTHONPATH=$PWD:$PWD/activations:$PWD/optimizer:${PYTHONPATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/multi_gpu_out}
mkdir -p "$OUT"
LOG=$OUT/multi_gpu.log
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
mode=${1:-parity}
status=0

step() {  # step NAME TIMEOUT_S CMD...: run guarded, append the output to the log, print PASS/FAIL and the tail
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name" >>"$LOG"
  if timeout "$limit" "$@" >>"$LOG" 2>&1; then
    echo "PASS $name ($((SECONDS - t0)) s)"
  else
    echo "FAIL $name (rc $?, $((SECONDS - t0)) s)"
    status=1
  fi
  grep -v "Warning\|warn(\|^\s*$" "$LOG" | tail -n 12
}

echo "GPUs: $NGPU x $(python3 -c "import torch; print(torch.cuda.get_device_name())")"
[ "$NGPU" -ge 2 ] || { echo "FAIL needs 2+ GPUs, found $NGPU"; exit 1; }
case "$mode" in
  parity)
    flavor=${2:-motif3_debug}
    step "parity ($flavor${3:+, -k $3}): 1 GPU vs the layouts of $NGPU GPUs, EP checkpoints resumed" 580 \
      env PARITY_FLAVOR="$flavor" python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
      tests/test_multi_gpu_training.py -rs ${3:+-k "$3"}
    ;;
  ep)
    step "EP dispatch, uniform routing, $NGPU ranks" 150 torchrun --standalone --nproc_per_node "$NGPU" \
      bench/bench_ep_dispatch.py --out "$OUT/ep_dispatch_uniform.json"
    step "EP dispatch, skewed routing (skew 1.0), $NGPU ranks" 150 torchrun --standalone --nproc_per_node "$NGPU" \
      bench/bench_ep_dispatch.py --skew 1.0 --out "$OUT/ep_dispatch_skew.json"
    ;;
  long)
    for cp_mode in ulysses ring; do
      step "long context, CP 2 ($cp_mode)" 300 torchrun --standalone --nproc_per_node 2 bench/bench_long_context.py \
        --cp 2 --cp-mode "$cp_mode" --seq-lens 65536,131072 --out "$OUT/long_cp2_$cp_mode.json"
    done
    ;;
  scaling)
    shift
    base="$OUT/train_1gpu.json"
    step "train step, 1 GPU" 300 python3 bench/bench_train.py --flavor motif3_proxy --batch 2 --ac full --steps 5 \
      --out "$base" "$@"
    for n in 2 4 8; do
      [ "$n" -le "$NGPU" ] || break
      step "train step, $n GPUs (EP $n)" 300 torchrun --standalone --nproc_per_node "$n" bench/bench_train.py \
        --flavor motif3_proxy --batch 2 --ac full --steps 5 --ep "$n" --baseline "$base" --out "$OUT/train_${n}gpu.json" "$@"
    done
    ;;
  *)
    echo "usage: bash scripts/device/multi_gpu.sh parity [FLAVOR [K]] | ep | long | scaling [ARGS]"
    exit 2
    ;;
esac
exit $status
