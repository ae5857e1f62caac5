"""The shm transport: the direct (one-shot) all-reduce, dead-peer detection,
abort, and the lifetime of the shared-memory segment (nothing left in
/dev/shm, even while a communicator is alive)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests._dist import client_store, run_ranks, spawn_ranks, COMM_TIMEOUT
from tests.reference import SWEEP_WORLDS
from tests.test_collectives import _all_reduce_cases, _reduce_scatter_cases

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shm")


def _ours(pid: int) -> list[str]:
    """Segments named after rank 0's pid (pycomm/_setup.py: /pycomm-<pid>-...)."""
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"pycomm-{pid}-")]


@pytest.mark.parametrize("world_size", SWEEP_WORLDS[1:])
def test_direct_all_reduce_every_op_dtype_size(world_size):
    # large=True: float64 x 1M elements spans several pieces of the shared buffers
    per_rank = run_ranks(_all_reduce_cases, world_size, "shm", "direct", True)
    for r in range(1, world_size):
        assert per_rank[r] == per_rank[0], f"rank {r} differs from rank 0"


def _odd_geometry(rank, world_size, port, body):
    # 64 KiB pieces (the smallest that take the two-shot path on 3 ranks; the
    # large cases span over a hundred) and 3 buffers in rotation (not a power
    # of two): the buffer-reuse rule must hold for any rotation length. The
    # creator's geometry travels in the segment header.
    import pycomm

    os.environ.update(PYCOMM_SHM_DIRECT_BYTES="65536", PYCOMM_SHM_DIRECT_BUFFERS="3")
    store = client_store(port, world_size)
    comm = pycomm.init(rank=rank, world_size=world_size, store=store, transport="shm",
                       timeout=COMM_TIMEOUT)
    try:
        return body(comm)
    finally:
        comm.close()


def _direct_all_reduces(comm):
    return _all_reduce_cases(comm, "direct", True)


@pytest.mark.parametrize("world_size", [2, 3])
def test_direct_all_reduce_many_pieces_three_buffers(world_size):
    per_rank = spawn_ranks(_odd_geometry, world_size, _direct_all_reduces)
    for r in range(1, world_size):
        assert per_rank[r] == per_rank[0], f"rank {r} differs from rank 0"


def _direct_reduce_scatters(comm):
    _reduce_scatter_cases(comm, "direct", True)
    # "auto" is direct on shm: the same bits as "direct", in rank order
    n = comm.world_size
    x = torch.randn(n * 70_001, generator=torch.Generator().manual_seed(comm.rank))
    outs = [torch.empty(70_001) for _ in range(3)]
    for out, algo in zip(outs, ["direct", "auto", "ring"]):
        comm.reduce_scatter(out, x, algo=algo)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], outs[2])


@pytest.mark.parametrize("world_size", SWEEP_WORLDS[1:])
def test_direct_reduce_scatter(world_size):
    """Pieces of 64 KiB in 3 buffers: blocks span dozens of them."""
    spawn_ranks(_odd_geometry, world_size, _direct_reduce_scatters)


def _algo_mix(comm):
    # auto switches between direct and ring by size; ring/direct interleave
    # on one communicator, sync and async.
    out = []
    for i, count in enumerate([5, 70_000, 1_000_003, 3]):
        t = torch.full((count,), float(comm.rank + i))
        works = [comm.all_reduce(t.clone(), algo=a, async_op=True) for a in ("ring", "direct")]
        for w in works:
            w.wait()
        comm.all_reduce(t)
        expect = sum(r + i for r in range(comm.world_size))
        assert torch.all(t == expect), (count, t[:3])
        out.append(float(t[0]))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_and_direct_interleave(world_size):
    run_ranks(_algo_mix, world_size, "shm")


def _segment_names(comm):
    return os.getpid(), comm.transport, _ours(os.getpid())


def test_segment_unlinked_while_alive_and_auto_picks_shm():
    # Every rank has mapped it, so its name is gone already.
    res = run_ranks(_segment_names, 2, "auto")
    assert res[0][1] == "shm", "transport='auto' on one host should pick shm"
    assert res[0][2] == [], f"segment still in /dev/shm: {res[0][2]}"


def _new_shm_comm(rank, world_size, port):
    import pycomm

    pycomm.init(rank=rank, world_size=world_size, store=client_store(port, world_size),
                transport="shm", timeout=COMM_TIMEOUT).close()


