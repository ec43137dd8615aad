#!/usr/bin/env bash
# Launch llm_training on one node of a (Kubeflow) multi-node job through torchrun.
#
#   CONFIG_FILE=llm_training/motif/train_configs/example_c4_pretrain.toml bash run_train_kubeflow.sh [--section.key=value ...]
#
# Node layout comes from the variables the Kubeflow Trainer torch plugin injects (defaults: one node):
#   PET_NNODES (1)  PET_NPROC_PER_NODE (GPUs from nvidia-smi, else 1)  PET_NODE_RANK (0)
#   PET_MASTER_ADDR (127.0.0.1)  PET_MASTER_PORT (29500)
# Extra arguments are passed to llm_training.train as config overrides. W&B credentials and settings
# (WANDB_API_KEY, WANDB_PROJECT, WANDB_TEAM, WANDB_RUN_NAME, WANDB_MODE) are read from the environment by
# the trainer (llm_training/trainer/metrics.py). examples/kubeflow/trainjob.yaml runs
# scripts/build_activation_at_start.sh before this script.
# DRY_RUN=1 prints the torchrun command instead of running it.
set -euo pipefail

if [ -z "${CONFIG_FILE:-}" ]; then
  echo "run_train_kubeflow.sh: CONFIG_FILE is not set; run e.g." >&2
  echo "  CONFIG_FILE=llm_training/motif/train_configs/debug_cpu.toml bash run_train_kubeflow.sh" >&2
  exit 2
fi
if [ ! -f "$CONFIG_FILE" ]; then
  echo "run_train_kubeflow.sh: CONFIG_FILE=$CONFIG_FILE does not exist (cwd $(pwd)); shipped configs:" >&2
  ls "$(dirname "${BASH_SOURCE[0]}")"/llm_training/motif/train_configs/*.toml >&2 || true
  exit 2
fi

nproc_per_node="${PET_NPROC_PER_NODE:-}"
if ! [[ "$nproc_per_node" =~ ^[0-9]+$ ]]; then  # unset, or torchrun's "auto"/"gpu": count the GPUs
  nproc_per_node=1
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    if [ "${gpus:-0}" -gt 0 ]; then nproc_per_node="$gpus"; fi
  fi
fi

cmd=(
  torchrun
  --nnodes "${PET_NNODES:-1}"
  --nproc_per_node "$nproc_per_node"
  --node_rank "${PET_NODE_RANK:-0}"
  --master_addr "${PET_MASTER_ADDR:-127.0.0.1}"
  --master_port "${PET_MASTER_PORT:-29500}"
  -m llm_training.train
  --job.config_file "$CONFIG_FILE"
  "$@"
)

if [ "${DRY_RUN:-0}" = "1" ]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
