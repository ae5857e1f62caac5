"""DistributedDataParallel: DDP's gradient bucketing, in readable Python.

One iteration, as every rank runs it::

    forward ──> [join: 1 all-reduce: who is active, who syncs]
                [buffers: broadcast from rank 0 / the highest active rank]
                module(...)  ──> find_unused: walk the graph from the outputs
    backward ─> (1) a parameter's gradient is accumulated
                    (register_post_accumulate_grad_hook) -> copy it into its
                    bucket's flat buffer (or it already is a view of it)
                (2) a bucket whose gradients are all ready is full; full
                    buckets launch their async all-reduce (or the comm hook)
                    strictly in bucket index order, so every rank submits the
                    same collectives in the same order
                (3) autograd's end-of-backward callback: buckets that never
                    filled (parameters without a gradient) launch with zeros,
                    then one small all-reduce of the per-parameter "used"
                    flags; wait for all of it
                (4) the flags say which parameters got no gradient anywhere
                    (left alone with find_unused_parameters) or somewhere
                    (DDP's error, raised on every rank: nobody hangs)
                (5) averaged gradients written back into ``.grad``
                (6) after the first synchronised iteration only: rank 0's
                    gradient-ready order is broadcast and every rank rebuilds
                    its buckets in that order

Every collective above is issued by every rank in the same order, including
ranks that have run out of data inside :meth:`DistributedDataParallel.join`:
they answer each of (join, buffers, (2)-(6)) with zeros.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .._grad_bucket import GradBucket
from ..comm import Communicator, Work, get_default
from ._records import CommHook, _Bucket, _InFlight, _JoinState
from ._sync import broadcast_coalesced, check_same_parameters
from ._unused import find_tensors, late_gradient_error, params_reached, unused_error
from .buckets import bucket_size_limits, compute_bucket_assignment_by_size
from .stats import BucketStats, DDPStats, IterationStats, comm_overlap

__all__ = ["DistributedDataParallel"]

_REDUCIBLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_STATS_HISTORY = 10_000


def _as_communicator(comm: Any) -> Communicator:
    """``comm``, which must be a pycomm.Communicator (TypeError otherwise)."""
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a pycomm.Communicator, got {type(comm).__name__}")
    return comm


def _grad_ready_hook(ref: "weakref.ref[DistributedDataParallel]", i: int) -> Callable:
    """Parameter i's post-accumulate-grad hook (holds the DDP weakly)."""
    def hook(_param: torch.Tensor) -> None:
        ddp = ref()
        if ddp is not None:
            ddp._on_grad_ready(i)
    return hook


def _output_grad_hook(ref: "weakref.ref[DistributedDataParallel]") -> Callable:
    """A forward output's gradient hook: backward has started."""
    def hook(_grad: torch.Tensor) -> None:
        ddp = ref()
        if ddp is not None:
            ddp._start_backward()
    return hook