def test_a_segment_whose_creator_is_gone_is_swept_at_the_next_setup():
    """A job SIGKILLed whole while setting up leaves its segment's name (the
    one window where a name exists); the next shm setup on the host removes
    the names whose creator is gone, and only those: not a live creator's,
    not another pid namespace's (whose pids mean other processes)."""
    from pycomm import _setup

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    ns = _setup._pid_namespace()
    names = {"orphan": f"pycomm-{gone.pid}-{ns}-1-0123456789ab",
             "live": f"pycomm-{os.getpid()}-{ns}-1-0123456789ab",
             "other_ns": f"pycomm-{gone.pid}-{ns + 1}-1-0123456789ab"}
    for name in names.values():
        with open(f"/dev/shm/{name}", "wb") as f:
            f.write(b"\0" * 64)
    try:
        # (a second test run sharing the machine may sweep the orphan first)
        assert not set(_setup.orphan_segments()) & {names["live"], names["other_ns"]}
        spawn_ranks(_new_shm_comm, 2)
        left = {k for k, n in names.items() if os.path.exists(f"/dev/shm/{n}")}
        assert left == {"live", "other_ns"}
    finally:
        for name in names.values():
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def _direct_on_gloo(comm):
    try:
        comm.all_reduce(torch.ones(3), algo="direct")
    except ValueError as e:
        return str(e)
    return "no error"


def test_direct_needs_shm():
    assert all("shm" in m for m in run_ranks(_direct_on_gloo, 2, "gloo"))


# ------------------------------------------------------------ faults

def _kill_one_mid_all_reduce(rank, world_size, port, victim):
    import pycomm

    store = client_store(port, world_size)
    comm = pycomm.init(rank=rank, world_size=world_size, store=store, transport="shm",
                       timeout=COMM_TIMEOUT)
    t = torch.ones(2 << 20)  # 8 MiB: many ring steps per all-reduce
    comm.all_reduce(t)
    store.set(f"pid/{rank}", str(os.getpid()))
    if rank == victim:
        # SIGKILL ourselves while the next all-reduces run
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        for _ in range(100000):
            comm.all_reduce(t)
            small = torch.ones(100)
            comm.all_reduce(small)  # direct algo: dies in arrive_and_wait too
    except pycomm.CommError as e:
        msg = str(e)
        # later calls fail fast as well
        try:
            comm.all_reduce(torch.ones(3))
            again = "no error"
        except pycomm.CommError as e2:
            again = str(e2)
        comm.close()
        return ("raised", msg, again, time.monotonic() - start, int(store.get("pid/0")))
    return ("no error", "", "", time.monotonic() - start, 0)


@pytest.mark.parametrize("world_size,victim", [(2, 1), (3, 1), (4, 3)])
def test_sigkill_mid_all_reduce_fails_every_survivor(world_size, victim):
    res = spawn_ranks(_kill_one_mid_all_reduce, world_size, victim)
    assert res[victim][0] == "died", res[victim]
    for r in range(world_size):
        if r == victim:
            continue
        status, msg, again, _elapsed, pid0 = res[r]
        assert status == "raised", f"rank {r}: {res[r]}"
        # detected as a death (or told by the survivor that saw it), not a timeout
        assert "died" in msg or "aborted" in msg, msg
        assert "timed out" not in msg, msg
        assert again != "no error"
    pid0 = res[0 if victim != 0 else 1][4]
    assert _ours(pid0) == []


def _abort_unblocks(rank, world_size, port):
    import pycomm

    store = client_store(port, world_size)
    comm = pycomm.init(rank=rank, world_size=world_size, store=store, transport="shm",
                       timeout=COMM_TIMEOUT)
    if rank == 0:
        # rank 1 never joins this all-reduce: abort from another thread
        threading.Timer(0.3, lambda: comm.abort("test abort")).start()
        try:
            comm.all_reduce(torch.ones(1000))
            return "no error"
        except pycomm.CommError as e:
            store.set("aborted", "1")
            return str(e)
    store.wait(["aborted"])
    try:
        comm.all_reduce(torch.ones(1000))  # the peer aborted: fails fast
        return "no error"
    except pycomm.CommError as e:
        return str(e)


def test_abort_fails_pending_and_peer_waits_fast():
    res = spawn_ranks(_abort_unblocks, 2)
    assert "abort" in res[0], res
    assert "abort" in res[1], res


def _mismatched_sizes(rank, world_size, port):
    import pycomm

    store = client_store(port, world_size)
    comm = pycomm.init(rank=rank, world_size=world_size, store=store, transport="shm",
                       timeout=COMM_TIMEOUT)
    a = torch.ones(1000 if rank == 0 else 2000)
    try:
        comm.send(a, 1) if rank == 0 else comm.recv(a, 0)
        return "no error"
    except pycomm.CommError as e:
        return str(e)


def test_mismatched_message_sizes_raise():
    res = spawn_ranks(_mismatched_sizes, 2)
    assert "expected a message of 8000 bytes" in res[1], res
