"""One rank of a simulated-hosts test (tests/test_hosts.py): runs every
collective against float64 references and prints one line,
``OK <rank> <hostname> <transport>``, or raises (non-zero exit).

Started by pycomm.bench.simhosts with torchrun's variables; argv[1] is the
transport to ask for ("auto", "gloo", ...).
"""

from __future__ import annotations

import itertools
import os
import socket
import sys

import torch

import pycomm
from tests.reference import assert_matches, rank_input, reference

SIZES = [0, 1, 7, 1021, 300_007]


def check_collectives(comm: pycomm.Communicator) -> None:
    r, n = comm.rank, comm.world_size
    for count in SIZES:
        for dtype, op in [(torch.float32, "sum"), (torch.float64, "avg"), (torch.int32, "max"),
                          (torch.bfloat16, "sum"), (torch.float64, "product"),
                          (torch.int64, "min")]:
            inputs = [rank_input(q, count, dtype, op) for q in range(n)]
            t = inputs[r].clone()
            comm.all_reduce(t, op=op)
            assert_matches(t, reference(inputs, op), f"all_reduce {count} {dtype} {op}")
            everyone = torch.empty(n * count, dtype=dtype)
            comm.all_gather(everyone, t)
            assert all(torch.equal(row, t) for row in everyone.view(n, count)), \
                f"all_reduce {count} {dtype} {op}: ranks differ"
        inputs = [rank_input(q, count * n, torch.float32, "sum") for q in range(n)]
        out = torch.empty(count)
        comm.reduce_scatter(out, inputs[r])
        assert_matches(out, reference(inputs, "sum")[r * count:(r + 1) * count], f"reduce_scatter {count}")
        mine = rank_input(r, count, torch.float32, "sum")
        gathered = torch.empty(count * n)
        comm.all_gather(gathered, mine)
        expect = torch.cat([rank_input(q, count, torch.float32, "sum") for q in range(n)])
        assert torch.equal(gathered, expect), f"all_gather {count}"
        for src in range(n):
            want = rank_input(src, count, torch.float64, "sum")
            t = want.clone() if r == src else torch.zeros(count, dtype=torch.float64)
            comm.broadcast(t, src=src)
            assert torch.equal(t, want), f"broadcast {count} from {src}"
    check_rooted(comm)
    check_async_and_groups(comm)
    if comm.transport == "shm+gloo":
        check_steps(comm)
        check_shm_p2p_across_a_gloo_op(comm)
        check_register_on_some_ranks(comm)
        check_interleaved(comm)
        check_ddp(comm)
    # p2p both ways around the ring (crosses hosts at every host boundary)
    right, left = (r + 1) % n, (r - 1) % n
    for count in (1, 1021, 300_007):
        got = torch.empty(count)
        mine = rank_input(r, count, torch.float32, "sum")
        works = comm.batch_isend_irecv([pycomm.P2POp("isend", mine, right),
                                        pycomm.P2POp("irecv", got, left)])
        for w in works:
            w.wait()
        assert torch.equal(got, rank_input(left, count, torch.float32, "sum")), f"p2p {count}"
    # tags: two messages to the right, received in the other order
    firsts = [torch.full((5,), 10.0 * r + k) for k in range(2)]
    works = [comm.isend(firsts[k], right, tag=7 + k) for k in range(2)]
    got = [torch.empty(5) for _ in range(2)]
    for k in (1, 0):
        assert comm.recv(got[k], left, tag=7 + k) == left
    for w in works:
        w.wait()
    assert [g[0].item() for g in got] == [10.0 * left, 10.0 * left + 1], "tags"
    if comm.transport == "shm+gloo":
        try:
            comm.recv(got[0])
            raise AssertionError("recv from any source across hosts did not raise")
        except NotImplementedError as e:
            assert "across hosts" in str(e)
    comm.barrier()


