"""The classic algorithms (csrc/core/classic.cc): recursive doubling,
halving-doubling and the pipelined tree for all_reduce, Bruck for
all_gather. Every op x dtype x size against float64 references on 1 to 7
ranks (3, 5, 6, 7: the fold of a non-power-of-two world; 6 and 7 with -m
slow), bitwise identical
on every rank, on shm and gloo; the algorithm named where it cannot run; a
different algo across ranks is a CommError on every rank; the c10d backend
runs the one its Options name."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
import torch

from tests._dist import client_store, run_ranks, spawn_ranks
from tests.reference import assert_matches, digest, rank_input, reference
from tests.test_collectives import _all_gather_cases, _all_reduce_cases

CLASSIC = ["recursive_doubling", "halving_doubling", "tree"]


def _classic_all_reduce(comm, large: bool):
    """{algo: digests} of every case, after checking each against float64."""
    return {algo: _all_reduce_cases(comm, algo, large) for algo in CLASSIC}


def _same_bits_on_every_rank(per_rank):
    for r in range(1, len(per_rank)):
        for algo, digests in per_rank[0].items():
            assert per_rank[r][algo] == digests, f"{algo}: rank {r} differs from rank 0"


@pytest.mark.parametrize("world_size", [
    1, 2, 3, 4, 5, pytest.param(6, marks=pytest.mark.slow), pytest.param(7, marks=pytest.mark.slow)])
def test_classic_all_reduce_shm(world_size):
    # large sizes (many slices, the fold's hand-offs in slices) on 3 and 4 ranks
    per_rank = run_ranks(_classic_all_reduce, world_size, "shm", world_size in (3, 4),
                         timeout=600)
    _same_bits_on_every_rank(per_rank)


@pytest.mark.parametrize("world_size", [
    1, 2, 3, pytest.param(4, marks=pytest.mark.slow), 5,
    pytest.param(6, marks=pytest.mark.slow), pytest.param(7, marks=pytest.mark.slow)])
def test_classic_all_reduce_gloo(world_size):
    # 1: a world without a peer, as on shm
    per_rank = run_ranks(_classic_all_reduce, world_size, "gloo", world_size == 3, timeout=600)
    _same_bits_on_every_rank(per_rank)


@pytest.mark.parametrize("transport,world_size", [
    ("shm", 1), ("shm", 2), ("shm", 3), ("shm", 4), ("shm", 5), ("shm", 6),
    pytest.param("shm", 7, marks=pytest.mark.slow), ("gloo", 2), ("gloo", 3), ("gloo", 4),
    ("gloo", 5), pytest.param("gloo", 6, marks=pytest.mark.slow), ("gloo", 7)])
def test_bruck_all_gather(transport, world_size):
    # Bruck's last step moves fewer blocks than the one before unless n is
    # a power of two (3, 5, 6, 7); 2 and 4 are whole doublings.
    run_ranks(_all_gather_cases, world_size, transport, "bruck")


# Elements per rank, prime: a float64 / float32 block is 800 / 400 KB, larger
# than an shm slot (256 KiB at most), so each step's messages go through the
# channels' rings of slots in many pieces.
BRUCK_LARGE = 100_003


def _bruck_large_blocks(comm):
    """Digests of large Bruck all-gathers, each checked against the
    concatenation of every rank's input."""
    n, r = comm.world_size, comm.rank
    digests = []
    for dtype in [torch.float64, torch.float32, torch.bfloat16, torch.int8]:
        inputs = [rank_input(q, BRUCK_LARGE, dtype, "sum") for q in range(n)]
        out = torch.full((n * BRUCK_LARGE,), 7, dtype=dtype)
        comm.all_gather(out, inputs[r], algo="bruck")
        assert torch.equal(out, torch.cat(inputs)), f"bruck {dtype} m={BRUCK_LARGE}"
        digests.append(digest(out))
    return digests


