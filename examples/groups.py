"""Sub-communicators on a 2 x (N/2) grid of ranks: run with
    torchrun --nproc-per-node 4 examples/groups.py
Rows reduce gradients (data parallel); columns would pass activations
(pipeline). Each rank checks its sums and prints one line."""

import torch

import pycomm

comm = pycomm.init()  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
n, r = comm.world_size, comm.rank
if n % 2:
    raise SystemExit(f"run with an even number of ranks, got {n}")
width = n // 2

# split: every rank calls it; equal colors form a group, ranked by key.
row = comm.split(color=r // width)           # ranks {0..w-1}, {w..n-1}
col = comm.split(color=r % width, key=-r)    # {w+c, c}: key reverses the order

# new_group: members listed in the group's order; other ranks get None.
firsts = comm.new_group([0, width])          # the first rank of each row

t = torch.full((3,), float(r))
row.all_reduce(t)                            # sum over my row only
row_sum = sum(range(r // width * width, (r // width + 1) * width))
ok = torch.all(t == row_sum).item() and col.rank == 1 - r // width
if firsts is not None:
    x = torch.tensor([float(r)])
    firsts.all_reduce(x, op="max")
    ok = ok and x.item() == width
comm.all_reduce(torch.ones(1))               # the parent is still in step

print(f"rank {r}/{n}: row {row.rank}/{row.world_size} col {col.rank}/{col.world_size} "
      f"row sum {t[0].item()} ({'OK' if ok else 'WRONG'})", flush=True)
for g in (row, col, firsts):
    if g is not None:
        g.close()
comm.close()
