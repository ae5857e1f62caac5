"""Accuracy of compressed-gradient DDP on a real data set (issue 38 item 5).

    python benchmarks/compression/accuracy.py --worlds 2,4 --json accuracy.json

scikit-learn's bundled ``load_digits`` (1797 8x8 digits, nothing
downloaded), a 64-256-256-10 MLP trained with torch DDP on ``world`` ranks,
the same seeds, data order and epochs for every hook. What differs is the
communication hook:

    fp32       torch's own allreduce_hook on gloo (DDP's default traffic)
    bf16       pycomm.hooks.bf16_compress_hook (bf16 wire, bf16 average)
    ring_bf16  pycomm.hooks.ring_bf16_hook (bf16 wire, fp32 sums)
    int8       pycomm.hooks.int8_hook with error feedback
    int8_noef  pycomm.hooks.int8_hook without error feedback
    fp8        pycomm.hooks.fp8_hook (float8_e4m3fn) with error feedback
    fp8_noef   the same without error feedback

For each: the final test accuracy and its difference from fp32's in
percentage points, the final test loss, how far the parameters ended from
fp32's (||theta - theta_fp32|| / ||theta_fp32||), and the gradient error
against the exact average (taken in float64 over gloo, on that run's own
gradients): per step, ||hook's average - exact|| / ||exact||, and summed
over the run, ||sum of the hook's averages - sum of the exact ones|| /
||sum of the exact ones||. The summed error is what error feedback bounds:
what one step's rounding loses, a later step sends. Ranks are spawned here (torchrun's variables, shm between
them); each world prints one JSON line from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch

HOOKS = ("fp32", "bf16", "ring_bf16", "int8", "int8_noef", "fp8", "fp8_noef")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4", help="rank counts, comma-separated")
    ap.add_argument("--hooks", default=",".join(HOOKS), help="from " + ",".join(HOOKS))
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64, help="global batch (split over the ranks)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        import sklearn  # noqa: F401
    except ImportError:
        ap.error("needs scikit-learn for load_digits: pip install scikit-learn")
    args.hooks = args.hooks.split(",")
    unknown = sorted(set(args.hooks) - set(HOOKS))
    if unknown:
        ap.error(f"unknown hooks {unknown}; choose from {','.join(HOOKS)}")
    args.worlds = [int(w) for w in args.worlds.split(",")]
    if any(args.batch % w for w in args.worlds):
        ap.error(f"--batch {args.batch} must divide by every world size {args.worlds}")
    return args


def _digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fixed 80/20 split of load_digits, features scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = len(y) * 4 // 5
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


class _Errors:
    """Gradient error against the exact average: per step, and of the sums
    over the run (per bucket; a bucket rebuilt with another size restarts)."""

    def __init__(self) -> None:
        self.per_step: list[float] = []
        self.sums: dict[int, list[torch.Tensor]] = {}

    def add(self, index: int, out: torch.Tensor, exact: torch.Tensor) -> None:
        denom = exact.norm().item()
        self.per_step.append((out - exact).norm().item() / denom if denom else 0.0)
        sums = self.sums.get(index)
        if sums is None or sums[0].numel() != out.numel():
            sums = self.sums[index] = [torch.zeros_like(exact), torch.zeros_like(exact)]
        sums[0] += out
        sums[1] += exact

    def summed(self) -> float:
        diff = sum((o - e).norm().item() ** 2 for o, e in self.sums.values())
        norm = sum(e.norm().item() ** 2 for _, e in self.sums.values())
        return (diff / norm) ** 0.5 if norm else 0.0


def _measured(hook: Callable, pg: Any, errors: _Errors) -> Callable:
    """``hook`` that also records each bucket's error against the float64
    average of the same gradients (taken over gloo before the hook runs)."""
    import torch.distributed as dist

    def measured_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        exact = bucket.buffer().double()
        dist.all_reduce(exact, group=pg)
        exact /= dist.get_world_size(pg)

        def compare(fut: torch.futures.Future) -> torch.Tensor:
            out = fut.value()
            out = out[0] if isinstance(out, list) else out
            errors.add(bucket.index(), out.double(), exact)
            return out

        return hook(state, bucket).then(compare)

    # DDP checks the annotations as objects; this module's are strings.
    measured_hook.__annotations__ = {"state": Any, "bucket": dist.GradBucket,
                                     "return": torch.futures.Future[torch.Tensor]}
    return measured_hook


def _train(name: str, args: argparse.Namespace, comm: Any, pg: Any,
           fp32_params: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Trains with hook ``name``; fp32's parameters are kept in ``fp32_params``
    for the later hooks' drift."""
    import torch.distributed as dist
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as torch_hooks
    import torch.nn as nn

    from pycomm import hooks

    rank, world = comm.rank, comm.world_size
    xtr, ytr, xte, yte = _digits(args.seed)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    ddp = nn.parallel.DistributedDataParallel(model, process_group=pg)
    state, hook = {
        "fp32": (pg, torch_hooks.allreduce_hook),
        "bf16": (comm, hooks.bf16_compress_hook),
        "ring_bf16": (comm, hooks.ring_bf16_hook),
        "int8": (hooks.CompressionState(comm), hooks.int8_hook),
        "int8_noef": (hooks.CompressionState(comm, error_feedback=False), hooks.int8_hook),
        "fp8": (hooks.CompressionState(comm), hooks.fp8_hook),
        "fp8_noef": (hooks.CompressionState(comm, error_feedback=False), hooks.fp8_hook),
    }[name]
    errors = _Errors()
    ddp.register_comm_hook(state, _measured(hook, pg, errors))
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    g = torch.Generator().manual_seed(args.seed + 1)
    local = args.batch // world
    for _ in range(args.epochs):
        order = torch.randperm(len(ytr), generator=g)
        for start in range(0, len(order) - args.batch + 1, args.batch):
            idx = order[start + rank * local:start + (rank + 1) * local]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
    with torch.no_grad():
        logits = model(xte)
        acc = (logits.argmax(1) == yte).float().mean().item()
        test_loss = nn.functional.cross_entropy(logits, yte).item()
    # every rank must hold the same model (a check, not a measurement)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    spread = flat.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=pg)
    same = bool(torch.equal(spread, flat))
    if name == "fp32":
        fp32_params["flat"] = flat
    ref = fp32_params.get("flat")
    drift = (flat - ref).norm().item() / ref.norm().item() if ref is not None else None
    steps = errors.per_step
    return {"hook": name, "test_accuracy": acc, "test_loss": test_loss, "last_loss": loss.item(),
            "param_drift_vs_fp32": drift, "bucket_calls": len(steps),
            "grad_rel_error_mean": statistics.fmean(steps) if steps else 0.0,
            "grad_rel_error_max": max(steps, default=0.0),
            "summed_grad_rel_error": errors.summed(), "ranks_identical": same}


