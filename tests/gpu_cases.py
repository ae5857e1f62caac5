"""Rank bodies of the GPU tests: the collectives (the layers above are in
tests/gpu_cases_layers.py).

Each body is ``fn(comm, store, **kwargs)``, run on every rank of a world
(tests/gpu_world.py) by ``tests/test_gpu.py`` (a world per test, pytest) and
by ``scripts/gpu_check.sh`` (a world per size, tests/gpu_plan.py). This
module imports without a GPU (it never skips): the CPU suite imports it, and
runs the bodies that take any device on the gloo transport
(tests/test_gpu_check.py), so what the GPU check runs has been run before
the GPU comes. Device-generic bodies create their tensors on
``comm.device`` and use the algorithms of its transport (:func:`algos`);
the CUDA-only ones say so.
"""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch

from tests.reference import assert_matches, rank_input, reference

OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3, "product": 4}  # the core's op codes
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int32, torch.int64, torch.uint8, torch.int8]
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
COUNTS = [0, 1, 1009, 3 * (1 << 16) + 5]


# ---------------------------------------------------------------- helpers

def rand(dtype: torch.dtype, n: int, seed: int, lo: int = -8, hi: int = 8) -> torch.Tensor:
    """n seeded values in [lo, hi] (CPU); uint8 from 0."""
    g = torch.Generator().manual_seed(seed)
    if dtype in FLOATS:
        return (torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(dtype)
    if dtype == torch.uint8:
        lo = 0
    return torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64).to(dtype)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, except that NaNs only need to be NaN at the same
    places: arithmetic on a NaN gives the canonical NaN on the GPU but keeps
    the operand's payload on x86 (MAX/MIN select, so they keep it on both)."""
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    if a.dtype.is_floating_point:
        na, nb = torch.isnan(a), torch.isnan(b)
        if not torch.equal(na, nb):
            return False
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a[~na].view(width), b[~nb].view(width))
    return torch.equal(a, b)


def inputs(rank: int, dtype: torch.dtype, n: int, op: str, seed: int) -> torch.Tensor:
    """Rank r's input: small values so integer sums/products cannot overflow."""
    if op == "product":
        if dtype in FLOATS:
            x = rand(torch.float64, n, seed * 31 + rank, lo=0, hi=1) + 0.5
            return x.to(dtype)
        return rand(dtype, n, seed * 31 + rank, lo=1 if dtype == torch.uint8 else -2, hi=2)
    return rand(dtype, n, seed * 31 + rank, lo=-8, hi=8)


def expected(op: str, dtype: torch.dtype, n: int, world: int, seed: int) -> torch.Tensor:
    """op over the ranks' :func:`inputs`, in float64."""
    xs = [inputs(r, dtype, n, op, seed).double() for r in range(world)]
    if op in ("sum", "avg"):
        ref = torch.stack(xs).sum(0)
        return ref / world if op == "avg" else ref
    if op == "product":
        return torch.stack(xs).prod(0)
    return torch.stack(xs).amax(0) if op == "max" else torch.stack(xs).amin(0)


def tolerance(dtype: torch.dtype, world: int) -> tuple[float, float]:
    """(rtol, atol) of a ring result against the float64 reference."""
    return {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12),
            torch.float16: (2e-3 * world, 1e-2 * world),
            torch.bfloat16: (1.6e-2 * world, 6e-2 * world)}.get(dtype, (0, 0))


def algos(comm: Any, *extra: str) -> tuple[str, ...]:
    """Our ring, plus NCCL's native collectives on the nccl transport, plus ``extra``."""
    return ("ring", "nccl", *extra) if comm.transport == "nccl" else ("ring", *extra)


def prefixed(what: str) -> Callable[[str], str]:
    """An assert_close ``msg`` that says which case failed before what failed."""
    return lambda message: f"{what}: {message}"


def synchronize(comm: Any) -> None:
    """Waits for the GPU (a no-op on CPU): results read after it are final."""
    if comm.device.type == "cuda":
        torch.cuda.synchronize(comm.device)


