#!/usr/bin/env bash
# Creates .venv from scratch (or reuses it with PYCOMM_REUSE_VENV=1), installs
# torch (pinned; CPU build unless TORCH_SPEC says otherwise), NCCL headers/lib
# (nvidia-nccl-cu13, for the CUDA compile check), the test/bench tools, and
# builds pycomm._C in place (pip install -e, no build isolation).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

if [[ "${PYCOMM_REUSE_VENV:-0}" != 1 || ! -x .venv/bin/python ]]; then
  rm -rf .venv
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -m pip install -q "$TORCH_SPEC"
python -m pip install -q nvidia-nccl-cu13 -r requirements-dev.txt
echo "setup_env: building pycomm._C (about 2 minutes on 2 cores)..." >&2
python -m pip install -q --no-build-isolation --no-deps -e .
python -c "import pycomm, torch; from pycomm._ext import _C; print('setup_env: pycomm', pycomm.__version__, 'torch', torch.__version__, 'WITH_CUDA', _C.WITH_CUDA)"
