"""reduce, gather, scatter, all_to_all and all_to_all_single (issue 24) on real
ranks against independent references (float64 for reductions, the inputs
themselves for data movement), every root, every CPU transport, 1 to 4
ranks (4 in the slow run: reference.SWEEP_WORLDS); mismatched calls across ranks; bad input."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from tests._dist import client_store, run_ranks, spawn_ranks
from tests.reference import (
    SWEEP_WORLDS,
    DTYPES,
    LARGE_COUNT,
    OPS,
    SMALL_COUNTS,
    assert_matches,
    rank_input,
    reference,
)

# ---------------------------------------------------------------- reduce

def _reduce_cases(comm, large: bool):
    n, r = comm.world_size, comm.rank
    cases = [(c, dt, op) for dt in DTYPES for op in OPS for c in SMALL_COUNTS
             if not (op == "avg" and not dt.is_floating_point)]
    # many slices: the chain's pipeline with middle ranks lagging two slices
    cases.append((comm._impl.slice_bytes // 4 * 5 + 3, torch.float32, "sum"))
    cases.append((comm._impl.slice_bytes // 4 * 3 + 1, torch.float64, "avg"))
    if large:
        cases += [(LARGE_COUNT, dt, "sum") for dt in DTYPES]
        cases += [(LARGE_COUNT, torch.float32, "max"), (LARGE_COUNT, torch.bfloat16, "avg")]
    else:
        cases.append((LARGE_COUNT, torch.float32, "sum"))
    for count, dtype, op in cases:
        inputs = [rank_input(q, count, dtype, op) for q in range(n)]
        for dst in range(n):
            t = inputs[r].clone()
            work = comm.reduce(t, dst=dst, op=op, async_op=dst % 2 == 1)
            if work is not None:
                work.wait()
                assert work.get_future().value()[0] is t
            if r == dst:
                assert_matches(t, reference(inputs, op), f"reduce {op} {dtype} count={count} "
                                                         f"dst={dst}")


@pytest.mark.parametrize("world_size", SWEEP_WORLDS)
def test_reduce_every_op_dtype_size_root(transport, world_size):
    run_ranks(_reduce_cases, world_size, transport, False)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reduce_large(transport, world_size):
    run_ranks(_reduce_cases, world_size, transport, True, timeout=600)


# ---------------------------------------------------------------- gather / scatter

MOVE_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.int8]


def _gather_scatter_cases(comm, counts):
    n, r = comm.world_size, comm.rank
    for count in counts:
        for dtype in MOVE_DTYPES:
            inputs = [rank_input(q, count, dtype, "sum") for q in range(n)]
            for root in range(n):
                what = f"{dtype} count={count} root={root}"
                # gather; on the root, its own slot may be the input itself
                mine = inputs[r].clone()
                outs = None
                if r == root:
                    outs = [torch.full((count,), 7, dtype=dtype) for _ in range(n)]
                    if root % 2:
                        outs[root] = mine
                work = comm.gather(outs, mine, dst=root, async_op=count == 13)
                if work is not None:
                    work.wait()
                assert torch.equal(mine, inputs[r]), f"gather modified its input: {what}"
                if r == root:
                    for q in range(n):
                        assert torch.equal(outs[q], inputs[q]), f"gather {what}: block {q}"
                # scatter: rank q gets the root's block q
                blocks = [rank_input(100 + root, count, dtype, "sum", seed=q) for q in range(n)]
                out = torch.full((count,), 7, dtype=dtype)
                work = comm.scatter(out, blocks if r == root else None, src=root,
                                    async_op=count == 13)
                if work is not None:
                    work.wait()
                assert torch.equal(out, blocks[r]), f"scatter {what}"


@pytest.mark.parametrize("world_size", SWEEP_WORLDS)
def test_gather_scatter(transport, world_size):
    run_ranks(_gather_scatter_cases, world_size, transport, SMALL_COUNTS + [LARGE_COUNT // 8])


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gather_scatter_large(transport, world_size):
    run_ranks(_gather_scatter_cases, world_size, transport, [LARGE_COUNT], timeout=600)


# ---------------------------------------------------------------- all_to_all

def _split_matrix(n: int, seed: int) -> list[list[int]]:
    """S[i][j]: rows rank i sends to rank j; uneven, with zeros."""
    return [[(i * 7 + j * 3 + seed) % 5 for j in range(n)] for i in range(n)]


def _block(i: int, j: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """What rank i sends to rank j (distinct per pair)."""
    return rank_input(i, rows * width, dtype, "sum", seed=1000 + j).view(rows, width)


def _all_to_all_cases(comm, large: bool):
    n, r = comm.world_size, comm.rank
    for dtype in MOVE_DTYPES:
        # all_to_all_single, even blocks (no splits), 1-D and 2-D
        per_peer = [0, 1, 13, 1031] + ([LARGE_COUNT // n] if large else [4099])
        for m in per_peer:
            inp = torch.cat([_block(r, p, m, 1, dtype) for p in range(n)]).view(-1)
            out = torch.full((n * m,), 7, dtype=dtype)
            comm.all_to_all_single(out, inp)
            expect = torch.cat([_block(p, r, m, 1, dtype) for p in range(n)]).view(-1)
            assert torch.equal(out, expect), f"all_to_all_single even {dtype} m={m}"
        # uneven splits with zero-length blocks, rows of width 3
        for seed in range(3):
            S = _split_matrix(n, seed)
            ins = [_block(r, p, S[r][p], 3, dtype) for p in range(n)]
            inp = torch.cat(ins)
            out = torch.full((sum(S[p][r] for p in range(n)), 3), 7, dtype=dtype)
            work = comm.all_to_all_single(out, inp, [S[p][r] for p in range(n)], S[r],
                                          async_op=seed == 1)
            if work is not None:
                work.wait()
            expect = torch.cat([_block(p, r, S[p][r], 3, dtype) for p in range(n)])
            assert torch.equal(out, expect), f"all_to_all_single uneven {dtype} seed={seed}"
            # the same with lists, one tensor per peer
            outs = [torch.full((S[p][r], 3), 7, dtype=dtype) for p in range(n)]
            comm.all_to_all(outs, ins)
            for p in range(n):
                assert torch.equal(outs[p], _block(p, r, S[p][r], 3, dtype)), \
                    f"all_to_all lists {dtype} seed={seed} from {p}"
    # lists of even size, async
    outs = [torch.empty(5) for _ in range(n)]
    comm.all_to_all(outs, [torch.full((5,), float(10 * r + p)) for p in range(n)],
                    async_op=True).wait()
    assert [o.tolist() for o in outs] == [[float(10 * p + r)] * 5 for p in range(n)]


@pytest.mark.parametrize("world_size", SWEEP_WORLDS)
def test_all_to_all(transport, world_size):
    run_ranks(_all_to_all_cases, world_size, transport, False)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_to_all_large(transport, world_size):
    run_ranks(_all_to_all_cases, world_size, transport, True, timeout=600)


# ---------------------------------------------------------------- mismatches

COMM_TIMEOUT_S = 10.0


def _mismatch_cases(transport: str, check: bool):
    """(name, call(comm), fragments). Each call differs across ranks."""
    def splits(c):  # rank 0 sends 2 rows to rank 1, which expects 1
        n, r = c.world_size, c.rank
        send = [1] * n
        recv = [1] * n
        if r == 0:
            send[1] = 2
        inp, out = torch.ones(sum(send)), torch.empty(sum(recv))
        c.all_to_all_single(out, inp, recv, send)

    def splits_zero(c):  # rank 1 expects 0 rows from rank 0, which sends 3
        n, r = c.world_size, c.rank
        send, recv = [3] * n, [3] * n
        if r == 1:
            recv[0] = 0
        c.all_to_all_single(torch.empty(sum(recv)), torch.ones(sum(send)), recv, send)

    def lists(c):  # all_to_all with lists: rank 1 expects 4 elements from rank 0, gets 5
        n, r = c.world_size, c.rank
        ins = [torch.ones(5 if (r == 0 and p == 1) else 4) for p in range(n)]
        outs = [torch.empty(4) for _ in range(n)]
        c.all_to_all(outs, ins)

    def even_count(c):  # even blocks (no splits) of different sizes
        n, r = c.world_size, c.rank
        m = 4 + (r == 1)
        c.all_to_all_single(torch.empty(n * m), torch.ones(n * m))

    def reduce_count(c):
        c.reduce(torch.ones(8 + (c.rank == 1)), dst=0)

    def reduce_root(c):
        c.reduce(torch.ones(8), dst=1 if c.rank == 1 else 0)

    def gather_root(c):
        dst = 1 if c.rank == 1 else 0
        c.gather([torch.empty(4) for _ in range(c.world_size)] if c.rank == dst else None,
                 torch.ones(4), dst=dst)

    def scatter_root(c):
        src = 1 if c.rank == 1 else 0
        c.scatter(torch.empty(4), [torch.ones(4)] * c.world_size if c.rank == src else None,
                  src=src)

    split_frag = ["split sizes differ", "rank 0 sends"]
    cases = [
        ("uneven splits", splits, split_frag + ["2 elements to rank 1, which expects 1"]),
        ("zero-length split", splits_zero, split_frag + ["3 elements to rank 1, which expects 0"]),
        ("lists", lists, split_frag + ["5 elements to rank 1, which expects 4"]),
        ("even blocks differ", even_count, split_frag + ["4 elements to rank 1, which expects 5"]),
    ]
    if check:
        cases += [
            ("reduce count", reduce_count, ["checked mode", "count=8", "count=9"]),
            ("reduce root", reduce_root, ["checked mode", "root=0", "root=1"]),
            ("gather root", gather_root, ["checked mode", "gather", "root=0", "root=1"]),
            ("scatter root", scatter_root, ["checked mode", "scatter", "root=0", "root=1"]),
        ]
    else:
        cases += [
            ("reduce count", reduce_count, ["count differs", "reduce"]),
        ]
        if transport == "shm":
            # a rank waiting for a message sees its peer's op line (gloo: the
            # two roots only wait for each other, until the timeout)
            cases += [
                ("reduce root", reduce_root, ["root differs"]),
                ("gather root", gather_root, ["root differs"]),
                # both roots only send: the next call receives a scatter message
                ("scatter root", scatter_root, ["scatter #1", "root="]),
            ]
    return cases


def _run_mismatches(rank, world_size, port, transport, check):
    import pycomm

    out = []
    for i, (name, call, _) in enumerate(_mismatch_cases(transport, check)):
        store = torch.distributed.PrefixStore(f"case{i}", client_store(port, world_size))
        comm = pycomm.init(rank=rank, world_size=world_size, store=store, transport=transport,
                           timeout=timedelta(seconds=COMM_TIMEOUT_S), check=check)
        err = kind = None
        try:
            call(comm)
            # a rank that only sends (reduce's chain tail, scatter's root) may
            # finish the op and learn of the failure at its next call
            comm.barrier()
        except (pycomm.CommError, ValueError) as e:
            kind, err = type(e).__name__, str(e)
        usable = None
        if err is not None:
            try:
                comm.all_reduce(torch.ones(2))
                usable = True
            except pycomm.CommError:
                usable = False
        try:
            comm.close()
        except pycomm.CommError:
            pass
        out.append((name, kind, err, usable))
    return out


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_mismatched_calls_raise_on_every_rank(transport, world_size, check):
    """Split sizes that differ between a sender and its receiver: CommError on
    every rank (the verification exchange), whatever the settings. Counts and
    roots: the op header (CommError, communicator failed; a rank that only
    sends learns of it at its next call) or, in checked mode, the
    fingerprints (ValueError, communicator still usable)."""
    results = spawn_ranks(_run_mismatches, world_size, transport, check, timeout=600)
    problems = []
    for i, (name, _, fragments) in enumerate(_mismatch_cases(transport, check)):
        split_case = "split sizes differ" in fragments
        want = "ValueError" if check and not split_case else "CommError"
        informed = 0
        for r in range(world_size):
            _, kind, err, usable = results[r][i]
            if kind != want:
                problems.append(f"{name}: rank {r} raised {kind} ({err}), expected {want}")
                continue
            if usable != (want == "ValueError"):
                problems.append(f"{name}: rank {r}: communicator usable={usable} afterwards")
            informed += all(f in err for f in fragments)
        # every rank holds the verification table / the fingerprints; a header
        # mismatch reaches the ranks that did not see it through the abort
        need = world_size if (split_case or check or transport == "shm") else 1
        if informed < need:
            errs = [results[r][i][2] for r in range(world_size)]
            problems.append(f"{name}: {informed} of {world_size} ranks name {fragments}: {errs}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- bad input

def _bad_input(comm):
    """Every case raises on every rank before anything is sent (so the ranks
    stay in step); returns what each case raised."""
    n, r = comm.world_size, comm.rank
    t = torch.ones(4)
    L = [torch.ones(4) for _ in range(n)]  # noqa: N806
    cases = [
        ("reduce dst too big", lambda: comm.reduce(t, dst=n), ValueError, "dst=2 is out of range"),
        ("reduce dst negative", lambda: comm.reduce(t, dst=-1), ValueError, "out of range"),
        ("reduce avg on ints", lambda: comm.reduce(torch.ones(4, dtype=torch.int32), op="avg"),
         ValueError, "AVG"),
        ("reduce bad dtype", lambda: comm.reduce(torch.ones(4, dtype=torch.complex64)),
         TypeError, "tensor has unsupported dtype"),
        ("reduce wrong device", lambda: comm.reduce(torch.ones(4, device="meta")), ValueError,
         "meta"),
        ("reduce not a tensor", lambda: comm.reduce([1.0]), TypeError, "tensor must be a torch"),
        # rank 0 is the root: a list of the wrong length; rank 1 passes a list
        ("gather list", lambda: comm.gather(L[:1] if r == 0 else L, t, dst=0), ValueError,
         "gather_list must hold world_size = 2 tensors" if r == 0 else
         "gather_list must be None on ranks other than dst=0"),
        ("gather list dtype", lambda: comm.gather(
            [torch.ones(4, dtype=torch.float64)] * n, t, dst=r), TypeError,
         "gather_list[0] dtype"),
        ("gather list numel", lambda: comm.gather([torch.ones(5)] * n, t, dst=r), ValueError,
         "gather_list[0] has 5 elements"),
        ("gather list not a list", lambda: comm.gather(t, t, dst=r), TypeError,
         "gather_list must be a list"),
        ("gather dst", lambda: comm.gather(None, t, dst=n + 1), ValueError, "dst=3"),
        ("scatter list", lambda: comm.scatter(t, L if r == 1 else L[:1], src=0), ValueError,
         "scatter_list must hold world_size" if r == 0 else "scatter_list must be None"),
        ("scatter src", lambda: comm.scatter(t, None, src=-3), ValueError, "src=-3"),
        ("scatter list numel", lambda: comm.scatter(t, [torch.ones(3)] * n, src=r), ValueError,
         "scatter_list[0] has 3 elements"),
        ("all_to_all lengths", lambda: comm.all_to_all(L[:1], L), ValueError,
         "output_tensor_list must hold world_size = 2"),
        ("all_to_all dtypes", lambda: comm.all_to_all(
            L, [torch.ones(4, dtype=torch.int8)] + L[1:]), TypeError, "dtype"),
        ("all_to_all self block", lambda: comm.all_to_all(
            [torch.ones(3)] * n, L), ValueError, "block to itself"),
        ("all_to_all not a list", lambda: comm.all_to_all(None, L), TypeError,
         "output_tensor_list must be a list of tensors"),
        ("a2a single splits length", lambda: comm.all_to_all_single(
            torch.empty(4), t, [2, 2], [4]), ValueError, "input_split_sizes must have"),
        ("a2a single splits sum", lambda: comm.all_to_all_single(
            torch.empty(4), t, [2, 2], [1, 2]), ValueError, "input_split_sizes sum to 3"),
        ("a2a single out splits sum", lambda: comm.all_to_all_single(
            torch.empty(4), t, [3, 3], [2, 2]), ValueError, "output_split_sizes sum to 6"),
        ("a2a single negative", lambda: comm.all_to_all_single(
            torch.empty(4), t, [2, 2], [5, -1]), ValueError, "input_split_sizes[1] = -1"),
        ("a2a single not divisible", lambda: comm.all_to_all_single(
            torch.empty(5), torch.ones(5)), ValueError, "not divisible by world_size"),
        ("a2a single dtype", lambda: comm.all_to_all_single(
            torch.empty(4, dtype=torch.int64), t), TypeError, "output dtype"),
        ("a2a single device", lambda: comm.all_to_all_single(
            torch.empty(4, device="meta"), t), ValueError, "output is on meta"),
        ("a2a single overlap", lambda: comm.all_to_all_single(t, t), ValueError, "overlaps"),
        ("a2a single splits type", lambda: comm.all_to_all_single(
            torch.empty(4), t, "22", None), TypeError, "output_split_sizes must be a list"),
        ("a2a single self block", lambda: comm.all_to_all_single(
            torch.empty(4), t, [1, 3] if r == 0 else [3, 1], [2, 2]), ValueError,
         "block to itself"),
    ]
    failures = []
    for name, call, exc, fragment in cases:
        try:
            call()
        except exc as e:
            if fragment not in str(e):
                failures.append(f"{name}: {str(e)!r} lacks {fragment!r}")
        except Exception as e:  # noqa: BLE001 - reported
            failures.append(f"{name}: expected {exc.__name__}, got {type(e).__name__}: {e}")
        else:
            failures.append(f"{name}: no exception")
    # nothing was sent: the ranks are still in step
    x = torch.full((3,), float(r + 1))
    comm.reduce(x, dst=0)
    if r == 0 and x.tolist() != [float(n * (n + 1) // 2)] * 3:
        failures.append(f"reduce after the errors gave {x.tolist()}")
    return failures


def test_bad_input_raises_clear_errors():
    assert run_ranks(_bad_input, 2, "shm") == [[], []]


# ---------------------------------------------------------------- one rank, module level

def test_single_rank_and_module_level_twins():
    import pycomm

    with pycomm.init(rank=0, world_size=1, store=torch.distributed.HashStore()):
        t = torch.arange(5.0)
        pycomm.reduce(t, dst=0, op="avg")
        assert torch.equal(t, torch.arange(5.0))
        outs = [torch.empty(5)]
        pycomm.gather(outs, t, dst=0)
        assert torch.equal(outs[0], t)
        out = torch.empty(5)
        pycomm.scatter(out, [t], src=0)
        assert torch.equal(out, t)
        out = torch.empty(5)
        pycomm.all_to_all_single(out, t)
        assert torch.equal(out, t)
        pycomm.all_to_all_single(out, t, [5], [5])
        assert torch.equal(out, t)
        outs = [torch.empty(2)]
        pycomm.all_to_all(outs, [torch.ones(2)])
        assert torch.equal(outs[0], torch.ones(2))
        work = pycomm.reduce(t, async_op=True)
        work.wait()
        assert work.is_completed()
