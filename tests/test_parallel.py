"""pycomm.parallel.DistributedDataParallel on real ranks, against two
independent references: one process training on the full batch, and torch's
own DistributedDataParallel over gloo on the same ranks."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._dist import run_ranks

TOL = dict(rtol=1e-5, atol=1e-5)
PER_RANK = 4  # rows of the global batch each rank takes
STEPS = 4
LR = 0.1


# ---------------------------------------------------------------- helpers

_TORCH_GROUPS: dict = {}


def _torch_group(comm):
    """A gloo process group on the pool's store for torch's DDP (the peer
    reference), built once per process by hand so that the pool processes,
    which other test files share, keep having no default group."""
    if comm.world_size not in _TORCH_GROUPS:
        store = dist.PrefixStore("test_parallel/gloo", comm._store)
        gloo = dist.ProcessGroupGloo(store, comm.rank, comm.world_size, timedelta(seconds=60))
        pg = dist.ProcessGroup(store, comm.rank, comm.world_size)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        _TORCH_GROUPS[comm.world_size] = pg
    return _TORCH_GROUPS[comm.world_size]


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(),
                         nn.Linear(12, 3))


def _batches(world: int, steps: int = STEPS, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(world * PER_RANK, 6, generator=g), torch.randn(world * PER_RANK, 3,
                                                                        generator=g))
            for _ in range(steps)]


def _local(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * PER_RANK:(rank + 1) * PER_RANK]


def _step(model, opt, x, y, set_to_none=True):
    opt.zero_grad(set_to_none=set_to_none)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()


def _train(model, batches, rank=None, set_to_none=True):
    """SGD on each batch (the rank's rows, or all of them when rank is None)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches:
        if rank is not None:
            x, y = _local(x, rank), _local(y, rank)
        _step(model, opt, x, y, set_to_none)
    return model


def _assert_same_params(a: nn.Module, b: nn.Module, what: str, **tol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, **(tol or TOL), msg=lambda m: f"{what}: {name}: {m}")


def _pycomm_ddp(comm, module, **kwargs):
    from pycomm.parallel import DistributedDataParallel

    return DistributedDataParallel(module, comm, **kwargs)


def _torch_ddp(comm, module, **kwargs):
    kwargs.pop("first_bucket_mb", None)
    return nn.parallel.DistributedDataParallel(module, process_group=_torch_group(comm), **kwargs)


# ---------------------------------------------------------------- equality

CONFIGS = {
    "default": {},
    "small_buckets": dict(bucket_cap_mb=1e-6, first_bucket_mb=1e-6),  # one per parameter
    "one_bucket": dict(bucket_cap_mb=1000, first_bucket_mb=1000),
    "bucket_view": dict(gradient_as_bucket_view=True, bucket_cap_mb=0.0005),
}


def _equality_case(comm, config_name):
    kwargs = CONFIGS[config_name]
    n, r = comm.world_size, comm.rank
    batches = _batches(n)
    reference = _mlp(100)  # one process, full batch, rank 0's init
    ours = _pycomm_ddp(comm, _mlp(100 + r), **kwargs)  # other ranks start elsewhere
    _assert_same_params(ours.module, _mlp(100), "after the constructor's broadcast", rtol=0, atol=0)
    theirs = _torch_ddp(comm, _mlp(100 + r), **kwargs)
    for set_to_none in (True, False):
        _train(ours, batches, r, set_to_none)
        _train(theirs, batches, r, set_to_none)
        _train(reference, batches, set_to_none=set_to_none)
    _assert_same_params(ours.module, reference, "vs full batch")
    _assert_same_params(ours.module, theirs.module, "vs torch DDP")
    buckets = ours.bucket_assignment()
    if config_name == "small_buckets":
        assert len(buckets) == 6 and all(len(b) == 1 for b in buckets), buckets
    if config_name in ("one_bucket", "default"):
        assert len(buckets) == 1, buckets
    if config_name == "bucket_view":
        assert len(buckets) > 1
        storages = {name: p.grad.untyped_storage().data_ptr()
                    for name, p in ours.module.named_parameters()}
        for bucket in buckets:
            assert len({storages[name] for name in bucket}) == 1, "grads are views of one buffer"
        assert len({storages[b[0]] for b in buckets}) == len(buckets)
    stats = ours.stats()
    assert len(stats.iterations) == 2 * STEPS
    assert stats.bytes_reduced == 2 * STEPS * sum(p.numel() * 4 for p in ours.parameters())
    return [p.detach().clone() for p in ours.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_full_batch_and_torch_ddp(transport, world_size):
    per_rank = run_ranks(_equality_case, world_size, transport, "default")
    for r in range(1, world_size):  # bitwise identical replicas
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0], per_rank[r]))


