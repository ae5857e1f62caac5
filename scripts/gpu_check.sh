#!/usr/bin/env bash
# The whole GPU check in one command, on a 1-GPU (or larger) machine with a
# CUDA build of torch:
#
#   scripts/gpu_check.sh OUTDIR
#
#  1. builds the CUDA extension in place (python setup.py build_ext --inplace)
#     and checks that pycomm._C.WITH_CUDA is True;
#  2. runs pytest -m gpu (2-4 ranks sharing the GPU): first with a distinct
#     NCCL_HOSTID per rank; if that fails, again with NCCL_MULTI_RANK_GPU_ENABLE=1
#     (PYCOMM_GPU_TEST_MODE=multi); OUTDIR/gpu_test_mode.txt records what worked;
#  3. only if asked (GPU_CHECK_STEPS includes "cpu"): the CPU suite
#     (-m "not gpu"), for information; CI runs it anyway;
#  4. benchmarks: OUTDIR/kernel.json (reduce kernel vs D2D copy, 256 MiB fp32/
#     bf16/fp16) and OUTDIR/allreduce.json (ring vs nccl vs auto busbw,
#     64 MiB..1 GiB; OUTDIR/auto_table.json is the measured auto table).
#
# GPU_CHECK_STEPS selects steps (default "build gpu kernel allreduce"; add
# "cpu" for the CPU suite). Under a tight per-command time limit, split it:
# GPU_CHECK_STEPS="build gpu" first, then GPU_CHECK_STEPS="kernel allreduce"
# (a later step reuses the in-place build and the recorded test mode).
#
# Exit status: non-zero if the build, the GPU tests (in both modes) or a
# benchmark failed. Logs of every step are in OUTDIR.
set -uo pipefail

OUT="${1:?usage: scripts/gpu_check.sh OUTDIR}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
STEPS=" ${GPU_CHECK_STEPS:-build gpu kernel allreduce} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
status=0

{
  echo "date: $(date -u +%FT%TZ)"
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name() if torch.cuda.is_available() else "-")'
  command -v nvcc >/dev/null && nvcc --version | tail -1
  nvidia-smi 2>/dev/null | head -20
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if want build; then
echo "== build (CUDAExtension)"
if ! "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  tail -50 "$OUT/build.log"; echo "gpu_check: BUILD FAILED (see $OUT/build.log)"; exit 1
fi
fi
if ! "$PY" -c 'from pycomm._ext import _C; assert _C.WITH_CUDA, "CPU build"; print("WITH_CUDA", _C.WITH_CUDA, "NCCL headers", _C.NCCL_VERSION)' 2>&1 | tee -a "$OUT/build.log"; then
  grep -i "pycomm:" "$OUT/build.log"; echo "gpu_check: the extension was built without CUDA"; exit 1
fi

if want gpu; then
echo "== pytest -m gpu (NCCL_HOSTID per rank)"
mode=""
if PYCOMM_GPU_TEST_MODE=hostid timeout 1500 "$PY" -m pytest -m gpu tests/test_gpu.py -v -rs \
     --junitxml="$OUT/pytest_gpu_hostid.xml" > "$OUT/pytest_gpu_hostid.log" 2>&1; then
  mode="hostid (NCCL_HOSTID=host<rank>, socket transport over lo)"
else
  tail -40 "$OUT/pytest_gpu_hostid.log"
  echo "== pytest -m gpu (NCCL_MULTI_RANK_GPU_ENABLE=1)"
  if PYCOMM_GPU_TEST_MODE=multi timeout 1500 "$PY" -m pytest -m gpu tests/test_gpu.py -v -rs \
       --junitxml="$OUT/pytest_gpu_multi.xml" > "$OUT/pytest_gpu_multi.log" 2>&1; then
    mode="multi (NCCL_MULTI_RANK_GPU_ENABLE=1)"
    export PYCOMM_GPU_TEST_MODE=multi
  else
    tail -40 "$OUT/pytest_gpu_multi.log"
    mode="none: both modes failed"
    status=1
  fi
fi
echo "$mode" | tee "$OUT/gpu_test_mode.txt"
tail -5 "$OUT"/pytest_gpu_*.log
elif grep -q '^multi' "$OUT/gpu_test_mode.txt" 2>/dev/null; then
  export PYCOMM_GPU_TEST_MODE=multi
fi

if want cpu; then
echo "== pytest -m 'not gpu' (CPU suite, informational)"
timeout 900 "$PY" -m pytest tests -m "not gpu" -q > "$OUT/pytest_cpu.log" 2>&1
tail -3 "$OUT/pytest_cpu.log"
fi

if want kernel; then
echo "== benchmark: reduction kernel vs D2D copy"
if ! timeout 600 "$PY" benchmarks/gpu/bench_kernel.py --out "$OUT/kernel.json" > "$OUT/bench_kernel.log" 2>&1; then
  tail -30 "$OUT/bench_kernel.log"; status=1
fi
cat "$OUT/bench_kernel.log"
fi

if want allreduce; then
echo "== benchmark: ring vs nccl vs auto all-reduce"
if ! timeout 1200 "$PY" benchmarks/gpu/bench_allreduce.py --out "$OUT/allreduce.json" \
     --auto-table "$OUT/auto_table.json" > "$OUT/bench_allreduce.log" 2>&1; then
  tail -30 "$OUT/bench_allreduce.log"; status=1
fi
tail -40 "$OUT/bench_allreduce.log"
fi

echo "gpu_check: done (status $status); results in $OUT"
exit $status
