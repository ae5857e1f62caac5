"""The communicator: pycomm's torch.distributed-style API over the C++ core.

Python here only orchestrates: it rendezvouses through a c10d Store, picks a
transport, and forwards each call to pycomm._C.Comm, which validates tensors
and runs the C++ algorithms (csrc/core).
"""

from __future__ import annotations

import enum
import hashlib
import numbers
import os
import socket
import threading
import uuid
import warnings
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence, Union, overload

import torch
import torch.distributed as dist

from ._ext import _C

__all__ = [
    "CommError",
    "Communicator",
    "P2POp",
    "ReduceOp",
    "Work",
    "init",
    "get_default",
    "is_initialized",
]

#: Raised on every rank when a collective fails (timeout, dead peer, transport
#: error, mismatched calls in checked mode). A RuntimeError.
CommError = _C.CommError

#: Handle of an asynchronous operation: ``wait()``, ``is_completed()``,
#: ``is_success()``, ``get_future()`` (a ``torch.futures.Future`` completed with
#: the list of output tensors, what DDP communication hooks return; on GPU a
#: CUDA-aware one, completed at the enqueue and ordered on the caller's stream,
#: as ProcessGroupNCCL's).
if TYPE_CHECKING:  # the compiled class, opaque to type checkers
    Work = Any
else:
    Work = _C.Work

DEFAULT_TIMEOUT = timedelta(minutes=5)
DEFAULT_SLICE_BYTES = 512 * 1024
# gloo pays ~1 ms of latency per message on loopback, so its ring slices must
# be large (64 MiB all-reduce, 2 ranks: 128 KiB slices 811 ms, 512 KiB 191 ms,
# 4 MiB 65 ms, torch's own gloo all-reduce 68 ms).
DEFAULT_GLOO_SLICE_BYTES = 4 * 1024 * 1024
#: GPU default: each slice costs one ncclGroupStart/End (a kernel launch and a
#: few microseconds of host time), so slices are larger than on CPU.
DEFAULT_CUDA_SLICE_BYTES = 4 * 1024 * 1024

#: algo="auto" on GPU: per op, the first rule whose max_bytes (None = no limit)
#: is >= the message size picks the algorithm. The default crossover, 1 MiB, is
#: an estimate until measured on the H100 (scripts/gpu_check.sh writes a
#: measured table to OUTDIR/auto_table.json): below it a collective is
#: latency-bound and NCCL's single fused kernel wins over our 2(n-1) grouped
#: launches; above it the ring is bandwidth-bound and is meant to match NCCL.
#: Override with PYCOMM_AUTO_TABLE=path.json ({"all_reduce": [[bytes|null, algo], ...]}).
DEFAULT_AUTO_TABLE: dict[str, list[tuple[int | None, str]]] = {
    "all_reduce": [(1 << 20, "nccl"), (None, "ring")],
    "reduce_scatter": [(1 << 20, "nccl"), (None, "ring")],
    "all_gather": [(1 << 20, "nccl"), (None, "ring")],
    "broadcast": [(1 << 20, "nccl"), (None, "ring")],
}


class ReduceOp(enum.IntEnum):
    """Reduction operators. Strings ("sum", "avg", "max", "min", "product")
    and ``torch.distributed.ReduceOp`` values are accepted wherever an op is."""

    SUM = 0
    AVG = 1
    MAX = 2
    MIN = 3
    PRODUCT = 4


_OP_NAMES = {
    "sum": ReduceOp.SUM,
    "avg": ReduceOp.AVG,
    "mean": ReduceOp.AVG,
    "max": ReduceOp.MAX,
    "min": ReduceOp.MIN,
    "product": ReduceOp.PRODUCT,
    "prod": ReduceOp.PRODUCT,
}

OpLike = Union[ReduceOp, str, int, "dist.ReduceOp"]


def _to_op(op: Any) -> int:
    if isinstance(op, ReduceOp):
        return int(op)
    if isinstance(op, str):
        try:
            return int(_OP_NAMES[op.lower()])
        except KeyError:
            raise ValueError(
                f"unknown reduce op {op!r}; expected one of {sorted(_OP_NAMES)}"
            ) from None
    if isinstance(op, dist.ReduceOp) or type(op).__name__ == "RedOpType":
        name = str(op).split(".")[-1].lower()
        if name in _OP_NAMES:
            return int(_OP_NAMES[name])
        raise ValueError(f"torch.distributed reduce op {op} is not supported by pycomm")
    if isinstance(op, int) and not isinstance(op, bool) and 0 <= op < len(ReduceOp):
        return op
    raise ValueError(f"unknown reduce op {op!r}; use pycomm.ReduceOp or a string like 'sum'")


