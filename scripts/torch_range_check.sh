#!/usr/bin/env bash
# Checks the ends of the supported torch range (README, setup.py): for each
# version, in a venv of its own, builds the CPU extension and runs a short
# smoke subset of the tests (init, every collective on shm and gloo, the
# c10d backend with torch DDP, a DDP hook).
#
#   scripts/torch_range_check.sh [VERSION ...]     (default: 2.11.0 2.14.1)
#
# Run it before landing changes to csrc/torch, pycomm/backend.py or
# pycomm/_setup.py (the code that leans on torch's C++ and private c10d
# APIs); scripts/test.sh --full runs it too. Both ends are CUDA builds of torch,
# which import without a GPU; the CPU extension is built against them
# (PYCOMM_FORCE_CPU=1): the CUDA build against 2.11 is
# scripts/cuda_build_check.sh's.
#
# Each version's venv lives in the cache (PYCOMM_CACHE, default
# ~/.cache/pycomm/venv-torch-VERSION) and is reused while its torch is the
# one asked for; the repo is copied (git ls-files, tracked and untracked
# files alike) into OUTDIR/src-VERSION so that building there leaves the
# checkout's own pycomm/_C untouched.
#
# Environment: PYCOMM_CACHE, OUTDIR (default build/torch_range), PYTHON
# (the interpreter the venvs are made from), JOBS (MAX_JOBS of the builds).
# Exit status: 0 every version passed; 1 a build or a smoke test failed;
# 2 a venv could not be set up (a version pip cannot get).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${PYCOMM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pycomm}"
OUT="${OUTDIR:-$ROOT/build/torch_range}"
PY="${PYTHON:-python3}"
export MAX_JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
VERSIONS=("$@")
(( ${#VERSIONS[@]} )) || VERSIONS=(2.11.0 2.14.1)
say() { echo "torch_range_check: $*"; }

# The smoke subset, as pytest node ids: init, every collective on both CPU
# transports (2 and 3 ranks), the c10d backend with torch DDP, a DDP hook.
SMOKE=(tests/test_api.py::test_init_from_torch_group_matches_torch_all_reduce
       tests/test_api.py::test_init_without_rendezvous_says_how
       "tests/test_backend.py::test_every_op_matches_reference[2]"
       tests/test_backend.py::test_torch_ddp_equals_one_process
       "tests/test_hooks.py::test_ddp_hooks_match_plain_ddp_and_single_process[2]"
       # the GPU check's runner and device-generic case bodies, which must
       # work on the GPU machine's torch (2.11) before a GPU is lent
       tests/test_gpu_check.py::test_world_step_records_each_case
       "tests/test_gpu_check.py::test_plan_bodies_pass_on_gloo_2_ranks")
for t in gloo shm; do
  SMOKE+=("tests/test_collectives.py::test_all_reduce_every_op_dtype_size[$t-ring-2]"
          "tests/test_collectives.py::test_all_reduce_every_op_dtype_size[$t-auto-3]"
          "tests/test_collectives.py::test_reduce_scatter[$t-3]"
          "tests/test_collectives.py::test_all_gather[$t-2]"
          "tests/test_collectives.py::test_broadcast_from_every_src[$t-3]"
          "tests/test_collectives.py::test_p2p_both_directions[$t-2]"
          "tests/test_collectives.py::test_async_ops_waited_out_of_order[$t-2]"
          "tests/test_rooted.py::test_reduce_every_op_dtype_size_root[$t-3]"
          "tests/test_rooted.py::test_gather_scatter[$t-2]"
          "tests/test_rooted.py::test_all_to_all[$t-3]")
done

# venv_for VERSION: a venv whose torch is VERSION, with the test tools.
venv_for() {
  local version="$1" venv="$CACHE/venv-torch-$1"
  if [[ -x "$venv/bin/python" ]] &&
     [[ "$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" == "$version" ]]; then
    return 0
  fi
  say "setting up $venv (torch==$version)"
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  # scripts/cuda_build_check.sh may have the wheel already (it downloads it
  # with --no-deps); pip resolves its dependencies either way.
  local wheel
  wheel="$(ls "$CACHE"/wheels/torch-"$version"-*.whl 2>/dev/null | head -1 || true)"
  # (pip's warnings about this machine's unused local indexes are noise)
  "$venv/bin/python" -m pip install -q "${wheel:-torch==$version}" \
    pytest pytest-timeout numpy expecttest ninja 2>&1 | grep -v "^WARNING: Location" || true
  "$venv/bin/python" -c "import torch" || return 2
}

status=0
mkdir -p "$OUT"
for version in "${VERSIONS[@]}"; do
  if ! venv_for "$version"; then
    say "torch $version: cannot set up its venv"; exit 2
  fi
  vpy="$CACHE/venv-torch-$version/bin/python"
  src="$OUT/src-$version"
  rm -rf "$src"
  mkdir -p "$src"
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard |
     while IFS= read -r -d '' f; do if [[ -f "$f" ]]; then printf '%s\0' "$f"; fi; done |
     xargs -0 -r cp --parents -t "$src")
  log="$OUT/torch-$version.log"
  say "torch $("$vpy" -c 'import torch; print(torch.__version__)'): building the CPU extension (log $log)"
  if ! (cd "$src" && PYCOMM_FORCE_CPU=1 "$vpy" setup.py -q build_ext --inplace) > "$log" 2>&1; then
    tail -40 "$log"; say "torch $version: BUILD FAILED"; status=1; continue
  fi
  if ! (cd "$src" && "$vpy" -m pytest -q --timeout 600 -p no:cacheprovider "${SMOKE[@]}") \
      >> "$log" 2>&1; then
    status=1
    grep -E '^(FAILED|ERROR)' "$log" | sed 's/^/  /'
  fi
  say "torch $version: $(tail -1 "$log")"
done
(( status == 0 )) && say "OK (${VERSIONS[*]})" || say "FAILED"
exit $status