def _rank_main(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    import pycomm

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    comm = pycomm.init(group=dist.group.WORLD)
    fp32_params: dict[str, torch.Tensor] = {}
    rows = [_train(name, args, comm, dist.group.WORLD, fp32_params) for name in args.hooks]
    if comm.rank == 0:
        print(json.dumps({"world": comm.world_size, "transport": comm.transport, "rows": rows}))
    comm.close()
    dist.destroy_process_group()
    return 0


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        return None


def _table(worlds: list[dict[str, Any]]) -> str:
    lines = ["| ranks | hook | test accuracy | vs fp32 (pp) | test loss | drift from fp32 | "
             "grad error per step (mean / max) | summed grad error |",
             "|---|---|---|---|---|---|---|---|"]
    for w in worlds:
        base = next((r["test_accuracy"] for r in w["rows"] if r["hook"] == "fp32"), None)
        for r in w["rows"]:
            delta = "" if base is None else f"{100 * (r['test_accuracy'] - base):+.2f}"
            drift = "" if r["param_drift_vs_fp32"] is None else f"{r['param_drift_vs_fp32']:.2e}"
            lines.append(f"| {w['world']} | {r['hook']} | {100 * r['test_accuracy']:.2f} % | "
                         f"{delta} | {r['test_loss']:.4f} | {drift} | "
                         f"{r['grad_rel_error_mean']:.2e} / {r['grad_rel_error_max']:.2e} | "
                         f"{r['summed_grad_rel_error']:.2e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.rank_mode:
        return _rank_main(args)
    from pycomm.bench.launch import run_script

    repo = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    worlds = []
    for world in args.worlds:
        rank_argv = [__file__, "--rank-mode", "--worlds", str(world), "--hooks", ",".join(args.hooks),
                     "--epochs", str(args.epochs), "--batch", str(args.batch), "--lr", str(args.lr),
                     "--seed", str(args.seed)]
        procs = run_script(rank_argv, world, timeout=1800, env=env)
        for r, p in enumerate(procs):
            if p.returncode != 0:
                sys.stderr.write(p.stdout + p.stderr)
                raise SystemExit(f"accuracy: rank {r} of world {world} exited {p.returncode}")
        worlds.append(json.loads(procs[0].stdout.strip().splitlines()[-1]))
    print(_table(worlds))
    if args.json:
        out = {"commit": _commit(), "epochs": args.epochs, "batch": args.batch, "lr": args.lr,
               "seed": args.seed, "torch": torch.__version__, "worlds": worlds}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
