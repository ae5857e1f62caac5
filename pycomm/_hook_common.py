"""What every pycomm DDP hook does first and last: find the communicator in
the hook's state, check that the bucket is on its device, and average a
tensor with an asynchronous all-reduce whose future completes with it.
Shared by :mod:`pycomm.hooks` and its PowerSGD (pycomm/_powersgd.py)."""

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .comm import Communicator, ReduceOp


def _comm_of(state: Any) -> Communicator:
    """The communicator of a hook state: the state itself, or ``state.comm``."""
    comm = state if isinstance(state, Communicator) else getattr(state, "comm", None)
    if not isinstance(comm, Communicator):
        raise TypeError(
            "pycomm hook: state must be a pycomm.Communicator or an object with a .comm "
            f"Communicator (e.g. PowerSGDState), got {type(state).__name__}; register with "
            "ddp.register_comm_hook(comm, hook)"
        )
    return comm


def _check_bucket(comm: Communicator, bucket: dist.GradBucket, tensor: torch.Tensor) -> None:
    """Raises on the first bucket whose device is not the communicator's."""
    if tensor.device != comm.device:
        raise ValueError(
            f"pycomm hook: gradient bucket {bucket.index()} is on {tensor.device} but the "
            f"communicator runs on {comm.device}; create the communicator on the model's device "
            f"(pycomm.init(device={str(tensor.device)!r}, ...)) or move the model to {comm.device}"
        )


def _first(fut: torch.futures.Future) -> torch.Tensor:
    """A pycomm Work future holds the list of output tensors: take the first."""
    return fut.value()[0]


def _allreduce_avg(comm: Communicator, tensor: torch.Tensor,
                   wire_dtype: Optional[torch.dtype] = None,
                   register: bool = False) -> torch.futures.Future[torch.Tensor]:
    """Averages ``tensor`` in place; the future completes with it.
    ``register``: register it, i.e. move it into symmetric memory (all_reduce)."""
    work = comm.all_reduce(tensor, op=ReduceOp.AVG, async_op=True, wire_dtype=wire_dtype,
                           register=register)
    return work.get_future().then(_first)


def then_async(fut: torch.futures.Future,
                fn: Callable[[torch.futures.Future], torch.futures.Future],
                device: torch.device) -> torch.futures.Future:
    """``fut.then(fn)`` for an ``fn`` that issues an asynchronous op and
    returns its future: the result completes with that future's value, without
    any thread waiting for it. An exception in ``fut`` or ``fn`` fails it.

    On CUDA the result is a CUDA-aware future on ``device``: it is completed
    in the inner future's callback, whose current stream waits for the op, so
    it records that ordering and its own callbacks' streams wait for it. A
    plain future would hand its callbacks the value with no ordering at all:
    they would read the tensors while the all-reduce still writes them (the
    GPU check caught PowerSGD differing from torch's by 0.1)."""
    out: torch.futures.Future = torch.futures.Future(
        devices=[device] if device.type == "cuda" else None)

    def forward(inner: torch.futures.Future) -> None:
        try:
            out.set_result(inner.value())
        except Exception as e:  # noqa: BLE001 - handed to the waiting caller
            out.set_exception(e)

    def start(done: torch.futures.Future) -> None:
        try:
            inner = fn(done)
        except Exception as e:  # noqa: BLE001
            out.set_exception(e)
            return
        inner.add_done_callback(forward)

    fut.add_done_callback(start)
    return out
