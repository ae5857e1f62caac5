"""FSDP2 training and a DCP checkpoint on pycomm: run with
    torchrun --nproc-per-node 2 examples/fsdp2_dcp.py [CHECKPOINT_DIR]
`import pycomm` registers backend="pycomm"; the rest is ordinary torch code.
fully_shard shards each layer's parameters over the ranks (all_gather before
forward/backward, reduce_scatter of the gradients); torch.distributed.checkpoint
saves the sharded model and optimizer state, and a fresh sharded model loads
it. Every collective, the checkpoint's planning (gather/scatter of plans)
included, runs on pycomm."""

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

import pycomm  # noqa: F401  (registers the "pycomm" backend)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


dist.init_process_group(backend="pycomm")  # RANK, WORLD_SIZE, ... from torchrun
rank, world = dist.get_rank(), dist.get_world_size()
ckpt = sys.argv[1] if len(sys.argv) > 1 else None
if ckpt is None:  # one directory for every rank: rank 0 makes it, the others learn its name
    name = [tempfile.mkdtemp(prefix="fsdp2_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    ckpt = name[0]

model = make_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
torch.manual_seed(1)
x, y = torch.randn(64, 16), torch.randn(64, 1)
shard = slice(rank * 64 // world, (rank + 1) * 64 // world)  # this rank's part of the batch
for step in range(10):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x[shard]), y[shard])
    loss.backward()
    opt.step()
    if step in (0, 9):
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step} loss {mean.item():.4f}", flush=True)

dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt)

fresh = make_model()
with torch.no_grad():  # not the trained values: the load must bring them
    for p in fresh.parameters():
        p.zero_()
fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
state = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
dcp.load(state, checkpoint_id=ckpt)
fresh_opt.load_state_dict(state["optim"])

ok = all(torch.equal(a.full_tensor(), b.full_tensor())
         for a, b in zip(model.parameters(), fresh.parameters()))
with torch.no_grad():
    same = torch.equal(model(x[shard]), fresh(x[shard]))
print(f"rank {rank}/{world} backend={dist.get_backend()} checkpoint={ckpt} "
      f"loaded={'OK' if ok and same else 'WRONG'}", flush=True)
dist.destroy_process_group()
