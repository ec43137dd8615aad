#!/usr/bin/env bash
# Job start-up build of the `activation` package (activations/), run on every node before training
# (examples/kubeflow/trainjob.yaml does so). It builds from a node-local copy because an in-place build on
# shared storage races across nodes: every node would write the same build/ and *.egg-info folders.
#   1. copy activations/ to a fresh temporary folder (under TMPDIR, node-local: /tmp by default)
#   2. remove stale build/ and *.egg-info folders from that copy
#   3. pip install --no-build-isolation --no-deps --force-reinstall <copy> [extra pip arguments]
#      (--no-build-isolation builds against the torch already installed; --no-deps never lets pip touch
#      torch or anything else in the image)
#   4. remove the copy
# The image already has `activation` installed (docker/cuda/llm-training.Dockerfile), so training works
# whether or not this ran; running it picks up the kernels of the checkout the job runs from.
#   bash scripts/build_activation_at_start.sh                      # into the current Python environment
#   bash scripts/build_activation_at_start.sh --target /tmp/act    # extra arguments go to pip
#   ACTIVATION_SRC=/mnt/src/activations bash scripts/build_activation_at_start.sh
# PYTHON selects the interpreter (default: python). Exits non-zero when the copy or the build fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="${ACTIVATION_SRC:-$ROOT/activations}"
PY="${PYTHON:-python}"
if [ ! -f "$SRC/pyproject.toml" ]; then
  echo "build_activation_at_start.sh: $SRC/pyproject.toml not found; set ACTIVATION_SRC to the activations/ folder" >&2
  exit 2
fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/activation-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
cp -R "$SRC/." "$WORK/"
shopt -s nullglob
rm -rf "$WORK/build" "$WORK"/*.egg-info "$WORK"/*/*.egg-info
echo "[build_activation_at_start] building $SRC from the node-local copy $WORK"
"$PY" -m pip install --quiet --no-build-isolation --no-deps --force-reinstall "$@" "$WORK"
echo "[build_activation_at_start] installed activation from $SRC"
