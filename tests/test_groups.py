"""Sub-communicators: Communicator.new_group / split on every CPU transport.

Each group's collectives are checked against float64 references computed
from the members' inputs; ranks are renumbered in the group's order; groups
run interleaved with their parent; creating a group on some ranks only never
desynchronises the groups created later."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._dist import COMM_TIMEOUT, run_ranks
from tests.reference import assert_matches, rank_input, reference

COUNTS = [0, 1, 13, 1031, 65_537]


def _check_group(group, members: list[int], parent_rank: int, tag: str) -> None:
    """Runs all_reduce / broadcast / all_gather / reduce_scatter / p2p on a
    group of parent ranks ``members`` (in group order) and compares them
    with references built from the members' inputs."""
    n = len(members)
    assert (group.rank, group.world_size) == (members.index(parent_rank), n), tag
    for count in COUNTS:
        inputs = [rank_input(p, count, torch.float64, "sum", seed=7) for p in members]
        t = inputs[group.rank].clone()
        group.all_reduce(t)
        assert_matches(t, reference(inputs, "sum"), f"{tag}: all_reduce count={count}")
    root = n - 1
    b = torch.full((9,), float(parent_rank))
    group.broadcast(b, src=root)
    assert torch.equal(b, torch.full((9,), float(members[root]))), f"{tag}: broadcast"
    out = torch.empty(3 * n, dtype=torch.float64)
    group.all_gather(out, torch.full((3,), float(parent_rank), dtype=torch.float64))
    expect = torch.tensor(members, dtype=torch.float64).repeat_interleave(3)
    assert torch.equal(out, expect), f"{tag}: all_gather {out.tolist()}"
    inputs = [rank_input(p, 4 * n, torch.float64, "sum", seed=8) for p in members]
    rs = torch.empty(4, dtype=torch.float64)
    group.reduce_scatter(rs, inputs[group.rank].clone())
    r = group.rank
    assert_matches(rs, reference(inputs, "sum")[4 * r:4 * (r + 1)], f"{tag}: reduce_scatter")
    if n > 1:  # a ring of sends in group ranks: each receives its predecessor's parent rank
        got = torch.empty(2)
        works = group.batch_isend_irecv([
            _p2p("isend", torch.full((2,), float(parent_rank)), (r + 1) % n),
            _p2p("irecv", got, (r - 1) % n),
        ])
        for w in works:
            w.wait()
        assert torch.equal(got, torch.full((2,), float(members[(r - 1) % n]))), f"{tag}: p2p"
    group.barrier()


def _p2p(op, tensor, peer):
    import pycomm

    return pycomm.P2POp(op, tensor, peer)


def _parent_all_reduce(comm, seed: int) -> None:
    inputs = [rank_input(q, 1031, torch.float64, "sum", seed=seed) for q in range(comm.world_size)]
    t = inputs[comm.rank].clone()
    comm.all_reduce(t)
    assert_matches(t, reference(inputs, "sum"), f"parent all_reduce seed={seed}")


def _second_parent(comm, tag: str, **kwargs):
    """A fresh communicator over the pool's ranks (it may be closed by the test)."""
    import pycomm

    return pycomm.init(rank=comm.rank, world_size=comm.world_size,
                       store=dist.PrefixStore(tag, comm._store), transport=comm.transport,
                       timeout=COMM_TIMEOUT, set_default=False, **kwargs)


# ---------------------------------------------------------------- new_group

def _pairs(comm):
    import pycomm

    r = comm.rank
    # Every rank calls both; non-members get None. The module-level twin acts
    # on the default communicator (the pool's).
    g01 = comm.new_group([0, 1])
    g23 = pycomm.new_group([2, 3])
    mine, other = (g01, g23) if r < 2 else (g23, g01)
    assert other is None and mine is not None
    assert mine.transport == comm.transport and mine.device == comm.device
    _check_group(mine, [0, 1] if r < 2 else [2, 3], r, "pair")
    # renumbered in the given order, not sorted
    rev = comm.new_group([3, 1, 0])
    if r == 2:
        assert rev is None
    else:
        _check_group(rev, [3, 1, 0], r, "[3, 1, 0]")
        rev.close()
    mine.close()
    return r


def test_new_group_pairs_and_reordered(transport):
    assert run_ranks(_pairs, 4, transport) == [0, 1, 2, 3]


# ---------------------------------------------------------------- split

def _split_parity(comm):
    r = comm.rank
    # keys reverse the order: color 0 -> [2, 0], color 1 -> [3, 1]
    g = comm.split(r % 2, key=-r)
    members = [q for q in reversed(range(comm.world_size)) if q % 2 == r % 2]
    _check_group(g, members, r, "split(rank % 2, key=-rank)")
    # default key: parent order; color None: not in any group
    h = comm.split(None if r == 1 else 5)
    if r == 1:
        assert h is None
    else:
        _check_group(h, [0, 2, 3], r, "split(5) without rank 1")
        h.close()
    g.close()
    return g.world_size


def test_split_by_parity_with_reversed_keys(transport):
    assert run_ranks(_split_parity, 4, transport) == [2, 2, 2, 2]


