"""DDP step time: the harness for every data-parallel study of pycomm.

    python benchmarks/ddp/bench.py                       # 2 CPU ranks, ~10M-parameter MLP
    python benchmarks/ddp/bench.py --variants torch-gloo,hook-allreduce --rounds 6
    python benchmarks/ddp/bench.py --width 512 --steps 5  # reduced size (busy machine)

The script spawns its own ranks (``--nproc``, default 2). Each rank builds one
model per variant from the same seed, wraps it with the variant's function,
and trains it on fixed data: SGD steps of forward, backward (the gradient
all-reduce runs inside it), optimizer step. Variants take turns: every round
runs ``--warmup`` untimed then ``--steps`` timed steps of each variant in
turn, so machine noise hits all of them alike. A step's time is the slowest
rank's; the table shows each variant's median over all rounds and its speedup
over ``torch-gloo`` (torch DDP on gloo without a hook, the default a user
has). Results go to JSON (with the git commit) and a PNG.

Adding a variant is a few lines::

    @variant("my-ddp")
    def _my_ddp(model: nn.Module, env: Env) -> nn.Module:
        return pycomm.parallel.DistributedDataParallel(model, env.comm)

The function gets a fresh model (same initial parameters for every variant)
and the rank's environment (torch's default gloo group ``env.pg``, a pycomm
communicator ``env.comm`` over shm, the store, ranks, ``bucket_cap_mb``) and
returns the module to train: ``loss = mse(m(x), y); loss.backward();
opt.step()`` must do one data-parallel step with it.
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
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import pycomm  # noqa: E402
from pycomm import hooks  # noqa: E402

BASELINE = "torch-gloo"


# ---------------------------------------------------------------- variants

@dataclass
class Env:
    """What a variant may use on its rank."""

    rank: int
    world_size: int
    store: Any                   # the run's c10d store (prefix your keys)
    pg: dist.ProcessGroup        # torch's default group (gloo)
    comm: pycomm.Communicator    # pycomm over shm, on the same ranks
    bucket_cap_mb: float


Wrap = Callable[[nn.Module, Env], nn.Module]
VARIANTS: dict[str, Wrap] = {}
DEFAULT_VARIANTS: list[str] = []  # what a run without --variants measures


def variant(name: str, default: bool = True) -> Callable[[Wrap], Wrap]:
    """Registers ``fn(model, env) -> module to train`` under ``name``;
    ``default=False`` for diagnostics that run only when named."""
    def register(fn: Wrap) -> Wrap:
        if name in VARIANTS:
            raise ValueError(f"variant {name!r} is registered twice")
        VARIANTS[name] = fn
        if default:
            DEFAULT_VARIANTS.append(name)
        return fn
    return register


def _torch_ddp(model: nn.Module, env: Env, **kwargs: Any) -> nn.parallel.DistributedDataParallel:
    return nn.parallel.DistributedDataParallel(model, process_group=env.pg,
                                               bucket_cap_mb=env.bucket_cap_mb, **kwargs)


def _torch_ddp_with(hook: Callable[..., Any], state: Callable[[Env], Any] = lambda env: env.comm,
                    **kwargs: Any) -> Wrap:
    """torch DDP (with DDP ``kwargs``) whose buckets go through ``hook``."""
    def wrap(model: nn.Module, env: Env) -> nn.Module:
        ddp = _torch_ddp(model, env, **kwargs)
        ddp.register_comm_hook(state(env), hook)
        return ddp
    return wrap


def _unreduced(state, bucket):  # type: ignore[no-untyped-def]
    """A hook that returns the bucket as it is: DDP's own cost without traffic.
    (Unannotated: DDP compares annotations, which are strings in this module.)"""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


variant(BASELINE)(_torch_ddp)
variant("hook-allreduce")(_torch_ddp_with(hooks.allreduce_hook))
variant("hook-ring-fp16")(_torch_ddp_with(hooks.ring_fp16_hook))
variant("hook-fp16")(_torch_ddp_with(hooks.fp16_compress_hook))
# Diagnostics (not data parallel, or not DDP's defaults): run when named.
variant("compute-only", default=False)(lambda model, env: model)  # no DDP at all: the floor
variant("ddp-no-comm", default=False)(_torch_ddp_with(_unreduced, state=lambda env: None))
variant("torch-gloo-view", default=False)(
    lambda model, env: _torch_ddp(model, env, gradient_as_bucket_view=True))
variant("hook-allreduce-view", default=False)(
    _torch_ddp_with(hooks.allreduce_hook, gradient_as_bucket_view=True))


# ---------------------------------------------------------------- one rank

def make_model(width: int, depth: int, inputs: int, outputs: int) -> nn.Module:
    """The MLP: inputs -> depth x (width, ReLU) -> outputs (same seed every time)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    d = inputs
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, outputs))
    return nn.Sequential(*layers)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=False)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def run_rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> dict:
    """Trains every variant in turn; returns {variant: [step seconds, ...]}."""
    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world_size)
    comm = pycomm.init(group=dist.group.WORLD, transport="shm")
    env = Env(rank, world_size, store, dist.group.WORLD, comm, args.bucket_cap_mb)
    g = torch.Generator().manual_seed(1 + rank)  # fixed data, this rank's shard
    x = torch.randn(args.batch, args.inputs, generator=g)
    y = torch.randn(args.batch, args.outputs, generator=g)
    trained = {}
    for name in args.variants:
        module = VARIANTS[name](make_model(args.width, args.depth, args.inputs, args.outputs), env)
        trained[name] = (module, torch.optim.SGD(module.parameters(), lr=1e-3))
    times: dict[str, list[float]] = {name: [] for name in args.variants}
    for _ in range(args.rounds):
        for name, (module, opt) in trained.items():
            for _ in range(args.warmup):
                _step(module, opt, x, y)
            for _ in range(args.steps):
                dist.barrier()  # start together: a step is timed from a common point
                t0 = time.perf_counter()
                _step(module, opt, x, y)
                times[name].append(time.perf_counter() - t0)
    comm.close()
    dist.destroy_process_group()
    return times


