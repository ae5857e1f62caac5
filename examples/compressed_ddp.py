"""torch DDP with 8-bit gradients: run with
    torchrun --nproc-per-node 2 examples/compressed_ddp.py [--wire fp8_e4m3] [--no-error-feedback]

`pycomm.hooks.int8_hook` sends each gradient bucket as int8 codes with one
float32 scale per 256 elements (about a quarter of the float32 bytes), sums
in float32 and keeps each rank's rounding error in a residual that rides
along with the next step (error feedback). `--wire fp8_e4m3` / `fp8_e5m2`
uses `pycomm.hooks.fp8_hook` instead: float8 codes in the same blocks.
Biases and other small parameters go exact. Trains a small MLP side by side with plain DDP (same
data, same start) and prints both losses and how far the parameters ended
up apart, and that every rank holds the same bits.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

import pycomm
from pycomm import hooks

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--wire", choices=["int8", "fp8_e4m3", "fp8_e5m2"], default="int8")
parser.add_argument("--no-error-feedback", action="store_true")
args = parser.parse_args()
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
hook = hooks.int8_hook if args.wire == "int8" else hooks.fp8_hook

dist.init_process_group("gloo")                      # torchrun's environment
comm = pycomm.init(group=dist.group.WORLD)          # shm between this host's ranks
rank, world = comm.rank, comm.world_size
state = hooks.CompressionState(comm, wire_block=256, error_feedback=not args.no_error_feedback,
                               fp8_format=FP8.get(args.wire, torch.float8_e4m3fn))

models = []
for compress in (False, True):                      # the same start for both
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(
        nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4)))
    if compress:
        ddp.register_comm_hook(state, hook)              # <- the one line
    models.append(ddp)
plain, compressed = models

opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (plain, compressed)]
g = torch.Generator().manual_seed(1234)
target = torch.randn(32, 4, generator=g)                 # a learnable linear map
for step in range(args.steps):
    x = torch.randn(16 * world, 32, generator=g)
    y = torch.tanh(x @ target)
    shard = slice(16 * rank, 16 * (rank + 1))   # this rank's part of the global batch
    losses = []
    for model, opt in zip((plain, compressed), opts):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[shard]), y[shard])
        loss.backward()
        opt.step()
        losses.append(loss.item())

diff = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), compressed.parameters()))
flat = torch.cat([p.detach().reshape(-1) for p in compressed.parameters()])
highest = flat.clone()
# Over pycomm, not the gloo group: torch DDP keeps that group's threads alive
# past destroy_process_group, and one that dropped this tensor only at
# interpreter exit would abort the process (pytorch/pytorch#190489).
comm.all_reduce(highest, op=pycomm.ReduceOp.MAX)
print(f"rank {rank}/{world} {args.wire} (error feedback {state.error_feedback}) [{comm.transport}] "
      f"last loss {losses[1]:.4f} (plain DDP {losses[0]:.4f}), "
      f"max |param - plain DDP's| = {diff:.2e}, ranks identical: {torch.equal(highest, flat)}",
      flush=True)
comm.close()
dist.destroy_process_group()
