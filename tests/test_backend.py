"""pycomm as a torch.distributed backend (backend="pycomm"): every supported op
through the torch.distributed API against float64 references, async Works and
futures, new_group, errors, torch DDP and torch.distributed.pipelining against
one process on the full batch, and the example under torchrun. Every rank is a
fresh spawned process that calls init_process_group(backend="pycomm")."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests._dist import client_store, run_torchrun, spawn_ranks
from tests.reference import assert_matches, rank_input, reference

ROOT = Path(__file__).resolve().parent.parent
COUNTS = [0, 1, 13, 1031]  # 13 and 1031: primes, not divisible by 2 or 3
DTYPES = [torch.float32, torch.float64, torch.int32]
OPS = ["sum", "avg", "max", "min", "product"]


def _init(rank: int, world_size: int, port: int, pg_options=None,
          backend: str = "pycomm") -> None:
    import torch.distributed as dist

    import pycomm  # noqa: F401  (registers the backend)

    dist.init_process_group(backend, store=client_store(port, world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60),
                            pg_options=pg_options)


def _torch_op(op: str):
    import torch.distributed as dist

    return getattr(dist.ReduceOp, op.upper())


def _cases():
    for count in COUNTS:
        for dtype in DTYPES:
            for op in OPS:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                yield count, dtype, op


# ---------------------------------------------------------------- collectives

def _reductions(rank: int, n: int, device: str = "cpu") -> int:
    """all_reduce (sync, async + future, coalesced), reduce_scatter_tensor and
    reduce_scatter (list) for every count x dtype x op, on ``device``."""
    import torch.distributed as dist

    checked = 0
    for count, dtype, op in _cases():
        what = f"{op} {dtype} count={count}"
        inputs = [rank_input(r, count, dtype, op) for r in range(n)]
        ref = reference(inputs, op)
        t = inputs[rank].to(device, copy=True)
        assert dist.all_reduce(t, op=_torch_op(op)) is None
        assert_matches(t.cpu(), ref, f"all_reduce {what}")

        t = inputs[rank].to(device, copy=True)
        work = dist.all_reduce(t, op=_torch_op(op), async_op=True)
        value = work.get_future().wait()
        assert value[0] is t or value[0].data_ptr() == t.data_ptr()
        assert work.wait()
        assert_matches(t.cpu(), ref, f"async all_reduce {what}")
        _assert_completes(work)

        # reduce-scatter: rank r's input holds n blocks; block j goes to rank j.
        big = [rank_input(r, n * count, dtype, op, seed=1) for r in range(n)]
        full = reference(big, op)
        mine = full[rank * count:(rank + 1) * count]
        out = torch.empty(count, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(out, big[rank].to(device, copy=True), op=_torch_op(op))
        assert_matches(out.cpu(), mine, f"reduce_scatter_tensor {what}")
        out = torch.full((count,), 7, dtype=dtype, device=device)
        chunks = (list(big[rank].to(device, copy=True).chunk(n)) if count else
                  [torch.empty(0, dtype=dtype, device=device) for _ in range(n)])
        work = dist.reduce_scatter(out, chunks, op=_torch_op(op), async_op=True)
        work.wait()
        assert_matches(out.cpu(), mine, f"reduce_scatter (list) {what}")
        checked += 4

    # all_reduce_coalesced: several tensors, one flat all-reduce.
    xs = [rank_input(rank, c, torch.float64, "sum", seed=2).to(device) for c in COUNTS]
    refs = [reference([rank_input(r, c, torch.float64, "sum", seed=2) for r in range(n)], "sum")
            for c in COUNTS]
    dist.all_reduce_coalesced(xs)
    for x, ref, c in zip(xs, refs, COUNTS):
        assert_matches(x.cpu(), ref, f"all_reduce_coalesced count={c}")
    return checked + 1


def _assert_completes(work, limit: float = 60.0) -> None:
    """The Work reports completion and success (CUDA: once the GPU is done,
    which the watchdog sees shortly after)."""
    import time

    deadline = time.monotonic() + limit
    while not work.is_completed():
        assert time.monotonic() < deadline, "the Work never completed"
        time.sleep(0.005)
    assert work.is_success() and work_exception(work) is None


def work_exception(work):
    """``work.exception()``, or None where torch's own binding cannot return
    it: torch 2.11 binds ``Work.exception`` without a converter for
    ``std::exception_ptr``, so it raises this TypeError for every backend
    (gloo's too); 2.13 returns None or the error."""
    try:
        return work.exception()
    except TypeError as e:
        if "Unable to convert function return value" not in str(e):
            raise
        return None


def _gathers_and_broadcast(rank: int, n: int, device: str = "cpu") -> int:
    """all_gather (list), all_gather_into_tensor and broadcast from every root,
    on ``device``."""
    import torch.distributed as dist

    checked = 0
    for count in COUNTS:
        for dtype in DTYPES:
            inputs = [rank_input(r, count, dtype, "sum", seed=3) for r in range(n)]
            outs = [torch.full((count,), 5, dtype=dtype, device=device) for _ in range(n)]
            # The staged list is filled before the future completes (CUDA: the
            # future's value is ordered after the copies).
            dist.all_gather(outs, inputs[rank].to(device, copy=True),
                            async_op=True).get_future().wait()
            for r in range(n):
                assert torch.equal(outs[r].cpu(), inputs[r]), \
                    f"all_gather {dtype} count={count} r={r}"
            flat = torch.empty(n * count, dtype=dtype, device=device)
            dist.all_gather_into_tensor(flat, inputs[rank].to(device, copy=True),
                                        async_op=True).wait()
            assert torch.equal(flat.cpu(), torch.cat(inputs)), \
                f"all_gather_into_tensor {dtype} {count}"
            for src in range(n):
                t = inputs[rank].to(device, copy=True)
                dist.broadcast(t, src=src)
                assert torch.equal(t.cpu(), inputs[src]), \
                    f"broadcast {dtype} count={count} src={src}"
            checked += 2 + n
    return checked


def _p2p_and_layouts(rank: int, n: int, device: str = "cpu") -> int:
    """send/recv, isend/irecv, batch_isend_irecv around the ring, barrier, and
    non-contiguous tensors (staged through a contiguous copy), on ``device``."""
    import torch.distributed as dist

    def full(shape, value, dtype=torch.float32):
        return torch.full(shape, value, dtype=dtype, device=device)

    nxt, prv = (rank + 1) % n, (rank - 1) % n
    if rank == 0:
        dist.send(torch.arange(1031, dtype=torch.float64, device=device), 1)
    elif rank == 1:
        got = torch.empty(1031, dtype=torch.float64, device=device)
        dist.recv(got, 0)
        assert torch.equal(got.cpu(), torch.arange(1031, dtype=torch.float64))
    # A ring shift, batched and as lone isend/irecv pairs (small messages:
    # on CUDA a ring of lone isends relies on NCCL buffering them).
    for count in COUNTS:
        got = torch.empty(count, dtype=torch.int64, device=device)
        ops = [dist.P2POp(dist.isend, full((count,), rank, torch.int64), nxt),
               dist.P2POp(dist.irecv, got, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert torch.equal(got.cpu(), torch.full((count,), prv)), \
            f"batch_isend_irecv count={count}"
        got = torch.empty(count, device=device)
        works = [dist.isend(full((count,), float(rank)), nxt), dist.irecv(got, prv)]
        for w in works:
            w.wait()
        assert torch.equal(got.cpu(), torch.full((count,), float(prv))), \
            f"isend/irecv count={count}"
    dist.barrier()
    dist.barrier(async_op=True).wait()

    # Non-contiguous tensors: the strided column is updated, the rest is not.
    base = torch.stack([full((13,), float(rank + 1)), full((13,), -1.0)], dim=1)
    col = base[:, 0]
    assert not col.is_contiguous()
    dist.all_reduce(col)
    assert torch.equal(base[:, 0].cpu(), torch.full((13,), n * (n + 1) / 2))
    assert torch.equal(base[:, 1].cpu(), torch.full((13,), -1.0))
    bcast = full((4, 6), float(rank)).t()
    work = dist.broadcast(bcast, src=n - 1, async_op=True)
    work.wait()  # the copy back is ordered before what follows (CUDA: on the current stream)
    assert torch.equal(bcast.cpu(), torch.full((6, 4), float(n - 1)))
    strided = torch.zeros(2, 13, device=device)[:, ::2]
    if rank == 0:
        dist.send(full((2, 7), 1.0), 1)
    elif rank == 1:
        dist.recv(strided, 0)
        assert torch.equal(strided.cpu(), torch.ones(2, 7))
    return 4


def _wait_timeout(rank: int) -> int:
    """Work.wait(timeout) raises when the op is still pending, and the op
    completes later all the same (CPU: a pending irecv)."""
    import torch.distributed as dist

    late = torch.zeros(3)
    if rank == 0:
        work = dist.irecv(late, 1)
        with pytest.raises(RuntimeError, match="did not complete within 200 ms"):
            work.wait(timeout=timedelta(milliseconds=200))
    dist.barrier()
    if rank == 1:
        dist.send(torch.ones(3), 0)
    elif rank == 0:
        work.wait()
        assert torch.equal(late, torch.ones(3))
    return 1


def _collectives(rank: int, world_size: int, port: int) -> int:
    import torch.distributed as dist

    import pycomm

    _init(rank, world_size, port)
    try:
        assert dist.get_backend() == "pycomm"
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        assert backend.name() == "pycomm"
        comm = pycomm.backend.get_communicator()
        assert (comm.rank, comm.world_size) == (rank, world_size)
        return (_reductions(rank, world_size) + _gathers_and_broadcast(rank, world_size)
                + _p2p_and_layouts(rank, world_size) + _wait_timeout(rank))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_op_matches_reference(world_size):
    counts = spawn_ranks(_collectives, world_size, timeout=300)
    assert counts[0] > 100 and len(set(counts)) == 1


# ---------------------------------------------------------------- groups, options, errors

def _raises(exc: type, pattern: str, fn, *args, **kwargs) -> None:
    with pytest.raises(exc, match=pattern):
        fn(*args, **kwargs)


def _groups_options_errors(rank: int, world_size: int, port: int) -> list:
    import torch.distributed as dist

    import pycomm

    _init(rank, world_size, port, pg_options=pycomm.backend.Options(transport="gloo", algo="ring"))
    try:
        assert pycomm.backend.get_communicator().transport == "gloo"
        # A subgroup inherits the default group's options; a second subgroup
        # that every rank creates must rendezvous even though rank 2 created no
        # communicator for the first one.
        sub = dist.new_group([0, 1])
        if rank < 2:
            assert dist.get_backend(sub) == "pycomm"
            assert pycomm.backend.get_communicator(sub).transport == "gloo"
            x = torch.full((5,), float(rank + 1))
            dist.all_reduce(x, group=sub)
            assert torch.equal(x, torch.full((5,), 3.0))
        everyone = dist.new_group([2, 0, 1], pg_options=pycomm.backend.Options(transport="shm"))
        assert pycomm.backend.get_communicator(everyone).transport == "shm"
        y = torch.full((3,), float(rank))
        dist.all_reduce(y, group=everyone, op=dist.ReduceOp.MAX)
        assert torch.equal(y, torch.full((3,), 2.0))

        t = torch.ones(4)
        # Unsupported options: an error naming the op, nothing runs.
        _raises(NotImplementedError, "ReduceOp.BAND is not supported", dist.all_reduce,
                torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.BAND)
        # Bad input: a Python exception naming the problem, the group stays usable.
        _raises(ValueError, "must hold world_size = 3 tensors", dist.all_gather,
                [torch.empty(4)], t)
        _raises(ValueError, r"output_tensor_list\[1\] has 5 elements but input has 4",
                dist.all_gather, [torch.empty(4), torch.empty(5), torch.empty(4)], t)
        _raises(ValueError, "world_size", dist.all_gather_into_tensor, torch.empty(5), t)
        _raises(ValueError, "AVG needs a floating dtype", dist.all_reduce,
                torch.ones(4, dtype=torch.int64), op=dist.ReduceOp.AVG)
        _raises(TypeError, "unsupported dtype", dist.all_reduce,
                torch.ones(4, dtype=torch.bool))
        _raises(ValueError, "out of range", dist.send, t, 5)
        _raises(ValueError, "not divisible by world_size = 3", dist.all_to_all_single,
                torch.empty(5), torch.ones(5))
        z = torch.full((2,), float(rank))
        dist.all_reduce(z)
        assert torch.equal(z, torch.full((2,), 3.0))
        return ["ok"]
    finally:
        dist.destroy_process_group()


def test_groups_options_and_errors():
    assert spawn_ranks(_groups_options_errors, 3, timeout=240) == [["ok"]] * 3


def _devices_and_dispatch(rank: int, world_size: int, port: int, backend: str) -> list:
    import torch.distributed as dist

    import pycomm
    from pycomm._ext import _C

    _init(rank, world_size, port, backend=backend)
    try:
        # One backend object serves both devices: calls are dispatched by device.
        pg = dist.group.WORLD
        assert {d.type for d in pg._device_types} == {"cpu", "cuda"}
        on_cpu, on_cuda = pg._get_backend(torch.device("cpu")), pg._get_backend(torch.device("cuda"))
        assert on_cpu.name() == on_cuda.name() == "pycomm"
        assert _C.backend_comm(on_cuda) is _C.backend_comm(on_cpu)  # the CPU communicator
        # CPU users are unaffected: ops, object collectives and barrier run on CPU.
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((3,), world_size * (world_size + 1) / 2))
        objs: list = [None] * world_size
        dist.all_gather_object(objs, {"rank": rank})
        assert objs == [{"rank": r} for r in range(world_size)]
        dist.barrier()
        if not torch.cuda.is_available():
            # Scripts written for NCCL pass device_ids=[local_rank]; without a
            # GPU that barrier stays on CPU (it once asked for the CUDA
            # communicator and failed).
            dist.barrier(device_ids=[0])
        # The tensors of one call must be on one device; other devices are refused.
        _raises(ValueError, r"output_tensor_list\[1\] is on meta but input is on cpu",
                dist.all_gather, [torch.empty(2), torch.empty(2, device="meta")], torch.ones(2))
        _raises(ValueError, "runs on CPU and CUDA tensors, got one on meta", on_cpu.allreduce,
                [torch.ones(2, device="meta")])
        if not _C.WITH_CUDA:
            # The CUDA communicator is made on demand (the C++ backend calls
            # pycomm/backend.py's factory); without CUDA it says what is
            # missing, and a failed creation stays failed.
            for _ in range(2):
                _raises(ValueError, "get_communicator on cuda:0: this pycomm build has no "
                        r"CUDA/NCCL support \(pycomm._C.WITH_CUDA is False\)",
                        pycomm.backend.get_communicator, device="cuda")
        # A backend made without a CUDA factory serves CPU tensors only.
        bare = _C.make_backend(_C.backend_comm(on_cpu), "auto")
        _raises(ValueError, "without a CUDA communicator factory", _C.backend_comm, bare, "cuda:0")
        assert _C.backend_comm(bare) is _C.backend_comm(on_cpu)
        z = torch.full((2,), float(rank))
        dist.all_reduce(z, op=dist.ReduceOp.MAX)
        assert torch.equal(z, torch.full((2,), float(world_size - 1)))
        return ["ok"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["pycomm", "cpu:pycomm,cuda:pycomm"])
def test_one_backend_for_cpu_and_cuda(backend):
    assert spawn_ranks(_devices_and_dispatch, 2, backend, timeout=120) == [["ok"]] * 2


def test_options_resolve_and_validate(monkeypatch):
    import pycomm

    monkeypatch.setenv("PYCOMM_BACKEND_CUDA_ALGO", "nccl")
    monkeypatch.delenv("PYCOMM_BACKEND_ALGO", raising=False)
    opts = pycomm.backend.Options(transport="gloo").resolved()
    assert (opts.transport, opts.algo, opts.cuda_algo) == ("gloo", "auto", "nccl")
    assert pycomm.backend.Options(cuda_algo="ring").resolved().cuda_algo == "ring"
    with pytest.raises(ValueError, match="cuda_algo='direct' is not one of"):
        pycomm.backend.Options(cuda_algo="direct").resolved()
    with pytest.raises(ValueError, match="algo='nccl' is not one of"):
        pycomm.backend.Options(algo="nccl").resolved()
    with pytest.raises(ValueError, match="transport='nccl' is not one of .* CUDA tensors always"):
        pycomm.backend.Options(transport="nccl").resolved()


def _reinit_without_options(rank: int, world_size: int, port: int) -> list:
    import torch.distributed as dist

    import pycomm

    store = client_store(port, world_size)
    transports = []
    for k, options in enumerate([pycomm.backend.Options(transport="gloo"), None]):
        dist.init_process_group("pycomm", store=dist.PrefixStore(f"init{k}", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60),
                                pg_options=options)
        try:
            transports.append(pycomm.backend.get_communicator().transport)
        finally:
            dist.destroy_process_group()
    return transports


def test_new_default_group_does_not_inherit_a_destroyed_ones_options(monkeypatch):
    # The second init_process_group has no pg_options: defaults ("auto": shm
    # on one host), not the options of the group destroyed before it.
    monkeypatch.delenv("PYCOMM_BACKEND_TRANSPORT", raising=False)
    assert spawn_ranks(_reinit_without_options, 2, timeout=120) == [["gloo", "shm"]] * 2


# ---------------------------------------------------------------- torch DDP

def _mlp(hidden: int = 64, depth: int = 2) -> torch.nn.Module:
    """16 -> hidden (-> hidden) x (depth - 1) -> 4, tanh between; seeded."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(16, hidden)]
    for _ in range(depth - 1):
        layers += [torch.nn.Tanh(), torch.nn.Linear(hidden, hidden)]
    layers += [torch.nn.Tanh(), torch.nn.Linear(hidden, 4)]
    return torch.nn.Sequential(*layers)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(24, 16, generator=g), torch.randn(24, 4, generator=g)


def _to_parent(params) -> list:
    """Parameters as numpy arrays: torch tensors cross the result pipe as
    shared-memory handles that die with the rank process."""
    return [p.detach().numpy().copy() for p in params]


def _train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


DDP_MLP = {"hidden": 64, "depth": 3}  # 16-64-64-64-4: 9.7 K parameters


def _ddp_train(rank: int, world_size: int, steps: int, device: torch.device) -> dict:
    """torch DDP over the default group, each rank on its shard of the batch,
    on ``device``: the trained parameters (numpy), bucket sizes and backend."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _mlp(**DDP_MLP).to(device)
    # 8 KiB buckets: from the second iteration on (DDP rebuilds its
    # buckets in gradient-ready order) the 8 parameters go out in several.
    ddp = DDP(model, bucket_cap_mb=8 / 1024)
    x, y = (t.to(device) for t in _batch())
    shard = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)
    _train(ddp, x[shard], y[shard], steps)
    buckets = [b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets()]
    backend = ddp.process_group._get_backend(torch.device(device.type)).name()
    return {"params": _to_parent(p.cpu() for p in model.parameters()), "buckets": buckets,
            "backend": (dist.get_backend(ddp.process_group), backend)}


def _ddp_rank(rank: int, world_size: int, port: int, steps: int) -> dict:
    import torch.distributed as dist

    _init(rank, world_size, port)
    try:
        return _ddp_train(rank, world_size, steps, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_torch_ddp_equals_one_process():
    steps = 4
    ranks = spawn_ranks(_ddp_rank, 2, steps, timeout=240)
    ref = _mlp(**DDP_MLP)
    _train(ref, *_batch(), steps)
    for r, out in enumerate(ranks):
        assert out["backend"] == ("pycomm", "pycomm")
        assert len(out["buckets"]) >= 3, out["buckets"]
        for p, q in zip(out["params"], ref.parameters()):
            torch.testing.assert_close(torch.from_numpy(p), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=r: f"rank {r}: {m}")


def _symmetric_maps() -> int:
    """Mappings of symmetric-memory parts in this process (their names are
    unlinked once mapped: "/dev/shm/pycomm-...s<k>.<r> (deleted)")."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/pycomm-" in line and ".s" in line.rsplit("/", 1)[-1])


def _register_option(rank: int, world_size: int, port: int) -> dict:
    import numpy as np
    import torch.distributed as dist

    import pycomm

    _init(rank, world_size, port, pg_options=pycomm.backend.Options(register=True))
    comm = pycomm.backend.get_communicator()
    n = world_size
    expect = float(sum(range(1, n + 1)))

    def reduce_twice(make) -> list[bool]:
        seen = []
        for _ in range(3):
            t = make()
            dist.all_reduce(t)
            assert torch.all(t == expect), t[:3]
            seen.append(comm.is_registered(t))
        return seen

    out = {}
    big = torch.empty(100_000)  # 400 KB: moves at its second all-reduce
    out["repeated"] = reduce_twice(lambda: big.fill_(rank + 1))
    small = torch.empty(1000)
    out["small"] = reduce_twice(lambda: small.fill_(rank + 1))
    whole = torch.empty(100_001)
    out["view"] = reduce_twice(lambda: whole[1:].fill_(rank + 1))
    arr = np.empty(100_000, dtype=np.float32)
    out["numpy"] = reduce_twice(lambda: torch.from_numpy(arr).fill_(rank + 1))
    mine = torch.empty(100_000)  # rank 0 registers, rank 1 reduces fresh tensors: nobody moves
    out["mixed"] = reduce_twice(
        lambda: mine.fill_(rank + 1) if rank == 0 else torch.full((100_000,), rank + 1.0))
    off = dist.new_group(pg_options=pycomm.backend.Options(register=False))
    other = torch.empty(100_000)
    seen = []
    for _ in range(3):
        dist.all_reduce(other.fill_(rank + 1), group=off)
        seen.append(pycomm.backend.get_communicator(off).is_registered(other))
    out["off"] = seen
    dist.destroy_process_group()
    return out


def test_register_option_moves_only_reused_whole_allocations():
    for out in spawn_ranks(_register_option, 2, timeout=120):
        assert out["repeated"] == [False, True, True], out
        for case in ("small", "view", "numpy", "mixed", "off"):
            assert not any(out[case]), (case, out)


def _ddp_registered_rank(rank: int, world_size: int, port: int, steps: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pycomm

    _init(rank, world_size, port, pg_options=pycomm.backend.Options(register=True))
    try:
        model = _mlp(hidden=384, depth=3)  # 0.3 M parameters: buckets of 256 KiB or more
        ddp = DDP(model, bucket_cap_mb=0.5)
        x, y = _batch()
        shard = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)
        _train(ddp, x[shard], y[shard], steps)
        return {"params": _to_parent(model.parameters()), "maps": _symmetric_maps()}
    finally:
        dist.destroy_process_group()


def test_torch_ddp_with_registered_buckets_equals_one_process():
    steps = 4
    ranks = spawn_ranks(_ddp_registered_rank, 2, steps, timeout=240)
    ref = _mlp(hidden=384, depth=3)
    _train(ref, *_batch(), steps)
    for r, out in enumerate(ranks):
        # Every rank maps every rank's part of each moved bucket.
        assert out["maps"] >= 2, f"rank {r}: DDP's buckets did not move ({out['maps']} maps)"
        for p, q in zip(out["params"], ref.parameters()):
            torch.testing.assert_close(torch.from_numpy(p), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=r: f"rank {r}: {m}")


# ---------------------------------------------------------------- pipelining

def _pipeline_rank(rank: int, world_size: int, port: int, schedule_name: str,
                   steps: int) -> list:
    import torch.distributed as dist
    from torch.distributed import pipelining

    _init(rank, world_size, port)
    try:
        full = _mlp()
        part = full[:2] if rank == 0 else full[2:]
        stage = pipelining.PipelineStage(part, rank, world_size, torch.device("cpu"))
        schedule = getattr(pipelining, schedule_name)(
            stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
        opt = torch.optim.SGD(part.parameters(), lr=0.1, momentum=0.9)
        x, y = _batch()
        for _ in range(steps):
            opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
            opt.step()
        return _to_parent(part.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
def test_torch_pipelining_equals_one_process(schedule):
    steps = 3
    ranks = spawn_ranks(_pipeline_rank, 2, schedule, steps, timeout=240)
    ref = _mlp()
    _train(ref, *_batch(), steps)  # equal microbatches: mean of means = full-batch mean
    got = ranks[0] + ranks[1]
    want = [p.detach() for p in ref.parameters()]
    assert len(got) == len(want)
    for p, q in zip(got, want):
        torch.testing.assert_close(torch.from_numpy(p), q, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- example

@pytest.mark.parametrize("register", [False, True])
def test_example_under_torchrun(register):
    proc = run_torchrun("examples/torch_backend.py", 2, *(["--register"] if register else []))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # ranks print concurrently: lines may interleave, so match records, not lines
    records = re.findall(r"rank (\d)/2 backend=pycomm all_reduce=\[[^\]]*\] loss=[\d.]+ "
                         r"symmetric=(\d+) OK", proc.stdout)
    assert sorted(r for r, _ in records) == ["0", "1"], proc.stdout
    # 5 steps; DDP rebuilds its bucket after step 1, and the new one moves at
    # its second all-reduce (step 3), which runs from symmetric memory on
    assert all(int(n) >= 3 if register else int(n) == 0 for _, n in records), proc.stdout
    assert "WRONG" not in proc.stdout
