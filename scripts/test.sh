#!/usr/bin/env bash
# Runs the test suite (tests/, activations/tests/, optimizer/tests/ from pyproject's testpaths) after
# setting up .venv (scripts/bootstrap.sh). Arguments go to pytest, e.g.
#   bash scripts/test.sh tests/config        # one folder
#   bash scripts/test.sh -m gpu              # only the CUDA tests (they skip themselves without a GPU)
# TEST_WORKERS sets the number of pytest-xdist workers (default 2; 0 runs in one process).
# Exits non-zero when a test fails; a selection that collects no test counts as success.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
workers="${TEST_WORKERS:-2}"
xdist=()
if [ "$workers" != "0" ]; then xdist=(-n "$workers"); fi
set +e
python -m pytest -q "${xdist[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: no tests were collected for this selection"
  exit 0
fi
exit "$rc"
