#!/usr/bin/env bash
# The test command: sets up .venv from scratch, runs the static checks
# (ruff, mypy, clang-format: scripts/lint.sh), builds and links the complete
# CUDA extension against the GPU machine's torch (scripts/cuda_build_check.sh:
# nvcc and the CUDA torch's headers, no GPU needed), then runs the suite.
#   bash scripts/test.sh [--full] [extra pytest args]
# --full also checks both ends of the supported torch range
# (scripts/torch_range_check.sh 2.11.0 2.14.1: a CPU build and about 5
# minutes each on 2 cores, with venvs of several GB set up once in
# ~/.cache/pycomm; PYCOMM_SKIP_TORCH_RANGE=1 skips it) and runs the `slow`
# variants (4-rank sweeps, more fault trials, sizes and examples); it takes
# several times longer. The default run stays under 40 minutes on CI.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# each phase's minutes, printed as it ends: what to cut when the run nears 40
phase() { echo "test: $1 done at $((SECONDS / 60)) min $((SECONDS % 60)) s" >&2; }
bash scripts/setup_env.sh
phase "setup (venv, build)"
# shellcheck disable=SC1091
source .venv/bin/activate
bash scripts/lint.sh
phase lint
if command -v nvcc >/dev/null; then
  bash scripts/cuda_build_check.sh
  phase "CUDA build check"
else
  echo "test: nvcc not found, skipping the CUDA build check" >&2
fi
if [[ "${1:-}" == "--full" ]]; then
  shift
  if [[ "${PYCOMM_SKIP_TORCH_RANGE:-0}" != 1 ]]; then
    bash scripts/torch_range_check.sh 2.11.0 2.14.1
    phase "torch range check"
  fi
  PYCOMM_SLOW=1 python -m pytest -q --timeout 1800 -p no:cacheprovider "$@" tests
else
  # the 20 slowest tests listed: what to mark `slow` when the run nears its 40 minutes
  python -m pytest -q -m "not slow" --timeout 900 --durations 20 -p no:cacheprovider "$@" tests
fi
phase tests
