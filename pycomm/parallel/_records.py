"""The per-iteration records of :class:`DistributedDataParallel`: a bucket's
flat buffer, a launched reduction, a rank's view of ``join()``."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..comm import Work


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


@dataclasses.dataclass
class _JoinState:
    """Per-rank view of a :meth:`DistributedDataParallel.join` context."""

    divide_by_initial_world_size: bool
    throw_on_early_termination: bool
    last_active: list[int] = dataclasses.field(default_factory=list)
