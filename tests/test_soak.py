"""The soak harness (pycomm/bench/soak.py): its reference and checks, one
rank in process (a wrong result is caught), and short soaks of mixed
traffic over shm and gloo that must end with every result verified and
nothing leaked (issue 41's CI soak; the hours-long runs are recorded under
benchmarks/soak)."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pycomm.bench import resources, soak

ROOT = Path(__file__).resolve().parents[1]


def test_reference_and_comparison():
    a, b = torch.tensor([1, -3, 2], dtype=torch.int8), torch.tensor([2, 3, -2], dtype=torch.int8)
    assert soak.reference([a, b], "sum").tolist() == [3.0, 0.0, 0.0]
    assert soak.reference([a, b], "max").tolist() == [2.0, 3.0, 2.0]
    assert soak.reference([a, b], "min").tolist() == [1.0, -3.0, -2.0]
    assert soak.reference([a, b], "product").tolist() == [2.0, -9.0, -4.0]
    assert soak.reference([a.float(), b.float()], "avg").tolist() == [1.5, 0.0, 0.0]
    assert soak.same(torch.tensor([1.5, 0.0], dtype=torch.bfloat16), torch.tensor([1.5, 0.0]), "avg")
    assert not soak.same(torch.tensor([1, 2]), torch.tensor([1.0, 3.0]), "sum")
    assert not soak.same(torch.tensor([1]), torch.tensor([1.0, 1.0]), "sum")


def test_program_is_the_same_on_every_rank_and_exact():
    """Ranks draw the same steps from the seed; the inputs keep every
    reduction exact in its dtype at the largest world."""
    steps = [[soak.draw(r, i, 4, 1 << 20) for i in range(300)]
             for r in (random.Random(7), random.Random(7))]
    assert steps[0] == steps[1]
    assert {s.kind for s in steps[0]} == set(soak.KINDS)
    for step in steps[0][:60]:
        if step.op == "avg":
            continue
        inputs = [soak.rank_input(7, step, q) for q in range(soak.MAX_WORLD)]
        want = soak.reference(inputs, step.op)
        got = inputs[0].clone()
        for t in inputs[1:]:
            got = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum,
                   "product": torch.mul}[step.op](got, t)
        assert soak.same(got, want, step.op), (step, got[:4], want[:4])


def _one_rank_soak(steps: int, patch=None) -> soak.Soak:
    """``steps`` steps of a one-rank soak in this process (``patch(comm)``
    first, if given); the finished Soak."""
    import pycomm

    comm = pycomm.init(rank=0, world_size=1, store=torch.distributed.HashStore(), set_default=False)
    s = soak.Soak(comm, argparse.Namespace(seed=3, max_bytes=1 << 16, leave_out=frozenset()))
    if patch is not None:
        patch(comm)
    try:
        for i in range(steps):
            s.run_step(i)
        s.drain()
    finally:
        comm.close()
    return s


def test_every_kind_runs_and_verifies_on_one_rank():
    s = _one_rank_soak(400)
    assert s.wrong == 0, s.first_wrong
    assert s.ops == 400 and s.verified > 300


def test_a_wrong_result_is_caught():
    """The harness can fail: an all-reduce that adds one to floating tensors
    is counted wrong, named, and the run goes on."""
    def patch(comm):
        real = comm.all_reduce

        def off_by_one(t, *args, **kwargs):
            work = real(t, *args, **kwargs)
            if work is not None:
                work.wait()
            if t.numel() and t.is_floating_point():  # not DDP's int bookkeeping
                t.add_(1)
            return work  # done already

        comm.all_reduce = off_by_one

    s = _one_rank_soak(200, patch)
    assert s.wrong > 0 and any(" all_reduce " in w for w in s.first_wrong), s.first_wrong
    assert s.verified > 0  # the other kinds still verify


@pytest.mark.parametrize("transport, nproc, seconds", [
    ("shm", 3, 40), ("gloo", 2, 20),
    pytest.param("shm", 3, 300, marks=pytest.mark.slow),
    pytest.param("gloo", 3, 180, marks=pytest.mark.slow)])
def test_soak_mixed_traffic(tmp_path, transport, nproc, seconds):
    """Mixed traffic (80 s of soak in the default run with the
    simulated hosts' below; minutes more in the slow variants): every result verified, nothing wrong, no fd / thread /
    /dev/shm leak (exit status 0)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "soak.json"
    res = subprocess.run(
        [sys.executable, "-m", "pycomm.bench", "soak", "--nproc", str(nproc), "--transport",
         transport, "--duration", str(seconds), "--seed", "11", "--max-bytes", "1M",
         "--report", "30", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=seconds + 240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["wrong"] == 0 and data["verified"] > 100 and data["steps"] > 50
    assert data["fd_growth"] == 0 and data["thread_growth"] == 0 and data["shm_segments_left"] == []
    assert data["world_size"] == nproc and data["transport"] == transport
    assert "rss_trend_mb" in data and data["max_rss_growth_mb"] > 0
    assert "heap_trend_mb" in data["per_rank"][0]
    assert "0 wrong" in res.stdout


def test_soak_across_simulated_hosts(tmp_path):
    """--hosts 2 --nproc 2: the ranks on two simulated hosts take
    transport="auto" (shm+gloo), receives name their source, all verified."""
    from pycomm.bench.simhosts import unavailable_reason

    why = unavailable_reason()
    if why:
        pytest.skip(why)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "soak.json"
    res = subprocess.run(
        [sys.executable, "-m", "pycomm.bench", "soak", "--hosts", "2", "--nproc", "2",
         "--duration", "20", "--seed", "12", "--max-bytes", "256K", "--report", "30",
         "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=270)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["transport"] == "shm+gloo" and data["world_size"] == 4
    assert data["wrong"] == 0 and data["verified"] > 100
    assert data["fd_growth"] == 0 and data["thread_growth"] == 0 and data["shm_segments_left"] == []


def test_rss_trend_is_late_minus_early_median():
    """A leak shows as the last quarter's median over the second quarter's;
    a single large-step sample does not."""
    steady = [(t, 100.0) for t in range(100)]
    assert resources.rss_trend_mb(steady, 100.0) == 0.0
    spike = [(t, 900.0 if t == 80 else 100.0) for t in range(100)]
    assert resources.rss_trend_mb(spike, 100.0) == 0.0
    leak = [(t, 100.0 + t) for t in range(100)]
    assert resources.rss_trend_mb(leak, 100.0) > 40.0
    assert resources.rss_trend_mb([(1.0, 5.0)], 100.0) == 0.0  # too few samples


_FREED_BUT_KEPT = """
import ctypes, json
from pycomm.bench import resources
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
# 64 KiB chunks stay in the heap (under glibc's mmap threshold); the last one
# stays alive, so free() cannot give the space below it back by itself.
chunks = [libc.malloc(64 << 10) for _ in range(1025)]
for c in chunks:
    ctypes.memset(c, 1, 64 << 10)
for c in chunks[:-1]:
    libc.free(c)
print(json.dumps([resources.rss_mb(), resources.rss_mb(trim=True)]))
"""


def test_rss_after_malloc_trim_leaves_out_what_the_allocator_keeps_free():
    """``--malloc-trim``'s sample: 64 MiB freed but kept by glibc counts in
    the plain RSS and not after the trim (so a trend that remains is memory
    in use, not the allocator's)."""
    res = subprocess.run([sys.executable, "-c", _FREED_BUT_KEPT], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    plain, trimmed = json.loads(res.stdout)
    assert plain - trimmed > 48, (plain, trimmed)


_IN_USE_THEN_FREED = r"""
import ctypes, json
from pycomm.bench import resources
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
before = resources.heap_mb()
chunks = [libc.malloc(64 << 10) for _ in range(1025)]
held = resources.heap_mb()
for c in chunks[:-1]:
    libc.free(c)
print(json.dumps([before, held, resources.heap_mb()]))
"""


def test_heap_in_use_counts_what_malloc_handed_out_and_not_what_it_keeps():
    """The soak's second trend: 64 MiB malloc'ed count while held, and no
    longer once freed, though glibc keeps those pages (the test above)."""
    res = subprocess.run([sys.executable, "-c", _IN_USE_THEN_FREED], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    before, held, freed = json.loads(res.stdout)
    if before is None:
        pytest.skip("no mallinfo2 in this libc")
    assert held - before > 63 and held - freed > 63, (before, held, freed)


def test_leave_out_never_draws_the_kind():
    rng = random.Random(5)
    kinds = {soak.draw(rng, i, 3, 1 << 16, frozenset({"new_group"})).kind for i in range(3000)}
    assert "new_group" not in kinds and len(kinds) == len(soak.KINDS) - 1
    with pytest.raises(SystemExit):
        soak.parse_args(["--leave-out", "reboot"])
