"""Pipeline-parallel training with pycomm: run with
    torchrun --nproc-per-node 2 examples/pipeline_train.py

An MLP cut into one stage per rank learns a fixed random linear map with
1F1B over 8 microbatches. Rank 0 feeds the batches, the last rank computes
the loss and prints it; each rank prints how many microbatches of
activations its stage held at most (1F1B: world_size - rank)."""

import torch
from torch import nn

import pycomm
from pycomm.pipeline import PipelineStage, Schedule1F1B, split_sequential

comm = pycomm.init()  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
torch.manual_seed(0)  # the same model and data on every rank
width, steps, batch, n_microbatches = 32, 30, 64, 8
layers = []
for _ in range(2 * comm.world_size):
    layers += [nn.Linear(width, width), nn.Tanh()]
model = nn.Sequential(*layers[:-1])  # no activation after the last layer
stages = split_sequential(model, comm.world_size)
stage = PipelineStage(stages[comm.rank], comm.rank, comm.world_size, comm)
schedule = Schedule1F1B(stage, n_microbatches, loss_fn=nn.functional.mse_loss)
optimizer = torch.optim.Adam(stage.submod.parameters(), lr=1e-2)
teacher = torch.randn(width, width) / width ** 0.5

for step in range(steps):
    x = torch.randn(batch, width)
    y = torch.tanh(x @ teacher)
    optimizer.zero_grad()
    if stage.is_first:
        schedule.step(x)
    elif stage.is_last:
        losses: list = []
        schedule.step(target=y, losses=losses)
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:2d}  loss {torch.stack(losses).mean():.4f}", flush=True)
    else:
        schedule.step()
    optimizer.step()

print(f"rank {comm.rank}: stage {stage.stage_index} held at most "
      f"{stage.peak_live_microbatches} microbatches of activations", flush=True)
comm.close()
