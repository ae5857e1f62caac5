"""pycomm's symmetric all-reduce against its own reduction loop run bare, in
the same processes and the same rounds.

    python benchmarks/allreduce/symmetric_bare.py --mib 64 --rounds 15 [--json F]

Two CPU ranks (spawned here). Each round times, one after the other, with the
ranks lined up by a barrier before each:

  pycomm   ``comm.all_reduce`` of a float32 tensor registered in symmetric
           memory (``register_tensor``): the path the study's ``symmetric``
           series times.
  bare     that path's memory traffic and nothing else: rank r sums half r of
           the two ranks' copies and writes the sum into both copies, with the
           reducer pycomm runs (``pycomm._C.reduce_to_all_``), then a barrier.
           The copies are memfd mappings that each owner fills first, as
           pycomm's regions are.
  memcpy   rank 0 copies a tensor of that size alone (the study's bound).

Why: on a shared VM the memory bandwidth that two busy cores get moves
between states that last seconds to minutes, so figures taken minutes apart,
or in another program, compare the states rather than the code. Timed in
the same rounds, ``pycomm / bare`` is what pycomm adds to its own loop (the
handshake and the binding; before 2cf37be also the staging of the first
piece), whatever the state.
Each series is checked once for the right sum before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SERIES = ("pycomm", "bare", "memcpy")


def _shared_copies(store: dist.Store, rank: int, numel: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Both ranks' copies of a float32 tensor, in rank order, and this rank's
    memfd (keep it open until the peer is done): each rank creates and fills
    its own, the peer maps it through /proc (nothing is left in /dev/shm)."""
    fd = os.memfd_create(f"symmetric_bare_{rank}")
    os.ftruncate(fd, numel * 4)
    store.set(f"fd{rank}", f"{os.getpid()} {fd}")
    mine = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=torch.float32)
    mine.fill_(float(rank + 1))  # first touch by the owner
    pid, peer_fd = store.get(f"fd{1 - rank}").decode().split()
    store.set(f"filled{rank}", "1")
    store.wait([f"filled{1 - rank}"])
    other = torch.from_file(f"/proc/{pid}/fd/{peer_fd}", shared=True, size=numel,
                            dtype=torch.float32)
    return (mine, other, fd) if rank == 0 else (other, mine, fd)


def _rank_main(rank: int, port: int, args: argparse.Namespace, out: Path) -> None:
    import pycomm
    from pycomm import _C

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=120))
    comm = pycomm.init(rank, 2, store, transport="shm")
    numel = args.mib * 2**20 // 4
    t = torch.full((numel,), float(rank + 1))
    if not comm.register_tensor(t):
        raise RuntimeError("register_tensor declined: no symmetric memory on this host")
    c0, c1, fd = _shared_copies(store, rank, numel)
    half = numel // 2
    lo, hi = (0, half) if rank == 0 else (half, numel)
    a, b = c0[lo:hi], c1[lo:hi]
    src, dst = torch.ones(numel), torch.empty(numel)

    def run_pycomm() -> None:
        comm.all_reduce(t)

    def run_bare() -> None:
        _C.reduce_to_all_([a, b], a, b, int(pycomm.ReduceOp.SUM), 1.0)
        comm.barrier()

    def run_memcpy() -> None:
        if rank == 0:
            dst.copy_(src)
        comm.barrier()

    runs = {"pycomm": run_pycomm, "bare": run_bare, "memcpy": run_memcpy}
    # Correctness first: 1 + 2 everywhere, on both ranks' copies.
    run_pycomm()
    run_bare()
    for name, x in (("pycomm", t), ("bare", c0), ("bare", c1)):
        if not bool((x == 3.0).all()):
            raise RuntimeError(f"{name}: wrong sum on rank {rank}")
    times: dict[str, list[float]] = {s: [] for s in SERIES}
    for r in range(args.warmup + args.rounds):
        for name in SERIES:
            comm.barrier()
            t0 = time.perf_counter()
            runs[name]()
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    if comm.symmetric_all_reduces != args.warmup + args.rounds + 1:
        raise RuntimeError("not every pycomm call ran from symmetric memory")
    if rank == 0:
        out.write_text(json.dumps(times))
    comm.barrier()  # the peer is done with this rank's memfd
    os.close(fd)
    comm.close()


def summarise(times: dict[str, list[float]], mib: int) -> list[str]:
    """The printed table: per series the median and range in microseconds,
    GB/s of the tensor's bytes, and the per-round ratios' medians."""
    nbytes = mib * 2**20
    lines = [f"# {mib} MiB float32 sum, 2 ranks, {len(times['pycomm'])} rounds",
             f"{'series':<8} {'median us':>10} {'min us':>9} {'max us':>9} {'GB/s':>7}"]
    for s in SERIES:
        med = statistics.median(times[s])
        lines.append(f"{s:<8} {med * 1e6:>10.0f} {min(times[s]) * 1e6:>9.0f} "
                     f"{max(times[s]) * 1e6:>9.0f} {nbytes / med / 1e9:>7.2f}")

    def ratio(x: str, y: str) -> float:
        return statistics.median(p / q for p, q in zip(times[x], times[y]))

    lines.append(f"# pycomm / bare, per round (median): {ratio('pycomm', 'bare'):.3f}")
    lines.append(f"# memcpy / pycomm (busbw / memcpy): {ratio('memcpy', 'pycomm'):.2f}; "
                 f"memcpy / bare: {ratio('memcpy', 'bare'):.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="tensor size in MiB")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write the times, the table and the commit here")
    args = ap.parse_args(argv)
    if args.mib < 1 or args.rounds < 1 or args.warmup < 0:
        ap.error("--mib and --rounds must be >= 1, --warmup >= 0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"symmetric_bare_{os.getpid()}.json"
    try:
        mp.spawn(_rank_main, args=(port, args, out), nprocs=2, join=True)
        times = json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
    lines = summarise(times, args.mib)
    print("\n".join(lines))
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from pycomm.bench.report import git_commit

        meta = {"commit": git_commit(["benchmarks/allreduce/symmetric_bare.py"]),
                "mib": args.mib, "rounds": args.rounds, "warmup": args.warmup}
        Path(args.json).write_text(json.dumps({"meta": meta, "times_s": times, "table": lines},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
