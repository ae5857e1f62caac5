"""How a communicator comes to be (private; pycomm.comm is the API).

``init()`` and ``Communicator.new_group`` / ``split`` call these steps:

1. read the environment (:class:`Environment`, the one parser of every
   ``PYCOMM_*`` and torchrun variable) and validate the arguments;
2. rendezvous (:func:`rendezvous`): find the store, this rank and the world
   size (``group=``, ``store=``, an initialised torch group, or torchrun);
3. decide the transport once (:func:`plan_transport`: what was asked, or for
   ``"auto"`` a collective decision through the store: shm when every rank
   is on this host, the shm+gloo hierarchy across even hosts, else gloo);
4. build it (:func:`build`: one builder per transport in :data:`BUILDERS`),
   giving the C++ communicator and its resolved :class:`Settings`.

Agreements through the store go through pycomm._store. The process-wide
state here is only the counters that name store keys and shared-memory
segments (the default communicator lives with ``Communicator``).
"""

from __future__ import annotations

import numbers
import os
import re
import socket
import uuid
import warnings
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from . import _auto_table, _hierarchy
from ._ext import _C, CommError
from ._store import agree_errors, all_gather, broadcast

DEFAULT_TIMEOUT = timedelta(minutes=5)
DEFAULT_SLICE_BYTES = 512 * 1024
# gloo pays about a millisecond of latency per message on loopback, so its
# ring slices must be large (measured: benchmarks/allreduce/README.md).
DEFAULT_GLOO_SLICE_BYTES = 4 * 1024 * 1024
#: GPU default: each slice costs one ncclGroupStart/End (a kernel launch and a
#: few microseconds of host time), so slices are larger than on CPU.
DEFAULT_CUDA_SLICE_BYTES = 4 * 1024 * 1024

@dataclass(frozen=True)
class Settings:
    """How a communicator is to be built, or was built; its groups are built
    the same way (with their own timeout if given).

    Asked for (init): ``transport`` may be "auto", ``device`` and
    ``slice_bytes`` None (the defaults). Built (:func:`build`): every field
    resolved, ``check`` what the transport runs.
    """

    transport: str  # "auto", "shm", "gloo", "nccl" or (built across hosts) "shm+gloo"
    device: torch.device | None
    timeout: timedelta
    slice_bytes: int | None
    check: bool
    #: check was asked for explicitly: a transport without checked mode is an
    #: error rather than silently unchecked.
    require_check: bool = False


# ------------------------------------------------------------------ environment

