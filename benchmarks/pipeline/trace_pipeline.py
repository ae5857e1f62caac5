"""Where a pipeline step's time goes, action by action, on every rank.

    OMP_NUM_THREADS=1 python benchmarks/pipeline/trace_pipeline.py --schedule 1f1b -m 16 \\
        --width 1024 --layers-per-stage 8 --batch 256

Spawns ``--ranks`` CPU processes with the stage of ``bench_pipeline.py``,
runs a few warm-up steps, then times ``--steps`` steps with every action of
the runtime wrapped (``time.perf_counter``, one clock for all processes on
Linux): for each computation, the time it waited for its received input
(``wait``) and the time it computed (``compute``); for each communication
phase, its duration (posting, header wait, Python). Prints, per rank, the
totals of the fastest step (on a shared machine, the
least disturbed one) (compute, wait, phase, the rest = Python between
actions) and, with ``--timeline``, that step's actions in time order
on both ranks. Last, it replays the measured computations with free
communication: what this step would take if transfers and the runtime's own
work cost nothing (the rest of the gap to the busiest rank's compute is the
schedule's coupling with the computations' run-to-run spread).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import _stage_module  # noqa: E402


def _instrument(events: list) -> None:
    """Wraps the runtime's actions so that each appends (what, t0, t1, wait)."""
    from pycomm.pipeline import schedules as sch

    waits = [0.0]
    orig_wait = sch._wait_received

    def wait_received(work):
        t0 = time.perf_counter()
        orig_wait(work)
        waits[0] += time.perf_counter() - t0

    sch._wait_received = wait_received

    def wrap(name, fn):
        def run(self, arg):
            waits[0] = 0.0
            t0 = time.perf_counter()
            fn(self, arg)
            t1 = time.perf_counter()
            if name == "phase":
                what = "phase " + " ".join(
                    f"{a.kind.value}{a.microbatch}" for a in arg)
            else:
                what = f"{arg.kind.value}{arg.microbatch}"
            events.append((what, t0, t1, waits[0]))
        return run

    sch._Run.forward = wrap("forward", sch._Run.forward)
    sch._Run.backward = wrap("backward", sch._Run.backward)
    sch._Run.phase = wrap("phase", sch._Run.phase)


def _replay(orders: list[list[tuple[str, int, float]]]) -> float:
    """The step time if every transfer and every action's overhead took no
    time: each rank runs its computations (stage = rank) in the order and
    with the durations measured, each as soon as its inputs exist."""
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * len(orders), [0.0] * len(orders)
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                kind, i, dur = order[pos[r]]
                dep = ((kind, r - 1, i) if kind == "F" and r > 0 else
                       ("B", r + 1, i) if kind == "B" and r < len(orders) - 1 else None)
                if dep is not None and dep not in done:
                    break
                clock[r] = max(clock[r], done[dep] if dep else 0.0) + dur
                done[(kind, r, i)] = clock[r]
                pos[r] += 1
                progress = True
    return max(clock)


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    import pycomm
    import pycomm.pipeline as pp

    comm = pycomm.init(group=dist.group.WORLD, transport=args.transport)
    events: list = []
    _instrument(events)
    torch.manual_seed(7)
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    stage = pp.PipelineStage(_stage_module(args, rank), rank, world, comm)
    if args.schedule == "gpipe":
        sched = pp.ScheduleGPipe(stage, args.microbatches, nn.functional.mse_loss)
    else:
        sched = pp.Schedule1F1B(stage, args.microbatches, nn.functional.mse_loss,
                                slack=args.slack)

    def step():
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y)
        else:
            sched.step()

    for _ in range(3):
        step()
    steps = []
    for _ in range(args.steps):
        dist.barrier()
        events.clear()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        steps.append((t1 - t0, t0, list(events)))
    durs = torch.tensor([s[0] for s in steps], dtype=torch.float64)
    dist.all_reduce(durs, op=dist.ReduceOp.MAX)
    k = int(torch.argmin(durs))  # the fastest step (slowest rank's time): the least noise
    dur, t0, evs = steps[k]
    comp = sum(e[2] - e[1] - e[3] for e in evs if not e[0].startswith("phase"))
    wait = sum(e[3] for e in evs)
    phase = sum(e[2] - e[1] for e in evs if e[0].startswith("phase"))
    rows = [f"rank {rank}: step {dur * 1e3:7.2f} ms (slowest rank {float(durs[k]) * 1e3:7.2f}; "
            f"steps {' '.join(f'{float(d) * 1e3:.1f}' for d in durs)})",
            f"  compute {comp * 1e3:7.2f}  wait-for-input {wait * 1e3:7.2f}  "
            f"phases {phase * 1e3:7.2f}  other {(dur - comp - wait - phase) * 1e3:7.2f} ms"]
    if args.timeline:
        for what, a, b, w in evs:
            rows.append(f"  r{rank} {(a - t0) * 1e3:8.3f} {(b - a) * 1e3:7.3f} "
                        f"wait {w * 1e3:6.3f}  {what}")
    computes = [(e[0][0], int(e[0][1:]), e[2] - e[1] - e[3]) for e in evs
                if not e[0].startswith("phase")]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, ("\n".join(rows), computes))
    if rank == 0:
        print(f"{args.schedule} p={world} m={args.microbatches}"
              + (f" slack={args.slack}" if args.schedule == "1f1b" else ""))
        for text, _ in gathered:
            print(text)
        orders = [c for _, c in gathered]
        busy = [sum(t for *_, t in o) for o in orders]
        print(f"replay of these computations with free communication: "
              f"{_replay(orders) * 1e3:7.2f} ms; busiest rank {max(busy) * 1e3:7.2f}, "
              f"mean {sum(busy) / world * 1e3:7.2f} ms")
    comm.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    ap.add_argument("-m", "--microbatches", type=int, default=16)
    ap.add_argument("--slack", type=int, default=0, help="1F1B's slack (Schedule1F1B)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers-per-stage", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--transport", default="shm", choices=["shm", "gloo"])
    ap.add_argument("--timeline", action="store_true", help="print every action")
    args = ap.parse_args()
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank_main, args=(args.ranks, port, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
