"""Data parallelism over pycomm: DDP's gradient bucketing in readable Python.

``DistributedDataParallel`` is a drop-in for the common arguments of
``torch.nn.parallel.DistributedDataParallel`` that runs on a
:class:`pycomm.Communicator`; ``compute_bucket_assignment_by_size`` is its
bucketing rule as a pure function; ``GradBucket`` is what comm hooks get.
"""

from .._grad_bucket import GradBucket
from .buckets import bucket_size_limits, compute_bucket_assignment_by_size
from .distributed import DistributedDataParallel
from .stats import BucketStats, DDPStats, IterationStats, comm_overlap

__all__ = [
    "BucketStats",
    "DDPStats",
    "DistributedDataParallel",
    "GradBucket",
    "IterationStats",
    "bucket_size_limits",
    "comm_overlap",
    "compute_bucket_assignment_by_size",
]
