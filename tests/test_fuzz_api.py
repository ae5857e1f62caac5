"""API fuzz (hypothesis): random, often wrong, arguments to every
collective and to p2p, the same on every rank of a world of 1 to 3, through
each of the three ways in: a Communicator's method, its module-level twin
(``pycomm.all_reduce``: the default communicator) and the torch.distributed
op on a ``"pycomm"`` process group. Every call either works (every rank then
agrees bitwise on its outputs) or raises TypeError / ValueError /
NotImplementedError / CommError on every rank alike, with a message that
names the call; after it, the communicator still all-reduces correctly. No
crash, no hang (a hung case fails at run_ranks' timeout).

Arguments are identical on every rank (a wrong size on one rank only is
checked mode's business, tests/test_misuse.py), and lists for rooted ops are
given only where torch.distributed wants them (on the root), so that every
error is one all ranks see.

The default run is short and reproducible (derandomize); ``-m slow`` runs
many more examples per world size.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._dist import close_pools, run_ranks

ALLOWED = ("TypeError", "ValueError", "NotImplementedError", "CommError")
APIS = ("method", "module", "c10d")
METHODS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather",
           "scatter", "all_to_all", "all_to_all_single", "p2p")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8", "bool",
          "complex64")
SHAPES = ((), (0,), (1,), (7,), (4, 3), "transposed")

# -- argument descriptions (picklable: built into objects on each rank) --------

tensor_specs = st.fixed_dictionaries({"dtype": st.sampled_from(DTYPES),
                                      "shape": st.sampled_from(SHAPES)})
not_tensors = st.sampled_from([("list", [1.0, 2.0]), ("numpy", None), ("int", 3), ("none", None),
                               ("str", "x")])
tensor_args = st.one_of(tensor_specs.map(lambda s: ("tensor", s)), not_tensors)
ops = st.sampled_from(["sum", "avg", "max", "min", "product", "median", "", 1, 17, -1, None, 2.5,
                       "torch.MAX"])
algos = st.sampled_from(["auto", "ring", "direct", "nccl", "recursive_doubling", "halving_doubling",
                        "tree", "bruck", "bogus", "", None, 3])
ranks = st.sampled_from([0, 1, 2, -1, 3, 99, "0", 1.5, None, True])
async_ops = st.sampled_from([False, True])


@st.composite
def calls(draw: Any) -> dict[str, Any]:
    method = draw(st.sampled_from(METHODS))
    return {
        "api": draw(st.sampled_from(APIS)),
        "method": method,
        "a": draw(tensor_args),
        "b": draw(tensor_args),
        "op": draw(ops),
        "algo": draw(algos),
        "root": draw(ranks),
        "async_op": draw(async_ops),
        "n_list": draw(st.sampled_from([None, 0, 1, 2, 3, 4])),  # list length (None: world)
        "splits": draw(st.sampled_from([None, [], [1], [1, 1], [0, 2, 1], [-1, 1, 0], ["a"], 2])),
        "tag": draw(st.sampled_from([0, 1, 7, -1])),
    }


def _build(arg: Any) -> Any:
    kind, spec = arg
    if kind == "list":
        return list(spec)
    if kind == "numpy":
        return np.ones(3, dtype=np.float32)
    if kind in ("int", "str", "none"):
        return spec
    dtype = getattr(torch, spec["dtype"])
    if spec["shape"] == "transposed":
        return torch.ones(4, 3, dtype=dtype).t()  # not contiguous
    return torch.ones(spec["shape"], dtype=dtype)


def _like(t: Any, n: int) -> Any:
    """A list of ``n`` tensors like ``t`` (ones), or ``t`` itself when it is
    not a tensor (then the call gets a wrong type where a list belongs)."""
    if not isinstance(t, torch.Tensor):
        return t
    return [torch.ones_like(t) for _ in range(n)]


def _call(comm: Any, c: dict[str, Any]) -> list[Any]:
    """Makes the call through the case's API; returns the outputs to compare
    across ranks."""
    a, b = _build(c["a"]), _build(c["b"])
    m, r, n = c["method"], comm.rank, comm.world_size
    root, opts = c["root"], {"async_op": c["async_op"]}
    if c["api"] == "c10d":
        _c10d_group(comm)
        api: Any = _C10dApi()
        # a root must be an int there: torch's own frontend compares it with
        # the group's ranks before any backend sees it
        root = root if isinstance(root, int) and 0 <= root < n else 0
    elif c["api"] == "module":
        import pycomm

        assert pycomm.get_default() is comm
        api = pycomm  # the module-level twins, on the default communicator
    else:
        api = comm
    n_list = n if c["n_list"] is None else c["n_list"]
    outs: list[Any] = [a]
    if m == "all_reduce":
        work = api.all_reduce(a, op=c["op"], algo=c["algo"], **opts)
    elif m == "reduce_scatter":
        work = api.reduce_scatter(a, b, op=c["op"], algo=c["algo"], **opts)
    elif m == "all_gather":
        work = api.all_gather(a, b, algo=c["algo"], **opts)
    elif m == "broadcast":
        work = api.broadcast(a, src=root, algo=c["algo"], **opts)
    elif m == "reduce":
        work = api.reduce(a, dst=root, op=c["op"], **opts)
        outs = [a] if root == r else []
    elif m in ("gather", "scatter"):
        # The root's list matches the other tensor (world_size of them): a
        # wrong list on the root alone would be an error only the root sees.
        like = b if m == "gather" else a
        lst = _like(like, n) if root == r else None
        if m == "gather":
            work = api.gather(lst, b, dst=root, **opts)
            outs = lst if isinstance(lst, list) else []
        else:
            work = api.scatter(a, lst, src=root, **opts)
    elif m == "all_to_all":
        outs = _like(a, n_list)
        work = api.all_to_all(outs, _like(b, n_list), **opts)
    elif m == "all_to_all_single":
        work = api.all_to_all_single(a, b, c["splits"], c["splits"], **opts)
    else:  # p2p around the ring: send a to the next rank, receive b from the previous one
        return _ring_p2p(api, a, b, r, n, c["tag"])
    if work is not None:
        work.wait()
    return outs if isinstance(outs, list) else []


class LeftPosted(Exception):
    """The isend was posted, then the irecv raised: the message is left for
    whichever receive comes next, as in torch.distributed (nothing cancels a
    posted send), so the case's ranks are not reused."""


