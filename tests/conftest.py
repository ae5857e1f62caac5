"""Shared pytest configuration."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU and the CUDA build of pycomm._C (skipped otherwise)"
    )
