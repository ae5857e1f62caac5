"""``GradBucket``, re-exported: it lives in :mod:`pycomm._grad_bucket`, where
:mod:`pycomm.hooks` can use it too without importing this package (hooks and
parallel sit side by side, above pycomm.comm)."""

from .._grad_bucket import GradBucket

__all__ = ["GradBucket"]
