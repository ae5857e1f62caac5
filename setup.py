"""Builds pycomm._C, the C++ (and, with a CUDA torch, CUDA/NCCL) core.

    pip install --no-build-isolation .          # uses the torch already installed

Environment:
  CUDA_HOME             CUDA toolkit (found by torch.utils.cpp_extension when unset)
  TORCH_CUDA_ARCH_LIST  GPU architectures to build for, e.g. "8.0;9.0+PTX". A value
                        set by the user always wins. Unset: the compute capability
                        of every GPU torch sees at build time (e.g. "9.0" on an
                        H100), or "9.0+PTX" when it sees none: sm_90 code plus
                        compute_90 PTX, which the driver JIT-compiles on first use
                        on newer GPUs (Blackwell and later). A GPU older than the
                        list (e.g. an A100, 8.0, with "9.0+PTX") cannot run the
                        build: set TORCH_CUDA_ARCH_LIST="8.0" (or build on it).
                        The build prints the list it chose and why.
  MAX_JOBS              parallel compile jobs (ninja); defaults to the CPU count
  PYCOMM_FORCE_CPU=1    build the CPU-only extension even with a CUDA torch
  PYCOMM_DEBUG_INFO=1   keep debug information (-g; dropped by default: it
                        doubles the compile time)
  NCCL_HOME             NCCL install with include/ and lib/ (default: nvidia-nccl-cu13 wheel)

Build isolation must be off: the extension links against the installed torch,
and an isolated build would download a different (CUDA) torch.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:
    sys.exit(
        "pycomm: PyTorch must be installed before building pycomm "
        "(pip install torch==2.13.0), and the build must see it: "
        "pip install --no-build-isolation ."
    )

# pycomm/_build_info.py holds the source lists; load it without importing pycomm.
_spec = importlib.util.spec_from_file_location("_pycomm_build_info", ROOT / "pycomm" / "_build_info.py")
info = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(info)

if not info.torch_in_range(torch.__version__):
    (lo_major, lo_minor), (hi_major, hi_minor) = info.TORCH_RANGE
    sys.exit(
        f"pycomm: torch {torch.__version__} is outside the supported range "
        f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor} (README, 'Supported torch'); "
        f"install one inside it, e.g. pip install torch==2.13.0"
    )

os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))


def _rel(paths):
    return [os.path.relpath(p, ROOT) for p in paths]


def _extension():
    want_cuda = torch.version.cuda is not None and not os.environ.get("PYCOMM_FORCE_CPU")
    if want_cuda and CUDA_HOME is None:
        print("pycomm: torch has CUDA but CUDA_HOME was not found; building the CPU extension",
              file=sys.stderr)
        want_cuda = False
    nccl = info.nccl_home() if want_cuda else None
    if want_cuda and nccl is None:
        print("pycomm: NCCL not found (pip install nvidia-nccl-cu13 or set NCCL_HOME); "
              "building the CPU extension", file=sys.stderr)
        want_cuda = False
    if not want_cuda or not info.cuda_sources():
        print("pycomm: building the CPU extension (CppExtension)", file=sys.stderr)
        return CppExtension(
            "pycomm._C",
            _rel(info.core_sources() + info.torch_sources()),
            extra_compile_args={"cxx": info.CXX_FLAGS},
        )
    arch, why = _cuda_arch_list()
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch  # read by torch's BuildExtension
    _check_nvcc_version()
    print(f"pycomm: building the CUDA extension (CUDA_HOME={CUDA_HOME}, NCCL={nccl}, "
          f"TORCH_CUDA_ARCH_LIST={arch}: {why})", file=sys.stderr)
    lib = nccl / "lib"
    return CUDAExtension(
        "pycomm._C",
        _rel(info.core_sources() + info.torch_sources() + info.cuda_sources()),
        include_dirs=[str(nccl / "include")],
        library_dirs=[str(lib)],
        extra_link_args=[f"-l:{_nccl_lib(lib)}", f"-Wl,-rpath,{lib}"],
        define_macros=[("PYCOMM_WITH_CUDA", "1")],
        extra_compile_args={"cxx": info.CXX_FLAGS, "nvcc": info.NVCC_FLAGS},
    )


def _cuda_arch_list() -> tuple[str, str]:
    """The TORCH_CUDA_ARCH_LIST to build for and why (see the header)."""
    user = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if user:
        return user, "set by the user"
    if torch.cuda.is_available():
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return ";".join(f"{major}.{minor}" for major, minor in caps), f"detected {', '.join(names)}"
    return "9.0+PTX", "no GPU visible at build time: sm_90 plus PTX that newer GPUs JIT-compile"


def _check_nvcc_version() -> None:
    """Warns when nvcc's CUDA release differs from the one torch was built with
    (torch's BuildExtension fails only on a major mismatch)."""
    nvcc = Path(CUDA_HOME) / "bin" / "nvcc"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                             check=False).stdout
    except OSError as e:
        print(f"pycomm: warning: cannot run {nvcc}: {e}", file=sys.stderr)
        return
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        print(f"pycomm: warning: cannot parse `{nvcc} --version`", file=sys.stderr)
        return
    nvcc_v = (int(m.group(1)), int(m.group(2)))
    torch_v = tuple(int(x) for x in torch.version.cuda.split(".")[:2])
    if nvcc_v != torch_v:
        print(f"pycomm: warning: nvcc is CUDA {nvcc_v[0]}.{nvcc_v[1]} but torch was built "
              f"with CUDA {torch.version.cuda}; the extension may fail to load "
              f"(set CUDA_HOME to a matching toolkit)", file=sys.stderr)


def _nccl_lib(lib: Path) -> str:
    for name in ("libnccl.so", "libnccl.so.2"):
        if (lib / name).exists():
            return name
    raise SystemExit(f"pycomm: no libnccl.so in {lib}")


setup(
    name="pycomm",
    version="0.1.0",
    description="Ring all-reduce, broadcast and p2p over NCCL/gloo/shm as a PyTorch extension",
    packages=["pycomm", "pycomm.bench"],
    package_data={"pycomm": ["auto_table.json"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.10",
    install_requires=[info.torch_requirement()],
    entry_points={"console_scripts": ["pycomm-bench=pycomm.bench.__main__:main"]},
)
