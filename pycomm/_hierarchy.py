"""Collectives across hosts: shared memory inside a host, gloo between (private).

``transport="auto"`` over ranks on several hosts (pycomm._setup.build)
gives each rank three communicators, built by the same ``build`` as any
other, and :class:`HierarchicalComm` composes their existing algorithms
(no second ring)::

    host 0: ranks 0 1            host 1: ranks 2 3
    +----------------+           +----------------+
    | intra (shm)    |           | intra (shm)    |
    | {0, 1}         |           | {2, 3}         |
    +----------------+           +----------------+
      local 0: inter (gloo) {0, 2}     local 1: inter (gloo) {1, 3}
      flat (gloo) {0, 1, 2, 3}: every other op, p2p between hosts

    all_reduce of B bytes, L ranks a host, H hosts:
      1. intra reduce-scatter (in place): local rank l holds shard l (B/L)
         summed over its host
      2. inter all-reduce of shard l with the l-th rank of every other host
      3. intra all-gather of the L shards
    Each rank sends 2(H-1)/H * B/L bytes between hosts, instead of the flat
    ring's 2(n-1)/n * B (n = H*L ranks).

Messages up to :data:`SMALL_BYTES` take an intra all-reduce instead and
skip step 3: every column then all-reduces the whole tensor between hosts at
once (the columns hold the same bits, so every rank ends with the same
result). ``register=True`` counts only there (steps 1-3 stage).
broadcast, reduce_scatter and all_gather compose likewise (see their
docstrings); send/recv use shm inside a host and the flat gloo communicator
between hosts; reduce, gather, scatter, all-to-all and barrier run on the
flat communicator. A quantized wire (``wire_dtype=torch.int8``, with or
without ``residual``) composes too: steps 1 and 3 stay exact in shared
memory and only step 2, where the bytes cost, is quantized (its error
feedback on the matching slice of ``residual``). Calls the composition does
not cover (a 16-bit ``wire_dtype``, ``algo`` other than "auto"/"ring", empty
or non-contiguous tensors, arguments the flat op refuses) go to the flat
communicator as well, so they behave (and fail) exactly as on
``transport="gloo"``.

The rule for uneven hosts: the composition needs the same number L >= 2 of
ranks on every host; otherwise (3 + 1 ranks, or one rank a host) "auto"
takes the flat gloo ring, with a one-time warning naming why for uneven
hosts (:func:`hierarchy_refusal`). So does a job where some host cannot set
up shared memory (decided together: :func:`build_hierarchical`).
"""

from __future__ import annotations

import ipaddress
import os
import queue
import socket
import threading
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ._store import agree_errors
from ._types import QUANTIZED_WIRES, ReduceOp

#: Largest all-reduce (bytes) taken as intra all-reduce + inter all-reduce of
#: the whole tensor (2 latency steps) rather than steps 1-3 (an estimate: the
#: simulated-hosts timings were too noisy to place the crossover).
SMALL_BYTES = 256 * 1024


@dataclass(frozen=True)
class Step:
    """One step of a composed all-reduce: the collective ``op`` on the
    ``comm`` communicator ("intra": this host's L ranks, "inter": the H
    ranks with this local index), over the whole tensor of B bytes or, with
    ``shard``, over this local rank's B/L of it."""

    comm: str
    op: str
    shard: bool = False


#: The all-reduce as :meth:`HierarchicalComm._all_reduce` runs it (the
#: module docstring's steps), large and (up to SMALL_BYTES) small; the cost
#: model (pycomm.bench.hosts_model) counts its ring steps from this table,
#: and tests/test_hierarchy.py checks the code against it.
ALL_REDUCE_STEPS: dict[str, tuple[Step, ...]] = {
    "large": (Step("intra", "reduce_scatter"), Step("inter", "all_reduce", shard=True),
              Step("intra", "all_gather")),
    "small": (Step("intra", "all_reduce"), Step("inter", "all_reduce")),
}


def all_reduce_steps(nbytes: float) -> tuple[Step, ...]:
    """The steps of an all-reduce of ``nbytes`` bytes (ALL_REDUCE_STEPS)."""
    return ALL_REDUCE_STEPS["small" if nbytes <= SMALL_BYTES else "large"]


