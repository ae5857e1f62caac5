"""torch DDP across 2 simulated hosts x 2 ranks: the same model trained on
torch's gloo group and on a "pycomm" group (whose CPU all-reduce runs
through the shm+gloo hierarchy), interleaved rounds; median step time (the
slowest rank's) and the largest difference of the trained parameters.

    python benchmarks/hosts/ddp_hosts.py --json benchmarks/hosts/ddp_2x2.json
"""
import functools
import json
import os
import statistics
import subprocess
import sys


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 16))


def rank_main():
    import torch
    import torch.distributed as dist

    import pycomm  # noqa: F401 - registers the "pycomm" backend
    from pycomm.bench.runner import mse_train_step, slowest_step_s

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    r = dist.get_rank()
    on_pycomm = dist.new_group(backend="pycomm")
    ddps = {"torch-gloo": torch.nn.parallel.DistributedDataParallel(_model()),
            "torch-ddp-on-pycomm": torch.nn.parallel.DistributedDataParallel(
                _model(), process_group=on_pycomm)}
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(r))
    y = torch.randn(32, 16)
    times = {k: [] for k in ddps}
    for _ in range(4):  # rounds, variants interleaved
        for name, m in ddps.items():
            opt = torch.optim.SGD(m.parameters(), lr=1e-3)
            for step in range(7):
                dt = slowest_step_s(functools.partial(mse_train_step, m, opt, x, y))
                if step >= 2:  # 2 warm-up steps a round
                    times[name].append(dt)
    params = [list(m.parameters()) for m in ddps.values()]
    diff = max((a - b).abs().max().item() for a, b in zip(*params))
    if r == 0:
        print(json.dumps({f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}
                         | {"max_param_diff": diff}))
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:] == ["rank"]:
        rank_main()
        sys.exit(0)
    from pycomm.bench.simhosts import SimulatedHosts
    with SimulatedHosts(2) as h:
        res = h.launch([2, 2], [sys.executable, __file__, "rank"], env={"OMP_NUM_THREADS": "1"})
    for x in res:
        if x.returncode != 0:
            raise SystemExit(f"rank {x.rank} exited {x.returncode}:\n{x.stderr[-3000:]}")
    data = json.loads(res[0].stdout.strip().splitlines()[-1])
    data["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, cwd=os.path.dirname(os.path.abspath(__file__))
                                    ).stdout.strip()
    data["loadavg"] = os.getloadavg()
    print(json.dumps(data))
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(data, f, indent=1)
