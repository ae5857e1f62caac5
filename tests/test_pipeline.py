"""Pipeline parallelism on real ranks (shm transport) against one process.

Every case trains the same seeded model one step: on N ranks with a pipeline
schedule, and in the test process on the whole batch split the same way
(``tensor.chunk``), loss = mean over microbatches. Losses and every stage's
parameter gradients must agree (1e-5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._dist import run_ranks

TRANSPORT = "shm"
TOL = dict(rtol=1e-5, atol=1e-5)
WIDTH = 16
# (n_microbatches, batch rows): 1, 4, 8 microbatches, and an uneven split
# (10 rows in 4: 3, 3, 3, 1).
SPLITS = [(1, 5), (4, 8), (8, 16), (4, 10)]


def _model(n_layers: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for k in range(n_layers):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _batch(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + rows)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def _loss(out, target):
    return nn.functional.mse_loss(out, target)


def _reference(n_stages: int, m: int, rows: int):
    """One process: the mean of the microbatch losses, its gradients per stage."""
    from pycomm.pipeline import split_sequential

    model = _model(n_stages)
    x, y = _batch(rows)
    xs, ys = x.chunk(m), y.chunk(m)
    losses = [_loss(model(a), b) for a, b in zip(xs, ys)]
    torch.stack(losses).mean().backward()
    stages = split_sequential(model, n_stages, balance=[2] * n_stages)
    grads = [[p.grad.clone() for p in s.parameters()] for s in stages]
    return [float(v.detach()) for v in losses], grads


def _pipeline_cases(comm, schedule: str, stages_per_rank: int, splits, checkpoint="never"):
    """On every rank: one training step per split; returns per split this
    rank's {stage: grads} and, on the last stage's rank, the losses."""
    import pycomm.pipeline as pp

    n_stages = comm.world_size * stages_per_rank
    out = []
    for m, rows in splits:
        model = _model(n_stages)
        parts = pp.split_sequential(model, n_stages, balance=[2] * n_stages)
        mine = [pp.PipelineStage(parts[s], s, n_stages, comm, checkpoint=checkpoint)
                for s in range(comm.rank, n_stages, comm.world_size)]
        if schedule == "gpipe":
            sched = pp.ScheduleGPipe(mine[0], m, _loss)
        elif schedule == "1f1b":
            sched = pp.Schedule1F1B(mine[0], m, _loss)
        else:
            sched = pp.ScheduleInterleaved1F1B(mine, m, _loss)
        x, y = _batch(rows)
        kwargs = {}
        losses: list = []
        if any(s.is_last for s in mine):
            kwargs = dict(target=y, losses=losses)
        args = (x,) if any(s.is_first for s in mine) else ()
        ret = sched.step(*args, **kwargs)
        if ret is not None:
            assert ret.shape == y.shape
        out.append({"grads": {s.stage_index: [p.grad.clone() for p in s.submod.parameters()]
                              for s in mine},
                    "losses": [float(v) for v in losses],
                    "peak": {s.stage_index: s.peak_live_microbatches for s in mine}})
    return out


def _check_against_reference(per_rank, world_size, stages_per_rank, splits):
    n_stages = world_size * stages_per_rank
    for k, (m, rows) in enumerate(splits):
        ref_losses, ref_grads = _reference(n_stages, m, rows)
        got_losses = per_rank[(n_stages - 1) % world_size][k]["losses"]
        torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(ref_losses), **TOL)
        for r in range(world_size):
            for s, grads in per_rank[r][k]["grads"].items():
                assert len(grads) == len(ref_grads[s])
                for g, ref in zip(grads, ref_grads[s]):
                    torch.testing.assert_close(g, ref, **TOL,
                                               msg=f"m={m} rows={rows} stage {s} gradient")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("schedule,stages_per_rank",
                         [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_schedule_matches_one_process(world_size, schedule, stages_per_rank):
    per_rank = run_ranks(_pipeline_cases, world_size, TRANSPORT, schedule, stages_per_rank,
                         SPLITS)
    _check_against_reference(per_rank, world_size, stages_per_rank, SPLITS)
