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
        elif schedule.startswith("1f1b"):  # "1f1b+1": one microbatch of slack
            sched = pp.Schedule1F1B(mine[0], m, _loss, slack=int(schedule[5:] or 0))
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
                    "peak": {s.stage_index: s.peak_live_microbatches for s in mine},
                    "peak_bytes": {s.stage_index: s.peak_live_bytes for s in mine}})
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
                         [("gpipe", 1), ("1f1b", 1), ("1f1b+1", 1), ("interleaved", 2)])
def test_schedule_matches_one_process(world_size, schedule, stages_per_rank):
    per_rank = run_ranks(_pipeline_cases, world_size, TRANSPORT, schedule, stages_per_rank,
                         SPLITS)
    _check_against_reference(per_rank, world_size, stages_per_rank, SPLITS)


def test_1f1b_keeps_fewer_activations_than_gpipe():
    splits = [(8, 16)]
    gp = run_ranks(_pipeline_cases, 4, TRANSPORT, "gpipe", 1, splits)
    ofob = run_ranks(_pipeline_cases, 4, TRANSPORT, "1f1b", 1, splits)
    for r in range(4):
        # measured by the stages: forwards run whose backward had not yet run
        assert gp[r][0]["peak"] == {r: 8}
        assert ofob[r][0]["peak"] == {r: 4 - r}
        assert ofob[r][0]["peak_bytes"][r] < gp[r][0]["peak_bytes"][r]


# ---------------------------------------------------------------- tuples, masks, shapes

class _Embed(nn.Module):
    """Stage 0: returns (hidden, mask, positions): a float tensor that carries
    a gradient back, a bool mask and an int64 tensor that do not."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        mask = x[..., 0] > 0
        pos = torch.arange(x.shape[1]).expand(x.shape[0], -1).contiguous()
        return h, mask, pos


class _Masked(nn.Module):
    """Middle stages: pass the tuple on, transforming the hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, h, mask, pos):
        h = torch.tanh(self.lin(h)) * mask.unsqueeze(-1) + 0.01 * pos.unsqueeze(-1)
        return h, mask, pos


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, 1)

    def forward(self, h, mask, pos):
        return self.lin(h).squeeze(-1) * mask


def _tuple_model(n_stages: int) -> list[nn.Module]:
    torch.manual_seed(3)
    return [_Embed()] + [_Masked() for _ in range(n_stages - 2)] + [_Head()]


def _seq_batch(rows: int, seq: int, step: int):
    g = torch.Generator().manual_seed(100 * step + seq)
    return torch.randn(rows, seq, WIDTH, generator=g), torch.randn(rows, seq, generator=g)


STEPS = [(8, 5), (7, 3), (10, 7)]  # (rows, sequence length) per step: shapes change


def _tuple_reference(n_stages: int, m: int):
    parts = _tuple_model(n_stages)
    out = []
    for step, (rows, seq) in enumerate(STEPS):
        for p in parts:
            p.zero_grad()
        x, y = _seq_batch(rows, seq, step)
        losses = []
        for a, b in zip(x.chunk(m), y.chunk(m)):
            v = (a,)
            for p in parts:
                v = p(*v)
                v = v if isinstance(v, tuple) else (v,)
            losses.append(_loss(v[0], b))
        torch.stack(losses).mean().backward()
        out.append(([float(v.detach()) for v in losses],
                    [[q.grad.clone() for q in p.parameters()] for p in parts]))
    return out


def _tuple_steps(comm, schedule: str, m: int):
    import pycomm.pipeline as pp

    parts = _tuple_model(comm.world_size)
    stage = pp.PipelineStage(parts[comm.rank], comm.rank, comm.world_size, comm)
    if schedule == "gpipe":
        sched = pp.ScheduleGPipe(stage, m, _loss)
    else:
        sched = pp.Schedule1F1B(stage, m, _loss, slack=int(schedule[5:] or 0))
    out = []
    for step, (rows, seq) in enumerate(STEPS):
        stage.submod.zero_grad()
        x, y = _seq_batch(rows, seq, step)
        losses: list = []
        if stage.is_first:
            sched.step(x)
        elif stage.is_last:
            ret = sched.step(target=y, losses=losses)
            assert ret.shape == y.shape
        else:
            sched.step()
        grads = [q.grad.clone() for q in stage.submod.parameters()]
        out.append(([float(v) for v in losses], grads))
    return out


@pytest.mark.parametrize("world_size,schedule,m",
                         [(2, "1f1b", 4), (2, "1f1b+1", 4), (4, "gpipe", 3)])
