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

from tests._dist import COMM_TIMEOUT, client_store, run_ranks, spawn_ranks
from tests.reference import assert_matches, digest, rank_input, reference
from tests.test_collectives import _cases

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shm")


def _ours(pid: int) -> list[str]:
    """Names under rank 0's pid: the segment and its symmetric parts
    (/pycomm-<pid>-...[.s<k>.<r>])."""
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"pycomm-{pid}-")]


def _ours_any() -> list[str]:
    """Symmetric parts of any pycomm segment."""
    return [f for f in os.listdir("/dev/shm") if f.startswith("pycomm-") and ".s" in f]


def _registered_cases(comm, register: bool):
    """Every (count, dtype, op) case of test_collectives, all-reduced from a
    registered tensor (or a plain one); digests of the results."""
    out = []
    for count, dtype, op in _cases(True):
        inputs = [rank_input(r, count, dtype, op) for r in range(comm.world_size)]
        t = inputs[comm.rank].clone()
        if register:
            assert comm.register_tensor(t) and comm.is_registered(t)
            assert torch.equal(t, inputs[comm.rank]), "registering changed the values"
        for _ in range(2):  # twice: the region is reused by the next op
            x = t if register else t.clone()
            x.copy_(inputs[comm.rank])
            comm.all_reduce(x, op=op)
            assert_matches(x, reference(inputs, op), f"all_reduce {op} {dtype} count={count}")
        out.append(digest(x))
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
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
    # A view of a registered tensor, and a clone, take the staged path.
    part = t[1:]
    comm.all_reduce(part)
    assert torch.equal(part, (torch.arange(1, 1000, dtype=torch.float32) * n + sum(range(n))))
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
    comm.all_reduce(t, op="avg")
    expect = sum(range(1, n + 1)) / n
    assert torch.all(t == expect), t[:3]
    # Two communicators over the same ranks: a tensor registered by one is
    # plain to the other (its region numbers mean nothing there).
    other = comm.new_group(list(range(n)))
    c = torch.full((5000,), float(r))
    assert other.register_tensor(c)
    a.fill_(float(r))
    comm.all_reduce(c)    # registered with `other`, reduced by `comm`: staged
    other.all_reduce(a)   # and the other way round
    assert torch.all(c == sum(range(n))) and torch.all(a == sum(range(n)))
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
    return ok, t.data_ptr() == before, [str(w.message) for w in caught], _ours_any()


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
    return _ours_any()


def test_symmetric_names_unlinked_once_mapped():
    for left in run_ranks(_names_after_register, 2, "shm"):
        assert left == [], f"left in /dev/shm: {left}"


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


def _kill_during_symmetric(rank, world_size, port, victim):
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
            comm.all_reduce(t, op="avg")
    except pycomm.CommError as e:
        return ("raised", str(e), time.monotonic() - start, int(store.get("pid/0")))
    return ("no error", "", time.monotonic() - start, 0)


@pytest.mark.parametrize("world_size,victim", [(2, 1), (3, 0)])
def test_peer_killed_during_symmetric_all_reduce(world_size, victim):
    res = spawn_ranks(_kill_during_symmetric, world_size, victim)
    for r, out in enumerate(res):
        if r == victim:
            continue
        status, msg, elapsed, pid0 = out
        assert status == "raised" and "died" in msg, out
        assert elapsed < 10, f"rank {r} took {elapsed:.1f} s to notice"
        assert _ours(pid0) == [], _ours(pid0)
