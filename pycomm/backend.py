"""pycomm as a ``torch.distributed`` backend, on CPU and CUDA tensors.

``import pycomm`` registers the backend ``"pycomm"`` (devices ``cpu`` and
``cuda``); after that, unmodified torch code runs its collectives on pycomm's
algorithms and transports::

    import torch.distributed as dist
    import pycomm  # noqa: F401  (registers backend="pycomm")

    dist.init_process_group(backend="pycomm")           # torchrun environment
    dist.all_reduce(t)                                  # pycomm's all-reduce
    model = torch.nn.parallel.DistributedDataParallel(model)

``backend="pycomm"`` and ``"cpu:pycomm,cuda:pycomm"`` give each process group
(the default one and every ``dist.new_group``) ONE C++ backend
(``csrc/torch/backend.cpp``, ``ProcessGroupPycomm``) that dispatches every call
by its tensors' device: CPU tensors to the group's CPU communicator (shm or
gloo, built with the group over its store, ranks and timeout), CUDA tensors to
its CUDA communicator (nccl). The CUDA communicator is built lazily, at the
group's first CUDA operation, like ProcessGroupNCCL's NCCL communicators: CPU
users never pay for NCCL. Its creation is collective over the group, so the
group's first CUDA operation must be one every rank of the group reaches (a
collective; a first CUDA ``send``/``recv`` works only in a two-rank group); if
it fails, later CUDA operations of the group raise the same error. It runs on
the device of that first operation's tensors (one CUDA device per group).
CUDA semantics are ProcessGroupNCCL's: an op runs after the caller's current
stream, ``Work.wait()`` makes the current stream wait (with a ``timeout``: the
host waits for the GPU), ``get_future()`` is CUDA-aware. With
``"cpu:gloo,cuda:pycomm"`` torch sends only CUDA tensors here (the group still
gets its, unused, CPU communicator).

Supported: ``all_reduce`` (SUM, AVG, MAX, MIN, PRODUCT), ``broadcast``,
``all_gather`` (list), ``all_gather_into_tensor``, ``reduce_scatter`` (list),
``reduce_scatter_tensor``, ``send``/``recv``/``isend``/``irecv`` (any tag;
``recv`` from any source, ``src=None``: CPU tensors only, NCCL pairs in
posting order),
``batch_isend_irecv`` (posted together), ``barrier`` (on the CUDA communicator
when torch names a CUDA device: ``device_ids=`` or a group bound with
``device_id=``), ``all_reduce_coalesced``, ``reduce``, ``gather``,
``scatter`` (and so ``gather_object`` / ``scatter_object_list``),
``all_to_all``, ``all_to_all_single`` (even or uneven splits), the coalesced
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (one op each, as
DTensor and FSDP2 issue them), ``all_gather_coalesced``, and sequence numbers
(``TORCH_DISTRIBUTED_DEBUG=DETAIL``); ``async_op=True`` Works with
``get_future()``. A collective issued inside a ``then()`` callback runs
nested, at once, so waiting for it there works (torch's PowerSGD hook).
Other ops, other reduce ops and sparse tensors (``TypeError``) raise an
error naming them. The list
variants and non-contiguous tensors go through a contiguous staging buffer and
one copy each way (on CUDA: ordered on the streams, as the op). The tensors of
one call must be on one device (else ``ValueError``).

``torch.distributed.shrink_group`` works (the backend supports shrinking):
after a peer died, the survivors call it and go on over a group without the
ranks they name, on the same transport (see ``_shrink_backend``).

Options (:class:`Options`, passed as ``pg_options=``, or the environment):
``transport`` (``PYCOMM_BACKEND_TRANSPORT``, CPU), ``algo``
(``PYCOMM_BACKEND_ALGO``, CPU), ``cuda_algo`` (``PYCOMM_BACKEND_CUDA_ALGO``),
``timeout`` (else ``init_process_group``'s), ``check`` (``PYCOMM_CHECK``),
``slice_bytes`` (``PYCOMM_SLICE_BYTES``), ``register``
(``PYCOMM_BACKEND_REGISTER``: DDP's buckets move into symmetric memory). A
``new_group`` without ``pg_options`` takes the default group's options.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._ext import _C
from ._setup import ENV
from .comm import Communicator, init

__all__ = ["BACKEND_NAME", "Options", "get_communicator", "lost_ranks", "register"]

#: The name to pass to ``init_process_group(backend=...)``.
BACKEND_NAME = "pycomm"

_TRANSPORTS = ("auto", "shm", "gloo")
#: The all-reduce algorithms a group may name (Communicator.all_reduce's).
_CLASSIC_ALGOS = ("recursive_doubling", "halving_doubling", "tree")
_ALGOS = ("auto", "ring", "direct", *_CLASSIC_ALGOS)
_CUDA_ALGOS = ("auto", "ring", "nccl", *_CLASSIC_ALGOS)
#: Where a group's CUDA communicator keeps its rendezvous keys in the group's
#: store (the CPU one uses "pycomm").
_CUDA_KEY_PREFIX = "pycomm-cuda"
# torch.distributed.distributed_c10d.SHRINK_ABORT (torch >= 2.10 names it).
_SHRINK_ABORT = getattr(dist.distributed_c10d, "SHRINK_ABORT", 1)


@dataclass(frozen=True)
class Options:
    """Options of a pycomm process group (``init_process_group(pg_options=...)``
    or ``new_group(pg_options=...)``). ``None`` fields take the environment's
    value, then the default.

    Args:
        transport: the CPU communicator's: ``"auto"`` (shared memory when
            every rank is on this host, else gloo), ``"shm"`` or ``"gloo"``.
            Env ``PYCOMM_BACKEND_TRANSPORT``. CUDA tensors always use nccl.
        algo: the all-reduce algorithm on CPU tensors: ``"auto"``, ``"ring"``,
            ``"direct"`` (shm only), ``"recursive_doubling"``,
            ``"halving_doubling"`` or ``"tree"`` (see
            :meth:`pycomm.Communicator.all_reduce`). Other collectives use
            ``"auto"``. Env ``PYCOMM_BACKEND_ALGO``.
        cuda_algo: the all-reduce algorithm on CUDA tensors: ``"auto"``,
            ``"ring"`` (pycomm's ring over NCCL send/recv), ``"nccl"``
            (NCCL's own) or one of the classic algorithms (over NCCL
            send/recv). Env ``PYCOMM_BACKEND_CUDA_ALGO``.
        timeout: bounds every blocking wait of the communicators (seconds or
            a timedelta); default the ``timeout`` of ``init_process_group`` /
            ``new_group``.
        check: checked mode (see :func:`pycomm.init`); env ``PYCOMM_CHECK``.
        slice_bytes: ring pipelining granularity (both devices); env
            ``PYCOMM_SLICE_BYTES``, else each transport's default.
        register: on the shm transport, register the CPU tensors that the
            group all-reduces again and again (DDP's gradient buckets): move
            them into symmetric memory, so their all-reduces run without
            staging (:meth:`pycomm.Communicator.register_tensor`). A tensor
            moves at its second all-reduce when, on every rank, it is all of
            a storage of at least 256 KiB that torch's allocator made and
            that is still alive since its first. Values, views and autograd
            are unaffected, but its ``data_ptr()`` changes: anything holding
            the old address (a ``numpy()`` view of it) would see freed
            memory, so it is off by default. Env ``PYCOMM_BACKEND_REGISTER=1``.

    Example::

        >>> dist.init_process_group("pycomm", pg_options=pycomm.backend.Options(algo="ring"))
    """

    transport: str | None = None
    algo: str | None = None
    cuda_algo: str | None = None
    timeout: timedelta | float | None = None
    check: bool | None = None
    slice_bytes: int | None = None
    register: bool | None = None

    def resolved(self) -> "Options":
        """These options with the environment's defaults filled in and checked.

        Raises:
            ValueError: an unknown transport, algo or cuda_algo.
        """
        transport = self.transport or ENV.text("PYCOMM_BACKEND_TRANSPORT", "auto")
        algo = self.algo or ENV.text("PYCOMM_BACKEND_ALGO", "auto")
        cuda_algo = self.cuda_algo or ENV.text("PYCOMM_BACKEND_CUDA_ALGO", "auto")
        if transport not in _TRANSPORTS:
            raise ValueError(
                f"pycomm backend: transport={transport!r} is not one of {_TRANSPORTS} (the "
                "CPU communicator's; CUDA tensors always use nccl)")
        if algo not in _ALGOS:
            raise ValueError(f"pycomm backend: algo={algo!r} is not one of {_ALGOS}")
        if cuda_algo not in _CUDA_ALGOS:
            raise ValueError(
                f"pycomm backend: cuda_algo={cuda_algo!r} is not one of {_CUDA_ALGOS}")
        register = self.register
        if register is None:
            register = ENV.flag("PYCOMM_BACKEND_REGISTER")
        return replace(self, transport=transport, algo=algo, cuda_algo=cuda_algo,
                       register=register)


# The default group's options: a new_group without pg_options inherits them.
_world_options: Options | None = None
_registered = False
# The Communicator of each group's backend, by id() of its C++ communicator
# (pybind11 hands back the same Python object for it while it is alive here).
_communicators: dict[int, Communicator] = {}


def _create_backend(dist_opts: Any, pg_options: Any) -> Any:
    """The creator ``register_backend`` calls for each process group (extended
    API; once per group, for all its devices): the group's CPU communicator
    over its store, rank, size and timeout, and a factory for its CUDA one,
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
    timeout = opts.timeout if opts.timeout is not None else dist_opts.timeout
    comm = init(
        rank=dist_opts.group_rank,
        world_size=dist_opts.group_size,
        store=dist_opts.store,  # torch's store, already prefixed per group (and device)
        key_prefix="pycomm",
        transport=opts.transport or "auto",  # resolved() filled it in
        device="cpu",
        timeout=timeout,
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
    return _make_backend(comm, dist_opts.store, timeout, opts)


def _make_backend(comm: Communicator, store: Any, timeout: timedelta | float,
                  opts: Options) -> Any:
    """The C++ ``ProcessGroupPycomm`` over the group's CPU communicator
    ``comm``, with a factory for its CUDA one (over ``store``) and a shrinker
    for ``torch.distributed.shrink_group``."""
    comm._impl.auto_register = bool(opts.register) and comm.transport == "shm"
    for key in [k for k, c in _communicators.items() if c.closed]:
        del _communicators[key]  # groups destroyed since (shutdown closed them)
    # Across hosts ("shm+gloo") the C++ communicator composes its own
    # collectives (csrc/torch/hierarchy.h): the backend is the same.
    impl = comm._impl
    _communicators[id(impl)] = comm
    cuda_factory = functools.partial(_create_cuda_communicator, store, comm.rank,
                                     comm.world_size, timeout, opts)
    shrinker = functools.partial(_shrink_backend, comm, timeout, opts)
    return _C.make_backend(impl, opts.algo, cuda_factory, opts.cuda_algo, shrinker)


def _shrink_backend(comm: Communicator, timeout: timedelta | float, opts: Options,
                    ranks_to_exclude: list[int], flags: int, timeout_ms: int) -> Any:
    """The survivors' backend for ``torch.distributed.shrink_group``: the C++
    backend calls it with the GIL on every rank that stays.

    The CPU communicator shrinks (:meth:`Communicator.shrink` with
    ``exclude=ranks_to_exclude``, on its transport: shm gets a new segment,
    gloo a new group) and the old one is aborted, with either flag: an op
    still pending on the old group fails (``SHRINK_ABORT`` aborts before the
    survivors agree, ``SHRINK_DEFAULT`` once they have). The new group's CUDA
    communicator is made at its first CUDA op, over the new communicator's
    store. A ``pg_options`` given to ``shrink_group`` sets only the timeout.
    """
    if flags & _SHRINK_ABORT:
        comm.abort("torch.distributed.shrink_group(shrink_flags=SHRINK_ABORT)")
    if timeout_ms >= 0:
        timeout = timedelta(milliseconds=timeout_ms)
    new = comm.shrink(exclude=ranks_to_exclude, timeout=timeout)
    return _make_backend(new, new._store, timeout, opts)


def _create_cuda_communicator(store: Any, rank: int, world_size: int,
                              timeout: timedelta | float, opts: Options, device: str,
                              op: str) -> Any:
    """A group's CUDA communicator on ``device``, built when ``op`` (the
    group's first CUDA operation, on every rank) needs it; the C++ backend
    calls it with the GIL and keeps the returned ``_C.Comm``.

    Raises:
        ValueError: this pycomm build or torch has no CUDA, or no such device.
        RuntimeError: the NCCL setup failed (e.g. a rank of the group did not
            reach a CUDA operation within the timeout).
    """
    if not getattr(_C, "WITH_CUDA", False):
        raise ValueError(
            f"{op} on {device}: this pycomm build has no CUDA/NCCL support "
            "(pycomm._C.WITH_CUDA is False): rebuild pycomm against a CUDA torch, or use "
            "backend='cpu:pycomm,cuda:nccl'")
    dev = torch.device(device)
    if not torch.cuda.is_available():
        raise ValueError(f"{op} on {device}: torch.cuda.is_available() is False")
    try:
        # dev has its index (the op's tensors'); init never changes the
        # caller's current device.
        comm = init(rank=rank, world_size=world_size, store=store,
                    key_prefix=_CUDA_KEY_PREFIX, transport="nccl", device=dev,
                    timeout=timeout, check=opts.check, slice_bytes=opts.slice_bytes,
                    set_default=False)
    except ValueError as e:
        raise ValueError(f"{op}: cannot create the process group's CUDA communicator: {e}") from e
    except Exception as e:
        raise RuntimeError(
            f"{op}: creating the process group's CUDA communicator on {dev} failed: {e}. It is "
            "created at the group's first CUDA operation, which every rank of the group must "
            "reach (a collective, not a send/recv between some of its ranks)") from e
    _communicators[id(comm._impl)] = comm
    return comm._impl


def register() -> None:
    """Registers ``"pycomm"`` with ``torch.distributed`` (``import pycomm``
    does it; calling it again does nothing)."""
    global _registered
    if _registered:
        return
    # One backend object serves both devices (torch creates one when every
    # device of a group names "pycomm"); devices= does not displace torch's
    # defaults (cpu: gloo, cuda: nccl) for other users.
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True,
                                  devices=["cpu", "cuda"])
    _register_shrunk_groups_as_custom()
    _registered = True


def _register_shrunk_groups_as_custom() -> None:
    """Makes ``torch.distributed.shrink_group`` register a pycomm survivors'
    backend the way ``init_process_group`` does: as ``BackendType.CUSTOM``,
    for CPU and CUDA tensors.

    torch's ``_create_shrunk_process_group`` registers any backend under
    ``GLOO`` (CPU) or ``NCCL`` (CUDA), and torch's C++ then takes a backend of
    that type for its own class: torch DDP's logger casts a "gloo" group's
    backend to ``ProcessGroupGloo`` and reads its thread count, which on ours
    reads another member (a crash or garbage, by layout). The wrapper leaves
    other backends as torch made them.
    """
    c10d = dist.distributed_c10d
    create = getattr(c10d, "_create_shrunk_process_group", None)
    if create is None or getattr(create, "_pycomm_wrapper", False):
        return

    @functools.wraps(create)
    def create_shrunk_process_group(new_backend: Any, *args: Any, **kwargs: Any) -> Any:
        pg = create(new_backend, *args, **kwargs)
        if new_backend.name() == BACKEND_NAME:
            custom = dist.ProcessGroup.BackendType.CUSTOM
            for device in ("cpu", "cuda"):
                pg._register_backend(torch.device(device), custom, new_backend)
            pg._set_default_backend(custom)
        return pg

    create_shrunk_process_group._pycomm_wrapper = True  # type: ignore[attr-defined]
    c10d._create_shrunk_process_group = create_shrunk_process_group


def lost_ranks(group: Any = None) -> list[int]:
    """The ranks of ``group`` (default: the default group) that have left it,
    as its survivors agree: what to pass to ``torch.distributed.shrink_group``
    after an operation failed because peers died. A collective of the
    survivors (:meth:`Communicator.lost_ranks` of the group's CPU
    communicator), the same list on every one.

    Example::
        >>> try:
        ...     loss.backward()        # torch DDP: a peer died, RuntimeError
        ... except RuntimeError:
        ...     dist.shrink_group(pycomm.backend.lost_ranks())
        ...     ddp = DistributedDataParallel(model)   # over the shrunk group
    """
    return get_communicator(group).lost_ranks()


def get_communicator(group: Any = None, device: str | torch.device = "cpu") -> Communicator:
    """The pycomm :class:`~pycomm.Communicator` behind a process group of the
    pycomm backend, to use pycomm's own API (``algo=``, ...) on its ranks.

    It shares the group's communicator: closing it closes the group's.

    Args:
        group: a process group created with the pycomm backend (default: the
            default group).
        device: ``"cpu"`` (the CPU communicator) or a CUDA device (the CUDA
            communicator; ``"cuda"``: the current device). If the group has
            run no CUDA operation yet, the CUDA communicator is created now,
            which is collective: every rank of the group must call this then.

    Returns:
        The communicator (``rank`` and ``world_size`` are the group's).

    Raises:
        TypeError: the group's backend for ``device`` is not pycomm's.
        ValueError: a device other than CPU and CUDA; no CUDA in this build;
            a CUDA device other than the one the group's CUDA communicator
            runs on.

    Example::

        >>> dist.init_process_group("pycomm")
        >>> comm = pycomm.backend.get_communicator()
        >>> comm.all_reduce(t, algo="ring")
        >>> gpu = pycomm.backend.get_communicator(device="cuda")  # every rank
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    impl = _C.backend_comm(pg._get_backend(dev), str(dev))
    return _communicators[id(impl)]
