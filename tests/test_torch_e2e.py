"""torch's parallelism stack end to end over backend "pycomm": DTensor on a
2x2 DeviceMesh (distribute_tensor, redistribute, full_tensor), tensor
parallel Colwise/Rowwise forward + backward, FSDP2 training, then a DCP
checkpoint saved and loaded into a fresh model. Each result is compared with
one process computing the same thing on the whole tensor/batch. The same
bodies run on backend "gloo" (the ``gloo`` parameter, marked slow) as the
reference that the test itself is right."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_torchrun, spawn_ranks
from tests.test_backend import _init

BACKENDS = ["pycomm", pytest.param("gloo", marks=pytest.mark.slow)]


# ---------------------------------------------------------------- DTensor

def _dtensor_2x2(rank: int, n: int, port: int, backend: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    _init(rank, n, port, backend=backend)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = torch.randn(12, 10, dtype=torch.float64)  # same on every rank (seed)

    d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    row, col = mesh.get_coordinate()
    assert torch.equal(d.to_local(), full.chunk(2, 0)[row].chunk(2, 1)[col])
    assert torch.equal(d.full_tensor(), full)
    for placements in ([Replicate(), Shard(0)], [Shard(1), Replicate()],
                       [Shard(1), Shard(0)], [Replicate(), Replicate()]):
        r = d.redistribute(mesh, placements)
        assert torch.equal(r.full_tensor(), full), placements

    # Partial -> Replicate: a sum over the mesh of each rank's contribution
    part = torch.full((4, 3), float(rank + 1), dtype=torch.float64)
    from torch.distributed.tensor import DTensor

    p = DTensor.from_local(part, mesh, [Partial(), Partial()])
    assert torch.equal(p.full_tensor(), torch.full((4, 3), float(n * (n + 1) // 2),
                                                   dtype=torch.float64))
    s = p.redistribute(mesh, [Shard(0), Replicate()])
    assert torch.equal(s.full_tensor(), torch.full((4, 3), 10.0, dtype=torch.float64))
    return rank


@pytest.mark.parametrize("backend", BACKENDS)
def test_dtensor_2x2_mesh(backend):
    assert spawn_ranks(_dtensor_2x2, 4, backend, timeout=300) == [0, 1, 2, 3]


# ---------------------------------------------------------------- tensor parallel

def _mlp() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 6)).double()


def _tp(rank: int, n: int, port: int, backend: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _init(rank, n, port, backend=backend)
    ref, model = _mlp(), _mlp()
    mesh = init_device_mesh("cpu", (n,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    torch.manual_seed(2)
    x = torch.randn(5, 8, dtype=torch.float64)
    out, want = model(x), ref(x)
    torch.testing.assert_close(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)
    return rank


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_colwise_rowwise(backend):
    assert spawn_ranks(_tp, 2, backend, timeout=300) == [0, 1]


# ---------------------------------------------------------------- FSDP2 + DCP

def _fsdp2_dcp(rank: int, n: int, port: int, backend: str, ckpt: str) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    _init(rank, n, port, backend=backend)
    ref, model = _mlp(), _mlp()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    torch.manual_seed(3)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    shard = slice(rank * 8 // n, (rank + 1) * 8 // n)  # equal shards: the mean of means
    losses = []
    for _ in range(3):
        for m, o, xs, ys in ((model, opt, x[shard], y[shard]), (ref, ref_opt, x, y)):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(xs), ys)
            loss.backward()
            o.step()
        losses.append(loss.item())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, msg=name)

    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt)
    fresh = _mlp()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    for layer in (fresh[0], fresh[2]):
        fully_shard(layer)
    fully_shard(fresh)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh_opt.zero_grad()
    fresh(x[shard]).sum().backward()  # Adam's state exists before it is loaded into
    fresh_opt.step()
    state = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    fresh_opt.load_state_dict(state["optim"])
    for (name, p), q in zip(fresh.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, msg=f"loaded {name}")
    # one more step from the loaded checkpoint matches the reference's next step
    for m, o, xs, ys in ((fresh, fresh_opt, x[shard], y[shard]), (ref, ref_opt, x, y)):
        o.zero_grad()
        torch.nn.functional.mse_loss(m(xs), ys).backward()
        o.step()
    for (name, p), q in zip(fresh.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, msg=f"resumed {name}")
    return losses


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_train_then_dcp_roundtrip(backend, tmp_path):
    losses = spawn_ranks(_fsdp2_dcp, 2, backend, str(tmp_path / "ckpt"), timeout=300)
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0]


# ---------------------------------------------------------------- example

def test_fsdp2_dcp_example_under_torchrun(tmp_path):
    import re

    proc = run_torchrun("examples/fsdp2_dcp.py", 2, str(tmp_path / "ckpt"), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    loss = [float(x) for x in re.findall(r"step \d+ loss ([\d.]+)", proc.stdout)]
    assert len(loss) == 2 and loss[1] < loss[0], proc.stdout
    records = re.findall(r"rank (\d)/2 backend=pycomm checkpoint=\S+ loaded=OK", proc.stdout)
    assert sorted(records) == ["0", "1"], proc.stdout + proc.stderr
