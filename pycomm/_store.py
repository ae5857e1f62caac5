"""Agreements through the c10d store (private): "set my key, wait for every
rank's, read them back", written once.

Every collective decision of the setup (the host ids behind
``transport="auto"``, the shm segment being mapped on every rank, the
hosts' addresses, shared memory on every host) is one :func:`all_gather`
of a short string per rank, or one :func:`agree_errors` when what the ranks
share is "ok or why not". What one rank creates for all (the shm segment's
name, the NCCL unique id) is one :func:`broadcast`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch.distributed as dist

from ._ext import CommError

__all__ = ["agree_errors", "all_gather", "bounded_by", "broadcast", "ranks_text", "wait_for",
           "watching_liveness"]

#: How often a rendezvous under :func:`watching_liveness` looks whether a
#: rank it waits for has exited.
LIVENESS_SLICE = timedelta(seconds=0.5)

#: (ranks still missing -> those of them known to have exited, the group's
#: members: its ranks in the communicator that makes it) while watching (see
#: watching_liveness); None: wait without looking.
_watch: ContextVar[tuple[Callable[[list[int]], list[int]], Sequence[int] | None] | None] = \
    ContextVar("pycomm_rendezvous_watch", default=None)


#: The longest a rendezvous under :func:`bounded_by` waits, in seconds, where
#: it is shorter than the store's own timeout; None: the store's.
_limit: ContextVar[float | None] = ContextVar("pycomm_rendezvous_limit", default=None)


@contextmanager
def bounded_by(timeout: timedelta) -> Iterator[None]:
    """Within it, every :func:`wait_for` gives up after ``timeout`` where the
    store would wait longer. A group's rendezvous runs under the group's
    timeout (Communicator._create_group), as torch's new_group and gloo's own
    rendezvous do: a member alive but absent (stopped, busy, or on another
    host, where its process cannot be seen) is reported then, not at the
    store's timeout. ``init()`` keeps the store's: its ranks may start far
    apart."""
    token = _limit.set(timeout.total_seconds())
    try:
        yield
    finally:
        _limit.reset(token)


def _wait_limit(store: Any) -> tuple[float, str]:
    """(seconds a rendezvous may wait, 0: no limit; the timeout that sets it)."""
    own, bound = store.timeout.total_seconds(), _limit.get()
    if bound and (own <= 0 or bound < own):
        return bound, "the group's timeout"
    return own, "the store's timeout"


@contextmanager
def watching_liveness(exited: Callable[[list[int]], list[int]] | None,
                      members: Sequence[int] | None = None) -> Iterator[None]:
    """Within it, every :func:`wait_for` looks every LIVENESS_SLICE which of
    the ranks it still waits for ``exited`` says have exited, and raises
    CommError naming them at once instead of waiting out the store's
    timeout. A group's rendezvous runs under it (Communicator._create_group):
    a member that died before arriving is seen within a second where its
    process can be seen (on this host). The waits number ranks as the
    group does; ``members`` (group rank -> rank of the communicator making
    the group) lets the errors name both. A build whose waits number ranks
    otherwise (a hierarchy's parts) runs under ``watching_liveness(None)``,
    which waits plainly."""
    token = _watch.set(None if exited is None else (exited, members))
    try:
        yield
    finally:
        _watch.reset(token)


def _missing(store: Any, keys: dict[int, str]) -> list[int]:
    return [q for q, k in keys.items() if not store.check([k])]


def ranks_text(ranks: list[int], members: Sequence[int] | None = None) -> str:
    """"rank 1" or "ranks [1, 2]", as the errors of collectives name them;
    group ranks (``members``: group rank -> the rank making the group) as
    "rank 5 (group rank 1)" where the two differ."""
    def named(q: list[int]) -> str:
        return f"rank {q[0]}" if len(q) == 1 else f"ranks {q}"
    if members is None or all(members[g] == g for g in ranks):
        return named(ranks)
    return f"{named([members[g] for g in ranks])} (group {named(ranks)})"


def _wait_watching(store: Any, keys: dict[int, str], what: str, limit: float,
                   exited: Callable[[list[int]], list[int]],
                   members: Sequence[int] | None) -> None:
    # Polls (check() neither blocks nor logs a timeout, as a sliced wait()
    # would), its period doubling from 1 ms to 100 ms. A timeout of 0 is
    # c10d's "none".
    start = time.monotonic()
    deadline, looked, nap = start + limit if limit > 0 else float("inf"), start, 0.001
    while not store.check(list(keys.values())):
        now = time.monotonic()
        if now >= deadline:
            raise dist.DistStoreError(f"wait timeout after {now - start:.1f} s")
        if now - looked >= LIVENESS_SLICE.total_seconds():
            looked = now
            gone = exited(_missing(store, keys))
            if gone:
                raise CommError(f"{what}: {ranks_text(gone, members)} exited before arriving (their "
                                "processes are gone); every rank of a new communicator must "
                                "create it")
        time.sleep(nap)
        nap = min(2 * nap, 0.1)


def wait_for(store: Any, keys: dict[int, str], what: str) -> None:
    """Waits for the store keys of the ranks in ``keys`` (rank -> key) under
    the store's own timeout (``init()``: its ranks may start far apart), or
    a group's where that is shorter (:func:`bounded_by`). A timeout is a
    CommError naming the ranks still missing and ``what`` was being set up;
    so is, at once, a missing rank known to have exited
    (:func:`watching_liveness`)."""
    watch = _watch.get()
    limit, which = _wait_limit(store)
    try:
        if watch is not None:
            _wait_watching(store, keys, what, limit, *watch)
        elif limit > 0:
            store.wait(list(keys.values()), timedelta(seconds=limit))
        else:
            store.wait(list(keys.values()))
    except dist.DistStoreError as e:
        missing = _missing(store, keys)
        raise CommError(
            f"{what}: {ranks_text(missing, watch and watch[1])} did not arrive within {which} "
            f"({limit:g} s); every rank of a new communicator must "
            "create it (init(), or new_group/split on every member)") from e


def all_gather(store: Any, key: str, rank: int, world_size: int, value: str,
               what: str) -> list[str]:
    """Every rank's ``value`` in rank order: sets ``<key>/<rank>``, waits for
    the keys of all ``world_size`` ranks (:func:`wait_for`), reads them back."""
    store.set(f"{key}/{rank}", value)
    keys = {q: f"{key}/{q}" for q in range(world_size)}
    wait_for(store, keys, what)
    return [store.get(k).decode() for k in keys.values()]


def agree_errors(store: Any, key: str, rank: int, world_size: int, error: str,
                 what: str) -> list[tuple[int, str]]:
    """(rank, error) of every rank whose ``error`` is not empty, the same
    list on every rank: a collective "did it work everywhere?"."""
    values = all_gather(store, key, rank, world_size, "!" + error if error else "ok", what)
    return [(q, v[1:]) for q, v in enumerate(values) if v != "ok"]


def broadcast(store: Any, key: str, rank: int, value: str | None, what: str,
              root: int = 0) -> str:
    """Rank ``root``'s ``value`` on every rank: the root sets ``key``, every
    rank waits for it (:func:`wait_for`) and reads it back. ``value`` is
    read on the root only (the others pass None)."""
    if rank == root:
        if value is None:
            raise ValueError(f"broadcast of {key!r}: the root (rank {root}) has no value")
        store.set(key, value)
    wait_for(store, {root: key}, what)
    return store.get(key).decode()


#: The counter of a group's members that have closed it (release_keys).
_LEFT_KEY = "left"
#: Where the communicators made from a group keep their keys, under its
#: prefix (Communicator._create_group, shrink, an NCCL split): they outlive
#: it, and a group among them releases its own.
_NESTED_PREFIXES = ("group/", "shrink/", "nccl-split/")


def release_keys(store: Any, members: int) -> None:
    """Deletes a group's rendezvous keys once every member has closed it.

    The store keeps every key for the job's life, on the store's host (rank
    0's process under torchrun): a program that makes and closes groups
    again and again would grow it without bound (dozens of keys per
    group of 4 ranks on gloo). Every member calls this as it closes the
    group, healthy (Communicator.close: not after an abort); the last of
    them (the one whose increment of ``left`` makes it ``members``) deletes
    every key under the group's prefix but those of the communicators made
    from it: no member reads one after it closed. Best effort: a store that
    fails leaves the keys where they are.
    """
    try:
        if store.add(_LEFT_KEY, 1) != members:
            return
        for key in store.list_keys():
            if not key.startswith(_NESTED_PREFIXES):
                store.delete_key(key)
    except (RuntimeError, dist.DistError):  # NotImplementedError: a store without list_keys
        pass