# The C++ DType codes of the wire dtypes (csrc/core/types.h).
_WIRE_DTYPES = {torch.float16: 2, torch.bfloat16: 3}
_WIRE_NAMES = {"float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _to_wire(wire_dtype: Any) -> int:
    """all_reduce's wire_dtype -> the core's DType code."""
    dt = _WIRE_NAMES.get(wire_dtype.lower()) if isinstance(wire_dtype, str) else wire_dtype
    if not isinstance(dt, torch.dtype) or dt not in _WIRE_DTYPES:
        raise ValueError(f"all_reduce: wire_dtype must be None, torch.float16 or torch.bfloat16 "
                         f"(or 'float16' / 'bfloat16'), got {wire_dtype!r}")
    return _WIRE_DTYPES[dt]


@dataclass
class P2POp:
    """One request of :meth:`Communicator.batch_isend_irecv`.

    Args:
        op: ``"isend"`` or ``"irecv"`` (or the functions/methods of that name,
            as with ``torch.distributed.P2POp(dist.isend, t, peer)``).
        tensor: the tensor to send from or receive into (contiguous).
        peer: the other rank.
    """

    op: Union[str, Callable[..., Any]]
    tensor: torch.Tensor
    peer: int

    def is_send(self) -> bool:
        name = self.op if isinstance(self.op, str) else getattr(self.op, "__name__", "")
        if name in ("isend", "send"):
            return True
        if name in ("irecv", "recv"):
            return False
        raise ValueError(f"P2POp.op must be 'isend' or 'irecv', got {self.op!r}")


@dataclass(frozen=True)
class _Settings:
    """How a communicator was built; its groups are built the same way."""

    transport: str  # resolved: "shm", "gloo" or "nccl"
    device: torch.device
    timeout: timedelta
    slice_bytes: int
    check: bool


class Communicator:
    """A group of ranks and the transport between them.

    Create one with :func:`pycomm.init`, or over a subset of an existing
    communicator's ranks with :meth:`new_group` / :meth:`split`. All ranks
    must call collectives in the same order. Operations are in place, like
    ``torch.distributed``; with ``async_op=True`` they return a :class:`Work`
    and run on a background thread (CPU) in submission order. Usable as a
    context manager (closes).
    """

    def __init__(self, impl: Any, *, store: Any, settings: _Settings,
                 keepalive: Sequence[Any] = ()) -> None:
        self._impl = impl
        # This communicator's own prefixed store: groups rendezvous under it.
        self._store = store
        self._settings = settings
        self._keepalive = list(keepalive)
        self._pid = os.getpid()
        # Groups created per member list (see _create_group): the rendezvous
        # key of a group counts only the groups with the same members, so a
        # group that other ranks never create cannot shift theirs.
        self._group_counts: dict[tuple[int, ...], int] = {}
        self._nccl_splits = 0  # split() calls over NCCL (all ranks make them)

    # -- properties ------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._impl.rank

    @property
    def world_size(self) -> int:
        return self._impl.world_size

    @property
    def device(self) -> torch.device:
        return torch.device(self._impl.device)

    @property
    def transport(self) -> str:
        return self._impl.transport

    @property
    def closed(self) -> bool:
        return self._impl.closed

    @property
    def check(self) -> bool:
        """Checked mode: ranks compare call fingerprints before each collective."""
        return bool(getattr(self._impl, "check", False))

    def __repr__(self) -> str:
        return (
            f"Communicator(rank={self.rank}, world_size={self.world_size}, "
            f"transport={self.transport!r}, device={str(self.device)!r})"
        )

    # -- collectives -----------------------------------------------------
    # The overloads tell type checkers that async_op=True always gives a Work.
    @overload
    def all_reduce(
        self, tensor: torch.Tensor, op: OpLike = ..., algo: str = ...,
        *, async_op: Literal[True], wire_dtype: torch.dtype | str | None = ...,
        register: bool = ...,
    ) -> Work: ...

    @overload
    def all_reduce(
        self, tensor: torch.Tensor, op: OpLike = ..., algo: str = ...,
        async_op: bool = ..., wire_dtype: torch.dtype | str | None = ...,
        register: bool = ...,
    ) -> Work | None: ...

    def all_reduce(
        self, tensor: torch.Tensor, op: OpLike = ReduceOp.SUM, algo: str = "auto",
        async_op: bool = False, wire_dtype: torch.dtype | str | None = None,
        register: bool = False,
    ) -> Work | None:
        """Reduces ``tensor`` across all ranks in place; every rank gets the
        bitwise-identical result.

        Args:
            tensor: contiguous tensor on the communicator's device.
            op: SUM, AVG (floating dtypes), MAX, MIN or PRODUCT.
            algo: "ring", "nccl" (GPU native), "direct" (shm transport:
                every rank reduces straight from the others' shared buffers;
                one or two synchronisations instead of 2(n-1) ring steps), or
                "auto" (the fastest for the size and transport).
            async_op: return a :class:`Work` instead of waiting.
            wire_dtype: ``None``, or ``torch.float16`` / ``torch.bfloat16``
                (or the strings ``"float16"`` / ``"bfloat16"``) for a float32
                ``tensor``: the ring then sends every step in that dtype and
                accumulates in float32 (half the bytes; one rounding per ring
                step). The owner of each chunk rounds its final value to the
                wire dtype too, so every rank ends with the same bits:
                ``wire(op over ranks)``. Ring only: ``algo="auto"`` takes the
                ring, ``"direct"`` and ``"nccl"`` are refused. (The CUDA
                kernels for it are compile-checked but have not run on a GPU.)
            register: on ``shm``, offer to move ``tensor``'s storage into
                symmetric memory during this op (as :meth:`register_tensor`
                does), for a buffer that is reduced again and again (a
                gradient bucket). It moves only if every rank offers, with
                ``algo`` "auto" or "direct", and ``tensor`` is all of a
                storage that torch's CPU allocator made; otherwise nothing
                moves and the op stages as usual, so ranks cannot disagree.
                With ``async_op=True`` the call returns once the op has
                decided (ops issued later must see the new address; with one
                rank, once the op is done). A storage some rank declined
                does not offer again. Ignored elsewhere, inside Future
                callbacks (on the worker thread), and for a tensor already
                registered.

        Raises:
            TypeError: unsupported dtype. ValueError: wrong device,
            non-contiguous tensor, unknown op/algo, AVG on integers, a
            wire_dtype that is not float16/bfloat16, with a non-float32
            tensor, or with algo "direct" / "nccl".
            CommError: the collective failed on this or a peer rank.
        """
        _need_tensors("all_reduce", tensor=tensor)
        wire = -1 if wire_dtype is None else _to_wire(wire_dtype)
        return self._impl.all_reduce(tensor, _to_op(op), algo, async_op, wire, bool(register))

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: OpLike = ReduceOp.SUM,
        algo: str = "auto", async_op: bool = False,
    ) -> Work | None:
        """``output`` (m elements) on rank r gets op over ranks of
        ``input[r*m:(r+1)*m]``; ``input`` has world_size * m elements
        (like ``torch.distributed.reduce_scatter_tensor``)."""
        _need_tensors("reduce_scatter", output=output, input=input)
        return self._impl.reduce_scatter(output, input, _to_op(op), algo, async_op)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, algo: str = "auto",
        async_op: bool = False,
    ) -> Work | None:
        """``output`` (world_size * m elements) gets every rank's ``input`` (m
        elements) in rank order (like ``all_gather_into_tensor``)."""
        _need_tensors("all_gather", output=output, input=input)
        return self._impl.all_gather(output, input, algo, async_op)

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, algo: str = "auto", async_op: bool = False
    ) -> Work | None:
        """Copies ``tensor`` of rank ``src`` into ``tensor`` on every rank
        (pipelined chain from src)."""
        _need_tensors("broadcast", tensor=tensor)
        return self._impl.broadcast(tensor, src, algo, async_op)

    # -- rooted collectives and all-to-all (csrc/core/collectives.h) ------
    def reduce(
        self, tensor: torch.Tensor, dst: int = 0, op: OpLike = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work | None:
        """Reduces ``tensor`` of every rank into ``tensor`` on rank ``dst``
        (like ``torch.distributed.reduce``; a pipelined chain toward ``dst``).

        On the other ranks ``tensor`` is overwritten with partial results
        (torch leaves their contents undefined): keep a copy if you need it.

        Raises:
            TypeError: unsupported dtype. ValueError: ``dst`` out of range,
            wrong device, non-contiguous tensor, unknown op, AVG on integers.
            CommError: the collective failed, or ranks passed different
            ``dst``, sizes, dtypes or ops (``check=True``: ValueError on every
            rank before anything is sent).
        """
        _need_tensors("reduce", tensor=tensor)
        return self._impl.reduce(tensor, dst, _to_op(op), async_op)

    def gather(
        self, gather_list: Sequence[torch.Tensor] | None, tensor: torch.Tensor, dst: int = 0,
        async_op: bool = False,
    ) -> Work | None:
        """Rank ``dst`` receives every rank's ``tensor`` into
        ``gather_list[rank]`` (world_size tensors of ``tensor``'s dtype and
        numel); the other ranks pass ``None``. Like ``torch.distributed.gather``.

        Raises:
            ValueError: ``gather_list`` given on a rank other than ``dst``, or
            of the wrong length or sizes on ``dst``; ``dst`` out of range.
            TypeError: not tensors, or dtypes that differ.
        """
        _need_tensors("gather", tensor=tensor)
        return self._impl.gather(_tensor_list("gather", "gather_list", gather_list), tensor, dst,
                                 async_op)

    def scatter(
        self, tensor: torch.Tensor, scatter_list: Sequence[torch.Tensor] | None, src: int = 0,
        async_op: bool = False,
    ) -> Work | None:
        """``tensor`` on rank r receives ``scatter_list[r]`` of rank ``src``;
        the other ranks pass ``None``. Like ``torch.distributed.scatter``.

        Raises:
            ValueError / TypeError: as :meth:`gather`, for ``scatter_list``
            and ``src``.
        """
        _need_tensors("scatter", tensor=tensor)
        return self._impl.scatter(tensor, _tensor_list("scatter", "scatter_list", scatter_list),
                                  src, async_op)

    def all_to_all(
        self, output_tensor_list: Sequence[torch.Tensor],
        input_tensor_list: Sequence[torch.Tensor], async_op: bool = False,
    ) -> Work | None:
        """``output_tensor_list[p]`` receives rank p's
        ``input_tensor_list[rank]``; sizes may differ per peer, as long as each
        sender's block matches its receiver's (checked: a mismatch raises
        CommError on every rank before any data moves). Pairwise schedule.
        Like ``torch.distributed.all_to_all``."""
        return self._impl.all_to_all(
            _tensor_list("all_to_all", "output_tensor_list", output_tensor_list, none_ok=False),
            _tensor_list("all_to_all", "input_tensor_list", input_tensor_list, none_ok=False),
            async_op)

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None, async_op: bool = False,
    ) -> Work | None:
        """Block p of ``input`` (``input_split_sizes[p]`` rows of dim 0) goes
        to rank p, whose block for this rank lands in ``output`` at the rows
        ``output_split_sizes`` give. ``None`` splits: equal blocks of
        ``size(0) / world_size`` rows. Uneven splits are verified across ranks
        (a mismatch raises CommError on every rank, nothing is truncated).
        Like ``torch.distributed.all_to_all_single``.

        Raises:
            ValueError: splits of the wrong length, negative, or not summing
            to ``size(0)``; ``size(0)`` not divisible without splits;
            ``output`` overlapping ``input``. TypeError: dtypes differ.
        """
        _need_tensors("all_to_all_single", output=output, input=input)
        return self._impl.all_to_all_single(
            output, input, _splits("output_split_sizes", output_split_sizes),
            _splits("input_split_sizes", input_split_sizes), async_op)

    def barrier(self) -> None:
        """Returns once every rank has entered the barrier."""
        self._impl.barrier()

    # -- symmetric memory ------------------------------------------------
    def register_tensor(self, tensor: torch.Tensor) -> bool:
        """Moves the storage of ``tensor`` into symmetric memory, in place:
        shared memory that every rank of this communicator maps, so that an
        :meth:`all_reduce` of it reads the peers' copies and writes the
        result into every copy, with nothing staged through the transport's
        buffers (on 2 ranks half the memory traffic; torch calls this idea
        ``SymmetricMemory``, NCCL "registered buffers").

        A collective: every rank calls it at the same point of its op
        sequence, with a tensor whose storage has the same number of bytes.
        Like :meth:`torch.Tensor.share_memory_`, the data is copied and the
        storage's memory swapped, so ``tensor`` and every view of its storage
        keep their identity and values; ``data_ptr()`` changes, so anything
        that holds the old address (a ``numpy()`` view taken before, an op in
        flight on another communicator or thread, a pending ``irecv`` into
        it) must not be in use. Inside a Future callback every rank returns
        False (ops queued earlier may hold the address). Only a
        storage that torch's CPU allocator made moves (not ``from_numpy``,
        ``from_blob`` or ``share_memory_()`` memory, whose sharing would
        silently end): otherwise every rank returns False. The memory is
        released when the storage is freed; registering again moves it to a
        fresh region. :meth:`all_reduce` with ``register=True`` does the same
        inside an all-reduce, without a collective of its own.

        The fast path applies to ``all_reduce`` (``algo`` "auto" or "direct")
        of a tensor that spans its whole registered storage, when every rank
        passes its registered tensor. Otherwise (a view, an unregistered
        tensor on some rank) every rank takes the staged path: same bits,
        nothing to get wrong.

        Args:
            tensor: a contiguous CPU tensor; its whole storage is registered.

        Returns:
            True when registered. False on every rank, with a warning naming
            the rank and the reason, when some rank could not reserve the
            memory (``/dev/shm`` too small), has ``PYCOMM_SHM_SYMMETRIC=0``
            or a storage that may not move; the tensor is then unchanged.

        Raises:
            ValueError: the communicator's transport is not ``shm``, or the
                tensor is not on its device.
            CommError: the collective failed (a dead peer, the timeout,
                storages of different sizes).
        """
        _need_tensors("register_tensor", tensor=tensor)
        why = self._impl.register_tensor(tensor)
        if why:
            warnings.warn(f"pycomm: register_tensor: no symmetric memory ({why}); all_reduce "
                          "stages through the transport's buffers instead", stacklevel=2)
        return not why

    def is_registered(self, tensor: torch.Tensor) -> bool:
        """True when the storage of ``tensor`` was moved into symmetric memory
        by this communicator (:meth:`register_tensor`, or an all-reduce with
        ``register=True``)."""
        return self._impl.is_registered(tensor)

    @property
    def symmetric_all_reduces(self) -> int:
        """All-reduces so far that ran from symmetric memory (nothing staged)."""
        return self._impl.symmetric_all_reduces

    # -- point to point --------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Sends ``tensor`` to rank ``dst`` (blocks until it is delivered to
        the transport)."""
        _need_tensors("send", tensor=tensor)
        self._impl.send(tensor, dst, False)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receives into ``tensor`` from rank ``src``."""
        _need_tensors("recv", tensor=tensor)
        self._impl.recv(tensor, src, False)

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        """Asynchronous :meth:`send`."""
        _need_tensors("isend", tensor=tensor)
        return self._impl.send(tensor, dst, True)

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        """Asynchronous :meth:`recv`."""
        _need_tensors("irecv", tensor=tensor)
        return self._impl.recv(tensor, src, True)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        """Posts all ``ops`` together (so a send and a recv between the same
        pair cannot deadlock) and returns one :class:`Work` per op (they share
        one completion)."""
        ops = list(ops)
        if not ops:
            return []
        for o in ops:
            if not isinstance(o, P2POp):
                raise TypeError(f"batch_isend_irecv takes pycomm.P2POp items, got {type(o).__name__}")
        for o in ops:
            _need_tensors("batch_isend_irecv", tensor=o.tensor)
        work = self._impl.batch_p2p([(o.is_send(), o.tensor, o.peer) for o in ops])
        return [work] * len(ops)

    # -- groups -----------------------------------------------------------
    def new_group(
        self, ranks: Sequence[int], *, timeout: timedelta | float | None = None
    ) -> "Communicator | None":
        """A communicator over ``ranks`` of this one, renumbered in the given
        order (``ranks[i]`` becomes rank ``i``), on the same transport, device,
        slice size and checked mode.

        Only the members rendezvous (through this communicator's store, under
        a key made from the member list and how many groups with these members
        this rank created before), so every member must create its groups with
        these members in the same order, while other ranks may call it (it
        returns None there at once) or skip it: that never shifts the groups
        created later. The group has its own transport: closing it leaves this
        communicator usable, and closing this one leaves the group usable.

        Args:
            ranks: distinct ranks of this communicator, in the group's order.
            timeout: the group's timeout (default: this communicator's).

        Returns:
            The group's :class:`Communicator` on its members, None elsewhere.

        Raises:
            ValueError: ``ranks`` is empty, has duplicates or a rank out of
                range. TypeError: a rank is not an int.
            RuntimeError: this communicator is closed or was forked.
            CommError: the group's transport could not be set up.

        Example::

            >>> # 4 ranks: two data-parallel pairs
            >>> pair = comm.new_group([0, 1]) if comm.rank < 2 else comm.new_group([2, 3])
            >>> pair.all_reduce(t)                # sums over the pair only
        """
        self._check_usable("new_group")
        return self._create_group(_group_members(ranks, self.world_size), timeout)

    def split(
        self, color: int | None, key: int | None = None, *,
        timeout: timedelta | float | None = None,
    ) -> "Communicator | None":
        """Partitions the ranks by ``color``, like ``MPI_Comm_split``.

        A collective of this communicator: every rank calls it, in the same
        order as its other collectives. The ranks that pass the same color
        form one group, ranked by ``(key, rank in this communicator)``. On
        the ``nccl`` transport it is NCCL's own ``ncclCommSplit`` (color and
        key must then fit in 32 bits); elsewhere the ranks exchange their
        colors and keys, then each group sets up its own transport.

        Args:
            color: the group to join; None or a negative int joins none.
            key: orders the ranks within the group (default: this rank).
            timeout: the group's timeout (default: this communicator's).

        Returns:
            This rank's group as a :class:`Communicator` (same transport as
            this one), or None when ``color`` is None or negative.

        Raises:
            TypeError: color or key is not an int.
            ValueError: color or key does not fit in 64 bits.
            RuntimeError: this communicator is closed or was forked.
            CommError: the exchange of colors or the group's setup failed.

        Example::

            >>> row = comm.split(comm.rank // 2)          # ranks {0,1}, {2,3}
            >>> col = comm.split(comm.rank % 2, key=-comm.rank)  # {3,1}, {2,0}
        """
        self._check_usable("split")
        color = -1 if color is None else _as_int64(color, "color")
        key = self.rank if key is None else _as_int64(key, "key")
        if self.transport == "nccl":
            return self._nccl_split(color, key, timeout)
        # Every rank learns every (color, key) through this communicator.
        mine = torch.tensor([max(color, -1), key], dtype=torch.int64, device=self.device)
        table = torch.empty(2 * self.world_size, dtype=torch.int64, device=self.device)
        self.all_gather(table, mine)
        pairs = table.view(self.world_size, 2).tolist()
        if color < 0:
            return None
        members = sorted((k, r) for r, (c, k) in enumerate(pairs) if c == color)
        return self._create_group(tuple(r for _, r in members), timeout)

    def _nccl_split(self, color: int, key: int,
                    timeout: timedelta | float | None) -> "Communicator | None":
        """split() through ncclCommSplit on the collectives' communicator."""
        for name, value in (("color", color), ("key", key)):
            if not -2**31 <= value < 2**31:
                raise ValueError(f"split: {name}={value} does not fit in 32 bits (NCCL's split)")
        settings = self._group_settings(timeout)
        # Every rank splits in the same order: the count names the group's
        # store (for its own groups later) identically on its members.
        self._nccl_splits += 1
        impl = self._impl.split(max(color, -1), key,
                                int(settings.timeout.total_seconds() * 1000))
        if impl is None:
            return None
        store = dist.PrefixStore(f"nccl-split/{self._nccl_splits}/{color}", self._store)
        return Communicator(impl, store=store, settings=settings)

    def _group_settings(self, timeout: timedelta | float | None) -> "_Settings":
        """A sub-communicator's settings: this one's, with ``timeout`` if given."""
        if timeout is None:
            return self._settings
        return replace(self._settings, timeout=_timeout_from(timeout))

    def _check_usable(self, op: str) -> None:
        if self.closed:
            raise RuntimeError(f"{op}: the communicator is closed")
        if os.getpid() != self._pid:
            raise RuntimeError(f"{op}: this communicator belongs to process {self._pid} and "
                               f"cannot be used in a forked child (pid {os.getpid()})")

    def _create_group(self, members: tuple[int, ...],
                      timeout: timedelta | float | None) -> "Communicator | None":
        """Builds the group ``members`` (ordered ranks of this communicator)
        on the members; None elsewhere. The rendezvous prefix names the
        member list and this rank's count of groups with that member list."""
        if self.rank not in members:
            return None
        count = self._group_counts.get(members, 0) + 1
        self._group_counts[members] = count
        ident = hashlib.sha1(",".join(map(str, members)).encode()).hexdigest()[:16]
        store = dist.PrefixStore(f"group/{ident}/{count}", self._store)
        settings = self._group_settings(timeout)
        try:
            return _build(store, members.index(self.rank), len(members), settings.transport,
                          settings.device, settings.timeout, settings.slice_bytes, settings.check,
                          explicit_check=settings.check)
        except (CommError, dist.DistError) as e:  # setup failed, or a member never came
            raise CommError(f"creating the group of ranks {list(members)} (group rank i is "
                            f"ranks[i]) on rank {self.rank}: {e}") from e

    # -- lifetime ---------------------------------------------------------
    def close(self) -> None:
        """Waits for queued operations, then releases the transport. Later
        calls raise. Idempotent.

        Raises:
            CommError: an operation failed and aborted the communicator, and
                no call has raised that failure yet (an async op whose Work
                nobody waited for); everything is released all the same. Not
                after :meth:`abort`, nor once a call raised the failure.
        """
        global _default
        try:
            self._impl.close()
        finally:
            if os.getpid() != self._pid:
                # A forked child's copy: the transport objects (e.g. the Gloo
                # process group) own the parent's threads and sockets;
                # destroying them here could hang. Keep them alive until this
                # process exits.
                _forked_leaks.extend(self._keepalive)
            self._keepalive.clear()
            with _lock:
                if _default is self:
                    _default = None

    def abort(self, reason: str = "aborted by the user") -> None:
        """Fails pending and future operations of this communicator at once."""
        self._impl.abort(reason)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close()
        except CommError:
            if exc_type is None:
                raise
            # The block's own exception is the one to see: the failure that
            # close() reports is the same one, or a consequence of it.


