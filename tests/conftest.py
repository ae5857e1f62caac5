import os

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