def _split_uneven(comm):
    r = comm.rank
    g = comm.split(0 if r == 0 else 1)
    _check_group(g, [0] if r == 0 else [1, 2], r, "uneven split")
    # a negative color is "no group", like MPI_UNDEFINED
    h = comm.split(-3 if r == 2 else 0, key=10 - r)
    if r == 2:
        assert h is None
    else:
        _check_group(h, [1, 0], r, "split without rank 2")
        h.close()
    g.close()
    return g.world_size


def test_split_three_ranks_uneven(transport):
    assert run_ranks(_split_uneven, 3, transport) == [1, 2, 2]


# ---------------------------------------------------------------- with the parent

def _interleaved(comm):
    r = comm.rank
    g = comm.split(r // 2)  # {0, 1}, {2, 3}
    members = [0, 1] if r < 2 else [2, 3]
    for step in range(3):
        _parent_all_reduce(comm, seed=step)
        # async ops on both communicators in flight together
        inputs = [rank_input(q, 5000, torch.float64, "sum", seed=10 + step) for q in members]
        tg = inputs[g.rank].clone()
        wg = g.all_reduce(tg, async_op=True)
        pin = [rank_input(q, 5000, torch.float64, "max", seed=20 + step)
               for q in range(comm.world_size)]
        tp = pin[r].clone()
        wp = comm.all_reduce(tp, op="max", async_op=True)
        wp.wait()
        wg.wait()
        assert_matches(tg, reference(inputs, "sum"), f"group all_reduce step {step}")
        assert_matches(tp, reference(pin, "max"), f"parent all_reduce step {step}")
        _check_group(g, members, r, f"group step {step}")
    g.close()
    assert g.closed
    with pytest.raises(RuntimeError, match="closed"):
        g.all_reduce(torch.ones(2))
    with pytest.raises(RuntimeError, match="new_group: the communicator is closed"):
        g.new_group([0])
    _parent_all_reduce(comm, seed=99)  # the parent is untouched
    return r


def test_groups_interleaved_with_parent_and_closed_first(transport):
    assert run_ranks(_interleaved, 4, transport) == [0, 1, 2, 3]


def _parent_closed_first(comm):
    r = comm.rank
    parent = _second_parent(comm, "closed-parent", check=True)
    g = parent.split(r % 2)
    assert g.check, "a group inherits checked mode"
    parent.close()
    with pytest.raises(RuntimeError, match="split: the communicator is closed"):
        parent.split(0)
    # the group has its own transport and store prefix: it outlives its parent
    members = [q for q in range(comm.world_size) if q % 2 == r % 2]
    _check_group(g, members, r, "group of a closed parent")
    sub = g.new_group([0])
    if g.rank == 0:
        t = torch.arange(4.0)
        sub.all_reduce(t)
        assert torch.equal(t, torch.arange(4.0))
        sub.close()
    # checked mode in the group: a mismatch is a ValueError on every member
    with pytest.raises(ValueError, match="mismatched"):
        g.all_reduce(torch.ones(3 + g.rank))
    _check_group(g, members, r, "group after a checked-mode mismatch")
    g.close()
    return r


def test_closing_the_parent_leaves_groups_usable(transport):
    assert run_ranks(_parent_closed_first, 4, transport) == [0, 1, 2, 3]


# ---------------------------------------------------------------- rendezvous keys

def _partial_creation(comm):
    r = comm.rank
    # Group {0, 1}: rank 2 calls new_group for it (a non-member: None at
    # once), rank 3 skips the call. With rendezvous keys from a process-wide
    # counter, every later group would now disagree between ranks {0, 1, 2}
    # and rank 3 (and hang until the timeout).
    first = comm.new_group([0, 1]) if r != 3 else None
    if r < 2:
        _check_group(first, [0, 1], r, "first {0, 1}")
    # Ranks 1 and 2 alone create {1, 2} twice; 0 and 3 never hear of it.
    extra = [comm.new_group([1, 2]) for _ in range(2)] if r in (1, 2) else []
    for i, e in enumerate(extra):
        _check_group(e, [1, 2], r, f"{{1, 2}} #{i}")
    # Then every rank creates the same groups: all must still meet.
    everyone = comm.new_group([0, 1, 2, 3])
    _check_group(everyone, [0, 1, 2, 3], r, "all four")
    again = comm.new_group([0, 1])
    if r < 2:
        _check_group(again, [0, 1], r, "second {0, 1}")
    pair = comm.new_group([2, 3])
    if r >= 2:
        _check_group(pair, [2, 3], r, "{2, 3}")
    halves = comm.split(r // 2)
    _check_group(halves, [0, 1] if r < 2 else [2, 3], r, "split after partial groups")
    for g in [first, *extra, everyone, again, pair, halves]:
        if g is not None:
            g.close()
    _parent_all_reduce(comm, seed=5)
    return r


def test_group_created_by_some_ranks_does_not_desynchronise_later_groups(transport):
    assert run_ranks(_partial_creation, 4, transport) == [0, 1, 2, 3]


def _group_churn_keys(comm):
    r, n = comm.rank, comm.world_size
    comm.barrier()
    before = sorted(comm._store.list_keys())
    comm.barrier()  # nobody makes a group before every rank has listed the keys
    for i in range(4):
        g = comm.new_group(list(range(n)))
        _check_group(g, list(range(n)), r, f"churn {i}")
        nested = g.new_group([0, 1])  # its keys under g's prefix: it outlives g
        g.close()
        if nested is not None:
            _check_group(nested, [0, 1], r, f"nested {i}")
            nested.close()
        comm.split(r % 2).close()
    comm.barrier()  # every member has closed every group
    return before, sorted(comm._store.list_keys())


def _shrink_a_group(comm):
    g = comm.new_group(list(range(comm.world_size)))
    s = g.shrink(exclude=[])  # closes g on every member: its keys must outlive it
    _check_group(s, list(range(comm.world_size)), comm.rank, "shrunk group")
    s.close()
    return comm.rank


def test_shrinking_a_group_keeps_the_new_communicators_keys(transport):
    assert run_ranks(_shrink_a_group, 3, transport) == [0, 1, 2]


def test_closed_groups_leave_no_store_keys(transport):
    # The store keeps keys for the job's life on its host: a program that
    # makes groups again and again would grow it (12 keys per 4-rank gloo
    # group before _store.release_keys).
    for before, after in run_ranks(_group_churn_keys, 4, transport):
        assert after == before


# ---------------------------------------------------------------- bad input

def _bad_ranks(comm):
    import pycomm

    n = comm.world_size
    cases = [
        ([], ValueError, "empty"),
        ([0, 0], ValueError, r"ranks \[0\] appear more than once"),
        ([1, 2, 1, 2], ValueError, r"ranks \[1, 2\] appear more than once"),
        ([0, n], ValueError, rf"ranks \[{n}\] are out of range for world_size {n}"),
        ([-1], ValueError, "out of range"),
        ([0, 1.0], TypeError, "must be ints"),
        ([True], TypeError, "must be ints"),
        ("01", TypeError, "sequence of ints"),
        (3, TypeError, "sequence of ints"),
    ]
    for ranks, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            comm.new_group(ranks)
    with pytest.raises(TypeError, match="split: color must be an int or None"):
        comm.split("red")
    with pytest.raises(TypeError, match="split: key must be an int or None"):
        comm.split(0, key=1.5)
    with pytest.raises(ValueError, match="split: color=.* does not fit in 64 bits"):
        comm.split(1 << 64)
    # nothing was exchanged: the parent and later groups are unaffected
    g = pycomm.new_group(range(n))
    _check_group(g, list(range(n)), comm.rank, "group after bad calls")
    g.close()
    return True


def test_bad_ranks_raise_clear_errors(transport):
    assert run_ranks(_bad_ranks, 4, transport) == [True] * 4


# ---------------------------------------------------------------- example

def test_groups_example_under_torchrun():
    """examples/groups.py (the README's Groups section) on 4 ranks."""
    import re

    from tests._dist import run_torchrun

    proc = run_torchrun("examples/groups.py", 4)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ok = re.findall(r"rank (\d)/4: row \d/2 col \d/2 row sum [\d.]+ \(OK\)", proc.stdout)
    assert sorted(ok) == ["0", "1", "2", "3"], proc.stdout
    assert "WRONG" not in proc.stdout


def test_group_functions_are_public():
    import pycomm

    for name in ("new_group", "split"):
        assert name in pycomm.__all__ and callable(getattr(pycomm, name)), name
        assert callable(getattr(pycomm.Communicator, name)), name


# ---------------------------------------------------------------- a member that never comes

def _missing_member(comm):
    import pycomm

    r = comm.rank
    parent = _second_parent(comm, "missing-member")  # its group counts are this test's alone
    if r == 2:  # rank 3 never creates {2, 3}: the rendezvous names it at the group's timeout
        with pytest.raises(pycomm.CommError, match=r"creating the group of ranks \[2, 3\].*rank 3 "
                           r"\(group rank 1\) did not arrive within the group's timeout \(3 s\)"):
            parent.new_group([2, 3], timeout=3)
    _parent_all_reduce(parent, seed=3)  # the parent is unaffected
    g = parent.new_group([0, 1])  # and groups of other members still meet
    if r < 2:
        _check_group(g, [0, 1], r, "after a failed group")
        g.close()
    parent.close()
    return r


def test_member_that_never_creates_the_group_fails_cleanly(transport):
    assert run_ranks(_missing_member, 4, transport) == [0, 1, 2, 3]


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_native_split_is_nccl_only(transport):
    """The binding's split (ncclCommSplit) exists on every communicator, but a
    CPU transport says it has none instead of doing something else;
    Communicator.split then uses the store path (the tests above)."""
    import pycomm

    with pycomm.init(rank=0, world_size=1, store=dist.HashStore(), transport=transport,
                     set_default=False) as comm:
        with pytest.raises(ValueError, match="has no split of its own"):
            comm._impl.split(0, 0, 1000)
        group = comm.split(0)
        assert group is not None and group.world_size == 1 and group.transport == transport
        group.close()