def test_tuple_outputs_masks_and_changing_shapes(world_size, schedule, m):
    per_rank = run_ranks(_tuple_steps, world_size, TRANSPORT, schedule, m)
    ref = _tuple_reference(world_size, m)
    for step in range(len(STEPS)):
        ref_losses, ref_grads = ref[step]
        torch.testing.assert_close(torch.tensor(per_rank[-1][step][0]), torch.tensor(ref_losses),
                                   **TOL)
        for r in range(world_size):
            for g, want in zip(per_rank[r][step][1], ref_grads[r]):
                torch.testing.assert_close(g, want, **TOL, msg=f"step {step} stage {r}")


class _Argmax(nn.Module):
    def forward(self, x):
        return x.argmax(dim=1)


def _token_model() -> list[nn.Module]:
    """Stage 0 hands only integer tokens to stage 1: no gradient flows back."""
    torch.manual_seed(4)
    return [nn.Sequential(nn.Linear(WIDTH, 4), _Argmax()),
            nn.Sequential(nn.Embedding(4, WIDTH), nn.Linear(WIDTH, WIDTH))]


def _token_step(comm, schedule: str, m: int, rows: int):
    import pycomm.pipeline as pp

    stage = pp.PipelineStage(_token_model()[comm.rank], comm.rank, 2, comm)
    cls = pp.ScheduleGPipe if schedule == "gpipe" else pp.Schedule1F1B
    x, y = _batch(rows)
    sched = cls(stage, m, _loss)
    sched.step(x) if stage.is_first else sched.step(target=y)
    return [None if q.grad is None else q.grad.clone() for q in stage.submod.parameters()]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_integer_only_activations_send_no_gradient(schedule):
    m, rows = 4, 10
    per_rank = run_ranks(_token_step, 2, TRANSPORT, schedule, m, rows)
    parts = _token_model()
    x, y = _batch(rows)
    torch.stack([_loss(parts[1](parts[0](a)), b)
                 for a, b in zip(x.chunk(m), y.chunk(m))]).mean().backward()
    assert per_rank[0] == [None, None]  # argmax: stage 0 gets no gradient, as in one process
    for g, q in zip(per_rank[1], parts[1].parameters()):
        torch.testing.assert_close(g, q.grad, **TOL)


def _state_sizes(obj) -> dict:
    return {k: len(v) for k, v in vars(obj).items() if isinstance(v, (dict, list, set))}


def _shape_churn(comm):
    """Many steps, each with another sequence length: what the schedule and
    the stage keep must not grow with the number of shapes seen."""
    import pycomm.pipeline as pp

    parts = _tuple_model(2)
    stage = pp.PipelineStage(parts[comm.rank], comm.rank, 2, comm)
    sched = pp.Schedule1F1B(stage, 2, _loss)
    sizes = []
    for step in range(12):
        x, y = _seq_batch(4, 2 + step, step)
        sched.step(x) if stage.is_first else sched.step(target=y)
        sizes.append((_state_sizes(sched), _state_sizes(stage)))
    return sizes


def test_state_does_not_grow_with_distinct_shapes():
    for sizes in run_ranks(_shape_churn, 2, TRANSPORT):
        assert sizes[-1] == sizes[1], (sizes[1], sizes[-1])


def test_balance_by_time_leaves_the_model_untouched():
    # Profiling must not train the model: BatchNorm statistics, gradients and
    # the RNG stay as they were (torchgpipe times copies of the layers).
    from pycomm.pipeline import balance_by_time, split_sequential

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(),
                          nn.Dropout(0.5), nn.Linear(WIDTH, WIDTH))
    model(torch.randn(4, WIDTH)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(8, WIDTH)
    rng = torch.get_rng_state()
    balance = balance_by_time(model, sample, 2)
    assert len(split_sequential(model, 2, balance=balance)) == 2 and sum(balance) == 5
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    for p, g in zip(model.parameters(), grads):
        assert p.grad is not None and torch.equal(p.grad, g)
    assert torch.equal(torch.get_rng_state(), rng)


# ---------------------------------------------------------------- checkpointing

def test_checkpoint_always_matches_one_process():
    splits = [(4, 10), (8, 16)]
    per_rank = run_ranks(_pipeline_cases, 2, TRANSPORT, "1f1b", 1, splits, "always")
    _check_against_reference(per_rank, 2, 1, splits)
    for r in range(2):
        assert per_rank[r][1]["peak_bytes"][r] > 0


def _bn_model() -> nn.Sequential:
    torch.manual_seed(6)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH))


