"""GPU tests (pytest -m gpu): the CUDA kernels and the nccl communicator.

They run on ONE GPU: 2-4 ranks are processes sharing it. NCCL refuses two
ranks of one host on one GPU, so each rank gets its own NCCL_HOSTID (NCCL then
talks between them over its socket transport on loopback); with
PYCOMM_GPU_TEST_MODE=multi they use NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30)
instead. Such runs prove correctness, not speed. Everything skips cleanly
without CUDA or without a CUDA build of pycomm._C.

The rank bodies live in tests/gpu_cases.py and tests/gpu_cases_layers.py,
shared with scripts/gpu_check.sh, which runs them many to a world
(tests/gpu_plan.py); here each test spawns a world of its own.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import pytest
import torch

from tests import gpu_cases as cases
from tests import gpu_cases_layers as layers
from tests.gpu_cases import DTYPES, FLOATS, OPS, bitwise_equal, rand
from tests.gpu_world import Case, gpu_rank_env, run_world

pytestmark = pytest.mark.gpu

try:
    from pycomm._ext import _C

    _HAVE_EXT = True
except Exception:  # pragma: no cover - the CPU suite reports build problems
    _C = None  # type: ignore[assignment]
    _HAVE_EXT = False

HAVE_GPU = (_HAVE_EXT and bool(getattr(_C, "WITH_CUDA", False))
            and torch.cuda.is_available())
if not HAVE_GPU:
    pytest.skip("needs CUDA and the CUDA build of pycomm._C", allow_module_level=True)

TIMEOUT = float(os.environ.get("PYCOMM_GPU_TEST_TIMEOUT", "600"))


# ---------------------------------------------------------------- kernels (one process)

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_kernel_bitwise_equals_cpu(op, dtype):
    if op == "avg" and dtype not in FLOATS:
        pytest.skip("AVG is floating only")
    n = 1 << 16
    a, b = rand(dtype, n + 64, 1), rand(dtype, n + 64, 2)
    if dtype in FLOATS:  # specials: NaN, inf, -0, subnormals, overflow in fp16
        sp = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 6e4, -6e4, 1e-7],
                          dtype=torch.float64).to(dtype)
        a[: sp.numel()] = sp
        b[3 : 3 + sp.numel()] = sp
    # offsets 0..15 elements: aligned packs, scalar prologues/epilogues, and
    # different misalignments of dst and src (the element-by-element path)
    for off_a, off_b, count in [(0, 0, n), (1, 1, n - 3), (3, 5, n - 7), (0, 0, 1), (2, 2, 0), (7, 7, 13)]:
        x, y = a[off_a : off_a + count].clone(), b[off_b : off_b + count].clone()
        ref = x.clone()
        _C.reduce_(ref, y, OPS[op])
        buf_a = a.cuda()
        gx = buf_a[off_a : off_a + count]
        gx.copy_(x)
        gy = b.cuda()[off_b : off_b + count]
        _C.cuda_reduce_(gx, gy, OPS[op])
        torch.cuda.synchronize()
        assert bitwise_equal(gx, ref), (op, dtype, off_a, off_b, count)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("factor", [0.5, 1 / 3])
def test_scale_and_fused_reduce_scale_bitwise(dtype, factor):
    n = 100_003
    a, b = rand(dtype, n, 3), rand(dtype, n, 4)
    ref = a.clone()
    _C.scale_(ref, factor)
    g = a.cuda()
    _C.cuda_scale_(g, factor)
    torch.cuda.synchronize()
    assert bitwise_equal(g, ref)
    ref2 = a.clone()
    _C.reduce_(ref2, b, OPS["sum"])
    _C.scale_(ref2, factor)
    g2 = a.cuda()
    _C.cuda_reduce_scale_(g2, b.cuda(), OPS["sum"], factor)
    torch.cuda.synchronize()
    assert bitwise_equal(g2, ref2)


# Per format: the largest code value M, and values that are exact ties
# between two codes once a block's absmax is M (x * (M / absmax) = x):
# round to nearest even, in the normal and in the subnormal range.
_TIES = {
    "int8": (127.0, [0.5, 1.5, 2.5, -0.5, -3.5, 126.5]),
    "float8_e4m3fn": (448.0, [1.0625, 1.1875, -1.0625, 0.5 * 2**-9, 1.5 * 2**-9, -2.5 * 2**-9]),
    "float8_e5m2": (57344.0, [1.125, 1.375, -1.125, 0.5 * 2**-16, 1.5 * 2**-16, -2.5 * 2**-16]),
}


def _quant_input(n: int, block: int, fmt: str) -> torch.Tensor:
    """float32 values whose blocks span magnitudes from 1e-40 to 3e38, with
    the special blocks of quant.h: all zero, one NaN, one infinity, one
    with a subnormal scale (absmax ~1e-36), one with -0.0s, and (blocks of
    16 or more) one of exact ties."""
    x = rand(torch.float32, n, 5, lo=-1, hi=1)
    mags = torch.tensor([1.0, 1e-40, 1e-20, 1e-3, 7.5, 1e4, 3e38 / 2], dtype=torch.float32)
    x *= mags[(torch.arange(n) // block) % mags.numel()]
    for b in range(2, 8):
        lo, hi = b * block, min(n, (b + 1) * block)
        if lo >= n:
            break
        if b == 2:
            x[lo:hi] = 0.0
        elif b in (3, 4):
            x[lo + (hi - lo) // 2] = float("nan") if b == 3 else float("inf")
        elif b == 5:
            x[lo:hi] = rand(torch.float32, hi - lo, 7, lo=-1, hi=1) * 1e-36
        elif b == 6:
            x[lo:hi:3] = -0.0
        elif block >= 16:
            top, ties = _TIES[fmt]
            x[lo] = top
            x[lo + 1:lo + 1 + len(ties)] = torch.tensor(ties)
    return x


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_quantize_kernels_bitwise_equal_cpu(fmt):
    """cuda_quantize / cuda_dequantize_ write the CPU's scales, codes,
    errors and values, bit for bit (quant_codec.h is their arithmetic)."""
    # 1_048_579 blocks of 1: more than the quantize grid's 2^20, so its
    # blocks stride
    for n, block in [(1, 1), (255, 256), (257, 256), (1009, 7), (4000, 16), (200_003, 256),
                     (70_000, 5000), (1_048_579, 1)]:
        x = _quant_input(n, block, fmt)
        err = torch.empty(n)
        q = _C.quantize(x, block, err, format=fmt)
        gerr = torch.empty(n, device="cuda")
        gq = _C.cuda_quantize(x.cuda(), block, gerr, format=fmt)
        torch.cuda.synchronize()
        assert torch.equal(gq.cpu(), q), (fmt, n, block)
        assert bitwise_equal(gerr, err), (fmt, n, block)
        for add in (False, True):
            base = rand(torch.float32, n, 6)
            ref = base.clone()
            _C.dequantize(ref, q, block, add, format=fmt)
            g = base.cuda()
            _C.cuda_dequantize_(g, gq, block, add, format=fmt)
            torch.cuda.synchronize()
            assert bitwise_equal(g, ref), (fmt, n, block, add)


# ---------------------------------------------------------------- multi-rank

def run_ranks(world: int, fn: Callable[..., Any], init: Mapping[str, Any] | None = None,
              close_may_fail: bool = False, **kwargs: Any) -> None:
    """Runs fn(comm, store, **kwargs) on `world` ranks sharing cuda:0 (a
    world of its own, tests/gpu_world.py); ``init``: pycomm.init arguments.
    A rank's traceback fails the test, a hang fails it after TIMEOUT seconds
    with the ranks' stacks."""
    case = Case(fn.__name__, fn, kwargs, init or {}, deadline_s=TIMEOUT,
                close_may_fail=close_may_fail)
    (res,) = run_world(world, [case], transport="nccl", device="cuda:0", env_for_rank=gpu_rank_env,
                       gpus=torch.cuda.device_count())
    if res.status == "skipped":
        pytest.skip(res.detail)
    assert res.status == "passed", f"{res.status} on {world} ranks:\n{res.detail}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduce_every_op_dtype(world):
    # small slices so that chunks span several slices (the overlapped pipeline)
    run_ranks(world, cases.all_reduce_sweep, {"slice_bytes": 64 * 1024}, seed=world)


