"""The pure parts of the shm+gloo hierarchy (pycomm/_hierarchy.py): the
layout of ranks on hosts, the rule for uneven hosts, the address check.
The composition itself (csrc/torch/hierarchy.h) runs across simulated hosts
in tests/test_hosts.py."""

from __future__ import annotations

import pytest

from pycomm import _hierarchy
from pycomm._hierarchy import Layout, address_problem, hierarchy_refusal


def test_layout_numbers_hosts_by_lowest_rank():
    lay = Layout.from_host_ids(["b", "a", "b", "a"])
    assert lay.host == (0, 1, 0, 1) and lay.local == (0, 0, 1, 1)
    assert lay.ranks_per_host() == [2, 2] and lay.rank_of(1, 1) == 3


@pytest.mark.parametrize("ids,why", [
    (["a", "a", "b", "b"], None),
    (["a", "a", "a", "b"], "different numbers of ranks (3+1)"),
    (["a", "b"], "one rank per host"),
    (["a", "a"], "one host"),
])
def test_hierarchy_needs_even_hosts(ids, why):
    refusal = hierarchy_refusal(Layout.from_host_ids(ids))
    assert refusal is None if why is None else why in str(refusal)


def test_address_problem():
    assert address_problem("localhost", None) is not None  # loopback only
    assert "does not resolve" in str(address_problem("no-such-host.invalid", None))
    assert address_problem("no-such-host.invalid", "eth0") is None  # the interface decides


def test_the_step_table_is_the_cpp_one():
    """ALL_REDUCE_STEPS is read from csrc/torch/hierarchy.h (the code that
    runs it); tests/_hosts_rank.check_steps checks the parts' op counts
    against it across simulated hosts."""
    steps = _hierarchy.ALL_REDUCE_STEPS
    assert [(s.comm, s.op, s.shard) for s in steps["large"]] == [
        ("intra", "reduce_scatter", False), ("inter", "all_reduce", True),
        ("intra", "all_gather", False)]
    assert [(s.comm, s.op) for s in steps["small"]] == [("intra", "all_reduce"),
                                                       ("inter", "all_reduce")]
    assert _hierarchy.all_reduce_steps(_hierarchy.SMALL_BYTES) == steps["small"]
    assert _hierarchy.all_reduce_steps(_hierarchy.SMALL_BYTES + 1) == steps["large"]