# ------------------------------------------------------------------ init

_lock = threading.Lock()
_default: Communicator | None = None
_init_count = 0
_forked_leaks: list[Any] = []


def _need_tensors(op: str, **args: Any) -> None:
    """TypeError naming the argument when one is not a torch.Tensor (a list
    or a numpy array would otherwise get pybind's signature dump)."""
    for name, value in args.items():
        if not isinstance(value, torch.Tensor):
            hint = " (wrap it with torch.as_tensor)" if hasattr(value, "__len__") else ""
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}{hint}")


def _tensor_list(op: str, name: str, value: Any, none_ok: bool = True) -> list[torch.Tensor]:
    """A list argument of tensors (None -> [] where allowed), or a TypeError
    naming it."""
    if value is None and none_ok:
        return []
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list of tensors"
                        f"{' or None' if none_ok else ''}, got {type(value).__name__}")
    for i, t in enumerate(value):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return list(value)


def _splits(name: str, value: Any) -> list[int]:
    """all_to_all_single's split sizes (None -> [], equal blocks)."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value):
        raise TypeError(f"all_to_all_single: {name} must be a list of ints or None, got {value!r}")
    return [int(v) for v in value]


def _check_from(check: bool | None) -> bool:
    if check is None:
        return os.environ.get("PYCOMM_CHECK", "0").strip().lower() not in ("", "0", "false", "no")
    return bool(check)


def _env_number(name: str, kind: type, what: str, value: Any = None) -> Any:
    """Environment variable ``name`` (or ``value`` when given) as an int or a
    float; a ValueError that names the variable when it is not one."""
    raw = os.environ.get(name) if value is None else value
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"environment variable {name}={raw!r} is not {what}") from None


def _check_cpu_simd() -> None:
    """PYCOMM_CPU_SIMD selects the CPU reduction kernels (csrc/core/reduce.cc):
    unset or "auto" (AVX2/F16C where the CPU has them) or "scalar" (the
    portable loops; results are bitwise the same). The kernels read it at their
    first use and raise on another value; init checks it first, so that a typo
    fails here rather than inside a collective."""
    value = os.environ.get("PYCOMM_CPU_SIMD", "")
    if value not in ("", "auto", "scalar"):
        raise ValueError(f"environment variable PYCOMM_CPU_SIMD={value!r} is not 'auto' or 'scalar'")


def _timeout_from(timeout: timedelta | float | None) -> timedelta:
    if timeout is None:
        if not os.environ.get("PYCOMM_TIMEOUT"):
            return DEFAULT_TIMEOUT
        seconds = _env_number("PYCOMM_TIMEOUT", float, "a number of seconds")
        if not seconds > 0:
            raise ValueError(f"environment variable PYCOMM_TIMEOUT={seconds!r} must be positive")
        return timedelta(seconds=seconds)
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=float(timeout))
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
    return timeout


def _rendezvous(
    rank: int | None, world_size: int | None, store: Any, group: Any, timeout: timedelta
) -> tuple[Any, int, int, str]:
    """Returns (store, rank, world_size, key prefix)."""
    global _init_count
    _init_count += 1
    if group is not None:
        if not dist.is_initialized():
            raise ValueError("init(group=...) needs torch.distributed.init_process_group first")
        r, n = dist.get_rank(group), dist.get_world_size(group)
        if rank is not None and rank != r:
            raise ValueError(f"rank={rank} disagrees with the group's rank {r}")
        base = dist.distributed_c10d._get_default_store()
        name = dist.distributed_c10d._get_process_group_name(group) if group != dist.group.WORLD else "world"
        return base, r, n, f"pycomm/{name}/{_init_count}"
    if store is not None:
        if rank is None or world_size is None:
            raise ValueError("init(store=...) also needs rank= and world_size=")
        return store, rank, world_size, f"pycomm/{_init_count}"
    if rank is None and world_size is None and dist.is_initialized():
        return _rendezvous(None, None, None, dist.group.WORLD, timeout)
    env_rank = rank if rank is not None else os.environ.get("RANK")
    env_world = world_size if world_size is not None else os.environ.get("WORLD_SIZE")
    if env_rank is None or env_world is None or "MASTER_ADDR" not in os.environ:
        raise ValueError(
            "pycomm.init() needs a rendezvous: run under torchrun (RANK, WORLD_SIZE, "
            "MASTER_ADDR, MASTER_PORT), or pass rank=, world_size= and store=, or group="
        )
    r = _env_number("RANK", int, "an integer rank", env_rank)
    n = _env_number("WORLD_SIZE", int, "an integer world size", env_world)
    _validate_world(r, n)  # before the rendezvous, which would wait for the missing rank
    st, r, n = next(dist.rendezvous("env://", r, n, timeout=timeout))
    return st, r, n, f"pycomm/{_init_count}"


def _wait_for(store: Any, keys: dict[int, str], what: str) -> None:
    """Waits for the store keys of the ranks in ``keys`` (rank -> key) under
    the store's own timeout (ranks may reach a rendezvous far apart; the
    communicator's timeout bounds its operations, not its creation). A
    timeout is a CommError naming the ranks still missing."""
    try:
        store.wait(list(keys.values()))
    except dist.DistStoreError as e:
        missing = [q for q, k in keys.items() if not store.check([k])]
        raise CommError(
            f"{what}: ranks {missing} did not arrive within the store's timeout "
            f"({store.timeout.total_seconds():g} s); every rank of a new communicator must "
            "create it (init(), or new_group/split on every member)") from e


def _same_host(store: Any, prefix: str, rank: int, world_size: int) -> bool:
    """True when every rank runs on this host (hostname + boot id match)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    me = f"{socket.gethostname()}|{boot}"
    store.set(f"{prefix}/host/{rank}", me)
    keys = {r: f"{prefix}/host/{r}" for r in range(world_size)}
    _wait_for(store, keys, "choosing the transport")
    return all(store.get(k).decode() == me for k in keys.values())