class Environment:
    """Every environment variable pycomm reads, parsed in one place.

    ==========================  ===============================================
    ``PYCOMM_CHECK``            checked mode (a flag: "", 0, false, no are off)
    ``PYCOMM_TIMEOUT``          seconds, > 0 (default 5 minutes)
    ``PYCOMM_SLICE_BYTES``      ring slice size in bytes
    ``PYCOMM_CPU_SIMD``         "auto" or "scalar" (CPU reduction kernels)
    ``PYCOMM_AUTO_TABLE``       JSON file of algo="auto"'s table
                                (:mod:`pycomm._auto_table`)
    ``PYCOMM_BACKEND_*``        process group options (:mod:`pycomm.backend`)
    ``RANK``, ``WORLD_SIZE``,   the torchrun rendezvous (``MASTER_PORT`` is
    ``MASTER_ADDR``             read by torch's ``env://``)
    ``LOCAL_RANK``              the default CUDA device index
    ``PYCOMM_SHRINK_GRACE``     seconds a shrink waits for remote ranks (2)
    ``TORCHELASTIC_RESTART_``   torchrun's attempt number: scopes every store
    ``COUNT``                   key, so an attempt never reads an earlier one's
    ``GLOO_SOCKET_IFNAME``      read by torch's gloo (the interface to use);
                                unset across hosts, pycomm first checks that
                                each hostname resolves to a non-loopback
                                address (pycomm._hierarchy.check_addresses)
    ==========================  ===============================================

    Each is read when the setup needs it, not at import, so a variable that a
    path never uses cannot fail it; a bad value is a ValueError naming the
    variable. (``PYCOMM_SHM_*`` tunables are read by the C++ transport.)
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = environ  # None: os.environ as it is at each read

    def get(self, name: str) -> str | None:
        """The raw value of ``name``, None when unset."""
        environ = os.environ if self._environ is None else self._environ
        return environ.get(name)

    def text(self, name: str, default: str = "") -> str:
        """The raw value of ``name``, ``default`` when unset."""
        value = self.get(name)
        return default if value is None else value

    def flag(self, name: str) -> bool:
        """An on/off variable: unset, "", "0", "false" and "no" are off."""
        return self.text(name, "0").strip().lower() not in ("", "0", "false", "no")

    def number(self, name: str, kind: type, what: str, value: Any = None) -> Any:
        """``name`` (or ``value`` standing for it, when given) as an int or a
        float; a ValueError that names the variable when it is not one."""
        raw = self.text(name) if value is None else value
        try:
            return kind(raw)
        except (TypeError, ValueError):
            raise ValueError(f"environment variable {name}={raw!r} is not {what}") from None

    def timeout(self) -> timedelta | None:
        """PYCOMM_TIMEOUT, or None when unset."""
        if not self.text("PYCOMM_TIMEOUT"):
            return None
        seconds = self.number("PYCOMM_TIMEOUT", float, "a number of seconds")
        if not seconds > 0:
            raise ValueError(f"environment variable PYCOMM_TIMEOUT={seconds!r} must be positive")
        return timedelta(seconds=seconds)

    def slice_bytes(self) -> int | None:
        """PYCOMM_SLICE_BYTES, or None when unset."""
        if not self.text("PYCOMM_SLICE_BYTES"):
            return None
        return self.number("PYCOMM_SLICE_BYTES", int, "a whole number of bytes (no K/M suffix)")

    def check_cpu_simd(self) -> None:
        """PYCOMM_CPU_SIMD selects the CPU reduction kernels (csrc/core/reduce.cc):
        unset or "auto" (AVX2/F16C where the CPU has them) or "scalar" (the
        portable loops; results are bitwise the same). The kernels read it at
        their first use and raise on another value; init checks it first, so
        that a typo fails here rather than inside a collective."""
        value = self.text("PYCOMM_CPU_SIMD")
        if value not in ("", "auto", "scalar"):
            raise ValueError(
                f"environment variable PYCOMM_CPU_SIMD={value!r} is not 'auto' or 'scalar'")

    def shrink_grace(self) -> float:
        """PYCOMM_SHRINK_GRACE: seconds a shrink waits for ranks on other
        hosts, whose death cannot be seen from here (default 2)."""
        if not self.text("PYCOMM_SHRINK_GRACE"):
            return 2.0
        return self.number("PYCOMM_SHRINK_GRACE", float, "a number of seconds")

    def attempt(self) -> int:
        """TORCHELASTIC_RESTART_COUNT (torchrun's restart number), 0 when unset."""
        if not self.text("TORCHELASTIC_RESTART_COUNT"):
            return 0
        return self.number("TORCHELASTIC_RESTART_COUNT", int, "an integer restart count")

    def torchrun_world(self, rank: int | None, world_size: int | None) -> tuple[int, int]:
        """(rank, world size) from RANK and WORLD_SIZE (an explicit argument
        wins over its variable); MASTER_ADDR must be set too."""
        env_rank = rank if rank is not None else self.get("RANK")
        env_world = world_size if world_size is not None else self.get("WORLD_SIZE")
        if env_rank is None or env_world is None or self.get("MASTER_ADDR") is None:
            raise ValueError(
                "pycomm.init() needs a rendezvous: run under torchrun (RANK, WORLD_SIZE, "
                "MASTER_ADDR, MASTER_PORT), or pass rank=, world_size= and store=, or group="
            )
        r = self.number("RANK", int, "an integer rank", env_rank)
        n = self.number("WORLD_SIZE", int, "an integer world size", env_world)
        return r, n


#: The process's environment (read at each use).
ENV = Environment()


# ------------------------------------------------------------------ arguments

def check_from(check: bool | None) -> bool:
    """init's ``check``, else PYCOMM_CHECK."""
    return ENV.flag("PYCOMM_CHECK") if check is None else bool(check)


def timeout_from(timeout: timedelta | float | None) -> timedelta:
    """init's ``timeout`` (seconds or a timedelta), else PYCOMM_TIMEOUT, else
    DEFAULT_TIMEOUT."""
    if timeout is None:
        from_env = ENV.timeout()
        return DEFAULT_TIMEOUT if from_env is None else from_env
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=float(timeout))
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
    return timeout


