"""Bucket assignment: which gradients travel together in one all-reduce.

A pure function of the tensors' sizes, dtypes and devices, so it is tested
without ranks (tests/test_buckets.py compares it with torch's own
``torch.distributed._compute_bucket_assignment_by_size``). The rules are
DDP's (reducer.cpp):

* tensors are taken in the order given; a bucket holds one dtype on one
  device (each (dtype, device) key fills its own open bucket);
* a bucket closes as soon as its bytes reach the current size limit of its
  key; the limits are consumed in turn per key and the last one repeats, so
  ``[1 MiB, 25 MiB]`` gives a small first bucket and 25 MiB buckets after it;
* buckets still open at the end follow, in the order their key first
  appeared;
* without ``tensor_indices`` the tensors are in registration order and the
  buckets are sorted by their smallest index; with ``tensor_indices`` the
  tensors are already in the order gradients become ready (the rebuild after
  the first iteration) and the buckets stay in the order they closed.

``DistributedDataParallel`` calls it with the parameters in reverse
registration order (an estimate of the order in which backward produces
their gradients) and again, once, with the order measured in the first
iteration. Either way bucket 0 is the small one that becomes ready first.
"""

from __future__ import annotations

import sys
from typing import Hashable, Sequence

import torch

__all__ = ["compute_bucket_assignment_by_size", "bucket_size_limits"]

#: No size limit (torch uses sys.maxsize too).
NO_LIMIT = sys.maxsize
_MB = 1024 * 1024


def bucket_size_limits(bucket_cap_mb: float, first_bucket_mb: float) -> list[int]:
    """The per-key limits DDP uses: a small first bucket, then ``bucket_cap_mb``.

    Args:
        bucket_cap_mb: size limit of every bucket after the first, in MiB.
        first_bucket_mb: size limit of the first bucket, in MiB (capped at
            ``bucket_cap_mb``).

    Returns:
        ``[first_bytes, cap_bytes]``, or ``[cap_bytes]`` when they are equal.
    """
    cap = int(bucket_cap_mb * _MB)
    first = min(int(first_bucket_mb * _MB), cap)
    return [first, cap] if first < cap else [cap]


def _key(t: torch.Tensor) -> Hashable:
    return (t.dtype, t.device)


def compute_bucket_assignment_by_size(
    tensors: Sequence[torch.Tensor],
    bucket_size_limits: Sequence[int],
    tensor_indices: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Groups ``tensors`` into buckets of bounded size, one dtype and device each.

    Args:
        tensors: the tensors (only their ``numel``, ``element_size``, dtype and
            device matter). Sparse tensors are rejected.
        bucket_size_limits: byte limits, consumed in turn by each (dtype,
            device) key; the last one repeats. A bucket closes as soon as it
            reaches its limit (so one tensor larger than the limit gets a
            bucket of its own).
        tensor_indices: the index to report for each tensor (default: its
            position). When given, the tensors are in gradient-ready order and
            the buckets keep the order in which they closed; otherwise they
            are sorted by their smallest index.

    Returns:
        ``(buckets, limits)``: for each bucket the indices of its tensors, in
        the order given, and the size limit it was built under.

    Raises:
        ValueError: no tensors, no or non-positive limits, a sparse tensor, or
            ``tensor_indices`` of the wrong length.

    Example::
        >>> ts = [torch.empty(300_000), torch.empty(100), torch.empty(300_000)]
        >>> compute_bucket_assignment_by_size(ts, [1 << 20])
        ([[0, 1, 2]], [1048576])
        >>> compute_bucket_assignment_by_size(ts, [1000, 1 << 20])
        ([[0], [1, 2]], [1000, 1048576])
    """
    if len(tensors) == 0:
        raise ValueError("compute_bucket_assignment_by_size: tensors is empty")
    limits = [int(x) for x in bucket_size_limits]
    if not limits or any(x <= 0 for x in limits):
        raise ValueError(f"bucket_size_limits must be positive byte counts, got {limits}")
    if tensor_indices is not None and len(tensor_indices) != len(tensors):
        raise ValueError(
            f"tensor_indices has {len(tensor_indices)} entries for {len(tensors)} tensors")

    closed: list[tuple[list[int], int]] = []
    # Per key: [indices, bytes, position in `limits`], in first-seen order.
    open_buckets: dict[Hashable, list] = {}
    for pos, t in enumerate(tensors):
        if t.is_sparse:
            raise ValueError(f"tensor {pos} is sparse; buckets hold dense gradients only")
        index = pos if tensor_indices is None else int(tensor_indices[pos])
        acc = open_buckets.setdefault(_key(t), [[], 0, 0])
        acc[0].append(index)
        acc[1] += t.numel() * t.element_size()
        limit = limits[acc[2]]
        if acc[1] >= limit:
            closed.append((acc[0], limit))
            acc[0], acc[1] = [], 0
            acc[2] = min(acc[2] + 1, len(limits) - 1)
    for indices, _, which in open_buckets.values():
        if indices:
            closed.append((indices, limits[which]))
    if tensor_indices is None:
        closed.sort(key=lambda bucket: min(bucket[0]))
    return [b for b, _ in closed], [lim for _, lim in closed]
