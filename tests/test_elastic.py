"""Elastic training (examples/elastic_train.py) under a real torchrun: a
worker SIGKILLed in the middle of a backward, then the job recovers.

Restart: torchrun restarts every worker, the new attempt rendezvous under
its own store keys (pycomm scopes them by TORCHELASTIC_RESTART_COUNT) and
resumes from rank 0's checkpoint; the final parameters equal an
uninterrupted run's. Before the attempt scoping, the second attempt read
the first one's shm segment name and failed.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests._dist import run_script_ranks, run_torchrun

EXAMPLE = "examples/elastic_train.py"
STEPS = "8"


def _final(tmp_path, name: str) -> list[torch.Tensor]:
    return torch.load(tmp_path / name)


def _shm_names() -> set[str]:
    """pycomm's segments in /dev/shm whose creator is gone: a leak once the
    test's ranks have ended (another job's live segments, as in a second test
    run sharing the machine, are not)."""
    from pycomm import _setup

    return set(_setup.orphan_segments())


def _reference(world: int, steps: int, survivors: list[int] | None = None,
               from_step: int = 0) -> list[torch.Tensor]:
    """One process, float64: the example's model and data, the gradient
    averaged over the ranks' batches (what DDP computes); from step
    ``from_step`` on, over the ``survivors``' batches only."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    try:
        import elastic_train as ex
    finally:
        sys.path.pop(0)
    model = ex.make_model().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        ranks = survivors if survivors is not None and step >= from_step else range(world)
        for r in ranks:
            x, y = ex.batch(r, step)
            (torch.nn.functional.mse_loss(model(x.double()), y.double()) / len(ranks)).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


# "--torch": torch's DDP over backend "pycomm" instead of pycomm's DDP.
# The two 2-rank shm variants failed once each in CI rehearsals under load
# (a worker SIGKILLed by the agent, exit -9; cause not found, issue 41):
# slow until that is understood.
@pytest.mark.parametrize("world, transport, flags", [
    pytest.param(2, "shm", [], marks=pytest.mark.slow), (2, "gloo", []), (3, "shm", []),
    pytest.param(2, "shm", ["--torch"], marks=pytest.mark.slow),
    pytest.param(3, "gloo", [], marks=pytest.mark.slow),
])
def test_torchrun_restart_after_a_worker_is_killed_mid_backward(tmp_path, world, transport,
                                                                flags):
    before = _shm_names()
    common = ["--steps", STEPS, "--transport", transport, *flags]
    plain = run_torchrun(EXAMPLE, world, *common, "--out", str(tmp_path / "plain.pt"),
                         timeout=240)
    assert plain.returncode == 0, plain.stderr[-4000:]
    killed = run_torchrun(EXAMPLE, world, *common, "--ckpt", str(tmp_path / "ckpt.pt"),
                          "--kill-rank", str(world - 1), "--kill-step", "3",
                          "--out", str(tmp_path / "killed.pt"), max_restarts=1, timeout=240)
    assert killed.returncode == 0, killed.stdout[-2000:] + killed.stderr[-6000:]
    # the survivors saw the death as a CommError, and the second attempt resumed
    assert "has died" in killed.stderr or "peer" in killed.stderr, killed.stderr[-4000:]
    for r in range(world):
        assert f"rank {r}: attempt 1 resumes at step" in killed.stdout, killed.stdout
    if transport == "shm":
        assert "uses gloo instead of shm" not in killed.stderr, killed.stderr[-4000:]
    for a, b, ref in zip(_final(tmp_path, "killed.pt"), _final(tmp_path, "plain.pt"),
                         _reference(world, int(STEPS))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        torch.testing.assert_close(a.double(), ref, rtol=1e-5, atol=1e-5)
    assert _shm_names() <= before


@pytest.mark.parametrize("world, transport, flags", [
    (2, "shm", []), (3, "shm", []), (3, "gloo", []), (3, "shm", ["--torch"]),
    pytest.param(2, "gloo", [], marks=pytest.mark.slow),
    pytest.param(3, "gloo", ["--torch"], marks=pytest.mark.slow),
])
def test_shrink_continues_on_the_survivors(tmp_path, world, transport, flags):
    """Shrink mode: ranks started without an elastic agent (a dead worker
    does not stop the others); the survivors shrink, rebind the DDP model
    (--torch: torch.distributed.shrink_group and a new torch DDP) and finish
    equal to a reference trained on their data from the failure step on."""
    before = _shm_names()
    victim, kill_step = 0 if world == 3 else 1, 3
    procs = run_script_ranks(EXAMPLE, world, "--steps", STEPS, "--transport", transport, *flags, "--shrink",
                             "--kill-rank", str(victim), "--kill-step", str(kill_step),
                             "--out", str(tmp_path / "shrunk.pt"), timeout=240)
    survivors = [r for r in range(world) if r != victim]
    assert procs[victim].returncode == -9
    for r in survivors:
        assert procs[r].returncode == 0, procs[r].stdout + procs[r].stderr[-4000:]
        assert f"rank {r}: step {kill_step} lost a peer" in procs[r].stdout
    assert f"trained {STEPS} steps on {world - 1} ranks" in procs[survivors[0]].stdout
    ref = _reference(world, int(STEPS), survivors, kill_step)
    for a, b in zip(_final(tmp_path, "shrunk.pt"), ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    assert _shm_names() <= before


def test_one_transport_decision_when_one_rank_cannot_map_the_segment(tmp_path):
    """Rank 1 runs with a /dev/shm of its own (a mount namespace, as in a
    container with a private IPC mount): it cannot map rank 0's segment.
    transport="auto" then falls back to gloo on every rank, never a mix, and
    the warning names rank 1 and its reason."""
    import shutil
    import subprocess
    import textwrap

    from tests._dist import master_store

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private /dev/shm")
    before = _shm_names()
    store = master_store(2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = textwrap.dedent(f"""
        import sys, warnings, torch, pycomm
        from tests._dist import client_store
        r = int(sys.argv[1])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            comm = pycomm.init(rank=r, world_size=2, store=client_store({store.port}, 2),
                               transport="auto", timeout=60)
        t = torch.ones(3)
        comm.all_reduce(t)
        print(comm.transport, t.tolist(), [str(w.message) for w in caught])
        comm.close()
    """)
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    private = ["unshare", "--mount", "--", "sh", "-c",
               'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]
    procs = [subprocess.Popen(prefix + [sys.executable, "-c", code, str(r)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r, prefix in ((0, []), (1, private))]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert out.startswith("gloo [2.0, 2.0, 2.0]"), out + err[-2000:]
        assert "rank 1" in out and "uses gloo instead of shm" in out, out
    assert _shm_names() <= before
