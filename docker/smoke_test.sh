#!/usr/bin/env bash
# Smoke test of a built training image; runs wherever Docker runs, no GPU needed.
#   bash docker/smoke_test.sh [IMAGE]          # default IMAGE: localhost:5000/llm-training:latest
#   GPU=1 bash docker/smoke_test.sh [IMAGE]    # on a GPU machine: also import the CUDA extensions
# Checks, each in a fresh container started in the image's working directory (the repository root, which
# torchrun puts first on sys.path):
#   1. the three packages import, `optimizer` being the package and not the project folder optimizer/;
#   2. the start-up build of `activation` (scripts/build_activation_at_start.sh) succeeds;
#   3. one CPU training step of motif3_debug through the Kubeflow wrapper (run_train_kubeflow.sh -> torchrun);
#   4. with GPU=1: deep_ep (+ HybridEP), deep_gemm, flash-attn-4, liger-kernel and torchao import on the GPU.
# Exits non-zero at the first failing check. DOCKER selects the client (default: docker).
set -euo pipefail
IMAGE="${1:-localhost:5000/llm-training:latest}"
DOCKER="${DOCKER:-docker}"
run() { "$DOCKER" run --rm "$@"; }
step() { echo "[smoke_test] $*"; }

step "1/4 imports from the repository root"
run "$IMAGE" python -c "
import activation, llm_training, optimizer
from optimizer import GroupRule
import llm_training.trainer.optim
assert optimizer.__file__ is not None, 'optimizer resolved to a namespace package (the optimizer/ folder)'
print('imports ok:', activation.__file__, optimizer.__file__)
"

step "2/4 start-up build of activation"
run "$IMAGE" bash -c 'bash scripts/build_activation_at_start.sh && python -c "import activation; print(activation.__file__)"'

step "3/4 one CPU step of motif3_debug through run_train_kubeflow.sh"
run -e CONFIG_FILE=llm_training/motif/train_configs/debug_cpu.toml -e PET_NPROC_PER_NODE=1 "$IMAGE" \
  bash run_train_kubeflow.sh --training.steps=1 --training.local_batch_size=2 --training.seq_len=64 \
  --lr_scheduler.warmup_steps=0 --checkpoint.enable=false --metrics.log_freq=1 --job.dump_folder=/tmp/smoke

if [ "${GPU:-0}" = "1" ]; then
  step "4/4 CUDA extensions on the GPU"
  run --gpus all "$IMAGE" python -c "
import torch
assert torch.cuda.is_available(), 'no GPU visible in the container'
import deep_ep, deep_gemm, liger_kernel, torchao
from deep_ep import HybridEPBuffer
from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd  # what layers/attention/fa4.py calls
print('GPU imports ok on', torch.cuda.get_device_name())
"
else
  step "4/4 skipped (GPU=1 to import the CUDA extensions)"
fi
step "passed: $IMAGE"
