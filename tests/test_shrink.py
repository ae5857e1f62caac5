"""Communicator.shrink(): the survivors of a failure go on, without a restart.

Fresh processes (spawn_ranks): the victim SIGKILLs itself inside a
collective; the survivors get CommError, shrink, and the new communicator's
collectives equal float64 references over the survivors' inputs.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests._dist import COMM_TIMEOUT, client_store, spawn_ranks


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("pycomm")}


def _victims_die(rank, victims, all_reduce, error_type) -> str:
    """Every rank all-reduces once, then the victims SIGKILL themselves; the
    survivors' next all-reduce must raise ``error_type``: its message."""
    t = torch.ones(1 << 16)
    all_reduce(t)  # everyone is up
    if rank in victims:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        all_reduce(t)
    except error_type as e:
        return str(e)
    raise AssertionError("the all-reduce with a dead peer succeeded")


def _die_then_shrink(rank, world_size, port, transport, victims, explicit):
    import time

    import pycomm

    comm = pycomm.init(rank=rank, world_size=world_size, store=client_store(port, world_size),
                       transport=transport, timeout=COMM_TIMEOUT)
    error = _victims_die(rank, victims, comm.all_reduce, pycomm.CommError)
    start = time.monotonic()
    new = comm.shrink(exclude=victims if explicit else None)
    took = time.monotonic() - start
    x = torch.full((1021,), float(rank + 1), dtype=torch.float64)
    new.all_reduce(x)
    b = torch.arange(7.0) * (rank + 1) if new.rank == 0 else torch.zeros(7)
    new.broadcast(b, src=0)
    out = (new.rank, new.world_size, new.transport, x[0].item(), b.tolist(), comm.closed,
           pycomm.get_default() is new, error, took)
    new.close()
    return out


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("world_size, victims, explicit", [
    (2, [1], False), (3, [1], False), (3, [0], True), (4, [0, 2], False),
])
def test_survivors_shrink_and_go_on(transport, world_size, victims, explicit):
    before = _shm_names()
    results = spawn_ranks(_die_then_shrink, world_size, transport, victims, explicit, timeout=120)
    survivors = [r for r in range(world_size) if r not in victims]
    for new_rank, old in enumerate(survivors):
        rank, n, tr, total, b, old_closed, is_default, error, took = results[old]
        assert (rank, n, tr) == (new_rank, len(survivors), transport)
        assert total == sum(q + 1 for q in survivors)
        assert b == [i * (survivors[0] + 1) for i in range(7)]
        assert old_closed and is_default
    for v in victims:
        assert results[v][0] == "died"
    assert _shm_names() <= before


def _bad_exclude(rank, world_size, port):
    import pycomm

    comm = pycomm.init(rank=rank, world_size=world_size, store=client_store(port, world_size),
                       transport="gloo", timeout=COMM_TIMEOUT)
    errors = []
    for exclude in ([5], [rank]):
        try:
            comm.shrink(exclude=exclude)
        except ValueError as e:
            errors.append(str(e))
    comm.close()
    return errors


def test_shrink_rejects_bad_exclude():
    for rank, errors in enumerate(spawn_ranks(_bad_exclude, 2)):
        assert "out of range" in errors[0]
        assert f"rank {rank} excludes itself" in errors[1]


def _c10d_die_then_shrink(rank, world_size, port, transport, victims, flags):
    import torch.distributed as dist

    import pycomm.backend

    dist.init_process_group("pycomm", store=client_store(port, world_size), rank=rank,
                            world_size=world_size, timeout=COMM_TIMEOUT,
                            pg_options=pycomm.backend.Options(transport=transport))
    supports = dist.group.WORLD._get_backend(torch.device("cpu")).supports_shrinking
    error = _victims_die(rank, victims, dist.all_reduce, RuntimeError)
    lost = pycomm.backend.lost_ranks()  # the survivors' agreement
    group = dist.shrink_group(lost, shrink_flags=flags)
    x = torch.full((1021,), float(rank + 1), dtype=torch.float64)
    dist.all_reduce(x)
    # torch DDP over the shrunk default group: its gradient is the float64
    # mean of every survivor's own gradient (all-gathered, summed here).
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    inp = torch.randn(5, 8) * (rank + 1)
    model(inp).square().sum().backward()
    own = model.weight.grad.detach().double()
    model.weight.grad = None
    grads = [torch.empty_like(own) for _ in range(dist.get_world_size())]
    dist.all_gather(grads, own)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(inp).square().sum().backward()
    err = (model.weight.grad.double() - sum(grads) / len(grads)).abs().max().item()
    # Registered as init_process_group registers it (CUSTOM, not torch's
    # GLOO, which torch's C++ casts to ProcessGroupGloo), for CUDA tensors too.
    kind = (dist.group.WORLD.name(), sorted(d.type for d in dist.group.WORLD._device_types))
    out = (dist.get_rank(), dist.get_world_size(), supports, x[0].item(),
           group == dist.group.WORLD, pycomm.backend.get_communicator().transport, err, error,
           lost, kind)
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("world_size, victims, flags", [(3, [1], 0), (3, [0], 1)])
def test_torch_shrink_group_after_a_death(transport, world_size, victims, flags):
    """torch.distributed.shrink_group(pycomm.backend.lost_ranks()) over
    backend "pycomm": the survivors agree on the dead, and their default
    group runs collectives and torch DDP on the same transport (flags 1:
    SHRINK_ABORT, the old group aborted before the survivors agree)."""
    before = _shm_names()
    results = spawn_ranks(_c10d_die_then_shrink, world_size, transport, victims, flags,
                          timeout=120)
    survivors = [r for r in range(world_size) if r not in victims]
    for new_rank, old in enumerate(survivors):
        rank, n, supports, total, is_world, tr, err, error, lost, kind = results[old]
        assert lost == victims
        assert kind == ("custom", ["cpu", "cuda"])
        assert (rank, n, supports, is_world, tr) == (new_rank, len(survivors), True, True,
                                                     transport)
        assert total == sum(q + 1 for q in survivors)
        assert err < 1e-5 and error
    for v in victims:
        assert results[v][0] == "died"
    assert _shm_names() <= before


def test_agreement_looks_again_for_a_rank_still_exiting():
    """A killed rank's connections close before its process is gone: a
    survivor that noticed at once saw it still running (SIGKILL, 3 gloo
    ranks: rank 2 waited in the agreement for rank 0, the whole timeout,
    while rank 1 had decided without it and waited in the new
    communicator's setup). Looked at again, it counts as dead and rank 2
    agrees with rank 1 at once."""
    import time

    import torch.distributed as dist

    from pycomm import _shrink

    store = dist.HashStore()
    store.set("s/in/1", "1")  # rank 1 checked in (and saw rank 0 dead)
    looks = []

    def dead() -> set[int]:
        looks.append(time.monotonic())
        return {0} if len(looks) > 2 else set()  # rank 0 seen exiting at first

    start = time.monotonic()
    members = _shrink.agree_on_survivors(store, "s", 2, 3, exclude=None, dead=dead, unknown=(),
                                         grace=0.0, timeout=30.0)
    assert members == [1, 2]
    assert time.monotonic() - start < 10, "waited for the dead rank"
    # A list of dead ranks still works, and a rank that checks in is waited for.
    store2 = dist.HashStore()
    store2.set("s/in/0", "1")
    assert _shrink.agree_on_survivors(store2, "s", 1, 3, exclude=None, dead=[2], unknown=(),
                                      grace=0.0, timeout=30.0) == [0, 1]
