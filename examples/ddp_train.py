"""Data-parallel training with pycomm's DistributedDataParallel: run with
    torchrun --nproc-per-node 2 examples/ddp_train.py
Each rank trains an MLP on its own shard of a synthetic regression task;
gradients are averaged in buckets that overlap with backward. Rank 0 prints
the loss, then the buckets and the per-iteration overlap (ddp.stats())."""

import torch
from torch import nn

import pycomm
from pycomm.parallel import DistributedDataParallel

comm = pycomm.init()  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
n, r = comm.world_size, comm.rank

torch.manual_seed(r)  # different on each rank: the constructor copies rank 0's weights
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                      nn.Linear(256, 1))
ddp = DistributedDataParallel(model, comm, bucket_cap_mb=0.25, first_bucket_mb=0.05)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

g = torch.Generator().manual_seed(1000 + r)  # this rank's shard of the data
w_true = torch.randn(64, 1, generator=torch.Generator().manual_seed(0))
for step in range(30):
    x = torch.randn(32, 64, generator=g)
    y = torch.tanh(x @ w_true / 8)
    opt.zero_grad()
    loss = nn.functional.mse_loss(ddp(x), y)
    loss.backward()  # all-reduces launch here, bucket by bucket
    opt.step()
    if r == 0 and step % 10 == 9:
        print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)

# Every replica took the same steps: check it with one all-reduce of a checksum.
flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
check = torch.stack([flat.sum(), -flat.sum()]).double()
comm.all_reduce(check, op="max")
if r == 0:
    print(ddp.stats())
    print(f"replicas identical: {bool(check[0] == -check[1])}", flush=True)
comm.close()
