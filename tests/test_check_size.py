"""scripts/check_size.py: a unit over 700 lines or a function over 60 lines
of logic fails, and a C++ source counts together with its header."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_size.py"


def _run(root: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *flags, str(root)], capture_output=True,
                          text=True, timeout=60)


def test_a_source_counts_with_its_header(tmp_path):
    (tmp_path / "a.cc").write_text("int x;\n" * 400)
    (tmp_path / "a.h").write_text("int y;\n" * 400)
    (tmp_path / "b.cc").write_text("int z;\n" * 400)  # alone: under the limit
    (tmp_path / "m.py").write_text("x = 1\n" * 400)
    proc = _run(tmp_path)
    assert proc.returncode == 1, proc.stdout
    assert f"{tmp_path}/a.{{cc,h}}: 800 lines with its header (limit 700)" in proc.stdout
    assert "b.cc" not in proc.stdout and "m.py" not in proc.stdout


def test_a_long_function_fails(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    (tmp_path / "f.py").write_text("def f():\n" + body)
    proc = _run(tmp_path)
    assert proc.returncode == 1 and "function f has 61 lines of logic (limit 60)" in proc.stdout
    assert _run(tmp_path, "--max-function", "61").returncode == 0
    proc = _run(tmp_path, "--max-unit", "50")
    assert proc.returncode == 1 and "f.py: 61 lines (limit 50)" in proc.stdout
