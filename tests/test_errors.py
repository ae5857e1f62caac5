"""Bad input gets a clear Python exception naming the problem, on every rank,
and the communicator stays usable afterwards (nothing was sent)."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks

# (name, call(comm) -> None, expected exception, message fragment)
def _bad_calls(comm):
    import pycomm

    n, r = comm.world_size, comm.rank
    t = torch.ones(8)
    return [
        ("complex dtype", lambda: comm.all_reduce(torch.ones(4, dtype=torch.complex64)),
         TypeError, "unsupported dtype"),
        ("bool dtype", lambda: comm.all_reduce(torch.ones(4, dtype=torch.bool)),
         TypeError, "unsupported dtype"),
        ("not a tensor", lambda: comm.all_reduce([1.0, 2.0]), TypeError, ""),
        ("unknown op string", lambda: comm.all_reduce(t, op="median"), ValueError, "median"),
        ("unknown op int", lambda: comm.all_reduce(t, op=17), ValueError, "reduce op"),
        ("avg on int", lambda: comm.all_reduce(torch.ones(3, dtype=torch.int32), op="avg"),
         ValueError, "AVG"),
        ("unknown algo", lambda: comm.all_reduce(t, algo="tree"), ValueError, "unknown algo"),
        ("nccl algo on cpu", lambda: comm.all_reduce(t, algo="nccl"), ValueError, "CUDA"),
        ("non-contiguous", lambda: comm.all_reduce(torch.ones(4, 4).t()), ValueError,
         "contiguous"),
        ("wrong device", lambda: comm.all_reduce(torch.ones(4, device="meta")), ValueError,
         "meta"),
        ("broadcast src too big", lambda: comm.broadcast(t, src=n), ValueError, "out of range"),
        ("broadcast src negative", lambda: comm.broadcast(t, src=-1), ValueError, "out of range"),
        ("send to self", lambda: comm.send(t, r), ValueError, "this rank"),
        ("recv from out of range", lambda: comm.recv(t, n + 3), ValueError, "out of range"),
        ("isend dst out of range", lambda: comm.isend(t, -2), ValueError, "out of range"),
        ("p2p op name", lambda: comm.batch_isend_irecv([pycomm.P2POp("put", t, (r + 1) % n)]),
         ValueError, "isend"),
        ("p2p item type", lambda: comm.batch_isend_irecv([(t, 1)]), TypeError, "P2POp"),
        ("reduce_scatter size", lambda: comm.reduce_scatter(torch.empty(3), torch.empty(3 * n + 1)),
         ValueError, "world_size"),
        ("reduce_scatter dtype", lambda: comm.reduce_scatter(
            torch.empty(3), torch.empty(3 * n, dtype=torch.float64)), TypeError, "dtype"),
        ("all_gather size", lambda: comm.all_gather(torch.empty(2 * n + 1), torch.empty(2)),
         ValueError, "world_size"),
    ]


def _check_bad_inputs(comm):
    failures = []
    for name, call, exc, fragment in _bad_calls(comm):
        try:
            call()
        except exc as e:
            if fragment and fragment not in str(e):
                failures.append(f"{name}: message {str(e)!r} lacks {fragment!r}")
        except Exception as e:  # wrong type
            failures.append(f"{name}: expected {exc.__name__}, got {type(e).__name__}: {e}")
        else:
            failures.append(f"{name}: no exception")
    # the communicator is still healthy
    t = torch.ones(5)
    comm.all_reduce(t)
    assert torch.all(t == comm.world_size)
    return failures


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_input_raises_clear_errors(transport, world_size):
    failures = run_ranks(_check_bad_inputs, world_size, transport)
    assert failures == [[]] * world_size, failures


def test_init_argument_errors():
    import pycomm

    store = torch.distributed.HashStore()
    with pytest.raises(ValueError, match="rank=5 is out of range"):
        pycomm.init(rank=5, world_size=2, store=store)
    with pytest.raises(ValueError, match="world_size"):
        pycomm.init(rank=0, world_size=0, store=store)
    with pytest.raises(ValueError, match="unknown transport"):
        pycomm.init(rank=0, world_size=1, store=store, transport="carrier-pigeon")
    with pytest.raises(ValueError, match="needs rank= and world_size="):
        pycomm.init(store=store)
    with pytest.raises(ValueError, match="timeout"):
        pycomm.init(rank=0, world_size=1, store=store, timeout=-1.0)


def test_use_after_close_and_context_manager():
    import pycomm

    store = torch.distributed.HashStore()
    with pycomm.init(rank=0, world_size=1, store=store, transport="gloo") as comm:
        t = torch.ones(3)
        comm.all_reduce(t)
        assert pycomm.get_default() is comm
    assert comm.closed and not pycomm.is_initialized()
    with pytest.raises(RuntimeError, match="closed"):
        comm.all_reduce(torch.ones(3))
    with pytest.raises(RuntimeError, match="init"):
        pycomm.all_reduce(torch.ones(3))
    comm.close()  # idempotent


def test_single_rank_collectives_are_identity_or_copy():
    import pycomm

    with pycomm.init(rank=0, world_size=1, store=torch.distributed.HashStore()) as comm:
        t = torch.arange(5.0)
        comm.all_reduce(t, op="avg")
        assert torch.equal(t, torch.arange(5.0))
        out = torch.empty(5)
        comm.all_gather(out, t)
        assert torch.equal(out, t)
        comm.reduce_scatter(out, t, op="max")
        assert torch.equal(out, t)
        comm.broadcast(t, src=0)
        comm.barrier()
