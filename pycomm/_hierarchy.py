"""Collectives across hosts: the layout decision, the address check and the
build (private).

``transport="auto"`` over ranks on several hosts (pycomm._setup.build)
builds, with the same ``build`` as any other communicator, three of them:
``flat`` (gloo, every rank), ``intra`` (shm, this host's ranks) and
``inter`` (gloo, the ranks with this local index), then makes the flat one
compose the collectives over the other two (``_C.Comm.compose_hosts``). How
the composition runs (one worker thread, one queue in issue order, the
steps of an all-reduce, what runs flat) is written once, in
``csrc/torch/hierarchy.h``; :data:`ALL_REDUCE_STEPS` is its step table.

The rule for uneven hosts: the composition needs the same number L >= 2 of
ranks on every host; otherwise (3 + 1 ranks, or one rank a host) "auto"
takes the flat gloo ring, with a one-time warning naming why for uneven
hosts (:func:`hierarchy_refusal`). So does a job where some host cannot set
up shared memory (decided together: :func:`build_hierarchical`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch.distributed as dist

from ._ext import _C
from ._store import agree_errors, watching_liveness

#: Largest all-reduce (bytes) taken as intra all-reduce + inter all-reduce of
#: the whole tensor (csrc/torch/hierarchy.h, kSmallBytes).
SMALL_BYTES: int = int(_C.HIERARCHY_SMALL_BYTES)


@dataclass(frozen=True)
class Step:
    """One step of a composed all-reduce: the collective ``op`` on the
    ``comm`` communicator ("intra": this host's L ranks, "inter": the H
    ranks with this local index), over the whole tensor of B bytes or, with
    ``shard``, over this local rank's B/L of it."""

    comm: str
    op: str
    shard: bool = False


#: The all-reduce as the C++ hierarchy runs it (csrc/torch/hierarchy.h),
#: large and (up to SMALL_BYTES) small; the cost model
#: (pycomm.bench.hosts_model) counts its ring steps from this table, and
#: tests/test_hierarchy.py checks the parts' op counts against it.
ALL_REDUCE_STEPS: dict[str, tuple[Step, ...]] = {
    case: tuple(Step(*s) for s in _C.hierarchy_steps(case)) for case in ("large", "small")}


def all_reduce_steps(nbytes: float) -> tuple[Step, ...]:
    """The steps of an all-reduce of ``nbytes`` bytes (ALL_REDUCE_STEPS)."""
    return ALL_REDUCE_STEPS["small" if nbytes <= SMALL_BYTES else "large"]


@dataclass(frozen=True)
class Layout:
    """Where the ranks run: global rank g is local rank ``local[g]`` of host
    ``host[g]``; hosts are numbered by their lowest rank, local ranks in rank
    order (torchrun's numbering gives g = host * L + local)."""

    host: tuple[int, ...]
    local: tuple[int, ...]

    @classmethod
    def from_host_ids(cls, ids: Sequence[str]) -> "Layout":
        """The layout of ranks whose host ids (``_setup.host_id``) are ``ids``."""
        numbers: dict[str, int] = {}
        host: list[int] = []
        local: list[int] = []
        for ident in ids:
            h = numbers.setdefault(ident, len(numbers))
            local.append(host.count(h))
            host.append(h)
        return cls(tuple(host), tuple(local))

    @property
    def n_hosts(self) -> int:
        return max(self.host) + 1

    def ranks_per_host(self) -> list[int]:
        return [self.host.count(h) for h in range(self.n_hosts)]

    def rank_of(self, host: int, local: int) -> int:
        """The global rank of local rank ``local`` on host ``host``."""
        return next(g for g in range(len(self.host))
                    if self.host[g] == host and self.local[g] == local)


def hierarchy_refusal(layout: Layout) -> str | None:
    """None when ``layout`` spans several hosts with the same number >= 2 of
    ranks on each (the composition applies), else why the flat ring runs."""
    counts = layout.ranks_per_host()
    if len(counts) < 2:
        return "every rank is on one host"
    if len(set(counts)) > 1:
        return (f"hosts have different numbers of ranks ({'+'.join(map(str, counts))}); the "
                "shm+gloo hierarchy needs the same number on every host")
    if counts[0] < 2:
        return "one rank per host: nothing to share through memory"
    return None