def check_quantized_wire(comm: pycomm.Communicator) -> None:
    """all_reduce(wire_dtype=torch.int8): on shm+gloo only the step between
    hosts is quantized. Host 0's ranks hold 127 and 0.5 (local 0) and 0 and
    0.5 (local 1), alternating; host 1 zeros. Summed exactly inside host 0,
    each pair is 127, 1: an int8 block with scale 1, so the result is exact.
    The flat quantized op rounds local 0's 0.5 to 0 (scale 1) and then the
    sum's 0.5 to 0: 127, 0. Small (one intra all-reduce) and large (the
    reduce-scatter's chunks, blocks at any offset) sizes, float32 and
    bfloat16 (these values are exact in both); every rank the same bits,
    with error feedback's residual too."""
    n = comm.world_size
    host, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    for count, dtype in itertools.product((1000, 300_001), (torch.float32, torch.bfloat16)):
        pattern = torch.tensor([127.0, 0.5], dtype=dtype).repeat(count // 2 + 1)[:count]
        t = torch.zeros(count, dtype=dtype)
        if host == 0 and local < 2:
            t = pattern.clone() if local == 0 else pattern.clone().mul_(pattern == 0.5)
        want = torch.tensor([127.0, 1.0], dtype=dtype).repeat(count // 2 + 1)[:count]
        comm.all_reduce(t, wire_dtype=torch.int8)
        if comm.transport == "shm+gloo":
            assert torch.equal(t, want), f"int8 wire {count} {dtype} (between hosts only): {t[:4]}"
        else:  # the flat quantized op: local 0's 0.5 and then the sum's round to 0
            assert torch.equal(t, want.masked_fill(want == 1.0, 0.0)), f"int8 wire {count} flat"
    for count, dtype in itertools.product((1000, 300_001), (torch.float32, torch.bfloat16)):
        def inputs(q: int) -> torch.Tensor:
            return torch.randn(count, generator=torch.Generator().manual_seed(q)).to(dtype)
        t, residual = inputs(comm.rank), torch.zeros(count)
        exact = sum(inputs(q).double() for q in range(n))
        comm.all_reduce(t, op="avg", wire_dtype=torch.int8, residual=residual)
        assert t.dtype == dtype
        everyone = torch.empty(n * count, dtype=dtype)
        comm.all_gather(everyone, t)
        assert all(torch.equal(row, t) for row in everyone.view(n, count)), "int8 wire: ranks differ"
        # two roundings of at most absmax / 254 each (absmax of a sum of n normals
        # < 6 sqrt(n)), and bfloat16's last one (2**-8 of the average, < 6 / sqrt(n))
        bound = 2 * 6 * n ** 0.5 / 254 + (6 / n ** 0.5 * 2 ** -8 if dtype != torch.float32 else 0)
        assert (t.double() - exact / n).abs().max() < bound, f"int8 wire avg {dtype}"
        assert residual.abs().max() > 0, "int8 wire: no error feedback"


def check_wire_differs_inside_a_host(comm: pycomm.Communicator) -> None:
    """Local rank 0 of every host all-reduces with wire_dtype=int8, local rank
    1 with float8_e4m3fn: each column between hosts agrees with itself, so only
    the exact step inside a host can see it, which its op header's wire does.
    Every rank raises (without it the columns would end with different sums).
    Leaves ``comm`` aborted: the last check."""
    wire = torch.int8 if int(os.environ["LOCAL_RANK"]) == 0 else torch.float8_e4m3fn
    try:
        comm.all_reduce(torch.full((1000,), 1.0 + comm.rank / 3), wire_dtype=wire)
    except pycomm.CommError as e:
        assert "wire_dtype differs (" in str(e), str(e)
    else:
        raise AssertionError("wire_dtype differing inside a host: no error")


def worker_threads() -> int:
    """pycomm worker threads in this process (csrc/core/worker.h names them):
    across hosts too, one per communicator (its parts share it)."""
    tasks = f"/proc/{os.getpid()}/task"
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("pycomm-worker")


def check_steps(comm: pycomm.Communicator) -> None:
    """A composed all-reduce runs on its parts the ops of its step table
    (pycomm._hierarchy.ALL_REDUCE_STEPS, which the cost model counts), on an
    even tensor (no tail), small and large; the flat ring only numbers it."""
    from pycomm._hierarchy import SMALL_BYTES, all_reduce_steps

    parts = [comm._impl, *comm._impl.hierarchy_parts]
    local = comm._impl.hierarchy_parts[0].world_size
    for count in (1024, (SMALL_BYTES // 4 + 1) * local):
        steps = all_reduce_steps(4 * count)
        seqs = [p.seq for p in parts]
        comm.all_reduce(torch.ones(count))
        ran = [p.seq - s for p, s in zip(parts, seqs)]
        want = [1] + [sum(s.comm == c for s in steps) for c in ("intra", "inter")]
        assert ran == want, f"all_reduce {count}: (flat, intra, inter) ops {ran}, table {want}"


def check_shm_p2p_across_a_gloo_op(comm: pycomm.Communicator) -> None:
    """An isend to a peer on this host, then a barrier (gloo, between hosts):
    the send, larger than shm's ring, keeps moving while the one worker
    blocks in gloo, so the peer's recv, and then its barrier, complete
    (Transport::set_while_blocked)."""
    r = comm.rank
    partner = r ^ 1  # torchrun numbering: ranks 2h and 2h + 1 share host h
    big = torch.arange(4 << 20, dtype=torch.float32) + r
    if r % 2 == 0:
        work = comm.isend(big, partner)
        comm.barrier()
        work.wait()
    else:
        got = torch.empty_like(big)
        comm.recv(got, partner)
        comm.barrier()
        assert torch.equal(got, big - 1), "shm isend across a gloo barrier"


def check_register_on_some_ranks(comm: pycomm.Communicator) -> None:
    """register=True on some ranks only, and a tensor registered on one rank
    while its peer's is not: every rank still issues the same ops (the
    registration is negotiated, never a per-rank choice of algorithm)."""
    r, n = comm.rank, comm.world_size
    for count in (1021, 300_007):  # the small all-reduce, then steps 1-3
        inputs = [rank_input(q, count, torch.float32, "sum") for q in range(n)]
        t = inputs[r].clone()
        comm.all_reduce(t, register=r % 2 == 0)
        assert_matches(t, reference(inputs, "sum"), f"all_reduce {count}, register on some")
        t = inputs[r].clone()
        comm.all_reduce(t)
        assert_matches(t, reference(inputs, "sum"), f"all_reduce {count} after it")


def check_interleaved(comm: pycomm.Communicator) -> None:
    """A group whose ranks alternate between hosts (on 2x2: group ranks 0, 2
    on host 0, 1, 3 on host 1), so that the blocks of reduce-scatter and
    all-gather are reordered between rank order and (local, host) order."""
    n = comm.world_size
    group = comm.new_group(list(range(0, n, 2)) + list(range(1, n, 2)))
    assert group is not None
    r = group.rank
    for count in (1, 1021, 70_001):
        inputs = [rank_input(q, count * n, torch.float32, "sum") for q in range(n)]
        out = torch.empty(count)
        group.reduce_scatter(out, inputs[r])
        assert_matches(out, reference(inputs, "sum")[r * count:(r + 1) * count],
                       f"interleaved reduce_scatter {count}")
        gathered = torch.empty(count * n)
        group.all_gather(gathered, inputs[r][:count].contiguous())
        assert torch.equal(gathered, torch.cat([x[:count] for x in inputs])), \
            f"interleaved all_gather {count}"
        t = inputs[r].clone()
        group.all_reduce(t)
        assert_matches(t, reference(inputs, "sum"), f"interleaved all_reduce {count}")
        for src in range(n):
            t = inputs[r].clone()
            group.broadcast(t, src=src)
            assert torch.equal(t, inputs[src]), f"interleaved broadcast {count} from {src}"
    print(f"interleaved group: {group.transport}", flush=True)
    group.close()


def check_ddp(comm: pycomm.Communicator) -> None:
    """pycomm's DDP (async bucket all-reduces, small buckets) against the
    full-batch gradient."""
    from torch import nn

    from pycomm.parallel import DistributedDataParallel

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))

    n = comm.world_size
    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(q)) for q in range(n)]
    ref = model()
    (sum(ref(x).pow(2).mean() for x in xs) / n).backward()
    ddp = DistributedDataParallel(model(), comm, bucket_cap_mb=0.01)
    ddp(xs[comm.rank]).pow(2).mean().backward()
    for got, want in zip(ddp.module.parameters(), ref.parameters()):
        assert torch.allclose(got.grad, want.grad, atol=1e-5), "ddp gradient"


