"""Resident memory of two gloo ranks exchanging isend/irecv pairs.

    python benchmarks/soak/p2p_rss.py --rounds 20000 --json p2p_rss.json

Rank 0's RSS after glibc's malloc_trim(0) (memory in use, not heap kept
free) every 2000 rounds, and the rounds' wall time. A transport that starts a
thread per message grows here by what torch keeps per thread that ever
waited on a c10d Work (RankLocal, never freed); one that reuses its threads
stays flat once warm.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SAMPLE_EVERY = 2000


def _rank(rank: int, port: int, rounds: int, path: str) -> None:
    import pycomm
    from pycomm.bench.report import git_commit
    from pycomm.bench.resources import rss_mb

    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    comm = pycomm.init(rank=rank, world_size=2, store=store, transport="gloo")
    peer = 1 - rank
    mine, got = torch.full((256,), float(rank)), torch.empty(256)
    samples = []
    start = time.perf_counter()
    for i in range(rounds):
        if i % SAMPLE_EVERY == 0:
            samples.append([i, round(rss_mb(trim=True), 2)])
        recv, send = comm.irecv(got, peer), comm.isend(mine, peer)
        recv.wait()
        send.wait()
        if got[0].item() != peer:
            raise AssertionError(f"round {i}: received {got[0].item()}, expected {peer}")
    seconds = time.perf_counter() - start
    samples.append([rounds, round(rss_mb(trim=True), 2)])
    comm.close()
    if rank == 0:
        result = {"commit": git_commit(), "rounds": rounds, "seconds": round(seconds, 2),
                  "rss_mb": samples, "growth_mb": round(samples[-1][1] - samples[1][1], 2)}
        print(json.dumps(result))
        if path:
            with open(path, "w") as f:
                json.dump(result, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20000)
    p.add_argument("--json", default="", help="write the result here")
    args = p.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    mp.spawn(_rank, args=(store.port, args.rounds, args.json), nprocs=2)


if __name__ == "__main__":
    main()
