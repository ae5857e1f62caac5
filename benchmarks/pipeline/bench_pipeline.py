"""Pipeline study: pycomm's schedules vs torch.distributed.pipelining, side by side.

    python benchmarks/pipeline/bench_pipeline.py --ranks 2 --microbatches 2,4,8,16

Spawns ``--ranks`` CPU processes. Each holds one stage (an MLP of
``--layers-per-stage`` Linear+Tanh layers of ``--width``) and, for every
schedule (GPipe, 1F1B, 1F1B with slack=1) and microbatch count, times training steps of

* pycomm: ``pycomm.pipeline`` over pycomm's p2p (``--transport``, default shm),
* torch:  ``torch.distributed.pipelining`` over gloo,

taking turns within each round so both see the same machine. The same rank
also times its stage's computation alone (m forwards + m backwards, no
communication; median of the round, best round, as for the steps): the *busy*
time. Measured bubble = 1 - mean busy / step time
(communication and per-microbatch overheads count as bubble), next to the
theory (p-1)/(m+p-1). Writes ``results_<p>ranks.json`` (with the git commit)
and a PNG.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HERE = Path(__file__).resolve().parent
# "1f1b+1": pycomm's 1F1B with slack=1 (one more warm-up forward on every
# stage but the last); torch's row beside it is its plain 1F1B.
SCHEDULES = ("gpipe", "1f1b", "1f1b+1")


def _stage_module(args: argparse.Namespace, stage: int) -> nn.Sequential:
    torch.manual_seed(1000 + stage)
    layers: list[nn.Module] = []
    for _ in range(args.layers_per_stage):
        layers += [nn.Linear(args.width, args.width), nn.Tanh()]
    return nn.Sequential(*layers)


def _busy_time(mod: nn.Module, m: int, args: argparse.Namespace, is_last: bool) -> float:
    """One step's computation of this stage alone: m forwards + m backwards."""
    rows = args.batch // m
    x = torch.randn(rows, args.width, requires_grad=True)
    y = torch.randn(rows, args.width)
    t0 = time.perf_counter()
    for _ in range(m):
        out = mod(x)
        if is_last:
            nn.functional.mse_loss(out, y).backward()
        else:
            out.backward(torch.ones_like(out))
    return time.perf_counter() - t0


def _timed_steps(step, steps: int) -> float:
    """Median seconds per step over `steps` steps, the slowest rank's."""
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    import pycomm
    import pycomm.pipeline as pp
    from torch.distributed import pipelining as tp

    comm = pycomm.init(group=dist.group.WORLD, transport=args.transport)
    is_first, is_last = rank == 0, rank == world - 1
    torch.manual_seed(7)
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    loss_fn = nn.functional.mse_loss
    results = []
    for m in args.microbatches:
        for name in SCHEDULES:
            mod = _stage_module(args, rank)
            ours = pp.PipelineStage(copy.deepcopy(mod), rank, world, comm)
            if name == "gpipe":
                ours_sched = pp.ScheduleGPipe(ours, m, loss_fn)
            else:
                ours_sched = pp.Schedule1F1B(ours, m, loss_fn, slack=int(name[5:] or 0))
            theirs_sched = None
            if name == "gpipe" or m >= world:  # torch's 1F1B needs m >= stages
                theirs = tp.PipelineStage(copy.deepcopy(mod), rank, world, torch.device("cpu"))
                theirs_sched = (tp.ScheduleGPipe if name == "gpipe" else tp.Schedule1F1B)(
                    theirs, m, loss_fn=loss_fn)

            def run(sched):
                def step():
                    if is_first:
                        sched.step(x)
                    elif is_last:
                        sched.step(target=y)
                    else:
                        sched.step()
                return step

            runs = {"pycomm": run(ours_sched)}
            if theirs_sched is not None:
                runs["torch"] = run(theirs_sched)
            for step in runs.values():  # warm-up (torch infers shapes here)
                step()
            per = {k: [] for k in runs}
            busy = []
            for _ in range(args.rounds):
                for k, step in runs.items():
                    per[k].append(_timed_steps(step, args.steps))
                # The step times' statistic (median of the round, best round):
                # a minimum here would set the fastest computation against
                # typical steps and count their spread as bubble.
                busy.append(statistics.median(_busy_time(mod, m, args, is_last)
                                              for _ in range(args.steps)))
            b = torch.tensor([min(busy)], dtype=torch.float64)
            dist.all_reduce(b)
            busy_mean = float(b) / world
            row = {"schedule": name, "ranks": world, "microbatches": m,
                   "busy_s": busy_mean,
                   "bubble_theory": (world - 1) / (m + world - 1)}
            for k, ts in per.items():
                t = min(ts)
                row[f"{k}_step_s"] = t
                row[f"{k}_samples_per_s"] = args.batch / t
                row[f"{k}_bubble"] = max(0.0, 1.0 - busy_mean / t)
            if "torch" in per:
                row["speedup_vs_torch"] = row["torch_step_s"] / row["pycomm_step_s"]
            results.append(row)
            if rank == 0:
                _print_row(row)
    if rank == 0:
        _write(results, args)
    comm.close()
    dist.destroy_process_group()


