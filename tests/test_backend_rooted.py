"""The pycomm backend's rooted collectives, all-to-alls, coalesced variants,
object collectives, sequence numbers and sparse-tensor errors, through the
torch.distributed API against float64 references (one spawned world runs
every case; 2 and 3 ranks). The 2-rank world runs with
TORCH_DISTRIBUTED_DEBUG=DETAIL, which needs sequence numbers."""

from __future__ import annotations

import pytest
import torch

from tests._dist import spawn_ranks
from tests.reference import assert_matches, rank_input, reference
from tests.test_backend import _init

COUNTS = [0, 1, 13]
DTYPES = [torch.float32, torch.int32]


def _noncontig(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous view (every other element)."""
    base = torch.zeros(2 * t.numel(), dtype=t.dtype)
    view = base[::2]
    view.copy_(t)
    return view


def _check_reduce(rank: int, n: int) -> None:
    import torch.distributed as dist

    for count in COUNTS:
        for dtype in DTYPES:
            for op in ("sum", "max"):
                inputs = [rank_input(r, count, dtype, op) for r in range(n)]
                ref = reference(inputs, op)
                for dst in range(n):
                    for make in (torch.Tensor.clone, _noncontig):
                        t = make(inputs[rank])
                        dist.reduce(t, dst, op=getattr(dist.ReduceOp, op.upper()))
                        what = f"reduce {op} {dtype} count={count} dst={dst}"
                        if rank == dst:
                            assert_matches(t, ref, what)
                        else:  # left as it was
                            assert torch.equal(t, inputs[rank]), what


def _check_gather_scatter(rank: int, n: int) -> None:
    import torch.distributed as dist

    for count in COUNTS:
        for dtype in DTYPES:
            inputs = [rank_input(r, count, dtype, "sum", seed=2) for r in range(n)]
            for root in range(n):
                outs = [_noncontig(torch.zeros(count, dtype=dtype)) for _ in range(n)]
                work = dist.gather(inputs[rank], outs if rank == root else None, dst=root,
                                   async_op=True)
                work.wait()
                if rank == root:
                    for r in range(n):
                        assert torch.equal(outs[r], inputs[r]), ("gather", count, dtype, root, r)
                out = _noncontig(torch.zeros(count, dtype=dtype))
                dist.scatter(out, inputs if rank == root else None, src=root)
                assert torch.equal(out, inputs[root] * 0 + inputs[rank]) or count == 0, (
                    "scatter", count, dtype, root)
    objs = [None] * n if rank == 0 else None
    dist.gather_object({"rank": rank, "s": "x" * rank}, objs, dst=0)
    if rank == 0:
        assert objs == [{"rank": r, "s": "x" * r} for r in range(n)]
    got: list = [None]
    dist.scatter_object_list(got, [("to", r) for r in range(n)] if rank == n - 1 else None,
                             src=n - 1)
    assert got == [("to", rank)]
    everyone = [None] * n
    dist.all_gather_object(everyone, rank * 10)
    assert everyone == [r * 10 for r in range(n)]


def _block(src: int, dst: int, rows: int, cols: int = 3) -> torch.Tensor:
    """What rank `src` sends rank `dst`: values that name both."""
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 1000 * src + dst


def _check_all_to_all(rank: int, n: int) -> None:
    import torch.distributed as dist

    # Lists, a different size per pair (0 included).
    def rows(src: int, dst: int) -> int:
        return (src + 2 * dst) % 3

    ins = [_block(rank, p, rows(rank, p)) for p in range(n)]
    outs = [torch.empty(rows(p, rank), 3) for p in range(n)]
    dist.all_to_all(outs, ins)
    for p in range(n):
        assert torch.equal(outs[p], _block(p, rank, rows(p, rank))), ("all_to_all", p)
    # One tensor, even splits and uneven ones (non-contiguous output).
    for uneven in (False, True):
        r_of = rows if uneven else (lambda s, d: 2)
        inp = torch.cat([_block(rank, p, r_of(rank, p)) for p in range(n)])
        total = sum(r_of(p, rank) for p in range(n))
        out = torch.zeros(3, total).t()  # non-contiguous [total, 3]
        in_splits = [r_of(rank, p) for p in range(n)] if uneven else None
        out_splits = [r_of(p, rank) for p in range(n)] if uneven else None
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, async_op=True)
        work.wait()
        want = torch.cat([_block(p, rank, r_of(p, rank)) for p in range(n)])
        assert torch.equal(out, want), ("all_to_all_single", uneven)


def _check_coalesced(rank: int, n: int) -> None:
    import torch.distributed as dist

    # Several tensors (one packed op), and one (the flat op, unpacked).
    for sizes in ([1, 7, 0, 4], [5]):
        ins = [torch.full((s,), 10.0 * rank + i) for i, s in enumerate(sizes)]
        outs = [torch.zeros(n * s) for s in sizes]
        with dist._coalescing_manager():
            for o, i in zip(outs, ins):
                dist.all_gather_into_tensor(o, i)
        for k, s in enumerate(sizes):
            want = torch.cat([torch.full((s,), 10.0 * r + k) for r in range(n)])
            assert torch.equal(outs[k], want), ("allgather_into_tensor_coalesced", k)
        # reduce_scatter_tensor_coalesced: rank r's block j of input k is r + j + k.
        big = [torch.cat([torch.full((s,), float(rank + j + k)) for j in range(n)])
               for k, s in enumerate(sizes)]
        outs = [torch.zeros(s) for s in sizes]
        with dist._coalescing_manager():
            for o, i in zip(outs, big):
                dist.reduce_scatter_tensor(o, i)
        for k, s in enumerate(sizes):
            want = torch.full((s,), float(sum(r + rank + k for r in range(n))))
            assert torch.equal(outs[k], want), ("reduce_scatter_tensor_coalesced", k)
        # Called directly, each reports itself as coalesced, one tensor or several.
        from torch._C._distributed_c10d import OpType
        pg = dist.group.WORLD
        ins = [torch.ones(s) for s in sizes]
        works = [pg.allgather_into_tensor_coalesced([torch.zeros(n * s) for s in sizes], ins),
                 pg.reduce_scatter_tensor_coalesced([torch.zeros(s) for s in sizes],
                                                    [torch.ones(n * s) for s in sizes])]
        for w in works:
            w.wait()
            assert w._get_op_type() == int(OpType.COALESCED), (sizes, w._get_op_type())
    sizes = [1, 7, 0, 4]
    # all_gather_coalesced (deprecated API): output_lists[r][k] = rank r's input k.
    ins = [torch.full((s,), 100.0 * rank + k) for k, s in enumerate(sizes)]
    output_lists = [[torch.zeros(s) for s in sizes] for _ in range(n)]
    with pytest.warns(FutureWarning):
        dist.all_gather_coalesced(output_lists, ins)
    for r in range(n):
        for k, s in enumerate(sizes):
            assert torch.equal(output_lists[r][k], torch.full((s,), 100.0 * r + k))


def _check_errors_and_seq(rank: int, n: int) -> None:
    import torch.distributed as dist

    # ProcessGroup's own call only forwards for built-in backends: ask ours
    # (or, under DETAIL, the wrapper around it, which checks every collective).
    pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    detail = dist.get_debug_level() == dist.DebugLevel.DETAIL
    assert detail == (type(pg).__name__ == "_ProcessGroupWrapper"), type(pg)
    before = pg._get_sequence_number_for_group()
    dist.all_reduce(torch.ones(1))
    assert pg._get_sequence_number_for_group() == before + 1
    seqs = [None] * n
    dist.all_gather_object(seqs, pg._get_sequence_number_for_group())
    assert len(set(seqs)) == 1, seqs
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    # (Other ops have no sparse kernel in torch's dispatcher: torch raises.)
    for async_op in (False, True):
        with pytest.raises(TypeError, match="sparse tensor.*dense"):
            dist.all_reduce(sparse, async_op=async_op)
    dist.barrier()  # still usable


def _rooted_world(rank: int, n: int, port: int, detail: bool) -> str:
    import os

    import torch.distributed as dist

    if detail:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()
    _init(rank, n, port)
    try:
        _check_reduce(rank, n)
        _check_gather_scatter(rank, n)
        _check_all_to_all(rank, n)
        _check_coalesced(rank, n)
        _check_errors_and_seq(rank, n)
    finally:
        dist.destroy_process_group()
    return "ok"


@pytest.mark.parametrize("world_size", [2, 3])
def test_rooted_alltoall_coalesced_objects_errors(world_size):
    detail = world_size == 2
    assert spawn_ranks(_rooted_world, world_size, detail, timeout=300) == ["ok"] * world_size
