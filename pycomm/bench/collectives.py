"""One small object per collective, like nccl-tests' ``src/<coll>.cu``:
how many bytes a size means, the bus-bandwidth factor, each rank's buffers,
the independently computed expected result, and how to run it through pycomm
or torch.distributed. Adding a collective is one :class:`Collective`
subclass and one entry in :data:`SPECS` (and a ``cli.COLLECTIVES`` name
follows from it).

Input data: element ``i`` of rank ``r`` is a small integer (0..7; 1..2 for
prod) hashed from (r, i), so every dtype holds it exactly, sums of a few
ranks stay exact even in bf16, and a chunk written to the wrong place is
caught (the pattern does not repeat). The expected result is computed from
those integers in float64 (int64 for integer dtypes), then cast to the
benchmark dtype, and compared within a few ulps.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..comm import P2POp

__all__ = [
    "Buffers",
    "Call",
    "Collective",
    "SPECS",
    "busbw_factor",
    "count_wrong",
    "counts",
    "expected_result",
    "get_collective",
    "make_buffers",
    "make_runner",
    "rank_values",
    "reduce_exact",
]


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


def tolerance(dtype: torch.dtype) -> float:
    """Relative (and absolute) tolerance: 4 ulps of the dtype; 0 for integers."""
    return 4 * torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def count_wrong(result: torch.Tensor, expected: torch.Tensor, atol: float = 0.0) -> int:
    """Elements of ``result`` that differ from ``expected`` (exact values,
    cast to ``result``'s dtype first, so rounding and integer wrap-around
    match) beyond :func:`tolerance`, or beyond ``atol`` where that is larger
    (a quantized wire's bound, :func:`wire_atol`). NaN counts as wrong."""
    res = result.detach().reshape(-1).cpu()
    if res.numel() != expected.numel():
        raise ValueError(f"result has {res.numel()} elements, expected {expected.numel()}")
    exp = expected.reshape(-1).to(res.dtype)
    if res.dtype.is_floating_point:
        tol = tolerance(res.dtype)
        ok = torch.isclose(res.double(), exp.double(), rtol=tol, atol=max(tol, atol))
    else:
        ok = res == exp
    return int((~ok).sum())


#: ``--wire`` series: all_reduce(wire_dtype=...) of float32, one name per
#: wire, with the largest rounding of one quantization relative to its
#: block's largest magnitude (int8: half a step of absmax / 127; fp8: half
#: an ulp of the largest binade, 3 and 2 mantissa bits; bf16: 7). ``bf16``: the
#: bf16 hook's way (a bfloat16 copy all-reduced, every partial sum rounded too).
WIRES = {"int8": 1 / 254, "fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3, "bf16": 2.0 ** -8}
#: The elements per scale of the ``--wire`` series (all_reduce's default).
WIRE_BLOCK = 256


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up, for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def wire_of(algo: str) -> str | None:
    """The wire of a ``--wire`` series name ("wire_int8" -> "int8"), or None."""
    name = algo[len("wire_"):] if algo.startswith("wire_") else None
    return name if name in WIRES else None


def wire_atol(wire: str, inputs: Sequence[torch.Tensor], expected: torch.Tensor) -> float:
    """How far a quantized all-reduce may land from the exact result: each
    contribution is rounded once (at most its largest magnitude times the
    wire's relative step) and the sum once more; 1 % over, for float32's own
    rounding of the scales; bf16 rounds the n - 1 partial sums too."""
    most = sum(float(t.abs().max()) for t in inputs if t.numel())
    if wire == "bf16":
        most *= len(inputs)
    most += float(expected.abs().max()) if expected.numel() else 0.0
    return 1.01 * WIRES[wire] * most


def sent_bytes(algo: str, count: int, elem_size: int, world_size: int) -> int | None:
    """Bytes one rank sends in one all-reduce of ``count`` elements: the
    ring's 2 (n - 1) chunks, or a ``--wire`` series' quantized chunks (each
    whole blocks, 1 byte an element and a float32 scale a block) out in the
    all-to-all and its own chunk to the n - 1 others in the all-gather
    (rank 0's, whose chunk is never short). None for the other algos."""
    n = world_size
    if n == 1:
        return 0
    if algo == "ring":
        return 2 * (n - 1) * ceil_div(count, n) * elem_size
    if wire_of(algo) in (None, "bf16"):  # bf16: auto's choice, not only the ring
        return None
    per = ceil_div(ceil_div(count, WIRE_BLOCK), n) * WIRE_BLOCK

    def quantized(length: int) -> int:
        return length + 4 * ceil_div(length, WIRE_BLOCK)

    lengths = [max(0, min(count, (j + 1) * per) - min(count, j * per)) for j in range(n)]
    return sum(quantized(x) for x in lengths[1:]) + (n - 1) * quantized(lengths[0])


def _sentinel(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(torch.iinfo(t.dtype).max)


# --------------------------------------------------------------- buffers

#: A call's tensors by argument name ("tensor", "input", "output", "send", ...).
Tensors = dict[str, torch.Tensor]
#: One synchronous call of a collective.
Run = Callable[[], None]


@dataclass
class Buffers:
    """The tensors of one (size, placement), shared by every algo.

    ``reset()`` restores the input (and poisons the output) before each
    iteration, outside the timed region, so each iteration sees the same data
    and the last one's result can be checked. ``tensors`` are the arguments
    of the collective; ``result`` is what gets checked."""

    tensors: Tensors
    result: torch.Tensor
    reset: Callable[[], object]  # return value ignored (e.g. Tensor.copy_)


def _poisoned(tensors: Tensors, result: str) -> Buffers:
    """Out-of-place buffers: reset() only poisons ``tensors[result]`` (the
    input is never written)."""
    out = tensors[result]
    return Buffers(tensors, out, lambda: _sentinel(out))


def _in_place(pristine: torch.Tensor) -> Buffers:
    """One tensor that is both input and result; reset() restores the input."""
    buf = torch.empty_like(pristine)
    return Buffers({"tensor": buf}, buf, lambda: buf.copy_(pristine))


# --------------------------------------------------------------- one rank's call

@dataclass(frozen=True)
class Call:
    """What one rank measures, the same for every size of a sweep.

    ``op`` is the canonical reduction ("sum", "prod", "max", "min", "avg"),
    or "none" for a collective that does not reduce; ``root`` the root rank
    of a rooted collective (0 otherwise)."""

    rank: int
    world_size: int
    dtype: torch.dtype
    op: str = "sum"
    root: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.world_size

    def exact(self, op: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """:func:`reduce_exact` of ``parts`` for this call's dtype."""
        return reduce_exact(op, parts, self.dtype.is_floating_point)

    def torch_op(self) -> Any:
        """This call's reduction as a ``torch.distributed.ReduceOp``."""
        return getattr(dist.ReduceOp, _TORCH_OPS.get(self.op, "SUM"))


_TORCH_OPS = {"sum": "SUM", "prod": "PRODUCT", "max": "MAX", "min": "MIN", "avg": "AVG"}


# --------------------------------------------------------------- the collectives

class Collective:
    """One collective as the harness sees it (nccl-tests' ``testColl``: one
    small object per collective fills these hooks; the harness, runner.py,
    does the rest: sweep, timing, checking, table).

    Attributes:
        name: sub-command name ("allreduce").
        title: nccl-tests' spelling ("AllReduce").
        placements: the placements measured, as ``in_place`` flags
            (False = out-of-place). pycomm's all_reduce and broadcast only
            exist in place, so they are measured in place only (out-of-place
            is printed "N/A" in the header note, not faked with a copy).
        reduces: takes a reduction op (the others print op "none").
        rooted: has a root (broadcast); others print root -1.
        min_world: the fewest ranks it can run on.
        algos: pycomm's algorithms for it besides "auto" (``--algo all``
            measures these, "auto" and "torch").
    """

    name: str = ""
    title: str = ""
    placements: tuple[bool, ...] = (True,)
    reduces: bool = False
    rooted: bool = False
    min_world: int = 1
    algos: tuple[str, ...] = ("ring",)

    def bus_factor(self, world_size: int) -> float:
        """busbw = algbw * this (see :func:`busbw_factor`)."""
        raise NotImplementedError

    def counts(self, nbytes: int, elem_size: int, world_size: int) -> tuple[int, int]:
        """(count, size in bytes) of ``nbytes`` (rounded down to whole
        elements), as nccl-tests prints them."""
        elems = nbytes // elem_size
        return elems, elems * elem_size

    def inputs(self, c: Call, count: int, rank: int | None = None,
               offset: int = 0) -> torch.Tensor:
        """Rank ``rank``'s (default: this rank's) input values as exact
        int64 (:func:`rank_values`; the op's pattern if it reduces)."""
        op = c.op if self.reduces else "sum"
        return rank_values(c.rank if rank is None else rank, count, op, offset)

    def expected(self, c: Call, count: int) -> torch.Tensor:
        """What rank ``c.rank`` must hold afterwards, computed from the inputs
        alone (never from another rank's result), exact (float64/int64)."""
        raise NotImplementedError

    def buffers(self, c: Call, count: int, in_place: bool) -> Buffers:
        """Allocates and fills this rank's buffers of one call."""
        raise NotImplementedError

    def pycomm_runner(self, comm: Any, t: Tensors, c: Call, algo: str) -> Run:
        """One synchronous call through the pycomm communicator."""
        raise NotImplementedError

    def torch_runner(self, t: Tensors, c: Call) -> Run:
        """One synchronous call through torch.distributed's default group."""
        raise NotImplementedError

    def _values(self, c: Call, count: int) -> torch.Tensor:
        """This rank's input, in the call's dtype on its device."""
        return self.inputs(c, count).to(c.dtype).to(c.device)


class _Chunked(Collective):
    """Reduce-scatter and all-gather: each rank owns one of world_size chunks.
    ``count`` is per rank, ``size`` the whole (world_size * count) buffer, as
    in nccl-tests; a rank's link carries the other ranks' chunks."""

    def bus_factor(self, world_size: int) -> float:
        return (world_size - 1) / world_size

    def counts(self, nbytes: int, elem_size: int, world_size: int) -> tuple[int, int]:
        per_rank = nbytes // elem_size // world_size
        return per_rank, per_rank * world_size * elem_size


class _InPlace(Collective):
    """All-reduce and broadcast: one tensor, input and result (pycomm's op
    exists in place only)."""

    def buffers(self, c: Call, count: int, in_place: bool) -> Buffers:
        return _in_place(self._values(c, count))


class AllReduce(_InPlace):
    name = "allreduce"
    title = "AllReduce"
    reduces = True
    algos = ("ring", "recursive_doubling", "halving_doubling", "tree")

    def bus_factor(self, world_size: int) -> float:
        return 2.0 * (world_size - 1) / world_size

    def expected(self, c: Call, count: int) -> torch.Tensor:
        return c.exact(c.op, [self.inputs(c, count, r) for r in range(c.world_size)])


    def pycomm_runner(self, comm: Any, t: Tensors, c: Call, algo: str) -> Run:
        if algo == "symmetric":
            return SymmetricRun(comm, t["tensor"], c.op)
        wire = wire_of(algo)
        if wire == "bf16":
            return lambda: _bf16_all_reduce(comm, t["tensor"], c.op)
        if wire is not None:
            return lambda: comm.all_reduce(t["tensor"], op=c.op, wire_dtype=wire,
                                           wire_block=WIRE_BLOCK)
        return lambda: comm.all_reduce(t["tensor"], op=c.op, algo=algo)

    def torch_runner(self, t: Tensors, c: Call) -> Run:
        op = c.torch_op()
        return lambda: dist.all_reduce(t["tensor"], op=op)


def _bf16_all_reduce(comm: Any, tensor: torch.Tensor, op: str) -> None:
    """The ``bf16`` series: what hooks.bf16_compress_hook does with a bucket."""
    half = tensor.to(torch.bfloat16)
    comm.all_reduce(half, op=op)
    tensor.copy_(half)


class SymmetricRun:
    """Algo ``symmetric``: the all-reduce of a tensor registered before
    timing (``Communicator.register_tensor``: its storage moves into
    symmetric memory, so every call reduces straight from the ranks'
    tensors, with no staging). Its buffers must be its own (the registration
    moves their storage). :meth:`all_symmetric` says whether every call so
    far ran from symmetric memory: the study reports the series only then."""

    def __init__(self, comm: Any, tensor: torch.Tensor, op: str) -> None:
        if comm.transport != "shm":
            raise ValueError(f"symmetric memory needs the shm transport, not {comm.transport!r}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reason is raised below instead
            if not comm.register_tensor(tensor):
                raise ValueError("register_tensor declined (no symmetric memory on this host)")
        self._comm, self._tensor, self._op = comm, tensor, op
        self._start, self._calls = comm.symmetric_all_reduces, 0

    def __call__(self) -> None:
        self._comm.all_reduce(self._tensor, op=self._op)
        self._calls += 1

    def all_symmetric(self) -> bool:
        return self._comm.symmetric_all_reduces - self._start == self._calls


class ReduceScatter(_Chunked):
    name = "reducescatter"
    title = "ReduceScatter"
    placements = (False, True)
    reduces = True

    def expected(self, c: Call, count: int) -> torch.Tensor:
        return c.exact(c.op, [self.inputs(c, count, r, offset=c.rank * count)
                              for r in range(c.world_size)])

    def buffers(self, c: Call, count: int, in_place: bool) -> Buffers:
        """In place, as in nccl-tests: the output is chunk ``rank`` of the input."""
        pristine = self._values(c, c.world_size * count)
        if in_place:
            big = torch.empty_like(pristine)
            out = big[c.rank * count:(c.rank + 1) * count]
            return Buffers({"output": out, "input": big}, out, lambda: big.copy_(pristine))
        out = torch.empty(count, dtype=c.dtype, device=c.device)
        return _poisoned({"output": out, "input": pristine}, "output")

    def pycomm_runner(self, comm: Any, t: Tensors, c: Call, algo: str) -> Run:
        return lambda: comm.reduce_scatter(t["output"], t["input"], op=c.op, algo=algo)

    def torch_runner(self, t: Tensors, c: Call) -> Run:
        rs = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        op = c.torch_op()
        return lambda: rs(t["output"], t["input"], op=op)


class AllGather(_Chunked):
    name = "allgather"
    algos = ("ring", "bruck")
    title = "AllGather"
    placements = (False, True)

    def expected(self, c: Call, count: int) -> torch.Tensor:
        return torch.cat([self.inputs(c, count, r) for r in range(c.world_size)])

    def buffers(self, c: Call, count: int, in_place: bool) -> Buffers:
        """In place, as in nccl-tests: the input is chunk ``rank`` of the output."""
        pristine = self._values(c, count)
        out = torch.empty(c.world_size * count, dtype=c.dtype, device=c.device)
        if not in_place:
            return _poisoned({"output": out, "input": pristine}, "output")
        inp = out[c.rank * count:(c.rank + 1) * count]

        def reset() -> None:
            _sentinel(out)
            inp.copy_(pristine)

        return Buffers({"output": out, "input": inp}, out, reset)

    def pycomm_runner(self, comm: Any, t: Tensors, c: Call, algo: str) -> Run:
        return lambda: comm.all_gather(t["output"], t["input"], algo=algo)

    def torch_runner(self, t: Tensors, c: Call) -> Run:
        ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        return lambda: ag(t["output"], t["input"])


class Broadcast(_InPlace):
    name = "broadcast"
    title = "Broadcast"
    rooted = True

    def bus_factor(self, world_size: int) -> float:
        return 1.0

    def expected(self, c: Call, count: int) -> torch.Tensor:
        return self.inputs(c, count, c.root)


    def pycomm_runner(self, comm: Any, t: Tensors, c: Call, algo: str) -> Run:
        return lambda: comm.broadcast(t["tensor"], src=c.root, algo=algo)

    def torch_runner(self, t: Tensors, c: Call) -> Run:
        return lambda: dist.broadcast(t["tensor"], src=c.root)


class SendRecv(Collective):
    """Each rank sends to the next and receives from the previous one."""

    name = "sendrecv"
    title = "SendRecv"
    placements = (False,)
    min_world = 2

    def bus_factor(self, world_size: int) -> float:
        return 1.0

    def expected(self, c: Call, count: int) -> torch.Tensor:
        return self.inputs(c, count, c.prev_rank)

    def buffers(self, c: Call, count: int, in_place: bool) -> Buffers:
        if in_place:
            raise ValueError("sendrecv is measured out-of-place only")
        send = self._values(c, count)
        return _poisoned({"send": send, "recv": torch.empty_like(send)}, "recv")

    def pycomm_runner(self, comm: Any, t: Tensors, c: Call, algo: str) -> Run:
        if algo not in ("ring", "auto"):
            raise ValueError(f"sendrecv has no algo {algo!r} in pycomm (point to point)")
        ops = [P2POp("isend", t["send"], c.next_rank), P2POp("irecv", t["recv"], c.prev_rank)]
        return lambda: comm.batch_isend_irecv(ops)[0].wait()

    def torch_runner(self, t: Tensors, c: Call) -> Run:
        def torch_sendrecv() -> None:
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t["send"], c.next_rank),
                                           dist.P2POp(dist.irecv, t["recv"], c.prev_rank)])
            for r in reqs:
                r.wait()
        return torch_sendrecv


def _root_only(c: Call, result: torch.Tensor) -> torch.Tensor:
    """What a rooted collective's non-root ranks check: nothing (an empty
    view), as nccl-tests checks only the root's buffer."""
    return result if c.rank == c.root else result[:0]


def _nothing() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


class Reduce(_InPlace):
    """In place, as pycomm's reduce; only the root's result is checked."""

    name = "reduce"
    title = "Reduce"
    reduces = True
    rooted = True

    def bus_factor(self, world_size: int) -> float:
        return 1.0

    def expected(self, c: Call, count: int) -> torch.Tensor:
        if c.rank != c.root:
            return _nothing()
        return c.exact(c.op, [self.inputs(c, count, r) for r in range(c.world_size)])

    def buffers(self, c: Call, count: int, in_place: bool) -> Buffers:
        b = _in_place(self._values(c, count))
        return Buffers(b.tensors, _root_only(c, b.result), b.reset)

    def pycomm_runner(self, comm: Any, t: Tensors, c: Call, algo: str) -> Run:
        _no_algo(self, algo)
        return lambda: comm.reduce(t["tensor"], c.root, c.op)

    def torch_runner(self, t: Tensors, c: Call) -> Run:
        op = c.torch_op()
        return lambda: dist.reduce(t["tensor"], dst=c.root, op=op)


def _no_algo(coll: Collective, algo: str) -> None:
    if algo not in ("ring", "auto"):
        raise ValueError(f"{coll.name} has no algo {algo!r} in pycomm (one algorithm)")


def _blocks(buf: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(buf.chunk(n)) if buf.numel() else [buf] * n


class Gather(_Chunked):
    """The root receives every rank's ``count`` elements into one buffer of
    world_size blocks (a list of views, torch's API)."""

    name = "gather"
    title = "Gather"
    placements = (False,)
    rooted = True

    def expected(self, c: Call, count: int) -> torch.Tensor:
        if c.rank != c.root:
            return _nothing()
        return torch.cat([self.inputs(c, count, r) for r in range(c.world_size)])

    def buffers(self, c: Call, count: int, in_place: bool) -> Buffers:
        inp = self._values(c, count)
        out = torch.empty(c.world_size * count, dtype=c.dtype, device=c.device)
        b = _poisoned({"input": inp, "output": out}, "output")
        return Buffers(b.tensors, _root_only(c, out), b.reset)

    def _outs(self, t: Tensors, c: Call) -> list[torch.Tensor] | None:
        return _blocks(t["output"], c.world_size) if c.rank == c.root else None

    def pycomm_runner(self, comm: Any, t: Tensors, c: Call, algo: str) -> Run:
        _no_algo(self, algo)
        outs = self._outs(t, c)
        return lambda: comm.gather(outs, t["input"], c.root)

    def torch_runner(self, t: Tensors, c: Call) -> Run:
        outs = self._outs(t, c)
        return lambda: dist.gather(t["input"], gather_list=outs, dst=c.root)


class Scatter(_Chunked):
    """Rank r receives block r (``count`` elements) of the root's buffer."""

    name = "scatter"
    title = "Scatter"
    placements = (False,)
    rooted = True

    def expected(self, c: Call, count: int) -> torch.Tensor:
        return self.inputs(c, count, c.root, offset=c.rank * count)

    def buffers(self, c: Call, count: int, in_place: bool) -> Buffers:
        inp = self.inputs(c, c.world_size * count).to(c.dtype).to(c.device)
        out = torch.empty(count, dtype=c.dtype, device=c.device)
        return _poisoned({"input": inp, "output": out}, "output")

    def _ins(self, t: Tensors, c: Call) -> list[torch.Tensor] | None:
        return _blocks(t["input"], c.world_size) if c.rank == c.root else None

    def pycomm_runner(self, comm: Any, t: Tensors, c: Call, algo: str) -> Run:
        _no_algo(self, algo)
        ins = self._ins(t, c)
        return lambda: comm.scatter(t["output"], ins, c.root)

    def torch_runner(self, t: Tensors, c: Call) -> Run:
        ins = self._ins(t, c)
        return lambda: dist.scatter(t["output"], scatter_list=ins, src=c.root)


class AllToAll(_Chunked):
    """Block p (``count`` elements) of each rank's input goes to rank p;
    ``count`` is per block, ``size`` a rank's whole buffer."""

    name = "alltoall"
    title = "AlltoAll"
    placements = (False,)

    def expected(self, c: Call, count: int) -> torch.Tensor:
        return torch.cat([self.inputs(c, count, p, offset=c.rank * count)
                          for p in range(c.world_size)])

    def buffers(self, c: Call, count: int, in_place: bool) -> Buffers:
        inp = self._values(c, c.world_size * count)
        return _poisoned({"input": inp, "output": torch.empty_like(inp)}, "output")

    def pycomm_runner(self, comm: Any, t: Tensors, c: Call, algo: str) -> Run:
        _no_algo(self, algo)
        return lambda: comm.all_to_all_single(t["output"], t["input"])

    def torch_runner(self, t: Tensors, c: Call) -> Run:
        return lambda: dist.all_to_all_single(t["output"], t["input"])


#: Every measured collective by sub-command name, in the order of the help.
SPECS: dict[str, Collective] = {
    c.name: c for c in (AllReduce(), ReduceScatter(), AllGather(), Broadcast(), SendRecv(),
                        Reduce(), Gather(), Scatter(), AllToAll())
}


# --------------------------------------------------------------- by name

def get_collective(name: str) -> Collective:
    """The :class:`Collective` called ``name``; ValueError for an unknown one."""
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown collective {name!r}") from None


def busbw_factor(collective: str, world_size: int) -> float:
    """busbw = algbw * factor (nccl-tests' doc/PERFORMANCE.md): the fraction
    of the data each rank's link must carry, so that busbw is comparable to
    the hardware's bandwidth whatever the world size.

    all-reduce 2(n-1)/n; reduce-scatter, all-gather, gather, scatter and
    all-to-all (n-1)/n; broadcast, reduce and send/recv 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return get_collective(collective).bus_factor(world_size)


def counts(collective: str, nbytes: int, elem_size: int, world_size: int) -> tuple[int, int]:
    """(count, size_bytes) of one step of the sweep (:meth:`Collective.counts`)."""
    return get_collective(collective).counts(nbytes, elem_size, world_size)


def expected_result(collective: str, rank: int, world_size: int, count: int,
                    dtype: torch.dtype, op: str, root: int = 0) -> torch.Tensor:
    """:meth:`Collective.expected` of rank ``rank``."""
    return get_collective(collective).expected(Call(rank, world_size, dtype, op, root), count)


def make_buffers(collective: str, in_place: bool, rank: int, world_size: int, count: int,
                 dtype: torch.dtype, op: str, device: torch.device) -> Buffers:
    """:meth:`Collective.buffers` of rank ``rank``."""
    c = Call(rank, world_size, dtype, op, 0, device)
    return get_collective(collective).buffers(c, count, in_place)


def make_runner(collective: str, algo: str, bufs: Buffers, *, comm: Any, rank: int,
                world_size: int, op: str, root: int) -> Callable[[], None]:
    """A no-argument function that runs the collective once, synchronously
    (for ``algo`` "torch": through torch.distributed's default group; else
    through the pycomm communicator with ``algo=algo``)."""
    c = Call(rank, world_size, bufs.result.dtype, op, root, bufs.result.device)
    return runner(get_collective(collective), algo, bufs, comm, c)


def runner(coll: Collective, algo: str, bufs: Buffers, comm: Any, c: Call) -> Callable[[], None]:
    """:func:`make_runner` for a :class:`Collective` and a :class:`Call`."""
    if algo == "torch":
        return coll.torch_runner(bufs.tensors, c)
    return coll.pycomm_runner(comm, bufs.tensors, c, algo)