@pytest.mark.parametrize("world", [3, 4])
def test_classic_algorithms(world):
    # 3: the fold of a non-power-of-two world; 4: two log steps
    run_ranks(world, cases.classic_algorithms, {"slice_bytes": 64 * 1024})


def test_all_reduce_default_slices_and_auto():
    run_ranks(2, cases.default_slices_and_auto)


def test_ring_max_min_propagate_nan():
    run_ranks(3, cases.nan_propagation, {"slice_bytes": 256})


@pytest.mark.parametrize("world", [2, 3])
def test_broadcast_from_every_src(world):
    run_ranks(world, cases.broadcast_every_src, {"slice_bytes": 4096})


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_all_gather(world):
    run_ranks(world, cases.reduce_scatter_all_gather, {"slice_bytes": 8192})


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reduce_gather_scatter_all_to_all(world):
    run_ranks(world, cases.rooted_and_all_to_all)


@pytest.mark.parametrize("world", [2, 3])
def test_p2p_and_batch(world):
    run_ranks(world, cases.p2p_and_batch)


@pytest.mark.parametrize("world", [2, 3])
def test_user_p2p_is_independent_of_collectives(world):
    run_ranks(world, cases.user_p2p_beside_collective)


def test_async_work_future_and_stream_semantics():
    run_ranks(2, cases.async_and_streams)