_shm_count = 0


def _init_shm(st: Any, rank: int, world_size: int, timeout_ms: int, slice_bytes: int,
              fallback_ok: bool) -> Any:
    """Creates the shm communicator: rank 0 creates the segment (O_EXCL, 0600)
    and publishes its name; the others attach; once every rank has reported
    (store barrier) the name is unlinked, so nothing outlives the processes.

    Returns None (on every rank alike) when some rank could not set up shared
    memory and ``fallback_ok``; raises CommError otherwise.
    """
    global _shm_count
    _shm_count += 1
    key = "shm"  # ``st`` is this communicator's own prefixed store
    # Rank 0 publishes the name before it creates the segment, so that if it
    # dies or is interrupted before every rank has mapped it (the last one to
    # do so unlinks it, shm_transport.h), the survivors can remove it: every
    # rank unlinks the name when init fails here, whatever the reason.
    if rank == 0:
        # Unique per job (rank 0's pid + random) and per communicator.
        st.set(f"{key}/intent", f"/pycomm-{os.getpid()}-{_shm_count}-{uuid.uuid4().hex[:12]}")
    _wait_for(st, {0: f"{key}/intent"}, "shm setup")
    intent = st.get(f"{key}/intent").decode()
    try:
        impl, errors = _map_shm(st, key, intent, rank, world_size, timeout_ms, slice_bytes)
    except BaseException:
        _C.shm_unlink(intent)  # ENOENT is fine
        raise
    _C.shm_unlink(intent)
    if errors:
        if impl is not None:
            impl.close()
        reason = "could not set up the shm transport: " + "; ".join(e[1:] for e in errors)
        if fallback_ok:
            _warn_fallback_once(reason)
            return None
        raise CommError(reason)
    return impl


