#!/usr/bin/env bash
# The GPU check, on a 1-GPU (or larger) machine with a CUDA build of torch,
# in steps that each finish within 10 minutes (every step runs under
# `timeout`, at most STEP_TIMEOUT = 540 s, and every pytest call under
# --timeout, so one hung test fails instead of eating the step):
#
#   scripts/gpu_check.sh OUTDIR                      (all default steps, in order)
#   GPU_CHECK_STEPS="STEP ..." scripts/gpu_check.sh OUTDIR
#
# Steps:
#   build            python setup.py build_ext --inplace (the CUDAExtension;
#                    setup.py picks TORCH_CUDA_ARCH_LIST) and checks that
#                    pycomm._C.WITH_CUDA is True (every step checks the latter).
#   mode             how 2-4 ranks share one GPU: a short 2-rank probe test with
#                    a distinct NCCL_HOSTID per rank (socket transport over lo);
#                    if that fails, and only where NCCL >= 2.30 (torch's and
#                    pycomm's; the variable does not exist before, and with NCCL
#                    2.28.9 that mode crashed every test), with
#                    NCCL_MULTI_RANK_GPU_ENABLE=1. Writes OUTDIR/gpu_test_mode.txt,
#                    which the multi-rank test steps read (they run `mode`
#                    first if it is missing).
#   gpu-*            tests/test_gpu.py in six parts (pytest -m gpu -k ...):
#     gpu-kernels      the reduction kernels against the CPU (one process);
#     gpu-allreduce    all_reduce at 2-4 ranks, NaN propagation, wire dtype;
#     gpu-collectives  broadcast, reduce_scatter / all_gather, p2p, async/streams;
#     gpu-misuse       argument errors, checked mode, the timeout/abort test;
#     gpu-layers       pipeline stages, DDP and DDP hooks over NCCL;
#     gpu-rest         every other test of the file (new ones land here).
#   gpu              = all six gpu-* steps, in that order.
#   cpu              the CPU suite (-m "not gpu"), for information only: CI runs
#                    it, and it may not finish within the step's time here.
#   kernel           benchmark: reduction kernel vs D2D copy, 256 MiB
#                    fp32/bf16/fp16 -> OUTDIR/kernel.json.
#   allreduce        benchmark: ring vs nccl vs auto busbw, 64 MiB..1 GiB ->
#                    OUTDIR/allreduce.json, OUTDIR/auto_table.json (the measured
#                    auto table).
# Default GPU_CHECK_STEPS: "build mode gpu kernel allreduce" (about an hour).
#
# Under a 10-minute-per-command limit, run one step per command, in this
# order (later steps reuse the in-place build and OUTDIR/gpu_test_mode.txt,
# so the machine must keep the working tree between commands):
#
#   GPU_CHECK_STEPS=build           scripts/gpu_check.sh OUTDIR
#   GPU_CHECK_STEPS=mode            scripts/gpu_check.sh OUTDIR
#   GPU_CHECK_STEPS=gpu-kernels     scripts/gpu_check.sh OUTDIR
#   GPU_CHECK_STEPS=gpu-allreduce   scripts/gpu_check.sh OUTDIR
#   GPU_CHECK_STEPS=gpu-collectives scripts/gpu_check.sh OUTDIR
#   GPU_CHECK_STEPS=gpu-misuse      scripts/gpu_check.sh OUTDIR
#   GPU_CHECK_STEPS=gpu-layers      scripts/gpu_check.sh OUTDIR
#   GPU_CHECK_STEPS=gpu-rest        scripts/gpu_check.sh OUTDIR
#   GPU_CHECK_STEPS=kernel          scripts/gpu_check.sh OUTDIR
#   GPU_CHECK_STEPS=allreduce       scripts/gpu_check.sh OUTDIR
#
# Environment: PYTHON (default python3); STEP_TIMEOUT (seconds per step,
# default 540); TEST_TIMEOUT (pytest --timeout per test, default 300; the
# multi-rank harness gives up on its ranks 30 s earlier).
#
# Exit status: 0 if every step run passed; 1 if the build, a GPU test step, the
# mode probe (in every mode allowed) or a benchmark failed; 2 if this machine
# cannot run the check (no CUDA torch, no GPU, unknown step). Logs of every
# step are in OUTDIR (STEP.log; pytest also writes STEP.xml).
set -uo pipefail

OUT="${1:?usage: scripts/gpu_check.sh OUTDIR}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
STEP_TIMEOUT="${STEP_TIMEOUT:-540}"
TEST_TIMEOUT="${TEST_TIMEOUT:-300}"
# The multi-rank harness of tests/test_gpu.py fails a test whose ranks hang
# after this many seconds (before pytest-timeout would).
export PYCOMM_GPU_TEST_TIMEOUT="$((TEST_TIMEOUT - 30))"
# pytest's per-test limit needs the pytest-timeout plugin, which the GPU
# machine may lack (and cannot download): without it each step keeps only
# the harness's limit above and the step's `timeout`.
PYTEST_TIMEOUT=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
  PYTEST_TIMEOUT=(--timeout "$TEST_TIMEOUT")