@pytest.mark.parametrize("config", ["small_buckets", "one_bucket", "bucket_view"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_bucket_configs_match(world_size, config):
    run_ranks(_equality_case, world_size, "shm", config)


# ---------------------------------------------------------------- rebuild

class _Scrambled(nn.Module):
    """Gradients are ready in an order unlike reverse registration, and
    (two independent branches built in rank-dependent order) unlike on the
    other ranks."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.a, self.b = nn.Linear(6, 8), nn.Linear(6, 6)
        self.p, self.q = nn.Linear(8, 3), nn.Linear(8, 3)
        self.rank = rank

    def forward(self, x):
        h = torch.tanh(self.a(torch.tanh(self.b(x))))  # b before a
        branches = [self.p, self.q] if self.rank % 2 == 0 else [self.q, self.p]
        outs = [f(h) for f in branches]
        return outs[0] + outs[1]


def _rebuild_case(comm):
    n, r = comm.world_size, comm.rank
    batches = _batches(n)
    ddp = _pycomm_ddp(comm, _Scrambled(r), bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    names = {id(p): name for name, p in ddp.module.named_parameters()}
    ready: list[str] = []
    for p in ddp.module.parameters():
        p.register_post_accumulate_grad_hook(lambda q: ready.append(names[id(q)]))
    before = ddp.bucket_assignment()
    _train(ddp, batches[:1], r)
    first_order = list(ready)
    after = ddp.bucket_assignment()
    _train(ddp, batches[1:], r)
    # On shm every bucket moved into symmetric memory at its first
    # all-reduce (the rebuilt ones too), and the later ones ran from there.
    assert all(comm.is_registered(b.buffer) for b in ddp._buckets)
    assert comm.symmetric_all_reduces > 0
    reference = _train(_Scrambled(0), batches)
    _assert_same_params(ddp.module, reference, "vs full batch")
    assert ddp.stats().rebuilt_after == 1
    return before, first_order, after, ddp.bucket_assignment()


@pytest.mark.parametrize("world_size", [2, 3])
def test_rebuild_adopts_rank0_ready_order(world_size):
    results = run_ranks(_rebuild_case, world_size, "shm")
    registration = [name for name, _ in _Scrambled(0).named_parameters()]
    order0 = results[0][1]
    assert results[1][1] != order0, "the ranks' ready orders should differ (test has no teeth)"
    assert order0 != list(reversed(registration))
    for before, _, after, final in results:
        assert before == [[name] for name in reversed(registration)]
        assert after == [[name] for name in order0]  # every rank adopts rank 0's order
        assert final == after  # rebuilt once


# ---------------------------------------------------------------- no_sync

def _no_sync_case(comm, bucket_view):
    n, r = comm.world_size, comm.rank
    micro = _batches(n, steps=3 * 3)
    ddp = _pycomm_ddp(comm, _mlp(3), gradient_as_bucket_view=bucket_view)
    reference = _mlp(3)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (ddp, reference)]
    local_grads = []
    for step in range(3):
        for opt in opts:
            opt.zero_grad()
        for k in range(3):
            x, y = micro[3 * step + k]
            nn.functional.mse_loss(reference(x), y).backward()
            if k < 2:
                with ddp.no_sync():
                    nn.functional.mse_loss(ddp(_local(x, r)), _local(y, r)).backward()
                local_grads.append(ddp.module[0].weight.grad.clone())
            else:
                nn.functional.mse_loss(ddp(_local(x, r)), _local(y, r)).backward()
        for opt in opts:
            opt.step()
    _assert_same_params(ddp.module, reference, "no_sync accumulation vs full batch")
    assert len(ddp.stats().iterations) == 3  # only synchronised backwards communicate
    return local_grads


@pytest.mark.parametrize("bucket_view", [False, True])
@pytest.mark.parametrize("world_size", [2, 3])
def test_no_sync_accumulates_locally(world_size, bucket_view):
    per_rank = run_ranks(_no_sync_case, world_size, "shm", bucket_view)
    assert not torch.allclose(per_rank[0][0], per_rank[1][0]), "no_sync grads must stay local"


# ---------------------------------------------------------------- unused parameters

class _WithUnused(nn.Module):
    """`extra` is used on `users` ranks only (all, some or none)."""

    def __init__(self, rank: int, users: str) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.body, self.extra, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.uses_extra = users == "all" or (users == "rank0" and rank == 0)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        if self.uses_extra:
            h = h + self.extra(h)
        return self.head(h)


def _unused_case(comm, users, static_graph):
    n, r = comm.world_size, comm.rank
    batches = _batches(n)
    kwargs = dict(bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    if static_graph:
        kwargs["static_graph"] = True
    else:
        kwargs["find_unused_parameters"] = True
    ours = _train(_pycomm_ddp(comm, _WithUnused(r, users), **kwargs), batches, r)
    theirs = _train(_torch_ddp(comm, _WithUnused(r, users), **kwargs), batches, r)
    _assert_same_params(ours.module, theirs.module, "vs torch DDP")
    if users == "none":
        assert ours.module.extra.weight.grad is None  # unused everywhere: left alone
        assert torch.equal(ours.module.extra.weight, _WithUnused(0, "none").extra.weight)
    else:
        torch.testing.assert_close(ours.module.extra.weight.grad, theirs.module.extra.weight.grad)


@pytest.mark.parametrize("static_graph", [False, True])
@pytest.mark.parametrize("users", ["none", "rank0"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_unused_parameters_handled(world_size, users, static_graph):
    run_ranks(_unused_case, world_size, "shm", users, static_graph)


def _unused_error_case(comm, users):
    n, r = comm.world_size, comm.rank
    ddp = _pycomm_ddp(comm, _WithUnused(r, users), bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    x, y = _batches(n, steps=1)[0]
    with pytest.raises(RuntimeError, match="did not receive a gradient on every rank") as err:
        nn.functional.mse_loss(ddp(_local(x, r)), _local(y, r)).backward()
    assert "extra.weight" in str(err.value) and "find_unused_parameters=True" in str(err.value)
    t = torch.ones(3)
    comm.all_reduce(t)  # collectives still matched up on every rank
    assert torch.all(t == n)


@pytest.mark.parametrize("users", ["none", "rank0"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_unused_parameter_without_find_unused_raises_everywhere(world_size, users):
    run_ranks(_unused_error_case, world_size, "shm", users)


# ---------------------------------------------------------------- buffers

def _frozen_model(seed: int) -> nn.Module:
    """An MLP whose first layer is frozen (requires_grad=False), as in fine-tuning."""
    model = _mlp(seed)
    model[0].requires_grad_(False)
    return model


def _frozen_case(comm):
    n, r = comm.world_size, comm.rank
    batches = _batches(n)
    ours = _pycomm_ddp(comm, _frozen_model(200 + r))  # frozen weights differ per rank
    theirs = _torch_ddp(comm, _frozen_model(200 + r))
    # As torch's DDP: the constructor copies rank 0's parameters, frozen ones too.
    _assert_same_params(ours.module, _frozen_model(200), "frozen layer after the constructor",
                        rtol=0, atol=0)
    _train(ours, batches, r)
    _train(theirs, batches, r)
    _assert_same_params(ours.module, _train(_frozen_model(200), batches), "vs full batch")
    _assert_same_params(ours.module, theirs.module, "vs torch DDP")


@pytest.mark.parametrize("world_size", [2, 3])
def test_frozen_parameters_broadcast_from_rank0(world_size):
    run_ranks(_frozen_case, world_size, "shm")


def _frozen_mismatch_case(comm):
    # Frozen parameters are broadcast too: ranks whose frozen shapes differ
    # (or that freeze different parameters) must raise, not broadcast garbage.
    model = _frozen_model(1)
    if comm.rank == 1:
        model[0] = nn.Linear(6, 8).requires_grad_(False)
    with pytest.raises(ValueError, match=r"parameter 0 \('0.weight'.*frozen float32 on rank 1"):
        _pycomm_ddp(comm, model)
    model = _mlp(1)
    if comm.rank == 1:
        model[0].bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"'0.bias'.*float32 on rank 0 but .* frozen float32"):
        _pycomm_ddp(comm, model)
    t = torch.ones(3)
    comm.all_reduce(t)  # collectives still matched up on every rank
    assert torch.all(t == comm.world_size)


def test_frozen_parameter_mismatch_raises_on_every_rank():
    run_ranks(_frozen_mismatch_case, 2, "shm", timeout=60)


def _coalesced_layouts_case(comm):
    from pycomm.parallel._sync import broadcast_coalesced

    r = comm.rank
    # Odd byte counts before a non-contiguous tensor (e.g. a bool buffer, then
    # a channels_last weight): its bytes start at an unaligned offset.
    mask = torch.full((3,), r == 0)
    weight = torch.full((4, 5), float(r + 1)).t()
    half = torch.full((3,), float(r + 1), dtype=torch.float16)
    grid = torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1) * (r + 1)
    broadcast_coalesced(comm, [mask, weight, half, grid], src=0)
    assert not weight.is_contiguous() and not grid.is_contiguous()
    assert torch.equal(mask, torch.ones(3, dtype=torch.bool))
    assert torch.equal(weight, torch.ones(5, 4))
    assert torch.equal(half, torch.ones(3, dtype=torch.float16))
    assert torch.equal(grid, torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1))


def test_broadcast_coalesced_unaligned_non_contiguous():
    run_ranks(_coalesced_layouts_case, 2, "shm")


def _bn_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    model[1].running_mean.fill_(float(seed))  # differs by rank before wrapping
    return model


def _buffers_case(comm, broadcast_buffers):
    n, r = comm.world_size, comm.rank
    batches = _batches(n)
    ours = _pycomm_ddp(comm, _bn_model(20 + r), broadcast_buffers=broadcast_buffers)
    initial = _bn_model(20 + (0 if broadcast_buffers else r))[1].running_mean
    assert torch.equal(ours.module[1].running_mean, initial)
    theirs = _torch_ddp(comm, _bn_model(20 + r), broadcast_buffers=broadcast_buffers)
    _train(ours, batches, r)
    _train(theirs, batches, r)
    _assert_same_params(ours.module, theirs.module, "vs torch DDP")
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ours.module[1], name), getattr(theirs.module[1], name))
    return ours.module[1].running_mean.clone()


@pytest.mark.parametrize("broadcast_buffers", [True, False])
@pytest.mark.parametrize("world_size", [2, 3])
def test_batchnorm_buffers(world_size, broadcast_buffers):
    run_ranks(_buffers_case, world_size, "shm", broadcast_buffers)


def test_buffer_broadcast_changes_training():
    """Teeth for the test above: the broadcast does change rank 1's statistics."""
    with_bc = run_ranks(_buffers_case, 2, "shm", True)
    without = run_ranks(_buffers_case, 2, "shm", False)
    assert not torch.allclose(with_bc[1], without[1])


# ---------------------------------------------------------------- join

def _join_reference(world, counts, divide_by_initial):
    """One process: iteration k averages the gradients of the ranks that still
    have batch k (joined ranks count as zeros, or not at all)."""
    model = _mlp(40)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches = _batches(world, steps=max(counts))
    for k, (x, y) in enumerate(batches):
        active = [r for r in range(world) if counts[r] > k]
        opt.zero_grad()
        for r in active:
            loss = nn.functional.mse_loss(model(_local(x, r)), _local(y, r))
            (loss / (world if divide_by_initial else len(active))).backward()
        opt.step()
    return model


def _join_case(comm, counts, divide_by_initial, hook):
    n, r = comm.world_size, comm.rank
    ddp = _pycomm_ddp(comm, _mlp(40), bucket_cap_mb=0.001)
    if hook:
        ddp.register_comm_hook(comm, _sum_then_scale_hook(1.0 / n))
    batches = _batches(n, steps=max(counts))[:counts[r]]
    with ddp.join(divide_by_initial_world_size=divide_by_initial):
        _train(ddp, batches, r)
    reference = _join_reference(n, counts, divide_by_initial)
    _assert_same_params(ddp.module, reference, "join vs reference")


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_uneven_inputs(world_size):
    counts = [2, 4, 3][:world_size]  # rank 0 runs out first
    run_ranks(_join_case, world_size, "shm", counts, True, False)
    run_ranks(_join_case, world_size, "shm", counts[::-1], False, False)
    run_ranks(_join_case, world_size, "shm", counts, True, True)  # through a comm hook


def _join_throw_case(comm):
    n, r = comm.world_size, comm.rank
    ddp = _pycomm_ddp(comm, _mlp(40))
    batches = _batches(n, steps=3)[: 1 if r == 0 else 3]
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0\] exhausted"):
        with ddp.join(throw_on_early_termination=True):
            _train(ddp, batches, r)
    comm.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_throw_on_early_termination(world_size):
    run_ranks(_join_throw_case, world_size, "shm")


# ---------------------------------------------------------------- comm hooks

def _sum_then_scale_hook(scale):
    """A hook written on the public API: SUM all-reduce, then scale."""
    def hook(comm, bucket):
        fut = comm.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].mul_(scale))
    return hook


