#!/usr/bin/env bash
# Static checks (run by scripts/test.sh, or alone in an environment with
# torch and requirements-dev.txt installed):
#   ruff check pycomm           lint (ruff.toml)
#   mypy                        types of pycomm/ (mypy.ini; needs torch)
#   scripts/check_size.py       a source + its header <= 700 lines, functions
#                               <= 60 lines of logic
#   clang-format --dry-run      csrc/ formatted as .clang-format says
# `bash scripts/lint.sh --fix` first applies what the tools can fix (ruff's
# safe fixes, clang-format -i on the same files), then checks.
# MYPY_ARGS adds mypy options, e.g. --python-executable PATH when the tools
# live in another environment than torch.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

mapfile -t sources < <(git ls-files 'csrc/*.h' 'csrc/*.cc' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh')
if [[ "${1:-}" == --fix ]]; then
  ruff check --fix pycomm || true  # what is left is reported below
  clang-format -i "${sources[@]}"
fi

echo "lint: ruff" >&2
ruff check pycomm
echo "lint: mypy" >&2
mypy ${MYPY_ARGS:-}
echo "lint: size limits" >&2
python scripts/check_size.py
echo "lint: clang-format" >&2
clang-format --dry-run -Werror "${sources[@]}"
echo "lint: OK (${#sources[@]} C++/CUDA files formatted)" >&2
