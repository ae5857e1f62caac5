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
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed as dist

from . import collectives as C
from .cli import format_size
from .report import Progress, format_header, format_row, format_summary, git_commit, plot_results, write_json

__all__ = ["measure_memcpy", "run_benchmark"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_memcpy(device: torch.device, nbytes: int, reps: int = 5) -> float:
    """Bandwidth of one tensor copy on this rank, in GB/s (bytes copied per
    second; a copy reads and writes each byte once), median of ``reps``."""
    src = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return src.nbytes / statistics.median(times) / 1e9


def _fresh_start(bufs: C.Buffers, device: torch.device, barrier: Any) -> None:
    """Restore the buffers, let the device finish, and line the ranks up."""
    bufs.reset()
    _sync(device)
    barrier()


def _check_once(run: Any, bufs: C.Buffers, expected: Any, device: torch.device,
                barrier: Any) -> int:
    """Elements of one untimed call's result that differ from ``expected``."""
    _fresh_start(bufs, device, barrier)
    run()
    _sync(device)
    return C.count_wrong(bufs.result, expected)


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


def run_benchmark(args: Any) -> int:
    """Runs the sweep on this rank (torch.distributed already initialised).
    Returns the process exit code: 0, or 1 when a result was wrong."""
    rank, n = dist.get_rank(), dist.get_world_size()
    spec = C.SPECS[args.collective]
    if n < spec.min_world:
        raise ValueError(f"{spec.name} needs at least {spec.min_world} ranks, got {n}; use --nproc")
    if spec.rooted and not 0 <= args.root < n:
        raise ValueError(f"-r {args.root} is not a rank of a world of {n}")
    device = _pick_device(args.device)
    dtype = getattr(torch, args.dtype)
    es = torch.empty((), dtype=dtype).element_size()
    root = args.root if spec.rooted else -1
    op = args.op if spec.reduces else "none"
    # Control traffic (barriers, gathering numbers) goes over gloo on the CPU.
    ctl = dist.group.WORLD if device.type == "cpu" else dist.new_group(backend="gloo")

    def barrier() -> None:
        dist.barrier(group=ctl)

    def agree(values: list[float], reduce: str) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, reduce), group=ctl)
        return t.tolist()

    comm = None
    if any(a != "torch" for a in args.algo):
        import pycomm

        comm = pycomm.init(group=dist.group.WORLD, transport=args.transport, device=device,
                           set_default=False)
    pc_transport = comm.transport if comm is not None else None
    torch_backend = str(dist.get_backend())

    def transport_of(algo: str) -> str:
        return torch_backend if algo == "torch" else str(pc_transport)

    # -- which algos can run here: probe each once on a tiny message -----------
    skipped: dict[str, str] = {}
    active: list[str] = []
    for algo in args.algo:
        err = ""
        try:
            probe = C.make_buffers(spec.name, spec.placements[0], rank, n, 1, dtype, args.op, device)
            probe.reset()
            C.make_runner(spec.name, algo, probe, comm=comm, rank=rank, world_size=n,
                          op=args.op, root=max(root, 0))()
            _sync(device)
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        failed = agree([1.0 if err else 0.0], "MAX")[0]
        if failed:
            skipped[algo] = err or "failed on another rank"
        else:
            active.append(algo)
    if not active:
        raise RuntimeError("no algo can run here: " + "; ".join(f"{a}: {r}" for a, r in skipped.items()))

    # -- reference: memcpy bandwidth of rank 0 (others wait) --------------------
    memcpy_bytes = min(max(max(args.sizes), 16 << 20), 256 << 20)
    memcpy = measure_memcpy(device, memcpy_bytes) if rank == 0 else 0.0
    memcpy = agree([memcpy], "MAX")[0]
    barrier()

    out = sys.stdout
    if rank == 0:
        print(f"# pycomm.bench {spec.name} ({spec.title}): world_size {n}, device {device}, "
              f"dtype {args.dtype}, op {op}, iters {args.iters}, warmup {args.warmup_iters}, "
              f"rounds {args.rounds}, check {args.check}", file=out)
        print(f"# transports: pycomm {pc_transport}, torch {torch_backend}; host {socket.gethostname()}, "
              f"torch {torch.__version__}", file=out)
        print(f"# memcpy bandwidth (rank 0, {format_size(memcpy_bytes)}): {memcpy:.2f} GB/s", file=out)
        print("# time: calls back to back, max over ranks of each rank's median; out-of-place: "
              + ("measured" if False in spec.placements else
                 "N/A (pycomm's op is in place; not emulated with an extra copy)"), file=out)
        for a, why in skipped.items():
            print(f"# algo {a}: skipped ({why})", file=out)
        print("#", file=out)
    groups = [(a, ip) for ip in spec.placements for a in active]
    if rank == 0:
        print(format_header(groups), file=out, flush=True)

    want_bar = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    bar = Progress(total=sum(max(s, 1) for s in args.sizes) * len(groups), enabled=rank == 0 and want_bar)
    rows: list[dict[str, Any]] = []
    for nbytes in args.sizes:
        count, size = C.counts(spec.name, nbytes, es, n)
        expected = (C.expected_result(spec.name, rank, n, count, dtype, args.op, max(root, 0))
                    if args.check else None)
        line: list[dict[str, Any] | None] = []
        for in_place in spec.placements:
            bar.draw(f"{format_size(size)} {'in-place' if in_place else 'out-of-place'}")
            bufs = C.make_buffers(spec.name, in_place, rank, n, count, dtype, args.op, device)
            runs = {algo: C.make_runner(spec.name, algo, bufs, comm=comm, rank=rank, world_size=n,
                                        op=args.op, root=max(root, 0)) for algo in active}
            wrongs = {algo: (_check_once(runs[algo], bufs, expected, device, barrier)
                             if expected is not None else 0) for algo in active}
            # Rounds take turns between the algos (see --rounds); warm-up
            # calls precede each algo's first round only.
            times: dict[str, list[float]] = {algo: [] for algo in active}
            rounds = min(args.rounds, args.iters)
            for k in range(rounds):
                per = args.iters // rounds + (1 if k < args.iters % rounds else 0)
                for algo in active:
                    times[algo] += _time_loop(runs[algo], bufs, per,
                                              args.warmup_iters if k == 0 else min(1, args.warmup_iters),
                                              device, barrier)
            for algo in active:
                wrong = wrongs[algo]
                t_med, total_wrong = agree([statistics.median(times[algo]), 0.0], "MAX")[0], \
                    agree([float(wrong)], "SUM")[0]
                t_us = t_med * 1e6
                algbw = size / t_med / 1e9 if t_med > 0 else 0.0
                row = {
                    "collective": spec.name, "size": size, "count": count, "dtype": args.dtype,
                    "op": op, "root": root, "algo": algo, "in_place": in_place,
                    "time_us": t_us, "algbw": algbw,
                    "busbw": algbw * C.busbw_factor(spec.name, n),
                    "wrong": int(total_wrong) if args.check else None,
                    "world_size": n, "transport": transport_of(algo), "device": device.type,
                }
                rows.append(row)
                line.append(row)
                bar.advance(max(size, 1))
            del bufs
        if rank == 0:
            bar.clear()
            print(format_row(line), file=out, flush=True)
    bar.clear()

    wrong_total = sum(r["wrong"] or 0 for r in rows)
    if rank == 0:
        print(format_summary(rows, active, memcpy), file=out, flush=True)
        meta = {
            "collective": spec.name, "world_size": n, "device": device.type, "dtype": args.dtype,
            "op": op, "root": root, "iters": args.iters, "warmup": args.warmup_iters,
            "rounds": args.rounds,
            "check": args.check, "algos": active, "skipped": skipped,
            "transport": pc_transport, "torch_backend": torch_backend,
            "memcpy_GBps": memcpy, "memcpy_bytes": memcpy_bytes,
            "host": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "timing": ("back-to-back calls after a barrier and warmup; max over ranks of "
                       "per-rank median; CPU perf_counter, GPU CUDA events"),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(),
        }
        if args.json:
            write_json(args.json, meta, rows)
            print(f"# wrote {args.json}", file=out)
        if args.plot:
            plot_results({"meta": meta, "rows": rows}, args.plot)
            print(f"# wrote {args.plot}", file=out)
        out.flush()
    barrier()
    if comm is not None:
        comm.close()
    return 0 if wrong_total == 0 else 1
