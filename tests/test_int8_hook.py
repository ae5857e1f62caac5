"""pycomm.hooks.int8_hook (and fp8_hook, the same hook on a float8 wire):
equal to its reference in Python (the quantized all-reduce, then the exact
average of the small and 1-D parameters), and torch DDP with it trains like
DDP without a hook, with and without error feedback, every rank holding the
same parameters."""

from __future__ import annotations

import pytest
import torch

from pycomm import hooks
from pycomm._ext import _C
from pycomm._grad_bucket import GradBucket
from tests._dist import run_ranks, spawn_ranks
from tests.reference import digest
from tests.test_hooks import _max_diff, _pg_count, _torch_pg, _train
from tests.test_quantized import _reference_all_reduce, ref_quantize, ref_values


def _grads(rank: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(s, generator=g) for s in shapes]


# wire format (tests/test_quantized.py's names) -> (hook, CompressionState kwargs)
HOOKS = {"int8": (hooks.int8_hook, {}),
         "float8_e4m3fn": (hooks.fp8_hook, {}),  # the default fp8_format
         "float8_e5m2": (hooks.fp8_hook, {"fp8_format": torch.float8_e5m2})}


def _direct_call(comm, fmt, dtype=torch.float32):
    hook, kwargs = HOOKS[fmt]
    shapes = [(64, 40), (40,), (8, 8), (300, 7)]  # quantized, 1-D, small, quantized
    params = [torch.zeros(s, dtype=dtype) for s in shapes]
    all_grads = [_grads(q, shapes) for q in range(comm.world_size)]
    buffers = [torch.cat([g.reshape(-1) for g in gs]).to(dtype) for gs in all_grads]
    buffer = buffers[comm.rank].clone()
    bucket = GradBucket(0, buffer, [buffer], params, True)
    state = hooks.CompressionState(comm, exact_below=100, **kwargs)
    out = hook(state, bucket).wait()
    assert out is buffer and buffer.dtype == dtype
    wide = [b.float() for b in buffers]  # a 16-bit bucket is summed in float32
    exact = torch.stack(wide).sum(0) if comm.world_size > 1 else wide[0].clone()
    _C.scale_(exact, 1.0 / comm.world_size)
    exact = exact.to(dtype)
    is_exact = torch.zeros(buffer.numel(), dtype=torch.bool)
    offset = 0
    for s in shapes:
        n = torch.Size(s).numel()
        is_exact[offset:offset + n] = len(s) == 1 or n < 100
        offset += n
    # the exact slices travel as zeros on the quantized wire
    wide = [w.masked_fill(is_exact, 0.0) for w in wide]
    want = _reference_all_reduce(wide, "avg", state.wire_block, fmt).to(dtype)
    assert torch.allclose(buffer[is_exact], exact[is_exact], rtol=1e-6, atol=1e-6)
    assert torch.equal(buffer[~is_exact], want[~is_exact])
    # the residual (float32) is what this rank's contribution lost, nothing
    # on the exact slices
    mine = wide[comm.rank]
    sent = ref_values(*ref_quantize(mine, state.wire_block, fmt), state.wire_block, fmt)
    assert state.residuals[0].dtype == torch.float32
    assert torch.equal(state.residuals[0], mine - sent)
    assert not state.residuals[0][is_exact].any()
    return digest(buffer)


@pytest.mark.parametrize("fmt", HOOKS)
def test_quantized_hook_equals_its_reference(fmt):
    per_rank = run_ranks(_direct_call, 2, "shm", fmt)
    assert per_rank[0] == per_rank[1]


