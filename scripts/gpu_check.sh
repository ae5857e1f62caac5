#!/usr/bin/env bash
# The GPU check: build the CUDA extension and verify it on a GPU, in two
# commands of at most 8 minutes each (a lent GPU machine allows 10 minutes a
# command and 15 minutes in all):
#
#   scripts/gpu_check.sh --quick OUTDIR     first: the build and the broad check
#   scripts/gpu_check.sh --rest  OUTDIR     then, if time is left (another OUTDIR)
#   scripts/gpu_check.sh --all   OUTDIR     both in sequence (OUTDIR/quick, OUTDIR/rest)
#
# --quick: (1) build: setup.py build_ext --inplace with ninja, MAX_JOBS = the
#   CPU count, TORCH_CUDA_ARCH_LIST = this GPU's arch only (either may be set
#   in the environment instead); (2) import pycomm with _C.WITH_CUDA; (3) the
#   reduction kernels against the CPU, bitwise (tests/test_gpu.py, pytest);
#   (4) the kernel benchmark (256 MiB fp32/bf16/fp16 vs torch add_ and a copy);
#   (5) one world of 2 ranks and one of 3, sharing the GPU (a distinct
#   NCCL_HOSTID per rank, NCCL over loopback sockets), each running many cases
#   (tests/gpu_plan.py QUICK): all_reduce every op x dtype, broadcast,
#   reduce_scatter / all_gather, reduce / gather / scatter / all_to_all, p2p
#   and batched p2p, async Work + CUDA-aware futures + streams, checked mode,
#   argument errors (raised on every rank: a crash or hang fails), the
#   timeout/abort path, ncclCommSplit groups, torch DDP with pycomm hooks and
#   PowerSGD against torch's, pycomm.parallel DDP, 1F1B and GPipe on 2 stages,
#   init_process_group("cpu:gloo,cuda:pycomm") with torch DDP, each equal to
#   one process.
# --rest: the build again (a no-op when the tree kept it), world 4, the CUDA
#   backend sweeps, stream semantics and wire dtypes (tests/gpu_plan.py REST),
#   and the all-reduce benchmark (ring vs nccl vs auto on the shared GPU: shows
#   it works, not its speed).
#
# Every step runs under a time limit (scripts/gpu_check.py: a step's cap, or
# a share of the time left), a hung multi-rank case is killed at its deadline
# with its ranks' stacks and its world respawned for the next cases, and a
# failure never stops the run (except a failed build). So the command ends
# within GPU_CHECK_TOTAL seconds (default 470) whatever hangs; an outer
# `timeout` 10 s later is the last resort.
#
# OUTDIR gets summary.json ({"commit", "device", "date", "torch", "nccl",
# "python", "wall_s", "tests": {"passed", "failed", "skipped", "failures":
# [{"name", "status", "traceback"}]}, "benchmarks": {...}}, also written
# after every step), gpu_check.log (this run's progress) and one log per step
# (build.log, kernels.log, bench_kernel.log, world2.log, ...): 7 files, fewer than the 8
# a device machine's $OUT returns. benchmarks/results/gpu/README.md says
# where they are committed; `python3 scripts/gpu_check.py render
# OUTDIR/summary.json` prints the README's GPU paragraph from them.
#
# Environment: PYTHON (default python3); GPU_CHECK_TOTAL (seconds, default
# 470); GPU_CHECK_COMMIT (the commit to record where the tree has no .git);
# TORCH_CUDA_ARCH_LIST, MAX_JOBS (the build); PYCOMM_GPU_TEST_MODE=multi
# (NCCL_MULTI_RANK_GPU_ENABLE=1 instead of NCCL_HOSTID; NCCL >= 2.30).
#
# Exit status: 0 every test passed; 1 something failed (summary.json lists
# it); 2 this machine cannot run the check (one line says why: no CUDA torch
# or no GPU), or a usage error.
# This replaces the former step-by-step mode (GPU_CHECK_STEPS, ten commands,
# about an hour), whose steps the two modes now cover.
set -uo pipefail

usage() { echo "usage: scripts/gpu_check.sh --quick|--rest|--all OUTDIR" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
case "$1" in
  --quick|--rest|--all) mode="${1#--}" ;;
  *) usage ;;
esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$2" || exit 2
OUT="$(cd "$2" && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
TOTAL="${GPU_CHECK_TOTAL:-470}"

# run_mode MODE DIR: one mode under the outer time limit, its progress
# mirrored to DIR/gpu_check.log; returns the driver's exit status.
run_mode() {
  mkdir -p "$2"
  timeout -k 5 "$((TOTAL + 10))" "$PY" scripts/gpu_check.py run --mode "$1" --out "$2" \
    --total "$TOTAL" 2>&1 | tee "$2/gpu_check.log"
  local rc=${PIPESTATUS[0]}
  (( rc == 124 || rc == 137 )) && echo "gpu_check: killed after $((TOTAL + 10)) s" | tee -a "$2/gpu_check.log"
  return "$rc"
}

if [[ "$mode" != all ]]; then
  run_mode "$mode" "$OUT"
  exit $?
fi
run_mode quick "$OUT/quick"
rc=$?
(( rc == 2 )) && exit 2
run_mode rest "$OUT/rest"
rc2=$?
exit $(( rc > rc2 ? rc : rc2 ))
