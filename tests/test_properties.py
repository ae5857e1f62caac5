"""Property tests (hypothesis): random element count, dtype, reduce op, algo,
collective, root and input seed, for every world size 1 to 5 (4 and 5 in
the slow run) and every CPU
transport, against the independent float64 reference (tests/reference.py),
with bitwise-identical results on every rank.

The world size is a parameter rather than a drawn value so that each one keeps
its pooled ranks (spawning ranks costs seconds; run_ranks caches a few pools).
The default run is short and reproducible (derandomize, 15 examples per world
size); ``-m slow`` explores 150 random examples per world size.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._dist import run_ranks
from tests.reference import SWEEP_WORLDS, DTYPES, OPS, digest, rank_input, reference, tolerance

WORLD_SIZES = [1, 2, 3, 4, 5]
COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast"]

counts = st.one_of(
    st.sampled_from([0, 1, 2, 3, 5, 7, 13, 64, 1031]),  # edge cases and primes
    st.integers(0, 5000),
    st.integers(100_000, 300_000),  # several 512 KiB ring slices per chunk
)


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    ops = OPS if dtype.is_floating_point else [o for o in OPS if o != "avg"]
    return {
        "collective": draw(st.sampled_from(COLLECTIVES)),
        "count": draw(counts),
        "dtype": dtype,
        "op": draw(st.sampled_from(ops)),
        "algo": draw(st.sampled_from(["ring", "auto"])),
        "root": draw(st.integers(0, 4)),
        "seed": draw(st.integers(0, 2**16)),
    }


def _close(out, ref, n, what):
    if out.dtype.is_floating_point:
        rtol, atol = tolerance(out.dtype, max(n, 4))
        torch.testing.assert_close(out.to(torch.float64), ref.to(torch.float64), rtol=rtol,
                                   atol=atol, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(out, ref.to(out.dtype)), what


def _run_case(comm, c):
    n, r = comm.world_size, comm.rank
    count, dtype, op, algo, seed = c["count"], c["dtype"], c["op"], c["algo"], c["seed"]
    inputs = [rank_input(q, count, dtype, op, seed) for q in range(n)]
    what = f"{c} on rank {r} of {n}"
    if c["collective"] == "all_reduce":
        out = inputs[r].clone()
        comm.all_reduce(out, op=op, algo=algo)
        _close(out, reference(inputs, op), n, what)
    elif c["collective"] == "reduce_scatter":
        # each rank's input is n chunks of `count`; chunk q of every rank reduces to rank q
        big = [rank_input(q, count * n, dtype, op, seed) for q in range(n)]
        out = torch.empty(count, dtype=dtype)
        comm.reduce_scatter(out, big[r], op=op, algo=algo)
        _close(out, reference(big, op)[r * count:(r + 1) * count], n, what)
        return digest(torch.tensor([0]))  # rank results differ by design
    elif c["collective"] == "all_gather":
        out = torch.empty(count * n, dtype=dtype)
        comm.all_gather(out, inputs[r], algo=algo)
        assert torch.equal(out, torch.cat(inputs)), what
    else:
        root = c["root"] % n
        out = inputs[r].clone()
        comm.broadcast(out, src=root, algo=algo)
        assert torch.equal(out, inputs[root]), what
    return digest(out)


def _check(transport, world_size, c):
    digests = run_ranks(_run_case, world_size, transport, c)
    assert len(set(digests)) == 1, f"ranks differ bitwise: {c}"


_fast = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])
_slow = settings(max_examples=150, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])


@pytest.mark.parametrize("world_size", SWEEP_WORLDS[:3])  # 4 and 5 ranks: the _many variant
@_fast
@given(c=cases())
def test_collectives_match_reference(transport, world_size, c):
    _check(transport, world_size, c)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@_slow
@given(c=cases())
def test_collectives_match_reference_many(transport, world_size, c):
    _check(transport, world_size, c)