def wait_completed(work: Any, limit: float = 60.0) -> None:
    """Polls ``work.is_completed()`` (the watchdog's view) for ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not work.is_completed():
        assert time.monotonic() < deadline, "the Work never completed"
        time.sleep(0.005)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------- all_reduce

def all_reduce_sweep(comm: Any, store: Any, seed: int) -> None:
    """Every op x dtype x count (0, 1, prime, several slices) with every
    algorithm against float64 references; ring results bitwise equal on
    every rank."""
    world = comm.world_size
    digests = []
    for algo in algos(comm):
        for dtype in DTYPES:
            for op in OPS:
                if op == "avg" and dtype not in FLOATS:
                    continue
                for n in COUNTS:
                    t = inputs(comm.rank, dtype, n, op, seed).to(comm.device)
                    comm.all_reduce(t, op=op, algo=algo)
                    got = t.cpu()
                    rtol, atol = tolerance(dtype, world)
                    what = f"{algo} {op} {dtype} n={n}"
                    torch.testing.assert_close(got.double(), expected(op, dtype, n, world, seed),
                                               rtol=rtol, atol=atol,
                                               msg=prefixed(what))
                    if algo == "ring":
                        digests.append(_digest(got))
    store.set(f"digest/{comm.rank}", ",".join(digests))
    for r in range(world):
        assert store.get(f"digest/{r}").decode() == ",".join(digests), f"rank {r} differs"


def classic_algorithms(comm: Any, store: Any) -> None:
    """recursive_doubling, halving_doubling and tree all-reduce (over the
    transport's send/recv, NCCL's on GPU) and Bruck's all-gather: a few ops
    and dtypes at counts that span several slices, against float64, every
    rank bitwise identical."""
    world, r = comm.world_size, comm.rank
    digests = []
    for algo in ("recursive_doubling", "halving_doubling", "tree"):
        for dtype in (torch.float32, torch.bfloat16, torch.int32):
            for op in ("sum", "avg", "max"):
                if op == "avg" and dtype not in FLOATS:
                    continue
                for n in COUNTS:
                    t = inputs(r, dtype, n, op, 11).to(comm.device)
                    comm.all_reduce(t, op=op, algo=algo)
                    got = t.cpu()
                    rtol, atol = tolerance(dtype, world)
                    what = f"{algo} {op} {dtype} n={n}"
                    torch.testing.assert_close(got.double(), expected(op, dtype, n, world, 11),
                                               rtol=rtol, atol=atol, msg=prefixed(what))
                    digests.append(_digest(got))
    for m in (0, 1, 1009, 70001):
        gout = torch.empty(m * world, device=comm.device)
        comm.all_gather(gout, rand(torch.float32, m, 60 + r).to(comm.device), algo="bruck")
        assert bitwise_equal(gout, torch.cat([rand(torch.float32, m, 60 + q) for q in range(world)])), m
    store.set(f"classic/{r}", ",".join(digests))
    for q in range(world):
        assert store.get(f"classic/{q}").decode() == ",".join(digests), f"rank {q} differs"


def default_slices_and_auto(comm: Any, store: Any) -> None:
    """16 MiB of fp32: several default slices per chunk, every algorithm and auto."""
    n = (1 << 22) + 3
    for algo in algos(comm, "auto"):
        t = torch.full((n,), float(comm.rank + 1), device=comm.device)
        comm.all_reduce(t, algo=algo)
        expect = comm.world_size * (comm.world_size + 1) / 2
        assert torch.all(t == expect).item(), algo


def nan_propagation(comm: Any, store: Any) -> None:
    """MAX and MIN keep a NaN of any rank, at its place only."""
    for dtype in FLOATS:
        for op in ("max", "min"):
            t = torch.zeros(1001, dtype=dtype, device=comm.device)
            if comm.rank == 1:
                t[0] = float("nan")
                t[1000] = float("nan")
            comm.all_reduce(t, op=op, algo="ring")
            assert torch.isnan(t[0]).item() and torch.isnan(t[1000]).item(), (dtype, op)
            assert not torch.isnan(t[1:1000]).any().item()


def wire_matches_cpu(comm: Any, store: Any) -> None:
    """The wire-dtype ring on this communicator runs the CPU's arithmetic in
    the CPU's order (same slices), and so do the quantized wires (int8,
    float8; quant_codec.h), residuals included: bitwise the result of a gloo
    communicator on the same data."""
    import torch.distributed as dist

    import pycomm

    cpu = pycomm.init(rank=comm.rank, world_size=comm.world_size,
                      store=dist.PrefixStore("cpu-wire", store), transport="gloo",
                      slice_bytes=64 * 1024, set_default=False, key_prefix="cpu-wire")
    try:
        for wire in (torch.float16, torch.bfloat16):
            for op in ("sum", "avg", "max"):
                for n in COUNTS:
                    x = inputs(comm.rank, torch.float32, n, op, 11)
                    g = x.to(comm.device, copy=True)  # copy: on CPU .to() would alias x
                    comm.all_reduce(g, op=op, algo="auto", wire_dtype=wire)
                    c = x.clone()
                    cpu.all_reduce(c, op=op, algo="ring", wire_dtype=wire)
                    assert torch.equal(g.cpu(), c), (wire, op, n)
        _quantized_wires_match(comm, cpu)
        if comm.transport == "nccl":
            with pytest.raises(ValueError, match="nccl"):
                comm.all_reduce(torch.ones(4, device=comm.device), algo="nccl",
                                wire_dtype=torch.float16)
    finally:
        cpu.close()


def _quantized_wires_match(comm: Any, cpu: Any) -> None:
    """wire_dtype int8 / float8 on comm and on the CPU communicator `cpu`:
    the same bits, in the tensor and in the residual (a NaN block too)."""
    for wire in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2):
        for dtype, op, block in [(torch.float32, "avg", 100), (torch.bfloat16, "sum", 256)]:
            for n in COUNTS:
                x = inputs(comm.rank, dtype, n, op, 12)
                if n > 1000 and comm.rank == 1:
                    x[700] = float("nan")  # that block reads back as NaN everywhere
                r = rand(torch.float32, n, 13 + comm.rank) / 64
                g, gr = x.to(comm.device, copy=True), r.to(comm.device, copy=True)
                comm.all_reduce(g, op=op, wire_dtype=wire, wire_block=block, residual=gr)
                c, cr = x.clone(), r.clone()
                cpu.all_reduce(c, op=op, wire_dtype=wire, wire_block=block, residual=cr)
                assert bitwise_equal(g, c), (wire, dtype, n)
                assert bitwise_equal(gr, cr), (wire, dtype, n, "residual")


# ---------------------------------------------------------------- broadcast, rs / ag

def broadcast_every_src(comm: Any, store: Any) -> None:
    """Every root, three dtypes, every count: bitwise the root's data."""
    for algo in algos(comm):
        for src in range(comm.world_size):
            for dtype in (torch.float32, torch.uint8, torch.bfloat16):
                for n in COUNTS:
                    ref = rand(dtype, n, 1000 + src)
                    t = (ref.to(comm.device, copy=True) if comm.rank == src
                         else torch.zeros(n, dtype=dtype, device=comm.device))
                    comm.broadcast(t, src=src, algo=algo)
                    assert bitwise_equal(t, ref), (algo, src, dtype, n)