_fallback_warned = False


def _warn_fallback_once(reason: str) -> None:
    """transport="auto" falls back from shm to gloo (much slower): say why,
    once per process."""
    global _fallback_warned
    if not _fallback_warned:
        _fallback_warned = True
        warnings.warn(f"pycomm: transport='auto' uses gloo instead of shm ({reason}); pass "
                      "transport='shm' to make this an error", RuntimeWarning, stacklevel=4)


def _map_shm(st: Any, key: str, name: str, rank: int, world_size: int, timeout_ms: int,
             slice_bytes: int) -> tuple[Any, list[str]]:
    """_init_shm's steps: rank 0 creates segment ``name``, the others map it,
    then a store barrier. Returns (this rank's communicator or None, every
    rank's error)."""
    impl, err = None, ""
    if rank == 0:
        try:
            impl = _C.make_shm_comm(name, rank, world_size, True, timeout_ms, slice_bytes)
            st.set(f"{key}/name", name)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            err = f"rank 0: {e}"
            st.set(f"{key}/name", "!" + err)
    else:
        _wait_for(st, {0: f"{key}/name"}, "shm setup")
        published = st.get(f"{key}/name").decode()
        if published.startswith("!"):
            err = published[1:]
        else:
            try:
                impl = _C.make_shm_comm(name, rank, world_size, False, timeout_ms, slice_bytes)
            except Exception as e:  # noqa: BLE001
                err = f"rank {rank}: {e}"
    # Barrier: every rank has mapped the segment (or failed to).
    st.set(f"{key}/mapped/{rank}", "!" + err if err else "ok")
    keys = {r: f"{key}/mapped/{r}" for r in range(world_size)}
    try:
        _wait_for(st, keys, "shm setup")
    except BaseException:
        if impl is not None:
            impl.close()
        raise
    return impl, [v for v in (st.get(k).decode() for k in keys.values()) if v != "ok"]


