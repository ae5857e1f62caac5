#!/usr/bin/env bash
# The GPU check: build the CUDA extension and verify it on a GPU, in two
# commands of at most 8 minutes each (a lent GPU machine allows 10 minutes a
# command and 15 minutes in all):
#
#   scripts/gpu_check.sh --quick OUTDIR     first: the build and the broad check
#   scripts/gpu_check.sh --rest  OUTDIR     then, if time is left (another OUTDIR)
#
# Run --rest right after --quick, in the very next device call: the device
# machine stays warm only 30 s after a call, and a later call gets a fresh
# machine, where --rest must rebuild everything (its build step then takes
# the time its worlds need). There is no mode running both: two 8-minute
# runs exceed the 10 minutes of one command, and their 14 files the 8 a
# command returns.
#
# --quick: (1) build: setup.py build_ext --inplace with ninja (checked first:
#   without it the check stops at once, exit status 2), MAX_JOBS = the CPU
#   count, TORCH_CUDA_ARCH_LIST = this GPU's arch only (either may be set
#   in the environment instead); (2) import pycomm with _C.WITH_CUDA; (3) the
#   reduction and quantization kernels against the CPU, bitwise
#   (tests/test_gpu.py, pytest);
#   (4) the kernel benchmark (256 MiB fp32/bf16/fp16 vs torch add_ and a copy);
#   (5) one world of 2 ranks and one of 3, sharing the GPU (a distinct
#   NCCL_HOSTID per rank, NCCL over loopback sockets), each running many cases
#   (tests/gpu_plan.py QUICK): all_reduce every op x dtype, broadcast,
#   reduce_scatter / all_gather, reduce / gather / scatter / all_to_all, p2p
#   and batched p2p, the wire dtypes (fp16/bf16 and the quantized int8/fp8,
#   residuals included) bitwise against a gloo communicator, async Work +
#   CUDA-aware futures + streams, checked mode, argument errors (raised on
#   every rank: a crash or hang fails), the timeout/abort path, ncclCommSplit
#   groups, torch DDP with pycomm hooks and PowerSGD against torch's,
#   pycomm.parallel DDP, 1F1B and GPipe on 2 stages,
#   init_process_group("cpu:gloo,cuda:pycomm") with torch DDP, each equal to
#   one process.
# --rest: the build again (a no-op when the tree kept it), world 4, the CUDA
#   backend sweeps, stream semantics and wire dtypes at 3 ranks
#   (tests/gpu_plan.py REST), and the all-reduce benchmark (ring vs nccl vs
#   auto on the shared GPU: shows it works, not its speed).
#
# Every step runs under a time limit (scripts/gpu_check.py: a step's cap, or
# a share of the time left), a hung multi-rank case is killed at its deadline
# with its ranks' stacks and its world respawned for the next cases, and a
# failure never stops the run (except a failed build). A build killed at its
# time limit is recorded as `timeout` (not `failed`); a case still running
# when the time runs out as `hung`; what could not start in time as `cut`
# (the run is then "incomplete", exit status 1). So the driver ends within
# GPU_CHECK_TOTAL seconds (default 465) whatever hangs; the outer `timeout`
# sends it SIGTERM 5 s later (it then kills the running step's processes,
# which live in sessions of their own, and saves summary.json with status
# "killed") and SIGKILL 3 s after that: the whole command ends within
# GPU_CHECK_TOTAL + 8 s (473 s by default).
#
# OUTDIR gets summary.json ({"commit", "device", "date", "torch", "nccl",
# "python", "wall_s", "status", "tests": {"passed", "failed", "skipped",
# "cut", "failures": [{"name", "status", "traceback"}], "cuts": [...]},
# "benchmarks": {...}}, also written after every step), gpu_check.log (this
# run's progress) and one log per step (build.log, kernels.log,
# bench_kernel.log, world2.log, ...): 7 files, fewer than the 8 a device
# machine's $OUT returns. benchmarks/results/gpu/README.md says where they
# are committed; `python3 scripts/gpu_check.py render OUTDIR/summary.json`
# prints the README's GPU paragraph from them.
#
# Environment: PYTHON (default python3); GPU_CHECK_TOTAL (seconds, default
# 465); GPU_CHECK_COMMIT (the commit to record: the device machine's copy has
# no .git, so pass the sha of `git rev-parse HEAD` run on your machine; the
# run prints a WARNING line without it); TORCH_CUDA_ARCH_LIST, MAX_JOBS (the
# build); PYCOMM_GPU_TEST_MODE=multi (NCCL_MULTI_RANK_GPU_ENABLE=1 instead of
# NCCL_HOSTID; NCCL >= 2.30).
#
# Exit status: 0 every test passed; 1 something failed, was cut for time, or
# the run was killed by the outer time limit (timeout's 124 and 137 become
# 1); 2 this machine cannot run the check (one line says why: no CUDA torch,
# no GPU or no ninja), or a usage error.
# This replaces the former step-by-step mode (GPU_CHECK_STEPS, ten commands,
# about an hour), whose steps the two modes now cover.
set -uo pipefail

usage() { echo "usage: scripts/gpu_check.sh --quick|--rest OUTDIR" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
case "$1" in
  --quick|--rest) mode="${1#--}" ;;
  *) usage ;;
esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$2" || exit 2
OUT="$(cd "$2" && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
TOTAL="${GPU_CHECK_TOTAL:-465}"

# The driver under the outer time limit, its progress mirrored to
# OUT/gpu_check.log.
timeout -k 3 "$((TOTAL + 5))" "$PY" scripts/gpu_check.py run --mode "$mode" --out "$OUT" \
  --total "$TOTAL" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
if (( rc == 124 || rc == 137 )); then
  echo "gpu_check: killed by the outer time limit ($((TOTAL + 5)) s)" | tee -a "$OUT/gpu_check.log"
  rc=1
fi
exit "$rc"
