"""DDP step time: the one harness for pycomm's data-parallel studies.

    python benchmarks/ddp/bench.py                     # headline: 2 CPU ranks, ~10M-parameter MLP
    python benchmarks/ddp/bench.py --mode compare,sweep,contention
    python benchmarks/ddp/bench.py --variants torch-gloo,hook-allreduce --rounds 6
    python benchmarks/ddp/bench.py --width 512 --steps 5  # reduced size (busy machine)

The script spawns its own ranks (``--nproc``, default 2). Each rank builds one
model per variant from the same seed, wraps it with the variant's function,
and trains it on fixed data: SGD steps of forward, backward (the gradient
all-reduce runs inside it), optimizer step. Variants take turns: every round
runs ``--warmup`` untimed then ``--steps`` timed steps of each variant in
turn, so machine noise hits all of them alike. A step's time is the slowest
rank's; the table shows each variant's median over all rounds, its speedup
over ``torch-gloo`` (torch DDP on gloo without a hook, the default a user
has), pycomm DDP's communication time per step and the share of it hidden
behind backward (``ddp.stats()``), and the largest difference of its trained
parameters from ``torch-gloo``'s (every variant trains on the same data for
the same steps, so an exact variant must match). Results go to JSON (with the
git commit, the configuration and every step time) and one PNG.

Modes (``--mode``, comma-separated): ``compare`` (default: ``--variants`` at
``--bucket-cap-mb``), ``sweep`` (``--sweep-variants`` at each of the
``--sweep`` bucket caps, one interleaved set per cap) and ``contention`` (one
all-reduce of the model's gradient bytes, pycomm (on shm also from symmetric
memory, as allreduce_hook reduces DDP's buckets) and torch gloo, with the
calling process idle and with its main thread computing small matmuls
meanwhile, as during an overlapped backward).

Adding a variant is a few lines::

    @variant("my-ddp")
    def _my_ddp(model: nn.Module, env: Env) -> nn.Module:
        return pycomm.parallel.DistributedDataParallel(model, env.comm)

The function gets a fresh model (same initial parameters for every variant)
and the rank's environment (torch's default gloo group ``env.pg``, a pycomm
communicator ``env.comm``, the store, ranks, ``bucket_cap_mb``) and returns
the module to train: ``loss = mse(m(x), y); loss.backward(); opt.step()``
must do one data-parallel step with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import threading
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

import pycomm  # noqa: E402  (also registers backend="pycomm")
from pycomm import hooks  # noqa: E402
from pycomm.bench.cli import require_module  # noqa: E402
from pycomm.bench.report import git_commit  # noqa: E402
from pycomm.parallel import DistributedDataParallel as PycommDDP  # noqa: E402

BASELINE = "torch-gloo"
MODES = ("compare", "sweep", "contention")
# Trained parameters of an exact variant must match torch-gloo's this closely
# (fp32 sums of the same gradients; only the summation order may differ).
EXACT_TOL = 1e-4


# ---------------------------------------------------------------- variants

@dataclass
class Env:
    """What a variant may use on its rank."""

    rank: int
    world_size: int
    store: Any                   # the run's c10d store (prefix your keys)
    pg: dist.ProcessGroup        # torch's default group (gloo)
    comm: pycomm.Communicator    # pycomm (--transport) on the same ranks
    bucket_cap_mb: float


Wrap = Callable[[nn.Module, Env], nn.Module]
VARIANTS: dict[str, Wrap] = {}
DEFAULT_VARIANTS: list[str] = []  # what a run without --variants measures
EXACT: set[str] = set()           # variants whose parameters must equal torch-gloo's


def variant(name: str, default: bool = True, exact: bool = False) -> Callable[[Wrap], Wrap]:
    """Registers ``fn(model, env) -> module to train`` under ``name``;
    ``default=False`` for diagnostics that run only when named; ``exact=True``
    when its trained parameters must equal ``torch-gloo``'s (checked)."""
    def register(fn: Wrap) -> Wrap:
        if name in VARIANTS:
            raise ValueError(f"variant {name!r} is registered twice")
        VARIANTS[name] = fn
        if default:
            DEFAULT_VARIANTS.append(name)
        if exact:
            EXACT.add(name)
        return fn
    return register