def _hook_case(comm, which):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    n, r = comm.world_size, comm.rank
    batches = _batches(n)
    ddp = _pycomm_ddp(comm, _mlp(50), bucket_cap_mb=0.001, first_bucket_mb=0.0005)
    seen = []
    if which == "ours":
        inner = _sum_then_scale_hook(1.0 / n)

        def hook(state, bucket):
            grads, params = bucket.gradients(), bucket.parameters()
            assert [g.shape for g in grads] == [p.shape for p in params]
            assert bucket.buffer().numel() == sum(p.numel() for p in params)
            seen.append((bucket.index(), bucket.is_last()))
            return inner(state, bucket)

        ddp.register_comm_hook(comm, hook)
        with pytest.raises(RuntimeError, match="only be called once"):
            ddp.register_comm_hook(comm, hook)
    elif which == "torch_allreduce":
        ddp.register_comm_hook(_torch_group(comm), default_hooks.allreduce_hook)
    elif which == "torch_fp16":
        ddp.register_comm_hook(_torch_group(comm), default_hooks.fp16_compress_hook)
    elif which == "pycomm_hooks":
        from pycomm import hooks

        ddp.register_comm_hook(comm, hooks.allreduce_hook)
    _train(ddp, batches, r)
    tol = dict(rtol=2e-3, atol=2e-3) if which == "torch_fp16" else {}
    _assert_same_params(ddp.module, _train(_mlp(50), batches), f"hook {which} vs full batch",
                        **tol)
    if which == "ours":
        starts = [k for k, (index, _) in enumerate(seen) if index == 0] + [len(seen)]
        assert len(starts) == STEPS + 1
        for a, b in zip(starts, starts[1:]):  # each iteration: 0, 1, ..., last
            assert seen[a:b] == [(i, i == b - a - 1) for i in range(b - a)] and b - a > 1