def _print_row(r: dict) -> None:
    torch_part = (f"torch {r['torch_step_s'] * 1e3:8.2f} ms  bubble {r['torch_bubble']:.3f}  "
                  f"speedup {r['speedup_vs_torch']:.2f}x" if "torch_step_s" in r
                  else "torch  (1F1B needs m >= stages)")
    print(f"{r['schedule']:>6} p={r['ranks']} m={r['microbatches']:3d}  "
          f"theory {r['bubble_theory']:.3f}"
          f"  pycomm {r['pycomm_step_s'] * 1e3:8.2f} ms  bubble {r['pycomm_bubble']:.3f}  "
          + torch_part, flush=True)


def _git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=HERE, capture_output=True,
                               text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _write(results: list[dict], args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{args.ranks}ranks{args.tag}"
    doc = {"commit": _git_commit(), "torch": torch.__version__,
           "config": {k: v for k, v in vars(args).items() if k != "out"},
           "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
           "results": results}
    (out / f"results_{tag}.json").write_text(json.dumps(doc, indent=1) + "\n")
    _plot(results, out / f"pipeline_{tag}.png", args)
    print(f"wrote {out / f'results_{tag}.json'} and {out / f'pipeline_{tag}.png'}")


def _plot(results: list[dict], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, marker in zip(SCHEDULES, "os^"):
        rows = [r for r in results if r["schedule"] == name]
        ms = [r["microbatches"] for r in rows]
        ax1.plot(ms, [r["pycomm_bubble"] for r in rows], marker=marker, label=f"pycomm {name}")
        tr = [r for r in rows if "torch_bubble" in r]
        ax1.plot([r["microbatches"] for r in tr], [r["torch_bubble"] for r in tr], marker=marker,
                 linestyle=":", label=f"torch {name}")
        ax2.plot([r["microbatches"] for r in tr], [r["speedup_vs_torch"] for r in tr],
                 marker=marker, label=name)
    ms = sorted({r["microbatches"] for r in results})
    ax1.plot(ms, [(args.ranks - 1) / (m + args.ranks - 1) for m in ms], "k--",
             label="theory (p-1)/(m+p-1)")
    ax1.set(xscale="log", xlabel="microbatches m", ylabel="bubble fraction",
            title=f"bubble, {args.ranks} CPU ranks")
    ax2.axhline(1.0, color="k", linestyle="--")
    ax2.set(xscale="log", xlabel="microbatches m", ylabel="torch step time / pycomm step time",
            title=f"speed vs torch (pycomm: {args.transport}, torch: gloo)")
    for ax in (ax1, ax2):
        ax.minorticks_off()
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--microbatches", type=lambda s: [int(v) for v in s.split(",")],
                    default=[1, 2, 4, 8, 16])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers-per-stage", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256, help="rows per step (all microbatches)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round (median)")
    ap.add_argument("--rounds", type=int, default=3, help="turns between pycomm and torch (best)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--transport", default="shm", choices=["shm", "gloo"],
                    help="pycomm's transport (torch always uses gloo)")
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    args = ap.parse_args(argv)
    from pycomm.bench.cli import require_module

    require_module(ap, "the figure (always drawn)", "matplotlib")
    for m in args.microbatches:
        if args.batch % m:
            ap.error(f"--batch {args.batch} must be a multiple of every microbatch count ({m})")
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    mp.spawn(_rank_main, args=(args.ranks, port, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
