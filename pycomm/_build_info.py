"""Sources and flags of the pycomm._C extension, shared by setup.py and the JIT
fallback in pycomm/_ext.py. Importable without torch."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"

# The torch releases pycomm builds and is tested against (README, "Supported
# torch"): scripts/torch_range_check.sh checks both ends, and
# scripts/cuda_build_check.sh builds the CUDA extension against the lower one,
# the GPU machine's. setup.py refuses a torch outside the range.
TORCH_RANGE = ((2, 11), (2, 14))

# No -std here: torch's BuildExtension adds the standard its headers need
# (C++17 up to torch 2.11, C++20 from 2.13 on; 2.14's headers refuse C++17).
# csrc/core and csrc/cuda are C++17 and build under either.
# -ffp-contract=off: no FMA contraction either (GCC contracts in C++ mode
# wherever the target has FMA: aarch64, -march=native), so that the CPU's
# results stay bitwise the GPU's and the portable loops' (see NVCC_FLAGS).
# -g0: Python's own CFLAGS, which setuptools puts first, carry -g; debug
# information for torch's headers doubles every binding source's compile time
# and makes the library 20 times larger. PYCOMM_DEBUG_INFO=1 keeps it.
CXX_FLAGS = ["-O3", "-fvisibility=hidden", "-Wall", "-Wno-unused-function", "-ffp-contract=off",
             *([] if os.environ.get("PYCOMM_DEBUG_INFO") == "1" else ["-g0"])]
# -fmad=false: no FMA contraction in our kernels, so GPU reductions are bitwise
# the CPU ones (csrc/core/elementwise.h is shared).
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-fmad=false", "-lineinfo"]


def core_sources() -> list[str]:
    """C++17 sources with no torch and no CUDA dependency."""
    return sorted(str(p) for p in (CSRC / "core").glob("*.cc"))


def torch_sources() -> list[str]:
    """The binding layer (includes torch headers)."""
    return sorted(str(p) for p in (CSRC / "torch").glob("*.cpp"))


def cuda_sources() -> list[str]:
    """CUDA/NCCL sources (no torch headers)."""
    return sorted(str(p) for p in (CSRC / "cuda").glob("*.cu")) + sorted(
        str(p) for p in (CSRC / "cuda").glob("*.cc")
    )


def nccl_home() -> Path | None:
    """NCCL from $NCCL_HOME, else the nvidia-nccl-cu13 wheel, else None."""
    env = os.environ.get("NCCL_HOME")
    if env:
        return Path(env)
    try:
        import nvidia.nccl  # untyped, and absent on most machines (mypy.ini)

        for base in getattr(nvidia.nccl, "__path__", []):
            if (Path(base) / "include" / "nccl.h").exists():
                return Path(base)
    except ImportError:
        pass
    return None


def torch_in_range(version: str) -> bool:
    """Whether torch ``version`` (e.g. "2.13.0+cpu") is inside TORCH_RANGE."""
    major_minor = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    low, high = TORCH_RANGE
    return low <= major_minor <= high


def torch_requirement() -> str:
    """TORCH_RANGE as a pip requirement: "torch>=2.11,<2.15"."""
    (lo_major, lo_minor), (hi_major, hi_minor) = TORCH_RANGE
    return f"torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}"
