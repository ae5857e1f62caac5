#!/usr/bin/env bash
# Builds and links the complete CUDA extension, as the GPU machine builds it,
# on a machine without a GPU:
#
#   scripts/cuda_build_check.sh [OUTDIR]          (default build/cuda_full)
#
# - against the CUDA build of torch that the GPU machine has (TORCH_CUDA_SPEC,
#   default torch==2.11.0, CUDA 13.0): its wheel is downloaded once with
#   --no-deps, and its headers and libtorch*/libc10* unpacked into a cache
#   outside the repo (PYCOMM_CACHE, default ~/.cache/pycomm); nothing of it is
#   imported, so the interpreter running this script may hold any torch;
# - every csrc/core and csrc/torch source with g++ and the flags of
#   torch.utils.cpp_extension's CUDAExtension (-DPYCOMM_WITH_CUDA, the CUDA
#   torch headers), every csrc/cuda source with nvcc for sm_ARCH plus
#   compute_ARCH PTX (setup.py's default without a GPU: the PTX generation is
#   checked too);
# - one shared object linked against that wheel's libc10*/libtorch*, CUDA's
#   runtime and NCCL (the nvidia-nccl-cu13 wheel or NCCL_HOME), with every
#   unresolved symbol reported by the linker: only the Python C API (Py*,
#   _Py*) may stay undefined, as in any extension module, which gets it from
#   the interpreter that loads it. Any other undefined symbol (a function
#   declared but not defined, one that this torch does not export or renamed)
#   fails the check;
# - the kernels' PTX (kept by nvcc --keep) free of fma/mad and of float
#   add/sub/mul without an explicit rounding (which ptxas may fuse): the
#   GPU's arithmetic must round each multiply and add apart, as the CPU's
#   does, which -fmad=false ensures; a build without it fails here, not only
#   in the GPU's bitwise tests.
#
# Environment: TORCH_CUDA_SPEC, PYCOMM_CACHE, NVCC (default nvcc on PATH),
# NCCL_HOME, CUDA_ARCH (default 90), JOBS (default: CPU count), PYTHON.
# Exit status: 0 linked with no foreign undefined symbol; 1 a compile or link
# failure, or an FMA in the kernels' PTX; 2 a missing tool (nvcc, NCCL, the wheel).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/build/cuda_full}"
SPEC="${TORCH_CUDA_SPEC:-torch==2.11.0}"
CACHE="${PYCOMM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pycomm}"
NVCC="${NVCC:-nvcc}"
ARCH="${CUDA_ARCH:-90}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
PY="${PYTHON:-python3}"
say() { echo "cuda_build_check: $*"; }
die() { echo "cuda_build_check: $2" >&2; exit "$1"; }

command -v "$NVCC" >/dev/null || die 2 "nvcc not found (install the CUDA toolkit or set NVCC)"
# CUDA_HOME as torch.utils.cpp_extension finds it: the variable, nvcc's
# installation (nvcc may be a link or a wrapper on PATH), /usr/local/cuda.
if [[ -z "${CUDA_HOME:-}" ]]; then
  for home in "$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")" /usr/local/cuda; do
    [[ -f "$home/include/cuda_runtime_api.h" ]] && { CUDA_HOME="$home"; break; }
  done
fi
[[ -f "${CUDA_HOME:-}/include/cuda_runtime_api.h" ]] ||
  die 2 "cuda_runtime_api.h not found (set CUDA_HOME to the CUDA toolkit)"
CUDA_LIB="$CUDA_HOME/lib64"
[[ -d "$CUDA_LIB" ]] || CUDA_LIB="$CUDA_HOME/lib"

# ---- NCCL: headers and the library the GPU machine's torch also uses
if [[ -z "${NCCL_HOME:-}" ]]; then
  NCCL_HOME="$("$PY" - "$ROOT" <<'EOF'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("bi", sys.argv[1] + "/pycomm/_build_info.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
print(mod.nccl_home() or "")
EOF
)"
fi
[[ -n "$NCCL_HOME" && -f "$NCCL_HOME/include/nccl.h" ]] ||
  die 2 "nccl.h not found (pip install nvidia-nccl-cu13 or set NCCL_HOME)"
NCCL_LIB="$(cd "$NCCL_HOME/lib" && ls libnccl.so libnccl.so.2 2>/dev/null | head -1 || true)"
[[ -n "$NCCL_LIB" ]] || die 2 "no libnccl.so in $NCCL_HOME/lib"

