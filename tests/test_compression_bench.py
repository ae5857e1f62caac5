"""benchmarks/compression: the accuracy study runs end to end at a toy size,
and a missing scikit-learn fails at argument parsing with the fix."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "compression" / "accuracy.py"


def _module():
    spec = importlib.util.spec_from_file_location("accuracy", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_missing_scikit_learn_fails_at_parsing(monkeypatch, capsys):
    mod = _module()
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn raises ImportError
    with pytest.raises(SystemExit) as e:
        mod._parse(["--worlds", "2"])
    assert e.value.code == 2
    assert "pip install scikit-learn" in capsys.readouterr().err


def test_bad_arguments_are_refused(capsys):
    pytest.importorskip("sklearn")
    mod = _module()
    for argv, msg in ((["--hooks", "int4"], "unknown hooks"),
                      (["--worlds", "3", "--batch", "64"], "must divide")):
        with pytest.raises(SystemExit):
            mod._parse(argv)
        assert msg in capsys.readouterr().err


def test_accuracy_study_runs(tmp_path):
    pytest.importorskip("sklearn")
    out = tmp_path / "acc.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--worlds", "2", "--epochs", "1",
                           "--hooks", "fp32,int8,int8_noef,fp8", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| 2 | int8 |" in proc.stdout
    result = json.loads(out.read_text())
    rows = {r["hook"]: r for r in result["worlds"][0]["rows"]}
    assert set(rows) == {"fp32", "int8", "int8_noef", "fp8"}
    assert all(r["ranks_identical"] for r in rows.values())
    assert rows["fp32"]["grad_rel_error_max"] < 1e-6          # float32 vs float64 sums
    assert rows["fp32"]["param_drift_vs_fp32"] == 0.0
    for name in ("int8", "int8_noef", "fp8"):                  # 8 bits: about 1 % per step
        assert 1e-4 < rows[name]["grad_rel_error_mean"] < 0.1, rows[name]
        assert 0 < rows[name]["param_drift_vs_fp32"] < 0.05, rows[name]
        assert rows[name]["bucket_calls"] == rows["fp32"]["bucket_calls"] > 0


def test_hosts_ddp_runs(tmp_path):
    """benchmarks/compression/hosts_ddp.py at a toy width: every variant timed
    across 2 x 2 simulated hosts on shm+gloo, the speedups in the JSON."""
    from pycomm.bench import simhosts

    why = simhosts.unavailable_reason()
    if why is not None:
        pytest.skip(str(why))
    out = tmp_path / "h.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compression" / "hosts_ddp.py"),
                           "--width", "64", "--rounds", "1", "--steps", "1", "--link-rate",
                           "1gbit", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["transport"] == "shm+gloo" and data["args"]["link_rate"] == "1gbit"
    assert set(data["step_ms"]) == {"torch-gloo", "hook-allreduce", "hook-bf16", "hook-ring-bf16",
                                    "hook-int8", "hook-fp8", "compute-only"}
    assert set(data["traffic_ms"]) == set(data["step_ms"]) - {"compute-only"}
    assert data["speedup_over_torch-gloo"]["torch-gloo"] == 1.0
    assert "hook-int8" in proc.stdout