class DistributedDataParallel(nn.Module):
    """Data parallelism with DDP's gradient bucketing, over a pycomm communicator.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel``'s common
    arguments. The constructor makes every rank's parameters and buffers equal
    to rank 0's; each synchronised backward averages the gradients over the
    ranks, overlapping the all-reduces with the rest of backward.

    Args:
        module: the model; its parameters that require grad are synchronised.
        comm: the communicator (default: :func:`pycomm.get_default`). The
            parameters must live on its device.
        bucket_cap_mb: size limit of a gradient bucket in MiB.
        first_bucket_mb: size limit of the first bucket (the gradients ready
            first), so the first all-reduce starts early.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics)
            to every rank in the constructor and at the start of each
            forward, as torch does; ``False`` keeps them rank-local.
        find_unused_parameters: walk the autograd graph from the forward's
            outputs and treat parameters it does not reach as ready at once;
            parameters that get no gradient on any rank keep their ``.grad``.
            Without it, a parameter without a gradient raises on every rank.
        gradient_as_bucket_view: make each ``.grad`` a view into its bucket's
            flat buffer (default ``True``; torch's default is ``False``). It
            saves the copy into the bucket, the copy back and the memory of
            the grads: backward accumulates straight into the bucket, which
            is all-reduced in place. Pass ``False`` where code needs the
            ``.grad`` tensors to be their own: it calls ``p.grad.detach_()``
            or ``requires_grad_()`` on them (an error on a view, as in torch),
            or keeps a reference to a ``.grad`` across steps and expects it
            unchanged (the bucket is reused by the next step).
        static_graph: the set of used parameters never changes: the first
            iteration detects unused parameters (as find_unused_parameters
            does); later iterations skip the graph walk and the used-flags
            all-reduce.

    Differences from torch's DDP: buckets are real from the first iteration
    (torch uses one bucket until the rebuild unless find_unused_parameters;
    here every rank launches in bucket index order whatever its ready order,
    so an early order mismatch costs overlap, never correctness); the rebuild
    also happens with find_unused_parameters; an unused parameter raises at
    the end of the backward that missed it, on every rank (torch raises in
    the next forward and can hang when only some ranks miss it), at the cost
    of one small all-reduce per iteration (``static_graph=True`` drops it
    after the first). Not supported: ``device_ids``/``output_device``,
    sparse gradients, mixed precision, ``bucket_cap_mb`` lists.

    On GPU (transport ``nccl``): the copies into buckets, the all-reduces
    (ordered after the current stream) and the write-back are enqueued on
    streams with no host wait per bucket;
    the end of backward reads the used flags on the host once per iteration
    (not with ``static_graph=True`` after the first), and comm hooks'
    futures are CUDA-aware (completed at the enqueue, read on the stream),
    so a hook costs no host wait either. ``stats()`` times are host times:
    on GPU an op's "done" is when it was enqueued, so its communication and
    hidden times say nothing about the GPU (use the CUDA profiler).

    Raises:
        TypeError: ``module`` or ``comm`` of the wrong type, or a parameter
            dtype that cannot be all-reduced.
        ValueError: no parameter requires grad, a parameter on another device
            than the communicator, bad bucket sizes, or ranks whose
            parameters differ (raised on every rank, naming the parameter).

    Example::
        >>> comm = pycomm.init()                       # under torchrun
        >>> ddp = DistributedDataParallel(model, comm)
        >>> opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        >>> loss_fn(ddp(x), y).backward()              # gradients averaged here
        >>> opt.step()
        >>> print(ddp.stats())                         # buckets, overlap
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator | None = None,
        bucket_cap_mb: float = 25,
        first_bucket_mb: float = 1,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        comm = _as_communicator(get_default() if comm is None else comm)
        for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of MiB, got {value!r}")
        self.module = module
        self.comm = comm
        self.broadcast_buffers = bool(broadcast_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.static_graph = bool(static_graph)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._limits = bucket_size_limits(bucket_cap_mb, first_bucket_mb)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DistributedDataParallel: the module has no parameter that "
                             "requires grad; there is nothing to synchronise")
        self._names = [n for n, _ in named]
        self._params: list[nn.Parameter] = [p for _, p in named]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._module_buffers = list(module.buffers())
        try:
            self._check_params()
            local_error: Exception | None = None
        except (TypeError, ValueError) as e:
            local_error = e
        # A collective even when this rank failed, so the others raise too.
        self._match_rank0(comm, local_error)

        n = len(self._params)
        self._comm_hook: CommHook | None = None
        self._hook_state: Any = None
        self._join: _JoinState | None = None
        self._active = comm.world_size  # ranks contributing this iteration
        self._buffer_src = 0
        self._iteration = 0  # synchronised backward passes so far
        self._rebuild_pending = True
        self._rebuilt_after: int | None = None
        self._static_counts: list[int] | None = None
        self._static_unused: list[int] = []
        self._used = [False] * n  # got a gradient since the last sync (no_sync included)
        self._history: deque[IterationStats] = deque(maxlen=_STATS_HISTORY)
        self._reset_iteration()

        # Initial buckets: reverse registration order (the usual gradient-ready
        # order), small first bucket; rebuilt once after the first iteration.
        self._assign_buckets(list(reversed(range(n))))

        me = weakref.ref(self)
        self._grad_hooks = [p.register_post_accumulate_grad_hook(_grad_ready_hook(me, i))
                            for i, p in enumerate(self._params)]

    # ------------------------------------------------------------ setup
    def _check_params(self) -> None:
        dev = self.comm.device
        for name, p in zip(self._names, self._params):
            if p.dtype not in _REDUCIBLE:
                raise TypeError(f"parameter {name!r} has dtype {p.dtype}; DistributedDataParallel "
                                f"all-reduces {', '.join(str(d) for d in _REDUCIBLE)}")
            same = p.device.type == dev.type and (dev.index is None or p.device.index == dev.index)
            if not same:
                raise ValueError(f"parameter {name!r} is on {p.device} but the communicator runs "
                                 f"on {dev}; move the module to {dev} before wrapping it")
            if p.is_sparse:
                raise ValueError(f"parameter {name!r} is sparse; only dense gradients are supported")

    def _match_rank0(self, comm: Communicator, local_error: Exception | None = None) -> None:
        """Makes every rank's model rank 0's, a collective of ``comm``: raises
        on every rank unless all wrap the same parameters (``local_error``,
        this rank's own failed check, is named to the others, then raised
        here); then broadcasts rank 0's parameters (and, with
        broadcast_buffers, its buffers)."""
        every = list(self.module.named_parameters())  # frozen ones are broadcast too
        check_same_parameters(comm, [p for _, p in every], [n for n, _ in every],
                              str(local_error) if local_error else None)
        if local_error is not None:
            raise local_error
        # As torch: every parameter, frozen ones (requires_grad=False) too, so
        # that all ranks compute with rank 0's model; broadcast_buffers=False
        # keeps rank-local buffers, at init too.
        synced = [p for _, p in every] + (
            self._module_buffers if self.broadcast_buffers else [])
        broadcast_coalesced(comm, synced, src=0)

    def _assign_buckets(self, order: list[int]) -> None:
        """Buckets for the parameters in gradient-ready ``order`` (their
        indices), filled in that order up to the size limits."""
        assignment, _ = compute_bucket_assignment_by_size(
            [self._params[i] for i in order], self._limits, order)
        self._set_buckets(assignment)

    def _set_buckets(self, assignment: list[list[int]]) -> None:
        """Allocates the buckets; with gradient_as_bucket_view, existing
        ``.grad``s move into them and become views."""
        self._buckets = [_Bucket(b, idx, self._params) for b, idx in enumerate(assignment)]
        self._loc: list[tuple[int, int]] = [(0, 0)] * len(self._params)
        for bucket in self._buckets:
            for pos, i in enumerate(bucket.param_indices):
                self._loc[i] = (bucket.index, pos)
                p = self._params[i]
                if self.gradient_as_bucket_view and p.grad is not None:
                    bucket.views[pos].copy_(p.grad)
                    p.grad = bucket.views[pos]

    def _reset_iteration(self) -> None:
        n = len(self._params)
        self._sync_pending = False  # a synchronising forward expects its backward
        self._in_backward = False
        self._ready = [False] * n
        self._late: list[int] = []  # treated as unused, then got a gradient
        self._unused_now: list[int] = []
        if self._rebuild_pending:
            self._ready_order: list[int] = []
        self._next_bucket = 0
        self._inflight: list[_InFlight] = []
        self._t_first = 0.0
        for bucket in getattr(self, "_buckets", []):
            bucket.pending = len(bucket.param_indices)

    # ------------------------------------------------------------ forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._join is not None:
            self._join_notify(active=True, sync=sync)
        if self._will_sync_buffers():
            broadcast_coalesced(self.comm, self._module_buffers, src=self._buffer_src)
        self._reset_iteration()
        outputs = self.module(*inputs, **kwargs)
        if sync:
            self._prepare_for_backward(outputs)
        self.require_forward_param_sync = sync
        return outputs

    def _will_sync_buffers(self) -> bool:
        return (self.broadcast_buffers and bool(self._module_buffers)
                and self.require_forward_param_sync and self.comm.world_size > 1)

    def _find_unused_now(self) -> bool:
        return self.find_unused_parameters or (self.static_graph and self._iteration == 0)

    def _prepare_for_backward(self, outputs: Any) -> None:
        """Arms the backward hooks; finds the parameters this forward did not use."""
        self._sync_pending = True
        tensors = [t for t in find_tensors(outputs) if t.requires_grad]
        if self._find_unused_now():
            reached = params_reached(tensors, self._index_of)
            self._unused_now = [i for i in range(len(self._params)) if i not in reached]
        elif self.static_graph:
            self._unused_now = list(self._static_unused)
        me = weakref.ref(self)
        for t in tensors:
            # Backward reaching an output starts DDP's iteration even if no
            # parameter then gets a gradient (the others must not wait for us).
            if t.grad_fn is not None:
                t.register_hook(_output_grad_hook(me))

    # ------------------------------------------------------------ backward
    def _start_backward(self) -> bool:
        """First event of a synchronised backward: schedules the end-of-backward
        callback and marks the unused parameters ready."""
        if not self._sync_pending or self._in_backward:
            return False
        self._in_backward = True
        self._t_first = time.perf_counter()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        for i in self._unused_now:
            self._mark_ready(i)
        return True

    def _on_grad_ready(self, i: int) -> None:
        """register_post_accumulate_grad_hook: parameter i's gradient is complete."""
        self._used[i] = True
        if not self._sync_pending:
            return  # no_sync(), no grad sync, or the module called directly
        self._start_backward()
        if self._ready[i]:
            self._late.append(i)  # already sent as unused; reported at the end
            return
        if self._rebuild_pending:
            self._ready_order.append(i)
        self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        """Puts parameter i's gradient (zeros if it has none) into its bucket;
        launches every full bucket that is next in order."""
        self._ready[i] = True
        b, pos = self._loc[i]
        bucket = self._buckets[b]
        view, p = bucket.views[pos], self._params[i]
        grad = p.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            if self.gradient_as_bucket_view:
                p.grad = view
        bucket.pending -= 1
        while self._next_bucket < len(self._buckets) and \
                self._buckets[self._next_bucket].pending == 0:
            nxt = self._buckets[self._next_bucket]
            self._inflight.append(self._launch(nxt.index, nxt.buffer, nxt.views))
            self._next_bucket += 1

    def _divisor(self) -> int:
        join = self._join
        if join is not None and not join.divide_by_initial_world_size:
            return self._active
        return self.comm.world_size

    def _launch(self, index: int, buffer: torch.Tensor, views: list[torch.Tensor],
                register: bool = True) -> _InFlight:
        """Starts bucket ``index``'s reduction: the comm hook, or an averaging
        all-reduce (``register``: registering ``buffer``, a bucket kept from
        step to step, in symmetric memory)."""
        record = _InFlight(buffer=buffer, launched=time.perf_counter())
        if self._comm_hook is None:
            record.start_average(self.comm, self._divisor(), register)
        else:
            params = [self._params[i] for i in self._buckets[index].param_indices]
            record.start_hook(self._comm_hook, self._hook_state,
                              GradBucket(index, buffer, views, params,
                                         index == len(self._buckets) - 1))
        return record

    def _needs_used_flags(self) -> bool:
        return not (self.static_graph and self._iteration > 0)

    def _launch_used_flags(self, flags: list[int], late: bool) -> tuple[torch.Tensor, Work] | None:
        """The all-reduce of [used per parameter..., error]: after the buckets."""
        if not self._needs_used_flags():
            return None
        status = torch.tensor(flags + [int(late)], dtype=torch.int32, device=self.comm.device)
        return status, self.comm.all_reduce(status, async_op=True)

    def _end_of_backward(self) -> None:
        """Autograd's final callback of a synchronised backward: steps (3)-(6)."""
        t_end = time.perf_counter()
        try:
            for i in range(len(self._params)):
                if not self._ready[i]:
                    self._mark_ready(i)  # no gradient here: zeros (or the stale .grad)
            flags = [int(u) for u in self._used]
            status = self._launch_used_flags(flags, bool(self._late))
            # Without unused parameters to leave alone, each bucket is written
            # back as soon as it is reduced, while later ones are still in flight.
            known = self._static_counts if status is None else None
            early = known is not None or not (self.find_unused_parameters or self.static_graph)
            for k, record in enumerate(self._inflight):
                record.wait(k)
                if early:
                    self._write_back(self._buckets[k], known)
            t_waited = time.perf_counter()
            counts = self._check_used(status, flags)
            if not early:
                for bucket in self._buckets:
                    self._write_back(bucket, counts)
            self._iteration += 1
            self._record_stats(t_end, t_waited)
            self._used = [False] * len(self._params)
            if self._rebuild_pending:
                self._rebuild()
        finally:
            self._reset_iteration()

    def _check_used(self, status: tuple[torch.Tensor, Work] | None, flags: list[int]) -> list[int]:
        """Waits for the used flags; raises (on every rank alike) DDP's errors.

        Returns:
            per parameter, on how many ranks it got a gradient.
        """
        if status is None:
            assert self._static_counts is not None
            return self._static_counts
        tensor, work = status
        work.wait()
        values = tensor.tolist()
        counts, late = values[:-1], values[-1]
        if late:
            raise RuntimeError(late_gradient_error([self._names[i] for i in self._late]))
        if not self._find_unused_now() and not self.static_graph:
            missing = [i for i, c in enumerate(counts) if c != self._active]
            if missing:
                raise RuntimeError(unused_error(self._names, missing, counts, flags, self._active))
        if self.static_graph and self._static_counts is None:
            self._static_counts = counts
            self._static_unused = [i for i, f in enumerate(flags) if not f]
        return counts

    def _write_back(self, bucket: _Bucket, counts: list[int] | None) -> None:
        """A bucket's averaged gradients into ``.grad``; parameters that no
        rank used (``counts`` 0) keep theirs."""
        for pos, i in enumerate(bucket.param_indices):
            if counts is not None and counts[i] == 0:
                continue
            p, view = self._params[i], bucket.views[pos]
            if self.gradient_as_bucket_view:
                p.grad = view
            elif p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)

    def _record_stats(self, t_end: float, t_waited: float) -> None:
        records = self._inflight
        comm_s, hidden_s = comm_overlap(
            [r.launched for r in records],
            [r.done if r.done is not None else t_waited for r in records], t_end)
        self._history.append(IterationStats(
            iteration=self._iteration, backward_s=t_end - self._t_first, comm_s=comm_s,
            hidden_s=hidden_s, wait_s=t_waited - t_end,
            bytes_reduced=sum(b.nbytes for b in self._buckets), buckets=len(records)))

    def _rebuild(self) -> None:
        """Step (6), a collective: adopt rank 0's gradient-ready order."""
        n = len(self._params)
        seen = set(self._ready_order)
        order = self._ready_order + [i for i in reversed(range(n)) if i not in seen]
        mine = order if self._ready_order else [-1] * n
        t = torch.tensor(mine, dtype=torch.int64, device=self.comm.device)
        self.comm.broadcast(t, src=0)
        self._rebuild_pending = False
        self._ready_order = []
        order = t.tolist()
        if order[0] < 0:
            return  # rank 0 never ran a backward (joined at once): keep the buckets
        if sorted(order) != list(range(n)):
            raise RuntimeError(f"DistributedDataParallel: rank 0's bucket order {order} is not a "
                               "permutation of the parameters (ranks wrap different models?)")
        self._assign_buckets(order)
        self._rebuilt_after = self._iteration

    # ------------------------------------------------------------ public API
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the first
        synchronised backward after it averages the sum.

        Example::
            >>> with ddp.no_sync():
            ...     loss_fn(ddp(x1), y1).backward()   # local only
            >>> loss_fn(ddp(x2), y2).backward()       # averages x1's + x2's
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replaces the averaging all-reduce of each bucket by ``hook``.

        Torch's contract: ``hook(state, bucket) -> torch.futures.Future`` whose
        value is a tensor with the bucket's ``buffer().numel()`` elements, the
        reduced (averaged) gradients. ``bucket`` is a :class:`GradBucket`. Hooks
        run in bucket order on every rank, so collectives they issue match up.
        Works with ``pycomm.hooks`` and with torch's own hooks (whose state is
        a torch process group).

        Args:
            state: passed to the hook unchanged (e.g. the communicator).
            hook: the hook; register before the first synchronised backward,
                once.

        Raises:
            TypeError: ``hook`` is not callable with two arguments.
            RuntimeError: a hook is already registered, or training started.

        Example::
            >>> def allreduce_avg(comm, bucket):
            ...     fut = comm.all_reduce(bucket.buffer(), op="avg", async_op=True).get_future()
            ...     return fut.then(lambda f: f.value()[0])
            >>> ddp.register_comm_hook(comm, allreduce_avg)
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        try:
            inspect.signature(hook).bind(state, None)
        except TypeError:
            raise TypeError("hook must take two arguments (state, bucket)") from None
        except ValueError:
            pass  # no signature (a builtin): trust it
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once")
        if self._iteration > 0:
            raise RuntimeError("register_comm_hook must be called before the first "
                               "synchronised backward")
        self._comm_hook, self._hook_state = hook, state

    def stats(self) -> DDPStats:
        """Buckets (sizes, parameter names) and, per synchronised iteration,
        bytes reduced, communication time and the share of it hidden behind
        backward. ``print(ddp.stats())`` shows them as tables."""
        buckets = [BucketStats(index=b.index, params=[self._names[i] for i in b.param_indices],
                               numel=b.buffer.numel(), nbytes=b.nbytes,
                               dtype=str(b.buffer.dtype).replace("torch.", ""),
                               device=str(b.buffer.device)) for b in self._buckets]
        return DDPStats(buckets=buckets, iterations=list(self._history),
                        rebuilt_after=self._rebuilt_after, world_size=self.comm.world_size)

    def bucket_assignment(self) -> list[list[str]]:
        """The parameter names of each bucket, in communication order."""
        return [[self._names[i] for i in b.param_indices] for b in self._buckets]

    # ------------------------------------------------------------ join
    def rebind(self, comm: Communicator) -> None:
        """Carries on over ``comm``, e.g. the survivors' communicator from
        :meth:`pycomm.Communicator.shrink` after a peer died (a collective of
        ``comm``'s ranks).

        Forgets the iteration a failure interrupted (redo that step: zero the
        gradients, forward, backward), gives every bucket a fresh buffer (the
        old communicator's symmetric memory is not reused), makes every
        rank's parameters and buffers equal to ``comm``'s rank 0's, as the
        constructor does, and, when a comm hook's state is the old
        communicator, replaces it with ``comm`` (another state that holds the
        old communicator must be registered again). The bucket layout,
        statistics and static-graph knowledge stay.

        Raises:
            TypeError: ``comm`` is not a pycomm.Communicator.
            ValueError: the parameters are not on ``comm``'s device, or
                differ in shape or dtype between ``comm``'s ranks.
        """
        old, self.comm = self.comm, _as_communicator(comm)
        if self._hook_state is old:
            self._hook_state = comm
        self._join = None
        self._active = comm.world_size
        self._check_params()
        self._match_rank0(comm)
        self._set_buckets([bucket.param_indices for bucket in self._buckets])
        self._reset_iteration()

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Iterator[None]:
        """Training with uneven inputs: a rank that leaves the block early
        shadows the others' collectives with zeros until every rank has left.

        Each forward inside the block starts with one small all-reduce saying
        which ranks are still active and whether they synchronise gradients.
        A rank that has run out of data answers it, and every buffer broadcast
        and gradient all-reduce (through the comm hook, if any) of the others,
        with zeros. When all ranks are done, the parameters and buffers of the
        highest rank among the last to finish are broadcast to all.

        Args:
            divide_by_initial_world_size: average over all ranks (joined ones
                count as zeros, torch's default) instead of the active ones.
            enable: ``False`` makes it a no-op.
            throw_on_early_termination: raise ``RuntimeError`` on every rank as
                soon as one rank runs out of data, instead of shadowing.

        Example::
            >>> with ddp.join():
            ...     for x, y in my_batches:               # counts differ by rank
            ...         loss_fn(ddp(x), y).backward(); opt.step(); opt.zero_grad()
        """
        if not enable:
            yield
            return
        if self._join is not None:
            raise RuntimeError("DistributedDataParallel.join() contexts cannot be nested")
        self._join = _JoinState(bool(divide_by_initial_world_size), bool(throw_on_early_termination))
        try:
            yield
            self._shadow_until_all_joined()
        finally:
            self._join = None
            self._active = self.comm.world_size
            self._buffer_src = 0

    def _join_notify(self, active: bool, sync: bool) -> bool:
        """The per-iteration all-reduce of [active per rank..., syncing ranks]
        (:meth:`_JoinState.notify`); adopts the active ranks it names.

        Returns:
            whether any rank is still active.
        """
        join = self._join
        assert join is not None  # inside join()
        shadow_sync = join.notify(self.comm, active, sync)
        if shadow_sync is None:
            return False
        self._active = len(join.last_active)
        self._buffer_src = max(join.last_active)
        self._shadow_sync = shadow_sync
        return True

    def _shadow_until_all_joined(self) -> None:
        """This rank is out of data: match the others' iterations with zeros."""
        while self._join_notify(active=False, sync=False):
            if self._will_sync_buffers():
                broadcast_coalesced(self.comm, self._module_buffers, src=self._buffer_src)
            self.require_forward_param_sync = self._shadow_sync
            if self._shadow_sync:
                self._shadow_backward()
        assert self._join is not None  # inside join()
        src = max(self._join.last_active) if self._join.last_active else 0
        broadcast_coalesced(self.comm, self._params + self._module_buffers, src=src)

    def _shadow_backward(self) -> None:
        """Steps (2)-(6) of an iteration with zero gradients."""
        records = []
        for bucket in self._buckets:
            zeros = torch.zeros_like(bucket.buffer)
            views = [zeros[o:o + v.numel()].view(v.shape) for o, v in
                     zip(itertools.accumulate([0] + [v.numel() for v in bucket.views]),
                         bucket.views)]
            records.append(self._launch(bucket.index, zeros, views, register=False))
        n = len(self._params)
        status = self._launch_used_flags([0] * n, False)
        for k, record in enumerate(records):
            record.wait(k)
        self._check_used(status, [0] * n)
        self._iteration += 1
        if self._rebuild_pending:
            self._rebuild()