def reduce_scatter_all_gather(comm: Any, store: Any) -> None:
    """reduce_scatter against float64, all_gather bitwise, counts 0 .. 70001 per rank."""
    world, r = comm.world_size, comm.rank
    for algo in algos(comm):
        for dtype in (torch.float32, torch.bfloat16, torch.int32):
            for m in (0, 1, 1009, 70001):
                inp = inputs(r, dtype, m * world, "sum", 7).to(comm.device)
                out = torch.empty(m, dtype=dtype, device=comm.device)
                comm.reduce_scatter(out, inp, op="sum", algo=algo)
                ref = expected("sum", dtype, m * world, world, 7)[r * m:(r + 1) * m]
                rtol, atol = tolerance(dtype, world)
                torch.testing.assert_close(out.cpu().double(), ref, rtol=rtol, atol=atol)
                gin = rand(dtype, m, 50 + r).to(comm.device)
                gout = torch.empty(m * world, dtype=dtype, device=comm.device)
                comm.all_gather(gout, gin, algo=algo)
                gref = torch.cat([rand(dtype, m, 50 + q) for q in range(world)])
                assert bitwise_equal(gout, gref), (algo, dtype, m)


# ---------------------------------------------------------------- rooted, all-to-all

def rooted_and_all_to_all(comm: Any, store: Any) -> None:
    """reduce (every op, every root), gather / scatter (every root) and
    all_to_all / all_to_all_single (even and uneven, zero blocks) against
    independent references (tests/reference.py); a few ops async."""
    n, r, dev = comm.world_size, comm.rank, comm.device
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.uint8):
        for op in OPS:
            if op == "avg" and not dtype.is_floating_point:
                continue
            for count in (0, 1, 1031, 65537):
                ins = [rank_input(q, count, dtype, op) for q in range(n)]
                for dst in range(n):
                    t = ins[r].to(dev, copy=True)  # reduce writes into it (copy: CPU aliases)
                    work = comm.reduce(t, dst=dst, op=op, async_op=dst % 2 == 1)
                    if work is not None:
                        work.wait()
                    if r == dst:
                        assert_matches(t.cpu(), reference(ins, op), f"reduce {op} {dtype} {count} {dst}")
    for dtype in (torch.float32, torch.int64, torch.int8):
        for count in (0, 13, 40_009):
            ins = [rank_input(q, count, dtype, "sum") for q in range(n)]
            for root in range(n):
                outs = [torch.full((count,), 7, dtype=dtype, device=dev) for _ in range(n)]
                comm.gather(outs if r == root else None, ins[r].to(dev, copy=True), dst=root)
                if r == root:
                    for q in range(n):
                        assert torch.equal(outs[q].cpu(), ins[q]), f"gather {dtype} {count} from {q}"
                blocks = [rank_input(100 + root, count, dtype, "sum", seed=q) for q in range(n)]
                got = torch.full((count,), 7, dtype=dtype, device=dev)
                work = comm.scatter(got, [b.to(dev) for b in blocks] if r == root else None,
                                    src=root, async_op=count == 13)
                if work is not None:
                    work.wait()
                assert torch.equal(got.cpu(), blocks[r]), f"scatter {dtype} {count} root {root}"
    _all_to_all(comm)


