#!/usr/bin/env bash
# The demo: sets up .venv (scripts/bootstrap.sh) and runs the main job on the CPU demo config
# (motif3_debug on the bundled chat data). Extra arguments are config overrides, e.g.
#   bash scripts/demo.sh --training.steps=50
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec python -m llm_training.train --job.config_file llm_training/motif/train_configs/debug_cpu.toml "$@"
