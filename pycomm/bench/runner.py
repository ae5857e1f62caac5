"""The per-rank harness (nccl-tests' ``common.cu``): sweep the sizes, run
every algo interleaved per size, time, check, gather the numbers on rank 0
and print the table there.

Timing, per (size, placement, algo), after nccl-tests:

1. Check (untimed, when ``-c 1``): ``reset()`` the buffers (restore the
   input, poison the output), barrier, one call, compare with
   :func:`collectives.expected_result`; ``#wrong`` sums the mismatches over
   ranks.
2. In each of ``--rounds`` rounds, every algo in turn: ``reset()``,
   barrier, warm-up calls (``warmup`` in the first round, at most 1 after), then its
   share of the ``iters`` timed calls. Rounds spread every algo over the same
   stretch of time, so a slow spell on a shared machine does not land on one
   algo alone.
3. The timed calls run back to back, each timed on its own (CPU:
   ``perf_counter``; GPU: CUDA events recorded on the current stream between
   consecutive calls, read after one synchronize). No barrier between calls:
   a barrier per call would put the control group's exit skew into every
   small-message time; back to back, the ranks settle into the collective's
   own pace, as in nccl-tests. In-place inputs are not restored between
   timed calls (values drift, as in nccl-tests; CPU and GPU arithmetic speed
   does not depend on them).
4. Each rank takes the median of its timed calls; the reported time is the
   max over ranks of those medians.
5. Small messages get more calls: a round lasts at least ``--min-round-ms``
   per algo (its call count calibrated on the first round's warm-up calls,
   the same on every rank), so the first calls after a barrier, which carry
   its exit skew, do not decide the median.

The peers (``--peers``: another library's all-reduce, peers.py) are more
series in the same rounds; so are the bounds (bounds.py: a copy of the
size by one core and by every rank at once), in the first placement's.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, TextIO

import torch
import torch.distributed as dist

from . import collectives as C
from .bounds import BOUNDS, COPY_CORE, COPY_RANKS, Copy, traffic_gbps
from .cli import CLASSIC_ALGOS, format_size
from .peers import open_peers
from .report import Progress, format_header, format_row, format_summary, git_commit, plot_results, write_json

__all__ = ["run_benchmark"]


def slowest_step_s(step: Callable[[], object]) -> float:
    """Runs ``step`` on every rank of the default group at once (a barrier
    first) and returns the slowest rank's seconds: a training step's time
    as the job sees it (DDP benchmarks)."""
    dist.barrier()
    t0 = time.perf_counter()
    step()
    dt = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def mse_train_step(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    """One SGD step of ``model`` on an MSE loss (DDP benchmarks' step)."""
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fresh_start(bufs: C.Buffers, device: torch.device, barrier: Any) -> None:
    """Restore the buffers, let the device finish, and line the ranks up."""
    bufs.reset()
    _sync(device)
    barrier()


def _check_once(run: Any, bufs: C.Buffers, expected: Any, device: torch.device,
                barrier: Any, atol: float = 0.0) -> int:
    """Elements of one untimed call's result that differ from ``expected``
    (beyond ``atol`` too, where that is larger than the dtype's tolerance)."""
    _fresh_start(bufs, device, barrier)
    run()
    _sync(device)
    return C.count_wrong(bufs.result, expected, atol)


def _atol(s: "_Session", algo: str, count: int, expected: Any) -> float:
    """The absolute tolerance of ``algo``'s check: a ``--wire`` series'
    quantization bound (collectives.wire_atol), else 0."""
    wire = C.wire_of(algo)
    if wire is None or expected is None:
        return 0.0
    inputs = [s.coll.inputs(s.call, count, r).double() for r in range(s.call.world_size)]
    if s.call.op == "avg":
        inputs = [t / s.call.world_size for t in inputs]
    return C.wire_atol(wire, inputs, expected)


def _time_loop(run: Any, bufs: C.Buffers, iters: int, warmup: int, device: torch.device,
               barrier: Any) -> list[float]:
    """Seconds of each of ``iters`` back-to-back calls on this rank (see the
    module doc)."""
    _fresh_start(bufs, device, barrier)
    for _ in range(warmup):
        run()
    times = []
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        events[0].record()
        for i in range(iters):
            run()
            events[i + 1].record()
        events[-1].synchronize()
        times = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(iters)]
    else:
        t = time.perf_counter()
        for _ in range(iters):
            run()
            t2 = time.perf_counter()
            times.append(t2 - t)
            t = t2
    return times