def _bn_checkpointed(comm, checkpoint: str):
    """Two stages on one rank; returns the BatchNorm buffers and gradients."""
    import pycomm.pipeline as pp

    parts = pp.split_sequential(_bn_model(), 2, balance=[3, 2])
    stages = [pp.PipelineStage(parts[s], s, 2, comm, checkpoint=checkpoint) for s in range(2)]
    x, y = _batch(12)
    pp.ScheduleInterleaved1F1B(stages, 4, _loss).step(x, target=y)
    model = nn.Sequential(*parts)
    return [b.clone() for b in model.buffers()], [q.grad.clone() for q in model.parameters()]


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_checkpoint_updates_batchnorm_statistics_once(checkpoint):
    # The recomputation in backward must not count a microbatch twice in the
    # running statistics: they equal one process's, microbatch by microbatch.
    buffers, grads = run_ranks(_bn_checkpointed, 1, TRANSPORT, checkpoint)[0]
    model = _bn_model()
    x, y = _batch(12)
    torch.stack([_loss(model(a), b) for a, b in zip(x.chunk(4), y.chunk(4))]).mean().backward()
    want = list(model.named_buffers())
    assert len(buffers) == len(want) == 6
    for b, (name, v) in zip(buffers, want):
        torch.testing.assert_close(b, v, **TOL, msg=name)
    for g, q in zip(grads, model.parameters()):
        torch.testing.assert_close(g, q.grad, **TOL)


def _dropout_grads(comm, checkpoint: str):
    import pycomm.pipeline as pp

    torch.manual_seed(0)
    layers = []
    for _ in range(2 * comm.world_size):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5)]
    parts = pp.split_sequential(nn.Sequential(*layers), comm.world_size)
    stage = pp.PipelineStage(parts[comm.rank], comm.rank, comm.world_size, comm,
                             checkpoint=checkpoint)
    sched = pp.Schedule1F1B(stage, 4, _loss)
    x, y = _batch(12)
    torch.manual_seed(10 + comm.rank)  # dropout masks: the same on every run
    if stage.is_first:
        sched.step(x)
    else:
        sched.step(target=y)
    return [q.grad.clone() for q in stage.submod.parameters()], stage.peak_live_bytes


def test_checkpoint_replays_dropout():
    plain = run_ranks(_dropout_grads, 2, TRANSPORT, "never")
    for mode in ("always", "except_last"):
        ck = run_ranks(_dropout_grads, 2, TRANSPORT, mode)
        for r in range(2):
            for g, want in zip(ck[r][0], plain[r][0]):
                torch.testing.assert_close(g, want, rtol=0, atol=1e-6, msg=f"{mode} rank {r}")
            # recomputation keeps less for backward (with except_last, the
            # last stage's peak is the one uncheckpointed microbatch)
            if mode == "always" or r == 0:
                assert ck[r][1] < plain[r][1]


# ---------------------------------------------------------------- bad input

def _bad_inputs(comm):
    import pycomm.pipeline as pp

    parts = pp.split_sequential(_model(2), 2)
    errors = []

    def expect(exc, match, fn):
        with pytest.raises(exc, match=match):
            fn()
        errors.append(match)

    r = comm.rank
    expect(ValueError, "belongs on rank", lambda: pp.PipelineStage(parts[1 - r], 1 - r, 2, comm))
    expect(ValueError, "stage_index", lambda: pp.PipelineStage(parts[0], 5, 2, comm))
    expect(ValueError, "checkpoint", lambda: pp.PipelineStage(parts[r], r, 2, comm,
                                                               checkpoint="sometimes"))
    expect(TypeError, "nn.Module", lambda: pp.PipelineStage(lambda x: x, r, 2, comm))
    stage = pp.PipelineStage(parts[r], r, 2, comm)
    expect(ValueError, "n_microbatches", lambda: pp.Schedule1F1B(stage, 0, _loss))
    expect(TypeError, "loss_fn", lambda: pp.ScheduleGPipe(stage, 2, None))
    expect(TypeError, "ScheduleInterleaved1F1B", lambda: pp.Schedule1F1B([stage], 2, _loss))
    expect(ValueError, "num_stages", lambda: pp.ScheduleGPipe(
        pp.PipelineStage(parts[r], r, 4, comm), 2, _loss))
    expect(ValueError, "exactly its stages", lambda: pp.ScheduleInterleaved1F1B(
        [pp.PipelineStage(parts[r], r, 4, comm)], 2, _loss))
    sched = pp.Schedule1F1B(stage, 4, _loss)
    x, y = _batch(5)  # 5 rows chunk into 3 pieces, not 4
    if stage.is_first:
        expect(ValueError, "3 microbatches", lambda: sched.step(x))
        expect(ValueError, "must pass the batch", lambda: sched.step())
        expect(ValueError, "last stage", lambda: sched.step(x, target=y))
    else:
        expect(ValueError, "3 microbatches", lambda: sched.step(target=y))
        expect(ValueError, "target", lambda: sched.step())
        expect(ValueError, "holds no stage 0", lambda: sched.step(x, target=y))
    expect(ValueError, "balance", lambda: pp.split_sequential(_model(2), 2, balance=[1, 1]))
    expect(TypeError, "nn.Sequential", lambda: pp.split_sequential(nn.Linear(2, 2), 1))
    return errors