def _auto_table() -> dict[str, list[tuple[int, str]]]:
    """The algo="auto" table for the C++ side (max_bytes -1 = no limit)."""
    table: dict[str, Any] = dict(DEFAULT_AUTO_TABLE)
    path = os.environ.get("PYCOMM_AUTO_TABLE")
    if path:
        import json

        with open(path) as f:
            loaded = json.load(f)
        for op, rules in loaded.items():
            if op in table:
                table[op] = [(b, str(a)) for b, a in rules]
    out: dict[str, list[tuple[int, str]]] = {}
    for op, rules in table.items():
        for _, a in rules:
            if a not in ("ring", "nccl"):
                raise ValueError(f"auto table: algo for {op} must be 'ring' or 'nccl', got {a!r}")
        out[op] = [(-1 if b is None else int(b), a) for b, a in rules]
    return out


def _choose_cuda_index(requested: int | None, local_rank: str | None, device_count: int,
                       current_device: Callable[[], int]) -> int:
    """The CUDA device index of an nccl communicator, without touching CUDA.

    ``requested`` (the index of an explicit ``device=``) always wins; else
    ``LOCAL_RANK`` (``local_rank``: its value, None or "" when unset), as
    torchrun sets it; else ``current_device()`` (the caller's
    ``torch.cuda.set_device`` choice, or 0). Raises ValueError for a
    LOCAL_RANK that is not an integer and for an index outside
    ``range(device_count)``.
    """
    if requested is not None:
        index, what = requested, f"device=cuda:{requested}"
    elif local_rank is not None and local_rank.strip():
        try:
            index = int(local_rank)
        except ValueError:
            raise ValueError(f"environment variable LOCAL_RANK={local_rank!r} is not an integer"
                             ) from None
        what = f"LOCAL_RANK={index} (default device cuda:LOCAL_RANK)"
    else:
        index = current_device()
        what = f"torch.cuda.current_device()={index}"
    if not 0 <= index < device_count:
        raise ValueError(f"{what}: there is no cuda:{index} ({device_count} CUDA device(s) "
                         "visible); pass device='cuda:N' to init, or check CUDA_VISIBLE_DEVICES")
    return index


