#!/usr/bin/env bash
# Creates .venv (once) and installs llm_training + the in-repo `activation` and `optimizer` packages.
# Sourced by scripts/demo.sh and scripts/test.sh. Re-running is cheap: it skips work already done.
#   LLM_TORCH_SPEC   torch requirement to install when torch is missing (default: torch==2.13.0; on a
#                    CPU-only machine this takes the CPU wheel; GPU machines keep the torch they have)
#   LLM_VENV         virtual environment folder (default: .venv in the repo root)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LLM_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
STAMP="$VENV/.llm_training_installed"
HASH="$(cat "$ROOT/pyproject.toml" "$ROOT/activations/pyproject.toml" "$ROOT/optimizer/pyproject.toml" | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$HASH" ]; then
  "$VPY" -m pip install -q --upgrade pip
  if ! "$VPY" -c "import torch" 2>/dev/null; then
    echo "[bootstrap] installing ${LLM_TORCH_SPEC:-torch==2.13.0}"
    "$VPY" -m pip install -q "${LLM_TORCH_SPEC:-torch==2.13.0}"
  fi
  echo "[bootstrap] installing llm_training, activation, optimizer (+dev extras)"
  "$VPY" -m pip install -q -e "$ROOT/activations" -e "$ROOT[dev]"
  # compat mode puts optimizer/ itself on sys.path; with the default (import-hook) mode, the project folder
  # optimizer/ shadows the package as a namespace package whenever the repo root is on sys.path
  # (python -m from the root, PYTHONPATH=<repo>, pytest).
  "$VPY" -m pip install -q -e "$ROOT/optimizer" --config-settings editable_mode=compat
  echo "$HASH" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
