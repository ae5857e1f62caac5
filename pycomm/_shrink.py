"""Who continues after a failure: the survivors' agreement behind
``Communicator.shrink()``.

Every surviving rank of the old communicator calls ``agree_on_survivors``
with what it knows; they agree, through the old communicator's store, on one
member list, the same on every rank:

  1. each rank checks in under ``<base>/in/<rank>``;
  2. it waits for the ranks it expects: every rank but those it knows are
     dead (a rank on this host whose process has exited). When every rank
     runs on this host that knowledge is exact, and it waits (up to
     ``timeout``) for all the living; a rank on another host cannot be told
     from a slow one, so then it waits at most ``grace`` seconds. It looks
     again while it waits: a killed rank's connections close before its
     process is gone, so a survivor that noticed at once may have seen it
     still running. (With ``exclude`` the caller names the ranks that
     leave, and there is nothing to agree on.)
  3. it proposes the ranks that have checked in by then, and the first
     proposal wins (the store's ``compare_set``), so a rank that checked in
     late reads the same list as everyone else, and is told it was left out
     rather than joining a communicator the others do not have.

Keys live under ``<base>`` (``shrink<k>`` of the communicator's own store,
``k`` counting this communicator's shrinks), so a later shrink never reads
an earlier one's keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.distributed as dist

from ._ext import CommError
from ._setup import ENV, host_id, process_alive
from ._store import ranks_text

__all__ = ["agree_on_survivors", "liveness", "survivors"]

_POLL_S = 0.005


def agree_on_survivors(store: Any, base: str, rank: int, world_size: int, *,
                       exclude: Iterable[int] | None,
                       dead: Iterable[int] | Callable[[], Iterable[int]],
                       unknown: Iterable[int], grace: float, timeout: float) -> list[int]:
    """The old ranks that continue, in order (the new rank of each is its
    index). ``dead``: ranks known to have exited, or a function that tells
    them, asked again while the ranks expected have not all checked in (step
    2); ``unknown``: ranks whose liveness cannot be seen from here. Raises
    ValueError for a bad ``exclude`` and RuntimeError when this rank was
    left out (it checked in after the list was decided)."""
    if exclude is not None:
        excluded = sorted(set(int(q) for q in exclude))
        bad = [q for q in excluded if not 0 <= q < world_size]
        if bad:
            raise ValueError(f"shrink(exclude={excluded}): ranks {bad} are out of range for "
                             f"world_size {world_size}")
        if rank in excluded:
            raise ValueError(f"shrink(exclude={excluded}): rank {rank} excludes itself; only "
                             "the ranks that continue call shrink()")
        return [q for q in range(world_size) if q not in excluded]
    find_dead = dead if callable(dead) else (lambda known=set(dead): known)
    store.set(f"{base}/in/{rank}", "1")
    expected = [q for q in range(world_size) if q not in set(find_dead()) - {rank}]
    deadline = time.monotonic() + (grace if set(unknown) - {rank} else timeout)
    arrived = _arrived(store, base, expected)
    while len(arrived) < len(expected) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        gone = set(find_dead()) - set(arrived) - {rank}  # died since the last look
        expected = [q for q in expected if q not in gone]
        arrived = _arrived(store, base, expected)
    proposal = ",".join(str(q) for q in arrived)
    decided = store.compare_set(f"{base}/members", "", proposal)
    members = [int(q) for q in (decided.decode() if isinstance(decided, bytes) else decided).split(",")]
    if rank not in members:
        raise RuntimeError(f"shrink: rank {rank} checked in after the survivors {members} were "
                           "decided; it is not part of the new communicator")
    return members


def survivors(store: Any, base: str, rank: int, world_size: int,
              exclude: Iterable[int] | None, timeout: float) -> list[int]:
    """:func:`agree_on_survivors` with what this rank can see: the ranks on
    this host whose processes have exited (looked at again while waiting),
    those on other hosts as unknown, ``PYCOMM_SHRINK_GRACE``."""
    local, unknown = _processes(store, world_size) if exclude is None else ({}, set())

    def dead() -> set[int]:
        return {q for q, pid in local.items() if not process_alive(pid)}

    return agree_on_survivors(store, base, rank, world_size, exclude=exclude, dead=dead,
                              unknown=unknown, grace=ENV.shrink_grace(), timeout=timeout)


def _arrived(store: Any, base: str, expected: list[int]) -> list[int]:
    return [q for q in expected if store.check([f"{base}/in/{q}"])]


def liveness(store: Any, world_size: int) -> tuple[set[int], set[int]]:
    """(ranks known dead, ranks whose liveness cannot be seen from here):
    a rank on this host is dead when its process has exited (a zombie
    counts); one on another host cannot be told from a slow one."""
    local, unknown = _processes(store, world_size)
    return {q for q, pid in local.items() if not process_alive(pid)}, unknown


def exited(store: Any, ranks: list[int]) -> list[int]:
    """Those of ``ranks`` on this host whose process has exited (the others
    cannot be told from slow ones from here, nor can ranks that published no
    process: a communicator made by an NCCL split has none)."""
    known = [q for q in ranks if store.check([f"process/{q}"])]
    local, _ = _processes(store, known)
    return [q for q in known if q in local and not process_alive(local[q])]


def group_exited(store: Any, members: Sequence[int]) -> Callable[[list[int]], list[int]]:
    """For the rendezvous of a group of ``members`` (ranks of the
    communicator whose store is ``store``): the missing group ranks -> those
    whose process has exited (pycomm._store.watching_liveness)."""
    def of(missing: list[int]) -> list[int]:
        gone = set(exited(store, [members[i] for i in missing]))
        return [i for i in missing if members[i] in gone]
    return of


def with_exited_members(store: Any, members: Sequence[int], rank: int, why: str) -> str:
    """``why`` a group's setup failed (on rank ``rank``, a member), led by
    the members whose process has exited where that is the cause and ``why``
    does not say so (a transport's own rendezvous, gloo's, only times out)."""
    if "exited" in why:
        return why
    others = [i for i, m in enumerate(members) if m != rank]
    try:
        gone = group_exited(store, members)(others)
    except (dist.DistError, RuntimeError):  # the store is gone too: say what is known
        return why
    if not gone:
        return why
    return f"{ranks_text(gone, members)} exited (the process is gone): {why}"


def group_setup_failure(store: Any, members: Sequence[int], rank: int,
                        error: BaseException) -> str:
    """The message of the CommError a member raises when making the group
    ``members`` failed with ``error``: pycomm's own says why; the store
    unreachable, or a transport's own rendezvous or connect failing (gloo's
    raises RuntimeError), is led by the members known to have exited."""
    if isinstance(error, dist.DistNetworkError):
        why = f"the store is unreachable ({error})"
    elif isinstance(error, CommError):
        why = str(error)
    else:
        why = with_exited_members(store, members, rank, str(error))
    return f"creating the group of ranks {list(members)} (group rank i is ranks[i]) on rank {rank}: {why}"


def _processes(store: Any, ranks: int | list[int]) -> tuple[dict[int, int], set[int]]:
    """({rank: pid} of ``ranks`` (all of a world of that size, for an int)
    that run on this host, those on other hosts)."""
    me, local, unknown = host_id(), {}, set()
    for q in (range(ranks) if isinstance(ranks, int) else ranks):
        host, _, pid = store.get(f"process/{q}").decode().rpartition("|")
        if host != me:
            unknown.add(q)
        else:
            local[q] = int(pid)
    return local, unknown