def _pick_device(choice: str) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


@dataclass
class _Session:
    """One rank's side of a run: what it measures (``coll``, ``call``), the
    pycomm communicator (None when only torch is measured), the peers
    (peers.py) and the control group that barriers and agreements go
    through."""

    args: Any
    coll: C.Collective
    call: C.Call
    comm: Any
    flat: Any  # the transport="gloo" communicator of algo "flat", or None
    peers: dict[str, Any]
    ctl: Any
    torch_backend: str
    out: TextIO

    @property
    def series(self) -> list[str]:
        """What is measured, in table order: the algos, then the peers."""
        return [*self.args.algo, *self.peers]

    @property
    def root(self) -> int:
        """The root as printed: -1 for a collective without one."""
        return self.call.root if self.coll.rooted else -1

    @property
    def op(self) -> str:
        """The op as printed: "none" for a collective without one."""
        return self.args.op if self.coll.reduces else "none"

    @property
    def pycomm_transport(self) -> str | None:
        return self.comm.transport if self.comm is not None else None

    def transport_of(self, algo: str) -> str:
        # shm+gloo composes "auto" and "ring" (and the wire series) only; the
        # classic algorithms run flat over gloo, as "flat" does (hierarchy.h)
        if algo == "flat" or (algo in CLASSIC_ALGOS and self.pycomm_transport == "shm+gloo"):
            return "gloo"
        if algo in self.peers:
            return str(self.peers[algo].transport)
        if algo in BOUNDS:
            return "memory"
        return self.torch_backend if algo == "torch" else str(self.pycomm_transport)

    def barrier(self) -> None:
        dist.barrier(group=self.ctl)

    def agree(self, values: list[float], reduce: str) -> list[float]:
        """``values`` reduced over the ranks ("MAX", "MIN", "SUM")."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, reduce), group=self.ctl)
        return t.tolist()

    def runner(self, algo: str, bufs: C.Buffers) -> Callable[[], None]:
        if algo in self.peers:
            return self.peers[algo].runner(bufs.tensors["tensor"], self.call.op)
        if algo == "flat":
            return C.runner(self.coll, "ring", bufs, self.flat, self.call)
        return C.runner(self.coll, algo, bufs, self.comm, self.call)


def _open_session(args: Any) -> _Session:
    """Checks the world against the collective, picks the device, and creates
    the control group, (unless only torch is measured) the communicator and
    the peers."""
    rank, n = dist.get_rank(), dist.get_world_size()
    coll = C.SPECS[args.collective]
    if n < coll.min_world:
        raise ValueError(f"{coll.name} needs at least {coll.min_world} ranks, got {n}; use --nproc")
    if coll.rooted and not 0 <= args.root < n:
        raise ValueError(f"-r {args.root} is not a rank of a world of {n}")
    device = _pick_device(args.device)
    call = C.Call(rank, n, getattr(torch, args.dtype), args.op,
                  args.root if coll.rooted else 0, device)
    # Control traffic (barriers, gathering numbers) goes over gloo on the CPU.
    ctl = dist.group.WORLD if device.type == "cpu" else dist.new_group(backend="gloo")
    comm = flat = None
    import pycomm

    if any(a not in ("torch", "flat") for a in args.algo):
        comm = pycomm.init(group=dist.group.WORLD, transport=args.transport, device=device,
                           set_default=False)
    if "flat" in args.algo:
        flat = pycomm.init(group=dist.group.WORLD, transport="gloo", device=device,
                           set_default=False)
    peers = open_peers(args.peers, rank, n, ctl)
    return _Session(args, coll, call, comm, flat, peers, ctl, str(dist.get_backend()), sys.stdout)


def _probe_algos(s: _Session) -> tuple[list[str], dict[str, str]]:
    """Runs each algo once on a one-element message: (the algos every rank
    can run, {algo: why not} for the others)."""
    skipped: dict[str, str] = {}
    active: list[str] = []
    for algo in s.series:
        err = ""
        try:
            probe = s.coll.buffers(s.call, 1, s.coll.placements[0])
            probe.reset()
            s.runner(algo, probe)()
            _sync(s.call.device)
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        failed = s.agree([1.0 if err else 0.0], "MAX")[0]
        if failed:
            skipped[algo] = err or "failed on another rank"
        else:
            active.append(algo)
    if not active:
        raise RuntimeError("no algo can run here: " + "; ".join(f"{a}: {r}" for a, r in skipped.items()))
    return active, skipped


def _print_header(s: _Session, groups: list[tuple[str, bool | None]], skipped: dict[str, str]) -> None:
    """Rank 0: the ``#`` lines that say what was run, then the table header."""
    a, out, coll = s.args, s.out, s.coll
    print(f"# pycomm.bench {coll.name} ({coll.title}): world_size {s.call.world_size}, device "
          f"{s.call.device}, dtype {a.dtype}, op {s.op}, iters {a.iters}, warmup {a.warmup_iters}, "
          f"rounds {a.rounds} (each >= {a.min_round_ms:g} ms per algo), check {a.check}", file=out)
    print(f"# transports: pycomm {s.pycomm_transport}, torch {s.torch_backend}; host "
          f"{socket.gethostname()}, torch {torch.__version__}", file=out)
    for name, peer in s.peers.items():
        print(f"# peer {name}: {peer.version}", file=out)
    print(f"# bounds: {_BOUNDS_NOTE}", file=out)
    print("# time: calls back to back, max over ranks of each rank's median; out-of-place: "
          + ("measured" if False in coll.placements else
             "N/A (pycomm's op is in place; not emulated with an extra copy)"), file=out)
    for algo, why in skipped.items():
        print(f"# algo {algo}: skipped ({why})", file=out)
    print("#", file=out)
    print(format_header(groups), file=out, flush=True)


