"""Training step time: pycomm's DistributedDataParallel vs torch's DDP on gloo.

    python benchmarks/ddp/bench_pycomm_ddp.py --nproc 2 --json results.json --plot results.png

Spawns ``--nproc`` CPU ranks (one thread each). Every rank builds the same
MLP (``--width`` x ``--layers``, ~10M parameters by default) three times:
torch DDP over gloo, pycomm DDP over pycomm's default CPU transport, and the
bare module (compute only, no communication: the floor). The variants take
turns in ``--rounds`` rounds of ``--steps`` timed SGD steps (after
``--warmup`` steps each), so machine noise hits them alike. A step is
zero_grad + forward + backward + optimizer step; its time is the median over
the timed steps, the max over ranks. Reported: each variant's step time, the
speedup of pycomm over torch, and the share of pycomm's communication hidden
behind backward (``ddp.stats()``, iterations after the rebuild).

Modes: ``compare`` (``--bucket-mb``, default 25), ``sweep`` (both DDPs at
each of ``--sweep`` bucket caps, default 1,5,25,100 MiB) and ``contention``
(not in the default: one all-reduce of the model's gradient bytes, pycomm and
torch, with the calling process idle and with its main thread computing
matmuls meanwhile, as during an overlapped backward). JSON (with the git
commit and the PYCOMM_* environment) and a PNG.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--mode", default="compare,sweep", help="compare,sweep,contention (any)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=10, help="hidden layers of width x width")
    p.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25)
    p.add_argument("--sweep", default="1,5,25,100")
    p.add_argument("--transport", default="auto", help="pycomm transport (auto: shm on one host)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--timeout", type=float, default=1800)
    return p.parse_args(argv)


# ---------------------------------------------------------------- on each rank

def _model(args: argparse.Namespace):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(args.width, 1))


def _time_steps(model, opt, data, count: int) -> list[float]:
    import torch
    from torch import nn

    times = []
    for i in range(count):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def _variants(args: argparse.Namespace, comm: Any, cap: float) -> dict[str, Any]:
    import torch
    from torch import nn

    from pycomm.parallel import DistributedDataParallel

    return {
        "compute only": _model(args),
        "torch DDP (gloo)": nn.parallel.DistributedDataParallel(_model(args), bucket_cap_mb=cap),
        "pycomm DDP": DistributedDataParallel(_model(args), comm, bucket_cap_mb=cap),
    }


def _measure(args: argparse.Namespace, comm: Any, cap: float) -> dict[str, Any]:
    """Step times of every variant at one bucket cap, interleaved in rounds."""
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(comm.rank)
    data = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1, generator=g))
            for _ in range(4)]
    models = _variants(args, comm, cap)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for name, model in models.items():
        _time_steps(model, opts[name], data, args.warmup)
    ddp = models["pycomm DDP"]
    skip = len(ddp.stats().iterations)
    for _ in range(args.rounds):
        for name, model in models.items():
            dist.barrier()
            times[name] += _time_steps(model, opts[name], data, args.steps)
    stats = ddp.stats()
    its = stats.iterations[skip:]
    comm_s = sum(it.comm_s for it in its)
    local = {
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "hidden_fraction": sum(it.hidden_s for it in its) / comm_s if comm_s else 0.0,
        "comm_ms_per_step": 1e3 * comm_s / max(len(its), 1),
        "buckets": len(stats.buckets),
        "table": stats.table(last=3),
    }
    gathered: list[Any] = [None] * comm.world_size
    dist.all_gather_object(gathered, local)
    return {
        "bucket_mb": cap,
        "step_ms": {k: 1e3 * max(g["median_s"][k] for g in gathered) for k in times},
        "hidden_fraction": min(g["hidden_fraction"] for g in gathered),
        "pycomm_comm_ms_per_step": max(g["comm_ms_per_step"] for g in gathered),
        "buckets": gathered[0]["buckets"],
        "stats_rank0": gathered[0]["table"],
    }


def _contention(args: argparse.Namespace, comm: Any, numel: int) -> dict[str, Any]:
    """Median time of one all-reduce of ``numel`` floats, idle and while this
    rank's main thread computes small matmuls (an overlapped backward)."""
    import torch
    import torch.distributed as dist

    t = torch.ones(numel)
    a = torch.randn(200, 200)  # < 1 ms a matmul: the loop notices completion quickly
    out: dict[str, Any] = {}
    for name in ("pycomm", "torch"):
        for busy in (False, True):
            times = []
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                if name == "torch":
                    work = dist.all_reduce(t, async_op=True)
                else:
                    work = comm.all_reduce(t, op="avg", async_op=True)
                while busy and not work.is_completed():
                    a @ a
                work.wait()
                times.append(time.perf_counter() - t0)
            local = statistics.median(times)
            gathered: list[Any] = [None] * comm.world_size
            dist.all_gather_object(gathered, local)
            out[f"{name} {'busy' if busy else 'idle'} ms"] = 1e3 * max(gathered)
    return out


