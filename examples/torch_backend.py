"""Plain torch.distributed code on pycomm: run with
    torchrun --nproc-per-node 2 examples/torch_backend.py          # CPU tensors
    torchrun --nproc-per-node 2 examples/torch_backend.py --cuda   # cuda:LOCAL_RANK
    torchrun --nproc-per-node 2 examples/torch_backend.py --register
`import pycomm` registers backend="pycomm"; the rest is ordinary torch code
(collectives and DistributedDataParallel), and every collective runs on pycomm
(with --cuda: on the group's CUDA communicator, made at the first CUDA op).
--register passes pycomm.backend.Options(register=True): DDP's gradient
bucket moves into shared memory at its second all-reduce, and the later ones
run from there (counted in the last line)."""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm  # noqa: F401  (registers the "pycomm" backend)

register = "--register" in sys.argv[1:]
options = pycomm.backend.Options(register=True) if register else None
dist.init_process_group(backend="pycomm", pg_options=options)  # RANK, WORLD_SIZE, ... from torchrun
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
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 512), torch.nn.ReLU(),  # 70 K parameters:
                                torch.nn.Linear(512, 128), torch.nn.ReLU(),  # a 281 KB bucket
                                torch.nn.Linear(128, 1)).to(device))
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
sym = pycomm.backend.get_communicator().symmetric_all_reduces  # 0 without --register
print(f"rank {rank}/{world} backend={dist.get_backend()} all_reduce={t.tolist()} "
      f"loss={loss.item():.4f} symmetric={sym} {'OK' if ok else 'WRONG'}", flush=True)
dist.destroy_process_group()
