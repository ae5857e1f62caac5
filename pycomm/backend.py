"""pycomm as a ``torch.distributed`` backend.

``import pycomm`` registers the backend ``"pycomm"``; after that, unmodified
torch code runs its collectives on pycomm's algorithms and transports::

    import torch.distributed as dist
    import pycomm  # noqa: F401  (registers backend="pycomm")

    dist.init_process_group(backend="pycomm")           # torchrun environment
    dist.all_reduce(t)                                  # pycomm's all-reduce
    model = torch.nn.parallel.DistributedDataParallel(model)

Each process group (the default one and every ``dist.new_group``) gets its own
pycomm communicator, built over the group's store, ranks and timeout; the C++
backend (``csrc/torch/backend.cpp``, ``ProcessGroupPycomm``) delegates every
call to it.

Supported: ``all_reduce`` (SUM, AVG, MAX, MIN, PRODUCT), ``broadcast``,
``all_gather`` (list), ``all_gather_into_tensor``, ``reduce_scatter`` (list),
``reduce_scatter_tensor``, ``send``/``recv``/``isend``/``irecv`` (tag 0),
``batch_isend_irecv`` (posted together), ``barrier``, ``all_reduce_coalesced``;
``async_op=True`` Works with ``get_future()``. Other ops (``reduce``,
``gather``, ``scatter``, ``all_to_all``, ...) and other reduce ops raise an
error naming them. The list variants and non-contiguous tensors go through a
contiguous staging buffer and one copy each way. CPU tensors only: a CUDA
tensor raises ``NotImplementedError`` (use ``backend="cpu:pycomm,cuda:nccl"``).

Options (:class:`Options`, passed as ``pg_options=``, or the environment):
``transport`` (``PYCOMM_BACKEND_TRANSPORT``), ``algo``
(``PYCOMM_BACKEND_ALGO``), ``timeout`` (else ``init_process_group``'s),
``check`` (``PYCOMM_CHECK``), ``slice_bytes`` (``PYCOMM_SLICE_BYTES``). A
``new_group`` without ``pg_options`` takes the default group's options.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._ext import _C
from .comm import Communicator, init

__all__ = ["BACKEND_NAME", "Options", "get_communicator", "register"]

#: The name to pass to ``init_process_group(backend=...)``.
BACKEND_NAME = "pycomm"

_TRANSPORTS = ("auto", "shm", "gloo")
_ALGOS = ("auto", "ring", "direct")


@dataclass(frozen=True)
class Options:
    """Options of a pycomm process group (``init_process_group(pg_options=...)``
    or ``new_group(pg_options=...)``). ``None`` fields take the environment's
    value, then the default.

    Args:
        transport: ``"auto"`` (shared memory when every rank is on this host,
            else gloo), ``"shm"`` or ``"gloo"``. Env ``PYCOMM_BACKEND_TRANSPORT``.
        algo: the all-reduce algorithm: ``"auto"``, ``"ring"`` or ``"direct"``
            (shm only). Other collectives use ``"auto"``. Env
            ``PYCOMM_BACKEND_ALGO``.
        timeout: bounds every blocking wait of the communicator (seconds or a
            timedelta); default the ``timeout`` of ``init_process_group`` /
            ``new_group``.
        check: checked mode (see :func:`pycomm.init`); env ``PYCOMM_CHECK``.
        slice_bytes: ring pipelining granularity; env ``PYCOMM_SLICE_BYTES``.

    Example::

        >>> dist.init_process_group("pycomm", pg_options=pycomm.backend.Options(algo="ring"))
    """

    transport: str | None = None
    algo: str | None = None
    timeout: timedelta | float | None = None
    check: bool | None = None
    slice_bytes: int | None = None

    def resolved(self) -> "Options":
        """These options with the environment's defaults filled in and checked.

        Raises:
            ValueError: an unknown transport or algo.
        """
        transport = self.transport or os.environ.get("PYCOMM_BACKEND_TRANSPORT", "auto")
        algo = self.algo or os.environ.get("PYCOMM_BACKEND_ALGO", "auto")
        if transport not in _TRANSPORTS:
            raise ValueError(
                f"pycomm backend: transport={transport!r} is not one of {_TRANSPORTS} (the "
                "backend runs on CPU tensors; CUDA tensors need another backend, e.g. "
                "backend='cpu:pycomm,cuda:nccl')")
        if algo not in _ALGOS:
            raise ValueError(f"pycomm backend: algo={algo!r} is not one of {_ALGOS}")
        return replace(self, transport=transport, algo=algo)


# The default group's options: a new_group without pg_options inherits them.
_world_options: Options | None = None
_registered = False
# The Communicator of each group's backend, by id() of its C++ communicator
# (pybind11 hands back the same Python object for it while it is alive here).
_communicators: dict[int, Communicator] = {}


def _create_backend(dist_opts: Any, pg_options: Any) -> Any:
    """The creator ``register_backend`` calls for each process group (extended
    API): a pycomm communicator over the group's store, rank, size and timeout,
    wrapped in the C++ ``ProcessGroupPycomm``."""
    global _world_options
    if pg_options is None:
        # A new_group inherits the default group's options; a new default
        # group starts from the defaults, not from a destroyed one's.
        opts = (_world_options if dist.is_initialized() else None) or Options()
    elif isinstance(pg_options, Options):
        opts = pg_options
    else:
        raise TypeError(
            f"pycomm backend: pg_options must be a pycomm.backend.Options, got "
            f"{type(pg_options).__name__}")
    opts = opts.resolved()
    comm = init(
        rank=dist_opts.group_rank,
        world_size=dist_opts.group_size,
        store=dist_opts.store,  # torch's store, already prefixed per group and device
        key_prefix="pycomm",
        transport=opts.transport or "auto",  # resolved() filled it in
        device="cpu",
        timeout=opts.timeout if opts.timeout is not None else dist_opts.timeout,
        check=opts.check,
        slice_bytes=opts.slice_bytes,
        set_default=False,
    )
    if opts.algo == "direct" and comm.transport != "shm":
        comm.close()
        raise ValueError(
            f"pycomm backend: algo='direct' needs the shm transport, this group uses "
            f"{comm.transport!r}")
    if not dist.is_initialized():
        # Creating the default group: its options become new groups' default.
        _world_options = opts
    for key in [k for k, c in _communicators.items() if c.closed]:
        del _communicators[key]  # groups destroyed since (shutdown closed them)
    _communicators[id(comm._impl)] = comm
    return _C.make_backend(comm._impl, opts.algo)


def register() -> None:
    """Registers ``"pycomm"`` with ``torch.distributed`` (``import pycomm``
    does it; calling it again does nothing)."""
    global _registered
    if _registered:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True,
                                  devices=["cpu"])
    _registered = True


def get_communicator(group: Any = None) -> Communicator:
    """The pycomm :class:`~pycomm.Communicator` behind a process group of the
    pycomm backend, to use pycomm's own API (``algo=``, ...) on its ranks.

    It shares the group's communicator: closing it closes the group's.

    Args:
        group: a process group created with the pycomm backend (default: the
            default group).

    Returns:
        The communicator (``rank`` and ``world_size`` are the group's).

    Raises:
        TypeError: the group's CPU backend is not pycomm's.

    Example::

        >>> dist.init_process_group("pycomm")
        >>> comm = pycomm.backend.get_communicator()
        >>> comm.all_reduce(t, algo="ring")
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    impl = _C.backend_comm(pg._get_backend(torch.device("cpu")))
    return _communicators[id(impl)]