def _cuda_device(device: torch.device | None) -> torch.device:
    """init's CUDA device: see _choose_cuda_index. Never calls
    torch.cuda.set_device: the caller's current device stays theirs (the
    communicator's C++ side switches devices with scoped guards)."""
    if not torch.cuda.is_available():
        raise ValueError(f"device {device or 'cuda'} requested but torch.cuda.is_available() "
                         "is False")
    requested = None if device is None else torch.device(device).index
    index = _choose_cuda_index(requested, os.environ.get("LOCAL_RANK"),
                               torch.cuda.device_count(), torch.cuda.current_device)
    return torch.device("cuda", index)


def _make_nccl(st: Any, r: int, n: int, dev: torch.device, timeout: timedelta,
               slice_bytes: int) -> Any:
    """NCCL bootstrap: rank 0 creates the unique id and publishes it through
    the (prefixed, per-communicator) store; every rank initialises on ``dev``
    (from _cuda_device: an existing device)."""
    key = "nccl/unique_id"
    if r == 0:
        st.set(key, _C.nccl_unique_id().hex())
    _wait_for(st, {0: key}, "NCCL setup")
    uid = bytes.fromhex(st.get(key).decode())
    timeout_ms = int(timeout.total_seconds() * 1000)
    return _C.make_nccl_comm(uid, r, n, dev.index, timeout_ms, slice_bytes, _auto_table())


def _group_members(ranks: Sequence[int], world_size: int) -> tuple[int, ...]:
    """``ranks`` of new_group as a tuple, validated against ``world_size``."""
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"new_group: ranks must be a sequence of ints, got {ranks!r}")
    members = tuple(ranks)
    for r in members:
        if isinstance(r, bool) or not isinstance(r, numbers.Integral):
            raise TypeError(f"new_group: ranks must be ints, got {r!r} ({type(r).__name__})")
    members = tuple(int(r) for r in members)
    if not members:
        raise ValueError("new_group: ranks is empty; a group needs at least one rank")
    bad = [r for r in members if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"new_group: ranks {bad} are out of range for world_size {world_size}")
    if len(set(members)) != len(members):
        dups = sorted({r for r in members if members.count(r) > 1})
        raise ValueError(f"new_group: ranks {dups} appear more than once in {list(members)}")
    return members