def _torch_ddp(model: nn.Module, env: Env, group: Any = None,
               **kwargs: Any) -> nn.parallel.DistributedDataParallel:
    """torch DDP on ``group`` (default: torch's gloo group) at the run's bucket cap."""
    return nn.parallel.DistributedDataParallel(model, process_group=group or env.pg,
                                               bucket_cap_mb=env.bucket_cap_mb, **kwargs)


def _torch_ddp_with(hook: Callable[..., Any], state: Callable[[Env], Any] = lambda env: env.comm,
                    **kwargs: Any) -> Wrap:
    """torch DDP (with DDP ``kwargs``) whose buckets go through ``hook``."""
    def wrap(model: nn.Module, env: Env) -> nn.Module:
        ddp = _torch_ddp(model, env, **kwargs)
        ddp.register_comm_hook(state(env), hook)
        return ddp
    return wrap


def _torch_ddp_on_pycomm(**options: Any) -> Wrap:
    """Unmodified torch DDP on a ``backend="pycomm"`` group with these
    ``pycomm.backend.Options`` (a new group over all ranks: every rank builds
    the variants in the same order, so ``new_group`` matches up)."""
    def wrap(model: nn.Module, env: Env) -> nn.Module:
        group = dist.new_group(backend="pycomm", pg_options=pycomm.backend.Options(**options))
        return _torch_ddp(model, env, group=group)
    return wrap


def _unreduced(state, bucket):  # type: ignore[no-untyped-def]
    """A hook that returns the bucket as it is: DDP's own cost without traffic.
    (Unannotated: DDP compares annotations, which are strings in this module.)"""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class _OnePass:
    """State of :func:`_one_pass`: one thread that scales each bucket in place
    by 1/world_size and completes its future, as a communicator's worker
    would. That is the least an in-place all-reduce costs a rank (read and
    write every gradient once, off the autograd thread) without any of the
    exchange between ranks: the floor of ``hook-allreduce`` on this machine."""

    def __init__(self, world_size: int) -> None:
        self.scale = 1.0 / world_size
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="one-pass", daemon=True).start()

    def _run(self) -> None:
        while True:
            buffer, fut = self.queue.get()
            fut.set_result(buffer.mul_(self.scale))  # mul_ runs without the GIL


def _one_pass(state, bucket):  # type: ignore[no-untyped-def]
    """A hook that hands the bucket to ``state``'s thread (see _OnePass)."""
    fut: torch.futures.Future = torch.futures.Future()
    state.queue.put((bucket.buffer(), fut))
    return fut


variant(BASELINE, exact=True)(_torch_ddp)
variant("hook-allreduce", exact=True)(_torch_ddp_with(hooks.allreduce_hook))
variant("hook-ring-fp16")(_torch_ddp_with(hooks.ring_fp16_hook))
variant("pycomm-ddp", exact=True)(
    lambda model, env: PycommDDP(model, env.comm, bucket_cap_mb=env.bucket_cap_mb))
variant("backend-pycomm", exact=True)(_torch_ddp_on_pycomm())  # transport, algo "auto"
# The same with Options(register=True): DDP's buckets move into symmetric memory.
variant("backend-pycomm-symmetric", exact=True)(_torch_ddp_on_pycomm(register=True))
# Diagnostics (not data parallel, or not the defaults): run when named.
variant("hook-fp16", default=False)(_torch_ddp_with(hooks.fp16_compress_hook))
variant("backend-pycomm-ring", default=False, exact=True)(_torch_ddp_on_pycomm(algo="ring"))
variant("backend-pycomm-gloo", default=False, exact=True)(  # pycomm's ring over Gloo p2p
    _torch_ddp_on_pycomm(transport="gloo"))
variant("compute-only", default=False)(lambda model, env: model)  # no DDP at all: the floor
variant("ddp-no-comm", default=False)(_torch_ddp_with(_unreduced, state=lambda env: None))
variant("ddp-one-pass", default=False)(
    _torch_ddp_with(_one_pass, state=lambda env: _OnePass(env.world_size)))
