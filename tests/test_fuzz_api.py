"""API fuzz (hypothesis): random, often wrong, arguments to every
Communicator collective and to p2p, the same on every rank of a world of 1
to 3. Every call either works (every rank then agrees bitwise on its
outputs) or raises TypeError / ValueError / NotImplementedError / CommError
on every rank alike, with a message that names the call; after it, the
communicator still all-reduces correctly. No crash, no hang (a hung case
fails at run_ranks' timeout).

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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._dist import close_pools, run_ranks

ALLOWED = ("TypeError", "ValueError", "NotImplementedError", "CommError")
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
    """Makes the call; returns the outputs to compare across ranks."""
    a, b = _build(c["a"]), _build(c["b"])
    m, r, n = c["method"], comm.rank, comm.world_size
    root, opts = c["root"], {"async_op": c["async_op"]}
    n_list = n if c["n_list"] is None else c["n_list"]
    outs: list[Any] = [a]
    if m == "all_reduce":
        work = comm.all_reduce(a, op=c["op"], algo=c["algo"], **opts)
    elif m == "reduce_scatter":
        work = comm.reduce_scatter(a, b, op=c["op"], algo=c["algo"], **opts)
    elif m == "all_gather":
        work = comm.all_gather(a, b, algo=c["algo"], **opts)
    elif m == "broadcast":
        work = comm.broadcast(a, src=root, algo=c["algo"], **opts)
    elif m == "reduce":
        work = comm.reduce(a, dst=root, op=c["op"], **opts)
        outs = [a] if root == r else []
    elif m in ("gather", "scatter"):
        # The root's list matches the other tensor (world_size of them): a
        # wrong list on the root alone would be an error only the root sees.
        like = b if m == "gather" else a
        lst = _like(like, n) if root == r else None
        if m == "gather":
            work = comm.gather(lst, b, dst=root, **opts)
            outs = lst if isinstance(lst, list) else []
        else:
            work = comm.scatter(a, lst, src=root, **opts)
    elif m == "all_to_all":
        outs = _like(a, n_list)
        work = comm.all_to_all(outs, _like(b, n_list), **opts)
    elif m == "all_to_all_single":
        work = comm.all_to_all_single(a, b, c["splits"], c["splits"], **opts)
    else:  # p2p around the ring: send a to the next rank, receive b from the previous one
        if n == 1:
            return []
        works = [comm.isend(a, (r + 1) % n, tag=c["tag"]), comm.irecv(b, (r - 1) % n, tag=c["tag"])]
        for w in works:
            w.wait()
        return [b]
    if work is not None:
        work.wait()
    return outs if isinstance(outs, list) else []


def _fuzz_case(comm: Any, c: dict[str, Any]) -> tuple[str, str]:
    """One rank's outcome: ("ok", digest of outputs) or (exception type, message);
    then the communicator must still all-reduce correctly."""
    try:
        outs = _call(comm, c)
    except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
        outcome = (type(e).__name__, str(e))
    else:
        h = hashlib.sha1()
        for t in outs:
            h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        outcome = ("ok", h.hexdigest())
    if outcome[0] == "CommError":
        return outcome  # the communicator may be aborted: the test replaces it
    x = torch.ones(5)
    comm.all_reduce(x)
    assert torch.all(x == comm.world_size), f"communicator broken after {c}: {outcome}"
    return outcome


def _check(transport: str, world_size: int, c: dict[str, Any]) -> None:
    outcomes = run_ranks(_fuzz_case, world_size, transport, c)
    kinds = {o[0] for o in outcomes}
    assert len(kinds) == 1, f"ranks disagree on {c}: {outcomes}"
    kind, detail = outcomes[0]
    if kind == "CommError":
        close_pools()  # its communicators may be aborted: the next case gets fresh ranks
    if kind == "ok":
        if c["method"] in ("all_reduce", "all_gather", "broadcast"):
            assert len({o[1] for o in outcomes}) == 1, f"outputs differ across ranks: {c}"
        return
    assert kind in ALLOWED, f"{c} raised {kind}: {detail}"
    named = c["method"] if c["method"] != "p2p" else ("send", "recv")
    assert detail and any(w in detail for w in ([named] if isinstance(named, str) else named)) \
        or "reduce op" in detail or "datatype" in detail, f"{c}: message does not name the call: {detail}"


_fast = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
_slow = settings(max_examples=2000, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize("world_size", [1, 2, 3])
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