else
  echo "gpu_check: pytest-timeout is not installed; tests run without pytest's per-test limit"
fi

# -k selections of tests/test_gpu.py, one per test step; gpu-rest takes the rest.
declare -A SELECT=(
  [gpu-kernels]="test_kernel_bitwise_equals_cpu or test_scale_and_fused_reduce_scale_bitwise"
  [gpu-allreduce]="test_all_reduce_every_op_dtype or test_all_reduce_default_slices_and_auto or test_ring_max_min_propagate_nan or test_wire_dtype_all_reduce_bitwise_equals_cpu"
  [gpu-collectives]="test_broadcast_from_every_src or test_reduce_scatter_all_gather or test_p2p_and_batch or test_user_p2p_is_independent_of_collectives or test_async_work_future_and_stream_semantics"
  [gpu-misuse]="test_argument_errors or test_checked_mode_on_gpu or test_timeout_aborts_and_raises"
  [gpu-layers]="test_pipeline_two_stages_share_the_gpu or test_ddp_matches_full_batch_over_nccl or test_ddp_hooks_over_nccl"
)
TEST_STEPS=(gpu-kernels gpu-allreduce gpu-collectives gpu-misuse gpu-layers gpu-rest)
rest=""
for s in "${TEST_STEPS[@]:0:5}"; do rest+="${rest:+ or }${SELECT[$s]}"; done
SELECT[gpu-rest]="not ($rest)"
PROBE="test_all_reduce_default_slices_and_auto"

fail() { echo "gpu_check: $*" >&2; exit 2; }

# ---- which steps
requested=(${GPU_CHECK_STEPS:-build mode gpu kernel allreduce})
steps=()
for s in "${requested[@]}"; do
  case "$s" in
    gpu) steps+=("${TEST_STEPS[@]}") ;;
    build|mode|cpu|kernel|allreduce|gpu-kernels|gpu-allreduce|gpu-collectives|gpu-misuse|gpu-layers|gpu-rest)
      steps+=("$s") ;;
    *) fail "unknown step '$s' in GPU_CHECK_STEPS; steps: build mode gpu ${TEST_STEPS[*]} cpu kernel allreduce" ;;
  esac
done

# ---- can this machine run it? (a clear message, not a traceback)
"$PY" - > "$OUT/env.txt" 2>&1 <<'EOF'
import datetime, shutil, subprocess
print("date:", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
try:
    import torch
except Exception as e:  # noqa: BLE001
    print("torch: cannot import:", e)
    raise SystemExit(0)
gpus = torch.cuda.device_count() if torch.version.cuda else 0
names = [torch.cuda.get_device_name(i) for i in range(gpus)]
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else "-"
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", nccl, "gpus", gpus, names)
for cmd in (["nvcc", "--version"], ["nvidia-smi"]):
    if shutil.which(cmd[0]):
        out = subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()
        print("\n".join(out[-1:] if cmd[0] == "nvcc" else out[:20]))
EOF
cat "$OUT/env.txt"
need_gpu=0
for s in "${steps[@]}"; do [[ "$s" == build ]] || need_gpu=1; done
"$PY" - "$need_gpu" <<'EOF' || exit 2
import sys
try:
    import torch
except Exception as e:  # noqa: BLE001
    sys.exit(f"gpu_check: cannot import torch ({e}); install a CUDA build of torch")
if torch.version.cuda is None:
    sys.exit(f"gpu_check: torch {torch.__version__} is a CPU build (torch.version.cuda is None); "
             "the GPU check needs a CUDA build of torch on a machine with an NVIDIA GPU")
if sys.argv[1] == "1" and not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU "
             "(torch.cuda.is_available() is False); run it on a machine with an NVIDIA GPU")
EOF

status=0
step_failed() { echo "gpu_check: step $1 FAILED (see $OUT/${2:-$1.log})"; status=1; }
# run STEP CMD...: the command under the step's time limit, output to OUTDIR/STEP.log.
run() {
  local step="$1"; shift
  timeout -k 10 "$STEP_TIMEOUT" "$@" > "$OUT/$step.log" 2>&1
  local rc=$?
  (( rc == 124 || rc == 137 )) && echo "gpu_check: step $step ran past ${STEP_TIMEOUT} s" >> "$OUT/$step.log"
  return $rc
}
# pytest_gpu STEP MODE -k EXPR: tests/test_gpu.py in the given sharing mode.
pytest_gpu() {
  local step="$1" mode="$2"; shift 2
  PYCOMM_GPU_TEST_MODE="$mode" run "$step" "$PY" -m pytest -m gpu tests/test_gpu.py -v -rs \
    -p no:cacheprovider ${PYTEST_TIMEOUT[@]+"${PYTEST_TIMEOUT[@]}"} --junitxml="$OUT/$step.xml" "$@"
}