def _rebuilt_bucket(comm):
    """Bucket 0 again with its two parameters in the other order (as DDP's
    rebuild after the first step may do, same size): the residual starts
    anew rather than adding step 1's errors to the other parameter's
    positions; the same parameters in the same order keep theirs."""
    a, b = torch.zeros(300, 4), torch.zeros(500, 2)
    state = hooks.CompressionState(comm, exact_below=0)
    errors = []
    for params in ([a, b], [a, b], [b, a]):
        buffer = torch.randn(2200, generator=torch.Generator().manual_seed(comm.rank))
        mine = buffer.clone() + (state.residuals[0] if errors and params[0] is a else 0)
        hooks.int8_hook(state, GradBucket(0, buffer, [buffer], params, True)).wait()
        sent = ref_values(*ref_quantize(mine, state.wire_block, "int8"), state.wire_block, "int8")
        errors.append(torch.equal(state.residuals[0], mine - sent))
    return errors


def test_a_rebuilt_bucket_restarts_its_residual():
    for errors in run_ranks(_rebuilt_bucket, 2, "shm"):
        assert errors == [True, True, True], errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_hook_takes_16_bit_buckets(dtype):
    """A bfloat16 / float16 bucket: summed in float32 on the wire and in
    the exact slices, rounded to its dtype, the residual float32."""
    per_rank = run_ranks(_direct_call, 2, "shm", "int8", dtype)
    assert per_rank[0] == per_rank[1]


def test_fp8_hook_is_public_and_documented():
    assert {"int8_hook", "fp8_hook", "CompressionState"} <= set(hooks.__all__)
    doc = hooks.fp8_hook.__doc__
    assert "Args:" in doc and "float32" in doc and doc.index("Raises:") < doc.index("Example::")


def test_fp8_format_is_checked():
    with pytest.raises(ValueError, match="fp8_format must be torch.float8_e4m3fn or"):
        hooks.CompressionState(None, fp8_format=torch.float16)


def _ddp_case(comm, fmt):
    hook, kwargs = HOOKS[fmt]
    pg = _torch_pg(comm, f"int8-{next(_pg_count)}")
    plain = _train(comm, pg)
    out = {}
    for name, ef in (("ef", True), ("no_ef", False)):
        # exact_below=0: every weight matrix goes over the 8-bit wire
        state = hooks.CompressionState(comm, error_feedback=ef, exact_below=0, **kwargs)
        params = _train(comm, pg, hook, state)
        out[name] = (_max_diff(params, plain), digest(params[0]))
    return out


# 5 SGD steps (LR 0.2) on gradients of |g| <~ 0.3 quantized to 8 bits, two
# roundings each: int8 about |g|max / 254, float8 about |g| / 32 (e4m3) and
# |g| / 16 (e5m2). Measured (with error feedback / without): int8 5e-4 /
# 7e-4, e4m3 1.1e-3 / 2.0e-3, e5m2 2.4e-3 / 3.0e-3.
DDP_TOL = {"int8": 4e-3, "float8_e4m3fn": 1e-2, "float8_e5m2": 1.5e-2}


@pytest.mark.parametrize("fmt", HOOKS)
def test_ddp_with_quantized_hook_trains_like_plain_ddp(fmt):
    per_rank = run_ranks(_ddp_case, 2, "shm", fmt, timeout=300)
    for res in per_rank:
        for name in ("ef", "no_ef"):
            assert res[name][0] < DDP_TOL[fmt], res
    for name in ("ef", "no_ef"):
        assert per_rank[0][name][1] == per_rank[1][name][1], name
    print({k: v[0] for k, v in per_rank[0].items()})


# ------------------------------------- DDP options, no_sync, join, pycomm.parallel

# Every case: int8 (error feedback on, every weight over the int8 wire) against
# the same training without a hook; 5 SGD steps as above, same bound.
INT8_TOL = 4e-3


def _options_case(comm, flags: dict):
    pg = _torch_pg(comm, f"int8-opt-{next(_pg_count)}")
    plain = _train(comm, pg, **dict(flags))
    state = hooks.CompressionState(comm, exact_below=0)
    params = _train(comm, pg, hooks.int8_hook, state, **dict(flags))
    return _max_diff(params, plain), digest(torch.cat([p.reshape(-1) for p in params])), sorted(state.residuals)


