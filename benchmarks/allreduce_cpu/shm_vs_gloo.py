"""All-reduce on one host: pycomm over shared memory vs torch.distributed gloo.

Spawns N local ranks; each initialises torch.distributed (gloo) AND pycomm
(transport="shm") on the same ranks and times both, interleaved iteration by
iteration, for every size. Each iteration starts after a barrier; the time is
the median over iterations on each rank, then the max over ranks. busbw =
bytes / time * 2(n-1)/n (nccl-tests convention; for n=2 equal to algbw).

    python benchmarks/allreduce_cpu/shm_vs_gloo.py                  # 2 ranks
    python benchmarks/allreduce_cpu/shm_vs_gloo.py --world-sizes 2,3,4

Run from the repository root (it imports ./pycomm).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def _fmt_size(b: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= m and b % m == 0:
            return f"{b // m} {unit}"
    return f"{b} B"


def _iters_for(nbytes: int, base: int) -> int:
    # ~constant total bytes per size, at least 10 iterations
    return max(10, min(base, (512 << 20) // max(nbytes, 1)))


def _rank_main(rank: int, n: int, port: int, sizes: list[int], algos: list[str], iters: int,
               q) -> None:
    try:
        import torch
        import torch.distributed as dist

        import pycomm

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, n, False, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=dist.PrefixStore("torch", store), rank=rank,
                                world_size=n, timeout=timedelta(seconds=300))
        comm = pycomm.init(rank=rank, world_size=n, store=dist.PrefixStore("pycomm", store),
                           transport="shm", timeout=300)
        results = {}
        for nbytes in sizes:
            count = max(1, nbytes // 4)
            t = torch.ones(count, dtype=torch.float32)
            it = _iters_for(nbytes, iters)
            names = ["gloo"] + algos
            times = {k: [] for k in names}

            def one(name):
                if name == "gloo":
                    dist.all_reduce(t)
                else:
                    comm.all_reduce(t, algo=name)

            for name in names:  # warm-up (page faults, first-touch)
                one(name)
                one(name)
            for _ in range(it):
                for name in names:  # interleaved
                    comm.barrier()
                    t0 = time.perf_counter()
                    one(name)
                    times[name].append(time.perf_counter() - t0)
            results[nbytes] = {k: statistics.median(v) for k, v in times.items()}
        comm.close()
        dist.destroy_process_group()
        q.put((rank, results))
    except BaseException:
        import traceback

        q.put((rank, traceback.format_exc()))


def _memcpy_bw(nbytes: int = 64 << 20) -> float:
    import torch

    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    ts = []
    for _ in range(15):
        t0 = time.perf_counter()
        dst.copy_(src)
        ts.append(time.perf_counter() - t0)
    return nbytes / statistics.median(ts[3:])


def run(n: int, sizes: list[int], algos: list[str], iters: int) -> dict:
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    server = dist.TCPStore("127.0.0.1", 0, n, True, timeout=timedelta(seconds=120),
                           wait_for_workers=False)
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, n, server.port, sizes, algos, iters, q))
             for r in range(n)]
    for p in procs:
        p.start()
    per_rank = {}
    for _ in procs:
        r, res = q.get(timeout=1800)
        if isinstance(res, str):
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {r} failed:\n{res}")
        per_rank[r] = res
    for p in procs:
        p.join()
    # max over ranks of the per-rank medians
    return {b: {k: max(per_rank[r][b][k] for r in per_rank) for k in per_rank[0][b]}
            for b in sizes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--world-sizes", default="2", help="comma list, e.g. 2,3,4")
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="bytes per rank (K/M suffixes)")
    ap.add_argument("--algos", default="auto,ring", help="pycomm algos to time (auto,ring,direct)")
    ap.add_argument("--iters", type=int, default=50, help="max iterations per size")
    args = ap.parse_args()
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    algos = [a for a in args.algos.split(",") if a]
    memcpy = _memcpy_bw()
    print(f"memcpy (torch copy_, 64 MiB, 1 thread): {memcpy / 1e9:.1f} GB/s; "
          f"{os.cpu_count()} CPUs; float32 SUM; time = max over ranks of the median")
    for n in [int(x) for x in args.world_sizes.split(",")]:
        res = run(n, sizes, algos, args.iters)
        factor = 2 * (n - 1) / n if n > 1 else 1.0
        print(f"\nworld_size {n}")
        hdr = f"{'size':>9} | {'gloo us':>9} {'busbw':>6}"
        for a in algos:
            hdr += f" | {'shm/' + a + ' us':>13} {'busbw':>6} {'x gloo':>6}"
        print(hdr + "   (busbw in GB/s)")
        for b in sizes:
            g = res[b]["gloo"]
            line = f"{_fmt_size(b):>9} | {g * 1e6:9.1f} {b / g * factor / 1e9:6.2f}"
            for a in algos:
                t = res[b][a]
                line += f" | {t * 1e6:13.1f} {b / t * factor / 1e9:6.2f} {g / t:6.1f}"
            print(line)
        big = max(sizes)
        best = min(res[big][a] for a in algos)
        print(f"  {_fmt_size(big)}: best shm busbw {big / best * factor / 1e9:.2f} GB/s = "
              f"{big / best * factor / memcpy * 100:.0f}% of memcpy bandwidth")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
