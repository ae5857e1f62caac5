"""DDP step time across 2 simulated hosts x 2 ranks with compressed gradients
(issue 38 item 5): torch DDP on gloo (fp32, the baseline) and torch DDP with
pycomm's hooks (on shm+gloo: shared memory inside a host, gloo between):
allreduce (fp32), bf16_compress_hook, ring_bf16_hook, int8_hook and fp8_hook
(error feedback), in interleaved rounds, and the model alone without DDP
(compute-only: the floor, so step - floor is what the gradients' traffic
costs); the median step time of the slowest rank and each variant's speedup
over the baseline and over bf16_compress_hook.

    python benchmarks/compression/hosts_ddp.py --json benchmarks/compression/hosts_ddp_run1.json
    python benchmarks/compression/hosts_ddp.py --link-rate 1gbit --json ...  # a 1 Gbit/s network

The model is an MLP of ``--width`` (4096: 25.2 M parameters, 101 MB of
float32 gradients a step) with a small batch, so that the step is mostly
gradient traffic. Needs root (network namespaces: pycomm/bench/simhosts.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

VARIANTS = ("torch-gloo", "hook-allreduce", "hook-bf16", "hook-ring-bf16", "hook-int8", "hook-fp8",
            "compute-only")


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4, help="samples per rank and step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--link-rate", default=None, metavar="RATE",
                    help="cap each host's link at RATE (tc's units, e.g. 1gbit): "
                         "pycomm/bench/simhosts.py")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {','.join(VARIANTS)}")
    if not args.rank:
        from pycomm.bench.cli import check_hosts

        args.hosts = 2  # (an error about "--hosts" means the 2 simulated hosts)
        check_hosts(ap, args)
    return args


def _model(width: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 1024))


def _wrap(name: str, args: argparse.Namespace, comm: Any) -> Any:
    import torch

    from pycomm import hooks

    if name == "compute-only":  # no DDP, no gradient traffic: the step's floor
        return _model(args.width)
    ddp = torch.nn.parallel.DistributedDataParallel(_model(args.width))
    hook = {"hook-allreduce": (comm, hooks.allreduce_hook),
            "hook-bf16": (comm, hooks.bf16_compress_hook),
            "hook-ring-bf16": (comm, hooks.ring_bf16_hook),
            "hook-int8": (hooks.CompressionState(comm), hooks.int8_hook),
            "hook-fp8": (hooks.CompressionState(comm), hooks.fp8_hook)}.get(name)
    if hook is not None:
        ddp.register_comm_hook(*hook)
    return ddp


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import pycomm
    from pycomm.bench.runner import mse_train_step, slowest_step_s

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    comm = pycomm.init(group=dist.group.WORLD)
    r = dist.get_rank()
    x = torch.randn(args.batch, 1024, generator=torch.Generator().manual_seed(r))
    y = torch.randn(args.batch, 1024)
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):  # variants interleaved; each built fresh (memory)
        for name in args.variants:
            ddp = _wrap(name, args, comm)
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
            for step in range(args.steps + 2):  # 2 warm-up steps a round
                dt = slowest_step_s(functools.partial(mse_train_step, ddp, opt, x, y))
                if step >= 2:
                    times.setdefault(name, []).append(dt)
            del ddp, opt
    if r == 0:
        params = sum(p.numel() for p in _model(args.width).parameters())
        print(json.dumps({"transport": comm.transport, "parameters": params,
                          "step_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
                          "steps": {k: len(v) for k, v in times.items()}}))
    comm.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.rank:
        _rank_main(args)
        return 0
    from pycomm.bench.simhosts import SimulatedHosts

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, __file__, "--rank", "--width", str(args.width), "--batch",
           str(args.batch), "--rounds", str(args.rounds), "--steps", str(args.steps),
           "--variants", ",".join(args.variants)]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    with SimulatedHosts(2, args.link_rate) as hosts:
        res = hosts.launch([2, 2], cmd, env=env, timeout=1800)
    for x in res:
        if x.returncode != 0:
            raise SystemExit(f"rank {x.rank} exited {x.returncode}:\n{x.stderr[-3000:]}")
    data = json.loads(res[0].stdout.strip().splitlines()[-1])
    ms = data["step_ms"]
    for base in ("torch-gloo", "hook-bf16"):
        if base in ms:
            data[f"speedup_over_{base}"] = {k: ms[base] / v for k, v in ms.items()}
    if "compute-only" in ms:  # what the gradients' traffic adds to the step
        data["traffic_ms"] = {k: v - ms["compute-only"] for k, v in ms.items() if k != "compute-only"}
    data["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=repo).stdout.strip()
    data["loadavg"] = os.getloadavg()
    data["args"] = {k: v for k, v in vars(args).items() if k not in ("json", "rank", "hosts")}
    for k, v in ms.items():
        print(f"{k:>16}: {v:9.1f} ms/step  " + "  ".join(
            f"{data[f'speedup_over_{b}'][k]:.2f}x {b}" for b in ("torch-gloo", "hook-bf16")
            if f"speedup_over_{b}" in data)
              + (f"  traffic {data['traffic_ms'][k]:.1f} ms" if k in data.get("traffic_ms", {})
                 else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
