"""torch's own distributed test suite over backend "pycomm".

``DistributedTest._DistTestBase`` (torch/testing/_internal/distributed/
distributed_test.py, shipped in the wheel) is what torch's CI runs on gloo and
NCCL (test/distributed/test_distributed_spawn.py). Here it runs as torch runs
it on gloo, with one change: the suite is told ``BACKEND=gloo`` (so it takes
gloo's code paths, skips and tolerances) while every rank, which imports this
module and with it pycomm, builds ``"pycomm"`` wherever the suite asks
``init_process_group`` or ``new_group`` for ``"gloo"``.

Environment (set before the suite is imported, inherited by the spawned
ranks): ``WORLD_SIZE`` (``PYCOMM_TORCH_SUITE_WORLD``, default 4), ``TEMP_DIR``
(a fresh directory, the suite's file barrier and init files),
``PYCOMM_TORCH_SUITE_BACKEND`` (default ``pycomm``; ``gloo`` runs the same
list on real gloo, the reference).

Which tests: every test of the suite; the ones that skip on gloo skip here
too. :data:`EXCLUDED` names the tests that pass on gloo but cannot pass on
another backend, each with its torch-side reason; they are reported as
skipped with that reason. The default run is :data:`DEFAULT` (one or two
tests of each kind: collectives, p2p, groups, DDP); the rest are marked
``slow`` (``pytest -m slow tests/test_torch_suite.py`` or ``PYCOMM_SLOW=1``
runs the full list). Spawning 4 ranks per test is the cost (~2 s a rank).
"""

from __future__ import annotations

import functools
import inspect
import os
import tempfile
import unittest

import pytest

os.environ["BACKEND"] = "gloo"
os.environ.setdefault("WORLD_SIZE", os.environ.get("PYCOMM_TORCH_SUITE_WORLD", "4"))
if "TEMP_DIR" not in os.environ:  # the parent makes it; the ranks inherit it
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="pycomm_torch_suite_")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import pycomm  # noqa: E402,F401  (registers backend "pycomm" in every rank)

#: The backend the ranks really build when the suite asks for gloo.
REAL_BACKEND = os.environ.get("PYCOMM_TORCH_SUITE_BACKEND", "pycomm")


def _swap(backend):
    return REAL_BACKEND if backend is not None and str(backend).lower() == "gloo" else backend


def _patch(fn):
    @functools.wraps(fn)
    def patched(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = _swap(kwargs["backend"])
        return fn(*args, **kwargs)
    return patched


if not getattr(dist.init_process_group, "_pycomm_swap", False):
    dist.init_process_group = _patch(dist.init_process_group)
    dist.new_group = _patch(dist.new_group)
    dist.init_process_group._pycomm_swap = True  # type: ignore[attr-defined]

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

_GLOO_ONLY = "torch implements monitored_barrier for gloo process groups only"
_GLOO_ERRORS = ("asserts gloo's own error text/timeout behaviour (ProcessGroupGloo message)")

#: Tests that pass on gloo and cannot on another backend, with torch's reason.
EXCLUDED: dict[str, str] = {
    "test_monitored_barrier_gloo": _GLOO_ONLY,
    "test_monitored_barrier_gloo_subgroup": _GLOO_ONLY,
    "test_monitored_barrier_gloo_rank_0_timeout": _GLOO_ONLY,
    "test_monitored_barrier_failure_order": _GLOO_ONLY,
    "test_monitored_barrier_wait_all_ranks": _GLOO_ONLY,
    "test_monitored_barrier_allreduce_hang": _GLOO_ONLY,
    "test_monitored_barrier_allreduce_hang_wait_all_ranks": _GLOO_ONLY,
}

#: The default (not slow) subset: one or two tests of each kind.
DEFAULT: frozenset[str] = frozenset({
    "test_all_reduce_sum",
    "test_broadcast",
    "test_all_gather",
    "test_reduce_sum",
    "test_gather",
    "test_scatter",
    "test_all_to_all_single_equal_split",
    "test_send_recv",
    "test_barrier_group",
    "test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_Running_Value",
})


#: Decorators that skip a test in its ranks when there is no (or too few)
#: CUDA device. Without CUDA such a test is skipped here, with that reason,
#: instead of spawning its ranks only to learn it (~100 tests, minutes).
_NEEDS_CUDA = ("skip_if_lt_x_gpu", "skip_if_no_gpu")


def _cuda_skip(fn) -> str | None:
    if torch.cuda.is_available():
        return None
    head = inspect.getsource(fn).split("def ", 1)[0]
    hits = [d for d in _NEEDS_CUDA if f"@{d}" in head]
    return f"needs CUDA (@{hits[0]}; it would skip in its ranks)" if hits else None


def _mark(name: str, fn):
    @functools.wraps(fn)
    def test(self):
        return fn(self)

    if name in EXCLUDED:
        return unittest.skip(f"excluded: {EXCLUDED[name]}")(test)
    cuda = _cuda_skip(fn)
    if cuda:
        return unittest.skip(cuda)(test)
    if name not in DEFAULT:
        return pytest.mark.slow(test)
    return test


class TestTorchSuiteOnPycomm(TestDistBackend, DistributedTest._DistTestBase):
    """Every ``test_*`` of the suite, each in ``WORLD_SIZE`` spawned ranks."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()


for _name in dir(DistributedTest._DistTestBase):
    if _name.startswith("test_"):
        setattr(TestTorchSuiteOnPycomm, _name,
                _mark(_name, getattr(DistributedTest._DistTestBase, _name)))