def _a2a_block(i: int, j: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """What rank i sends to rank j: ``rows`` x 3, distinct per pair."""
    return rank_input(i, rows * 3, dtype, "sum", seed=1000 + j).view(rows, 3)


def _all_to_all(comm: Any) -> None:
    n, r, dev = comm.world_size, comm.rank, comm.device
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for m in (0, 1, 4099):  # even blocks, no splits
            inp = torch.cat([_a2a_block(r, p, m, dtype) for p in range(n)]).to(dev)
            out = torch.full((n * m, 3), 7, dtype=dtype, device=dev)
            comm.all_to_all_single(out, inp)
            expect = torch.cat([_a2a_block(p, r, m, dtype) for p in range(n)])
            assert torch.equal(out.cpu(), expect), f"all_to_all_single even {dtype} m={m}"
        # uneven: S[i][j] rows from rank i to rank j, zeros among them
        S = [[(i * 7 + j * 3) % 5 for j in range(n)] for i in range(n)]
        ins = [_a2a_block(r, p, S[r][p], dtype).to(dev) for p in range(n)]
        out = torch.full((sum(S[p][r] for p in range(n)), 3), 7, dtype=dtype, device=dev)
        comm.all_to_all_single(out, torch.cat(ins), [S[p][r] for p in range(n)], S[r],
                               async_op=True).wait()
        expect = torch.cat([_a2a_block(p, r, S[p][r], dtype) for p in range(n)])
        assert torch.equal(out.cpu(), expect), f"all_to_all_single uneven {dtype}"
        outs = [torch.full((S[p][r], 3), 7, dtype=dtype, device=dev) for p in range(n)]
        comm.all_to_all(outs, ins)
        for p in range(n):
            assert torch.equal(outs[p].cpu(), _a2a_block(p, r, S[p][r], dtype)), f"all_to_all {p}"


# ---------------------------------------------------------------- p2p

def p2p_and_batch(comm: Any, store: Any, big: int | None = None) -> None:
    """A batched ring shift and a ping-pong at every size; isend + irecv
    between a pair at a size NCCL cannot buffer (``big`` floats, default
    64 MiB on GPU); every rank to every peer in one batch."""
    import pycomm

    world, r, dev = comm.world_size, comm.rank, comm.device
    nxt, prv = (r + 1) % world, (r - 1) % world
    for n in (0, 1, 1009, 1 << 20):
        send = rand(torch.float32, n, 300 + r).to(dev)
        recv = torch.empty(n, device=dev)
        works = comm.batch_isend_irecv([pycomm.P2POp("isend", send, nxt),
                                        pycomm.P2POp("irecv", recv, prv)])
        for w in works:
            w.wait()
        assert bitwise_equal(recv, rand(torch.float32, n, 300 + prv))
        if r in (0, 1):
            t = torch.full((n,), float(r), device=dev)
            if r == 0:
                comm.send(t, 1)
                comm.recv(t, 1)
                assert torch.all(t == 2.0).item()
            else:
                comm.recv(t, 0)
                t += 2
                comm.isend(t, 0).wait()
    # isend(x, p); irecv(y, p) on both ranks of a pair: on one NCCL stream per
    # rank each receive would queue behind the rank's own send, which waits
    # for the peer's receive (a deadlock); the per-direction p2p lanes keep
    # them apart.
    m = big if big is not None else (16 << 20 if dev.type == "cuda" else 1 << 20)
    p = r ^ 1
    if p < world:
        out = torch.full((m,), float(r), device=dev)
        got = torch.empty(m, device=dev)
        for w in [comm.isend(out, p), comm.irecv(got, p)]:
            w.wait()
        assert torch.all(got == float(p)).item()
    outs = {q: torch.full((m,), float(r * 10 + q), device=dev) for q in range(world) if q != r}
    ins = {q: torch.empty(m, device=dev) for q in outs}
    ops = [pycomm.P2POp("isend", outs[q], q) for q in outs]
    ops += [pycomm.P2POp("irecv", ins[q], q) for q in ins]
    for w in comm.batch_isend_irecv(ops):
        w.wait()
    for q, got in ins.items():
        assert torch.all(got == float(q * 10 + r)).item(), q


def user_p2p_beside_collective(comm: Any, store: Any) -> None:
    """The pipeline-parallel pattern: rank 0 posts irecv(from 1), then an
    all_reduce; rank 1 sends only after rank 0 saw its all_reduce complete.
    User p2p must neither pair with the ring's messages nor hold up the
    collective or its Work."""
    r, world, dev = comm.rank, comm.world_size, comm.device
    n, m = (1 << 18) + 3, (1 << 17) + 7  # m: unlike any ring message
    expect = world * (world + 1) / 2
    # NCCL connects a pair lazily on its first transfer, which blocks the
    # host until the peer posts its side: connect everything first.
    for algo in algos(comm):
        comm.all_reduce(torch.ones(n, device=dev), algo=algo)
    buf = torch.zeros(m, device=dev)
    if r == 0:
        comm.recv(buf, 1)
    elif r == 1:
        comm.send(buf, 0)
    synchronize(comm)
    for i, algo in enumerate(algos(comm)):
        t = torch.full((n,), float(r + 1), device=dev)
        if r == 0:
            got = torch.zeros(m, device=dev)
            w = comm.irecv(got, 1)
            comm.all_reduce(t, algo=algo, async_op=True).get_future().wait()
            assert not w.is_completed()  # rank 1 has not sent yet
            store.set(f"all_reduced/{i}", "1")
            w.wait()
            assert torch.all(got == 100.0 + i).item(), algo
        else:
            comm.all_reduce(t, algo=algo)
            if r == 1:
                store.wait([f"all_reduced/{i}"])
                comm.send(torch.full((m,), 100.0 + i, device=dev), 0)
        assert torch.all(t == expect).item(), algo
    comm.barrier()


# ---------------------------------------------------------------- async, streams (CUDA)

def async_and_streams(comm: Any, store: Any) -> None:
    """CUDA only. Work + CUDA-aware futures (completed at the enqueue,
    ordering the caller's stream), then() callbacks stream-ordered, the op
    after the caller's current stream, wait() without the host, many async
    ops in order. A GPU sleep in front of each input makes a race visible."""
    world, r = comm.world_size, comm.rank
    n = 1 << 20
    expect = world * (world + 1) / 2
    t = torch.full((n,), float(r + 1), device="cuda")
    w = comm.all_reduce(t, async_op=True)
    res = w.get_future().wait()
    assert res[0] is t or res[0].data_ptr() == t.data_ptr()
    assert torch.all(t == expect).item()  # on the current stream, after the op
    wait_completed(w)  # the watchdog sees the GPU finish
    assert w.is_success()
    w.wait()

    s0 = torch.cuda.Stream()
    with torch.cuda.stream(s0):
        t = torch.zeros(n, device="cuda")
        torch.cuda._sleep(int(2e8))
        t.fill_(float(r + 1))
        doubled = comm.all_reduce(t, async_op=True).get_future().then(
            lambda f: f.value()[0] * 2).wait()
    s0.synchronize()
    assert torch.all(doubled == 2 * expect).item()

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = torch.zeros(n, device="cuda")
        torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time before the fill
        t.fill_(float(r + 1))
        w = comm.all_reduce(t, algo="ring", async_op=True)
        w.wait()  # makes s wait, not the host
        t.mul_(2)  # on s, after the all-reduce
    s.synchronize()
    assert torch.all(t == 2 * expect).item()

    u = torch.full((n,), float(r + 1), device="cuda")
    comm.all_reduce(u, algo="nccl")  # a sync op orders the caller's stream after it
    u.add_(1)
    torch.cuda.synchronize()
    assert torch.all(u == expect + 1).item()

    ts = [torch.full((4099,), float(r + i), device="cuda") for i in range(16)]
    ws = [comm.all_reduce(x, async_op=True, algo="ring" if i % 2 else "nccl") for i, x in enumerate(ts)]
    for i, (x, w) in enumerate(zip(ts, ws)):
        w.get_future().wait()
        assert torch.all(x == sum(q + i for q in range(world))).item()
    comm.barrier()


def off_the_current_device(comm: Any, store: Any) -> None:
    """CUDA, 2 GPUs: the communicator on cuda:1 while the caller's current
    device stays cuda:0 (init never calls set_device): every Work's event
    must be made on cuda:1, where the op's streams are."""
    assert comm.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
    t = torch.full((1 << 20,), float(comm.rank + 1), device="cuda:1")
    comm.all_reduce(t)
    comm.all_reduce(t, async_op=True).wait()
    torch.cuda.synchronize("cuda:1")
    want = float(sum(range(1, comm.world_size + 1)) * comm.world_size)
    assert torch.equal(t, torch.full_like(t, want))
    assert torch.cuda.current_device() == 0


# ---------------------------------------------------------------- misuse

def argument_errors(comm: Any, store: Any) -> None:
    """Usage errors raise on the calling rank before anything is enqueued
    (on GPU they once killed both ranks with SIGSEGV) and leave the
    communicator usable."""
    dev = comm.device
    if dev.type == "cuda":
        with pytest.raises(ValueError):
            comm.all_reduce(torch.ones(4))  # a CPU tensor
    with pytest.raises(ValueError):
        comm.all_reduce(torch.ones(4, 2, device=dev).t())  # not contiguous
    with pytest.raises(ValueError):
        comm.all_reduce(torch.ones(4, dtype=torch.int32, device=dev), op="avg")
    with pytest.raises(ValueError):
        comm.all_reduce(torch.ones(4, device=dev), algo="bogus")
    with pytest.raises(TypeError):
        comm.all_reduce(torch.ones(4, dtype=torch.complex64, device=dev))
    x = torch.ones(4, device=dev)
    if dev.type == "cuda":  # a quantized wire's residual lives beside the tensor
        with pytest.raises(ValueError, match="residual must be a contiguous float32 tensor on"):
            comm.all_reduce(x, wire_dtype=torch.int8, residual=torch.zeros(4))
    with pytest.raises(ValueError, match="is this rank"):
        comm.send(x, comm.rank)
    with pytest.raises(ValueError, match="out of range"):
        comm.send(x, 7)
    with pytest.raises(ValueError, match="out of range"):
        comm.broadcast(x, src=9)
    with pytest.raises(ValueError, match="world_size"):
        comm.reduce_scatter(torch.empty(3, device=dev), torch.ones(4, device=dev))
    if comm.transport != "shm":
        with pytest.raises(ValueError, match="direct"):
            comm.all_reduce(x, algo="direct")
    if comm.transport == "nccl":
        # NCCL pairs user p2p in posting order: no tags, no receive from any source.
        with pytest.raises(NotImplementedError, match="tag=3 .*NCCL"):
            comm.isend(x, 1 - comm.rank, tag=3)
        with pytest.raises(NotImplementedError, match="any source .*NCCL"):
            comm.irecv(x)
    assert not comm._impl.aborted
    comm.all_reduce(x)
    synchronize(comm)
    assert torch.all(x == comm.world_size).item()
    comm.barrier()


def checked_mode(comm: Any, store: Any) -> None:
    """Checked mode (init check=True): mismatched counts raise ValueError on
    every rank before any payload moved (on GPU the fingerprints travel in
    device memory), and the communicator stays usable."""
    assert comm._impl.check
    n = 1000 + comm.rank  # different counts
    with pytest.raises(ValueError, match="checked mode: ranks called mismatched collectives"):
        comm.all_reduce(torch.ones(n, device=comm.device))
    assert not comm._impl.aborted
    t = torch.ones(64, device=comm.device)
    for algo in algos(comm):
        comm.all_reduce(t, algo=algo)
    synchronize(comm)
    assert torch.all(t == comm.world_size ** len(algos(comm))).item()
    comm.barrier()


def timeout_aborts(comm: Any, store: Any) -> None:
    """Rank 0 calls a collective the others never join: after the
    communicator's timeout (init timeout=10) it raises CommError, the
    communicator is aborted and refuses further ops. Run it last in a world
    (an aborted NCCL communicator is not reused) with close_may_fail."""
    import pycomm

    if comm.rank != 0:
        # never joins; waits (bounded) for rank 0 to have seen its error
        store.wait(["timed_out"], timedelta(seconds=120))
        return
    t = torch.ones(1 << 16, device=comm.device)
    try:
        # Either the enqueue (NCCL connects lazily, which needs the peer) or
        # the GPU wait (watchdog) hits the timeout; both abort and raise.
        with pytest.raises(pycomm.CommError,
                           match=r"timed out after \d+ ms|did not finish within the timeout|"
                                 r"timeout \d+ ms\): .*[Tt]imed out"):
            w = comm.all_reduce(t, async_op=True)
            wait_completed(w, limit=60.0)
            w.wait()
        assert comm._impl.aborted
        with pytest.raises(pycomm.CommError):
            comm.all_reduce(t)
    finally:
        store.set("timed_out", "1")


# ---------------------------------------------------------------- groups

def groups(comm: Any, store: Any) -> None:
    """split() (ncclCommSplit on NCCL) and new_group() renumber the ranks
    and leave the parent usable."""
    world, r, dev = comm.world_size, comm.rank, comm.device
    # split by parity with reversed keys: {0, 2} -> ranks (2, 0); {1} alone
    g = comm.split(r % 2, key=-r)
    assert g is not None and g.transport == comm.transport
    members = sorted((q for q in range(world) if q % 2 == r % 2), reverse=True)
    assert g.world_size == len(members) and g.rank == members.index(r)
    t = torch.full((1 << 16,), float(r + 1), device=dev)
    g.all_reduce(t)
    synchronize(comm)
    assert torch.all(t == sum(q + 1 for q in members)).item()
    h = comm.split(None if r == 0 else 7)  # a rank that joins none gets None
    assert (h is None) == (r == 0)
    if h is not None:
        u = torch.ones(8, device=dev)
        h.all_reduce(u)
        synchronize(comm)
        assert torch.all(u == world - 1).item()
        h.close()
    pair = comm.new_group([1, 0])
    if r < 2:
        v = torch.full((4,), float(r), device=dev)
        pair.broadcast(v, src=0)  # group rank 0 is rank 1
        synchronize(comm)
        assert torch.all(v == 1.0).item()
        pair.close()
    g.close()
    w = torch.ones(4, device=dev)
    comm.all_reduce(w)  # the parent after its groups closed
    synchronize(comm)
    assert torch.all(w == world).item()
