"""Sources and flags of the pycomm._C extension, shared by setup.py and the JIT
fallback in pycomm/_ext.py. Importable without torch."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"

CXX_FLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
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