def _step_after_failed_step(comm):
    """A loss_fn that raises in one step (bad target, OOM skipped by the
    user...) must not poison the next: one rank, two stages in memory."""
    import pycomm.pipeline as pp

    calls = []

    def flaky_loss(out, target):
        calls.append(1)
        if len(calls) == 2:  # the second microbatch of the first step
            raise ValueError("bad target")
        return _loss(out, target)

    parts = pp.split_sequential(_model(2), 2, balance=[2, 2])
    stages = [pp.PipelineStage(parts[s], s, 2, comm) for s in range(2)]
    sched = pp.ScheduleInterleaved1F1B(stages, 4, flaky_loss)
    x, y = _batch(8)
    with pytest.raises(ValueError, match="bad target"):
        sched.step(x, target=y)
    for p in parts:
        p.zero_grad()
    losses: list = []
    sched.step(x, target=y, losses=losses)
    assert [s.live_microbatches for s in stages] == [0, 0]
    return [float(v) for v in losses], [[q.grad.clone() for q in p.parameters()] for p in parts]


def test_step_after_a_failed_step_starts_clean():
    losses, grads = run_ranks(_step_after_failed_step, 1, TRANSPORT)[0]
    ref_losses, ref_grads = _reference(2, 4, 8)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    for got, want in zip(grads, ref_grads):
        for g, ref in zip(got, want):
            torch.testing.assert_close(g, ref, **TOL)


def test_bad_input_raises_clear_errors():
    per_rank = run_ranks(_bad_inputs, 2, TRANSPORT)
    assert len(per_rank[0]) == len(per_rank[1]) == 14


def test_unsupported_dtype_is_a_type_error():
    # Checked where the header is built, before anything is sent.
    run_ranks(_unsupported_dtype_rank0_only, 2, TRANSPORT)


def _unsupported_dtype_rank0_only(comm):
    if comm.rank == 0:
        from pycomm.pipeline._wire import meta_of

        with pytest.raises(TypeError, match="complex64"):
            meta_of((torch.ones(2, dtype=torch.complex64),), "stage 0's output")
    return True


# ---------------------------------------------------------------- pipeline x data parallel

def _pipeline_x_dp(comm, m: int, rows: int):
    import pycomm.pipeline as pp

    pipe, dp = pp.pipeline_data_groups(comm, 2)
    parts = pp.split_sequential(_model(2), 2, balance=[2, 2])
    stage = pp.PipelineStage(parts[pipe.rank], pipe.rank, 2, pipe)
    sched = pp.Schedule1F1B(stage, m, _loss, dp_comm=dp)
    x, y = _batch(rows)
    replica = comm.rank // 2
    x, y = x.chunk(2)[replica], y.chunk(2)[replica]  # each replica its half
    if stage.is_first:
        sched.step(x)
    else:
        sched.step(target=y)
    grads = [p.grad.clone() for p in stage.submod.parameters()]
    pipe.close()
    dp.close()
    return stage.stage_index, grads


def test_pipeline_x_data_parallel_matches_one_process():
    m, rows = 4, 16
    per_rank = run_ranks(_pipeline_x_dp, 4, TRANSPORT, m, rows)
    # one process: the mean over both replicas' microbatches (4 + 4 of 2 rows)
    from pycomm.pipeline import split_sequential

    model = _model(2)
    x, y = _batch(rows)
    losses = [_loss(model(a), b) for half_x, half_y in zip(x.chunk(2), y.chunk(2))
              for a, b in zip(half_x.chunk(m), half_y.chunk(m))]
    torch.stack(losses).mean().backward()
    ref = [[p.grad for p in s.parameters()] for s in split_sequential(model, 2, balance=[2, 2])]
    for r, (stage, grads) in enumerate(per_rank):
        assert stage == r % 2
        for g, want in zip(grads, ref[stage]):
            torch.testing.assert_close(g, want, **TOL, msg=f"rank {r} stage {stage}")


# ---------------------------------------------------------------- the example

def test_example_pipeline_train_under_torchrun():
    import re

    from tests._dist import run_torchrun

    proc = run_torchrun("examples/pipeline_train.py", 2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(v) for v in re.findall(r"step +\d+  loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0], proc.stdout
    held = dict(re.findall(r"rank (\d): stage \d held at most (\d+) microbatches", proc.stdout))
    assert held == {"0": "2", "1": "1"}, proc.stdout


def test_interleaved_on_one_rank_hands_over_in_memory():
    # all three stages on rank 0: no transfer, only the in-memory hand-over
    per_rank = run_ranks(_pipeline_cases, 1, TRANSPORT, "interleaved", 3, SPLITS)
    _check_against_reference(per_rank, 1, 3, SPLITS)