#: Ops that run on the flat gloo communicator unchanged.
FLAT_OPS = ("reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier")


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


# ------------------------------------------------------------------ the communicator

class _QueuedWork:
    """The Work of a composed op, which the communicator's worker thread runs
    in submission order: ``wait`` returns once it ran (and raises its
    error), the future holds the outputs."""

    def __init__(self) -> None:
        self._future: torch.futures.Future = torch.futures.Future()
        self._error: BaseException | None = None
        self._ran = threading.Event()

    def finish(self, outputs: list[torch.Tensor] | None, error: BaseException | None) -> None:
        self._error = error
        self._ran.set()  # before the future's callbacks run (they may wait())
        if error is None:
            self._future.set_result(outputs)
        else:
            self._future.set_exception(error)

    def wait(self, timeout: Any = None) -> bool:
        self._ran.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._ran.is_set()

    def is_success(self) -> bool:
        return self._ran.is_set() and self._error is None

    def get_future(self) -> torch.futures.Future:
        return self._future


class _BothWorks:
    """The Work of a p2p batch split between the shm and the flat
    communicator: done when both parts are."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def get_future(self) -> torch.futures.Future:
        both = torch.futures.collect_all([w.get_future() for w in self._works])
        return both.then(lambda f: [t for part in f.value() for t in part.value()])


def _known_source(peer: int) -> int:
    """``peer``, which must be a rank: a receive from any source would have
    to listen on the shm and the gloo communicator at once."""
    if peer < 0:
        raise NotImplementedError(
            "recv from any source (src=None) is not supported across hosts (transport "
            "'shm+gloo': a peer's messages come over shm or gloo by where it runs); pass src, "
            "or use transport='gloo'")
    return peer


class HierarchicalComm:
    """The C++ communicator's interface over three of them (module
    docstring): ``flat`` (gloo, every rank), ``intra`` (shm, this host's
    ranks), ``inter`` (gloo, the ranks with this local index).

    Ordering: composed ops (all_reduce, reduce_scatter, all_gather,
    broadcast) run on a worker thread of this object, one after the other in
    submission order, each sub-op to completion (so every rank issues the
    sub-communicators' ops in the same order; a blocking call with nothing
    queued runs in the caller's thread); ``async_op=True`` returns at once.
    A composed op first waits for the flat collective issued before it; an
    op on the flat or the shm communicator (the others, p2p) first waits
    until the composed ops issued before it have run. A composed op issued
    from a Future callback (on the worker) runs there at once.
    """

    transport = "shm+gloo"

    def __init__(self, layout: Layout, rank: int, flat: Any, intra: Any, inter: Any) -> None:
        self.layout, self.flat, self.intra, self.inter = layout, flat, intra, inter
        self._rank = rank
        self._host, self._local = layout.host[rank], layout.local[rank]
        self._n_local = layout.ranks_per_host()[0]
        # Global rank g is row _lh_rows[g] of the blocks ordered by (local,
        # host) that the intra ops see; _by_column lists the rows' ranks.
        self._lh_rows = torch.tensor([layout.local[g] * layout.n_hosts + layout.host[g]
                                      for g in range(len(layout.host))])
        self._by_column = self._lh_rows.argsort()
        self._flat_work: Any = None  # the last async flat collective
        self._pid = os.getpid()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None  # started by the first composed op
        self._queued = 0  # composed ops submitted and not yet run
        self._idle = threading.Condition()

    # -- what Communicator reads
    rank = property(lambda self: self._rank)
    world_size = property(lambda self: len(self.layout.host))
    device = property(lambda self: self.flat.device)
    slice_bytes = property(lambda self: self.flat.slice_bytes)
    closed = property(lambda self: self.flat.closed)

    @property
    def check(self) -> bool:
        return bool(self.flat.check)

    @check.setter
    def check(self, on: bool) -> None:
        for c in (self.flat, self.intra, self.inter):
            c.check = on

    def __getattr__(self, name: str) -> Any:
        # register_tensor, is_registered, symmetric_all_reduces, seq, ...:
        # the flat communicator's (symmetric memory needs transport "shm").
        if name in FLAT_OPS:
            return lambda *args: self._on_flat(name, *args)
        return getattr(self.flat, name)

    def _on_flat(self, name: str, *args: Any) -> Any:
        self._drain()
        work = getattr(self.flat, name)(*args)
        if work is not None:
            self._flat_work = work
        return work

    def _composable(self, t: torch.Tensor, algo: str, op: int | None = None) -> bool:
        """Whether the composition takes this call (else the flat ring,
        which also raises the usual errors for bad arguments)."""
        if not (t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0
                and algo in ("auto", "ring")):
            return False
        return not (op == int(ReduceOp.AVG) and not t.is_floating_point())

    def _on_worker(self) -> bool:
        return threading.current_thread() is self._worker

    def _submit(self, run: Callable[[], list[torch.Tensor]], async_op: bool) -> Any:
        """Queues composed op ``run`` behind the earlier ones and waits for it
        unless ``async_op``; runs it at once in this thread when it is the
        worker itself, or when the call waits and nothing is queued."""
        work = _QueuedWork()
        if self._on_worker():
            work.finish(run(), None)
            return work if async_op else None
        if os.getpid() != self._pid:  # the worker thread stayed in the parent
            raise RuntimeError(f"this communicator belongs to process {self._pid} and cannot "
                               f"be used in a forked child (pid {os.getpid()})")
        flat_before, self._flat_work = self._flat_work, None
        if not async_op and self._queued == 0:  # nothing ahead: run here, no thread hop
            if flat_before is not None:
                flat_before.wait()
            run()
            return None
        with self._idle:
            self._queued += 1
        if self._worker is None:
            self._worker = threading.Thread(target=self._run_queue, daemon=True,
                                            name="pycomm-shm+gloo")
            self._worker.start()
        self._queue.put((run, work, flat_before))
        if not async_op:
            work.wait()
        return work if async_op else None

    def _run_queue(self) -> None:
        """The worker: runs the composed ops in order until close()."""
        while (item := self._queue.get()) is not None:
            run, work, flat_before = item
            try:
                if flat_before is not None:
                    flat_before.wait()
                outputs, error = run(), None
            except BaseException as e:  # noqa: BLE001 - handed to the op's Work
                outputs, error = None, e
            # Its callbacks run (here) before the op counts as done: an op a
            # callback issues runs inline, ahead of any issued meanwhile.
            try:
                work.finish(outputs, error)
            finally:
                with self._idle:
                    self._queued -= 1
                    self._idle.notify_all()

    def _drain(self) -> None:
        """Waits until the composed ops issued before have run."""
        if self._on_worker():
            return
        with self._idle:
            self._idle.wait_for(lambda: self._queued == 0)

    # -- collectives
    def all_reduce(self, t: torch.Tensor, op: int, algo: str, async_op: bool,
                   wire_dtype: int = -1, register: bool = False, wire_block: int = 256,
                   residual: torch.Tensor | None = None) -> Any:
        """Steps 1-3 of the module docstring. The tail of fewer than L
        elements (and, up to SMALL_BYTES, the whole tensor) is all-reduced
        between hosts by every column alike. A quantized wire quantizes
        step 2 only; a 16-bit one runs flat."""
        if self._quantized_composable(t, algo, op, wire_dtype, register, wire_block, residual):
            wire = (wire_dtype, wire_block, residual)
            work = self._submit(lambda: self._all_reduce(t, op, algo, False, wire), async_op)
            return work if async_op else None
        if wire_dtype != -1 or residual is not None or not self._composable(t, algo, op):
            return self._on_flat("all_reduce", t, op, algo, async_op, wire_dtype, register,
                                 wire_block, residual)
        # register=True may move t's storage: decided before the call returns.
        work = self._submit(lambda: self._all_reduce(t, op, algo, register), async_op or register)
        if register:
            work.wait()
        return work if async_op else None

    def _quantized_composable(self, t: torch.Tensor, algo: str, op: int, wire_dtype: int,
                              register: bool, wire_block: int,
                              residual: torch.Tensor | None) -> bool:
        """Whether a quantized-wire all_reduce composes: only calls the flat
        op would accept (else it runs flat and raises there, as on gloo)."""
        return (wire_dtype in QUANTIZED_WIRES and algo == "auto" and not register
                and t.dtype == torch.float32 and self._composable(t, algo, op)
                and op in (int(ReduceOp.SUM), int(ReduceOp.AVG)) and wire_block > 0
                and (residual is None or (residual.dtype == torch.float32
                                          and residual.device.type == "cpu"
                                          and residual.is_contiguous()
                                          and residual.shape == t.shape)))

    def _between_hosts(self, part: torch.Tensor, offset: int, op: int,
                       wire: tuple[int, int, torch.Tensor | None] | None) -> None:
        """Step 2 on ``part`` (elements ``offset`` on of the tensor): the
        ring, or the quantized wire with the matching slice of the residual."""
        if wire is None:
            self.inter.all_reduce(part, op, "ring", False)
            return
        code, block, residual = wire
        mine = None if residual is None else residual.view(-1)[offset:offset + part.numel()]
        self.inter.all_reduce(part, op, "auto", False, code, False, block, mine)

    def _all_reduce(self, t: torch.Tensor, op: int, algo: str, register: bool,
                    wire: tuple[int, int, torch.Tensor | None] | None = None
                    ) -> list[torch.Tensor]:
        flat = t.view(-1)
        m = 0 if t.nbytes <= SMALL_BYTES else flat.numel() // self._n_local  # ALL_REDUCE_STEPS
        whole = m * self._n_local
        mine = flat[self._local * m:(self._local + 1) * m]
        # 1. In place: a reduce-scatter leaves this rank its block summed over
        # the host, then the tail of fewer than L elements. Every rank takes
        # the same ops whatever it registers or registered (`register` counts only
        # in the small all-reduce, which negotiates it).
        if m:
            self.intra.reduce_scatter(mine, flat[:whole], op, algo, False)
            if whole < flat.numel():
                self.intra.all_reduce(flat[whole:], op, algo, False)
        else:
            self.intra.all_reduce(flat, op, algo, False, -1, register)
        if m:
            self._between_hosts(mine, self._local * m, op, wire)  # 2.
        if whole < flat.numel():
            self._between_hosts(flat[whole:], whole, op, wire)
        if m:  # 3. in place, as NCCL allows: the input is this rank's block of the output
            self.intra.all_gather(flat[:whole], mine, algo, False)
        return [t]

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: int, algo: str,
                       async_op: bool) -> Any:
        """Rows of ``inp`` reordered by (local, host); intra reduce-scatter
        leaves local rank l the H rows of the ranks with local index l,
        summed over its host; inter reduce-scatter gives each its own."""
        n = self.world_size
        if (not self._composable(out, algo, op) or not inp.is_contiguous()
                or inp.dtype != out.dtype or inp.numel() != n * out.numel()):
            return self._on_flat("reduce_scatter", out, inp, op, algo, async_op)

        def run() -> list[torch.Tensor]:
            by_column = inp.view(n, -1).index_select(0, self._by_column)
            mid = torch.empty(self.layout.n_hosts * out.numel(), dtype=out.dtype)
            self.intra.reduce_scatter(mid, by_column.view(-1), op, algo, False)
            self.inter.reduce_scatter(out, mid, op, "ring", False)
            return [out]

        return self._submit(run, async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, algo: str, async_op: bool) -> Any:
        """Inter all-gather (each rank's own block crosses hosts once), intra
        all-gather of those, then the blocks reordered by global rank."""
        n, m = self.world_size, inp.numel()
        if (not self._composable(inp, algo) or not out.is_contiguous()
                or inp.dtype != out.dtype or out.numel() != n * m):
            return self._on_flat("all_gather", out, inp, algo, async_op)

        def run() -> list[torch.Tensor]:
            mid = torch.empty(self.layout.n_hosts * m, dtype=inp.dtype)
            self.inter.all_gather(mid, inp, "ring", False)
            by_column = torch.empty(n * m, dtype=inp.dtype)
            self.intra.all_gather(by_column, mid, algo, False)
            torch.index_select(by_column.view(n, m), 0, self._lh_rows, out=out.view(n, m))
            return [out]

        return self._submit(run, async_op)

    def broadcast(self, t: torch.Tensor, src: int, algo: str, async_op: bool) -> Any:
        """Inter broadcast among the ranks with ``src``'s local index, then
        intra broadcast from that local rank on every host."""
        if not (isinstance(src, int) and 0 <= src < self.world_size) or \
                not self._composable(t, algo):
            return self._on_flat("broadcast", t, src, algo, async_op)
        src_host, src_local = self.layout.host[src], self.layout.local[src]

        def run() -> list[torch.Tensor]:
            if self._local == src_local:
                self.inter.broadcast(t, src_host, "ring", False)
            self.intra.broadcast(t, src_local, algo, False)
            return [t]

        return self._submit(run, async_op)

    # -- point to point: shm inside a host, the flat gloo ring between
    def _route(self, peer: int) -> tuple[Any, int]:
        if 0 <= peer < self.world_size and self.layout.host[peer] == self._host \
                and peer != self._rank:
            return self.intra, self.layout.local[peer]
        return self.flat, peer

    def send(self, t: torch.Tensor, dst: int, async_op: bool, tag: int = 0) -> Any:
        self._drain()
        comm, peer = self._route(dst)
        return comm.send(t, peer, async_op, tag)

    def recv(self, t: torch.Tensor, src: int, async_op: bool, tag: int = 0) -> Any:
        self._drain()
        comm, peer = self._route(_known_source(src))
        return comm.recv(t, peer, async_op, tag)

    def batch_p2p(self, ops: list[tuple[bool, torch.Tensor, int, int]]) -> Any:
        """One batch on each communicator that the peers need (both posted
        before either is waited for); one Work for all."""
        self._drain()
        routed = [(self._route(_known_source(peer)), is_send, t, tag)
                  for is_send, t, peer, tag in ops]
        works = []
        for comm in (self.intra, self.flat):
            mine = [(s, t, p, tag) for (c, p), s, t, tag in routed if c is comm]
            if mine:
                works.append(comm.batch_p2p(mine))
        return works[0] if len(works) == 1 else _BothWorks(works)

    # -- lifetime
    def close(self) -> None:
        """Runs the queued composed ops, stops the worker, then closes the
        three; the first error, if any, is raised after."""
        if self._worker is not None and not self._on_worker():
            self._queue.put(None)  # after the queued ops
            self._worker.join()
            self._worker = None
        errors = []
        for c in (self.inter, self.intra, self.flat):
            try:
                c.close()
            except Exception as e:  # noqa: BLE001 - close them all, then raise
                errors.append(e)
        if errors:
            raise errors[0]

    def abort(self, reason: str) -> None:
        for c in (self.flat, self.intra, self.inter):
            c.abort(reason)


# ------------------------------------------------------------------ building

Build = Callable[[Any, int, int, Any], tuple[Any, Any, list[Any]]]


def build_hierarchical(st: Any, rank: int, layout: Layout, asked: Any,
                       build: Build) -> tuple[str, Any, list[Any]]:
    """(transport, communicator, what it keeps alive) of ``rank``: the three
    communicators, each built by ``build`` (_setup.build) under its own
    prefix of ``st``, composed as "shm+gloo"; or, when shared memory cannot
    be set up on some host (e.g. a small ``/dev/shm``), the flat one alone
    as "gloo" on every rank, with a one-time warning naming why."""
    host, local = layout.host[rank], layout.local[rank]
    n_local, n_hosts = layout.ranks_per_host()[0], layout.n_hosts
    flat, _, keep = build(dist.PrefixStore("flat", st), rank, len(layout.host),
                          replace(asked, transport="gloo"))
    intra, why = None, ""
    try:
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
    inter, _, keep_inter = build(dist.PrefixStore(f"inter/{local}", st), host, n_hosts,
                                 replace(asked, transport="gloo"))
    return ("shm+gloo", HierarchicalComm(layout, rank, flat, intra, inter),
            keep + keep_intra + keep_inter)