def slice_bytes_for(slice_bytes: int | None, transport: str) -> int:
    """The explicit slice size, else PYCOMM_SLICE_BYTES, else the transport's."""
    if slice_bytes is not None:
        return int(slice_bytes)
    from_env = ENV.slice_bytes()
    if from_env is not None:
        return from_env
    return {"nccl": DEFAULT_CUDA_SLICE_BYTES, "gloo": DEFAULT_GLOO_SLICE_BYTES}.get(
        transport, DEFAULT_SLICE_BYTES)


def validate_world(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} is out of range for world_size {world_size}")


def resolve_transport(
    transport: str, device: str | torch.device | None
) -> tuple[str, torch.device | None]:
    """Validates init's transport and device; returns ("nccl" | "shm" | "gloo"
    | "auto" (a CPU transport picked at rendezvous), the requested device)."""
    if transport not in ("auto", "gloo", "shm", "nccl"):
        raise ValueError(f"unknown transport {transport!r}; expected 'auto', 'gloo', 'shm' or 'nccl'")
    with_cuda = bool(getattr(_C, "WITH_CUDA", False))
    req = torch.device(device) if device is not None else None
    # nccl (GPU) when asked for, when the device is CUDA, or for transport="auto"
    # with no device given on a CUDA build that sees a GPU.
    use_nccl = (
        transport == "nccl"
        or (req is not None and req.type == "cuda")
        or (transport == "auto" and req is None and with_cuda and torch.cuda.is_available())
    )
    if use_nccl:
        if not with_cuda:
            raise ValueError(
                "this pycomm build has no CUDA/NCCL support (pycomm._C.WITH_CUDA is False); "
                "use device='cpu' with transport 'gloo' or 'shm', or rebuild with a CUDA torch"
            )
        if transport not in ("auto", "nccl"):
            raise ValueError(f"transport {transport!r} runs on CPU tensors; CUDA needs 'nccl'")
        if req is not None and req.type != "cuda":
            raise ValueError(f"transport 'nccl' needs a CUDA device, got device={req}")
        return "nccl", req
    if req is not None and req.type != "cpu":
        raise ValueError(f"unsupported device {req}; pycomm runs on 'cpu' or CUDA devices")
    return transport, req


def group_members(ranks: Sequence[int], world_size: int) -> tuple[int, ...]:
    """``ranks`` of new_group as a tuple, validated against ``world_size``."""
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"new_group: ranks must be a sequence of ints, got {ranks!r}")
    members = tuple(ranks)
    for r in members:
        if isinstance(r, bool) or not isinstance(r, numbers.Integral):
            raise TypeError(f"new_group: ranks must be ints, got {r!r} ({type(r).__name__})")
    members = tuple(int(r) for r in members)
    if not members:
        raise ValueError("new_group: ranks is empty; a group needs at least one rank")
    bad = [r for r in members if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"new_group: ranks {bad} are out of range for world_size {world_size}")
    if len(set(members)) != len(members):
        dups = sorted({r for r in members if members.count(r) > 1})
        raise ValueError(f"new_group: ranks {dups} appear more than once in {list(members)}")
    return members


