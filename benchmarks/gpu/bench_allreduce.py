"""Ring vs NCCL all-reduce bus bandwidth, 64 MiB .. 1 GiB, plus algo="auto".

    python benchmarks/gpu/bench_allreduce.py --out allreduce.json [--auto-table auto.json]

With >= 2 GPUs each rank gets its own GPU (world = number of GPUs, or
--world). With one GPU, 2 ranks share it through NCCL's socket transport
(each rank its own NCCL_HOSTID): that run checks that the benchmark works and
is NOT a speed measurement (the JSON says "shared_gpu": true).

busbw = algbw * 2(n-1)/n as in nccl-tests. Targets (multi-GPU): ring >= 0.9x
nccl; auto >= 0.98x the better of the two. --auto-table writes the measured
crossover table for PYCOMM_AUTO_TABLE (pycomm/comm.py DEFAULT_AUTO_TABLE).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIZES_MIB = [64, 128, 256, 512, 1024]


def _worker(rank, world, port, shared, args, queue):
    try:
        sys.path.insert(0, str(ROOT))
        if shared:
            if os.environ.get("PYCOMM_GPU_TEST_MODE", "hostid") == "multi":
                os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
            else:
                os.environ["NCCL_HOSTID"] = f"host{rank}"
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_IB_DISABLE", "1")
        import torch
        import torch.distributed as dist

        import pycomm

        dev = 0 if shared else rank
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=600))
        comm = pycomm.init(rank=rank, world_size=world, store=store, transport="nccl",
                           device=f"cuda:{dev}", timeout=600, set_default=False)
        rows = []
        iters, warmup = (args.iters_shared, 1) if shared else (args.iters, 3)
        for mib in args.sizes:
            n = (mib << 20) // 4
            t = torch.ones(n, device=f"cuda:{dev}")
            # correctness once per size and algo, then timing
            for algo in ("ring", "nccl", "auto"):
                t.fill_(1.0)
                comm.all_reduce(t, algo=algo)
                wrong = int((t != world).sum().item())
                for _ in range(warmup):
                    comm.all_reduce(t, op="avg", algo=algo)
                comm.barrier()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    comm.all_reduce(t, op="avg", algo=algo)  # avg keeps values bounded
                end.record()
                end.synchronize()
                sec = start.elapsed_time(end) / 1000 / iters
                algbw = (n * 4) / sec / 1e9
                rows.append({"algo": algo, "bytes": n * 4, "time_us": round(sec * 1e6, 1),
                             "algbw_GBps": round(algbw, 2),
                             "busbw_GBps": round(algbw * 2 * (world - 1) / world, 2),
                             "wrong": wrong})
                if rank == 0:
                    print(json.dumps(rows[-1]), flush=True)
            del t
            torch.cuda.empty_cache()
        comm.close()
        queue.put((rank, rows, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--auto-table", default=None)
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--iters-shared", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="*", default=SIZES_MIB, help="MiB")
    args = ap.parse_args()
    import torch

    ngpu = torch.cuda.device_count()
    assert ngpu >= 1, "needs a GPU"
    shared = ngpu < 2
    world = args.world or (2 if shared else ngpu)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, shared, args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    errors = []
    for _ in range(world):
        rank, rows, err = queue.get(timeout=1800)
        if err:
            errors.append(f"rank {rank}:\n{err}")
        results[rank] = rows
    for p in procs:
        p.join(timeout=30)
    if errors:
        sys.exit("\n".join(errors))
    rows = results[0]
    summary = []
    table = []
    for b in sorted({r["bytes"] for r in rows}):
        by = {r["algo"]: r for r in rows if r["bytes"] == b}
        ring, nccl, auto = by["ring"]["busbw_GBps"], by["nccl"]["busbw_GBps"], by["auto"]["busbw_GBps"]
        best = max(ring, nccl)
        summary.append({"bytes": b, "ring_over_nccl": round(ring / nccl, 3) if nccl else None,
                        "auto_over_best": round(auto / best, 3) if best else None})
        table.append((b, "ring" if ring >= nccl else "nccl"))
    out = {"device": torch.cuda.get_device_name(), "world": world, "shared_gpu": shared,
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "targets": {"ring_over_nccl": 0.9, "auto_over_best": 0.98},
           "rows": rows, "summary": summary}
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=1))
    if args.auto_table:
        # Small sizes are not measured here: NCCL below the smallest size,
        # then the winner per measured size (pycomm/_auto_table.py's format).
        from pycomm import _auto_table

        rules = _auto_table.rules_from_best([(min(b for b, _ in table) - 1, "nccl"), *table])
        entry = {"device": "cuda", "transport": "nccl", "world_size": world,
                 "rules": {"all_reduce": rules},
                 "measured": {"device": out["device"], "shared_gpu": shared,
                              "command": "python benchmarks/gpu/bench_allreduce.py"}}
        table_json = _auto_table.with_entry(args.auto_table, entry)
        Path(args.auto_table).write_text(json.dumps(table_json, indent=1))


if __name__ == "__main__":
    main()