def _rank_main(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    import pycomm

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, args.nproc, False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("torch", store), rank=rank,
                            world_size=args.nproc)
    comm = pycomm.init(rank=rank, world_size=args.nproc, store=dist.PrefixStore("pycomm", store),
                       transport=args.transport)
    modes = args.mode.split(",")
    result: dict[str, Any] = {"pycomm_transport": comm.transport}
    if "compare" in modes:
        result["compare"] = _measure(args, comm, args.bucket_mb)
    if "sweep" in modes:
        result["sweep"] = [_measure(args, comm, float(c)) for c in args.sweep.split(",")]
    if "contention" in modes:
        numel = sum(p.numel() for p in _model(args).parameters())
        result["contention"] = _contention(args, comm, numel)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    comm.close()
    dist.destroy_process_group()


def _child(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    try:
        _rank_main(rank, args, port, out_path)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


# ---------------------------------------------------------------- parent

def _git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _launch(args: argparse.Namespace, out_path: str) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, args.nproc, True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_child, args=(r, args, store.port, out_path))
             for r in range(args.nproc)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    failed = [p for p in procs if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    if failed:
        raise SystemExit(f"bench_pycomm_ddp: {len(failed)} rank(s) failed or timed out")


def _print(result: dict[str, Any]) -> None:
    def row(m: dict[str, Any]) -> str:
        t = m["step_ms"]
        speedup = t["torch DDP (gloo)"] / t["pycomm DDP"]
        return (f"{m['bucket_mb']:>9g} {m['buckets']:>7} {t['compute only']:>12.1f} "
                f"{t['torch DDP (gloo)']:>12.1f} {t['pycomm DDP']:>12.1f} {speedup:>8.2f}x "
                f"{m['hidden_fraction']:>8.0%} {m['pycomm_comm_ms_per_step']:>10.1f}")

    cfg = result["config"]
    print(f"# pycomm DDP vs torch DDP: {cfg['nproc']} CPU ranks, {cfg['params'] / 1e6:.1f}M params "
          f"({cfg['params'] * 4 / 2**20:.0f} MiB fp32), batch {cfg['batch']}/rank, pycomm "
          f"transport {result['pycomm_transport']}, torch gloo; commit {result['git_commit'][:10]}")
    print(f"{'bucket MiB':>10} {'buckets':>7} {'compute ms':>12} {'torch ms':>12} "
          f"{'pycomm ms':>12} {'speedup':>9} {'hidden':>8} {'comm ms':>10}")
    for m in ([result["compare"]] if "compare" in result else []) + result.get("sweep", []):
        print(row(m))
    if "contention" in result:
        print("# one all-reduce of the gradient bytes, caller idle vs computing meanwhile: " +
              ", ".join(f"{k} {v:.1f}" for k, v in result["contention"].items()))
    if "compare" in result:
        print(result["compare"]["stats_rank0"])


def _plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if "compare" in result:
        t = result["compare"]["step_ms"]
        axes[0].bar(list(t), list(t.values()), color=["0.6", "tab:orange", "tab:blue"])
        axes[0].set_ylabel("step time (ms, median)")
        axes[0].set_title(f"bucket cap {result['compare']['bucket_mb']:g} MiB; pycomm "
                          f"{t['torch DDP (gloo)'] / t['pycomm DDP']:.2f}x faster, "
                          f"{result['compare']['hidden_fraction']:.0%} hidden", fontsize=9)
    sweep = result.get("sweep", [])
    if sweep:
        caps = [m["bucket_mb"] for m in sweep]
        for name, color in (("torch DDP (gloo)", "tab:orange"), ("pycomm DDP", "tab:blue"),
                            ("compute only", "0.6")):
            axes[1].plot(caps, [m["step_ms"][name] for m in sweep], "o-", label=name, color=color)
        axes[1].set_xscale("log")
        axes[1].set_xlabel("bucket_cap_mb")
        axes[1].set_ylabel("step time (ms)")
        axes[1].legend()
        axes[1].set_title("bucket-size sweep", fontsize=9)
    fig.suptitle(f"{result['config']['params'] / 1e6:.1f}M-param MLP, "
                 f"{result['config']['nproc']} CPU ranks", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import tempfile

    params = sum(p.numel() for p in _model(args).parameters())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        _launch(args, out)
        with open(out) as f:
            result = json.load(f)
    import torch

    result["git_commit"] = _git_commit()
    result["config"] = {**vars(args), "params": params, "torch": torch.__version__,
                        "host": platform.node(), "cpus": os.cpu_count(),
                        "env": {k: v for k, v in os.environ.items() if k.startswith("PYCOMM_")}}
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        _plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
