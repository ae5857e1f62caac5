"""The communicator: pycomm's torch.distributed-style API over the C++ core.

Python here only orchestrates: :func:`init` rendezvouses through a c10d
Store and picks a transport (the steps live in pycomm._setup), and each call
is forwarded to pycomm._C.Comm, which validates tensors and runs the C++
algorithms (csrc/core).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal, Sequence, overload

import torch
import torch.distributed as dist

from . import _setup, _shrink, _store
from ._ext import CommError, Work
from ._p2p import PointToPoint
from ._setup import (  # noqa: F401 - the defaults stay importable from pycomm.comm
    DEFAULT_CUDA_SLICE_BYTES,
    DEFAULT_GLOO_SLICE_BYTES,
    DEFAULT_SLICE_BYTES,
    DEFAULT_TIMEOUT,
    Settings,
)
from ._symmetric import SymmetricMemory
from ._types import (  # noqa: F401 - _to_op stays importable from pycomm.comm
    OpLike,
    P2POp,
    ReduceOp,
    _need_tensors,
    _splits,
    _tensor_list,
    _to_op,
    _to_wire,
)

__all__ = ["CommError", "Communicator", "P2POp", "ReduceOp", "Work", "init", "get_default",
           "is_initialized"]


# The communicator of the module-level functions (pycomm.all_reduce, ...):
# the last one init(set_default=True) created, until it closes.
_default: Communicator | None = None
_default_lock = threading.Lock()


def _set_default(comm: Communicator | None, *, if_current: Communicator | None = None) -> None:
    """Makes ``comm`` the default; with ``if_current``, only while that one is."""
    global _default
    with _default_lock:
        if if_current is None or _default is if_current:
            _default = comm


#: Transport objects of communicators closed in a forked child (see
#: Communicator.close): kept alive until the process exits.
_forked_leaks: list[Any] = []


class Communicator(PointToPoint, SymmetricMemory):
    """A group of ranks and the transport between them.

    Create one with :func:`pycomm.init`, or over a subset of an existing
    communicator's ranks with :meth:`new_group` / :meth:`split`. All ranks
    must call collectives in the same order. Operations are in place, like
    ``torch.distributed``; with ``async_op=True`` they return a :class:`Work`
    and run on a background thread (CPU) in submission order. Usable as a
    context manager (closes).
    """

    def __init__(self, impl: Any, *, store: Any, settings: Settings,
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
        self._shrinks = 0  # shrink() calls (every survivor makes them)
        # A group's member count: its store keys go once every member has
        # closed it (_store.release_keys); None for other communicators.
        self._members_to_release: int | None = None

    # -- properties ------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the communicator (0 .. world_size - 1)."""
        return self._impl.rank

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self._impl.world_size

    @property
    def device(self) -> torch.device:
        """Where its tensors live: ``cpu``, or the CUDA device of an nccl communicator."""
        return torch.device(self._impl.device)

    @property
    def transport(self) -> str:
        """``"shm"``, ``"gloo"``, ``"nccl"`` or, across hosts, ``"shm+gloo"`` (``"auto"``'s)."""
        return self._impl.transport

    @property
    def check(self) -> bool:
        """Checked mode: ranks compare call fingerprints before each collective."""
        return bool(getattr(self._impl, "check", False))

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._impl.closed

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, "
                f"transport={self.transport!r}, device={str(self.device)!r})")

    # -- collectives -----------------------------------------------------
    # The overloads tell type checkers that async_op=True always gives a Work.
    @overload
    def all_reduce(
        self, tensor: torch.Tensor, op: OpLike = ..., algo: str = ...,
        *, async_op: Literal[True], wire_dtype: torch.dtype | str | None = ...,
        register: bool = ..., wire_block: int = ..., residual: torch.Tensor | None = ...,
    ) -> Work: ...

    @overload
    def all_reduce(
        self, tensor: torch.Tensor, op: OpLike = ..., algo: str = ...,
        async_op: bool = ..., wire_dtype: torch.dtype | str | None = ...,
        register: bool = ..., wire_block: int = ..., residual: torch.Tensor | None = ...,
    ) -> Work | None: ...

    def all_reduce(
        self, tensor: torch.Tensor, op: OpLike = ReduceOp.SUM, algo: str = "auto",
        async_op: bool = False, wire_dtype: torch.dtype | str | None = None,
        register: bool = False, wire_block: int = 256, residual: torch.Tensor | None = None,
    ) -> Work | None:
        """Reduces ``tensor`` across all ranks in place; every rank gets the
        bitwise-identical result.

        Args:
            tensor: contiguous tensor on the communicator's device.
            op: SUM, AVG (floating dtypes), MAX, MIN or PRODUCT.
            algo: "auto" (the fastest for the size and transport), "ring",
                "nccl" (GPU native), "direct" (shm: every rank reduces from
                the others' shared buffers), "recursive_doubling",
                "halving_doubling" or "tree" (README, "Algorithms").
            async_op: return a :class:`Work` instead of waiting.
            wire_dtype: ``None``, or ``torch.float16`` / ``torch.bfloat16``
                (or the strings ``"float16"`` / ``"bfloat16"``) for a float32
                ``tensor``: the ring then sends every step in that dtype and
                accumulates in float32 (one rounding per ring step); each
                chunk's owner rounds its final value too: every rank ends with
                ``wire(op over ranks)``. Ring only. ``torch.int8``, ``float8_e4m3fn``,
                ``float8_e5m2`` (SUM/AVG of float32, bfloat16 or float16 on CPU
                or CUDA, summed in float32): one float32 scale per ``wire_block``
                elements, each contribution and the sum quantized once.
            residual: quantized wire's error feedback, float32, ``tensor``'s size:
                ``tensor + residual`` is sent, ``residual`` gets what it lost.
            register: on ``shm``, register ``tensor``: move its storage into
                symmetric memory during this op (as :meth:`register_tensor`
                does), for a buffer that is reduced again and again (a
                gradient bucket). It moves only if every rank registers, with
                ``algo`` "auto" or "direct", and ``tensor`` is all of a
                storage that torch's CPU allocator made; otherwise nothing
                moves and the op stages as usual, so ranks cannot disagree.
                With ``async_op=True`` the call returns once the op has
                decided (ops issued later must see the new address; with one
                rank, once the op is done). A storage some rank declined is
                not registered again. Ignored elsewhere, inside Future callbacks
                (on the worker thread), and for a tensor already registered.

        Raises:
            TypeError: unsupported dtype. ValueError: wrong device, layout,
            op or algo, AVG on integers, a wire_dtype it cannot send, or a
            bad residual.
            CommError: the collective failed on this or a peer rank.
        """
        if not isinstance(tensor, torch.Tensor):  # the common case pays no call
            _need_tensors("all_reduce", tensor=tensor)
        wire = -1 if wire_dtype is None else _to_wire(wire_dtype)
        return self._impl.all_reduce(tensor, op if type(op) is ReduceOp else _to_op(op), algo,
                                     async_op, wire, register, wire_block, residual)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: OpLike = ReduceOp.SUM,
        algo: str = "auto", async_op: bool = False,
    ) -> Work | None:
        """``output`` (m elements) on rank r gets op over ranks of
        ``input[r*m:(r+1)*m]``; ``input`` has world_size * m elements
        (like ``torch.distributed.reduce_scatter_tensor``). ``algo``:
        "auto" (on shm: "direct"), "ring", "direct" (shm) or "nccl" (GPU)."""
        _need_tensors("reduce_scatter", output=output, input=input)
        return self._impl.reduce_scatter(output, input, _to_op(op), algo, async_op)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, algo: str = "auto",
        async_op: bool = False,
    ) -> Work | None:
        """``output`` (world_size * m elements) gets every rank's ``input`` (m
        elements) in rank order (like ``all_gather_into_tensor``). ``algo``:
        "auto", "ring", "bruck" (ceil(log2 n) steps instead of n-1: for
        small blocks) or "nccl" (GPU)."""
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

    # -- symmetric memory (register_tensor, ...) and point to point (send,
    # recv, ...): the base classes SymmetricMemory (pycomm/_symmetric.py) and
    # PointToPoint (pycomm/_p2p.py)

    # -- groups -----------------------------------------------------------
    def new_group(self, ranks: Sequence[int], *,
                  timeout: timedelta | float | None = None) -> Communicator | None:
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
        return self._create_group(_setup.group_members(ranks, self.world_size), timeout)

    def split(
        self, color: int | None, key: int | None = None, *,
        timeout: timedelta | float | None = None,
    ) -> Communicator | None:
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
        color = -1 if color is None else _setup.as_int64(color, "color")
        key = self.rank if key is None else _setup.as_int64(key, "key")
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
                    timeout: timedelta | float | None) -> Communicator | None:
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
        impl.auto_table = _setup.auto_table_for("cuda", "nccl", impl.world_size)  # its own size
        store = dist.PrefixStore(f"nccl-split/{self._nccl_splits}/{color}", self._store)
        return Communicator(impl, store=store, settings=settings)

    def _group_settings(self, timeout: timedelta | float | None) -> Settings:
        """A sub-communicator's settings: this one's, with ``timeout`` if given."""
        if timeout is None:
            return self._settings
        return replace(self._settings, timeout=_setup.timeout_from(timeout))

    def _check_usable(self, op: str) -> None:
        if self.closed:
            raise RuntimeError(f"{op}: the communicator is closed")
        if os.getpid() != self._pid:
            raise RuntimeError(f"{op}: this communicator belongs to process {self._pid} and "
                               f"cannot be used in a forked child (pid {os.getpid()})")

    def _create_group(self, members: tuple[int, ...],
                      timeout: timedelta | float | None) -> Communicator | None:
        """Builds the group ``members`` (ordered ranks) on the members, None
        elsewhere; the rendezvous names the members and this rank's count of such groups."""
        if self.rank not in members:
            return None
        self._group_counts[members] = count = self._group_counts.get(members, 0) + 1
        ident = hashlib.sha1(",".join(map(str, members)).encode()).hexdigest()[:16]
        settings = replace(self._group_settings(timeout), require_check=self._settings.check)
        st, me = dist.PrefixStore(f"group/{ident}/{count}", self._store), members.index(self.rank)
        try:  # a member that exited meanwhile is named at once, one absent at the timeout
            with _store.bounded_by(settings.timeout), \
                    _store.watching_liveness(_shrink.group_exited(self._store, members), members):
                # every member present first, whatever the transport (gloo's
                # own rendezvous would only time out, naming a key)
                _store.all_gather(st, "arrived", me, len(members), "", "the group's rendezvous")
                if st.check(["abandoned"]):  # this rank came after the others gave up
                    raise CommError(f"the other members gave up first: {st.get('abandoned').decode()}")
                group = _build(st, me, len(members), settings)
                group._members_to_release = len(members)
                return group
        except (RuntimeError, dist.DistError) as e:  # setup failed, or a member never came
            why = _shrink.group_setup_failure(self._store, members, self.rank, e)
            with contextlib.suppress(Exception):  # tells a member that comes later
                st.set("abandoned", why)
            raise CommError(why) from e

    def shrink(self, exclude: Sequence[int] | None = None, *,
               timeout: timedelta | float | None = None) -> Communicator:
        """A new communicator over the ranks that continue after a failure:
        a collective of the survivors, the idea of NCCL's ``ncclCommShrink``.

        Call it on every surviving rank once an operation has raised
        :class:`CommError` because peers died. The survivors agree on who
        continues through the store: a rank on this host whose process has
        exited is left out at once; a rank on another host (whose death
        cannot be seen from here) is left out unless it calls ``shrink``
        within ``PYCOMM_SHRINK_GRACE`` seconds (default 2) of this rank.
        With ``exclude``, the survivors name the ranks that leave instead
        (every survivor passes the same list, as with
        ``torch.distributed.shrink_group``).

        The new communicator has this one's transport and settings (shm: a
        new segment; gloo: a new process group; nccl: a new NCCL
        communicator through the store) and renumbers the survivors in their
        old order. This communicator is aborted and closed; groups made from
        it are not carried over (make them again from the new one). If it
        was the default communicator, the new one becomes the default.

        Args:
            exclude: old ranks that leave (default: the dead, found as above).
            timeout: the new communicator's timeout (default: this one's).

        Returns:
            The communicator of the survivors.

        Raises:
            ValueError: ``exclude`` names a rank out of range, or this one.
            RuntimeError: this rank called ``shrink`` after the survivors
                were decided without it.
            CommError: the new transport could not be set up.

        Example::
            >>> try:
            ...     loss.backward()            # a peer dies: CommError
            ... except pycomm.CommError:
            ...     comm = comm.shrink()       # the survivors go on
            ...     ddp.rebind(comm)
        """
        if os.getpid() != self._pid:
            raise RuntimeError("shrink: this communicator belongs to another process")
        settings = replace(self._group_settings(timeout), require_check=self._settings.check)
        base, members = self._agree_on_survivors(exclude, settings.timeout)
        rank, was_default = self.rank, _default is self
        self._impl.abort(f"rank {rank} shrank the communicator to ranks {members}")
        try:
            self.close()
        except CommError:
            pass  # the failure that made us shrink: the caller has seen it
        with _store.bounded_by(settings.timeout):  # a survivor that stops now: at the timeout
            new = _build(dist.PrefixStore(f"{base}/comm", self._store), members.index(rank),
                         len(members), settings)
        if was_default:
            _set_default(new)
        return new

    def lost_ranks(self, *, timeout: timedelta | float | None = None) -> list[int]:
        """The ranks that have left, as the survivors agree: :meth:`shrink`'s
        agreement without the new communicator. A collective of the
        survivors, the same list on every one, for an API that takes the
        ranks to exclude (``torch.distributed.shrink_group``; see
        :func:`pycomm.backend.lost_ranks`).

        Raises:
            RuntimeError: this rank called it after the survivors were
                decided without it.
        """
        members = self._agree_on_survivors(None, self._group_settings(timeout).timeout)[1]
        return [q for q in range(self.world_size) if q not in members]

    def _agree_on_survivors(self, exclude: Sequence[int] | None,
                            timeout: timedelta) -> tuple[str, list[int]]:
        """(store key base of this agreement, the old ranks that continue)."""
        self._shrinks += 1
        base = f"shrink/{self._shrinks}"
        return base, _shrink.survivors(self._store, base, self.rank, self.world_size, exclude,
                                       timeout.total_seconds())

    # -- lifetime ---------------------------------------------------------
    def close(self) -> None:
        """Waits for queued operations, then releases the transport. Later
        calls raise. Idempotent.

        Raises:
            CommError: an operation failed and aborted the communicator, and
                no call has raised that failure yet (an async op whose Work
                nobody waited for); everything is released all the same. Not
                after :meth:`abort`, nor once a call raised the failure.
            RuntimeError: called on the communicator's worker thread (inside
                a Future callback), where it would wait for itself; the
                communicator stays open, and the default if it was.
        """
        # A group counts its close once (taken before anything can raise),
        # and only a healthy one releases its keys: an aborted group (a failed
        # op, shrink()) leaves them, and so close() makes no store call where
        # the store may be what failed.
        release, self._members_to_release = self._members_to_release, None
        healthy = not self._impl.aborted
        try:
            self._impl.close()
        except BaseException:
            healthy = False
            raise
        finally:
            if not self._impl.closed:  # refused on the worker thread: still open
                self._members_to_release = release
            else:
                if os.getpid() != self._pid:
                    # A forked child's copy: the transport objects (e.g. the
                    # Gloo process group) own the parent's threads and sockets;
                    # destroying them here could hang. Keep them until exit.
                    _forked_leaks.extend(self._keepalive)
                elif release is not None and healthy:
                    _store.release_keys(self._store, release)
                self._keepalive.clear()
                _set_default(None, if_current=self)

    def abort(self, reason: str = "aborted by the user") -> None:
        """Fails pending and future operations of this communicator at once."""
        self._impl.abort(reason)

    def __enter__(self) -> Communicator:
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
            back to "gloo" if shared memory cannot be set up; across hosts
            with the same number >= 2 of ranks on each, "shm+gloo": shm
            inside a host, gloo between (pycomm/_hierarchy.py); else "gloo").
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
            Either way the keys sit under the launch attempt
            (``TORCHELASTIC_RESTART_COUNT``), so a job that torchrun
            restarts never reads the keys of an earlier attempt.

    Example:
        >>> comm = pycomm.init()                  # under torchrun
        >>> t = torch.ones(4) * comm.rank
        >>> comm.all_reduce(t)                    # t == sum of ranks everywhere
    """
    st, r, n, asked = _setup.prepare(rank, world_size, store, group, transport, device, timeout,
                                     slice_bytes, check, key_prefix)
    comm = _build(st, r, n, asked)
    if set_default:
        _set_default(comm)
    return comm


def _build(st: Any, r: int, n: int, asked: Settings) -> Communicator:
    """The communicator of rank ``r`` of ``n`` that rendezvous through ``st``
    (a store prefixed for this communicator alone), built as ``asked``; init()
    and groups share it (the steps: pycomm._setup.build)."""
    impl, settings, keepalive = _setup.build(st, r, n, asked)
    return Communicator(impl, store=st, settings=settings, keepalive=keepalive)


def get_default() -> Communicator:
    """The communicator the module-level functions use (the last ``init``).

    Raises:
        RuntimeError: no ``init`` yet, or that communicator was closed.
    """
    comm = _default
    if comm is None:
        raise RuntimeError("pycomm.init() has not been called (or the communicator was closed)")
    return comm


def is_initialized() -> bool:
    """True when there is a default communicator (see :func:`get_default`)."""
    return _default is not None
