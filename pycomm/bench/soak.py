"""``python -m pycomm.bench soak``: mixed traffic for a given time, every
result checked against a float64 reference.

    python -m pycomm.bench soak --nproc 3 --transport shm --duration 60 --seed 1

Every rank draws the same program from ``random.Random(seed)``, one step at a
time, so the ranks issue matching calls: a collective of any kind (every
dtype, every op the dtype allows, sizes from 0 elements to ``--max-bytes``,
sync or async), p2p around a ring with a tag (some receives from any
source), batched p2p, a chain of all-reduces issued from Future callbacks
(PowerSGD's pattern), an all-reduce on a subgroup, one on a buffer
registered in symmetric memory, a DDP step (pycomm.parallel, small
buckets), and a group made, used and closed within one step. Async ops stay
in flight for a few steps and are waited in a random order.

A step's input on rank r is a function of (seed, step, r) alone: small
integers, whose sums, maxima and products every dtype holds exactly. So each
rank rebuilds every rank's input, computes the expected result in float64
and compares (exactly; AVG within the dtype's rounding): nothing is trusted
from the run. A wrong result is counted and printed, and the run goes on.

Rank 0 prints a progress line every ``--report`` seconds (steps, ops/s,
latency percentiles, wrong results); at the end every rank's counts are
gathered: steps and ops completed and verified, wrong results, memory growth
(peak RSS, and the current RSS's trend once warm: a slow leak the peak would
hide), fds and threads (start vs end), and pycomm's ``/dev/shm`` segments
left once closed. The exit status is 1 when a result was wrong or something
leaked. ``--hosts H`` runs it on H simulated hosts (``--nproc`` ranks each,
root only) with ``transport="auto"`` (shm within a host, gloo across, so a
receive names its source: a Communicator across hosts has no any-source).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["main", "parse_args", "run_soak"]

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.uint8, torch.int8)
KINDS = ("all_reduce", "broadcast", "reduce_scatter", "all_gather", "reduce", "gather", "scatter",
         "all_to_all", "barrier", "p2p_ring", "batch_p2p", "callback_chain", "group_all_reduce",
         "registered_all_reduce", "ddp_step", "new_group")
# How often each kind is drawn (all_reduce, the one users call most, most often).
WEIGHTS = (6, 2, 2, 2, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1)
MAX_IN_FLIGHT = 4  # async steps waited later, in a random order
MAX_WORLD = 6  # the value ranges below keep every reduction exact up to this
ANY_SOURCE_TAGS = 1000  # an any-source receive's tag: 1000 + the step's index
# The algorithms a step may name, for the kinds that take one.
ALGOS = {"all_reduce": ("auto", "ring", "recursive_doubling", "halving_doubling", "tree"),
         "all_gather": ("auto", "ring", "bruck")}


@dataclass
class Step:
    """One drawn step: what every rank calls, and how it checks it."""
    index: int
    kind: str
    dtype: torch.dtype
    op: str
    count: int
    root: int
    async_op: bool
    extra: dict[str, Any] = field(default_factory=dict)


Check = Callable[[], None]  # a step's check of its result, run once it is done


@dataclass
class Pending:
    """An issued step: its Works (or future) and the check to run once done."""
    step: Step
    wait: Callable[[], None]
    check: Check
    start: float


def _ops_for(dtype: torch.dtype) -> tuple[str, ...]:
    floating = dtype.is_floating_point
    return ("sum", "max", "min", "product") + (("avg",) if floating else ())


def _value_range(dtype: torch.dtype, op: str) -> tuple[int, int]:
    """Integers whose reduction over up to MAX_WORLD ranks is exact in
    ``dtype`` (int8: |sum| <= 18, |product| <= 64; bfloat16: integers up to
    256 are exact)."""
    if op == "product":
        return (0, 2) if dtype == torch.uint8 else (-2, 2)
    return (0, 3) if dtype == torch.uint8 else (-3, 3)


def draw(rng: random.Random, index: int, world: int, max_bytes: int,
         leave_out: frozenset[str] = frozenset()) -> Step:
    """The step every rank takes at ``index`` (``rng`` is the same on every
    rank); never a kind in ``leave_out``."""
    kind = rng.choices(KINDS, [0 if k in leave_out else w for k, w in zip(KINDS, WEIGHTS)])[0]
    dtype = rng.choice(DTYPES)
    op = rng.choice(_ops_for(dtype))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    r = rng.random()
    if r < 0.6:
        count = rng.randint(0, 1024)
    elif r < 0.9:
        count = rng.randint(1025, 1 << 16)
    else:
        count = rng.randint(1 << 16, max(1 << 16, max_bytes // itemsize))
    count = min(count, max(1, max_bytes // (itemsize * world)))
    step = Step(index, kind, dtype, op, count, rng.randrange(world), rng.random() < 0.5)
    if kind in ALGOS:
        step.extra["algo"] = rng.choice(ALGOS[kind])
    if kind == "all_to_all":
        step.extra["splits"] = [[rng.randint(0, 64) for _ in range(world)] for _ in range(world)]
    if kind in ("p2p_ring", "batch_p2p"):
        step.extra["shift"] = rng.randint(1, max(1, world - 1))
        step.extra["any_source"] = kind == "p2p_ring" and rng.random() < 0.3
        # An any-source receive takes the first message with its tag from
        # anyone: its tag is the step's own, so no other step's message (in
        # flight before or issued after it) can match it.
        step.extra["tag"] = ANY_SOURCE_TAGS + index if step.extra["any_source"] else rng.randint(0, 7)
    if kind in ("p2p_ring", "batch_p2p", "callback_chain"):
        step.async_op = True
    if kind == "new_group":
        step.async_op = False  # the group is closed within the step
        # members in a drawn order (the group renumbers them), two at least
        step.extra["members"] = rng.sample(range(world), rng.randint(min(2, world), world))
    if kind == "ddp_step":
        step.async_op = False  # backward returns with the gradients reduced
    return step


def rank_input(seed: int, step: Step, rank: int, count: int | None = None) -> torch.Tensor:
    """What ``rank`` contributes to ``step``: a function of (seed, step, rank)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step.index) * 1031 + rank)
    lo, hi = _value_range(step.dtype, step.op)
    n = step.count if count is None else count
    return torch.randint(lo, hi + 1, (n,), generator=g).to(step.dtype)