def _timed_rounds(s: _Session, runs: dict[str, Callable[[], None]],
                  bufs: dict[str, C.Buffers]) -> dict[str, list[float]]:
    """Each algo's call times (seconds) on this rank: the rounds take turns
    between the algos (see --rounds); warm-up calls precede each algo's first
    round only."""
    a = s.args
    times: dict[str, list[float]] = {algo: [] for algo in runs}
    rounds = min(a.rounds, a.iters)
    least = {algo: _calls_per_round(s, run, bufs[algo], rank0_only=algo == COPY_CORE)
             for algo, run in runs.items()}
    for k in range(rounds):
        per = a.iters // rounds + (1 if k < a.iters % rounds else 0)
        warmup = a.warmup_iters if k == 0 else min(1, a.warmup_iters)
        for algo, run in runs.items():
            times[algo] += _time_loop(run, bufs[algo], max(per, least[algo]), warmup,
                                      s.call.device, s.barrier)
    return times


def _calls_per_round(s: _Session, run: Callable[[], None], bufs: C.Buffers,
                     rank0_only: bool = False) -> int:
    """Calls that fill ``--min-round-ms`` at this algo's pace (timed on a few
    warm-up calls; the largest count any rank needs, so every rank makes the
    same calls); 0 when the option is 0. ``rank0_only``: only rank 0's calls
    do work (the one-core bound), so only its pace counts."""
    if s.args.min_round_ms <= 0:
        return 0
    probe = _time_loop(run, bufs, 5, 1, s.call.device, s.barrier)
    need = s.args.min_round_ms / 1e3 / max(statistics.median(probe), 1e-7)
    if rank0_only and s.call.rank != 0:
        need = 0.0
    return int(min(s.agree([need], "MAX")[0], 100_000))