def test_argument_errors():
    run_ranks(2, cases.argument_errors)


def test_checked_mode_on_gpu():
    run_ranks(2, cases.checked_mode, {"check": True})


@pytest.mark.parametrize("world", [3, 4])
def test_groups_over_nccl(world):
    run_ranks(world, cases.groups)


def test_timeout_aborts_and_raises():
    # 10 s, not less: the timeout also bounds the communicator's creation (NCCL
    # init, two splits, the p2p lanes' connect) on a GPU that may start cold.
    run_ranks(2, cases.timeout_aborts, {"timeout": 10}, close_may_fail=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_communicator_off_the_current_device():
    run_ranks(2, cases.off_the_current_device, {"device": "cuda:1"})


@pytest.mark.parametrize("world", [2, 3])
def test_wire_dtype_all_reduce_bitwise_equals_cpu(world):
    run_ranks(world, cases.wire_matches_cpu, {"slice_bytes": 64 * 1024})


# ---------------------------------------------------------------- layers

def test_pipeline_two_stages_share_the_gpu():
    run_ranks(2, layers.pipeline_two_stages)


@pytest.mark.parametrize("bucket_view,hook", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_matches_full_batch_over_nccl(world, bucket_view, hook):
    run_ranks(world, layers.parallel_ddp, variants=((bucket_view, hook),))


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_hooks_and_powerSGD_over_nccl(world):
    run_ranks(world, layers.ddp_hooks)


@pytest.mark.parametrize("world,backend", [(2, "pycomm"), (3, "pycomm"),
                                           (2, "cpu:pycomm,cuda:pycomm")])
def test_backend_every_op_on_cuda(world, backend):
    run_ranks(world, layers.backend_every_op, backend=backend)


def test_backend_stream_semantics():
    run_ranks(2, layers.backend_streams)


@pytest.mark.parametrize("world,backend", [(2, "pycomm"), (3, "pycomm"), (2, "cpu:gloo,cuda:pycomm"),
                                           (3, "cpu:gloo,cuda:pycomm")])
def test_backend_ddp_on_cuda_equals_one_process(world, backend):
    run_ranks(world, layers.backend_ddp, backend=backend)