@pytest.mark.parametrize("transport,world_size", [("shm", 5), ("gloo", 3)])
def test_bruck_all_gather_large_blocks(transport, world_size):
    """Blocks of BRUCK_LARGE elements (a partial last step on 3 and 5 ranks):
    every rank the same bytes, the reference's."""
    per_rank = run_ranks(_bruck_large_blocks, world_size, transport)
    assert all(d == per_rank[0] for d in per_rank[1:]), per_rank


def _slices_of_every_algorithm(comm):
    # Counts around multiples of a slice, so that the last slice of a run, a
    # halved run and a fold hand-off is short, empty or whole.
    per = comm._impl.slice_bytes // 4
    for algo in CLASSIC:
        for count in [per - 1, per, per + 1, 3 * per + 5, 8 * per]:
            inputs = [rank_input(r, count, torch.float32, "sum") for r in range(comm.world_size)]
            t = inputs[comm.rank].clone()
            comm.all_reduce(t, algo=algo)
            assert_matches(t, reference(inputs, "sum"), f"{algo} count={count}")


@pytest.mark.parametrize("world_size", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_slice_boundaries(world_size):
    run_ranks(_slices_of_every_algorithm, world_size, "shm")


def _usage_errors(comm):
    t = torch.ones(8)
    out = {}
    for name, call in [
        ("bruck all_reduce", lambda: comm.all_reduce(t, algo="bruck")),
        ("tree all_gather", lambda: comm.all_gather(torch.empty(8 * comm.world_size), t,
                                                    algo="tree")),
        ("tree broadcast", lambda: comm.broadcast(t, algo="halving_doubling")),
        ("wire", lambda: comm.all_reduce(t, algo="tree", wire_dtype=torch.bfloat16)),
        ("unknown", lambda: comm.all_reduce(t, algo="butterfly")),
    ]:
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    comm.all_reduce(t, algo="tree")  # still usable
    out["after"] = t.tolist()
    return out


def test_an_algorithm_a_collective_lacks_is_named():
    got = run_ranks(_usage_errors, 2, "shm")[0]
    assert "algo='bruck' is not implemented for all_reduce" in got["bruck all_reduce"]
    assert "'recursive_doubling', 'halving_doubling', 'tree'" in got["bruck all_reduce"]
    assert "algo='tree' is not implemented for all_gather" in got["tree all_gather"]
    assert "'bruck'" in got["tree all_gather"]
    assert "is not implemented for broadcast" in got["tree broadcast"]
    assert "wire_dtype needs algo='ring' or 'auto', not 'tree'" in got["wire"]
    assert "unknown algo 'butterfly'" in got["unknown"]
    assert got["after"] == [2.0] * 8


def all_reduce_error(rank, world_size, port, transport, kwargs, check=False):
    """Rank ``rank`` all-reduces 4096 ones with ``kwargs[rank % len(kwargs)]``
    on a fresh communicator: the error it raised ("Type: message"), or None."""
    import pycomm

    comm = pycomm.init(rank=rank, world_size=world_size, store=client_store(port, world_size),
                       transport=transport, timeout=timedelta(seconds=10), check=check)
    try:
        comm.all_reduce(torch.ones(4096), **kwargs[rank % len(kwargs)])
        return None
    except (pycomm.CommError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        comm.close()


def _with_algos(algos):
    return [{"algo": a} for a in algos]


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("algos", [("recursive_doubling", "tree"), ("halving_doubling", "ring"),
                                   ("tree", "recursive_doubling", "halving_doubling")])
def test_different_algo_across_ranks_raises_everywhere(transport, algos):
    errs = spawn_ranks(all_reduce_error, len(algos), transport, _with_algos(algos), timeout=120)
    assert all(isinstance(e, str) and e.startswith("CommError") for e in errs), errs
    if transport == "shm" or len(algos) == 2:
        # A rank that meets a message of another algorithm (or, on shm, sees
        # a blocked peer's op) names both; its peers may learn of it through
        # the abort. On gloo, three algorithms can wait on each other with no
        # message between them: then every rank times out (checked mode
        # names the difference, below).
        assert any("algo differs" in e for e in errs), errs


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_checked_mode_names_a_different_algo_on_every_rank(transport):
    algos = ("tree", "recursive_doubling", "halving_doubling")
    errs = spawn_ranks(all_reduce_error, 3, transport, _with_algos(algos), True, timeout=120)
    for e in errs:
        assert e.startswith("ValueError") and "tree" in e and "halving_doubling" in e, errs


def all_gather_error(rank, world_size, port, transport, algos):
    """Rank ``rank`` all-gathers 4096 ones per rank with
    ``algo=algos[rank % len(algos)]`` on a fresh communicator: the error it
    raised ("Type: message"), or None."""
    import pycomm

    comm = pycomm.init(rank=rank, world_size=world_size, store=client_store(port, world_size),
                       transport=transport, timeout=timedelta(seconds=10))
    try:
        comm.all_gather(torch.empty(4096 * world_size), torch.ones(4096),
                        algo=algos[rank % len(algos)])
        return None
    except (pycomm.CommError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        comm.close()


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_different_all_gather_algo_across_ranks_raises_everywhere(transport):
    """Bruck on rank 0, the ring on rank 1: the op header's algo differs, so
    no rank gathers the other's blocks in the wrong places, and the
    message names both algorithms."""
    errs = spawn_ranks(all_gather_error, 2, transport, ("bruck", "ring"), timeout=120)
    for e in errs:  # the rank that saw it says why, the other learns it through the abort
        assert isinstance(e, str) and e.startswith("CommError"), errs
        assert re.search(r"algo differs \((bruck on rank 0 vs ring on rank 1|"
                         r"ring on rank 1 vs bruck on rank 0)\)", e), errs


def _backend_classic(rank, world_size, port, algo):
    """In a fresh process: the default group of the c10d backend with
    ``Options(algo=algo)`` (shm, checked mode): float32 ``dist.all_reduce``
    against float64 (its digests), then the error of a call that rank 0
    makes through torch and the other ranks through the group's
    communicator with ``algo="ring"``: each side's fingerprint names its
    algorithm."""
    import torch.distributed as dist

    import pycomm
    from tests.test_backend import _init

    _init(rank, world_size, port,
          pg_options=pycomm.backend.Options(transport="shm", algo=algo, check=True))
    try:
        comm = pycomm.backend.get_communicator()
        digests = []
        for count in [0, 1, 13, 1031, 100_003]:
            for op in ["sum", "avg", "max"]:
                inputs = [rank_input(q, count, torch.float32, op) for q in range(world_size)]
                t = inputs[rank].clone()
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op.upper()))
                assert_matches(t, reference(inputs, op), f"{algo} {op} count={count}")
                digests.append(digest(t))
        t = torch.ones(64)
        try:
            if rank == 0:
                dist.all_reduce(t)
            else:
                comm.all_reduce(t, algo="ring")
            error = None
        except ValueError as e:  # checked mode: before any data moved, usable after
            error = str(e)
        t = torch.ones(64)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((64,), float(world_size)))
        return digests, error
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("algo", CLASSIC)
def test_backend_options_choose_a_classic_algorithm(algo, world_size):
    """``pycomm.backend.Options(algo=...)`` reaches the all-reduce: the
    result is the float64 reference's, the same bits on every rank, and
    checked mode's fingerprint of rank 0's ``dist.all_reduce`` (its op
    header) carries the algorithm (the communicator counts no algorithms:
    the fingerprint is where the one that ran shows)."""
    per_rank = spawn_ranks(_backend_classic, world_size, algo, timeout=120)
    assert all(d == per_rank[0][0] for d, _ in per_rank[1:]), "ranks differ"
    for r, (_, error) in enumerate(per_rank):
        assert error is not None, f"rank {r}: the different algo was not noticed"
        # rank 0's (torch's) fingerprint names the group's algorithm
        assert re.search(rf"rank 0: all_reduce #\d+ \([^)]*, algo={algo}\)", error), (r, error)
        assert re.search(r"rank 1: all_reduce #\d+ \([^)]*, algo=ring\)", error), (r, error)
