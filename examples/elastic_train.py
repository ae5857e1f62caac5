"""Elastic data-parallel training with pycomm: a job that loses a worker recovers.

Two ways, both with pycomm's DistributedDataParallel:

* **restart** (default), under torchrun's elastic agent:
      torchrun --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d \\
          --rdzv-endpoint 127.0.0.1:29400 examples/elastic_train.py --ckpt /tmp/elastic.pt
  Rank 0 checkpoints after every step. When a worker dies, the survivors get
  a CommError at once, torchrun restarts every worker, and the new attempt
  (a fresh communicator: pycomm scopes its store keys by
  TORCHELASTIC_RESTART_COUNT) resumes from the checkpoint.
* **shrink** (``--shrink``): the survivors keep going without a restart:
  ``comm.shrink()`` builds a communicator over them and ``ddp.rebind()``
  moves the model onto it. It needs a launcher that leaves the survivors
  running when a worker dies (torchrun's agent stops them all) and serves
  the store itself, so that the store outlives any rank (with plain env://
  rank 0 serves it, and losing rank 0 loses it): ``--spawn N`` starts N
  local ranks that way (pycomm.bench.launch.run_script):
      python examples/elastic_train.py --spawn 3 --shrink --kill-rank 1 --kill-step 3

``--torch`` does the same with torch's own DDP over ``backend="pycomm"``:
the restart as above, and the shrink through torch's API,
``dist.shrink_group(pycomm.backend.lost_ranks())`` and a new DDP over the
shrunk default group.

``--kill-rank R --kill-step S`` makes rank R SIGKILL itself in the middle of
step S's backward (first attempt only), to try it. Every rank's data at step
s depends on (its rank at launch, s) only, so a resumed run sees what an
uninterrupted one would. The final parameters go to ``--out`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import pycomm
from pycomm.backend import Options, get_communicator, lost_ranks
from pycomm.parallel import DistributedDataParallel


def batch(data_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``data_rank``'s batch of step ``step`` (the same in every attempt)."""
    g = torch.Generator().manual_seed(1000 * data_rank + step)
    x = torch.randn(16, 32, generator=g)
    return x, torch.tanh(x.sum(1, keepdim=True) / 4)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))


def save(path: str, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Atomically: a rank killed while writing leaves the previous checkpoint."""
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, path + ".tmp")
    os.replace(path + ".tmp", path)


def log_event(path: str, event: str, rank: int) -> None:
    """Appends ``{"event", "rank", "t"}`` (wall clock) to ``path`` (--events),
    for benchmarks/elastic: the time from a kill to the first resumed step."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, "rank": rank, "t": time.time()}) + "\n")


def kill_in_backward(model: nn.Module, events: str, rank: int) -> None:
    """SIGKILLs this process when the first gradient of the next backward is ready."""
    def die(grad: torch.Tensor) -> None:
        log_event(events, "killed", rank)
        os.kill(os.getpid(), signal.SIGKILL)

    next(model.parameters()).register_hook(die)


def spawn(nproc: int, victim: int) -> None:
    """Starts ``nproc`` ranks of this script, the store served here
    (pycomm.bench.launch.run_script): a dead rank leaves the others running."""
    from pycomm.bench.launch import run_script

    argv = [a for i, a in enumerate(sys.argv[1:])
            if a != "--spawn" and (i == 0 or sys.argv[i] != "--spawn")]
    procs = run_script([__file__, *argv], nproc)
    for r, p in enumerate(procs):
        print(p.stdout, end="")
        if p.returncode != 0 and r != victim:
            sys.exit(f"rank {r} failed ({p.returncode}):\n{p.stderr[-3000:]}")


def make_ddp(model: nn.Module, comm: pycomm.Communicator, torch_ddp: bool) -> nn.Module:
    """pycomm's DDP over ``comm``, or torch's over the default process group."""
    if torch_ddp:
        return torch.nn.parallel.DistributedDataParallel(model)
    return DistributedDataParallel(model, comm)


def shrink(comm: pycomm.Communicator, ddp: nn.Module, model: nn.Module,
           torch_ddp: bool) -> tuple[pycomm.Communicator, nn.Module]:
    """Continues on the survivors: (their communicator, the DDP over it)."""
    if torch_ddp:
        dist.shrink_group(lost_ranks())  # the default group shrinks in place
        return get_communicator(), make_ddp(model, comm, torch_ddp)
    comm = comm.shrink()
    ddp.rebind(comm)
    return comm, ddp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ckpt", default="", help="checkpoint path (restart mode)")
    ap.add_argument("--shrink", action="store_true", help="continue on the survivors")
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--transport", default="auto", help="pycomm.init's transport")
    ap.add_argument("--torch", action="store_true",
                    help='torch DDP over backend "pycomm" instead of pycomm\'s DDP')
    ap.add_argument("--out", default="", help="rank 0 saves the final parameters here")
    ap.add_argument("--events", default="", help="append timing events (JSON lines) here")
    ap.add_argument("--spawn", type=int, default=0,
                    help="launch this many local ranks of this script without an elastic agent "
                         "(for --shrink) and print their output")
    args = ap.parse_args()
    if args.spawn:
        spawn(args.spawn, args.kill_rank)
        return

    if args.torch:
        dist.init_process_group("pycomm", pg_options=Options(transport=args.transport))
        comm = get_communicator()
    else:
        comm = pycomm.init(transport=args.transport)
    launch_rank = comm.rank  # the data shard: a rank keeps its shard after a shrink
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    if args.ckpt and os.path.exists(args.ckpt):
        state = torch.load(args.ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
        print(f"rank {comm.rank}: attempt {attempt} resumes at step {start}", flush=True)
    ddp = make_ddp(model, comm, args.torch)

    step, resumed = start, start > 0
    while step < args.steps:
        if attempt == 0 and launch_rank == args.kill_rank and step == args.kill_step:
            kill_in_backward(model, args.events, launch_rank)
        x, y = batch(launch_rank, step)
        opt.zero_grad()
        try:
            nn.functional.mse_loss(ddp(x), y).backward()  # the all-reduces run here
        except RuntimeError as e:  # pycomm.CommError, or torch's error over backend "pycomm"
            if not args.shrink:
                raise  # torchrun restarts the job; the checkpoint has the last step
            log_event(args.events, "detected", launch_rank)
            (comm, ddp), resumed = shrink(comm, ddp, model, args.torch), True
            print(f"rank {launch_rank}: step {step} lost a peer ({e}); continuing as rank "
                  f"{comm.rank} of {comm.world_size}", flush=True)
            continue  # redo the step on the survivors
        opt.step()
        if args.ckpt and comm.rank == 0:
            save(args.ckpt, step, model, opt)
        if resumed:
            log_event(args.events, "resumed", launch_rank)
            resumed = False
        step += 1
    if comm.rank == 0:
        print(f"trained {args.steps} steps on {comm.world_size} ranks", flush=True)
        if args.out:
            torch.save([p.detach() for p in model.parameters()], args.out)
    if args.torch:
        dist.destroy_process_group()
    else:
        comm.close()


if __name__ == "__main__":
    main()
