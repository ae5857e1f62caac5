"""Unmodified torch DDP on backend="pycomm" vs backend="gloo", side by side.

    python benchmarks/ddp/bench_backend.py                  # 2 CPU ranks, ~10 M-parameter MLP
    python benchmarks/ddp/bench_backend.py --scale 0.25 --steps 5 --rounds 2   # quick run

Launches its own ranks (spawned processes, one TCPStore). Every rank builds
one process group per variant over the same ranks (the default group is
gloo; ``dist.new_group(backend="pycomm", pg_options=...)`` the others), and
identical models wrapped in torch's own ``DistributedDataParallel`` (default buckets),
one per group. Rounds alternate between the backends so both see the same
machine state; each round times ``--steps`` SGD steps after ``--warmup``.
Step time = the slowest rank's time per step in that round; the table gives
the median over rounds and the ratio gloo / variant (> 1: faster than gloo).
``--variants`` adds pycomm groups with other options (algo="ring", pycomm's
ring over the gloo transport). All models train on the same data for the same
number of steps, so their final parameters must agree (max |diff| is printed:
a correctness check).

Writes JSON (config, per-round times, git commit) and a PNG bar chart.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
# Variants: the process group each DDP model runs on. "gloo" is torch's own
# (the default group); the others are pycomm groups with these pg_options.
VARIANTS: dict[str, dict[str, Any] | None] = {
    "gloo": None,
    "pycomm": {},                     # defaults: transport and algo "auto"
    "pycomm-ring": {"algo": "ring"},  # all-reduce forced to the ring
    "pycomm-gloo": {"transport": "gloo"},  # pycomm's ring over torch's Gloo p2p
}
# 1024 -> 2048 -> 2048 -> 1024 -> 1024 -> 10: 9.45 M parameters at scale 1.
WIDTHS = (1024, 2048, 2048, 1024, 1024)


def mlp(scale: float) -> torch.nn.Sequential:
    """The benchmark model (seeded): Linear + ReLU stack, widths x scale."""
    torch.manual_seed(0)
    widths = [max(8, int(w * scale)) for w in WIDTHS] + [10]
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _timed_round(ddp: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    """Seconds for `steps` SGD steps of `ddp` on this rank."""
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return time.perf_counter() - t0


def _rank(rank: int, world: int, port: int, args: dict, conn: Any) -> None:
    try:
        torch.set_num_threads(args["threads"])
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        import pycomm  # noqa: F401  (registers backend="pycomm")

        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        variants = args["variants"]
        groups = {b: dist.group.WORLD if VARIANTS[b] is None else
                  dist.new_group(backend="pycomm", pg_options=pycomm.backend.Options(**VARIANTS[b]))
                  for b in variants}
        models = {b: mlp(args["scale"]) for b in variants}
        ddps = {b: DDP(models[b], process_group=groups[b]) for b in variants}
        opts = {b: torch.optim.SGD(models[b].parameters(), lr=0.01) for b in variants}
        g = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(args["batch"], models["gloo"][0].in_features, generator=g)
        y = torch.randint(0, 10, (args["batch"],), generator=g)
        for b in variants:
            _timed_round(ddps[b], opts[b], x, y, args["warmup"])
        times: dict[str, list[float]] = {b: [] for b in variants}
        for rnd in range(args["rounds"]):
            order = variants if rnd % 2 == 0 else variants[::-1]
            for b in order:
                dist.barrier()
                sec = torch.tensor([_timed_round(ddps[b], opts[b], x, y, args["steps"])])
                dist.all_reduce(sec, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
                times[b].append(sec.item() / args["steps"])
        diff = max((p - q).abs().max().item() for b in variants
                   for p, q in zip(models["gloo"].parameters(), models[b].parameters()))
        n_params = sum(p.numel() for p in models["gloo"].parameters())
        dist.destroy_process_group()
        conn.send(("ok", {"times": times, "max_param_diff": diff, "params": n_params}))
    except BaseException:
        conn.send(("err", traceback.format_exc()))


def run(args: dict) -> dict:
    """Launches the ranks; returns rank 0's measurements."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, args["nproc"], True, timeout=timedelta(seconds=120),
                          wait_for_workers=False)
    conns, procs = [], []
    for r in range(args["nproc"]):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_rank, args=(r, args["nproc"], store.port, args, child))
        p.start()
        conns.append(parent)
        procs.append(p)
    results = []
    for r, c in enumerate(conns):
        status, value = c.recv()
        if status != "ok":
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {r} failed:\n{value}")
        results.append(value)
    for p in procs:
        p.join(timeout=60)
    return results[0]


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, check=True).stdout.strip()
        return out or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(res: dict, args: dict) -> str:
    med = {b: statistics.median(res["times"][b]) for b in args["variants"]}
    lines = [f"# DDP step time, {args['nproc']} CPU ranks, MLP {res['params'] / 1e6:.2f} M params, "
             f"batch {args['batch']}/rank, {args['rounds']} rounds x {args['steps']} steps",
             f"{'variant':>12} {'step(ms)':>10} {'samples/s':>10} {'vs gloo':>8}"]
    for b in args["variants"]:
        sps = args["batch"] * args["nproc"] / med[b]
        lines.append(f"{b:>12} {med[b] * 1e3:10.1f} {sps:10.0f} {med['gloo'] / med[b]:7.2f}x")
    lines.append(f"# max |param diff| vs gloo after training: {res['max_param_diff']:.3g}")
    return "\n".join(lines)


def plot(res: dict, args: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = args["variants"]
    med = [statistics.median(res["times"][b]) * 1e3 for b in names]
    gloo = med[names.index("gloo")]
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 1.5, 3.2))
    ax.bar(names, med, color=["#999999" if b == "gloo" else "#1f77b4" for b in names])
    for i, m in enumerate(med):
        ax.text(i, m, f"{m:.0f} ms\n{gloo / m:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("DDP step time (ms)")
    ax.set_ylim(0, max(med) * 1.25)
    ax.set_title(f"torch DDP, {args['nproc']} CPU ranks, {res['params'] / 1e6:.1f} M params",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--scale", type=float, default=1.0, help="widths x scale (1: ~10 M params)")
    p.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=4, help="rounds, alternating the backends")
    p.add_argument("--variants", default="gloo,pycomm",
                   help=f"comma-separated, from {', '.join(VARIANTS)} (gloo is required)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=str(Path(__file__).with_name("results_backend.json")))
    p.add_argument("--plot", default=str(Path(__file__).with_name("backend_vs_gloo.png")))
    args = vars(p.parse_args(argv))
    args["variants"] = [v for v in args["variants"].split(",") if v]
    unknown = [v for v in args["variants"] if v not in VARIANTS]
    if unknown or "gloo" not in args["variants"]:
        p.error(f"--variants: unknown {unknown} or no gloo; choose from {list(VARIANTS)}")
    os.environ.setdefault("OMP_NUM_THREADS", str(args["threads"]))
    res = run(args)
    text = table(res, args)
    print(text)
    out = {"git_commit": _git_commit(), "config": args, "table": text, **res}
    Path(args["json"]).write_text(json.dumps(out, indent=1))
    plot(res, args, args["plot"])
    print(f"# wrote {args['json']} and {args['plot']}")


if __name__ == "__main__":
    sys.exit(main())