variant("torch-gloo-view", default=False, exact=True)(
    lambda model, env: _torch_ddp(model, env, gradient_as_bucket_view=True))
variant("hook-allreduce-view", default=False, exact=True)(
    _torch_ddp_with(hooks.allreduce_hook, gradient_as_bucket_view=True))
variant("pycomm-ddp-copy", default=False, exact=True)(  # pycomm-ddp with grads of their own
    lambda model, env: PycommDDP(model, env.comm, bucket_cap_mb=env.bucket_cap_mb,
                                 gradient_as_bucket_view=False))


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


def _model(args: argparse.Namespace) -> nn.Module:
    return make_model(args.width, args.depth, args.inputs, args.outputs)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=False)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _last_iteration(module: nn.Module) -> int:
    its = module.stats().iterations
    return its[-1].iteration if its else -1


def _run_phase(env: Env, names: list[str], args: argparse.Namespace, x: torch.Tensor,
               y: torch.Tensor) -> dict:
    """Trains ``names`` in turn at ``env.bucket_cap_mb``: per variant the step
    times by round, pycomm DDP's comm totals over the timed steps, and the
    largest parameter difference from torch-gloo's at the end."""
    trained = {}
    for name in names:
        module = VARIANTS[name](_model(args), env)
        trained[name] = (module, torch.optim.SGD(module.parameters(), lr=1e-3))
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    comm_s = {name: [0.0, 0.0, 0] for name, (m, _) in trained.items()
              if isinstance(m, PycommDDP)}  # comm, hidden, iterations
    for _ in range(args.rounds):
        for name, (module, opt) in trained.items():
            for _ in range(args.warmup):
                _step(module, opt, x, y)
            mark = _last_iteration(module) if name in comm_s else 0
            times[name].append([])
            for _ in range(args.steps):
                dist.barrier()  # start together: a step is timed from a common point
                t0 = time.perf_counter()
                _step(module, opt, x, y)
                times[name][-1].append(time.perf_counter() - t0)
            if name in comm_s:
                for it in module.stats().iterations:
                    if it.iteration > mark:
                        acc = comm_s[name]
                        acc[0] += it.comm_s
                        acc[1] += it.hidden_s
                        acc[2] += 1
    diff: dict[str, float] = {}
    if BASELINE in trained:
        base = list(trained[BASELINE][0].parameters())
        for name, (module, _) in trained.items():
            diff[name] = max((p - q).abs().max().item()
                             for p, q in zip(base, module.parameters()))
    return {"bucket_mb": env.bucket_cap_mb, "times": times, "param_diff": diff,
            "comm": {k: {"comm_s": c, "hidden_s": h, "iterations": n}
                     for k, (c, h, n) in comm_s.items()}}