check_extension() {
  "$PY" - <<'EOF' 2>&1 | tee -a "$OUT/extension.txt"
import sys
try:
    from pycomm._ext import _C
except Exception as e:  # noqa: BLE001
    sys.exit(f"gpu_check: cannot load pycomm._C ({e}); run the build step first")
if not getattr(_C, "WITH_CUDA", False):
    sys.exit("gpu_check: pycomm._C was built without CUDA (see build.log, lines 'pycomm:'); "
             "run the build step with a CUDA torch and CUDA_HOME/nvcc available")
print("WITH_CUDA", _C.WITH_CUDA, "NCCL headers", _C.NCCL_VERSION)
EOF
}

# NCCL >= 2.30 in torch and in pycomm's build: may NCCL_MULTI_RANK_GPU_ENABLE be tried?
multi_allowed() {
  "$PY" - <<'EOF'
import sys
import torch
from pycomm._ext import _C
v = torch.cuda.nccl.version()
torch_v = tuple(v) if isinstance(v, tuple) else (v // 10000, v // 100 % 100, v % 100)
code = int(getattr(_C, "NCCL_VERSION", 0))
ours = (code // 10000, code // 100 % 100, code % 100)
low = min(torch_v[:2], ours[:2])
print(f"torch NCCL {'.'.join(map(str, torch_v))}, pycomm NCCL headers {'.'.join(map(str, ours))}")
sys.exit(0 if low >= (2, 30) else 1)
EOF
}

probe_mode() {
  echo "== mode: probe ($PROBE) with NCCL_HOSTID per rank"
  if pytest_gpu mode-hostid hostid -k "$PROBE"; then
    echo "hostid" > "$OUT/gpu_test_mode.txt"
  else
    tail -30 "$OUT/mode-hostid.log"
    local versions
    if versions="$(multi_allowed)"; then
      echo "== mode: probe with NCCL_MULTI_RANK_GPU_ENABLE=1 ($versions)"
      if pytest_gpu mode-multi multi -k "$PROBE"; then
        echo "multi" > "$OUT/gpu_test_mode.txt"
      else
        tail -30 "$OUT/mode-multi.log"
        echo "none: hostid and multi failed" > "$OUT/gpu_test_mode.txt"
      fi
    else
      echo "none: hostid failed; multi not tried ($versions; needs NCCL >= 2.30)" \
        > "$OUT/gpu_test_mode.txt"
    fi
  fi
  echo "mode: $(cat "$OUT/gpu_test_mode.txt")"
  [[ "$(cat "$OUT/gpu_test_mode.txt")" != none* ]]
}

for step in "${steps[@]}"; do
  case "$step" in
    build)
      echo "== build (CUDAExtension)"
      if ! run build "$PY" setup.py build_ext --inplace; then
        tail -50 "$OUT/build.log"; echo "gpu_check: BUILD FAILED (see $OUT/build.log)"; exit 1
      fi
      grep "^pycomm:" "$OUT/build.log"
      check_extension || exit 1
      ;;
    mode)
      check_extension || exit 1
      probe_mode || step_failed mode "mode-*.log"
      ;;
    gpu-*)
      check_extension || exit 1
      if [[ "$step" == gpu-kernels ]]; then
        mode=hostid  # one process: no GPU sharing involved
      else
        if [[ ! -f "$OUT/gpu_test_mode.txt" ]]; then probe_mode || step_failed mode "mode-*.log"; fi
        mode="$(cat "$OUT/gpu_test_mode.txt")"
      fi
      if [[ "$mode" == none* ]]; then
        echo "gpu_check: $step skipped: no way to share the GPU between ranks ($mode)"; status=1
        continue
      fi
      echo "== $step (pytest -m gpu, mode $mode)"
      pytest_gpu "$step" "$mode" -k "${SELECT[$step]}"
      rc=$?
      # 5: nothing selected (gpu-rest when every test has a step of its own)
      if (( rc != 0 && rc != 5 )); then tail -40 "$OUT/$step.log"; step_failed "$step"; fi
      tail -3 "$OUT/$step.log"
      ;;
    cpu)
      echo "== cpu (pytest -m 'not gpu', informational)"
      run cpu "$PY" -m pytest tests -m "not gpu" -q -p no:cacheprovider ${PYTEST_TIMEOUT[@]+"${PYTEST_TIMEOUT[@]}"}
      tail -3 "$OUT/cpu.log"
      ;;
    kernel)
      check_extension || exit 1
      echo "== kernel: reduction kernel vs D2D copy"
      run kernel "$PY" benchmarks/gpu/bench_kernel.py --out "$OUT/kernel.json" || step_failed kernel
      cat "$OUT/kernel.log"
      ;;
    allreduce)
      check_extension || exit 1
      [[ "$(cat "$OUT/gpu_test_mode.txt" 2>/dev/null)" == multi ]] && export PYCOMM_GPU_TEST_MODE=multi
      echo "== allreduce: ring vs nccl vs auto all-reduce"
      run allreduce "$PY" benchmarks/gpu/bench_allreduce.py --out "$OUT/allreduce.json" \
        --auto-table "$OUT/auto_table.json" || step_failed allreduce
      tail -40 "$OUT/allreduce.log"
      ;;
  esac
done

echo "gpu_check: done (status $status); results in $OUT"
exit $status