def reference(inputs: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """``op`` over the ranks' inputs, in float64."""
    x = torch.stack([t.double() for t in inputs]) if inputs else torch.empty(0)
    if op == "sum":
        return x.sum(0)
    if op == "avg":
        return x.sum(0) / len(inputs)
    if op == "max":
        return x.max(0).values
    if op == "min":
        return x.min(0).values
    return x.prod(0)


def same(got: torch.Tensor, want: torch.Tensor, op: str) -> bool:
    """Exact, except AVG (one rounding in the dtype, or two in 16-bit)."""
    if got.numel() != want.numel():
        return False
    if op != "avg":
        return torch.equal(got.double(), want.double())
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(got.dtype, 1e-6)
    return torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)


def _keep(works: list[Any], w: Any) -> None:
    """Adds what an op returned (a Work, a list of them, or None) to ``works``."""
    if w is not None:
        works.extend(w if isinstance(w, list) else [w])


class Soak:
    """One rank's run: draws, issues, waits, checks and counts."""

    def __init__(self, comm: Any, args: argparse.Namespace) -> None:
        self.comm, self.args = comm, args
        self.rank, self.world = comm.rank, comm.world_size
        self.seed = args.seed
        self.rng = random.Random(args.seed)
        self.in_flight: list[Pending] = []
        self.latencies: list[float] = []
        self.steps = self.ops = self.verified = self.wrong = 0
        self.first_wrong: list[str] = []
        # the even ranks (both ranks of a world of two), renumbered
        self.members = list(range(0, self.world, 2)) if self.world > 2 else list(range(self.world))
        self.group = comm.new_group(self.members) if len(self.members) > 1 else None
        self.registered = torch.zeros(1 << 14, dtype=torch.float32)
        if comm.transport == "shm":  # elsewhere a plain buffer (nothing to register into)
            comm.register_tensor(self.registered)
        # across hosts (transport "shm+gloo") a receive names its source: the
        # step keeps its unique tag and receives from the known sender
        self.any_source_ok = "+" not in comm.transport
        self.model: torch.nn.Module | None = None  # ddp_step's, made at its first step
        self.ddp: Any = None

    # -- issuing -------------------------------------------------------
    def inputs(self, step: Step, count: int | None = None) -> list[torch.Tensor]:
        return [rank_input(self.seed, step, q, count) for q in range(self.world)]

    def expect(self, step: Step, what: str, got: torch.Tensor, want: torch.Tensor,
               op: str = "sum") -> None:
        if same(got, want, op):
            self.verified += 1
            return
        self.wrong += 1
        if len(self.first_wrong) < 5:
            self.first_wrong.append(
                f"step {step.index} {step.kind} {what} ({step.dtype}, op {step.op}, "
                f"algo {step.extra.get('algo', '-')}, count "
                f"{step.count}, root {step.root}) on rank {self.rank}: got {got[:8].tolist()}, "
                f"want {want[:8].tolist()}")

    def issue(self, step: Step) -> Pending:
        """Issues ``step`` on this rank: its Works and the check of its result."""
        works: list[Any] = []
        check = getattr(self, "_" + step.kind)(step, rank_input(self.seed, step, self.rank), works)

        def wait() -> None:
            for w in works:
                w.wait()

        return Pending(step, wait, check, time.perf_counter())

    # One method per kind: issues it (its Works into ``works``) and returns
    # the check of its result. ``mine`` is this rank's input.

    def _all_reduce(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        t = mine.clone()
        _keep(works, self.comm.all_reduce(t, op=step.op, algo=step.extra["algo"],
                                          async_op=step.async_op))
        return lambda: self.expect(step, "tensor", t, reference(self.inputs(step), step.op), step.op)

    def _broadcast(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        t = mine.clone()
        _keep(works, self.comm.broadcast(t, src=step.root, async_op=step.async_op))
        return lambda: self.expect(step, "tensor", t, rank_input(self.seed, step, step.root))

    def _reduce_scatter(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        n, m, r = self.world, step.count, self.rank
        out = torch.empty(m, dtype=step.dtype)
        op = step.op if step.op != "avg" else "sum"
        _keep(works, self.comm.reduce_scatter(out, rank_input(self.seed, step, r, m * n), op=op,
                                              async_op=step.async_op))
        return lambda: self.expect(step, "output", out,
                                   reference(self.inputs(step, m * n), op)[r * m:(r + 1) * m], op)

    def _all_gather(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        out = torch.empty(step.count * self.world, dtype=step.dtype)
        _keep(works, self.comm.all_gather(out, mine, algo=step.extra["algo"], async_op=step.async_op))
        return lambda: self.expect(step, "output", out, torch.cat(self.inputs(step)))

    def _reduce(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        t = mine.clone()
        _keep(works, self.comm.reduce(t, dst=step.root, op=step.op, async_op=step.async_op))
        if self.rank != step.root:
            return lambda: None  # only the root's tensor is defined
        return lambda: self.expect(step, "tensor", t, reference(self.inputs(step), step.op), step.op)

    def _gather(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        root = self.rank == step.root
        outs = [torch.empty(step.count, dtype=step.dtype) for _ in range(self.world)] if root else None
        _keep(works, self.comm.gather(outs, mine, dst=step.root, async_op=step.async_op))
        if outs is None:
            return lambda: None
        return lambda: self.expect(step, "gather_list", torch.cat(outs), torch.cat(self.inputs(step)))

    def _scatter(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        pieces = [rank_input(self.seed, step, 100 + q) for q in range(self.world)]
        out = torch.empty(step.count, dtype=step.dtype)
        _keep(works, self.comm.scatter(out, pieces if self.rank == step.root else None, src=step.root,
                                       async_op=step.async_op))
        return lambda: self.expect(step, "tensor", out, pieces[self.rank])

    def _all_to_all(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        n, r = self.world, self.rank
        splits = step.extra["splits"]  # splits[i][j]: what rank i sends to rank j

        def block(i: int, j: int) -> torch.Tensor:
            return rank_input(self.seed, step, i * n + j, splits[i][j])

        outs = [torch.empty(splits[i][r], dtype=step.dtype) for i in range(n)]
        _keep(works, self.comm.all_to_all(outs, [block(r, j) for j in range(n)],
                                          async_op=step.async_op))
        return lambda: self.expect(step, "outputs", torch.cat(outs),
                                   torch.cat([block(i, r) for i in range(n)]))

    def _barrier(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        self.comm.barrier()
        return lambda: None

    def _p2p(self, step: Step, mine: torch.Tensor, works: list[Any], batched: bool) -> Check:
        n, r = self.world, self.rank
        shift, tag = step.extra["shift"], step.extra["tag"]
        dst, src = (r + shift) % n, (r - shift) % n
        got = torch.empty(step.count, dtype=step.dtype)
        if n == 1:
            got.copy_(mine)
        elif batched:
            from pycomm import P2POp

            _keep(works, self.comm.batch_isend_irecv([P2POp("irecv", got, src, tag),
                                                      P2POp("isend", mine, dst, tag)]))
        else:
            _keep(works, self.comm.isend(mine, dst, tag=tag))
            any_source = step.extra["any_source"] and self.any_source_ok
            _keep(works, self.comm.irecv(got, None if any_source else src, tag=tag))
        return lambda: self.expect(step, "received", got, rank_input(self.seed, step, src))

    def _p2p_ring(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        return self._p2p(step, mine, works, batched=False)

    def _batch_p2p(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        return self._p2p(step, mine, works, batched=True)

    def _callback_chain(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        """PowerSGD's pattern: the second all-reduce is issued from the first's
        Future callback, and the chain's future is what the caller waits."""
        from pycomm._hook_common import then_async

        c = self.comm
        t1, t2 = mine.clone(), mine.clone()
        op = "sum" if step.op == "avg" else step.op
        first = c.all_reduce(t1, op=op, async_op=True).get_future()
        works.append(then_async(first, lambda _: c.all_reduce(t2, op=op, async_op=True).get_future(),
                                 torch.device("cpu")))

        def check() -> None:
            want = reference(self.inputs(step), op)
            self.expect(step, "first", t1, want, op)
            self.expect(step, "chained", t2, want, op)
        return check

    def _group_all_reduce(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        t = mine.clone()
        if self.group is None:
            return lambda: self.expect(step, "tensor", t, mine)  # not a member: untouched
        _keep(works, self.group.all_reduce(t, op=step.op, async_op=step.async_op))
        want = reference([rank_input(self.seed, step, q) for q in self.members], step.op)
        return lambda: self.expect(step, "tensor", t, want, step.op)

    def _new_group(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        """Group churn: a group made (a store rendezvous, a transport set
        up), used once and closed within the step."""
        members, t = step.extra["members"], mine.clone()
        group = self.comm.new_group(members)
        if group is None:
            return lambda: self.expect(step, "tensor", t, mine)  # not a member: untouched
        try:
            group.all_reduce(t, op=step.op)
        finally:
            group.close()
        want = reference([rank_input(self.seed, step, q) for q in members], step.op)
        return lambda: self.expect(step, "tensor", t, want, step.op)

    def _registered_all_reduce(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        """float32 sums in the buffer registered at the start (symmetric memory
        on shm); waited at once, since the next such step reuses it."""
        k = min(step.count, self.registered.numel())
        f32 = Step(step.index, step.kind, torch.float32, "sum", k, 0, False)
        self.registered[:k].copy_(rank_input(self.seed, f32, self.rank))
        self.registered[k:].zero_()
        _keep(works, self.comm.all_reduce(self.registered, async_op=step.async_op))
        step.async_op = False
        return lambda: self.expect(step, "registered", self.registered[:k].clone(),
                                   reference(self.inputs(f32), "sum"))

    def _ddp_step(self, step: Step, mine: torch.Tensor, works: list[Any]) -> Check:
        """A forward and backward of pycomm.parallel's DDP (small buckets, so
        several all-reduces) on this rank's batch; each gradient must be the
        mean over ranks of the gradients a float64 copy of the model computes
        on every rank's batch. The weights do not change (no optimizer step),
        so every step checks from the same model."""
        from pycomm.parallel import DistributedDataParallel

        if self.model is None:
            torch.manual_seed(self.seed)
            self.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                             torch.nn.Linear(32, 4))
            self.ddp = DistributedDataParallel(self.model, self.comm, bucket_cap_mb=0.001,
                                               first_bucket_mb=0.001)
        model = self.model

        def batch(q: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed((self.seed * 7919 + step.index) * 31 + q)
            return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)

        model.zero_grad(set_to_none=True)
        x, y = batch(self.rank)
        torch.nn.functional.mse_loss(self.ddp(x), y).backward()

        def check() -> None:
            ref = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
            exact = copy.deepcopy(model).double()
            for q in range(self.world):
                exact.zero_grad(set_to_none=True)
                xq, yq = batch(q)
                torch.nn.functional.mse_loss(exact(xq.double()), yq.double()).backward()
                for acc, p in zip(ref, exact.parameters()):
                    acc += p.grad / self.world
            for i, (p, want) in enumerate(zip(model.parameters(), ref)):
                got = p.grad if p.grad is not None else torch.zeros_like(p)
                ok = torch.allclose(got.double(), want, rtol=1e-4, atol=1e-6)
                self.expect(step, f"grad {i}", got, got if ok else want)
        return check

    # -- completing ----------------------------------------------------
    def finish(self, p: Pending) -> None:
        p.wait()
        self.latencies.append(time.perf_counter() - p.start)
        p.check()
        self.ops += 1

    def run_step(self, index: int) -> None:
        step = draw(self.rng, index, self.world, self.args.max_bytes, self.args.leave_out)
        p = self.issue(step)
        if step.async_op and len(self.in_flight) < MAX_IN_FLIGHT:
            self.in_flight.append(p)
        else:
            self.finish(p)
        # Waited in a random order (the same on every rank, though it need not be).
        while self.in_flight and (len(self.in_flight) >= MAX_IN_FLIGHT or self.rng.random() < 0.4):
            self.finish(self.in_flight.pop(self.rng.randrange(len(self.in_flight))))
        self.steps += 1

    def drain(self) -> None:
        while self.in_flight:
            self.finish(self.in_flight.pop(0))


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


# ---------------------------------------------------------------------- the run

def run_soak(args: argparse.Namespace) -> int:
    """One rank of the soak (torch.distributed is initialized): returns the
    exit code, 1 on a wrong result or a leak."""
    import pycomm

    from .report import git_commit
    from .resources import fds, heap_mb, max_rss_mb, rss_mb, rss_trend_mb, shm_segments, threads

    rank, world = dist.get_rank(), dist.get_world_size()
    commit = git_commit() if rank == 0 else ""  # the code that runs, read before it runs
    before = {"fds": fds(), "threads": threads(), "rss_mb": max_rss_mb()}
    comm = pycomm.init(group=dist.group.WORLD, transport=args.transport, set_default=False,
                       **({"timeout": args.op_timeout} if args.op_timeout else {}))
    soak = Soak(comm, args)
    if args.chaos:
        return run_under_chaos(args.chaos, rank, lambda: _traffic(soak, comm, args),
                               lambda: {"verified": soak.verified, "wrong": soak.wrong,
                                        "first_wrong": soak.first_wrong[:3]})
    start = last_report = time.monotonic()
    rss: list[tuple[float, float]] = []  # (seconds into the run, current RSS in MB)
    heap: list[tuple[float, float]] = []  # (seconds, malloc's bytes in use in MB)
    flag = torch.zeros(1, dtype=torch.int32)
    index = 0
    while True:
        if index % 16 == 0:  # rank 0's clock decides, for every rank at once
            rss.append((time.monotonic() - start, rss_mb(trim=args.malloc_trim)))
            in_use = heap_mb()
            if in_use is not None:
                heap.append((rss[-1][0], in_use))
            flag.fill_(int(time.monotonic() - start >= args.duration or
                           (args.steps is not None and index >= args.steps)))
            comm.broadcast(flag, src=0)
            if flag.item():
                break
        soak.run_step(index)
        index += 1
        now = time.monotonic()
        if rank == 0 and now - last_report >= args.report:
            last_report = now
            lat = soak.latencies[-2000:]
            print(f"soak: {now - start:7.1f} s  steps {soak.steps}  ops/s {soak.ops / (now - start):8.1f}  "
                  f"p50 {_percentile(lat, 0.5) * 1e3:.3f} ms  p99 {_percentile(lat, 0.99) * 1e3:.3f} ms  "
                  f"wrong {soak.wrong}", flush=True)
    soak.drain()
    elapsed = time.monotonic() - start
    if soak.group is not None:
        soak.group.close()
    comm.close()
    after = {"fds": fds(), "threads": threads(), "rss_mb": max_rss_mb()}
    mine = [soak.steps, soak.ops, soak.verified, soak.wrong, after["fds"] - before["fds"],
            after["threads"] - before["threads"], after["rss_mb"] - before["rss_mb"],
            rss_trend_mb(rss, elapsed), rss_trend_mb(heap, elapsed) if heap else None]
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, {"counts": mine, "wrong": soak.first_wrong, "transport": comm.transport,
                                  "latencies": soak.latencies[-5000:], "pid": os.getpid()})
    dist.barrier()  # every rank has closed its communicators
    segments = shm_segments([row["pid"] for row in rows]) if rank == 0 else []
    code = 0
    if rank == 0:
        code = _report(args, rows, elapsed, segments, commit)
    flag = torch.tensor([code], dtype=torch.int32)
    dist.broadcast(flag, src=0)
    return int(flag.item())


def run_under_chaos(directory: str, rank: int, traffic: Callable[[], None],
                    counts: Callable[[], dict[str, Any]] | None = None) -> int:
    """Runs ``traffic`` in a chaos trial (chaos.py): says when it started (a file), and
    on an error writes it (time, type, message) and leaves at once (exit 3),
    so that nothing after the fault can hang; when the traffic ends (``--steps``)
    writes ``counts()`` (verified, wrong) as rank<r>.done. SIGUSR1 is the
    "exit" fault."""
    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGUSR1, leave)
    Path(directory, f"rank{rank}.ready").touch()
    try:
        traffic()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - what a survivor raised is the record
        error = {"t": time.time(), "type": type(e).__name__, "message": str(e)[:2000]}
        Path(directory, f"rank{rank}.error").write_text(json.dumps(error))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    Path(directory, f"rank{rank}.done").write_text(json.dumps(counts() if counts else {}))
    return 0


def _traffic(soak: Soak, comm: Any, args: argparse.Namespace) -> None:
    """Chaos mode's traffic: steps until an error (or ``--steps``); no
    stop flag, since the fault ends the run."""
    index = 0
    while args.steps is None or index < args.steps:
        soak.run_step(index)
        index += 1
    soak.drain()


def _report(args: argparse.Namespace, rows: list[Any], elapsed: float, segments: list[str],
            commit: str) -> int:
    """Rank 0: the summary (and the JSON); the exit code."""
    names = ("steps", "ops", "verified", "wrong", "fd_growth", "thread_growth", "max_rss_growth_mb",
             "rss_trend_mb", "heap_trend_mb")
    per_rank = [dict(zip(names, row["counts"])) for row in rows]
    lat = [x for row in rows for x in row["latencies"]]
    total = {k: sum(r[k] for r in per_rank) for k in ("ops", "verified", "wrong")}
    leaks = {"fd_growth": max(r["fd_growth"] for r in per_rank),
             "thread_growth": max(r["thread_growth"] for r in per_rank),
             "shm_segments_left": segments}
    summary = {
        # what the communicator chose (auto across hosts: shm+gloo)
        "transport": rows[0]["transport"], "world_size": len(rows), "seed": args.seed,
        "duration_s": round(elapsed, 1), "steps": per_rank[0]["steps"], **total,
        # per rank, as the progress lines count them
        "ops_per_s": round(total["ops"] / len(rows) / max(elapsed, 1e-9), 1),
        "latency_ms": {"p50": _percentile(lat, 0.5) * 1e3, "p99": _percentile(lat, 0.99) * 1e3,
                       "mean": statistics.fmean(lat) * 1e3 if lat else float("nan")},
        "max_rss_growth_mb": max(r["max_rss_growth_mb"] for r in per_rank),
        "rss_trend_mb": max(r["rss_trend_mb"] for r in per_rank), "malloc_trim": args.malloc_trim,
        # the same trend of malloc's bytes in use (None without mallinfo2)
        "heap_trend_mb": max((r["heap_trend_mb"] for r in per_rank if r["heap_trend_mb"] is not None),
                             default=None),
        **leaks,
        "first_wrong": [w for row in rows for w in row["wrong"]][:10],
        "per_rank": per_rank,
    }
    print(f"soak: {summary['steps']} steps, {total['ops']} ops completed ({summary['ops_per_s']} per "
          f"second per rank), {total['verified']} results verified, {total['wrong']} wrong, in "
          f"{elapsed:.1f} s on {len(rows)} ranks over "
          f"{summary['transport']} (seed {args.seed})", flush=True)
    print(f"soak: latency p50 {summary['latency_ms']['p50']:.3f} ms, p99 "
          f"{summary['latency_ms']['p99']:.3f} ms; max RSS growth {summary['max_rss_growth_mb']:.1f} MB, "
          f"RSS trend once warm {summary['rss_trend_mb']:+.1f} MB"
          + ("" if summary["heap_trend_mb"] is None else
             f" (malloc's bytes in use {summary['heap_trend_mb']:+.1f} MB)") + "; "
          f"fd growth {leaks['fd_growth']}, thread growth {leaks['thread_growth']}, "
          f"/dev/shm segments left {len(segments)}", flush=True)
    for w in summary["first_wrong"]:
        print(f"soak: WRONG {w}", flush=True)
    if args.json:
        summary["commit"] = commit
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
    leaked = leaks["fd_growth"] > 0 or leaks["thread_growth"] > 0 or segments
    return 1 if total["wrong"] or leaked else 0


# ---------------------------------------------------------------------- command line

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The soak's flags; ``rank_main`` tells the launcher what each rank runs."""
    from .cli import add_hosts_argument, check_hosts, parse_size

    p = argparse.ArgumentParser(prog="python -m pycomm.bench soak",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None, help="local ranks to spawn (default 2)")
    p.add_argument("--transport", default=None, choices=("shm", "gloo", "auto"),
                   help="default shm, with --hosts auto (shm within a host, gloo across)")
    add_hosts_argument(p)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-bytes", type=parse_size, default=parse_size("4M"),
                   help="largest tensor of a step (e.g. 64M)")
    p.add_argument("--report", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("--leave-out", default="", metavar="KINDS",
                   help="kinds of step never drawn, comma-separated (e.g. new_group)")
    p.add_argument("--json", metavar="FILE", help="write the summary as JSON")
    p.add_argument("--malloc-trim", action="store_true",
                   help="sample the RSS trend after glibc's malloc_trim(0): memory in use, not kept free")
    p.add_argument("-T", "--timeout", type=float, default=None,
                   help="overall limit (default: duration + 300 s); ranks are killed past it")
    p.add_argument("--op-timeout", type=float, default=None, metavar="SECONDS",
                   help="the communicator's timeout (pycomm.init(timeout=...))")
    p.add_argument("--chaos", metavar="DIR", default=None, help=argparse.SUPPRESS)  # chaos.py
    args = p.parse_args(argv)
    args.leave_out = frozenset(k for k in args.leave_out.split(",") if k)
    if args.leave_out - set(KINDS) or args.leave_out >= set(KINDS):
        p.error(f"--leave-out: kinds of step from {','.join(KINDS)}, leaving one at least")
    if args.nproc is not None and not 1 <= args.nproc <= MAX_WORLD:
        p.error(f"--nproc must be 1 to {MAX_WORLD} (the inputs keep every reduction exact up to it)")
    check_hosts(p, args)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.transport is None:  # the ranks on the hosts get the choice explicitly
        args.transport = "auto" if args.hosts else "shm"
        args.argv += ["--transport", args.transport]
    if args.timeout is None:
        args.timeout = args.duration + 300.0
    args.device = "cpu"
    args.command = ["soak"]
    args.rank_main = run_soak
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pycomm.bench soak ...``: returns the exit code."""
    from .launch import launch

    args = parse_args(argv)
    if args.nproc is None and "RANK" not in os.environ:
        args.nproc = 2
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
