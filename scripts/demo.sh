#!/usr/bin/env bash
# The demo: sets up .venv (scripts/bootstrap.sh), trains motif3_debug on the bundled chat data for 200 steps
# on the CPU (debug_cpu.toml; checkpoints at steps 100 and 200), then starts the same run again with 20 more
# steps, which reloads the step-200 checkpoint and continues from it. Each demo is a new run folder under
# outputs/ (demo-<time>). Both runs evaluate on the held-out demo_chat_val.jsonl every 50 steps and at their last
# step ([validation], 4 batches). Extra arguments are config overrides for both runs, e.g.
#   bash scripts/demo.sh --training.local_batch_size=4
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
CONFIG=llm_training/motif/train_configs/debug_cpu.toml
RUN="demo-$(date +%Y%m%d-%H%M%S)"
VALIDATION=(--validation.enable --validation.dataset_path="$ROOT/llm_training/data/assets/demo_chat_val.jsonl"
  --validation.freq=50 --validation.steps=4)
python -m llm_training.train --job.config_file "$CONFIG" --job.run_name="$RUN" "${VALIDATION[@]}" "$@"
echo "[demo] resuming $RUN from its last checkpoint for 20 more steps"
python -m llm_training.train --job.config_file "$CONFIG" --job.run_name="$RUN" --training.steps=220 "${VALIDATION[@]}" "$@"
