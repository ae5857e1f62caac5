"""Where the gloo transport's mid-size latency goes: one all-reduce size on
2 local ranks over ``transport="gloo"``, timed four ways: synchronous or
``async_op=True`` + ``wait()``, issued from the main thread or from another
thread (a synchronous call from a non-main thread runs the ring inline on
that thread; from the main thread it runs on the communicator's worker, whose
waits can check for Ctrl-C). Per-thread CPU time shows which thread works.

    python benchmarks/hosts/gloo_waits.py --bytes 8192 --calls 1500
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch
import torch.multiprocessing as mp

import pycomm


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads, by name."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{tid}/stat") as f:
            st = f.read()
        name = st[st.index("(") + 1:st.index(")")]
        fields = st[st.index(")") + 2:].split()
        out[f"{name}/{tid}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _rank(rank: int, port: int, nbytes: int, calls: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK="0")
    comm = pycomm.init(transport="gloo")
    t = torch.ones(nbytes // 4)
    ways = {"sync": lambda: comm.all_reduce(t),
            "async+wait": lambda: comm.all_reduce(t, async_op=True).wait()}
    for on_thread in (True, False, True):  # other, main, other: not a warm-up effect
        for way, call in ways.items():
            def body() -> None:
                for _ in range(20):
                    call()
                before, t0 = _thread_cpu(), time.perf_counter()
                for _ in range(calls):
                    call()
                us = (time.perf_counter() - t0) / calls * 1e6
                after = _thread_cpu()
                busy = {k: round((after[k] - v) / calls * 1e6) for k, v in before.items()
                        if k in after and after[k] > v}
                if rank == 0:
                    where = "other thread" if on_thread else "main thread"
                    print(f"{nbytes} B {way:<10} from the {where:<12}: {us:7.0f} us/call; "
                          f"CPU us/call by thread: {busy}", flush=True)
            if on_thread:
                th = threading.Thread(target=body)
                th.start()
                th.join()
            else:
                body()
    comm.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=int, default=8192)
    p.add_argument("--calls", type=int, default=1500)
    p.add_argument("--port", type=int, default=29611)
    a = p.parse_args()
    mp.spawn(_rank, args=(a.port, a.bytes, a.calls), nprocs=2)


if __name__ == "__main__":
    main()
