"""The deferred point-to-point component (csrc/core/deferred_p2p.h) alone:
tests/deferred_p2p_driver.cc drives it with a fake transport and a fake
clock, on one thread, one scenario a run; each cites the rule of
deferred_p2p.h it checks and the multi-process test of the same pattern
(tests/test_collectives.py, tests/test_backend_p2p.py, tests/test_faults.py).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "csrc" / "core"

SCENARIOS = [
    "abort_and_transport_errors_fail_ops",
    "callback_waits_for_older_op_posted",
    "callback_waits_for_older_op_set_aside",
    "callback_waits_then_sends_later_poll",
    "callback_waits_then_sends_same_poll",
    "callbacks_post_and_wait",
    "completes_posted_ops",
    "deadline_fails_an_op_naming_its_peers",
    "failed_op_opens_no_scope",
    "posted_ahead_waits_for_the_idle_poll",
    "posted_ahead_while_a_callback_waits",
    "same_key_ends_in_posting_order",
    "scope_ends_when_a_callback_throws",
    "set_aside_older_op_holds_nothing_back",
    "wait_for_unknown_op_stops_while_older_pending",
    "which_ops_pair_in_order",
]


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the driver")
    out = tmp_path_factory.mktemp("deferred_p2p") / "deferred_p2p_driver"
    proc = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{CORE}",
                           str(ROOT / "tests" / "deferred_p2p_driver.cc"),
                           str(CORE / "deferred_p2p.cc"), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def test_every_scenario_is_listed(driver):
    listed = subprocess.run([str(driver), "--list"], capture_output=True, text=True,
                            check=True, timeout=60).stdout.split()
    assert sorted(listed) == sorted(SCENARIOS)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(driver, scenario):
    proc = subprocess.run([str(driver), scenario], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