_flat_warned = False


def warn_flat_once(reason: str) -> None:
    """transport="auto" across hosts runs the flat gloo ring (uneven hosts,
    or no shared memory on some host): say why, once per process."""
    global _flat_warned
    if not _flat_warned:
        _flat_warned = True
        warnings.warn(f"pycomm: transport='auto' runs the flat gloo ring across hosts ({reason})",
                      RuntimeWarning, stacklevel=6)


# ------------------------------------------------------------------ the inter-host interface

def address_problem(hostname: str, ifname: str | None) -> str | None:
    """Why gloo could not reach this host from another, or None.

    Gloo binds to ``GLOO_SOCKET_IFNAME`` (``ifname``) when set, else to the
    address ``hostname`` resolves to: a hostname that does not resolve, or
    resolves only to loopback (Debian's ``127.0.1.1`` line), makes the other
    hosts connect to nothing.
    """
    if ifname:
        return None
    try:
        infos = socket.getaddrinfo(hostname, None, proto=socket.IPPROTO_TCP)
    except OSError as e:
        return f"hostname {hostname!r} does not resolve ({e})"
    addrs = {str(info[4][0]) for info in infos}
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        return f"hostname {hostname!r} resolves only to loopback ({', '.join(sorted(addrs))})"
    return None


def check_addresses(st: Any, rank: int, world_size: int) -> None:
    """A collective check that every rank's host can be reached by gloo;
    every rank raises the same ValueError, naming the fix, when one cannot.

    Raises:
        ValueError: some rank's hostname does not resolve to a reachable
            address and GLOO_SOCKET_IFNAME is unset there.
    """
    problem = address_problem(socket.gethostname(), os.environ.get("GLOO_SOCKET_IFNAME"))
    bad = agree_errors(st, "addr", rank, world_size, problem or "", "checking the hosts' addresses")
    if bad:
        listed = "; ".join(f"rank {q}: {why}" for q, why in bad)
        raise ValueError(
            f"pycomm: gloo between hosts cannot find this host's address ({listed}). Fix: map "
            "each hostname to an address the other hosts reach, in /etc/hosts or DNS, or set "
            "GLOO_SOCKET_IFNAME to the interface to use (e.g. eth0) on every rank")


# ------------------------------------------------------------------ building

Build = Callable[[Any, int, int, Any], tuple[Any, Any, list[Any]]]


def build_hierarchical(st: Any, rank: int, layout: Layout, asked: Any,
                       build: Build) -> tuple[str, Any, list[Any]]:
    """(transport, communicator, what it keeps alive) of ``rank``: the three
    communicators, each built by ``build`` (_setup.build) under its own
    prefix of ``st``, the flat one composing over the other two as
    "shm+gloo"; or, when shared memory cannot
    be set up on some host (e.g. a small ``/dev/shm``), the flat one alone
    as "gloo" on every rank, with a one-time warning naming why."""
    host, local = layout.host[rank], layout.local[rank]
    n_local, n_hosts = layout.ranks_per_host()[0], layout.n_hosts
    flat, _, keep = build(dist.PrefixStore("flat", st), rank, len(layout.host),
                          replace(asked, transport="gloo"))
    intra, why = None, ""
    try:
        with watching_liveness(None):  # its waits number this host's ranks
            intra, _, keep_intra = build(dist.PrefixStore(f"intra/{host}", st), local, n_local,
                                         replace(asked, transport="shm"))
    except RuntimeError as e:  # CommError: every rank of that host sees it
        why = f"host of rank {rank}: {e}"
    # A collective decision: the other hosts must not wait for a missing group.
    failed = agree_errors(st, "intra_ok", rank, len(layout.host), why,
                          "setting up shared memory on every host")
    if failed:
        if intra is not None:
            intra.close()
        warn_flat_once(failed[0][1])
        return "gloo", flat, keep
    with watching_liveness(None):  # its waits number the hosts
        inter, _, keep_inter = build(dist.PrefixStore(f"inter/{local}", st), host, n_hosts,
                                     replace(asked, transport="gloo"))
    flat.compose_hosts(list(layout.host), list(layout.local), intra, inter)
    return "shm+gloo", flat, keep + keep_intra + keep_inter
