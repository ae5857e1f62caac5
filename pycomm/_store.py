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

from typing import Any

import torch.distributed as dist

from ._ext import CommError

__all__ = ["agree_errors", "all_gather", "broadcast", "wait_for"]


def wait_for(store: Any, keys: dict[int, str], what: str) -> None:
    """Waits for the store keys of the ranks in ``keys`` (rank -> key) under
    the store's own timeout (ranks may reach a rendezvous far apart; the
    communicator's timeout bounds its operations, not its creation). A
    timeout is a CommError naming the ranks still missing and ``what`` was
    being set up."""
    try:
        store.wait(list(keys.values()))
    except dist.DistStoreError as e:
        missing = [q for q, k in keys.items() if not store.check([k])]
        raise CommError(
            f"{what}: ranks {missing} did not arrive within the store's timeout "
            f"({store.timeout.total_seconds():g} s); every rank of a new communicator must "
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
