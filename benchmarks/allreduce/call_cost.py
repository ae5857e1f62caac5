"""What one blocking all-reduce call costs when there is nothing to
communicate: a world of one rank, 4 KiB of float32, beside mpi4py's
``Allreduce`` (MPICH, the same world of one) and torch's ``add_`` of the same
tensor, in the same rounds.

    python benchmarks/allreduce/call_cost.py [--rounds 7] [--calls 50000] [--json F]

Each round times ``--calls`` back-to-back calls of each series in turn; a
series' figure is its median over the rounds, in microseconds per call. On a
world of one every collective is the identity, so the time is the path from
Python to the transport and back (argument checks, the binding, the op's Work,
the executor): issue 40's "per-call overhead". Without mpi4py the MPI series
is left out, said once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.distributed import TCPStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pycomm  # noqa: E402
from pycomm.bench.report import git_commit  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    store = TCPStore("127.0.0.1", 0, 1, True)
    comm = pycomm.init(rank=0, world_size=1, store=store, transport="shm")
    t = torch.ones(1024)
    series = {"pycomm all_reduce": lambda: comm.all_reduce(t), "torch add_": lambda: t.add_(0)}
    try:
        from mpi4py import MPI
    except ImportError:
        print("# mpi4py: not installed (pip install mpi4py mpich): its series is left out")
    else:
        a = t.numpy()
        series["mpi4py Allreduce"] = lambda: MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
    times: dict[str, list[float]] = {name: [] for name in series}
    for fn in series.values():  # warm up
        per_call_us(fn, 1000)
    for _ in range(args.rounds):
        for name, fn in series.items():
            times[name].append(per_call_us(fn, args.calls))
    comm.close()
    medians = {name: statistics.median(v) for name, v in times.items()}
    for name, v in times.items():
        print(f"{name:20s} {medians[name]:6.2f} us/call (rounds {min(v):.2f}-{max(v):.2f})")
    if "mpi4py Allreduce" in medians:
        ratio = medians["pycomm all_reduce"] / medians["mpi4py Allreduce"]
        print(f"pycomm / mpi4py: {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join(sys.argv), "commit": git_commit(), "torch": torch.__version__,
            "us_per_call": times, "median_us": medians}, indent=1) + "\n")
        print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
