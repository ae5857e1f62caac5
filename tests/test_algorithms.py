"""The classic algorithms (csrc/core/classic.cc): recursive doubling,
halving-doubling and the pipelined tree for all_reduce, Bruck for
all_gather. Every op x dtype x size against float64 references on 1 to 7
ranks (3, 5, 6, 7: the fold of a non-power-of-two world; 6 and 7 with -m
slow), bitwise identical
on every rank, on shm and gloo; the algorithm named where it cannot run; a
different algo across ranks is a CommError on every rank."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from tests._dist import client_store, run_ranks, spawn_ranks
from tests.reference import assert_matches, rank_input, reference
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
    2, 3, pytest.param(4, marks=pytest.mark.slow), 5,
    pytest.param(6, marks=pytest.mark.slow), pytest.param(7, marks=pytest.mark.slow)])
def test_classic_all_reduce_gloo(world_size):
    per_rank = run_ranks(_classic_all_reduce, world_size, "gloo", world_size == 3, timeout=600)
    _same_bits_on_every_rank(per_rank)


@pytest.mark.parametrize("transport,world_size", [
    ("shm", 1), ("shm", 2), ("shm", 3), ("shm", 4), ("shm", 5),
    pytest.param("shm", 7, marks=pytest.mark.slow), ("gloo", 3),
    pytest.param("gloo", 6, marks=pytest.mark.slow)])
def test_bruck_all_gather(transport, world_size):
    run_ranks(_all_gather_cases, world_size, transport, "bruck")


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