def _as_int64(value: Any, name: str) -> int:
    """split's color/key: an int that fits in int64 (they travel as int64)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"split: {name} must be an int or None, got {value!r}")
    if not -(1 << 63) <= int(value) < (1 << 63):
        raise ValueError(f"split: {name}={value} does not fit in 64 bits")
    return int(value)


def _validate_world(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} is out of range for world_size {world_size}")


def init(
    rank: int | None = None,
    world_size: int | None = None,
    store: Any = None,
    *,
    group: Any = None,
    transport: str = "auto",
    device: str | torch.device | None = None,
    timeout: timedelta | float | None = None,
    slice_bytes: int | None = None,
    set_default: bool = True,
    check: bool | None = None,
    key_prefix: str | None = None,
) -> Communicator:
    """Creates a communicator (every rank calls it, in the same order).

    Rendezvous, in order of precedence: ``group=`` (reuse an initialised
    torch.distributed group and its store), ``store=`` with ``rank=`` and
    ``world_size=``, an initialised default torch group, or the torchrun
    environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    Args:
        transport: "gloo" (torch's Gloo send/recv; CPU, crosses hosts), "shm"
            (shared memory, one host), "nccl" (GPU), or "auto" ("nccl" when
            the device is CUDA, or when no device is given and this is a CUDA
            build that sees a GPU; on CPU "shm" when every rank runs on this
            host (hostname + boot id, exchanged through the store), falling
            back to "gloo" if shared memory cannot be set up, else "gloo").
        device: "cpu" or a CUDA device. For the nccl transport, a device
            without an index ("cuda", or None) means ``cuda:LOCAL_RANK`` when
            ``LOCAL_RANK`` is set (torchrun sets it), else
            ``torch.cuda.current_device()``; an explicit index always wins.
            ``init`` never calls ``torch.cuda.set_device``: the current device
            stays the caller's. ValueError if that device does not exist.
        timeout: bounds every blocking wait (default 5 minutes, or
            ``PYCOMM_TIMEOUT`` seconds).
        slice_bytes: pipelining granularity of the ring algorithms (default
            ``PYCOMM_SLICE_BYTES``, else 4 MiB for gloo and nccl, 512 KiB for
            shm; must match on all ranks).
        set_default: make it the communicator of the module-level functions.
        check: checked mode (default ``PYCOMM_CHECK=1``; must be equal on all
            ranks): before each collective the ranks all-gather a fingerprint
            of the call (op, collective sequence number, element count, dtype,
            reduce op, root); when they differ, every rank raises
            ``ValueError`` listing each side's fingerprint, before any data
            moved, and the communicator stays usable. Costs one small
            all-gather per collective. CPU transports only.
        key_prefix: put this communicator's rendezvous keys under this prefix
            of the store (every rank passes the same; unique per store)
            instead of one numbered by a per-process count of ``init`` calls,
            which differs between ranks that created different groups.

    Example:
        >>> comm = pycomm.init()                  # under torchrun
        >>> t = torch.ones(4) * comm.rank
        >>> comm.all_reduce(t)                    # t == sum of ranks everywhere
    """
    global _default
    explicit_check = check is not None
    check = _check_from(check)
    _check_cpu_simd()
    timeout = _timeout_from(timeout)
    transport, req = _resolve_transport(transport, device)
    st, r, n, prefix = _rendezvous(rank, world_size, store, group, timeout)
    if key_prefix is not None:
        prefix = key_prefix
    _validate_world(r, n)
    comm = _build(dist.PrefixStore(prefix, st), r, n, transport, req, timeout, slice_bytes, check,
                  explicit_check)
    if set_default:
        with _lock:
            _default = comm
    return comm


def _resolve_transport(
    transport: str, device: str | torch.device | None
) -> tuple[str, torch.device | None]:
    """Validates init's transport and device; returns ("nccl" | "shm" | "gloo"
    | "auto" (a CPU transport picked at rendezvous), the requested device)."""
    if transport not in ("auto", "gloo", "shm", "nccl"):
        raise ValueError(f"unknown transport {transport!r}; expected 'auto', 'gloo', 'shm' or 'nccl'")
    with_cuda = bool(getattr(_C, "WITH_CUDA", False))
    req = torch.device(device) if device is not None else None
    # nccl (GPU) when asked for, when the device is CUDA, or for transport="auto"
    # with no device given on a CUDA build that sees a GPU.
    use_nccl = (
        transport == "nccl"
        or (req is not None and req.type == "cuda")
        or (transport == "auto" and req is None and with_cuda and torch.cuda.is_available())
    )
    if use_nccl:
        if not with_cuda:
            raise ValueError(
                "this pycomm build has no CUDA/NCCL support (pycomm._C.WITH_CUDA is False); "
                "use device='cpu' with transport 'gloo' or 'shm', or rebuild with a CUDA torch"
            )
        if transport not in ("auto", "nccl"):
            raise ValueError(f"transport {transport!r} runs on CPU tensors; CUDA needs 'nccl'")
        if req is not None and req.type != "cuda":
            raise ValueError(f"transport 'nccl' needs a CUDA device, got device={req}")
        return "nccl", req
    if req is not None and req.type != "cpu":
        raise ValueError(f"unsupported device {req}; pycomm runs on 'cpu' or CUDA devices")
    return transport, req


def _slice_bytes(slice_bytes: int | None, transport: str) -> int:
    """The explicit slice size, else PYCOMM_SLICE_BYTES, else the transport's."""
    if slice_bytes is not None:
        return int(slice_bytes)
    default = {"nccl": DEFAULT_CUDA_SLICE_BYTES, "gloo": DEFAULT_GLOO_SLICE_BYTES}.get(
        transport, DEFAULT_SLICE_BYTES)
    if not os.environ.get("PYCOMM_SLICE_BYTES"):
        return default
    return _env_number("PYCOMM_SLICE_BYTES", int, "a whole number of bytes (no K/M suffix)")


def _build(st: Any, r: int, n: int, transport: str, device: torch.device | None,
           timeout: timedelta, slice_bytes: int | None, check: bool,
           explicit_check: bool) -> Communicator:
    """Builds the transport and the communicator of rank ``r`` of ``n`` that
    rendezvous through ``st`` (a store prefixed for this communicator alone).
    init() and groups (Communicator._create_group) share it.

    ``transport`` is "nccl", "shm", "gloo" or "auto" (CPU: shm when every rank
    runs on this host and shared memory can be set up, else gloo).
    """
    timeout_ms = int(timeout.total_seconds() * 1000)
    impl = None
    keepalive: list[Any] = []
    if transport == "auto":
        transport = "shm" if _same_host(st, "auto", r, n) else "gloo"
        if transport == "shm":
            impl = _init_shm(st, r, n, timeout_ms, _slice_bytes(slice_bytes, "shm"),
                             fallback_ok=True)
            if impl is None:
                transport = "gloo"
    elif transport == "shm":
        impl = _init_shm(st, r, n, timeout_ms, _slice_bytes(slice_bytes, "shm"), fallback_ok=False)
    if transport == "nccl":
        impl = _make_nccl(st, r, n, _cuda_device(device), timeout,
                          _slice_bytes(slice_bytes, "nccl"))
    elif transport == "gloo":
        pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", st), r, n, timeout)
        impl = _C.make_gloo_comm(pg, timeout_ms, _slice_bytes(slice_bytes, "gloo"))
        keepalive.append(pg)
    if impl is None:
        raise ValueError(f"transport {transport!r} is not available in this build")
    if check:
        if hasattr(impl, "check"):
            impl.check = True
        elif explicit_check:
            impl.close()
            raise ValueError(f"check=True is not supported by the {transport!r} transport")
    settings = _Settings(transport=transport, device=torch.device(impl.device), timeout=timeout,
                         slice_bytes=int(impl.slice_bytes),
                         check=bool(getattr(impl, "check", False)))
    return Communicator(impl, store=st, settings=settings, keepalive=keepalive)


def get_default() -> Communicator:
    """The communicator the module-level functions use (the last ``init``)."""
    if _default is None:
        raise RuntimeError("pycomm.init() has not been called (or the communicator was closed)")
    return _default


def is_initialized() -> bool:
    return _default is not None