def _contention(env: Env, args: argparse.Namespace, numel: int) -> dict:
    """Times of one all-reduce of ``numel`` floats, pycomm and torch gloo,
    idle and while this rank's main thread computes small matmuls (an
    overlapped backward), by round. On shm also ``pycomm-symmetric``: the same
    all-reduce of a tensor in symmetric memory (Communicator.register_tensor,
    as allreduce_hook does with DDP's buckets)."""
    a = torch.randn(200, 200)  # < 1 ms a matmul: the loop notices completion quickly
    tensors = {"pycomm": torch.ones(numel)}
    sym = torch.ones(numel)
    if env.comm.transport == "shm" and env.comm.register_tensor(sym):
        tensors["pycomm-symmetric"] = sym
    tensors["torch"] = torch.ones(numel)
    out: dict[str, list[list[float]]] = {}
    for name, t in tensors.items():
        for busy in (False, True):
            rounds = []
            for _ in range(args.rounds):
                times = []
                for _ in range(args.steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    if name == "torch":
                        work = dist.all_reduce(t, async_op=True)
                    else:
                        work = env.comm.all_reduce(t, op="avg", async_op=True)
                    while busy and not work.is_completed():
                        a @ a
                    work.wait()
                    times.append(time.perf_counter() - t0)
                rounds.append(times)
            out[f"{name} {'busy' if busy else 'idle'}"] = rounds
    return out


def _phases(args: argparse.Namespace) -> list[tuple[str, list[str], float]]:
    """(phase, variants, bucket cap) in the order they run."""
    phases = []
    if "compare" in args.mode:
        phases.append(("compare", args.variants, args.bucket_cap_mb))
    if "sweep" in args.mode:
        phases += [("sweep", args.sweep_variants, cap) for cap in args.sweep]
    return phases


def run_rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> dict:
    """Runs every phase of ``args.mode`` on this rank; returns its raw times."""
    if args.pin:  # before torch and pycomm start threads: they inherit it
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world_size)
    comm = pycomm.init(group=dist.group.WORLD, transport=args.transport)
    env = Env(rank, world_size, store, dist.group.WORLD, comm, args.bucket_cap_mb)
    g = torch.Generator().manual_seed(1 + rank)  # fixed data, this rank's shard
    x = torch.randn(args.batch, args.inputs, generator=g)
    y = torch.randn(args.batch, args.outputs, generator=g)
    out: dict[str, Any] = {"transport": comm.transport, "cpus": sorted(os.sched_getaffinity(0)),
                           "phases": []}
    for phase, names, cap in _phases(args):
        result = _run_phase(dataclasses.replace(env, bucket_cap_mb=cap), names, args, x, y)
        out["phases"].append({"phase": phase, **result})
    if "contention" in args.mode:
        out["contention"] = _contention(env, args, sum(p.numel() for p in _model(args).parameters()))
    comm.close()
    dist.destroy_process_group()
    return out


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

def _slowest(per_rank: list[list[list[float]]]) -> list[list[float]]:
    """Per round and step, the slowest rank's time (ms)."""
    return [[1e3 * max(ts) for ts in zip(*rounds)] for rounds in zip(*per_rank)]


def _row(phase: str, name: str, bucket_mb: float | None, rounds: list[list[float]]) -> dict:
    steps = [t for r in rounds for t in r]
    q = (statistics.quantiles(steps, n=4, method="inclusive") if len(steps) >= 2
         else [steps[0]] * 3)
    return {"phase": phase, "variant": name, "bucket_mb": bucket_mb,
            "median_ms": statistics.median(steps), "p25_ms": q[0], "p75_ms": q[2],
            "steps": len(steps), "times_ms": rounds}


def summarize(per_rank: list[dict]) -> list[dict]:
    """One row per (phase, bucket cap, variant) and contention case: the
    slowest rank per step, median and quartiles over all timed steps, speedup
    over torch-gloo in the same phase and cap (contention: over torch gloo in
    the same condition), pycomm DDP's comm ms per step and hidden fraction
    (the worst rank's), the largest parameter difference from torch-gloo."""
    rows = []
    for i, ph in enumerate(per_rank[0]["phases"]):
        ranks = [r["phases"][i] for r in per_rank]
        group = []
        for name in ph["times"]:
            row = _row(ph["phase"], name, ph["bucket_mb"], _slowest([r["times"][name] for r in ranks]))
            if name in ph["comm"]:
                c = [r["comm"][name] for r in ranks]
                row["comm_ms"] = max(1e3 * x["comm_s"] / max(x["iterations"], 1) for x in c)
                row["hidden_fraction"] = min(x["hidden_s"] / x["comm_s"] if x["comm_s"] else 0.0
                                             for x in c)
            if name in ph["param_diff"]:
                row["max_param_diff"] = max(r["param_diff"][name] for r in ranks)
                row["exact"] = name in EXACT
            group.append(row)
        base = next((r["median_ms"] for r in group if r["variant"] == BASELINE), None)
        for r in group:
            r["speedup_vs_" + BASELINE] = base / r["median_ms"] if base else None
        rows += group
    if "contention" in per_rank[0]:
        cases = per_rank[0]["contention"]
        group = [_row("contention", name, None, _slowest([r["contention"][name] for r in per_rank]))
                 for name in cases]
        by_name = {r["variant"]: r for r in group}
        for r in group:
            peer = by_name["torch " + r["variant"].split()[1]]
            r["speedup_vs_" + BASELINE] = peer["median_ms"] / r["median_ms"]
        rows += group
    return rows