@pytest.mark.parametrize("flags", [
    {"gradient_as_bucket_view": True},
    {"static_graph": True},
    {"find_unused_parameters": True, "unused": True},
], ids=["bucket_view", "static_graph", "find_unused"])
def test_int8_hook_with_ddp_options(flags):
    """DDP rebuilds its buckets after the first step: the residuals follow
    (one per bucket index, restarted where a bucket changed size)."""
    per_rank = run_ranks(_options_case, 2, "shm", flags, timeout=300)
    for diff, _, residuals in per_rank:
        assert diff < INT8_TOL, (flags, diff)
        assert len(residuals) > 1, residuals  # several buckets, each its own residual
    assert per_rank[0][1] == per_rank[1][1]  # every rank the same bits


def _no_sync_case(comm):
    """Gradient accumulation: two micro-batches per step, the first under
    no_sync() (no all-reduce), the second synchronised; int8 vs no hook."""
    import contextlib

    import torch.nn as nn

    from tests.test_hooks import BATCH, BUCKET_MB, LR, _data, _fresh_model

    pg = _torch_pg(comm, f"int8-nosync-{next(_pg_count)}")
    n, r = comm.world_size, comm.rank
    shard = slice(r * BATCH // n, (r + 1) * BATCH // n)

    def train(hooked: bool) -> tuple[list[torch.Tensor], int]:  # params, backwards
        model = _fresh_model()
        ddp = nn.parallel.DistributedDataParallel(model, process_group=pg,
                                                  bucket_cap_mb=BUCKET_MB)
        calls = [0]
        if hooked:
            state = hooks.CompressionState(comm, exact_below=0)

            def counting(st, bucket):
                calls[0] += bucket.is_last()  # one per all-reducing backward
                return hooks.int8_hook(st, bucket)

            ddp.register_comm_hook(state, counting)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        for step in range(4):
            opt.zero_grad()
            for micro in range(2):
                x, y = _data(10 * step + micro)
                with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                    nn.functional.mse_loss(ddp(x[shard]), y[shard]).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()], calls[0]

    plain, _ = train(False)
    params, calls = train(True)
    return _max_diff(params, plain), calls, digest(torch.cat([p.reshape(-1) for p in params]))


def test_int8_hook_under_no_sync():
    per_rank = run_ranks(_no_sync_case, 2, "shm", timeout=300)
    for diff, calls, _ in per_rank:
        assert diff < INT8_TOL, diff
        assert calls == 4, calls  # only the 4 synchronised backwards
    assert per_rank[0][2] == per_rank[1][2]


def _join_rank(rank: int, world_size: int, port: int):
    """Uneven inputs under torch DDP's join(): the rank that runs out first
    shadows the others' all-reduces through the hook with zero buckets (plus
    its residual, which error feedback still owes)."""
    from tests.test_hooks import run_joined

    def register(comm, ddp):
        ddp.register_comm_hook(hooks.CompressionState(comm, exact_below=0), hooks.int8_hook)

    return run_joined(rank, world_size, port, register,
                      lambda comm, plain, hooked: (_max_diff(hooked, plain), digest(
                          torch.cat([p.reshape(-1) for p in hooked]))))


def test_int8_hook_under_join():
    from tests._dist import spawn_ranks

    per_rank = spawn_ranks(_join_rank, 2, timeout=300)
    for diff, _ in per_rank:
        assert diff < INT8_TOL, diff
    assert per_rank[0][1] == per_rank[1][1]


