"""Bucket assignment and the stats arithmetic, without ranks: the pure
functions of pycomm.parallel against torch's own bucketing."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from pycomm.parallel import (
    DDPStats,
    BucketStats,
    IterationStats,
    bucket_size_limits,
    comm_overlap,
    compute_bucket_assignment_by_size,
)

MB = 1024 * 1024
DTYPES = [torch.float32, torch.float16, torch.float64]


def _tensors(rng: random.Random, count: int, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    return [torch.empty(rng.choice([1, 7, 100, 1000, 4096, 30_000, 300_000]),
                        dtype=rng.choice(dtypes)) for _ in range(count)]


def _random_limits(rng: random.Random) -> list[int]:
    return rng.choice([[1], [100], [4096], [MB], [1000, 50_000], [MB, 25 * MB],
                       [10_000, 100_000, 500_000], [2**62]])


@pytest.mark.parametrize("seed", range(40))
def test_matches_torch_in_registration_order(seed):
    """Without tensor_indices both sort the buckets by their smallest index,
    so the results agree exactly, mixed dtypes included."""
    rng = random.Random(seed)
    ts = _tensors(rng, rng.randint(1, 30), DTYPES[: 1 + seed % 3])
    limits = _random_limits(rng)
    assert compute_bucket_assignment_by_size(ts, limits) == \
        tuple(map(list, dist._compute_bucket_assignment_by_size(ts, limits)))


@pytest.mark.parametrize("seed", range(40))
def test_matches_torch_in_ready_order(seed):
    """With tensor_indices (the rebuild) buckets keep the order in which they
    closed. Torch appends the still-open buckets of several dtypes in hash-map
    order, so with mixed dtypes only the set of buckets is compared."""
    rng = random.Random(1000 + seed)
    mixed = seed % 2 == 1
    ts = _tensors(rng, rng.randint(1, 30), DTYPES if mixed else DTYPES[:1])
    order = list(range(len(ts)))
    rng.shuffle(order)
    limits = _random_limits(rng)
    ours = compute_bucket_assignment_by_size([ts[i] for i in order], limits, order)
    theirs = dist._compute_bucket_assignment_by_size([ts[i] for i in order], limits, [], order)
    if mixed:
        assert sorted(zip(*ours)) == sorted(zip(*map(list, theirs)))
    else:
        assert ours == tuple(map(list, theirs))


def test_small_first_bucket_then_cap():
    ts = [torch.empty(MB // 4) for _ in range(8)]  # 1 MiB each
    buckets, limits = compute_bucket_assignment_by_size(ts, [MB, 3 * MB], list(range(8)))
    assert buckets == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert limits == [MB, 3 * MB, 3 * MB, 3 * MB]


def test_one_dtype_per_bucket_and_oversized_tensor_alone():
    ts = [torch.empty(10), torch.empty(10, dtype=torch.float64), torch.empty(1000),
          torch.empty(10, dtype=torch.float64), torch.empty(10)]
    buckets, _ = compute_bucket_assignment_by_size(ts, [200])
    assert buckets == [[0, 2], [1, 3], [4]]
    for b in buckets:
        assert len({ts[i].dtype for i in b}) == 1


def test_bucket_size_limits():
    assert bucket_size_limits(25, 1) == [MB, 25 * MB]
    assert bucket_size_limits(0.5, 1) == [MB // 2]  # first capped at the cap
    assert bucket_size_limits(4, 4) == [4 * MB]


def test_bad_input():
    t = [torch.empty(3)]
    with pytest.raises(ValueError, match="empty"):
        compute_bucket_assignment_by_size([], [MB])
    with pytest.raises(ValueError, match="positive"):
        compute_bucket_assignment_by_size(t, [0])
    with pytest.raises(ValueError, match="positive"):
        compute_bucket_assignment_by_size(t, [])
    with pytest.raises(ValueError, match="tensor_indices"):
        compute_bucket_assignment_by_size(t, [MB], [0, 1])
    with pytest.raises(ValueError, match="sparse"):
        compute_bucket_assignment_by_size([torch.eye(3).to_sparse()], [MB])


def test_comm_overlap_serialises_ops():
    # op 1 is submitted at 1 but the communicator is busy with op 0 until 2
    assert comm_overlap([0.0, 1.0], [2.0, 3.0], backward_end=2.5) == (3.0, 2.5)
    assert comm_overlap([0.0], [1.0], backward_end=5.0) == (1.0, 1.0)  # all hidden
    assert comm_overlap([5.0], [6.0], backward_end=5.0) == (1.0, 0.0)  # all exposed
    assert comm_overlap([], [], backward_end=0.0) == (0.0, 0.0)
    with pytest.raises(ValueError):
        comm_overlap([0.0], [], 1.0)


def test_stats_table():
    stats = DDPStats(
        buckets=[BucketStats(0, ["fc2.bias", "fc2.weight"], 110, 440, "float32", "cpu")],
        iterations=[IterationStats(1, 0.010, 0.008, 0.002, 0.006, 440, 1),
                    IterationStats(2, 0.010, 0.004, 0.003, 0.001, 440, 1)],
        rebuilt_after=1, world_size=2)
    text = str(stats)
    assert "fc2.bias, fc2.weight" in text and "rebuilt in ready order after iteration 1" in text
    assert stats.bytes_reduced == 880
    assert stats.hidden_fraction() == pytest.approx(0.75)  # first iteration skipped
    assert stats.hidden_fraction(skip_first=False) == pytest.approx(5 / 12)
    assert stats.iterations[0].hidden_fraction == pytest.approx(0.25)
