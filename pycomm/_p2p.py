"""Point-to-point transfer, as :class:`pycomm.Communicator` offers it: send,
recv, isend, irecv and batch_isend_irecv. Each checks its arguments and
forwards to the compiled communicator (csrc/torch/comm.h), which matches
the messages."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ._ext import Work
from ._types import P2POp, _need_tensors

__all__ = ["PointToPoint"]

_ANY_SOURCE = -1  # the core's kAnySource (csrc/core/transport.h)


class PointToPoint:
    """The point-to-point methods of :class:`pycomm.Communicator` (one of its
    base classes), over its compiled communicator ``_impl``."""

    _impl: Any

    # Matching is torch.distributed's: a recv takes the first message sent to
    # it with its ``tag`` from ``src`` (or, with ``src=None``, from any rank),
    # whatever other tags are in flight; one sender's messages with one tag
    # arrive in order. Tags other than 0 and src=None: CPU transports only.
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Sends ``tensor`` to rank ``dst`` (blocks until it is delivered to
        the transport)."""
        _need_tensors("send", tensor=tensor)
        self._impl.send(tensor, dst, False, tag)

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> int:
        """Receives into ``tensor`` from rank ``src`` (None: from whichever
        rank sends first) and returns the sender's rank.

        Raises:
            NotImplementedError: ``src=None`` or a tag other than 0 on CUDA
                tensors (NCCL pairs messages in posting order)."""
        _need_tensors("recv", tensor=tensor)
        if src is not None:
            self._impl.recv(tensor, src, False, tag)
            return src
        work = self._impl.recv(tensor, _ANY_SOURCE, True, tag)
        work.wait()
        return int(work.source_rank())

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Asynchronous :meth:`send`."""
        _need_tensors("isend", tensor=tensor)
        return self._impl.send(tensor, dst, True, tag)

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        """Asynchronous :meth:`recv`; ``work.source_rank()`` is the sender
        once the work is complete."""
        _need_tensors("irecv", tensor=tensor)
        return self._impl.recv(tensor, _ANY_SOURCE if src is None else src, True, tag)

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
        work = self._impl.batch_p2p([(o.is_send(), o.tensor, o.peer, o.tag) for o in ops])
        return [work] * len(ops)
