"""Cross-memory all-reduce on the shm transport (PYCOMM_SHM_CMA=1,
csrc/core/cross_memory.h): a plain tensor of 1 MiB or more is reduced by
reading the peers' copies with process_vm_readv. Pinned here: the same bits
as the staged path (float64 references), on exactly the sizes it should run,
without moving the tensor; every rank stages when one rank did not opt in;
mismatched sizes raise before anything is read; a peer killed mid-op raises
"died" on the others and leaves nothing in /dev/shm; a registered tensor on
one rank makes every rank stage; a rank that may not read its peers makes
every rank stage, and each says why once."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from tests._dist import COMM_TIMEOUT, assert_survivors_raised, client_store, spawn_ranks
from tests.reference import DTYPES, LARGE_COUNT, assert_matches, digest, rank_input, reference

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shm")

THRESHOLD = 1 << 20  # kCrossMemoryMinBytes (csrc/core/direct.cc)


def _init(rank, world_size, port, cma: bool):
    import pycomm

    if cma:
        os.environ["PYCOMM_SHM_CMA"] = "1"
    else:
        os.environ.pop("PYCOMM_SHM_CMA", None)
    store = client_store(port, world_size)
    store.set(f"pid/{rank}", str(os.getpid()))
    return pycomm.init(rank=rank, world_size=world_size, store=store, transport="shm",
                       timeout=COMM_TIMEOUT)


def _cases():
    """(count, dtype, op): every dtype at LARGE_COUNT (1 MiB and more for
    every element size), every op on float32, and float32 counts on both
    sides of the threshold."""
    for dtype in DTYPES:
        yield LARGE_COUNT, dtype, "sum"
    for op in ("avg", "max", "min", "product"):
        yield LARGE_COUNT, torch.float32, op
    for count in (THRESHOLD // 4 - 1, THRESHOLD // 4, 3 * THRESHOLD // 4 + 5):
        yield count, torch.float32, "sum"


def _all_cases(rank, world_size, port, cma: bool):
    comm = _init(rank, world_size, port, cma)
    out = []
    for count, dtype, op in _cases():
        inputs = [rank_input(r, count, dtype, op) for r in range(world_size)]
        x = inputs[rank].clone()
        ptr, before = x.data_ptr(), comm.cross_memory_all_reduces
        comm.all_reduce(x, op=op)
        assert x.data_ptr() == ptr, "the all-reduce moved the tensor"
        assert_matches(x, reference(inputs, op), f"all_reduce {op} {dtype} count={count}")
        ran = comm.cross_memory_all_reduces - before
        big = count * x.element_size() >= THRESHOLD
        assert ran == (1 if cma and big else 0), (ran, count, dtype, op)
        out.append(digest(x))
    # Several in flight at once, each with its own address; a view that
    # starts inside its storage.
    base = torch.arange(3 * LARGE_COUNT, dtype=torch.float32) * (rank + 1)
    views = [base[k * LARGE_COUNT + 1:(k + 1) * LARGE_COUNT] for k in range(3)]
    works = [comm.all_reduce(v, async_op=True) for v in views]
    for w in works:
        w.wait()
    total = sum(range(1, world_size + 1))
    expect = torch.arange(3 * LARGE_COUNT, dtype=torch.float32) * total
    for k, v in enumerate(views):
        assert torch.equal(v, expect[k * LARGE_COUNT + 1:(k + 1) * LARGE_COUNT]), k
    assert torch.equal(base[::LARGE_COUNT], torch.arange(0, 3 * LARGE_COUNT, LARGE_COUNT,
                                                         dtype=torch.float32) * (rank + 1))
    comm.close()
    return out


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_cross_memory_same_bits_as_staged(world_size):
    cma = spawn_ranks(_all_cases, world_size, True)
    staged = spawn_ranks(_all_cases, world_size, False)
    for r in range(world_size):
        assert cma[r] == staged[r], f"rank {r}: cross-memory and staged results differ"
        assert cma[r] == cma[0], f"rank {r} differs from rank 0"


def _one_rank_without(rank, world_size, port):
    comm = _init(rank, world_size, port, cma=rank != 1)
    x = torch.full((LARGE_COUNT,), float(rank))
    for _ in range(2):
        comm.all_reduce(x)
        x.fill_(float(rank))
    comm.all_reduce(x)
    assert torch.all(x == sum(range(world_size)))
    n = comm.cross_memory_all_reduces
    comm.close()
    return n


def test_every_rank_stages_when_one_did_not_opt_in():
    assert spawn_ranks(_one_rank_without, 3) == [0, 0, 0]


def _forbid_process_vm_readv() -> None:
    """A seccomp filter on this thread and the threads it starts (pycomm's
    worker, started by init after it): process_vm_readv fails with EPERM,
    as where a container's profile forbids it (x86-64's syscall number)."""
    import ctypes

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                    ("k", ctypes.c_uint)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    nr_process_vm_readv, ret_errno, ret_allow, eperm = 310, 0x00050000, 0x7FFF0000, 1
    code = (Filter * 4)(Filter(0x20, 0, 0, 0),  # load seccomp_data.nr
                        Filter(0x15, 0, 1, nr_process_vm_readv),  # == ? next : skip one
                        Filter(0x06, 0, 0, ret_errno | eperm), Filter(0x06, 0, 0, ret_allow))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS, which a filter needs
    assert libc.prctl(22, 2, ctypes.byref(Program(4, code)), 0, 0) == 0  # SECCOMP_MODE_FILTER


def _refused(rank, world_size, port):
    """Rank 1 may not call process_vm_readv: every rank stages, right, and
    says why once (stderr, where torch's warnings from a worker thread go)."""
    import tempfile

    if rank == 1:
        _forbid_process_vm_readv()
    comm = _init(rank, world_size, port, cma=True)
    with tempfile.TemporaryFile() as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            for step in range(2):
                x = torch.full((LARGE_COUNT,), float(rank + step))
                comm.all_reduce(x)
                assert torch.all(x == sum(r + step for r in range(world_size))), (step, x[:3])
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        said = err.read().decode()
    n = comm.cross_memory_all_reduces
    comm.close()
    return n, said


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the filter names x86-64's syscall")
def test_a_refused_read_stages_everywhere_and_says_why_once():
    for rank, (n, said) in enumerate(spawn_ranks(_refused, 2)):
        assert n == 0, rank
        assert said.count("PYCOMM_SHM_CMA=1, but the ranks cannot read each other's memory") == 1, said
        why = ("rank 1 reading rank 0: process_vm_readv: Operation not permitted" if rank == 1
               else "rank 1 could not read a peer")
        assert why in said, said


def _registered_on_one_rank(rank, world_size, port):
    comm = _init(rank, world_size, port, cma=True)
    registered = torch.zeros(LARGE_COUNT)
    assert comm.register_tensor(registered)  # collective: every rank registers one
    x = registered if rank == 0 else torch.zeros(LARGE_COUNT)  # only rank 0 passes it
    for step in range(3):
        x.fill_(float(rank + 1 + step))
        comm.all_reduce(x)
        assert torch.all(x == sum(r + 1 + step for r in range(world_size))), (step, x[:3])
    # ...and both paths right after, with plain tensors on every rank
    y = torch.full((LARGE_COUNT,), 2.0)
    comm.all_reduce(y)
    assert torch.all(y == 2.0 * world_size)
    out = comm.cross_memory_all_reduces, comm.symmetric_all_reduces
    comm.close()
    return out


def test_a_registered_tensor_on_one_rank_stages_everywhere():
    assert spawn_ranks(_registered_on_one_rank, 2) == [(1, 0), (1, 0)]


def _different_sizes(rank, world_size, port):
    import pycomm

    comm = _init(rank, world_size, port, cma=True)
    comm.all_reduce(torch.ones(LARGE_COUNT))  # the probe, agreed
    try:
        comm.all_reduce(torch.ones(LARGE_COUNT + 1024 * rank))
        msg = "no error"
    except pycomm.CommError as e:
        msg = str(e)
    n = comm.cross_memory_all_reduces
    comm.close()
    return msg, n


def test_sizes_that_differ_raise_before_reading():
    for msg, n in spawn_ranks(_different_sizes, 2):
        assert "count differs" in msg, msg
        assert n == 1


def _kill_during(rank, world_size, port, victim):
    import pycomm

    comm = _init(rank, world_size, port, cma=True)
    t = torch.ones(4 << 20)  # 16 MiB
    comm.all_reduce(t)
    assert comm.cross_memory_all_reduces == 1
    if rank == victim:
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    pid0 = int(client_store(port, world_size).get("pid/0"))
    start = time.monotonic()
    try:
        for _ in range(100000):
            comm.all_reduce(t, op="avg")
    except pycomm.CommError as e:
        return "raised", str(e), time.monotonic() - start, pid0
    return "no error", "", time.monotonic() - start, pid0


@pytest.mark.parametrize("world_size,victim", [(2, 1), pytest.param(3, 0, marks=pytest.mark.slow)])
def test_peer_killed_during_cross_memory_all_reduce(world_size, victim):
    assert_survivors_raised(spawn_ranks(_kill_during, world_size, victim), victim)
