#!/usr/bin/env bash
# The test command: sets up .venv from scratch, runs the static checks
# (ruff, mypy, clang-format: scripts/lint.sh), builds and links the complete
# CUDA extension against the GPU machine's torch (scripts/cuda_build_check.sh:
# nvcc and the CUDA torch's headers, no GPU needed), checks both ends of the
# supported torch range (scripts/torch_range_check.sh), then runs the suite.
#   bash scripts/test.sh [--full] [extra pytest args]
# --full also runs the `slow` variants (more fault trials, sizes and
# examples), which the default run skips; it takes several times longer.
# The range check runs torch 2.11.0 (the GPU machine's) by default and both
# ends (2.11.0 and 2.14.1) with --full: each end costs a CPU build and about
# 5 minutes on 2 cores, and the default run stays under 40 minutes.
# PYCOMM_SKIP_TORCH_RANGE=1 skips it (it sets up venvs of several GB the
# first time; later runs reuse them from ~/.cache/pycomm).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
# shellcheck disable=SC1091
source .venv/bin/activate
bash scripts/lint.sh
if command -v nvcc >/dev/null; then
  bash scripts/cuda_build_check.sh
else
  echo "test: nvcc not found, skipping the CUDA build check" >&2
fi
if [[ "${PYCOMM_SKIP_TORCH_RANGE:-0}" != 1 ]]; then
  if [[ "${1:-}" == "--full" ]]; then
    bash scripts/torch_range_check.sh 2.11.0 2.14.1
  else
    bash scripts/torch_range_check.sh 2.11.0
  fi
fi
if [[ "${1:-}" == "--full" ]]; then
  shift
  PYCOMM_SLOW=1 python -m pytest -q --timeout 1800 -p no:cacheprovider "$@" tests
else
  # the 20 slowest tests listed: what to mark `slow` when the run nears its 40 minutes
  python -m pytest -q -m "not slow" --timeout 900 --durations 20 -p no:cacheprovider "$@" tests
fi
