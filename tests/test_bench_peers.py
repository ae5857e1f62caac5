"""Tests of the study's peers (``--peers``, pycomm/bench/peers.py): the
one-line refusals at argument parsing, and real 2-rank runs beside MPICH
(under mpiexec) and DeepSpeed's shm all-reduce, whose rows must be checked
results with sane values. Never on time."""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from pycomm.bench import cli, peers
from tests.test_bench import ROOT, _bench, check_bound_rows

_HAS_MPI = importlib.util.find_spec("mpi4py") is not None and peers.mpiexec() is not None
_HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _refused(argv, capsys):
    """The one line a refused command prints (exit status 2)."""
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.skipif(not _HAS_MPI, reason="mpi4py or mpiexec missing (pip install mpi4py mpich)")
@pytest.mark.parametrize("extra, why", [
    (["reducescatter"], "allreduce only"),
    (["allreduce", "-d", "bf16"], "has no bfloat16"),
    (["allreduce", "-o", "avg"], "has no op avg"),
    (["allreduce", "--hosts", "2"], "drop --hosts"),
    (["allreduce", "--device", "cuda"], "--device cpu"),
])
def test_mpich_refusals_are_one_line(extra, why, capsys):
    line = _refused([*extra, "--nproc", "2", "--peers", "mpich"], capsys)
    assert line.startswith("python -m pycomm.bench: error: --peers mpich: ") and why in line, line


@pytest.mark.skipif(not _HAS_MPI, reason="mpi4py or mpiexec missing (pip install mpi4py mpich)")
def test_mpich_refused_under_torchrun_and_without_mpiexec(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert "not under torchrun" in _refused(["allreduce", "--peers", "mpich"], capsys)
    monkeypatch.delenv("RANK")
    monkeypatch.setattr(peers, "mpiexec", lambda: None)
    assert "pip install mpi4py mpich" in _refused(["allreduce", "--peers", "mpich"], capsys)


@pytest.mark.skipif(not _HAS_DEEPSPEED, reason="deepspeed missing (pip install deepspeed)")
@pytest.mark.parametrize("extra, why", [
    (["-o", "max"], "has no op max"),
    (["-d", "float64"], "has no float64"),
])
def test_deepspeed_refusals_are_one_line(extra, why, capsys):
    line = _refused(["allreduce", "--peers", "deepspeed", *extra], capsys)
    assert "--peers deepspeed: " in line and why in line, line


@pytest.mark.skipif(not _HAS_DEEPSPEED, reason="deepspeed missing (pip install deepspeed)")
def test_deepspeed_that_does_not_build_is_one_line(tmp_path, monkeypatch):
    """DeepSpeed's op is built before any rank starts; when it cannot be
    (here: no compiler), one line says so and nothing runs."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))  # no cached build
    monkeypatch.setenv("CXX", "/bin/false")
    run = tmp_path / "run"
    run.mkdir()
    res = _bench(["allreduce", "--nproc", "2", "--peers", "deepspeed", "--json", "r.json"], run)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--peers deepspeed: DeepSpeed's shm all-reduce did not build" in lines[0]
    assert res.stdout == "" and list(run.iterdir()) == []


def test_default_study_imports_no_peer():
    """Without --peers, nothing of MPI or DeepSpeed is imported: the default
    study runs as it did before the peers."""
    code = ("import sys; from pycomm.bench import cli, launch, runner; cli.parse_args(['allreduce']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'deepspeed')))")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def test_unknown_peer_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["allreduce", "--peers", "openmpi"])
    assert e.value.code == 2 and "unknown peer 'openmpi'" in capsys.readouterr().err


def _peer_run(tmp_path, peer, timeout=300):
    """A 2-rank run at 4 KiB and 64 KiB with auto beside ``peer``; its
    JSON's peer rows, after the checks every run must pass."""
    res = _bench(["allreduce", "--nproc", "2", "-b", "4K", "-e", "64K", "-f", "16", "-n", "3", "-w", "1",
                  "--algo", "auto", "--peers", peer, "--json", "r.json", "--plot", "r.png"], tmp_path,
                 timeout=timeout)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{peer} in-place" in res.stdout and "# Out of bounds values : 0 OK" in res.stdout
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["meta"]["algos"] == ["auto", peer] and peer in data["meta"]["peers"]
    check_bound_rows(data["rows"], [4096, 65536])
    rows = [r for r in data["rows"] if r["algo"] == peer]
    assert sorted(r["size"] for r in rows) == [4096, 65536]
    for r in rows:
        assert r["wrong"] == 0 and r["world_size"] == 2 and r["in_place"]
        assert math.isfinite(r["time_us"]) and r["time_us"] > 0
        assert r["busbw"] == pytest.approx(r["algbw"]) == pytest.approx(r["size"] / r["time_us"] / 1e3)
    return data, rows


@pytest.mark.skipif(not _HAS_MPI, reason="mpi4py or mpiexec missing (pip install mpi4py mpich)")
def test_mpich_series_beside_pycomm(tmp_path):
    """``--peers mpich`` runs the ranks under mpiexec: MPICH's
    MPI_Allreduce is one more checked series in the same rounds."""
    data, rows = _peer_run(tmp_path, "mpich")
    assert data["meta"]["peers"]["mpich"].startswith("MPICH")
    assert all(r["transport"] == "mpi" for r in rows)


@pytest.mark.slow  # builds DeepSpeed's op first: about 45 s of the 40-minute CI run
@pytest.mark.skipif(not _HAS_DEEPSPEED, reason="deepspeed missing (pip install deepspeed)")
def test_deepspeed_series_beside_pycomm(tmp_path):
    """``--peers deepspeed``: DeepSpeed's shm all-reduce (built on first use,
    about a minute) is one more checked series; its segments do not outlive
    the run."""
    data, rows = _peer_run(tmp_path, "deepspeed", timeout=600)
    assert data["meta"]["peers"]["deepspeed"].startswith("DeepSpeed")
    assert all(r["transport"] == "shm (deepspeed)" for r in rows)
    assert glob.glob("/dev/shm/deepspeed_*_pycomm-bench_*") == []
