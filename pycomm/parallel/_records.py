"""The per-iteration records of :class:`DistributedDataParallel`: a bucket's
flat buffer, a launched reduction (how it starts, the wait for its result),
a rank's view of ``join()`` (and the all-reduce that updates it)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch
from torch import nn

from .._grad_bucket import GradBucket
from ..comm import Communicator, ReduceOp, Work

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


class _Bucket:
    """One flat buffer and the parameters whose gradients live in it."""

    def __init__(self, index: int, param_indices: list[int], params: list[nn.Parameter]) -> None:
        self.index = index
        self.param_indices = param_indices
        first = params[param_indices[0]]
        numels = [params[i].numel() for i in param_indices]
        self.buffer = torch.zeros(sum(numels), dtype=first.dtype, device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for i, n in zip(param_indices, numels):
            self.views.append(self.buffer[offset:offset + n].view(params[i].shape))
            offset += n
        self.pending = len(param_indices)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


@dataclasses.dataclass
class _InFlight:
    """A launched bucket (or the used-flags all-reduce)."""

    buffer: torch.Tensor
    launched: float
    work: Work | None = None  # the default path: an all-reduce in place
    future: torch.futures.Future | None = None  # a comm hook's result
    timed: torch.futures.Future | None = None  # completes after `done` is set
    done: float | None = None
    post_scale: float = 1.0

    def start_average(self, comm: Communicator, divisor: int, register: bool) -> None:
        """Launches the all-reduce that averages ``buffer`` over ``divisor``
        ranks: AVG when that is every rank, else a SUM that :meth:`wait`
        scales by ``post_scale`` (``register``: registering ``buffer``, a
        bucket kept from step to step, in symmetric memory)."""
        op = ReduceOp.AVG if divisor == comm.world_size else ReduceOp.SUM
        self.post_scale = 1.0 if op == ReduceOp.AVG else 1.0 / divisor
        # register: on shm the bucket moves into symmetric memory at its
        # first all-reduce (every rank registers it), and later ones read and
        # write every rank's bucket in place.
        self.work = comm.all_reduce(self.buffer, op=op, async_op=True, register=register)
        self._time(self.work.get_future())

    def start_hook(self, hook: CommHook, state: Any, bucket: GradBucket) -> None:
        """Launches the reduction through a comm hook: ``hook(state, bucket)``."""
        fut = hook(state, bucket)
        if not isinstance(fut, torch._C.Future):  # torch.futures.Future's base
            raise TypeError(f"the comm hook must return a torch.futures.Future, got "
                            f"{type(fut).__name__} (bucket {bucket.index()})")
        self.future = fut
        self._time(fut)

    def _time(self, fut: torch.futures.Future) -> None:
        """``timed`` completes once ``done`` holds when ``fut`` completed."""
        self.timed = fut.then(lambda _f: setattr(self, "done", time.perf_counter()))

    def wait(self, index: int) -> None:
        """Waits for the launched bucket ``index``; its reduced gradients end
        up in its buffer."""
        assert self.timed is not None  # set by start_average / start_hook
        if self.work is not None:
            if self.buffer.device.type == "cpu":
                self.timed.wait()
            self.work.wait()  # on GPU: the current stream waits, not the host
            if self.post_scale != 1.0:
                self.buffer.mul_(self.post_scale)
            return
        self.timed.wait()
        assert self.future is not None  # a comm hook's launch sets it
        value = self.future.wait()
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        if not isinstance(value, torch.Tensor) or value.numel() != self.buffer.numel():
            what = (f"a tensor of {value.numel()} elements" if isinstance(value, torch.Tensor)
                    else type(value).__name__)
            raise RuntimeError(f"the comm hook's future for bucket {index} returned {what}; "
                               f"expected a tensor of {self.buffer.numel()} elements")
        if value.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(value.reshape(-1))


@dataclasses.dataclass
class _JoinState:
    """Per-rank view of a :meth:`DistributedDataParallel.join` context."""

    divide_by_initial_world_size: bool
    throw_on_early_termination: bool
    last_active: list[int] = dataclasses.field(default_factory=list)

    def notify(self, comm: Communicator, active: bool, sync: bool) -> bool | None:
        """The per-iteration all-reduce of [active per rank..., syncing ranks],
        a collective of every rank inside ``join()``; keeps the active ranks
        in ``last_active``.

        Returns:
            whether the active ranks synchronise gradients; None once no
            rank is active.

        Raises:
            RuntimeError: a rank ran out of inputs under
                ``throw_on_early_termination``, or the active ranks disagree
                on synchronising gradients.
        """
        n = comm.world_size
        v = torch.zeros(n + 1, dtype=torch.int64, device=comm.device)
        if active:
            v[comm.rank] = 1
            v[n] = int(sync)
        comm.all_reduce(v)
        flags = v.tolist()
        ranks = [r for r in range(n) if flags[r]]
        if not ranks:
            return None
        self.last_active = ranks
        if self.throw_on_early_termination and len(ranks) < n:
            done = sorted(set(range(n)) - set(ranks))
            raise RuntimeError(f"DistributedDataParallel.join(throw_on_early_termination=True): "
                               f"rank(s) {done} exhausted their inputs")
        if flags[n] not in (0, len(ranks)):
            raise RuntimeError("DistributedDataParallel.join(): the active ranks disagree on "
                               "synchronising gradients (no_sync() or torch.no_grad() on some "
                               "ranks only)")
        return bool(flags[n])
