"""What a communication hook receives: torch's ``GradBucket`` interface.

pycomm's DDP (:mod:`pycomm.parallel`) hands these to hooks, and
:mod:`pycomm.hooks` recognises them beside torch's; both import it from here
(public as ``pycomm.parallel.GradBucket``)."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["GradBucket"]


class GradBucket:
    """One bucket of gradients, as ``torch.distributed.GradBucket`` presents it.

    A communication hook ``hook(state, bucket) -> torch.futures.Future[Tensor]``
    (torch's contract, see :meth:`DistributedDataParallel.register_comm_hook`)
    reads the flat ``buffer()`` and returns a future completed with a tensor of
    the same number of elements: the reduced gradients.

    Args:
        index: the bucket's position; buckets are communicated in index order.
        buffer: the flat gradient buffer (one dtype, one device).
        gradients: one view of ``buffer`` per parameter, shaped like it.
        parameters: the bucket's parameters, in the order of ``gradients``.
        is_last: whether this is the last bucket of the iteration.

    Example::
        >>> def double_hook(state, bucket):
        ...     fut = torch.futures.Future()
        ...     fut.set_result(bucket.buffer() * 2)
        ...     return fut
    """

    def __init__(self, index: int, buffer: torch.Tensor, gradients: Sequence[torch.Tensor],
                 parameters: Sequence[torch.Tensor], is_last: bool) -> None:
        self._index = index
        self._buffer = buffer
        self._gradients = gradients
        self._parameters = parameters
        self._is_last = is_last

    def index(self) -> int:
        """The bucket's index (0 is the first communicated)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat, contiguous 1-D gradient buffer."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """One view of the buffer per parameter, shaped like the parameter."""
        return list(self._gradients)

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients the bucket holds."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """True for the bucket communicated last in an iteration."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replaces the tensor ``buffer()`` returns (what torch's does; the
        reduced result is still the hook's future's value)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"set_buffer expects a tensor, got {type(tensor).__name__}")
        self._buffer = tensor

    def __repr__(self) -> str:
        return (f"GradBucket(index={self._index}, numel={self._buffer.numel()}, "
                f"dtype={self._buffer.dtype}, params={len(self._parameters)}, "
                f"is_last={self._is_last})")