def _child(rank: int, world_size: int, port: int, args: argparse.Namespace, conn: Any) -> None:
    try:
        conn.send(("ok", run_rank(rank, world_size, port, args)))
    except BaseException:
        conn.send(("err", traceback.format_exc()))


def launch(args: argparse.Namespace) -> list[dict]:
    """Spawns the ranks; returns their results (raises with a rank's traceback)."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, args.nproc, True, timeout=timedelta(seconds=120),
                          wait_for_workers=False)
    conns, procs = [], []
    for r in range(args.nproc):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_child, args=(r, args.nproc, store.port, args, child))
        p.start()
        conns.append(parent)
        procs.append(p)
    results = []
    try:
        for r, c in enumerate(conns):
            if not c.poll(args.timeout):
                raise TimeoutError(f"rank {r} did not finish within {args.timeout} s")
            status, value = c.recv()
            if status != "ok":
                raise RuntimeError(f"rank {r} failed:\n{value}")
            results.append(value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return results


# ---------------------------------------------------------------- report

def summarize(per_rank: list[dict], names: list[str]) -> list[dict]:
    """A step's time is the slowest rank's; median and quartiles per variant."""
    rows = []
    for name in names:
        steps = [max(ts) for ts in zip(*(r[name] for r in per_rank))]
        q = statistics.quantiles(steps, n=4) if len(steps) >= 2 else [steps[0]] * 3
        rows.append({"variant": name, "median_ms": 1e3 * statistics.median(steps),
                     "p25_ms": 1e3 * q[0], "p75_ms": 1e3 * q[2], "steps": len(steps)})
    base = next((r["median_ms"] for r in rows if r["variant"] == BASELINE), None)
    for r in rows:
        r["speedup_vs_" + BASELINE] = base / r["median_ms"] if base else None
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'variant':<20} {'step ms':>9} {'p25':>9} {'p75':>9} {'speedup vs ' + BASELINE:>22}"]
    for r in rows:
        s = r["speedup_vs_" + BASELINE]
        lines.append(f"{r['variant']:<20} {r['median_ms']:9.2f} {r['p25_ms']:9.2f} "
                     f"{r['p75_ms']:9.2f} {(f'{s:.2f}x' if s else '-'):>22}")
    return "\n".join(lines)


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "csrc",
                                "pycomm", "benchmarks/ddp"], capture_output=True, text=True).stdout
        return sha + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def plot(rows: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(rows), 4))
    names = [r["variant"] for r in rows]
    med = [r["median_ms"] for r in rows]
    err = [[m - r["p25_ms"] for m, r in zip(med, rows)], [r["p75_ms"] - m for m, r in zip(med, rows)]]
    bars = ax.bar(names, med, yerr=err, capsize=4,
                  color=["#888888" if n == BASELINE else "#3070b0" for n in names])
    for b, r in zip(bars, rows):
        s = r["speedup_vs_" + BASELINE]
        if s:
            ax.annotate(f"{s:.2f}x", (b.get_x() + b.get_width() / 2, r["p75_ms"]),
                        ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")
    ax.set_ylabel("step time, ms (median, p25-p75)")
    ax.set_title(f"DDP step, {meta['params'] / 1e6:.1f}M-param MLP, {meta['nproc']} CPU ranks",
                 fontsize=10)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, from: {', '.join(VARIANTS)} (default: "
                        f"{', '.join(DEFAULT_VARIANTS)})")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--width", type=int, default=2048, help="hidden width")
    p.add_argument("--depth", type=int, default=3, help="hidden layers")
    p.add_argument("--inputs", type=int, default=1024)
    p.add_argument("--outputs", type=int, default=16)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's default: 25")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant and round")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=str(Path(__file__).with_name("results_cpu_2ranks.json")))
    p.add_argument("--plot", default=str(Path(__file__).with_name("step_time_cpu_2ranks.png")))
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; registered: {list(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    params = sum(p.numel() for p in make_model(args.width, args.depth, args.inputs,
                                               args.outputs).parameters())
    meta = {"commit": git_commit(), "torch": torch.__version__, "host": platform.node(),
            "cpus": os.cpu_count(), "nproc": args.nproc, "params": params,
            "args": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(f"# DDP step time: {params / 1e6:.2f}M-parameter MLP ({args.depth} x {args.width}), "
          f"{args.nproc} CPU ranks x {args.threads} thread(s), batch {args.batch}/rank, "
          f"bucket_cap_mb {args.bucket_cap_mb}, {args.rounds} rounds x {args.steps} steps "
          f"(+{args.warmup} warmup); commit {meta['commit'][:12]}", flush=True)
    rows = summarize(launch(args), args.variants)
    print(format_table(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    if args.plot:
        plot(rows, meta, args.plot)
    print(f"# wrote {args.json} and {args.plot}", flush=True)
    return rows


if __name__ == "__main__":
    main()