def as_int64(value: Any, name: str) -> int:
    """split's color/key: an int that fits in int64 (they travel as int64)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"split: {name} must be an int or None, got {value!r}")
    if not -(1 << 63) <= int(value) < (1 << 63):
        raise ValueError(f"split: {name}={value} does not fit in 64 bits")
    return int(value)


# ------------------------------------------------------------------ rendezvous

_init_count = 0  # init() calls in this process: numbers the default key prefix


def rendezvous(
    rank: int | None, world_size: int | None, store: Any, group: Any, timeout: timedelta
) -> tuple[Any, int, int, str]:
    """Returns (store, rank, world_size, key prefix)."""
    global _init_count
    _init_count += 1
    if group is not None:
        if not dist.is_initialized():
            raise ValueError("init(group=...) needs torch.distributed.init_process_group first")
        r, n = dist.get_rank(group), dist.get_world_size(group)
        if rank is not None and rank != r:
            raise ValueError(f"rank={rank} disagrees with the group's rank {r}")
        base = dist.distributed_c10d._get_default_store()
        name = dist.distributed_c10d._get_process_group_name(group) if group != dist.group.WORLD else "world"
        return base, r, n, f"pycomm/{name}/{_init_count}"
    if store is not None:
        if rank is None or world_size is None:
            raise ValueError("init(store=...) also needs rank= and world_size=")
        return store, rank, world_size, f"pycomm/{_init_count}"
    if rank is None and world_size is None and dist.is_initialized():
        return rendezvous(None, None, None, dist.group.WORLD, timeout)
    r, n = ENV.torchrun_world(rank, world_size)
    validate_world(r, n)  # before the rendezvous, which would wait for the missing rank
    st, r, n = next(dist.rendezvous("env://", r, n, timeout=timeout))
    return st, r, n, f"pycomm/{_init_count}"


def prepare(rank: int | None, world_size: int | None, store: Any, group: Any, transport: str,
            device: str | torch.device | None, timeout: timedelta | float | None,
            slice_bytes: int | None, check: bool | None,
            key_prefix: str | None) -> tuple[Any, int, int, Settings]:
    """init()'s steps 1 and 2 (the module docstring) for its arguments:
    (this communicator's own prefixed store, rank, world size, the settings
    asked for)."""
    check_on = check_from(check)
    ENV.check_cpu_simd()
    timeout = timeout_from(timeout)
    transport, req = resolve_transport(transport, device)
    st, r, n, prefix = rendezvous(rank, world_size, store, group, timeout)
    if key_prefix is not None:
        prefix = key_prefix
    # A restarted job may find the last attempt's keys in the same store (the
    # elastic agent's): scope this attempt's, so none of them is ever read.
    prefix = f"{prefix}/attempt{ENV.attempt()}"
    validate_world(r, n)
    asked = Settings(transport=transport, device=req, timeout=timeout, slice_bytes=slice_bytes,
                     check=check_on, require_check=check is not None)
    return dist.PrefixStore(prefix, st), r, n, asked


def host_id() -> str:
    """This host: hostname and boot id (a container or network namespace with
    its own hostname counts as a host of its own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}"


def host_ids(store: Any, prefix: str, rank: int, world_size: int,
             what: str = "choosing the transport") -> list[str]:
    """Every rank's :func:`host_id`, exchanged through the store (``what``:
    the step a missing rank's timeout names)."""
    return all_gather(store, f"{prefix}/host", rank, world_size, host_id(), what)


def publish_process(store: Any, rank: int) -> None:
    """Records where rank ``rank`` runs (host id and pid), for
    pycomm._shrink.liveness."""
    store.set(f"process/{rank}", f"{host_id()}|{os.getpid()}")


# ------------------------------------------------------------------ shm bootstrap

_shm_count = 0  # shm communicators created here: part of each segment's name
_SHM_DIR = "/dev/shm"
_SEGMENT = re.compile(r"pycomm-(\d+)-(\d+)-")  # pycomm-<creator pid>-<its pid namespace>-...


