"""pycomm quickstart: run with
    torchrun --nproc-per-node 3 examples/quickstart.py
Each rank contributes rank+1; every rank prints the same sums."""

import torch

import pycomm

comm = pycomm.init()  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
n, r = comm.world_size, comm.rank

t = torch.full((4,), float(r + 1))
comm.all_reduce(t)  # in place, SUM, ring algorithm
expected = n * (n + 1) / 2
print(f"rank {r}/{n} [{comm.transport}] all_reduce -> {t.tolist()} "
      f"({'OK' if torch.all(t == expected) else 'WRONG'}, expected {expected})", flush=True)

work = comm.all_reduce(torch.full((2,), float(r)), op="max", async_op=True)
work.wait()
b = torch.arange(3.0) if r == 0 else torch.zeros(3)
comm.broadcast(b, src=0)
assert torch.equal(b, torch.arange(3.0))
comm.close()