def check_rooted(comm: pycomm.Communicator) -> None:
    """reduce, gather, scatter and all-to-all (the flat ring's, across hosts)."""
    r, n = comm.rank, comm.world_size
    for count in (1, 1021):
        inputs = [rank_input(q, count, torch.float32, "sum") for q in range(n)]
        for root in range(n):
            t = inputs[r].clone()
            comm.reduce(t, dst=root)
            if r == root:
                assert_matches(t, reference(inputs, "sum"), f"reduce {count} to {root}")
            got = [torch.empty(count) for _ in range(n)] if r == root else None
            comm.gather(got, inputs[r], dst=root)
            if got is not None:
                assert all(torch.equal(g, x) for g, x in zip(got, inputs)), f"gather {count}"
            out = torch.empty(count)
            comm.scatter(out, inputs if r == root else None, src=root)
            assert torch.equal(out, inputs[r]), f"scatter {count} from {root}"
        blocks = [rank_input(r * n + p, count, torch.float32, "sum") for p in range(n)]
        outs = [torch.empty(count) for _ in range(n)]
        comm.all_to_all(outs, blocks)
        assert all(torch.equal(outs[p], rank_input(p * n + r, count, torch.float32, "sum"))
                   for p in range(n)), f"all_to_all {count}"


def check_async_and_groups(comm: pycomm.Communicator) -> None:
    """async_op and its future, and a group split off the communicator."""
    r, n = comm.rank, comm.world_size
    inputs = [rank_input(q, 300_007, torch.float32, "sum") for q in range(n)]
    t = inputs[r].clone()
    work = comm.all_reduce(t, async_op=True)
    (fut,) = work.get_future().wait()
    work.wait()
    assert_matches(fut, reference(inputs, "sum"), "async all_reduce")
    # several in flight at once, in order: each all-reduce sees the previous result
    t = inputs[r].clone()
    works = [comm.all_reduce(t, async_op=True) for _ in range(3)]
    done = works[-1].get_future().then(lambda f: f.value()[0] * 2).wait()
    for w in works:
        w.wait()
    want = reference(inputs, "sum") * n * n
    assert_matches(t, want, "3 async all_reduces")
    assert_matches(done, want * 2, "a callback on the last one")
    half = comm.split(r % 2)
    assert half is not None
    t = inputs[r].clone()
    half.all_reduce(t)
    assert_matches(t, reference(inputs[r % 2::2], "sum"), f"split group {half.transport}")
    half.close()


