"""Plain torch.distributed code on pycomm: run with
    torchrun --nproc-per-node 2 examples/torch_backend.py          # CPU tensors
    torchrun --nproc-per-node 2 examples/torch_backend.py --cuda   # cuda:LOCAL_RANK
`import pycomm` registers backend="pycomm"; the rest is ordinary torch code
(collectives and DistributedDataParallel), and every collective runs on pycomm
(with --cuda: on the group's CUDA communicator, made at the first CUDA op)."""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm  # noqa: F401  (registers the "pycomm" backend)

dist.init_process_group(backend="pycomm")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun
rank, world = dist.get_rank(), dist.get_world_size()
if "--cuda" in sys.argv[1:]:
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")

t = torch.full((4,), float(rank + 1), device=device)
dist.all_reduce(t)  # SUM over ranks: n(n+1)/2 everywhere
ok = bool(torch.all(t == world * (world + 1) / 2))

gathered = [torch.empty(2, device=device) for _ in range(world)]
dist.all_gather(gathered, torch.full((2,), float(rank), device=device))
ok &= all(torch.all(g == r) for r, g in enumerate(gathered))

# DDP: each rank trains on its shard; gradients are averaged by pycomm.
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 1)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(64, 8).to(device), torch.randn(64, 1).to(device)  # same seed: same full batch
shard = slice(rank * 64 // world, (rank + 1) * 64 // world)
for step in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x[shard]), y[shard])
    loss.backward()
    opt.step()

# Parameters stay identical on every rank.
w = model.module[0].weight.detach().clone()
w0 = w.clone()
dist.broadcast(w0, src=0)
ok &= torch.equal(w, w0)
print(f"rank {rank}/{world} backend={dist.get_backend()} all_reduce={t.tolist()} "
      f"loss={loss.item():.4f} {'OK' if ok else 'WRONG'}", flush=True)
dist.destroy_process_group()