def _pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid), 0
    where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def orphan_segments() -> list[str]:
    """The names in /dev/shm of shm segments whose creator, a process of
    this pid namespace, is gone. Such a name is garbage: once every rank has
    mapped a segment its name is unlinked, so a name outlives only a setup
    that failed, and with its creator (rank 0) gone that setup failed for
    good. Only SIGKILL of every rank in that window leaves one. (A symmetric
    buffer's part, ``<name>.s<id>.<r>``, carries rank 0's pid though rank r
    made it: no allocation completes without rank 0 either.)"""
    ns = _pid_namespace()
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return []
    out = []
    for name in names:
        m = _SEGMENT.match(name)
        if ns and m and int(m.group(2)) == ns and not process_alive(int(m.group(1))):
            out.append(name)
    return out


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` (of this pid namespace) still runs: a zombie
    does not; another user's counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited child its parent has not reaped yet still answers kill()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def sweep_orphan_segments() -> list[str]:
    """Unlinks :func:`orphan_segments` (those this user may) and returns
    their names: a job killed whole during its setup leaves nothing for
    longer than the next setup. Says so (RuntimeWarning): it means a leak."""
    removed = []
    for name in orphan_segments():
        try:
            os.unlink(os.path.join(_SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass  # another user's, or unlinked meanwhile
    if removed:
        warnings.warn(f"pycomm: removed {len(removed)} shared-memory segment(s) left in /dev/shm "
                      f"by processes that are gone (killed while setting up): {removed}",
                      RuntimeWarning, stacklevel=2)
    return removed


def init_shm(st: Any, rank: int, world_size: int, timeout_ms: int, slice_bytes: int,
             fallback_ok: bool) -> Any:
    """Creates the shm communicator: rank 0 creates the segment (O_EXCL, 0600)
    and publishes its name; the others attach; once every rank has reported
    (store barrier) the name is unlinked, so nothing outlives the processes.

    Returns None (on every rank alike) when some rank could not set up shared
    memory and ``fallback_ok``; raises CommError otherwise.
    """
    global _shm_count
    _shm_count += 1
    key = "shm"  # ``st`` is this communicator's own prefixed store
    # Rank 0 publishes the name before it creates the segment, so that if it
    # dies or is interrupted before every rank has mapped it (the last one to
    # do so unlinks it, shm_transport.h), the survivors can remove it: every
    # rank unlinks the name when init fails here, whatever the reason.
    # Unique per job (rank 0's pid + random) and per communicator.
    if rank == 0:
        sweep_orphan_segments()
    name = (f"/pycomm-{os.getpid()}-{_pid_namespace()}-{_shm_count}-{uuid.uuid4().hex[:12]}"
            if rank == 0 else None)
    intent = broadcast(st, f"{key}/intent", rank, name, "shm setup")
    try:
        impl, errors = _map_shm(st, key, intent, rank, world_size, timeout_ms, slice_bytes)
    except BaseException:
        _C.shm_unlink(intent)  # ENOENT is fine
        raise
    _C.shm_unlink(intent)
    if errors:
        if impl is not None:
            impl.close()
        reason = "could not set up the shm transport: " + "; ".join(dict.fromkeys(errors))
        if fallback_ok:
            _warn_fallback_once(reason)
            return None
        raise CommError(reason)
    return impl


_fallback_warned = False


def _warn_fallback_once(reason: str) -> None:
    """transport="auto" falls back from shm to gloo (much slower): say why,
    once per process."""
    global _fallback_warned
    if not _fallback_warned:
        _fallback_warned = True
        warnings.warn(f"pycomm: transport='auto' uses gloo instead of shm ({reason}); pass "
                      "transport='shm' to make this an error", RuntimeWarning, stacklevel=5)


def _map_shm(st: Any, key: str, name: str, rank: int, world_size: int, timeout_ms: int,
             slice_bytes: int) -> tuple[Any, list[str]]:
    """init_shm's steps: rank 0 creates segment ``name``, the others map it,
    then a store barrier. Returns (this rank's communicator or None, every
    rank's error)."""
    impl, err, outcome = None, "", None
    if rank == 0:
        try:
            impl = _C.make_shm_comm(name, rank, world_size, True, timeout_ms, slice_bytes)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            err = f"rank 0: {e}"
        outcome = "!" + err if err else name  # the others map the segment or learn why not
    try:
        published = broadcast(st, f"{key}/name", rank, outcome, "shm setup")
        if rank != 0:
            if published.startswith("!"):
                err = published[1:]
            else:
                try:
                    impl = _C.make_shm_comm(name, rank, world_size, False, timeout_ms, slice_bytes)
                except Exception as e:  # noqa: BLE001
                    err = f"rank {rank}: {e}"
        # Barrier: every rank has mapped the segment (or failed to).
        errors = agree_errors(st, f"{key}/mapped", rank, world_size, err, "shm setup")
    except BaseException:
        if impl is not None:
            impl.close()
        raise
    return impl, [e for _, e in errors]


# ------------------------------------------------------------------ nccl bootstrap

def auto_table_for(device: str, transport: str, world_size: int,
                   hosts: bool = False) -> _auto_table.Rules:
    """algo="auto"'s table for a communicator (pycomm/_auto_table.py) whose
    ranks are on one host or (``hosts``) on several: PYCOMM_AUTO_TABLE's
    entry for it, else the built-in table's."""
    return _auto_table.table_for(device, transport, world_size,
                                 ENV.text("PYCOMM_AUTO_TABLE") or None, hosts)


def choose_cuda_index(requested: int | None, local_rank: str | None, device_count: int,
                      current_device: Callable[[], int]) -> int:
    """The CUDA device index of an nccl communicator, without touching CUDA.

    ``requested`` (the index of an explicit ``device=``) always wins; else
    ``LOCAL_RANK`` (``local_rank``: its value, None or "" when unset), as
    torchrun sets it; else ``current_device()`` (the caller's
    ``torch.cuda.set_device`` choice, or 0). Raises ValueError for a
    LOCAL_RANK that is not an integer and for an index outside
    ``range(device_count)``.
    """
    if requested is not None:
        index, what = requested, f"device=cuda:{requested}"
    elif local_rank is not None and local_rank.strip():
        try:
            index = int(local_rank)
        except ValueError:
            raise ValueError(f"environment variable LOCAL_RANK={local_rank!r} is not an integer"
                             ) from None
        what = f"LOCAL_RANK={index} (default device cuda:LOCAL_RANK)"
    else:
        index = current_device()
        what = f"torch.cuda.current_device()={index}"
    if not 0 <= index < device_count:
        raise ValueError(f"{what}: there is no cuda:{index} ({device_count} CUDA device(s) "
                         "visible); pass device='cuda:N' to init, or check CUDA_VISIBLE_DEVICES")
    return index


def cuda_device(device: torch.device | None) -> torch.device:
    """init's CUDA device: see choose_cuda_index. Never calls
    torch.cuda.set_device: the caller's current device stays theirs (the
    communicator's C++ side switches devices with scoped guards)."""
    if not torch.cuda.is_available():
        raise ValueError(f"device {device or 'cuda'} requested but torch.cuda.is_available() "
                         "is False")
    requested = None if device is None else torch.device(device).index
    index = choose_cuda_index(requested, ENV.get("LOCAL_RANK"), torch.cuda.device_count(),
                              torch.cuda.current_device)
    return torch.device("cuda", index)


def make_nccl(st: Any, r: int, n: int, dev: torch.device, timeout: timedelta,
              slice_bytes: int) -> Any:
    """NCCL bootstrap: rank 0 creates the unique id and publishes it through
    the (prefixed, per-communicator) store; every rank initialises on ``dev``
    (from cuda_device: an existing device)."""
    uid = bytes.fromhex(broadcast(st, "nccl/unique_id", r,
                                  _C.nccl_unique_id().hex() if r == 0 else None, "NCCL setup"))
    timeout_ms = int(timeout.total_seconds() * 1000)
    return _C.make_nccl_comm(uid, r, n, dev.index, timeout_ms, slice_bytes,
                             auto_table_for("cuda", "nccl", n))


# ------------------------------------------------------------------ plan and build

@dataclass(frozen=True)
class Plan:
    """The transport of a communicator, decided once (:func:`plan_transport`) before
    anything is built; :data:`BUILDERS` has one builder per ``transport``."""

    transport: str  # "shm", "gloo", "nccl" or "shm+gloo"
    #: shm: every rank falls back to gloo when some rank cannot set up shared
    #: memory ("auto"), instead of raising ("shm" asked for).
    fallback_ok: bool = False
    #: shm+gloo: where the ranks run.
    layout: _hierarchy.Layout | None = None
    #: Whether the ranks span hosts, where "auto" found out (None: a gloo
    #: builder asks the store itself).
    across_hosts: bool | None = None


def plan_transport(st: Any, r: int, n: int, asked: Settings) -> Plan:
    """The transport to build for ``asked``: "nccl", "shm" and "gloo" as
    asked; "auto" (CPU; "shm+gloo" asked, by a group or shrink of such a
    communicator, is decided as "auto" is) is a collective decision through
    ``st``: shm when every rank is on this host, else (after the address
    check) the shm+gloo hierarchy when every host has the same number >= 2 of
    ranks (pycomm._hierarchy), else gloo."""
    if asked.transport not in ("auto", "shm+gloo"):
        return Plan(asked.transport)
    ids = host_ids(st, "auto", r, n)
    if all(i == ids[0] for i in ids):
        return Plan("shm", fallback_ok=True, across_hosts=False)
    _hierarchy.check_addresses(dist.PrefixStore("auto", st), r, n)
    layout = _hierarchy.Layout.from_host_ids(ids)
    refusal = _hierarchy.hierarchy_refusal(layout)
    if refusal is None:
        return Plan("shm+gloo", layout=layout, across_hosts=True)
    if len(set(layout.ranks_per_host())) > 1:
        _hierarchy.warn_flat_once(refusal)
    return Plan("gloo", across_hosts=True)


#: A builder: (store, rank, world size, asked, plan) -> (the transport it
#: built, the C++ communicator with its algo="auto" table, objects the
#: communicator must keep alive). A hierarchy's parts have their own tables.
Builder = Callable[[Any, int, int, Settings, Plan], tuple[str, Any, list[Any]]]


def _timeout_ms(asked: Settings) -> int:
    return int(asked.timeout.total_seconds() * 1000)


def _build_gloo(st: Any, r: int, n: int, asked: Settings, plan: Plan) -> tuple[str, Any, list[Any]]:
    # algo="auto" takes a table measured where this group runs: on one host
    # or across hosts (pycomm/_auto_table.py)
    across = plan.across_hosts
    if across is None:
        across = len(set(host_ids(st, "gloo-place", r, n, "building the gloo transport"))) > 1
    # headers on one group, payloads on a group per direction (lower rank to
    # higher, and back): full duplex (csrc/torch/pg_transport.h)
    pgs = [dist.ProcessGroupGloo(dist.PrefixStore(name, st), r, n, asked.timeout)
           for name in ("gloo", "gloo-up", "gloo-down")]
    # the store also carries a failing rank's reason to peers blocked in a send
    impl = _C.make_gloo_comm(*pgs, timeout_ms=_timeout_ms(asked),
                             slice_bytes=slice_bytes_for(asked.slice_bytes, "gloo"),
                             store=dist.PrefixStore("gloo-abort", st))
    impl.auto_table = auto_table_for("cpu", "gloo", n, hosts=across)
    return "gloo", impl, pgs


def _build_shm(st: Any, r: int, n: int, asked: Settings, plan: Plan) -> tuple[str, Any, list[Any]]:
    impl = init_shm(st, r, n, _timeout_ms(asked), slice_bytes_for(asked.slice_bytes, "shm"),
                    fallback_ok=plan.fallback_ok)
    if impl is None:  # every rank alike: some rank could not set up shared memory
        return _build_gloo(st, r, n, asked, plan)
    impl.auto_table = auto_table_for("cpu", "shm", n)
    return "shm", impl, []


def _build_nccl(st: Any, r: int, n: int, asked: Settings, plan: Plan) -> tuple[str, Any, list[Any]]:
    impl = make_nccl(st, r, n, cuda_device(asked.device), asked.timeout,
                     slice_bytes_for(asked.slice_bytes, "nccl"))
    return "nccl", impl, []


def _build_hierarchy(st: Any, r: int, n: int, asked: Settings,
                     plan: Plan) -> tuple[str, Any, list[Any]]:
    assert plan.layout is not None
    return _hierarchy.build_hierarchical(dist.PrefixStore("hier", st), r, plan.layout,
                                         replace(asked, transport="auto"), build)


#: One builder per planned transport.
BUILDERS: dict[str, Builder] = {
    "gloo": _build_gloo,
    "shm": _build_shm,
    "nccl": _build_nccl,
    "shm+gloo": _build_hierarchy,
}


def build(st: Any, r: int, n: int, asked: Settings) -> tuple[Any, Settings, list[Any]]:
    """Builds the transport of rank ``r`` of ``n`` that rendezvous through
    ``st`` (a store prefixed for this communicator alone), as ``asked``:
    :func:`plan_transport`, then the plan's builder. init() and groups
    (Communicator._create_group) share it.

    Returns:
        (the C++ communicator, the resolved settings, objects the
        communicator must keep alive).
    """
    publish_process(st, r)
    chosen = plan_transport(st, r, n, asked)
    transport, impl, keepalive = BUILDERS[chosen.transport](st, r, n, asked, chosen)
    if asked.check:
        if hasattr(impl, "check"):
            impl.check = True
        elif asked.require_check:
            impl.close()
            raise ValueError(f"check=True is not supported by the {transport!r} transport")
    built = Settings(transport=transport, device=torch.device(impl.device), timeout=asked.timeout,
                     slice_bytes=int(impl.slice_bytes), check=bool(getattr(impl, "check", False)))
    return impl, built, keepalive
