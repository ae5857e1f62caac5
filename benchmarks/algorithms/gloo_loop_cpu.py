"""What a small gloo all-reduce costs in CPU, beside its time: torch's own
gloo backend, 2 ranks on this machine, blocking all-reduces of 1 KiB.

    python benchmarks/algorithms/gloo_loop_cpu.py [--calls 4000] [--json F]

Prints, per rank, the time per call and the CPU the rank's process used per
call (every thread: rusage), and which of its threads used it (the busiest
thread names from /proc, e.g. gloo's ``gloo_tcp_loop``). On the 2-core VM
of benchmarks/algorithms/README.md a 1 KiB call took about 1.2 ms of which
each rank burnt most as CPU, in gloo's I/O loop thread: what makes gloo's
small messages, and every algorithm sent over them, CPU-bound there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _thread_cpu() -> dict[str, float]:
    """Seconds of CPU per thread name of this process (/proc, Linux)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def _rank(rank: int, port: int, calls: int, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.zeros(256)
    for _ in range(100):
        dist.all_reduce(t)
    dist.barrier()
    threads0, usage0 = _thread_cpu(), resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(t)
    wall = time.perf_counter() - start
    usage, threads = resource.getrusage(resource.RUSAGE_SELF), _thread_cpu()
    cpu = (usage.ru_utime - usage0.ru_utime) + (usage.ru_stime - usage0.ru_stime)
    by_thread = {k: (v - threads0.get(k, 0.0)) / calls * 1e6 for k, v in threads.items()}
    results[rank] = {"us_per_call": wall / calls * 1e6, "cpu_us_per_call": cpu / calls * 1e6,
                     "cpu_us_per_call_by_thread": dict(sorted(by_thread.items(), key=lambda kv: -kv[1])[:4])}
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=4000)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(port, args.calls, results), nprocs=2)
    rows = [dict(results[r], rank=r) for r in range(2)]
    for row in rows:
        threads = ", ".join(f"{k} {v:.0f}" for k, v in row["cpu_us_per_call_by_thread"].items())
        print(f"rank {row['rank']}: {row['us_per_call']:.1f} us per 1 KiB all-reduce, "
              f"{row['cpu_us_per_call']:.1f} us of CPU per call ({threads})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "cpu_count": os.cpu_count(), "calls": args.calls,
                       "rows": rows}, f, indent=1)
        print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
