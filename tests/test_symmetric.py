"""Symmetric memory on the shm transport (Communicator.register_tensor): a
registered tensor keeps its values and views, an all-reduce of it gives the
bits of the staged direct algorithm (float64 references), mixed or partial
use falls back to the staged path on every rank, a rank that cannot (or may
not) register makes every rank return False, and nothing is left in /dev/shm,
even when a rank dies."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from tests._dist import (COMM_TIMEOUT, assert_survivors_raised, client_store, run_ranks,
                         spawn_ranks)
from tests.reference import all_reduce_cases, assert_matches, digest, rank_input, reference

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shm")


def _ours(pid: int) -> list[str]:
    """Names under rank 0's pid: the segment and its symmetric parts
    (/pycomm-<pid>-...[.s<k>.<r>])."""
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"pycomm-{pid}-")]


def _ours_any(comm) -> list[str]:
    """Symmetric parts of this communicator's segment (named after rank 0's
    pid, which rank 0 shares through the store)."""
    if comm.rank == 0:
        comm._store.set("sym-test-pid0", str(os.getpid()))
    pid0 = int(comm._store.get("sym-test-pid0"))
    return [f for f in _ours(pid0) if ".s" in f]


def _registered_cases(comm, register: bool):
    """Every (count, dtype, op) case of test_collectives, all-reduced from a
    registered tensor (or a plain one); digests of the results."""
    out = []
    for count, dtype, op in all_reduce_cases(True):
        inputs = [rank_input(r, count, dtype, op) for r in range(comm.world_size)]
        t = inputs[comm.rank].clone()
        if register:
            assert comm.register_tensor(t) and comm.is_registered(t)
            assert torch.equal(t, inputs[comm.rank]), "registering changed the values"
        for _ in range(2):  # twice: the region is reused by the next op
            x = t if register else t.clone()
            x.copy_(inputs[comm.rank])
            before = comm.symmetric_all_reduces
            comm.all_reduce(x, op=op)
            assert_matches(x, reference(inputs, op), f"all_reduce {op} {dtype} count={count}")
            # the symmetric path ran exactly when registered (and not empty)
            ran = comm.symmetric_all_reduces - before
            assert ran == (1 if register and count > 0 else 0), (ran, count, dtype, op)
        out.append(digest(x))
    return out


@pytest.mark.parametrize("world_size", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_registered_all_reduce_same_bits_as_staged(world_size):
    registered = run_ranks(_registered_cases, world_size, "shm", True)
    staged = run_ranks(_registered_cases, world_size, "shm", False)
    for r in range(world_size):
        assert registered[r] == staged[r], f"rank {r}: symmetric and staged results differ"
        assert registered[r] == registered[0], f"rank {r} differs from rank 0"


def _views_follow(comm):
    n, r = comm.world_size, comm.rank
    t = torch.arange(1000, dtype=torch.float32) + r
    view = t[10:20]
    before = t.data_ptr()
    assert comm.register_tensor(t)
    moved = t.data_ptr() != before
    # The view made before registering shares the moved storage.
    assert view.data_ptr() == t.data_ptr() + 40 and torch.equal(view, t[10:20])
    view.fill_(-1.0)
    assert torch.all(t[10:20] == -1.0)
    t.copy_(torch.arange(1000, dtype=torch.float32) + r)
    for step in range(5):  # the result lands in every rank's copy, every time
        t.add_(step)
        comm.all_reduce(t)
        base = torch.arange(1000, dtype=torch.float32) * n + sum(range(n))
        assert torch.equal(t, base + n * step), (step, t[:3])
        t.copy_(torch.arange(1000, dtype=torch.float32) + r)
    assert torch.equal(view, t[10:20])
    # A view of a registered tensor takes the staged path.
    part = t[1:]
    before = comm.symmetric_all_reduces
    comm.all_reduce(part)
    assert torch.equal(part, (torch.arange(1, 1000, dtype=torch.float32) * n + sum(range(n))))
    assert comm.symmetric_all_reduces == before
    return moved


def test_register_keeps_values_and_views():
    assert all(run_ranks(_views_follow, 2, "shm"))


def _one_rank(comm):
    t = torch.arange(10.0)
    ok = comm.register_tensor(t)
    comm.all_reduce(t, op="avg")
    return ok, comm.is_registered(t), t.tolist()


def test_register_on_one_rank():
    assert run_ranks(_one_rank, 1, "shm") == [(True, True, [float(i) for i in range(10)])]


def _mixed(comm):
    """Rank 0 all-reduces its registered tensor, the others a plain one."""
    n, r = comm.world_size, comm.rank
    a = torch.full((300_000,), float(r + 1))
    b = torch.full((300_000,), float(r + 1))
    assert comm.register_tensor(a)
    t = a if r == 0 else b
    before = comm.symmetric_all_reduces
    comm.all_reduce(t, op="avg")
    expect = sum(range(1, n + 1)) / n
    assert torch.all(t == expect), t[:3]
    assert comm.symmetric_all_reduces == before
    # Rank 0 passes its region (whose first arrival stages nothing), the
    # others ask to register a plain tensor: every rank stages, nothing moves.
    d = torch.full((300_000,), float(r + 1))
    where = d.data_ptr()
    a.fill_(1.0)
    if r == 0:
        comm.all_reduce(a, op="avg")
    else:
        comm.all_reduce(d, op="avg", register=True)
    assert torch.all((a if r == 0 else d) == expect), (a if r == 0 else d)[:3]
    assert d.data_ptr() == where and comm.symmetric_all_reduces == before
    # Two regions of this communicator, rank 0 passing one and the others the
    # other: both arrive unstaged with different tags, so all stage.
    e = torch.zeros(300_000)
    assert comm.register_tensor(e)
    a.fill_(float(r + 1))
    e.fill_(float(r + 1))
    comm.all_reduce(a if r == 0 else e, op="avg")
    assert torch.all((a if r == 0 else e) == expect), (a if r == 0 else e)[:3]
    assert comm.symmetric_all_reduces == before
    # Two communicators over the same ranks, each with its region number 1 of
    # the same size: rank 0 passes `comm`'s, the others `other`'s. Were the
    # region not checked to be `comm`'s own, the tags would match and rank 0
    # would read rank 1's `comm` region (which holds something else).
    other = comm.new_group(list(range(n)))
    c = torch.full((300_000,), -100.0)
    assert other.register_tensor(c)
    a.fill_(float(r))
    c.fill_(float(r))
    comm.all_reduce(a if r == 0 else c)  # rank 0: comm's region 1; others: other's
    mine = a if r == 0 else c
    assert torch.all(mine == sum(range(n))), mine[:3]
    assert comm.symmetric_all_reduces == before
    assert comm.is_registered(a) and not comm.is_registered(c) and other.is_registered(c)
    other.close()
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_mixed_registered_and_plain_take_the_staged_path(world_size):
    assert all(run_ranks(_mixed, world_size, "shm"))


def _one_rank_disabled(comm):
    import warnings

    t = torch.ones(4096)
    before = t.data_ptr()
    if comm.rank == 1:
        os.environ["PYCOMM_SHM_SYMMETRIC"] = "0"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = comm.register_tensor(t)
    finally:
        os.environ.pop("PYCOMM_SHM_SYMMETRIC", None)
    comm.all_reduce(t)
    assert torch.all(t == comm.world_size)
    return ok, t.data_ptr() == before, [str(w.message) for w in caught], _ours_any(comm)


def test_register_refused_by_one_rank_is_false_everywhere():
    per_rank = run_ranks(_one_rank_disabled, 2, "shm")
    for ok, unchanged, warned, left in per_rank:
        assert not ok and unchanged
        assert len(warned) == 1 and "rank 1" in warned[0] and "PYCOMM_SHM_SYMMETRIC=0" in warned[0]
        assert left == [], left


def _register_on_gloo(comm):
    try:
        comm.register_tensor(torch.ones(3))
    except ValueError as e:
        return str(e)
    return "no error"


def test_register_needs_shm():
    assert all("shm" in m for m in run_ranks(_register_on_gloo, 2, "gloo"))


def _names_after_register(comm):
    ts = [torch.ones(n) for n in (10, 100_000)]
    for t in ts:
        assert comm.register_tensor(t)
    comm.barrier()
    return _ours_any(comm)


def test_symmetric_names_unlinked_once_mapped():
    for left in run_ranks(_names_after_register, 2, "shm"):
        assert left == [], f"left in /dev/shm: {left}"


def _registers(comm):
    """all_reduce(register=True): the tensor moves only when every rank
    registers it; an async op returns after the move, so ops issued next see it."""
    n, r = comm.world_size, comm.rank
    t = torch.full((50_000,), float(r + 1))
    w = comm.all_reduce(t, async_op=True, register=True)
    moved_async = comm.is_registered(t)  # decided before the call returned
    b = comm.broadcast(t, src=0, async_op=True)  # issued on the new address
    w.wait()
    b.wait()
    assert torch.all(t == sum(range(1, n + 1))), t[:3]
    before = comm.symmetric_all_reduces
    comm.all_reduce(t)
    ran = comm.symmetric_all_reduces - before
    # Only rank 0 registers: nothing moves, every rank stages. Rank 0 then
    # remembers the refusal: when every rank registers next, it does not.
    u = torch.full((50_000,), float(r + 1))
    comm.all_reduce(u, register=r == 0)
    assert torch.all(u == sum(range(1, n + 1)))
    u.fill_(r + 1)
    comm.all_reduce(u, register=True)
    assert torch.all(u == sum(range(1, n + 1)))
    return moved_async, ran, comm.is_registered(u)


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_register_moves_when_every_rank_registers(world_size):
    for moved, ran, one_registered in run_ranks(_registers, world_size, "shm"):
        assert moved and ran == 1 and not one_registered


def _foreign_memory(comm):
    import warnings

    import numpy as np

    arr = np.ones(1000, dtype=np.float32)
    t = torch.from_numpy(arr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = comm.register_tensor(t)
    comm.all_reduce(t, register=True)  # registered, but may not move either
    arr[0] = 42.0  # still shared with numpy
    return ok, comm.is_registered(t), float(t[0]), [str(w.message) for w in caught]


def test_memory_torch_does_not_own_never_moves():
    for ok, registered, first, warned in run_ranks(_foreign_memory, 2, "shm"):
        assert not ok and not registered and first == 42.0
        assert len(warned) == 1 and "allocated by torch" in warned[0], warned


# ------------------------------------------------------------ faults

def _different_sizes(rank, world_size, port):
    import pycomm

    store = client_store(port, world_size)
    comm = pycomm.init(rank=rank, world_size=world_size, store=store, transport="shm",
                       timeout=COMM_TIMEOUT)
    try:
        comm.register_tensor(torch.ones(100 + rank))
        msg = "no error"
    except pycomm.CommError as e:
        msg = str(e)
    comm.close()
    return msg


def test_register_storages_of_different_sizes_raise():
    for msg in spawn_ranks(_different_sizes, 2):
        assert "register_tensor" in msg and "count differs" in msg, msg


def _kill_during_symmetric(rank, world_size, port, victim, during):
    import pycomm

    store = client_store(port, world_size)
    comm = pycomm.init(rank=rank, world_size=world_size, store=store, transport="shm",
                       timeout=COMM_TIMEOUT)
    store.set(f"pid/{rank}", str(os.getpid()))
    t = torch.ones(4 << 20)  # 16 MiB
    assert comm.register_tensor(t)
    if rank == victim:
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        for _ in range(100000):
            if during == "register":  # segments made and named again and again
                comm.register_tensor(torch.ones(1 << 16))
            else:
                comm.all_reduce(t, op="avg")
    except pycomm.CommError as e:
        return ("raised", str(e), time.monotonic() - start, int(store.get("pid/0")))
    return ("no error", "", time.monotonic() - start, 0)


@pytest.mark.parametrize("during", ["all_reduce", "register"])
@pytest.mark.parametrize("world_size,victim", [(2, 1), (3, 0)])
def test_peer_killed_during_symmetric_all_reduce(world_size, victim, during):
    assert_survivors_raised(spawn_ranks(_kill_during_symmetric, world_size, victim, during),
                            victim)
