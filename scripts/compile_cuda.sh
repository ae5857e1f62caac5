#!/usr/bin/env bash
# Compiles every csrc/cuda and csrc/core source with nvcc against the NCCL
# headers and links them into one shared object, without a GPU. CI runs it to
# keep the CUDA/NCCL code compiling on machines that cannot run it.
#
#   scripts/compile_cuda.sh [OUTDIR]      (default build/cuda_check)
#
# Environment: NVCC (default: nvcc on PATH), NCCL_HOME (default: the
# nvidia-nccl-cu13 wheel), CUDA_ARCH (default 90), JOBS (default: CPU count).
# Device code is built as setup.py builds it without a GPU ("9.0+PTX"): sm_ARCH
# machine code plus compute_ARCH PTX, so the PTX generation is checked too.
# Also syntax-checks the torch binding (csrc/torch/*.cpp) with
# -DPYCOMM_WITH_CUDA when the installed torch ships c10/cuda headers
# (PYCOMM_SKIP_BINDING_CHECK=1 skips it). Exits non-zero on any error.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/build/cuda_check}"
NVCC="${NVCC:-nvcc}"
ARCH="${CUDA_ARCH:-90}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
PY="${PYTHON:-python3}"

command -v "$NVCC" >/dev/null || { echo "compile_cuda: nvcc not found (set NVCC)" >&2; exit 2; }
if [[ -z "${NCCL_HOME:-}" ]]; then
  NCCL_HOME="$("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); import importlib.util as u; s=u.spec_from_file_location("bi", sys.argv[1]+"/pycomm/_build_info.py"); m=u.module_from_spec(s); s.loader.exec_module(m); h=m.nccl_home(); print(h or "")' "$ROOT")"
fi
[[ -n "$NCCL_HOME" && -f "$NCCL_HOME/include/nccl.h" ]] || {
  echo "compile_cuda: nccl.h not found (pip install nvidia-nccl-cu13 or set NCCL_HOME)" >&2; exit 2; }
NCCL_LIB="$(ls "$NCCL_HOME"/lib/libnccl.so "$NCCL_HOME"/lib/libnccl.so.2 2>/dev/null | head -1 || true)"
[[ -n "$NCCL_LIB" ]] || { echo "compile_cuda: no libnccl.so in $NCCL_HOME/lib" >&2; exit 2; }

mkdir -p "$OUT/obj"
rm -f "$OUT"/obj/*.o "$OUT"/libpycomm_cuda.so
echo "compile_cuda: $("$NVCC" --version | tail -1)"
echo "compile_cuda: NCCL $NCCL_HOME ($(grep -m1 '#define NCCL_VERSION_CODE' "$NCCL_HOME/include/nccl.h" | awk '{print $3}')), sm_$ARCH + compute_$ARCH PTX"

# Same flags as the CUDAExtension build: pycomm/_build_info.py NVCC_FLAGS plus
# torch.utils.cpp_extension's COMMON_NVCC_FLAGS (no implicit half conversions).
GENCODE=(-gencode "arch=compute_$ARCH,code=[sm_$ARCH,compute_$ARCH]")
FLAGS=("${GENCODE[@]}" -std=c++17 -O3 -fmad=false --expt-relaxed-constexpr
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
       -Xcompiler -fPIC -Xcompiler -Wall -Xcompiler -Wno-unused-function
       -Werror all-warnings -I"$NCCL_HOME/include")

SOURCES=("$ROOT"/csrc/cuda/*.cu "$ROOT"/csrc/cuda/*.cc "$ROOT"/csrc/core/*.cc)
fail=0
pids=()
for src in "${SOURCES[@]}"; do
  obj="$OUT/obj/$(basename "$(dirname "$src")")_$(basename "$src").o"
  # .cc files go through nvcc as C++ (-x cu not needed: host compiler).
  ( "$NVCC" "${FLAGS[@]}" -c "$src" -o "$obj" && echo "  ok   ${src#$ROOT/}" ) &
  pids+=($!)
  if (( ${#pids[@]} >= JOBS )); then
    wait "${pids[0]}" || fail=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || fail=1; done
if (( fail )); then echo "compile_cuda: FAILED (compile)" >&2; exit 1; fi

# -z defs: every symbol must resolve now (against NCCL, cudart and libstdc++),
# so a declared-but-undefined function fails here rather than at import.
"$NVCC" "${GENCODE[@]}" -shared -o "$OUT/libpycomm_cuda.so" "$OUT"/obj/*.o \
  -L"$NCCL_HOME/lib" -l:"$(basename "$NCCL_LIB")" -lcudart -Xlinker -z,defs \
  -Xlinker -rpath,"$NCCL_HOME/lib"
echo "  ok   linked $OUT/libpycomm_cuda.so"

if [[ -z "${PYCOMM_SKIP_BINDING_CHECK:-}" && -f "$ROOT/csrc/torch/cuda_comm.cpp" ]]; then
  TORCH_INC="$("$PY" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join(include_paths()))')"
  PY_INC="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  TORCH_DIR="$("$PY" -c 'import torch, os; print(os.path.dirname(torch.__file__))')"
  CUDA_INC="$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")/include"
  [[ -f "$CUDA_INC/cuda_runtime_api.h" ]] || CUDA_INC="${CUDA_HOME:-/usr/local/cuda}/include"
  if [[ -f "$TORCH_DIR/include/c10/cuda/CUDAStream.h" ]]; then
    INC=()
    for d in $TORCH_INC; do INC+=(-isystem "$d"); done
    # A CPU torch wheel ships c10/cuda headers but not the generated
    # c10/cuda/impl/cuda_cmake_macros.h; for a syntax check a stub will do.
    if [[ ! -f "$TORCH_DIR/include/c10/cuda/impl/cuda_cmake_macros.h" ]]; then
      mkdir -p "$OUT/stub/c10/cuda/impl"
      printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$OUT/stub/c10/cuda/impl/cuda_cmake_macros.h"
      INC+=(-isystem "$OUT/stub")
      echo "  note CPU torch: stub c10/cuda/impl/cuda_cmake_macros.h for the syntax check"
    fi
    for f in "$ROOT"/csrc/torch/*.cpp; do
      g++ -std=c++17 -fsyntax-only -Wall -Wno-unused-function -DPYCOMM_WITH_CUDA=1 \
        -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H \
        "${INC[@]}" -isystem "$PY_INC" -isystem "$CUDA_INC" -I"$NCCL_HOME/include" "$f" \
        || { echo "compile_cuda: FAILED (syntax check of ${f#$ROOT/})" >&2; exit 1; }
      echo "  ok   syntax ${f#$ROOT/} (-DPYCOMM_WITH_CUDA, torch $("$PY" -c 'import torch; print(torch.__version__)'))"
    done
  else
    echo "  skip syntax check of the binding: this torch has no c10/cuda headers"
  fi
fi
echo "compile_cuda: OK"