def _ring_p2p(api: Any, a: Any, b: Any, r: int, n: int, tag: int) -> list[Any]:
    """isend ``a`` to the next rank, irecv ``b`` from the previous one, wait
    for both (``api``: a Communicator, the pycomm module or
    torch.distributed)."""
    if n == 1:
        return []
    send = api.isend(a, (r + 1) % n, tag=tag)
    try:
        recv = api.irecv(b, (r - 1) % n, tag=tag)
    except Exception as e:
        raise LeftPosted() from e
    send.wait()
    recv.wait()
    return [b]


# torch.distributed's ReduceOp for the fuzzed ops. torch's frontend rejects
# a value that is not a ReduceOp before any backend sees it, so the others
# become the ReduceOps a backend may lack (bitwise ones).
_C10D_OPS = {"sum": "SUM", "avg": "AVG", "max": "MAX", "min": "MIN", "product": "PRODUCT"}
_C10D_ODD_OPS = ("BAND", "BOR", "BXOR")


def _c10d_op(op: Any) -> Any:
    name = _C10D_OPS.get(op) if isinstance(op, str) else None
    return getattr(dist.ReduceOp, name or _C10D_ODD_OPS[len(repr(op)) % len(_C10D_ODD_OPS)])


def _c10d_group(comm: Any) -> None:
    """The default process group of this pool's ranks, on the pycomm backend
    over the pool's transport (made once per pool: rank 0's store port goes
    out over ``comm``)."""
    if dist.is_initialized():
        return
    import pycomm

    port = torch.zeros(1, dtype=torch.int64)
    if comm.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, comm.world_size, is_master=True,
                              wait_for_workers=False)
        port[0] = store.port
    comm.broadcast(port, src=0)
    if comm.rank != 0:
        store = dist.TCPStore("127.0.0.1", int(port[0]), comm.world_size, is_master=False)
    dist.init_process_group("pycomm", store=store, rank=comm.rank, world_size=comm.world_size,
                            pg_options=pycomm.backend.Options(transport=comm.transport))


class _C10dApi:
    """The torch.distributed ops on the default (pycomm) process group,
    called as Communicator's methods are (``algo`` has no c10d twin)."""

    isend, irecv, all_to_all, all_to_all_single = (
        staticmethod(dist.isend), staticmethod(dist.irecv), staticmethod(dist.all_to_all),
        staticmethod(dist.all_to_all_single))

    @staticmethod
    def all_reduce(t: Any, op: Any, algo: Any, async_op: bool) -> Any:
        return dist.all_reduce(t, op=_c10d_op(op), async_op=async_op)

    @staticmethod
    def reduce_scatter(out: Any, inp: Any, op: Any, algo: Any, async_op: bool) -> Any:
        return dist.reduce_scatter_tensor(out, inp, op=_c10d_op(op), async_op=async_op)

    @staticmethod
    def all_gather(out: Any, inp: Any, algo: Any, async_op: bool) -> Any:
        return dist.all_gather_into_tensor(out, inp, async_op=async_op)

    @staticmethod
    def broadcast(t: Any, src: int, algo: Any, async_op: bool) -> Any:
        return dist.broadcast(t, src=src, async_op=async_op)

    @staticmethod
    def reduce(t: Any, dst: int, op: Any, async_op: bool) -> Any:
        return dist.reduce(t, dst=dst, op=_c10d_op(op), async_op=async_op)

    @staticmethod
    def gather(lst: Any, t: Any, dst: int, async_op: bool) -> Any:
        return dist.gather(t, gather_list=lst, dst=dst, async_op=async_op)

    @staticmethod
    def scatter(t: Any, lst: Any, src: int, async_op: bool) -> Any:
        return dist.scatter(t, scatter_list=lst, src=src, async_op=async_op)