HOOKS = ["ours", "torch_allreduce", "torch_fp16"]
try:
    import pycomm.hooks  # noqa: F401 (another branch; tested once it is here)

    HOOKS.append("pycomm_hooks")
except ImportError:
    pass


@pytest.mark.parametrize("which", HOOKS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_comm_hooks(world_size, which):
    run_ranks(_hook_case, world_size, "shm", which)


def _bad_hook_case(comm):
    ddp = _pycomm_ddp(comm, _mlp(1))
    with pytest.raises(TypeError, match="callable"):
        ddp.register_comm_hook(comm, 3)
    with pytest.raises(TypeError, match="two arguments"):
        ddp.register_comm_hook(comm, lambda bucket: bucket)

    def wrong_size(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer()[:1])
        return fut

    ddp.register_comm_hook(comm, wrong_size)
    x, y = _batches(comm.world_size, steps=1)[0]
    with pytest.raises(RuntimeError, match="expected a tensor of"):
        nn.functional.mse_loss(ddp(x), y).backward()


def test_bad_comm_hooks():
    run_ranks(_bad_hook_case, 2, "shm")


# ---------------------------------------------------------------- bad input

class _RankShaped(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 5 if rank == 1 else 4)


def _mismatch_case(comm):
    with pytest.raises(ValueError, match=r"parameter 2 \('fc2.weight'.*rank 1"):
        _pycomm_ddp(comm, _RankShaped(comm.rank))
    model = nn.Linear(3, 3)
    if comm.rank == 1:
        model = model.double().to(torch.complex64)  # fails a local check on rank 1 only
    with pytest.raises((TypeError, ValueError), match="complex64"):
        _pycomm_ddp(comm, model)
    comm.barrier()


def test_parameter_mismatch_raises_on_every_rank():
    run_ranks(_mismatch_case, 3, "shm")


def _bad_args_case(comm):
    from pycomm.parallel import DistributedDataParallel

    with pytest.raises(TypeError, match="module"):
        DistributedDataParallel("not a module", comm)
    with pytest.raises(TypeError, match="comm"):
        DistributedDataParallel(nn.Linear(2, 2), comm="gloo")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DistributedDataParallel(nn.Linear(2, 2), comm, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="first_bucket_mb"):
        DistributedDataParallel(nn.Linear(2, 2), comm, first_bucket_mb=-1)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="requires grad"):
        DistributedDataParallel(frozen, comm)
    ddp = DistributedDataParallel(nn.Linear(2, 2))  # comm=None: the default communicator
    assert ddp.comm is comm


def test_bad_arguments():
    run_ranks(_bad_args_case, 2, "shm")


# ---------------------------------------------------------------- example

def test_example_ddp_train_runs_under_torchrun():
    from tests._dist import run_torchrun

    out = run_torchrun("examples/ddp_train.py", 2, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pycomm DDP:" in out.stdout and "hidden behind backward" in out.stdout
    assert "replicas identical: True" in out.stdout