def param_mismatches(rows: list[dict]) -> list[dict]:
    """Rows of exact variants whose parameters drifted from torch-gloo's."""
    return [r for r in rows if r.get("exact") and r["max_param_diff"] > EXACT_TOL]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    head = (f"{'phase':<10} {'variant':<24} {'bucket MB':>9} {'step ms':>9} {'p25':>8} "
            f"{'p75':>8} {'vs ' + BASELINE:>13} {'hidden':>7} {'comm ms':>8} {'max|dparam|':>12}")
    lines = [head]
    for r in rows:
        s = r["speedup_vs_" + BASELINE]
        flag = " !" if r in param_mismatches([r]) else ""
        lines.append(
            f"{r['phase']:<10} {r['variant']:<24} {_fmt(r['bucket_mb'], 'g'):>9} "
            f"{r['median_ms']:9.2f} {r['p25_ms']:8.2f} {r['p75_ms']:8.2f} "
            f"{(f'{s:.2f}x' if s else '-'):>13} {_fmt(r.get('hidden_fraction'), '.0%'):>7} "
            f"{_fmt(r.get('comm_ms'), '.1f'):>8} {_fmt(r.get('max_param_diff'), '.2g'):>12}{flag}")
    return "\n".join(lines)


def _bars(ax: Any, rows: list[dict], ylabel: str) -> None:
    """Median bars with p25-p75 whiskers and the speedup above each."""
    names = [r["variant"] for r in rows]
    med = [r["median_ms"] for r in rows]
    err = [[m - r["p25_ms"] for m, r in zip(med, rows)], [r["p75_ms"] - m for m, r in zip(med, rows)]]
    bars = ax.bar(names, med, yerr=err, capsize=4,
                  color=["#888888" if n.startswith(("torch", BASELINE)) else "#3070b0"
                         for n in names])
    for b, r in zip(bars, rows):
        s = r["speedup_vs_" + BASELINE]
        if s:
            ax.annotate(f"{s:.2f}x", (b.get_x() + b.get_width() / 2, r["p75_ms"]),
                        ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.15 * max(r["p75_ms"] for r in rows))  # room for the labels
    for label in ax.get_xticklabels():
        label.set_rotation(20)
        label.set_ha("right")


