"""SIGTERM and SIGHUP (torchrun stops a failed job's other workers with
SIGTERM): the rank's shm segment is unlinked, its peers fail at once with a
CommError naming the stopped rank, and the process ends as the signal's
default would. No handler stays installed after close(), and a handler the
user installed first is left alone (csrc/core/stop_signals.h)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests._dist import master_store

ROOT = Path(__file__).resolve().parent.parent


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("pycomm")}


def _rank(code: str, rank: int, world: int, port: int) -> subprocess.Popen:
    """A rank running ``code`` with ``comm_args`` for pycomm.init in scope."""
    prelude = textwrap.dedent(f"""
        import os, signal, sys, time, torch, pycomm
        from datetime import timedelta
        from tests._dist import client_store
        # The default dispositions, whatever the launcher left (nohup ignores SIGHUP)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        comm_args = dict(rank={rank}, world_size={world}, store=client_store({port}, {world}),
                         transport="shm", timeout=timedelta(seconds=60))
    """)
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code)],
                            env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(pred, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("signo", [signal.SIGTERM, signal.SIGHUP])
def test_stopped_during_init_leaves_nothing(signo):
    """Rank 0 creates the segment, then waits in init for rank 1, which never
    comes: the signal still removes the segment's name."""
    before = _shm_names()
    store = master_store(2)
    p = _rank("pycomm.init(**comm_args)", 0, 2, store.port)
    _wait_for(lambda: _shm_names() - before)  # the segment exists
    p.send_signal(signo)
    p.communicate(timeout=60)
    assert p.returncode == -signo
    assert _shm_names() <= before


@pytest.mark.parametrize("signo", [signal.SIGTERM, signal.SIGHUP])
def test_stopped_during_an_op_peers_raise_naming_the_rank(signo, tmp_path):
    before = _shm_names()
    store = master_store(2)
    ready = tmp_path / "ready"
    victim = _rank(f"""
        comm = pycomm.init(**comm_args)
        open({str(ready)!r}, "w").close()
        comm.all_reduce(torch.ones(1 << 16))  # rank 0 sleeps: this blocks
    """, 1, 2, store.port)
    peer = _rank(f"""
        comm = pycomm.init(**comm_args)
        while not os.path.exists({str(ready)!r} + ".stopped"):
            time.sleep(0.01)
        try:
            comm.all_reduce(torch.ones(1 << 16))
        except pycomm.CommError as e:
            print("ERR", e)
    """, 0, 2, store.port)
    _wait_for(ready.exists)
    time.sleep(0.3)  # the victim is inside its all-reduce
    victim.send_signal(signo)
    victim.communicate(timeout=60)
    (tmp_path / "ready.stopped").touch()
    out, err = peer.communicate(timeout=120)
    assert victim.returncode == -signo
    name = signal.Signals(signo).name
    assert f"rank 1 was stopped by {name}" in out, out + err
    assert _shm_names() <= before


def test_no_handler_after_close_and_the_users_is_kept():
    store = master_store(1)
    p = _rank("""
        def caught():  # SigCgt: the signals this process catches, as a bitmask
            line = next(l for l in open("/proc/self/status") if l.startswith("SigCgt:"))
            mask = int(line.split()[1], 16)
            return [bool(mask >> (s - 1) & 1) for s in (signal.SIGTERM, signal.SIGHUP)]
        before = caught()
        comm = pycomm.init(**comm_args)
        during = caught()
        comm.close()
        after = caught()
        got = []
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
        comm = pycomm.init(**comm_args)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        comm.all_reduce(torch.ones(4))  # still usable: the user's handler ran, not ours
        comm.close()
        print(before, during, after, got == [signal.SIGTERM])
    """, 0, 1, store.port)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert out.split("\n")[0] == "[False, False] [True, True] [False, False] True", out + err
