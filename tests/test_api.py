"""Rendezvous paths and the user-facing entry points."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests._dist import spawn_ranks

ROOT = Path(__file__).resolve().parent.parent


def test_torchrun_quickstart_three_ranks():
    """The README's quickstart under torchrun prints correct sums on 3 ranks."""
    from tests._dist import run_torchrun

    proc = run_torchrun("examples/quickstart.py", 3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import re

    # ranks print concurrently: lines may interleave, so match records, not lines
    ok = re.findall(r"rank (\d)/3 \[\w+\] all_reduce -> \[[^\]]*\] \(OK, expected 6\.0\)",
                    proc.stdout)
    assert sorted(ok) == ["0", "1", "2"], proc.stdout
    assert "WRONG" not in proc.stdout


def _init_from_torch_group(rank, world_size, port):
    import torch.distributed as dist

    import pycomm

    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        comm = pycomm.init(group=dist.group.WORLD, transport="gloo")
        t = torch.full((7,), float(rank))
        comm.all_reduce(t)
        ref = torch.full((7,), float(rank))
        dist.all_reduce(ref)  # torch's own collective as the independent reference
        same = torch.equal(t, ref)
        comm2 = pycomm.init(transport="gloo")  # default group picked up without arguments
        t2 = torch.ones(3)
        comm2.all_reduce(t2)
        comm.close()
        comm2.close()
        return same and bool(torch.all(t2 == world_size)) and comm.world_size == world_size
    finally:
        dist.destroy_process_group()


def test_init_from_torch_group_matches_torch_all_reduce():
    assert spawn_ranks(_init_from_torch_group, 3) == [True, True, True]


def _init_from_env(rank, world_size, port):
    import pycomm

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    comm = pycomm.init(transport="gloo")
    t = torch.tensor([rank + 1.0])
    comm.all_reduce(t, op="product")
    comm.close()
    return t.item()


def test_init_from_torchrun_environment():
    # the test process serves the store, as torchrun's agent does
    assert spawn_ranks(_init_from_env, 2) == [2.0, 2.0]


def test_init_without_rendezvous_says_how():
    import pycomm

    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR") if k in os.environ}
    try:
        with pytest.raises(ValueError, match="torchrun"):
            pycomm.init()
    finally:
        os.environ.update(env)


def test_reduce_op_spellings():
    import torch.distributed as dist

    import pycomm
    from pycomm.comm import _to_op

    assert _to_op("SUM") == _to_op(pycomm.ReduceOp.SUM) == _to_op(dist.ReduceOp.SUM) == 0
    assert _to_op("avg") == _to_op(dist.ReduceOp.AVG) == 1
    assert _to_op("prod") == _to_op("product") == _to_op(dist.ReduceOp.PRODUCT) == 4
    with pytest.raises(ValueError):
        _to_op(dist.ReduceOp.BAND)


def test_public_api_names():
    import pycomm

    for name in ["init", "Communicator", "ReduceOp", "Work", "P2POp", "CommError", "all_reduce",
                 "reduce_scatter", "all_gather", "broadcast", "send", "recv", "isend", "irecv",
                 "batch_isend_irecv", "barrier", "close"]:
        assert name in pycomm.__all__ and hasattr(pycomm, name), name
    assert issubclass(pycomm.CommError, RuntimeError)


@pytest.mark.slow
def test_jit_fallback_builds_when_no_prebuilt_extension(tmp_path):
    """A source tree without pycomm/_C*.so JIT-compiles on first import and says
    so on stderr (about 2 minutes on 2 cores, hence slow)."""
    import shutil

    tree = tmp_path / "src"
    shutil.copytree(ROOT / "pycomm", tree / "pycomm",
                    ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    shutil.copytree(ROOT / "csrc", tree / "csrc")
    code = ("import torch, pycomm\n"
            "with pycomm.init(rank=0, world_size=1, store=torch.distributed.HashStore()) as c:\n"
            "    t = torch.ones(3); c.all_reduce(t); print('sum', t.sum().item())\n")
    env = dict(os.environ, PYTHONPATH=str(tree), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "JIT-compiling" in proc.stderr and "sum 3.0" in proc.stdout


def _module_twins() -> list[str]:
    """The module-level twins: pycomm's public functions named like a
    Communicator method (pycomm.all_reduce, ...)."""
    import inspect

    import pycomm

    twins = [n for n in pycomm.__all__
             if inspect.isfunction(getattr(pycomm, n)) and hasattr(pycomm.Communicator, n)]
    assert {"all_reduce", "broadcast", "send", "split", "batch_isend_irecv"} <= set(twins)
    return twins


def test_module_twins_match_the_methods():
    """Every module-level twin (pycomm.all_reduce, ...) takes exactly its
    Communicator method's parameters: names, kinds (keyword-only markers
    included), defaults, annotations and return type (a parameter added to a
    method and not to its twin, as register= once was to all_reduce, fails
    here)."""
    import inspect

    import pycomm

    for name in _module_twins():
        method = inspect.signature(getattr(pycomm.Communicator, name))
        params = list(method.parameters.values())[1:]  # without self
        want = method.replace(parameters=params)
        got = inspect.signature(getattr(pycomm, name))
        if name == "close":  # closes the default communicator if there is one
            assert not got.parameters and not params, name
            continue
        assert got == want, f"pycomm.{name}{got} != Communicator.{name}{want}"


def test_module_twins_forward_every_argument(monkeypatch):
    """Every twin hands each of its arguments to its method on the default
    communicator, as that method's parameter of the same name (a twin that
    takes a parameter and drops it, leaving the method's default, or passes
    it on as another one, fails here)."""
    import inspect

    import pycomm

    calls: dict[str, dict] = {}

    class Recorder:
        def __getattr__(self, name: str):
            method = getattr(pycomm.Communicator, name)

            def record(*args, **kwargs):
                calls[name] = inspect.signature(method).bind(self, *args, **kwargs).arguments
                calls[name].pop("self")

            return record

    recorder = Recorder()
    monkeypatch.setattr(pycomm, "get_default", lambda: recorder)
    monkeypatch.setattr(pycomm, "is_initialized", lambda: True)  # close() asks first
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for name in _module_twins():
        params = list(inspect.signature(getattr(pycomm, name)).parameters.values())
        assert all(p.kind in (*positional, inspect.Parameter.KEYWORD_ONLY) for p in params), name
        sent = {p.name: object() for p in params}  # compared by identity
        getattr(pycomm, name)(*(sent[p.name] for p in params if p.kind in positional),
                              **{p.name: sent[p.name] for p in params if p.kind not in positional})
        assert name in calls, f"pycomm.{name} did not call Communicator.{name}"
        got = calls.pop(name)
        assert got.keys() == sent.keys() and all(got[k] is sent[k] for k in sent), \
            f"pycomm.{name} passed {sorted(got)} for {sorted(sent)}"


def test_all_reduce_arguments_as_the_binding_reads_them():
    """Communicator.all_reduce hands its arguments to a METH_FASTCALL binding
    (bindings.cpp, all_reduce_fastcall) that converts them itself: every
    spelling still works, and a wrong type is a TypeError (naming the argument
    where the binding checks the type itself; wire_block gets int()'s)."""
    import torch.distributed as dist

    import pycomm

    with pycomm.init(rank=0, world_size=1, store=dist.HashStore()) as c:
        t = torch.arange(4.0)
        for op in ("sum", dist.ReduceOp.MAX, pycomm.ReduceOp.MIN, 3, "avg"):
            assert c.all_reduce(t, op=op) is None
        work = c.all_reduce(t, async_op=1)  # a number or None, as pybind11 read it
        assert isinstance(work, pycomm.Work)
        work.wait()
        assert torch.equal(t, torch.arange(4.0))
        residual = torch.zeros(4)
        c.all_reduce(t, wire_dtype=torch.int8, wire_block=2.0, residual=residual)  # int() of it
        assert torch.allclose(t, torch.arange(4.0), atol=0.02)
        assert c.all_reduce(t, async_op=None) is None
        with pytest.raises(TypeError, match="async_op must be a bool, got str"):
            c.all_reduce(t, async_op="no")
        with pytest.raises(TypeError, match="algo must be a str, got int"):
            c.all_reduce(t, algo=3)
        with pytest.raises(TypeError, match="residual must be a torch.Tensor, got list"):
            c.all_reduce(t, wire_dtype=torch.int8, residual=[0.0] * 4)
        with pytest.raises(TypeError):
            c.all_reduce(t, wire_dtype=torch.int8, wire_block=[256])
        with pytest.raises(ValueError, match="op"):
            c.all_reduce(t, op=9)
        with pytest.raises(TypeError, match=r"8 positional arguments \(tensor, .*\), got 1"):
            c._impl.all_reduce(t)