def plot(rows: list[dict], meta: dict, path: str) -> None:
    """One PNG: compare bars, the sweep's step time per cap, contention bars
    (the panels of the modes that ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_phase = {p: [r for r in rows if r["phase"] == p] for p in MODES}
    panels = [p for p in MODES if by_phase[p]]
    widths = [max(4.0, 0.8 * len(by_phase[p])) if p != "sweep" else 4.5 for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(1.5 + sum(widths), 4.4), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    for ax, phase in zip(axes[0], panels):
        if phase == "compare":
            _bars(ax, by_phase[phase], "step time, ms (median, p25-p75)")
            ax.set_title(f"bucket cap {by_phase[phase][0]['bucket_mb']:g} MB", fontsize=9)
        elif phase == "sweep":
            for name in dict.fromkeys(r["variant"] for r in by_phase[phase]):
                pts = [r for r in by_phase[phase] if r["variant"] == name]
                ax.errorbar([r["bucket_mb"] for r in pts], [r["median_ms"] for r in pts],
                            yerr=[[r["median_ms"] - r["p25_ms"] for r in pts],
                                  [r["p75_ms"] - r["median_ms"] for r in pts]],
                            marker="o", capsize=3, label=name)
            ax.set_xscale("log")
            ax.set_xlabel("bucket_cap_mb")
            ax.set_ylabel("step time, ms (median, p25-p75)")
            ax.legend(fontsize=8)
            ax.set_title("bucket-size sweep", fontsize=9)
        else:
            _bars(ax, by_phase[phase], "one all-reduce, ms (median, p25-p75)")
            ax.set_title("all-reduce of the gradient bytes: caller idle / computing", fontsize=9)
    fig.suptitle(f"DDP step, {meta['params'] / 1e6:.1f}M-param MLP, {meta['nproc']} CPU ranks, "
                 f"pycomm on {meta['transport']}; commit {meta['commit'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _csv(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="compare", help=f"comma-separated, from: {', '.join(MODES)}")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"compare mode; comma-separated, from: {', '.join(VARIANTS)} (default: "
                        f"{', '.join(DEFAULT_VARIANTS)})")
    p.add_argument("--sweep", default="1,5,25,100", help="sweep mode: bucket caps in MB")
    p.add_argument("--sweep-variants", default=f"{BASELINE},pycomm-ddp",
                   help="sweep mode: the variants run at every cap")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--width", type=int, default=2048, help="hidden width")
    p.add_argument("--depth", type=int, default=3, help="hidden layers")
    p.add_argument("--inputs", type=int, default=1024)
    p.add_argument("--outputs", type=int, default=16)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's default: 25")
    p.add_argument("--transport", default="shm", choices=("auto", "shm", "gloo"),
                   help="of the pycomm communicator the hooks and pycomm-ddp use")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--pin", action="store_true",
                   help="bind each rank (all its threads) to one CPU: rank r to the r-th allowed CPU")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant and round")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=str(Path(__file__).with_name("results_cpu_2ranks.json")))
    p.add_argument("--plot", default=str(Path(__file__).with_name("step_time_cpu_2ranks.png")),
                   help="the step-time figure ('' for none)")
    args = p.parse_args(argv)
    if args.plot:
        require_module(p, "--plot", "matplotlib", "pip install matplotlib (or --plot '' for none)")
    args.mode = _csv(args.mode)
    args.variants = _csv(args.variants)
    args.sweep_variants = _csv(args.sweep_variants)
    bad_modes = [m for m in args.mode if m not in MODES]
    if bad_modes or not args.mode:
        p.error(f"--mode: unknown {bad_modes} or empty; choose from {list(MODES)}")
    for flag, names in (("--variants", args.variants), ("--sweep-variants", args.sweep_variants)):
        unknown = [v for v in names if v not in VARIANTS]
        if unknown or not names:
            p.error(f"{flag}: unknown variants {unknown} or none; registered: {list(VARIANTS)}")
    try:
        args.sweep = [float(c) for c in _csv(args.sweep)]
    except ValueError:
        p.error(f"--sweep: expected comma-separated bucket caps in MB, got {args.sweep!r}")
    if not args.sweep or min(args.sweep) <= 0 or args.bucket_cap_mb <= 0:
        p.error("--sweep and --bucket-cap-mb: bucket caps must be positive")
    for name in ("nproc", "width", "depth", "inputs", "outputs", "batch", "threads", "rounds",
                 "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup: must be >= 0, got {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # inherited by the ranks
    params = sum(p.numel() for p in _model(args).parameters())
    meta = {"commit": git_commit(["benchmarks/ddp/*.py"]), "torch": torch.__version__, "host": platform.node(),
            "cpus": os.cpu_count(), "nproc": args.nproc, "params": params,
            "args": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
            "env": {k: v for k, v in os.environ.items() if k.startswith("PYCOMM_")},
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(f"# DDP step time: {params / 1e6:.2f}M-parameter MLP ({args.depth} x {args.width}), "
          f"{args.nproc} CPU ranks x {args.threads} thread(s){' (pinned)' if args.pin else ''}, batch {args.batch}/rank, "
          f"{args.rounds} rounds x {args.steps} steps (+{args.warmup} warmup), modes "
          f"{','.join(args.mode)}; commit {meta['commit'][:12]}", flush=True)
    per_rank = launch(args)
    meta["transport"] = per_rank[0]["transport"]
    meta["rank_cpus"] = [r["cpus"] for r in per_rank]  # what each rank could run on
    rows = summarize(per_rank)
    print(format_table(rows), flush=True)
    bad = param_mismatches(rows)
    if bad:
        print(f"# ! parameters differ from {BASELINE}'s by more than {EXACT_TOL:g}: "
              f"{sorted({r['variant'] for r in bad})}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, meta, args.plot)
    print(f"# wrote {args.json} and {args.plot}", flush=True)
    return rows


if __name__ == "__main__":
    main()