def check_backend_ddp(r: int, n: int) -> None:
    """torch DDP over the backend across hosts: each step's gradient is the
    float64 mean of every rank's own gradient (all-gathered, summed here)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 300))  # buckets above SMALL_BYTES
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.5)
    for step in range(3):
        inp = torch.randn(8, 64, generator=torch.Generator().manual_seed(step * n + r))
        own = torch.autograd.grad(model(inp).square().sum(), list(model.parameters()))
        ddp(inp).square().sum().backward()
        for p, g in zip(model.parameters(), own):
            grads = [torch.empty_like(g) for _ in range(n)]
            dist.all_gather(grads, g)
            want = sum(x.double() for x in grads) / n
            assert (p.grad.double() - want).abs().max().item() < 1e-5, f"DDP step {step}"
            p.grad = None


def check_backend_order(r: int, n: int, inputs: list[torch.Tensor]) -> None:
    """The group's ops run in the order issued, composed or on the flat
    ring: each op here reads what the async one before it wrote."""
    import torch.distributed as dist

    total = reference(inputs, "sum")
    for _ in range(2):
        t = inputs[r].clone()
        work = dist.all_reduce(t, async_op=True)  # composed
        dist.broadcast(t, src=n - 1)  # flat, after it
        work.wait()
        assert_matches(t, total, "broadcast after an async composed all_reduce")
        t = inputs[r].clone()
        work = dist.broadcast(t, src=1, async_op=True)  # flat
        dist.all_reduce(t)  # composed, after it
        work.wait()
        assert torch.equal(t, inputs[1] * n), "all_reduce after an async broadcast"
        t = inputs[r].clone()
        dist.all_reduce(t, async_op=True)
        dist.barrier()  # after the all_reduce, as torch's gloo barrier
        assert_matches(t, total, "barrier after an async composed all_reduce")
    # A pending irecv does not hold back a later collective (its send comes
    # after the collective on the sender).
    x = torch.full((1021,), float(r))
    t = inputs[r].clone()
    recv = dist.irecv(x, src=1) if r == 0 else None
    dist.all_reduce(t)
    if r == 1:
        dist.send(x, dst=0)
    if recv is not None:
        recv.wait()
        assert torch.equal(x, torch.full((1021,), 1.0)), "irecv pending across an all_reduce"
    # A receive from any source, here from a peer on this host: the backend's
    # p2p runs on the flat ring, as torch's gloo backend's.
    if r < 2:
        y = torch.full((7,), float(r))
        if r == 0:
            assert dist.recv(y) == 1 and torch.equal(y, torch.ones(7)), "recv from any source"
        else:
            dist.send(y, dst=0)
    assert_matches(t, total, "all_reduce while an irecv is pending")


def check_backend() -> None:
    """init_process_group("pycomm") across hosts: CPU allreduce composed by
    the shm+gloo communicator (sync, async, non-contiguous, torch DDP), the
    other collectives on its flat gloo ring; destroy_process_group closes
    every part."""
    import torch.distributed as dist

    dist.init_process_group("pycomm")
    r, n = dist.get_rank(), dist.get_world_size()
    comm = pycomm.backend.get_communicator()
    assert comm.transport == "shm+gloo", comm.transport
    parts = [comm._impl, *comm._impl.hierarchy_parts]
    inputs = [rank_input(q, 300_007, torch.float32, "sum") for q in range(n)]
    seqs = [p.seq for p in parts]
    t = inputs[r].clone()
    dist.all_reduce(t)
    assert_matches(t, reference(inputs, "sum"), "backend all_reduce")
    ran = [p.seq - s for p, s in zip(parts, seqs)]
    # intra: reduce-scatter, all-reduce of the odd tail element, all-gather;
    # inter: the shard and the tail; the flat communicator numbers the
    # composed op itself
    assert ran == [1, 3, 2], f"composed (flat, intra, inter ops): {ran}"
    t = inputs[r].clone()
    work = dist.all_reduce(t, async_op=True)
    (fut,) = work.get_future().wait()
    work.wait()
    assert_matches(fut, reference(inputs, "sum"), "backend async all_reduce")
    big = torch.zeros(2 * inputs[r].numel())
    big[::2] = inputs[r]
    dist.all_reduce(big[::2], op=dist.ReduceOp.MAX)  # non-contiguous: staged, then composed
    assert_matches(big[::2], reference(inputs, "max"), "backend non-contiguous all_reduce")
    assert not big[1::2].any(), "backend non-contiguous all_reduce wrote between"
    check_backend_order(r, n, inputs)
    check_backend_ddp(r, n)
    # A composed op still queued when the group ends runs first.
    queued = [inputs[r].clone() for _ in range(3)]
    works = [comm.all_reduce(q, async_op=True) for q in queued]
    dist.destroy_process_group()
    for w, q in zip(works, queued):
        w.wait()
        assert_matches(q, reference(inputs, "sum"), "all_reduce queued at destroy")
    # The group's end closes all three parts (the shm segment with them).
    assert [p.closed for p in parts] == [True] * 3, [p.closed for p in parts]
    print(f"OK {r} {socket.gethostname()} {comm.transport}", flush=True)


def check_auto_table_place(comm: pycomm.Communicator) -> None:
    """A gloo group across hosts takes algo="auto"'s entry measured between
    hosts: the flat communicator and a hierarchy's inter-host part; its
    intra-host part (shm) the one-host entry (pycomm/_auto_table.py)."""
    from pycomm import _auto_table

    entries = _auto_table.load(_auto_table.DEFAULT_PATH)
    across = comm.transport != "shm"
    parts = [(comm._impl, "gloo" if across else "shm", across)]
    if comm.transport == "shm+gloo":
        intra, inter = comm._impl.hierarchy_parts
        parts += [(intra, "shm", False), (inter, "gloo", True)]
    for part, transport, hosts in parts:
        want = _auto_table.rules_for(entries, "cpu", transport, part.world_size, hosts)
        assert part.auto_table == want, (transport, part.world_size, hosts, part.auto_table)


def main() -> None:
    bad = os.environ.get("PYCOMM_TEST_NO_SHM_ON_HOST")
    if bad is not None and bad == os.environ.get("GROUP_RANK"):
        # a segment far larger than /dev/shm: shm cannot be set up on this host
        os.environ["PYCOMM_SHM_SLOT_BYTES"] = str(1 << 40)
    if sys.argv[1:] == ["backend"]:
        return check_backend()
    comm = pycomm.init(transport=sys.argv[1] if len(sys.argv) > 1 else "auto", timeout=60)
    workers = worker_threads()
    assert workers == 1, f"{comm.transport}: {workers} pycomm worker threads, not 1"
    check_collectives(comm)
    check_quantized_wire(comm)
    check_auto_table_place(comm)
    if comm.transport == "shm+gloo":
        check_wire_differs_inside_a_host(comm)
    print(f"OK {comm.rank} {socket.gethostname()} {comm.transport}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