def _raised_by_torch_frontend(e: BaseException) -> bool:
    """Whether torch.distributed's Python frontend raised ``e`` itself (a
    ``raise`` statement in torch/distributed), before any backend saw the
    call. The backend's errors surface from the frontend's call into the
    process group, a line that is not a ``raise``."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or "torch/distributed/" not in tb.tb_frame.f_code.co_filename:
        return False
    import linecache

    line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).strip()
    return line.startswith("raise ")


def _fuzz_case(comm: Any, c: dict[str, Any]) -> tuple[str, str]:
    """One rank's outcome: ("ok", digest of outputs) or (exception type,
    message), the type prefixed "torch:" where torch's own frontend raised
    it (its messages are torch's), and "left-posted:" where a p2p case's
    send stays posted (LeftPosted); then the communicator (and the process
    group, once made) must still all-reduce correctly."""
    try:
        outs = _call(comm, c)
    except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
        err = e.__cause__ if isinstance(e, LeftPosted) else e
        frontend = c["api"] == "c10d" and _raised_by_torch_frontend(err)
        outcome = (("torch:" if frontend else "") + type(err).__name__, str(err))
        if isinstance(e, LeftPosted):
            outcome = ("left-posted:" + outcome[0], outcome[1])  # the test replaces these ranks
    else:
        h = hashlib.sha1()
        for t in outs:
            h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        outcome = ("ok", h.hexdigest())
    if outcome[0].endswith("CommError"):
        return outcome  # the communicator may be aborted: the test replaces it
    x = torch.ones(5)
    comm.all_reduce(x)
    assert torch.all(x == comm.world_size), f"communicator broken after {c}: {outcome}"
    if dist.is_initialized():
        dist.all_reduce(x)
        assert torch.all(x == comm.world_size**2), f"process group broken after {c}: {outcome}"
    return outcome


def _check(transport: str, world_size: int, c: dict[str, Any]) -> None:
    outcomes = run_ranks(_fuzz_case, world_size, transport, c)
    if any(o[0] == "CommError" or o[0].startswith("left-posted:") for o in outcomes):
        close_pools()  # aborted communicators or a send left posted: the next case gets fresh ranks
    # Where a rank's irecv raised only after its isend was posted is a matter of
    # timing (an abort by a peer reaches it before or after): not an outcome.
    kinds = {o[0].removeprefix("left-posted:") for o in outcomes}
    assert len(kinds) == 1, f"ranks disagree on {c}: {outcomes}"
    kind, detail = outcomes[0][0].removeprefix("left-posted:"), outcomes[0][1]
    if kind == "ok":
        if c["method"] in ("all_reduce", "all_gather", "broadcast"):
            assert len({o[1] for o in outcomes}) == 1, f"outputs differ across ranks: {c}"
        return
    if kind.startswith("torch:"):  # torch's frontend: its type is checked, its words are torch's
        assert kind[len("torch:"):] in ALLOWED, f"{c} raised {kind}: {detail}"
        return
    assert kind in ALLOWED, f"{c} raised {kind}: {detail}"
    assert _names_the_call(c, detail), f"{c}: message does not name the call: {detail}"


# How a message may name its call: the method, or its c10d op (the backend's
# names; torch's frontend names the parameter it rejects instead).
_C10D_NAMES = {"all_reduce": ("allreduce",), "reduce_scatter": ("reduce_scatter",),
               "all_gather": ("allgather", "all_gather"), "all_to_all": ("alltoall",),
               "all_to_all_single": ("alltoall_base", "all_to_all_single", "split")}


def _names_the_call(c: dict[str, Any], detail: str) -> bool:
    names = ("send", "recv") if c["method"] == "p2p" else (c["method"],)
    if c["api"] == "c10d":
        names += _C10D_NAMES.get(c["method"], ())
    return bool(detail) and (any(w in detail for w in names) or "reduce op" in detail
                             or "datatype" in detail)


_fast = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
_slow = settings(max_examples=2000, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# gloo on 3 ranks in the slow run: its aborting cases respawn 3 processes
# each (about 40 s), which the 40-minute CI run cannot spare
@pytest.mark.parametrize("transport,world_size", [
    ("shm", 1), ("shm", 2), ("shm", 3), ("gloo", 1), ("gloo", 2),
    pytest.param("gloo", 3, marks=pytest.mark.slow)])
@_fast
@given(c=calls())
def test_fuzz_api(transport, world_size, c):
    _check(transport, world_size, c)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3])
@_slow
@given(c=calls())
def test_fuzz_api_many(transport, world_size, c):
    _check(transport, world_size, c)
