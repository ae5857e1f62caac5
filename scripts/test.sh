#!/usr/bin/env bash
# The test command: sets up .venv from scratch, runs the static checks
# (ruff, mypy, clang-format: scripts/lint.sh), checks that every CUDA/NCCL
# source compiles (nvcc, no GPU needed), then runs the test suite.
#   bash scripts/test.sh [--full] [extra pytest args]
# --full also runs the `slow` variants (more fault trials, sizes and
# examples), which the default run skips; it takes several times longer.
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
if [[ "${1:-}" == "--full" ]]; then
  shift
  PYCOMM_SLOW=1 python -m pytest -q --timeout 1800 -p no:cacheprovider "$@" tests
else
  python -m pytest -q -m "not slow" --timeout 900 -p no:cacheprovider "$@" tests
fi
