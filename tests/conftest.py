import os
import time

import pytest

from tests import _dist

# Every CPU transport the build offers; the collective suite runs for each.
CPU_TRANSPORTS = [t for t in os.environ.get("PYCOMM_TEST_TRANSPORTS", "gloo,shm").split(",") if t]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA and NCCL (skipped without a GPU)")
    config.addinivalue_line("markers", "slow: long-running variants (run with -m slow)")


def pytest_collection_modifyitems(config, items):
    # The default run stays fast: slow variants run only when selected
    # (-m slow, or any -m expression naming slow) or with PYCOMM_SLOW=1.
    if "slow" in (config.getoption("-m") or "") or os.environ.get("PYCOMM_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow variant: run with -m slow or PYCOMM_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=CPU_TRANSPORTS)
def transport(request):
    return request.param


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    _dist.close_pools()


# Segments left in /dev/shm by a pycomm process that is gone (a leak: see
# pycomm._setup.orphan_segments), each with the test after which it was seen.
_ORPHANS: list[str] = []


@pytest.fixture(autouse=True)
def _no_orphan_segments(request):
    """After each test: names the test after which a dead process's segment
    is in /dev/shm (another run sharing the machine may have left it: the
    time tells them apart), then removes it so the next test starts clean.
    Reported at the end of the run, not failed: it is a detector for a leak
    seen once (a stray segment while two runs shared a machine)."""
    yield
    from pycomm import _setup

    left = _setup.orphan_segments()
    if left:
        _ORPHANS.append(f"{time.strftime('%H:%M:%S')} after {request.node.nodeid}: {left}")
        _setup.sweep_orphan_segments()


def pytest_terminal_summary(terminalreporter):
    if _ORPHANS:
        terminalreporter.section("pycomm: segments left in /dev/shm by processes that are gone")
        for line in _ORPHANS:
            terminalreporter.write_line(line)