def _p99(times: list[float]) -> float:
    """The 99th percentile of per-call times (nearest rank; the slowest of
    fewer than 100)."""
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _sent_bytes(s: _Session, algo: str, count: int, size: int) -> int | None:
    """Bytes one rank sends per all-reduce call (collectives.sent_bytes); on
    shm+gloo the bytes between hosts: step 2 moves this rank's 1/L of the
    tensor among the H hosts ("auto" by the ring, a wire series quantized)."""
    if s.coll.name != "allreduce":
        return None
    es, n = size // max(count, 1), s.call.world_size
    if s.transport_of(algo) == "shm+gloo":  # even hosts: torchrun's LOCAL_WORLD_SIZE ranks each
        per_host = int(os.environ.get("LOCAL_WORLD_SIZE", n))
        if algo == "wire_bf16":  # auto's inter-host ring on bfloat16 (2 bytes an element)
            algo, es = "auto", 2
        return C.sent_bytes("ring" if algo == "auto" else algo, C.ceil_div(count, per_host), es,
                            n // per_host)
    return C.sent_bytes("ring" if algo == "flat" else algo, count, es, n)


def _row(s: _Session, algo: str, in_place: bool, count: int, size: int, times: list[float],
         wrong: int | None) -> dict[str, Any]:
    """One JSON row: the max over ranks of the median time (``time_us``,
    also ``p50_us``) and of the 99th percentile (``p99_us``), #wrong summed
    (None: not checked, a bound; its row also has ``bound`` and
    ``traffic_GBps``, bytes read + written per second by each copying rank)."""
    t_med, t_p99 = s.agree([statistics.median(times), _p99(times)], "MAX")
    total_wrong = s.agree([float(wrong or 0)], "SUM")[0]
    algbw = size / t_med / 1e9 if t_med > 0 else 0.0
    row = {
        "collective": s.coll.name, "size": size, "count": count, "dtype": s.args.dtype,
        "op": s.op, "root": s.root, "algo": algo, "in_place": in_place,
        "time_us": t_med * 1e6, "p50_us": t_med * 1e6, "p99_us": t_p99 * 1e6, "algbw": algbw,
        "busbw": algbw * s.coll.bus_factor(s.call.world_size),
        "wrong": int(total_wrong) if s.args.check else None,
        "world_size": s.call.world_size, "transport": s.transport_of(algo), "device": s.call.device.type,
        "sent_bytes": _sent_bytes(s, algo, count, size),
    }
    if wrong is None:
        row.update(wrong=None, bound=True, traffic_GBps=traffic_gbps(size, t_med))
    return row


_BOUNDS_NOTE = (f"{COPY_CORE} (rank 0 alone) and {COPY_RANKS} (every rank at once) read and "
                "write each size in place (libc memmove one cache line down, warm buffer) in the "
                "same rounds; their busbw is the collective's at the copy's time, the least an "
                "all-reduce moving 2 x size per rank can take (bounds.py)")


def _measure_size(s: _Session, nbytes: int, active: list[str],
                  bar: Progress) -> list[dict[str, Any] | None]:
    """The rows of one size: every placement, every series (check, then
    time); None for a "symmetric" row whose calls did not all run
    symmetric; then the bounds (bounds.py), timed in the first placement's
    rounds."""
    es = torch.empty((), dtype=s.call.dtype).element_size()
    count, size = s.coll.counts(nbytes, es, s.call.world_size)
    expected = s.coll.expected(s.call, count) if s.args.check else None
    line: list[dict[str, Any] | None] = []
    bounds: list[dict[str, Any] | None] = []
    for in_place in s.coll.placements:
        bar.draw(f"{format_size(size)} {'in-place' if in_place else 'out-of-place'}")
        shared = s.coll.buffers(s.call, count, in_place)
        # "symmetric" registers its tensor (moves its storage): buffers of its own
        bufs = {algo: s.coll.buffers(s.call, count, in_place) if algo == "symmetric" else shared
                for algo in active}
        runs = {algo: s.runner(algo, bufs[algo]) for algo in active}
        wrongs = {algo: (_check_once(runs[algo], bufs[algo], expected, s.call.device, s.barrier,
                                     _atol(s, algo, count, expected))
                         if expected is not None else 0) for algo in active}
        first = in_place == s.coll.placements[0]
        if first:
            runs[COPY_CORE] = Copy(s.call.device, size, active=s.call.rank == 0)
            runs[COPY_RANKS] = Copy(s.call.device, size)
            bufs[COPY_CORE] = bufs[COPY_RANKS] = shared
        times = _timed_rounds(s, runs, bufs)
        if first:
            bounds = [_row(s, b, in_place, count, size, times[b], None) for b in BOUNDS]
        for algo in active:
            run = runs[algo]
            staged = isinstance(run, C.SymmetricRun) and not run.all_symmetric()
            if s.agree([float(staged)], "MAX")[0]:
                line.append(None)  # not every call ran from symmetric memory: N/A
            else:
                line.append(_row(s, algo, in_place, count, size, times[algo], wrongs[algo]))
            bar.advance(max(size, 1))
        del bufs, shared, runs
    return line + bounds


def _sweep(s: _Session, active: list[str],
           groups: list[tuple[str, bool | None]]) -> list[dict[str, Any]]:
    """Every size in turn; rank 0 prints one table line per size."""
    a = s.args
    want_bar = a.progress == "on" or (a.progress == "auto" and sys.stderr.isatty())
    series = sum(1 for _, in_place in groups if in_place is not None)  # the bar skips the bounds
    bar = Progress(total=sum(max(b, 1) for b in a.sizes) * series,
                   enabled=s.call.rank == 0 and want_bar)
    rows: list[dict[str, Any]] = []
    for nbytes in a.sizes:
        line = _measure_size(s, nbytes, active, bar)
        rows += [r for r in line if r is not None]
        if s.call.rank == 0:
            bar.clear()
            print(format_row(line), file=s.out, flush=True)
    bar.clear()
    return rows


def _meta(s: _Session, active: list[str], skipped: dict[str, str]) -> dict[str, Any]:
    """The JSON file's description of the run."""
    a = s.args
    return {
        "collective": s.coll.name, "world_size": s.call.world_size, "device": s.call.device.type,
        "dtype": a.dtype, "op": s.op, "root": s.root, "iters": a.iters, "warmup": a.warmup_iters,
        "rounds": a.rounds, "min_round_ms": a.min_round_ms,
        "check": a.check, "algos": active, "skipped": skipped,
        # torchrun's (and --hosts') layout: ranks a host, hosts (1: one host)
        "ranks_per_host": _ranks_per_host(s), "hosts": s.call.world_size // _ranks_per_host(s),
        "link_rate": os.environ.get("PYCOMM_SIM_LINK_RATE") or None,  # --link-rate (simhosts)
        "transport": s.pycomm_transport, "torch_backend": s.torch_backend,
        "peers": {name: peer.version for name, peer in s.peers.items()},
        "bounds": _BOUNDS_NOTE,
        "host": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "timing": ("back-to-back calls after a barrier and warmup; max over ranks of "
                   "per-rank median; CPU perf_counter, GPU CUDA events"),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        # as launch() saw it typed (a rank's own launch() reads the launcher's
        # COMMAND_VAR); None when run_benchmark is called directly
        "command": getattr(s.args, "typed_command", None),
    }


def _ranks_per_host(s: _Session) -> int:
    """LOCAL_WORLD_SIZE as torchrun (or --hosts) sets it, else every rank."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", s.call.world_size))


def _report(s: _Session, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Rank 0: the summary lines, then the JSON file and the plot if asked."""
    out = s.out
    print(format_summary(rows, meta["algos"]), file=out, flush=True)
    if s.args.json:
        write_json(s.args.json, meta, rows)
        print(f"# wrote {s.args.json}", file=out)
    if s.args.plot:
        plot_results({"meta": meta, "rows": rows}, s.args.plot)
        print(f"# wrote {s.args.plot}", file=out)
    out.flush()


def run_benchmark(args: Any) -> int:
    """Runs the sweep on this rank (torch.distributed already initialised).
    Returns the process exit code: 0, or 1 when a result was wrong.

    The steps: open the session (device, control group, communicator,
    peers), probe which series run, print the header, sweep the sizes (the
    bounds in the same rounds), report (rank 0), close.
    """
    s = _open_session(args)
    active, skipped = _probe_algos(s)
    groups: list[tuple[str, bool | None]] = [(algo, ip) for ip in s.coll.placements for algo in active]
    groups += [(b, None) for b in BOUNDS]
    if s.call.rank == 0:
        _print_header(s, groups, skipped)
    rows = _sweep(s, active, groups)
    if s.call.rank == 0:
        _report(s, rows, _meta(s, active, skipped))
    s.barrier()
    for comm in (s.comm, s.flat):
        if comm is not None:
            comm.close()
    wrong_total = sum(r["wrong"] or 0 for r in rows)
    return 0 if wrong_total == 0 else 1