def _parallel_case(comm):
    """pycomm.parallel.DistributedDataParallel takes the hook unchanged."""
    import torch.nn as nn

    from pycomm.parallel import DistributedDataParallel
    from tests.test_hooks import BATCH, LR, STEPS, _data, _fresh_model

    shard = slice(comm.rank * BATCH // comm.world_size, (comm.rank + 1) * BATCH // comm.world_size)

    def train(hooked: bool) -> list[torch.Tensor]:
        model = _fresh_model()
        ddp = DistributedDataParallel(model, comm, bucket_cap_mb=0.001)
        if hooked:
            ddp.register_comm_hook(hooks.CompressionState(comm, exact_below=0), hooks.int8_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        for step in range(STEPS):
            x, y = _data(step)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x[shard]), y[shard]).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    plain = train(False)
    params = train(True)
    return _max_diff(params, plain), digest(torch.cat([p.reshape(-1) for p in params]))


@pytest.mark.parametrize("transport", ["shm", pytest.param("gloo", marks=pytest.mark.slow)])
def test_int8_hook_with_pycomm_parallel(transport):
    per_rank = run_ranks(_parallel_case, 2, transport, timeout=300)
    for diff, _ in per_rank:
        assert 0 < diff < INT8_TOL, diff  # rounded (not exact), and close
    assert per_rank[0][1] == per_rank[1][1]


# ---------------------------------------------------------------- the example

@pytest.mark.parametrize("flags", [
    (), ("--wire", "fp8_e4m3"), pytest.param(("--no-error-feedback",), marks=pytest.mark.slow),
    pytest.param(("--wire", "fp8_e5m2"), marks=pytest.mark.slow)])
def test_example_compressed_ddp_under_torchrun(flags):
    """examples/compressed_ddp.py: both ranks report, hold the same bits, and
    end near plain DDP (an 8-bit wire rounds: close, not equal)."""
    import re

    from tests._dist import run_torchrun

    proc = run_torchrun("examples/compressed_ddp.py", 2, *flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ef = str("--no-error-feedback" not in flags)
    wire = flags[1] if flags[:1] == ("--wire",) else "int8"
    found = re.findall(rf"rank (\d)/2 {wire} \(error feedback {ef}\) \[shm\] last loss ([\d.]+) "
                       r"\(plain DDP ([\d.]+)\), max \|param - plain DDP's\| = ([\d.e+-]+), "
                       r"ranks identical: True", proc.stdout)
    assert sorted(f[0] for f in found) == ["0", "1"], proc.stdout
    for _, loss, plain_loss, diff in found:
        assert float(diff) < 0.05, proc.stdout
        assert abs(float(loss) - float(plain_loss)) < 0.1 * float(plain_loss) + 1e-3, proc.stdout


# ---------------------------------------------------------------- the c10d backend

def _backend_rank(rank: int, world_size: int, port: int):
    """In a fresh process: torch DDP over the default group of the c10d
    backend "pycomm" (shm), int8_hook's state on that group's communicator,
    against the same training without a hook (the backend's all-reduce)."""
    import torch.distributed as dist

    import pycomm
    from tests.test_backend import _init

    _init(rank, world_size, port, pg_options=pycomm.backend.Options(transport="shm"))
    try:
        comm = pycomm.backend.get_communicator()
        plain = _train(comm, dist.group.WORLD)
        state = hooks.CompressionState(comm, exact_below=0)
        params = _train(comm, dist.group.WORLD, hooks.int8_hook, state)
        return (_max_diff(params, plain), digest(torch.cat([p.reshape(-1) for p in params])),
                sorted(state.residuals))
    finally:
        dist.destroy_process_group()


def test_int8_hook_on_the_pycomm_backend():
    """The hook's all-reduces and DDP's own (parameter broadcast, the
    backend's) share one communicator, in one order on every rank: trained
    like DDP without a hook within INT8_TOL, rounded (the hook ran), every
    rank the same bits."""
    per_rank = spawn_ranks(_backend_rank, 2, timeout=300)
    for diff, _, residuals in per_rank:
        assert 0 < diff < INT8_TOL, diff
        assert len(residuals) > 1, residuals  # one residual per bucket
    assert per_rank[0][1] == per_rank[1][1]
