"""python -m pycomm.bench chaos: faults injected into soak traffic; every
survivor raises within the timeout + 5 s, nothing hangs, nothing is left in
/dev/shm. The default run injects 16 faults (12 signals, each kind 3 times,
and 4 of the surroundings); the longer runs (shm and gloo) are slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pycomm.bench import chaos

ROOT = Path(__file__).resolve().parents[1]


def _chaos(tmp_path, *args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "chaos.json"
    res = subprocess.run([sys.executable, "-m", "pycomm.bench", "chaos", *args, "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=timeout)
    return res, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.parametrize("transport, nproc, faults", [
    ("shm", 3, 12),  # with the 4 of test_the_job_lives_through_its_surroundings: 16 by default
    pytest.param("shm", 3, 40, marks=pytest.mark.slow),
    pytest.param("gloo", 3, 8, marks=pytest.mark.slow),
])
def test_chaos_every_survivor_raises_in_time(tmp_path, transport, nproc, faults):
    res, data = _chaos(tmp_path, "--nproc", str(nproc), "--transport", transport,
                       "--faults", str(faults), "--op-timeout", "5", "--seed", "3",
                       "--kinds", ",".join(chaos.SIGNALS))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    summary = data["summary"]
    assert summary["faults"] == faults and summary["breaches"] == []
    assert set(summary["by_fault"]) == set(chaos.SIGNALS)
    for kind, k in summary["by_fault"].items():
        assert k["survivors_raised"] == k["trials"] * (nproc - 1), (kind, k)
        assert k["max_s"] <= 5 + chaos.GRACE_S, (kind, k)
    assert all(t["shm_left"] == [] for t in data["trials"])
    assert f"{faults} faults on {nproc} ranks over {transport}" in res.stdout


def test_the_job_lives_through_its_surroundings(tmp_path):
    """A CPU-starved rank: every rank finishes its program verified, none
    raises; /dev/shm filled mid-program or the store's server killed: each
    finishes, or raises CommError (a group made after it: which steps come
    after the fault depends on the machine's speed)
    /dev/shm full before the start: every rank's init raises CommError
    saying so. Nothing hangs, nothing is left in /dev/shm."""
    # trial i has kind i % 3: shm_full at 0 (mid-program) and 3 (before the start)
    kinds, faults = ("shm_full,slow,store", 4) if chaos._private_shm_reason() is None else ("slow,store", 2)
    res, data = _chaos(tmp_path, "--nproc", "3", "--transport", "shm", "--faults", str(faults),
                       "--op-timeout", "5", "--seed", "4", "--kinds", kinds)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert data["summary"]["breaches"] == []
    for t in data["trials"]:
        assert t["shm_left"] == [], t
        if t.get("when") == "before":
            assert t["finished"] == 0 and len(t["survivors"]) == 3, t
            assert all(s["type"] == "CommError" and "No space left" in s["message"]
                       for s in t["survivors"]), t
        elif t["fault"] == "store":  # a group made after it raises, its peers then too
            assert t["finished"] + len(t["survivors"]) == 3, t
        elif t["fault"] == "shm_full":  # a group made after the fill raises: no space
            assert t["finished"] + len(t["survivors"]) == 3, t
            assert t["finished"] == 3 or any("No space left" in s["message"]
                                             for s in t["survivors"]), t
        else:
            assert t["finished"] == 3 and t["survivors"] == [], t
    assert [t.get("when") for t in data["trials"] if t["fault"] == "shm_full"] == (
        ["during", "before"] if faults == 4 else [])


def test_sigterm_to_the_driver_leaves_no_rank_running():
    """A chaos run ended by SIGTERM (a scheduler, a Ctrl-C'd shell) kills its
    trial's ranks on the way out."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    driver = subprocess.Popen([sys.executable, "-m", "pycomm.bench", "chaos", "--nproc", "2",
                               "--transport", "shm", "--faults", "50", "--op-timeout", "5"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    deadline = time.monotonic() + 120
    while not ranks and time.monotonic() < deadline:  # until a trial's ranks run
        time.sleep(0.2)
        ps = subprocess.run(["pgrep", "-P", str(driver.pid)], capture_output=True, text=True)
        ranks = [int(p) for p in ps.stdout.split()]
    assert ranks, "no trial started"
    driver.send_signal(signal.SIGTERM)
    driver.communicate(timeout=60)
    time.sleep(0.5)
    alive = [p for p in ranks if os.path.exists(f"/proc/{p}") and
             "Z" not in open(f"/proc/{p}/stat").read().split()[2]]
    assert alive == [], f"ranks {alive} outlived the driver"


def test_a_breach_is_reported():
    """The rule's checks can fail: a survivor that raised late, one that
    exited without raising, and a hung one are each a breach."""
    records = [{"trial": 0, "fault": "stop", "victim": 1, "survivors": [
        {"rank": 0, "after_s": 11.0, "type": "CommError", "names_victim": True, "message": ""}],
        "breaches": ["rank 0 raised 11.0 s after the fault (rule: 10 s)", "rank 2 hung"]}]
    summary = chaos.summarize(records)
    assert len(summary["breaches"]) == 2 and summary["by_fault"]["stop"]["max_s"] == 11.0


def test_bad_arguments(capsys):
    for argv in (["--kinds", "reboot"], ["--nproc", "1"], ["--faults", "0"],
                 ["--kinds", "shm_full", "--transport", "gloo"]):
        with pytest.raises(SystemExit) as e:
            chaos.parse_args(argv)
        assert e.value.code == 2
    assert "--kinds" in capsys.readouterr().err
