"""torch DDP with its gradient traffic on pycomm: run with
    torchrun --nproc-per-node 2 examples/ddp_hooks.py [--hook allreduce]

DDP is built on a gloo process group as usual; one line moves every gradient
bucket onto a pycomm communicator (shm between the processes of this host).
Trains a small MLP side by side with plain DDP (same data, same start) and
prints how far the two ended up apart. Hooks: allreduce, fp16, bf16,
ring_fp16, ring_bf16, powersgd.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

import pycomm
from pycomm import hooks

parser = argparse.ArgumentParser()
parser.add_argument("--hook", default="allreduce",
                    choices=["allreduce", "fp16", "bf16", "ring_fp16", "ring_bf16", "powersgd"])
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

dist.init_process_group("gloo")               # torchrun's environment
comm = pycomm.init(group=dist.group.WORLD)   # same ranks; shm on one host
rank, world = comm.rank, comm.world_size


def make_ddp() -> nn.parallel.DistributedDataParallel:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 4))
    return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets


plain, hooked = make_ddp(), make_ddp()
if args.hook == "powersgd":
    state = hooks.PowerSGDState(comm, matrix_approximation_rank=2, start_powerSGD_iter=5)
    hooked.register_comm_hook(state, hooks.powerSGD_hook)
else:
    hook = {"allreduce": hooks.allreduce_hook, "fp16": hooks.fp16_compress_hook,
            "bf16": hooks.bf16_compress_hook, "ring_fp16": hooks.ring_fp16_hook,
            "ring_bf16": hooks.ring_bf16_hook}[args.hook]
    hooked.register_comm_hook(comm, hook)      # <- the one line

opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, hooked)]
g = torch.Generator().manual_seed(1234)
for step in range(args.steps):
    x, y = torch.randn(8 * world, 32, generator=g), torch.randn(8 * world, 4, generator=g)
    shard = slice(8 * rank, 8 * (rank + 1))   # this rank's part of the global batch
    for model, opt in zip((plain, hooked), opts):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[shard]), y[shard])
        loss.backward()
        opt.step()

diff = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), hooked.parameters()))
print(f"rank {rank}/{world} hook={args.hook} [{comm.transport}] last loss {loss.item():.4f}, "
      f"max |param - plain DDP's| = {diff:.2e}", flush=True)
comm.close()
dist.destroy_process_group()