# ---- the CUDA torch: downloaded once, unpacked once (a marker file says the
# unpacking finished, so an interrupted one is redone)
version="${SPEC#torch==}"
TORCH_DIR="$CACHE/torch-$version"
if [[ ! -f "$TORCH_DIR/.unpacked" ]]; then
  mkdir -p "$CACHE/wheels"
  wheel="$(ls "$CACHE"/wheels/torch-"$version"-*.whl 2>/dev/null | head -1 || true)"
  if [[ -z "$wheel" ]]; then
    say "downloading $SPEC (--no-deps, once, into $CACHE/wheels)"
    "$PY" -m pip download -q --no-deps --only-binary=:all: "$SPEC" -d "$CACHE/wheels" ||
      die 2 "cannot download $SPEC"
    wheel="$(ls "$CACHE"/wheels/torch-"$version"-*.whl | head -1)"
  fi
  say "unpacking headers and libraries of $(basename "$wheel")"
  rm -rf "$TORCH_DIR"
  mkdir -p "$TORCH_DIR"
  "$PY" - "$wheel" "$TORCH_DIR" <<'EOF'
import re, sys, zipfile
keep = re.compile(r"torch/(include/.*|lib/lib(c10|torch)[a-z_]*\.so|version\.py)$")
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if keep.match(n)])
EOF
  touch "$TORCH_DIR/.unpacked"
fi
T="$TORCH_DIR/torch"
TORCH_VERSION="$(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$T/version.py")"
TORCH_CUDA="$(sed -n "s/^cuda: Optional\[str\] = '\(.*\)'/\1/p" "$T/version.py")"
[[ -n "$TORCH_CUDA" ]] || die 2 "$SPEC is not a CUDA build of torch ($T/version.py)"
[[ -f "$T/include/c10/cuda/impl/cuda_cmake_macros.h" ]] || die 2 "$T/include lacks the c10/cuda headers"

