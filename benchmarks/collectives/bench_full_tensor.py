"""DTensor ``full_tensor()`` of one parameter, pycomm vs gloo, side by side.

    torchrun --nproc-per-node 2 benchmarks/collectives/bench_full_tensor.py \\
        --mib 64 --iters 10 --rounds 5 --json benchmarks/collectives/full_tensor_2ranks.json

One process group of each backend in every rank (the default group on
"pycomm", a ``new_group(backend="gloo")`` beside it), a 1-D DeviceMesh over
each (``DeviceMesh.from_group``), and the same parameter (``--mib`` MiB of
float32, ``Shard(0)``) distributed on both. Each round times ``--iters``
``full_tensor()`` calls on one mesh, then on the other (rounds alternate
which goes first, so machine noise hits both alike); a call's time is the
slowest rank's (a barrier before, a max all-reduce of the times after). The
table shows each backend's median over all timed calls and pycomm's speedup;
the first call of each backend is untimed (warm-up). Every result is checked
against the parameter.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

import pycomm  # noqa: F401  (registers the "pycomm" backend)


def _time_full_tensor(d, group, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        full = d.full_tensor()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
        times.append(dt.item())
    if not torch.equal(full, PARAM):
        raise AssertionError("full_tensor() differs from the parameter")
    return times


def _commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty",
                              "--abbrev=40"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    global PARAM
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=float, default=64.0, help="parameter size in MiB (float32)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per backend per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    a = p.parse_args()

    dist.init_process_group(backend="pycomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"pycomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    numel = int(a.mib * (1 << 20)) // 4 // world * world
    torch.manual_seed(0)
    PARAM = torch.randn(numel)
    dts = {}
    for name, g in groups.items():
        mesh = DeviceMesh.from_group(g, "cpu")
        # src_data_rank=None: each rank slices its shard locally (no scatter)
        dts[name] = distribute_tensor(PARAM, mesh, [Shard(0)], src_data_rank=None)
        _time_full_tensor(dts[name], g, 1)  # warm-up
    times: dict[str, list[float]] = {n: [] for n in groups}
    order = list(groups)
    for r in range(a.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            times[name] += _time_full_tensor(dts[name], groups[name], a.iters)
    med = {n: statistics.median(t) for n, t in times.items()}
    if rank == 0:
        nbytes = numel * 4
        print(f"# DTensor full_tensor(): {nbytes} B float32 parameter, Shard(0) over {world} "
              f"ranks, {a.rounds} rounds x {a.iters} calls")
        print(f"{'backend':>8} {'median(us)':>12} {'min(us)':>10} {'algbw(GB/s)':>12}")
        for n in groups:
            print(f"{n:>8} {med[n] * 1e6:12.1f} {min(times[n]) * 1e6:10.1f} "
                  f"{nbytes / med[n] / 1e9:12.3f}")
        print(f"# pycomm speedup over gloo (median time ratio): {med['gloo'] / med['pycomm']:.2f}x")
        if a.json:
            Path(a.json).write_text(json.dumps({
                "meta": {"world_size": world, "bytes": nbytes, "dtype": "float32",
                         "iters": a.iters, "rounds": a.rounds, "commit": _commit(),
                         "host": platform.node(), "cpus": torch.get_num_threads()},
                "median_us": {n: m * 1e6 for n, m in med.items()},
                "speedup": med["gloo"] / med["pycomm"],
                "times_us": {n: [t * 1e6 for t in ts] for n, ts in times.items()},
            }, indent=1) + "\n")
    dist.destroy_process_group()


PARAM = torch.empty(0)

if __name__ == "__main__":
    main()
