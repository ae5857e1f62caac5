#!/usr/bin/env bash
# The test command: sets up .venv from scratch, runs the static checks
# (ruff, mypy, clang-format: scripts/lint.sh), checks that every CUDA/NCCL
# source compiles (nvcc, no GPU needed), then runs the test suite.
#   bash scripts/test.sh [extra pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
# shellcheck disable=SC1091
source .venv/bin/activate
bash scripts/lint.sh
if command -v nvcc >/dev/null; then
  bash scripts/compile_cuda.sh
else
  echo "test: nvcc not found, skipping the CUDA compile check" >&2
fi
python -m pytest -q -m "not slow" --timeout 900 -p no:cacheprovider "$@" tests
