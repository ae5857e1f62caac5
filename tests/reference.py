"""Deterministic per-rank inputs and independent float64 references."""

from __future__ import annotations

import hashlib
import zlib

import pytest
import torch

# World sizes of the full op x dtype x size sweeps: 1, 2 and 3 ranks (one,
# even, odd) in the default run; 4 ranks, the slowest on a 2-core machine,
# in the slow one (scripts/test.sh --full), which keeps CI under 40 minutes.
SWEEP_WORLDS = [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int32, torch.int64, torch.uint8, torch.int8]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
OPS = ["sum", "avg", "max", "min", "product"]
SMALL_COUNTS = [0, 1, 13, 1031]  # 13, 1031: primes, not divisible by 2, 3 or 4
LARGE_COUNT = 1_048_583  # prime, over a million: many slices of every algorithm


def all_reduce_cases(large: bool):
    """(count, dtype, op) of the all-reduce suites: every dtype x op (AVG on
    floats) x SMALL_COUNTS; ``large`` adds LARGE_COUNT for every dtype (sum)
    and float32 max and avg."""
    for dtype in DTYPES:
        for op in OPS:
            if op == "avg" and not dtype.is_floating_point:
                continue
            for count in SMALL_COUNTS:
                yield count, dtype, op
    if large:
        for dtype in DTYPES:
            yield LARGE_COUNT, dtype, "sum"
        yield LARGE_COUNT, torch.float32, "max"
        yield LARGE_COUNT, torch.float32, "avg"


def rank_input(rank: int, count: int, dtype: torch.dtype, op: str, seed: int = 0) -> torch.Tensor:
    """Rank `rank`'s input. Value ranges keep every op exact or well
    conditioned: small integers (no overflow for 5 ranks), products near 1."""
    key = f"{rank}/{count}/{dtype}/{op}/{seed}".encode()  # stable across processes
    g = torch.Generator().manual_seed(zlib.crc32(key))
    if dtype.is_floating_point:
        if op == "product":
            x = torch.rand(count, generator=g, dtype=torch.float64) * 0.5 + 0.75
        else:
            x = torch.randn(count, generator=g, dtype=torch.float64)
        return x.to(dtype)
    lo, hi = (0, 4) if dtype == torch.uint8 else (-3, 4)
    if op == "product":
        lo, hi = (1, 3) if dtype == torch.uint8 else (-2, 3)
    return torch.randint(lo, hi, (count,), generator=g, dtype=torch.int64).to(dtype)


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """op over ranks, computed in float64 (int64 for integer dtypes)."""
    acc_t = torch.float64 if inputs[0].dtype.is_floating_point else torch.int64
    xs = torch.stack([x.to(acc_t) for x in inputs])
    if op in ("sum", "avg"):
        out = xs.sum(0)
        return out / len(inputs) if op == "avg" else out
    if op == "max":
        return xs.max(0).values
    if op == "min":
        return xs.min(0).values
    if op == "product":
        return xs.prod(0)
    raise ValueError(op)


def tolerance(dtype: torch.dtype, world_size: int) -> tuple[float, float]:
    """(rtol, atol) for comparing a ring result with the float64 reference:
    each of the n-1 reduction steps rounds once to the storage dtype."""
    n = max(world_size, 1)
    return {
        torch.float64: (1e-12, 1e-12),
        torch.float32: (1e-5 * n, 1e-5 * n),
        torch.float16: (2e-3 * n, 4e-3 * n),
        torch.bfloat16: (1.6e-2 * n, 3.2e-2 * n),
    }.get(dtype, (0.0, 0.0))


def assert_matches(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    rtol, atol = tolerance(out.dtype, 4)
    if out.dtype.is_floating_point:
        torch.testing.assert_close(out.to(torch.float64), ref.to(torch.float64), rtol=rtol,
                                   atol=atol, msg=lambda m: f"{what}: {m}")
    else:
        # integers wrap like torch's own arithmetic
        expect = ref.to(out.dtype)
        if not torch.equal(out, expect):
            bad = (out != expect).nonzero()[:5].flatten().tolist()
            raise AssertionError(f"{what}: {int((out != expect).sum())} elements differ, "
                                 f"first at {bad}: got {out[bad].tolist()} "
                                 f"expected {expect[bad].tolist()}")


def ring_chunks(count: int, world_size: int, elem_size: int) -> list[tuple[int, int]]:
    """(offset, length) of each ring chunk, in elements: the partition of
    csrc/core/algorithms.h Chunks::aligned, written independently. Whole
    16-byte units are dealt out evenly, the first chunks getting one more; the
    leftover elements (fewer than a unit) join the last chunk."""
    unit = 16 // elem_size if elem_size < 16 and 16 % elem_size == 0 else 1
    units, tail = divmod(count, unit)
    out, offset = [], 0
    for c in range(world_size):
        length = (units // world_size + (c < units % world_size)) * unit
        length += tail if c == world_size - 1 else 0
        out.append((offset, length))
        offset += length
    return out


def digest(t: torch.Tensor) -> str:
    """Bit pattern fingerprint, to prove every rank holds identical bytes."""
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
