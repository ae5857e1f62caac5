"""Rank bodies of the GPU tests: the layers over the communicator (pipeline,
pycomm.parallel, DDP hooks, the torch.distributed backend).

As in tests/gpu_cases.py: ``fn(comm, store, **kwargs)`` on every rank,
importable without a GPU, device-generic unless the docstring says CUDA.
Each equals one process: the same model trained on the whole batch.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from tests.gpu_cases import prefixed, synchronize
from tests.test_hooks import _max_diff  # the CPU tests' parameter distance

# ---------------------------------------------------------------- pipeline


def pipeline_two_stages(comm: Any, store: Any) -> None:
    """Two pipeline stages (1F1B and GPipe, 4 microbatches, uneven last
    microbatch) against the whole model in one process on the same device."""
    import pycomm.pipeline as pp

    dev = comm.device

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 32, generator=g).to(dev), torch.randn(10, 32, generator=g).to(dev)
    ref = model().to(dev)
    losses = [nn.functional.mse_loss(ref(a), b) for a, b in zip(x.chunk(4), y.chunk(4))]
    torch.stack(losses).mean().backward()
    want = [p.grad for p in pp.split_sequential(ref, 2, balance=[2, 2])[comm.rank].parameters()]
    for cls in (pp.Schedule1F1B, pp.ScheduleGPipe):
        part = pp.split_sequential(model(), 2, balance=[2, 2])[comm.rank]
        stage = pp.PipelineStage(part, comm.rank, 2, comm, device=dev)
        sched = cls(stage, 4, nn.functional.mse_loss)
        sched.step(x) if stage.is_first else sched.step(target=y)
        for got, exp in zip(stage.submod.parameters(), want):
            torch.testing.assert_close(got.grad, exp, rtol=1e-4, atol=1e-5,
                                       msg=prefixed(cls.__name__))


# ---------------------------------------------------------------- pycomm.parallel

def _mlp(seed: int, dev: torch.device) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, 3)).to(dev)


def _ddp_one_variant(comm: Any, bucket_view: bool, hook: bool) -> None:
    from pycomm.parallel import DistributedDataParallel

    n, r, dev = comm.world_size, comm.rank, comm.device

    def sum_then_scale(state: Any, bucket: Any) -> torch.futures.Future:
        fut = state.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(n))

    ddp = DistributedDataParallel(_mlp(100 + r, dev), comm, bucket_cap_mb=0.001,
                                  first_bucket_mb=0.0005, gradient_as_bucket_view=bucket_view)
    if hook:
        ddp.register_comm_hook(comm, sum_then_scale)
    reference = _mlp(100, dev)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, reference)]
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        x, y = torch.randn(4 * n, 6, generator=g).to(dev), torch.randn(4 * n, 3, generator=g).to(dev)
        for opt in opts:
            opt.zero_grad()
        nn.functional.mse_loss(ddp(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
        nn.functional.mse_loss(reference(x), y).backward()
        for opt in opts:
            opt.step()
    synchronize(comm)
    for p, q in zip(ddp.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    stats = ddp.stats()
    assert len(stats.buckets) > 1 and stats.rebuilt_after == 1 and len(stats.iterations) == 4


def parallel_ddp(comm: Any, store: Any,
                 variants: tuple[tuple[bool, bool], ...] = ((False, False), (True, False),
                                                            (False, True))) -> None:
    """pycomm's DistributedDataParallel (several buckets; bucket views or not;
    a comm hook or not): after SGD steps the parameters equal one process
    trained on the full batch. ``variants``: (gradient_as_bucket_view, hook)."""
    for bucket_view, hook in variants:
        try:
            _ddp_one_variant(comm, bucket_view, hook)
        except BaseException as e:
            raise AssertionError(f"variant bucket_view={bucket_view} hook={hook}") from e


# ---------------------------------------------------------------- torch DDP + pycomm hooks

def _train_torch_ddp(comm: Any, hook: Any = None, state: Any = None, bucket_mb: float = 0.001,
                     steps: int = 4) -> list[torch.Tensor]:
    """torch DDP over the default group on this rank's data; the parameters."""
    dev = comm.device
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dev)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    if hook is not None:
        ddp.register_comm_hook(state if state is not None else comm, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(steps):
        x, y = torch.randn(6, 16, generator=g).to(dev), torch.randn(6, 4, generator=g).to(dev)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def ddp_hooks(comm: Any, store: Any) -> None:
    """torch DDP over torch's own backend (nccl on GPU, gloo on CPU), each
    pycomm hook on this communicator (the 8-bit ones too) against DDP
    without a hook; pycomm's
    PowerSGD against torch's ``powerSGD_hook`` on the same seeds (one bucket:
    torch's chains may interleave differently across ranks with several);
    on GPU, a CPU model's bucket: a clear error."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    from pycomm import hooks

    cuda = comm.device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore("ddp-pg", store),
                            rank=comm.rank, world_size=comm.world_size,
                            **({"device_id": comm.device} if cuda else {}))
    try:
        plain = _train_torch_ddp(comm)
        # float32 rounding; 16-bit: a few roundoffs of |g| <~ 0.3 (tests/test_hooks.py TOL)
        for hook, tol in ((hooks.allreduce_hook, 1e-5), (hooks.fp16_compress_hook, 4e-4),
                          (hooks.ring_fp16_hook, 4e-4), (hooks.ring_bf16_hook, 4e-3)):
            diff = _max_diff(_train_torch_ddp(comm, hook), plain)
            assert diff < tol, (hook.__name__, diff)
        # 8-bit wires with error feedback, every matrix quantized (exact_below=0):
        # 6e-4 (int8) and 3e-3 (fp8) from plain DDP on gloo, 3 ranks
        for hook in (hooks.int8_hook, hooks.fp8_hook):
            state8 = hooks.CompressionState(comm, wire_block=64, exact_below=0)
            diff = _max_diff(_train_torch_ddp(comm, hook, state8), plain)
            assert 1e-6 < diff < 2e-2, (hook.__name__, diff)
        theirs = _train_torch_ddp(comm, torch_psgd.powerSGD_hook,
                                  torch_psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                           start_powerSGD_iter=2),
                                  bucket_mb=25, steps=6)
        state = hooks.PowerSGDState(comm, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ours = _train_torch_ddp(comm, hooks.powerSGD_hook, state, bucket_mb=25, steps=6)
        assert _max_diff(ours, theirs) < 1e-5, f"PowerSGD differs from torch's by {_max_diff(ours, theirs)}"
        assert _max_diff(ours, _train_torch_ddp(comm, bucket_mb=25, steps=6)) > 1e-4, "did not compress"
        if cuda:
            cpu_model = nn.parallel.DistributedDataParallel(
                nn.Linear(4, 4), process_group=dist.new_group(backend="gloo"))
            cpu_model.register_comm_hook(comm, hooks.allreduce_hook)
            with pytest.raises(Exception, match="bucket 0 is on cpu but the communicator runs on cuda"):
                cpu_model(torch.randn(2, 4)).sum().backward()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- torch.distributed backend

@contextlib.contextmanager
def pycomm_process_group(comm: Any, store: Any, backend: str = "pycomm") -> Iterator[None]:
    """torch.distributed's default group over ``backend`` (naming pycomm's,
    e.g. "cpu:gloo,cuda:pycomm") on the world's ranks; the case's own
    communicator stays as it is."""
    import torch.distributed as dist

    import pycomm  # noqa: F401  (registers the backend)

    dist.init_process_group(backend, store=dist.PrefixStore(f"pg/{backend}", store),
                            rank=comm.rank, world_size=comm.world_size,
                            timeout=timedelta(seconds=120))
    try:
        yield
    finally:
        dist.destroy_process_group()


def backend_name(backend: str, device_type: str) -> str:
    """The backend ``init_process_group(backend)`` gives ``device_type``:
    "cpu:gloo,cuda:pycomm" -> "gloo" for cpu; a plain name for every device."""
    if ":" not in backend:
        return backend
    return dict(part.split(":") for part in backend.split(","))[device_type]


def backend_ddp(comm: Any, store: Any, backend: str = "pycomm") -> None:
    """torch DDP (several buckets) over ``backend`` on the communicator's
    device equals one process trained on the full batch (the CPU test of
    tests/test_backend.py, here on ``comm.device``)."""
    from tests.test_backend import DDP_MLP, _batch, _ddp_train, _mlp, _train

    steps, dev = 4, comm.device
    with pycomm_process_group(comm, store, backend):
        out = _ddp_train(comm.rank, comm.world_size, steps, dev)
    assert out["backend"][1] == backend_name(backend, dev.type), out["backend"]
    assert len(out["buckets"]) >= 3, out["buckets"]
    ref = _mlp(**DDP_MLP).to(dev)
    x, y = _batch()
    _train(ref, x.to(dev), y.to(dev), steps)
    for p, q in zip(out["params"], ref.parameters()):
        torch.testing.assert_close(torch.from_numpy(p), q.detach().cpu(), rtol=1e-5, atol=1e-5)


def _cuda_communicators() -> list[Any]:
    import pycomm

    return [c for c in pycomm.backend._communicators.values()
            if c.transport == "nccl" and not c.closed]


def backend_every_op(comm: Any, store: Any, backend: str) -> None:
    """CUDA only. tests/test_backend.py's op sweep (every op, sync and async,
    list and non-contiguous variants, p2p) on CUDA tensors through
    torch.distributed; the CUDA communicator appears at the first CUDA op; a
    subgroup; a CUDA barrier; a call mixing devices is a ValueError."""
    import torch.distributed as dist

    import pycomm
    from tests.test_backend import _gathers_and_broadcast, _p2p_and_layouts, _reductions

    r, n = comm.rank, comm.world_size
    with pycomm_process_group(comm, store, backend):
        t = torch.full((3,), float(r + 1))
        dist.all_reduce(t)  # CPU
        dist.barrier()
        assert _cuda_communicators() == [], "the CUDA communicator must wait for a CUDA op"
        checked = (_reductions(r, n, "cuda") + _gathers_and_broadcast(r, n, "cuda")
                   + _p2p_and_layouts(r, n, "cuda"))
        assert checked > 100
        gpu = pycomm.backend.get_communicator(device="cuda")
        assert (gpu.transport, str(gpu.device), gpu.rank, gpu.world_size) == ("nccl", "cuda:0", r, n)
        assert len(_cuda_communicators()) == 1
        sub = dist.new_group([0, 1])
        if r < 2:
            x = torch.full((5,), float(r + 1), device="cuda")
            dist.all_reduce(x, group=sub)
            assert torch.equal(x.cpu(), torch.full((5,), 3.0))
            assert pycomm.backend.get_communicator(sub, device="cuda").world_size == 2
        dist.barrier(device_ids=[0])  # on the CUDA communicator
        with pytest.raises(ValueError, match=r"output_tensor_list\[0\] is on cpu but input is on cuda:0"):
            dist.all_gather([torch.empty(2) for _ in range(n)], torch.ones(2, device="cuda"))
        y = torch.full((2,), float(r), device="cuda")
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        assert torch.equal(y.cpu(), torch.full((2,), float(n - 1)))


def backend_streams(comm: Any, store: Any) -> None:
    """CUDA only. ProcessGroupNCCL's stream semantics through the pycomm
    backend: an op runs after the caller's current stream, Work.wait()
    orders that stream after the op (and after the copy back of a staged
    output) without the host, get_future()/then() are stream-ordered,
    Work.wait(timeout) waits for the GPU. A GPU sleep in front of each input
    makes a race visible."""
    import torch.distributed as dist

    from tests.test_backend import work_exception  # torch 2.11's Work.exception() raises

    r, n = comm.rank, comm.world_size
    expect = n * (n + 1) / 2
    big = 1 << 20
    with pycomm_process_group(comm, store):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            t = torch.zeros(big, device="cuda")
            torch.cuda._sleep(int(2e8))
            t.fill_(float(r + 1))
            dist.all_reduce(t, async_op=True).wait()
            t.mul_(2)  # on s, after the all-reduce
        s.synchronize()
        assert torch.all(t == 2 * expect).item()

        s2 = torch.cuda.Stream()
        with torch.cuda.stream(s2):
            base = torch.zeros(big, 2, device="cuda")
            torch.cuda._sleep(int(2e8))
            base[:, 0].fill_(float(r + 1))
            col = base[:, 0]  # non-contiguous: staged, copied back after the op
            doubled = dist.all_reduce(col, async_op=True).get_future().then(
                lambda f: f.value()[0] * 2).wait()
            outs = [torch.empty(big, device="cuda") for _ in range(n)]
            torch.cuda._sleep(int(2e8))
            mine = torch.full((big,), float(r), device="cuda")
            dist.all_gather(outs, mine, async_op=True).wait()  # staged list
            gathered = torch.stack(outs)  # on s2, after the copies out
        s2.synchronize()
        assert torch.all(doubled == 2 * expect).item()
        assert torch.all(base[:, 0] == expect).item() and torch.all(base[:, 1] == 0).item()
        for q in range(n):
            assert torch.all(gathered[q] == q).item()

        u = torch.full((4, 6), float(r + 1), device="cuda").t()
        dist.all_reduce(u)  # a sync op orders the current stream after it, copy back included
        u.add_(1)
        torch.cuda.synchronize()
        assert torch.all(u == expect + 1).item()

        with torch.cuda.stream(s):
            v = torch.zeros(big, device="cuda")
            torch.cuda._sleep(int(2e8))
            v.fill_(1.0)
            work = dist.all_reduce(v, async_op=True)
            assert work.wait(timeout=timedelta(seconds=60))  # the host waits for the GPU
            assert work.is_completed() and work.is_success() and work_exception(work) is None
        s.synchronize()
        assert torch.all(v == n).item()
