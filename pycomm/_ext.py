"""Loads the compiled core, pycomm._C.

A wheel or `pip install .` ships a prebuilt `_C`. A source checkout without
one JIT-compiles it on first import with torch.utils.cpp_extension.load (CPU
build; about a minute) and says so on stderr.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any


def _jit_build() -> ModuleType:
    from torch.utils.cpp_extension import load

    from . import _build_info as info

    print(
        "pycomm: no prebuilt pycomm._C found; JIT-compiling the CPU extension "
        "(first import only, cached by torch.utils.cpp_extension)...",
        file=sys.stderr,
        flush=True,
    )
    return load(
        name="pycomm_C",
        sources=info.core_sources() + info.torch_sources(),
        extra_cflags=info.CXX_FLAGS,
        verbose=bool(os.environ.get("PYCOMM_VERBOSE_BUILD")),
    )


def load_extension() -> ModuleType:
    import torch  # noqa: F401  (loads libtorch before the extension)

    try:
        from . import _C  # type: ignore[attr-defined]

        return _C
    except ImportError as e:
        if "No module named" not in str(e) and "cannot import name" not in str(e):
            raise
        return _jit_build()


_C = load_extension()

#: Raised on every rank when a collective fails (timeout, dead peer, transport
#: error, mismatched calls in checked mode). A RuntimeError; the compiled
#: core's exception class, named here once (``pycomm.CommError``).
CommError = _C.CommError

#: Handle of an asynchronous operation: ``wait()``, ``is_completed()``,
#: ``is_success()``, ``get_future()`` (a ``torch.futures.Future`` completed with
#: the list of output tensors, what DDP communication hooks return; on GPU a
#: CUDA-aware one, completed at the enqueue and ordered on the caller's stream,
#: as ProcessGroupNCCL's). Named here once, like CommError (``pycomm.Work``).
if TYPE_CHECKING:  # the compiled class, opaque to type checkers
    Work = Any
else:
    Work = _C.Work
