"""One small description per collective, like nccl-tests' ``src/<coll>.cu``:
how many bytes a size means, the bus-bandwidth factor, each rank's input,
the independently computed expected result, and how to run it through pycomm
or torch.distributed.

Input data: element ``i`` of rank ``r`` is a small integer (0..7; 1..2 for
prod) hashed from (r, i), so every dtype holds it exactly, sums of a few
ranks stay exact even in bf16, and a chunk written to the wrong place is
caught (the pattern does not repeat). The expected result is computed from
those integers in float64 (int64 for integer dtypes), then cast to the
benchmark dtype, and compared within a few ulps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

__all__ = [
    "Buffers",
    "SPECS",
    "CollSpec",
    "busbw_factor",
    "count_wrong",
    "expected_result",
    "make_buffers",
    "make_runner",
    "rank_values",
    "reduce_exact",
]


@dataclass(frozen=True)
class CollSpec:
    """What the harness needs to know about one collective.

    Attributes:
        name: sub-command name ("allreduce").
        title: nccl-tests' spelling ("AllReduce").
        placements: the placements measured, as ``in_place`` flags
            (False = out-of-place). pycomm's all_reduce and broadcast only
            exist in place, so they are measured in place only (out-of-place
            is printed "N/A" in the header note, not faked with a copy).
        reduces: takes a reduction op.
        rooted: has a root (broadcast); others print root -1.
    """

    name: str
    title: str
    placements: tuple[bool, ...]
    reduces: bool
    rooted: bool = False
    min_world: int = 1


SPECS: dict[str, CollSpec] = {
    "allreduce": CollSpec("allreduce", "AllReduce", (True,), reduces=True),
    "reducescatter": CollSpec("reducescatter", "ReduceScatter", (False, True), reduces=True),
    "allgather": CollSpec("allgather", "AllGather", (False, True), reduces=False),
    "broadcast": CollSpec("broadcast", "Broadcast", (True,), reduces=False, rooted=True),
    "sendrecv": CollSpec("sendrecv", "SendRecv", (False,), reduces=False, min_world=2),
}


def busbw_factor(collective: str, world_size: int) -> float:
    """busbw = algbw * factor (nccl-tests' doc/PERFORMANCE.md): the fraction
    of the data each rank's link must carry, so that busbw is comparable to
    the hardware's bandwidth whatever the world size.

    all-reduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n, broadcast and
    send/recv 1.
    """
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {n}")
    if collective == "allreduce":
        return 2.0 * (n - 1) / n
    if collective in ("reducescatter", "allgather"):
        return (n - 1) / n
    if collective in ("broadcast", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")


def counts(collective: str, nbytes: int, elem_size: int, world_size: int) -> tuple[int, int]:
    """(count, size_bytes) of one step of the sweep, as nccl-tests prints
    them: for reduce-scatter and all-gather ``count`` is per rank and
    ``size`` is the whole (world_size * count) buffer; otherwise ``size`` is
    ``count * elem_size``. ``nbytes`` is rounded down to whole elements (and
    whole per-rank chunks)."""
    elems = nbytes // elem_size
    if collective in ("reducescatter", "allgather"):
        per_rank = elems // world_size
        return per_rank, per_rank * world_size * elem_size
    return elems, elems * elem_size


# --------------------------------------------------------------- data + check

def rank_values(rank: int, count: int, op: str = "sum", offset: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input elements ``offset .. offset+count-1`` as exact
    int64 values: 0..7 (1..2 for prod, so products are powers of two)."""
    m = 0xFFFFFFFF
    h = (torch.arange(offset, offset + count, dtype=torch.int64) + (rank + 1) * 0x9E3779B9) & m
    # A 32-bit integer hash (multipliers < 2**31 so int64 products cannot overflow).
    h ^= h >> 16
    h = (h * 0x2C1B3C6D) & m
    h ^= h >> 15
    h = (h * 0x297A2D39) & m
    h ^= h >> 16
    h >>= 29
    if op == "prod":
        h = 1 + (h & 1)
    return h


def reduce_exact(op: str, parts: Sequence[torch.Tensor], floating: bool) -> torch.Tensor:
    """Reduces per-rank int64 values exactly: float64 for floating dtypes,
    int64 (wrapping like the dtype will, after the cast) for integers."""
    acc = parts[0].to(torch.float64 if floating else torch.int64).clone()
    for p in parts[1:]:
        p = p.to(acc.dtype)
        if op in ("sum", "avg"):
            acc += p
        elif op == "prod":
            acc *= p
        elif op == "max":
            torch.maximum(acc, p, out=acc)
        elif op == "min":
            torch.minimum(acc, p, out=acc)
        else:
            raise ValueError(f"unknown op {op!r}")
    if op == "avg":
        acc /= len(parts)
    return acc


def expected_result(collective: str, rank: int, world_size: int, count: int, dtype: torch.dtype,
                    op: str, root: int = 0) -> torch.Tensor:
    """What rank ``rank`` must hold after the collective, computed from the
    inputs alone (never from another rank's result), exact (float64/int64)."""
    n, fl = world_size, dtype.is_floating_point
    vals_op = op if collective in ("allreduce", "reducescatter") else "sum"
    if collective == "allreduce":
        return reduce_exact(op, [rank_values(r, count, vals_op) for r in range(n)], fl)
    if collective == "reducescatter":
        return reduce_exact(op, [rank_values(r, count, vals_op, offset=rank * count) for r in range(n)], fl)
    if collective == "allgather":
        return torch.cat([rank_values(r, count) for r in range(n)])
    if collective == "broadcast":
        return rank_values(root, count)
    if collective == "sendrecv":
        return rank_values((rank - 1) % n, count)
    raise ValueError(f"unknown collective {collective!r}")


def tolerance(dtype: torch.dtype) -> float:
    """Relative (and absolute) tolerance: 4 ulps of the dtype; 0 for integers."""
    return 4 * torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def count_wrong(result: torch.Tensor, expected: torch.Tensor) -> int:
    """Elements of ``result`` that differ from ``expected`` (exact values,
    cast to ``result``'s dtype first, so rounding and integer wrap-around
    match) beyond :func:`tolerance`. NaN counts as wrong."""
    res = result.detach().reshape(-1).cpu()
    if res.numel() != expected.numel():
        raise ValueError(f"result has {res.numel()} elements, expected {expected.numel()}")
    exp = expected.reshape(-1).to(res.dtype)
    if res.dtype.is_floating_point:
        tol = tolerance(res.dtype)
        ok = torch.isclose(res.double(), exp.double(), rtol=tol, atol=tol)
    else:
        ok = res == exp
    return int((~ok).sum())


def _sentinel(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(torch.iinfo(t.dtype).max)


# --------------------------------------------------------------- buffers

@dataclass
class Buffers:
    """The tensors of one (size, placement), shared by every algo.

    ``reset()`` restores the input (and poisons the output) before each
    iteration, outside the timed region, so each iteration sees the same data
    and the last one's result can be checked. ``tensors`` are the arguments
    of the collective; ``result`` is what gets checked."""

    tensors: dict[str, torch.Tensor]
    result: torch.Tensor
    reset: Callable[[], object]  # return value ignored (e.g. Tensor.copy_)


def make_buffers(collective: str, in_place: bool, rank: int, world_size: int, count: int,
                 dtype: torch.dtype, op: str, device: torch.device) -> Buffers:
    """Allocates and fills the buffers of one collective call.

    In-place follows nccl-tests: reduce-scatter's output is chunk ``rank`` of
    its input, all-gather's input is chunk ``rank`` of its output.
    """
    n = world_size
    vop = op if collective in ("allreduce", "reducescatter") else "sum"

    def values(cnt: int) -> torch.Tensor:
        return rank_values(rank, cnt, vop).to(dtype).to(device)

    if collective in ("allreduce", "broadcast"):
        pristine = values(count)
        buf = torch.empty_like(pristine)
        return Buffers({"tensor": buf}, buf, lambda: buf.copy_(pristine))
    if collective == "reducescatter":
        pristine = values(n * count)
        if in_place:
            big = torch.empty_like(pristine)
            out = big[rank * count:(rank + 1) * count]
            return Buffers({"output": out, "input": big}, out, lambda: big.copy_(pristine))
        out = torch.empty(count, dtype=dtype, device=device)
        return Buffers({"output": out, "input": pristine}, out, lambda: _sentinel(out))
    if collective == "allgather":
        pristine = values(count)
        out = torch.empty(n * count, dtype=dtype, device=device)
        if in_place:
            inp = out[rank * count:(rank + 1) * count]

            def reset() -> None:
                _sentinel(out)
                inp.copy_(pristine)

            return Buffers({"output": out, "input": inp}, out, reset)
        return Buffers({"output": out, "input": pristine}, out, lambda: _sentinel(out))
    if collective == "sendrecv":
        if in_place:
            raise ValueError("sendrecv is measured out-of-place only")
        send = values(count)
        recv = torch.empty_like(send)
        return Buffers({"send": send, "recv": recv}, recv, lambda: _sentinel(recv))
    raise ValueError(f"unknown collective {collective!r}")


# --------------------------------------------------------------- runners

_TORCH_OPS = {"sum": "SUM", "prod": "PRODUCT", "max": "MAX", "min": "MIN", "avg": "AVG"}


def make_runner(collective: str, algo: str, bufs: Buffers, *, comm: Any, rank: int,
                world_size: int, op: str, root: int) -> Callable[[], None]:
    """A no-argument function that runs the collective once, synchronously
    (for ``algo`` "torch": through torch.distributed's default group; else
    through the pycomm communicator with ``algo=algo``)."""
    t = bufs.tensors
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    if algo == "torch":
        import torch.distributed as dist

        top = getattr(dist.ReduceOp, _TORCH_OPS.get(op, "SUM"))
        if collective == "allreduce":
            return lambda: dist.all_reduce(t["tensor"], op=top)
        if collective == "reducescatter":
            rs = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
            return lambda: rs(t["output"], t["input"], op=top)
        if collective == "allgather":
            ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
            return lambda: ag(t["output"], t["input"])
        if collective == "broadcast":
            return lambda: dist.broadcast(t["tensor"], src=root)
        if collective == "sendrecv":
            def torch_sendrecv() -> None:
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t["send"], nxt),
                                               dist.P2POp(dist.irecv, t["recv"], prv)])
                for r in reqs:
                    r.wait()
            return torch_sendrecv
    else:
        import pycomm

        if collective == "allreduce":
            return lambda: comm.all_reduce(t["tensor"], op=op, algo=algo)
        if collective == "reducescatter":
            return lambda: comm.reduce_scatter(t["output"], t["input"], op=op, algo=algo)
        if collective == "allgather":
            return lambda: comm.all_gather(t["output"], t["input"], algo=algo)
        if collective == "broadcast":
            return lambda: comm.broadcast(t["tensor"], src=root, algo=algo)
        if collective == "sendrecv":
            if algo not in ("ring", "auto"):
                raise ValueError(f"sendrecv has no algo {algo!r} in pycomm (point to point)")

            def pycomm_sendrecv() -> None:
                works = comm.batch_isend_irecv([pycomm.P2POp("isend", t["send"], nxt),
                                                pycomm.P2POp("irecv", t["recv"], prv)])
                works[0].wait()
            return pycomm_sendrecv
    raise ValueError(f"unknown collective {collective!r}")