mkdir -p "$OUT/obj"
rm -rf "$OUT"/obj/*.o "$OUT"/obj/*.keep "$OUT"/_C.so "$OUT"/*.log
say "torch $TORCH_VERSION (CUDA $TORCH_CUDA, $T), $("$NVCC" --version | tail -1)"
say "NCCL $NCCL_HOME ($(grep -m1 '#define NCCL_VERSION_CODE' "$NCCL_HOME/include/nccl.h" | awk '{print $3}')), sm_$ARCH + compute_$ARCH PTX, $JOBS jobs"

# ---- flags: pycomm/_build_info.py's plus what CUDAExtension adds
read_list() {  # read_list NAME: a list from pycomm/_build_info.py, one item a line
  "$PY" - "$ROOT" "$1" <<'EOF'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("bi", sys.argv[1] + "/pycomm/_build_info.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
value = getattr(mod, sys.argv[2])
print("\n".join(value() if callable(value) else value))
EOF
}
mapfile -t CXX_FLAGS < <(read_list CXX_FLAGS)
mapfile -t NVCC_FLAGS < <(read_list NVCC_FLAGS)
mapfile -t CXX_SOURCES < <(read_list core_sources; read_list torch_sources)
mapfile -t CU_SOURCES < <(read_list cuda_sources)
# (a failure inside <(...) escapes set -e: check what came out)
(( ${#CXX_FLAGS[@]} && ${#NVCC_FLAGS[@]} && ${#CXX_SOURCES[@]} && ${#CU_SOURCES[@]} )) ||
  die 1 "cannot read the flags and sources from pycomm/_build_info.py"
PY_INC="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
DEFINES=(-DPYCOMM_WITH_CUDA=1 -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H
         -D_GLIBCXX_USE_CXX11_ABI=1)
INCLUDES=(-isystem "$T/include" -isystem "$T/include/torch/csrc/api/include"
          -isystem "$CUDA_HOME/include" -isystem "$PY_INC" -I"$NCCL_HOME/include")
# The standard torch's BuildExtension adds: C++17 up to 2.11, C++20 from 2.13.
IFS=. read -r major minor _ <<< "$TORCH_VERSION"
STD=c++17
(( major > 2 || (major == 2 && minor >= 13) )) && STD=c++20
CXX_CMD=(g++ "${CXX_FLAGS[@]}" -std="$STD" -fPIC "${DEFINES[@]}" "${INCLUDES[@]}")
# torch.utils.cpp_extension's COMMON_NVCC_FLAGS: no implicit half conversions.
NVCC_CMD=("$NVCC" "${NVCC_FLAGS[@]}" -gencode "arch=compute_$ARCH,code=[sm_$ARCH,compute_$ARCH]"
          -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
          -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
          -Xcompiler -fPIC -Xcompiler -Wall -Xcompiler -Wno-unused-function
          -Werror all-warnings "${DEFINES[@]}" "${INCLUDES[@]}")

# ---- compile, JOBS at a time; .cu through nvcc, the rest through g++ (as
# CUDAExtension does: csrc/cuda/*.cc are host code)
fail=0
pids=()
compile() {
  local src="$1" obj="$OUT/obj/$(basename "$(dirname "$1")")_$(basename "$1").o"
  local cmd=("${CXX_CMD[@]}")
  # a .cu keeps its PTX (and nvcc's other intermediates) for the FMA check below
  [[ "$src" == *.cu ]] && { mkdir -p "$obj.keep"; cmd=("${NVCC_CMD[@]}" --keep --keep-dir "$obj.keep"); }
  if "${cmd[@]}" -c "$src" -o "$obj" > "$obj.log" 2>&1; then
    echo "  ok   ${src#$ROOT/}"
  else
    cat "$obj.log" >&2
    echo "  FAIL ${src#$ROOT/}" >&2
    return 1
  fi
}
for src in "${CU_SOURCES[@]}" "${CXX_SOURCES[@]}"; do
  compile "$src" &
  pids+=($!)
  if (( ${#pids[@]} >= JOBS )); then
    wait "${pids[0]}" || fail=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || fail=1; done
(( fail == 0 )) || die 1 "FAILED (compile)"

# ---- the kernels' arithmetic is the CPU's, bit for bit (elementwise.h,
# quant_codec.h): a multiply-add contracted into an FMA rounds once where the
# CPU rounds twice. -fmad=false (NVCC_FLAGS) forbids it: nvcc then writes no
# fma/mad and gives every float add, sub and mul an explicit rounding (.rn),
# which ptxas (or the driver compiling the PTX) may not fuse either; without
# it they come bare, free to be fused. So the PTX the build made must have
# neither (the check the GPU's bitwise tests would make only on a GPU). No
# kernel calls fmaf itself.
ptx=("$OUT"/obj/*.keep/*.ptx)
[[ -f "${ptx[0]}" ]] || die 1 "FAILED (fma): nvcc kept no PTX under $OUT/obj (has --keep changed?)"
float_op='(b?f16(x2)?|f32|f64)\b'
fusable="\\b((fma|mad)\\.[a-z0-9.]*$float_op|(add|sub|mul)(\\.ftz)?(\\.sat)?\\.$float_op)"
found=$(cat "${ptx[@]}" | grep -cE "$fusable" || true)
(( found == 0 )) || die 1 "FAILED (fma): $found fma/mad or unrounded float add/sub/mul instruction(s) in the kernels' PTX ($(grep -lE "$fusable" "${ptx[@]}" | xargs -n1 basename | paste -sd' ' -)): build them with -fmad=false (pycomm/_build_info.py's NVCC_FLAGS), or they differ from the CPU"
say "no FMA, and no float op left free to fuse, in ${#ptx[@]} kernels' PTX"

# ---- link: -z defs makes the linker report every symbol that no object or
# library given here defines; --warn-unresolved-symbols turns those reports
# into warnings so that the Python C API's can be told from the rest.
LINK_LOG="$OUT/link.log"
if ! g++ -shared -o "$OUT/_C.so" "$OUT"/obj/*.o \
    -L"$T/lib" -lc10 -lc10_cuda -ltorch -ltorch_cpu -ltorch_cuda -ltorch_python \
    -L"$CUDA_LIB" -lcudart -L"$NCCL_HOME/lib" -l:"$NCCL_LIB" \
    -Wl,-z,defs -Wl,--warn-unresolved-symbols > "$LINK_LOG" 2>&1; then
  cat "$LINK_LOG" >&2
  die 1 "FAILED (link)"
fi
mapfile -t undefined < <(sed -n "s/.*undefined reference to \`\(.*\)'$/\1/p" "$LINK_LOG" | sort -u)
# An extension module always uses the Python C API: none reported means the
# linker's wording changed and this check would pass blind.
(( ${#undefined[@]} )) || die 1 "no undefined reference recognised in $LINK_LOG (has ld's wording changed?)"
foreign=()
for sym in "${undefined[@]}"; do
  [[ "$sym" =~ ^_?Py ]] || foreign+=("$sym")
done
if (( ${#foreign[@]} )); then
  grep "undefined reference" "$LINK_LOG" | grep -v "to \`_\?Py" | head -40 >&2
  die 1 "FAILED (link): ${#foreign[@]} symbol(s) other than the Python C API's are defined nowhere: ${foreign[*]:0:5}"
fi
say "linked $OUT/_C.so: $(( ${#CXX_SOURCES[@]} + ${#CU_SOURCES[@]} )) sources, every symbol resolved but ${#undefined[@]} of the Python C API"
say "OK"
