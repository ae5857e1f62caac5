"""The pure parts of the shm+gloo hierarchy (pycomm/_hierarchy.py): the
layout of ranks on hosts, the rule for uneven hosts, the address check.
The collectives themselves run across simulated hosts in tests/test_hosts.py."""

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


def test_block_orders_invert_each_other():
    """all_gather's reorder (rows by local, host -> by rank) and
    reduce_scatter's (by rank -> by local, host) undo each other."""
    lay = Layout.from_host_ids(["a", "b", "a", "b", "a", "b"])

    class _Stub:
        device, slice_bytes, closed, check = "cpu", 1, False, False

    comm = _hierarchy.HierarchicalComm(lay, 0, _Stub(), _Stub(), _Stub())
    rows = comm._lh_rows.tolist()
    assert sorted(rows) == list(range(6))
    assert [rows[g] for g in comm._by_column.tolist()] == list(range(6))
    assert rows == [lay.local[g] * 2 + lay.host[g] for g in range(6)]


@pytest.mark.parametrize("case", ["large", "small"])
def test_all_reduce_runs_the_step_table(case):
    """HierarchicalComm._all_reduce issues exactly the steps of
    ALL_REDUCE_STEPS (which the two-level cost model counts), in order."""
    import torch

    lay = Layout.from_host_ids(["a", "a", "b", "b"])
    calls = []

    class _Recorder:
        device, slice_bytes, closed, check = "cpu", 1, False, False

        def __init__(self, name):
            self.name = name

        def __getattr__(self, op):
            return lambda t, *args: calls.append((self.name, op, t.numel()))

    comm = _hierarchy.HierarchicalComm(lay, 0, _Recorder("flat"), _Recorder("intra"),
                                       _Recorder("inter"))
    numel = 4 if case == "small" else 2 * _hierarchy.SMALL_BYTES  # float32: > SMALL_BYTES
    t = torch.zeros(numel)
    comm._all_reduce(t, 0, "auto", False)
    steps = _hierarchy.all_reduce_steps(t.nbytes)
    assert steps == _hierarchy.ALL_REDUCE_STEPS[case]
    assert [(c, op) for c, op, _ in calls] == [(s.comm, s.op) for s in steps]
    # The reduce-scatter's input and the all-gather's output are the whole
    # tensor; a shard step covers this local rank's 1/L of it.
    for (_, op, n), s in zip(calls, steps):
        if s.shard:
            assert n == numel // 2
        elif op != "reduce_scatter":
            assert n == numel
