"""Symmetric memory, as :class:`pycomm.Communicator` offers it:
:meth:`~SymmetricMemory.register_tensor`, :meth:`~SymmetricMemory.is_registered`
and the counts of all-reduces that ran from it. The memory itself and the
all-reduce's decision belong to the C++ SymmetricMemory
(csrc/torch/symmetric.h); these methods check their arguments and forward."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ._types import _need_tensors

__all__ = ["SymmetricMemory"]


class SymmetricMemory:
    """The symmetric-memory methods of :class:`pycomm.Communicator` (one of
    its base classes), over its compiled communicator ``_impl``."""

    _impl: Any

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

    @property
    def cross_memory_all_reduces(self) -> int:
        """All-reduces so far that read the peers' tensors (``PYCOMM_SHM_CMA=1``)."""
        return self._impl.cross_memory_all_reduces
