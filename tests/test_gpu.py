"""GPU tests (pytest -m gpu): the CUDA kernels and the nccl communicator.

They run on ONE GPU: 2-4 ranks are processes sharing it. NCCL refuses two
ranks of one host on one GPU, so each rank gets its own NCCL_HOSTID (NCCL then
talks between them over its socket transport on loopback); with
PYCOMM_GPU_TEST_MODE=multi they use NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30)
instead. Such runs prove correctness, not speed. Everything skips cleanly
without CUDA or without a CUDA build of pycomm._C.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import multiprocessing as mp
import os
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.gpu

try:
    from pycomm._ext import _C

    _HAVE_EXT = True
except Exception:  # pragma: no cover - the CPU suite reports build problems
    _C = None
    _HAVE_EXT = False

HAVE_GPU = (_HAVE_EXT and bool(getattr(_C, "WITH_CUDA", False))
            and torch.cuda.is_available())
if not HAVE_GPU:
    pytest.skip("needs CUDA and the CUDA build of pycomm._C", allow_module_level=True)

OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3, "product": 4}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int32, torch.int64, torch.uint8, torch.int8]
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
TIMEOUT = float(os.environ.get("PYCOMM_GPU_TEST_TIMEOUT", "600"))


# ---------------------------------------------------------------- kernels (one process)

def _rand(dtype, n, seed, lo=-8, hi=8):
    g = torch.Generator().manual_seed(seed)
    if dtype in FLOATS:
        return (torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(dtype)
    if dtype == torch.uint8:
        lo = 0
    return torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64).to(dtype)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_kernel_bitwise_equals_cpu(op, dtype):
    if op == "avg" and dtype not in FLOATS:
        pytest.skip("AVG is floating only")
    n = 1 << 16
    a, b = _rand(dtype, n + 64, 1), _rand(dtype, n + 64, 2)
    if dtype in FLOATS:  # specials: NaN, inf, -0, subnormals, overflow in fp16
        sp = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 6e4, -6e4, 1e-7],
                          dtype=torch.float64).to(dtype)
        a[: sp.numel()] = sp
        b[3 : 3 + sp.numel()] = sp
    # offsets 0..15 elements: aligned packs, scalar prologues/epilogues, and
    # different misalignments of dst and src (the element-by-element path)
    for off_a, off_b, count in [(0, 0, n), (1, 1, n - 3), (3, 5, n - 7), (0, 0, 1), (2, 2, 0), (7, 7, 13)]:
        x, y = a[off_a : off_a + count].clone(), b[off_b : off_b + count].clone()
        ref = x.clone()
        _C.reduce_(ref, y, OPS[op])
        buf_a = a.cuda()
        gx = buf_a[off_a : off_a + count]
        gx.copy_(x)
        gy = b.cuda()[off_b : off_b + count]
        _C.cuda_reduce_(gx, gy, OPS[op])
        torch.cuda.synchronize()
        assert _bitwise_equal(gx, ref), (op, dtype, off_a, off_b, count)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("factor", [0.5, 1 / 3])
def test_scale_and_fused_reduce_scale_bitwise(dtype, factor):
    n = 100_003
    a, b = _rand(dtype, n, 3), _rand(dtype, n, 4)
    ref = a.clone()
    _C.scale_(ref, factor)
    g = a.cuda()
    _C.cuda_scale_(g, factor)
    torch.cuda.synchronize()
    assert _bitwise_equal(g, ref)
    ref2 = a.clone()
    _C.reduce_(ref2, b, OPS["sum"])
    _C.scale_(ref2, factor)
    g2 = a.cuda()
    _C.cuda_reduce_scale_(g2, b.cuda(), OPS["sum"], factor)
    torch.cuda.synchronize()
    assert _bitwise_equal(g2, ref2)


# ---------------------------------------------------------------- multi-rank harness

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world, port, queue, kwargs):
    try:
        if os.environ.get("PYCOMM_GPU_TEST_MODE", "hostid") == "multi":
            os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
        else:
            os.environ["NCCL_HOSTID"] = f"host{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
        os.environ["LOCAL_RANK"] = "0"
        import torch.distributed as dist

        import pycomm

        store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                              timeout=timedelta(seconds=TIMEOUT))
        comm = pycomm.init(rank=rank, world_size=world, store=store, transport="nccl",
                           device=kwargs.pop("device", "cuda:0"),
                           timeout=kwargs.pop("comm_timeout", 120),
                           slice_bytes=kwargs.pop("slice_bytes", None),
                           check=kwargs.pop("check", False), set_default=False)
        try:
            fn(comm, store, **kwargs)
        finally:
            try:
                comm.close()
            except Exception:
                if not kwargs.get("allow_close_error"):
                    raise
        queue.put((rank, None))
    except BaseException:
        queue.put((rank, traceback.format_exc()))


def run_ranks(world: int, fn, **kwargs) -> None:
    """Runs fn(comm, store, **kwargs) on `world` ranks sharing cuda:0; a child's
    traceback fails the test; a hang fails it after TIMEOUT seconds."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, queue, dict(kwargs)), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT
    errors, done = [], 0
    try:
        while done < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {TIMEOUT} s ({done}/{world} ranks finished)")
            try:
                rank, err = queue.get(timeout=min(left, 5.0))
            except Exception:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and done + len(errors) < world:
                    raise AssertionError(f"rank(s) died: exit codes {[p.exitcode for p in procs]}")
                continue
            done += 1
            if err:
                errors.append(f"--- rank {rank} ---\n{err}")
        assert not errors, "\n".join(errors)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _inputs(rank, dtype, n, op, seed):
    """Rank r's input: small values so integer sums/products cannot overflow."""
    if op == "product":
        if dtype in FLOATS:
            x = _rand(torch.float64, n, seed * 31 + rank, lo=0, hi=1) + 0.5
            return x.to(dtype)
        return _rand(dtype, n, seed * 31 + rank, lo=1 if dtype == torch.uint8 else -2, hi=2)
    return _rand(dtype, n, seed * 31 + rank, lo=-8, hi=8)


def _reference(op, dtype, n, world, seed):
    xs = [_inputs(r, dtype, n, op, seed).double() for r in range(world)]
    if op in ("sum", "avg"):
        ref = sum(xs)
        if op == "avg":
            ref = ref / world
    elif op == "product":
        ref = xs[0]
        for x in xs[1:]:
            ref = ref * x
    elif op == "max":
        ref = torch.stack(xs).amax(0)
    else:
        ref = torch.stack(xs).amin(0)
    return ref


def _tolerance(dtype, world):
    return {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12),
            torch.float16: (2e-3 * world, 1e-2 * world),
            torch.bfloat16: (1.6e-2 * world, 6e-2 * world)}.get(dtype, (0, 0))


COUNTS = [0, 1, 1009, 3 * (1 << 16) + 5]


def _all_reduce_sweep(comm, store, seed):
    world = comm.world_size
    digests = []
    for algo in ("ring", "nccl"):
        for dtype in DTYPES:
            for op in OPS:
                if op == "avg" and dtype not in FLOATS:
                    continue
                for n in COUNTS:
                    t = _inputs(comm.rank, dtype, n, op, seed).cuda()
                    comm.all_reduce(t, op=op, algo=algo)
                    got = t.cpu()
                    ref = _reference(op, dtype, n, world, seed)
                    rtol, atol = _tolerance(dtype, world)
                    torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol,
                                               msg=lambda m: f"{algo} {op} {dtype} n={n}: {m}")
                    if algo == "ring":
                        digests.append(hashlib.sha1(got.contiguous().view(torch.uint8).numpy()
                                                    .tobytes()).hexdigest())
    # ring results are bitwise identical on every rank
    store.set(f"digest/{comm.rank}", ",".join(digests))
    for r in range(world):
        assert store.get(f"digest/{r}").decode() == ",".join(digests), f"rank {r} differs"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduce_every_op_dtype(world):
    # small slices so that chunks span several slices (the overlapped pipeline)
    run_ranks(world, _all_reduce_sweep, seed=world, slice_bytes=64 * 1024)


def _default_slice_large(comm, store):
    n = (1 << 22) + 3  # 16 MiB fp32: several default (4 MiB) slices per chunk
    for algo in ("ring", "nccl", "auto"):
        t = torch.full((n,), float(comm.rank + 1), device="cuda")
        comm.all_reduce(t, algo=algo)
        expect = comm.world_size * (comm.world_size + 1) / 2
        assert torch.all(t == expect).item(), algo


def test_all_reduce_default_slices_and_auto():
    run_ranks(2, _default_slice_large)


def _nan_propagation(comm, store):
    for dtype in FLOATS:
        for op in ("max", "min"):
            t = torch.zeros(1001, dtype=dtype, device="cuda")
            if comm.rank == 1:
                t[0] = float("nan")
                t[1000] = float("nan")
            comm.all_reduce(t, op=op, algo="ring")
            assert torch.isnan(t[0]).item() and torch.isnan(t[1000]).item(), (dtype, op)
            assert not torch.isnan(t[1:1000]).any().item()


def test_ring_max_min_propagate_nan():
    run_ranks(3, _nan_propagation, slice_bytes=256)


def _broadcast_every_src(comm, store):
    for algo in ("ring", "nccl"):
        for src in range(comm.world_size):
            for dtype in (torch.float32, torch.uint8, torch.bfloat16):
                for n in COUNTS:
                    ref = _rand(dtype, n, 1000 + src)
                    t = ref.cuda() if comm.rank == src else torch.zeros(n, dtype=dtype, device="cuda")
                    comm.broadcast(t, src=src, algo=algo)
                    assert _bitwise_equal(t, ref), (algo, src, dtype, n)


@pytest.mark.parametrize("world", [2, 3])
def test_broadcast_from_every_src(world):
    run_ranks(world, _broadcast_every_src, slice_bytes=4096)


def _rs_ag(comm, store):
    world, r = comm.world_size, comm.rank
    for algo in ("ring", "nccl"):
        for dtype in (torch.float32, torch.bfloat16, torch.int32):
            for m in (0, 1, 1009, 70001):
                inp = _inputs(r, dtype, m * world, "sum", 7).cuda()
                out = torch.empty(m, dtype=dtype, device="cuda")
                comm.reduce_scatter(out, inp, op="sum", algo=algo)
                ref = _reference("sum", dtype, m * world, world, 7)[r * m:(r + 1) * m]
                rtol, atol = _tolerance(dtype, world)
                torch.testing.assert_close(out.cpu().double(), ref, rtol=rtol, atol=atol)
                gin = _rand(dtype, m, 50 + r).cuda()
                gout = torch.empty(m * world, dtype=dtype, device="cuda")
                comm.all_gather(gout, gin, algo=algo)
                gref = torch.cat([_rand(dtype, m, 50 + q) for q in range(world)])
                assert _bitwise_equal(gout, gref), (algo, dtype, m)


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_all_gather(world):
    run_ranks(world, _rs_ag, slice_bytes=8192)


def _p2p(comm, store):
    import pycomm

    world, r = comm.world_size, comm.rank
    nxt, prv = (r + 1) % world, (r - 1) % world
    for n in (0, 1, 1009, 1 << 20):
        # batch: send to next while receiving from previous (a ring shift)
        send = _rand(torch.float32, n, 300 + r).cuda()
        recv = torch.empty(n, device="cuda")
        works = comm.batch_isend_irecv([pycomm.P2POp("isend", send, nxt),
                                        pycomm.P2POp("irecv", recv, prv)])
        for w in works:
            w.wait()
        assert _bitwise_equal(recv, _rand(torch.float32, n, 300 + prv))
        # ping-pong between 0 and 1 with blocking send/recv and isend/irecv
        if r in (0, 1):
            t = torch.full((n,), float(r), device="cuda")
            if r == 0:
                comm.send(t, 1)
                comm.recv(t, 1)
                assert torch.all(t == 2.0).item()
            else:
                comm.recv(t, 0)
                t += 2
                w = comm.isend(t, 0)
                w.wait()
    # isend(x, p); irecv(y, p) on both ranks of a pair, at a size NCCL cannot
    # buffer: on one stream per rank each receive would queue behind the
    # rank's own send, which waits for the peer's receive (a deadlock); the
    # per-direction p2p lanes keep them apart.
    m = 16 << 20
    p = r ^ 1
    if p < world:
        out = torch.full((m,), float(r), device="cuda")
        got = torch.empty(m, device="cuda")
        ws = [comm.isend(out, p), comm.irecv(got, p)]
        for w in ws:
            w.wait()
        assert torch.all(got == float(p)).item()
    # Every rank to every peer at that size: one batch_isend_irecv (a group
    # per lane), which NCCL runs whatever the order of its ops.
    outs = {q: torch.full((m,), float(r * 10 + q), device="cuda") for q in range(world) if q != r}
    ins = {q: torch.empty(m, device="cuda") for q in outs}
    ops = [pycomm.P2POp("isend", outs[q], q) for q in outs]
    ops += [pycomm.P2POp("irecv", ins[q], q) for q in ins]
    for w in comm.batch_isend_irecv(ops):
        w.wait()
    for q, got in ins.items():
        assert torch.all(got == float(q * 10 + r)).item(), q


@pytest.mark.parametrize("world", [2, 3])
def test_p2p_and_batch(world):
    run_ranks(world, _p2p)


def _user_p2p_beside_collective(comm, store):
    # The pipeline-parallel pattern: rank 0 posts irecv(from 1), then an
    # all_reduce; rank 1 runs the all_reduce and only then sends to 0 (after
    # rank 0 has seen its all_reduce complete). User p2p has an NCCL
    # communicator and stream of its own: NCCL must not pair rank 1's ring
    # send with rank 0's user recv, and the pending irecv must hold up neither
    # rank 0's all_reduce nor its Work.
    r, world = comm.rank, comm.world_size
    n, m = (1 << 18) + 3, (1 << 17) + 7  # m: unlike any ring message
    expect = world * (world + 1) / 2
    # NCCL connects a pair of ranks lazily on its first transfer, which blocks
    # the host until the peer posts its side: connect both communicators first
    # (the collectives both ways, the user one from 1 to 0, same sizes).
    for algo in ("ring", "nccl"):
        comm.all_reduce(torch.ones(n, device="cuda"), algo=algo)
    buf = torch.zeros(m, device="cuda")
    if r == 0:
        comm.recv(buf, 1)
    else:
        comm.send(buf, 0)
    torch.cuda.synchronize()

    for i, algo in enumerate(("ring", "nccl")):
        t = torch.full((n,), float(r + 1), device="cuda")
        if r == 0:
            got = torch.zeros(m, device="cuda")
            w = comm.irecv(got, 1)
            comm.all_reduce(t, algo=algo, async_op=True).get_future().wait()
            assert not w.is_completed()  # rank 1 has not sent yet
            store.set(f"all_reduced/{i}", "1")
            w.wait()
            assert torch.all(got == 100.0 + i).item(), algo
        else:
            comm.all_reduce(t, algo=algo)
            store.wait([f"all_reduced/{i}"])
            comm.send(torch.full((m,), 100.0 + i, device="cuda"), 0)
        assert torch.all(t == expect).item(), algo
    comm.barrier()


def test_user_p2p_is_independent_of_collectives():
    run_ranks(2, _user_p2p_beside_collective)


def _async_and_streams(comm, store):
    world, r = comm.world_size, comm.rank
    n = 1 << 20
    expect = world * (world + 1) / 2
    # async Work + future: the future is CUDA-aware (ProcessGroupNCCL's): it is
    # completed at the enqueue, and wait()/value() order the caller's current
    # stream after the op instead of blocking the host.
    t = torch.full((n,), float(r + 1), device="cuda")
    w = comm.all_reduce(t, async_op=True)
    fut = w.get_future()
    res = fut.wait()
    assert res[0] is t or res[0].data_ptr() == t.data_ptr()
    assert torch.all(t == expect).item()  # on the current stream, after the op
    _wait_completed(w)  # the watchdog sees the GPU finish
    assert w.is_success()
    w.wait()

    # then() callbacks run stream-ordered too: the callback's work (on the
    # stream it is given) starts after the all-reduce although the host did
    # not wait for it; a GPU sleep in front of the fill makes a race visible.
    s0 = torch.cuda.Stream()
    with torch.cuda.stream(s0):
        t = torch.zeros(n, device="cuda")
        torch.cuda._sleep(int(2e8))
        t.fill_(float(r + 1))
        chained = comm.all_reduce(t, async_op=True).get_future().then(
            lambda f: f.value()[0] * 2)
        doubled = chained.wait()
    s0.synchronize()
    assert torch.all(doubled == 2 * expect).item()

    # stream semantics: the op runs after the caller's current stream (here a
    # side stream that is busy before it writes the input) ...
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = torch.zeros(n, device="cuda")
        torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time before the fill
        t.fill_(float(r + 1))
        w = comm.all_reduce(t, algo="ring", async_op=True)
        # ... and wait() makes the current stream (s) wait, without the host
        w.wait()
        t.mul_(2)  # on s, after the all-reduce
    s.synchronize()
    assert torch.all(t == 2 * expect).item()

    # a sync op orders the caller's stream after it as well
    u = torch.full((n,), float(r + 1), device="cuda")
    comm.all_reduce(u, algo="nccl")
    u.add_(1)
    torch.cuda.synchronize()
    assert torch.all(u == expect + 1).item()

    # many async ops in flight, completing in order
    ts = [torch.full((4099,), float(r + i), device="cuda") for i in range(16)]
    ws = [comm.all_reduce(x, async_op=True, algo="ring" if i % 2 else "nccl") for i, x in enumerate(ts)]
    for i, (x, w) in enumerate(zip(ts, ws)):
        w.get_future().wait()
        assert torch.all(x == sum(q + i for q in range(world))).item()

    comm.barrier()


def _wait_completed(w, limit=60.0):
    deadline = time.monotonic() + limit
    while not w.is_completed():
        assert time.monotonic() < deadline, "the Work never completed"
        time.sleep(0.005)


def test_async_work_future_and_stream_semantics():
    run_ranks(2, _async_and_streams)


def _argument_errors(comm, store):
    with pytest.raises(ValueError):
        comm.all_reduce(torch.ones(4))  # CPU tensor
    with pytest.raises(ValueError):
        comm.all_reduce(torch.ones(4, 2, device="cuda").t())  # not contiguous
    with pytest.raises(ValueError):
        comm.all_reduce(torch.ones(4, dtype=torch.int32, device="cuda"), op="avg")
    with pytest.raises(ValueError):
        comm.all_reduce(torch.ones(4, device="cuda"), algo="bogus")
    with pytest.raises(TypeError):
        comm.all_reduce(torch.ones(4, dtype=torch.complex64, device="cuda"))
    # The misuses that killed both ranks with SIGSEGV before the CPU and GPU
    # communicators became one (issue 15): checked before anything is enqueued.
    x = torch.ones(4, device="cuda")
    with pytest.raises(ValueError, match="is this rank"):
        comm.send(x, comm.rank)
    with pytest.raises(ValueError, match="out of range"):
        comm.send(x, 7)
    with pytest.raises(ValueError, match="out of range"):
        comm.broadcast(x, src=9)
    with pytest.raises(ValueError, match="world_size"):
        comm.reduce_scatter(torch.empty(3, device="cuda"), torch.ones(4, device="cuda"))
    with pytest.raises(ValueError, match="direct"):
        comm.all_reduce(x, algo="direct")
    # NCCL pairs user p2p in posting order: no tags, no receive from any source.
    with pytest.raises(NotImplementedError, match="tag=3 .*NCCL"):
        comm.isend(x, 1 - comm.rank, tag=3)
    with pytest.raises(NotImplementedError, match="any source .*NCCL"):
        comm.irecv(x)
    assert not comm._impl.aborted  # usage errors leave the communicator usable
    assert comm.transport == "nccl" and comm.device == torch.device("cuda:0")
    comm.all_reduce(x)
    torch.cuda.synchronize()
    assert torch.all(x == comm.world_size).item()
    comm.barrier()


def test_argument_errors():
    run_ranks(2, _argument_errors)


def _checked_mode(comm, store):
    # The fingerprint exchange runs over NCCL in device memory and is read
    # back on the host (Reducer.download); a mismatch raises ValueError on
    # every rank before any payload moved, and the communicator stays usable.
    assert comm._impl.check
    n = 1000 + comm.rank  # different counts
    with pytest.raises(ValueError, match="checked mode: ranks called mismatched collectives"):
        comm.all_reduce(torch.ones(n, device="cuda"))
    assert not comm._impl.aborted
    t = torch.ones(64, device="cuda")
    comm.all_reduce(t, algo="nccl")
    comm.all_reduce(t, algo="ring")
    torch.cuda.synchronize()
    assert torch.all(t == comm.world_size ** 2).item()
    comm.barrier()


def test_checked_mode_on_gpu():
    run_ranks(2, _checked_mode, check=True)


def _groups_over_nccl(comm, store):
    """split() is ncclCommSplit; new_group() builds a communicator of its own
    for the members only. Both renumber the ranks and leave the parent usable."""
    world, r = comm.world_size, comm.rank
    # split by parity with reversed keys: {0, 2} -> ranks (2, 0); {1} alone
    g = comm.split(r % 2, key=-r)
    assert g is not None and g.transport == "nccl"
    members = sorted((q for q in range(world) if q % 2 == r % 2), reverse=True)
    assert g.world_size == len(members) and g.rank == members.index(r)
    t = torch.full((1 << 16,), float(r + 1), device="cuda")
    g.all_reduce(t)
    torch.cuda.synchronize()
    assert torch.all(t == sum(q + 1 for q in members)).item()
    # a rank that joins none gets None, at the same point on every rank
    h = comm.split(None if r == 0 else 7)
    assert (h is None) == (r == 0)
    if h is not None:
        u = torch.ones(8, device="cuda")
        h.all_reduce(u)
        torch.cuda.synchronize()
        assert torch.all(u == world - 1).item()
        h.close()
    pair = comm.new_group([1, 0])
    if r < 2:
        v = torch.full((4,), float(r), device="cuda")
        pair.broadcast(v, src=0)  # group rank 0 is rank 1
        torch.cuda.synchronize()
        assert torch.all(v == 1.0).item()
        pair.close()
    g.close()
    w = torch.ones(4, device="cuda")
    comm.all_reduce(w)  # the parent after its groups closed
    torch.cuda.synchronize()
    assert torch.all(w == world).item()


def test_groups_over_nccl():
    run_ranks(3, _groups_over_nccl)


def _timeout(comm, store, allow_close_error):
    import pycomm

    if comm.rank == 1:
        time.sleep(25)  # never joins the collective (rank 0 gives up after 10 s)
        return
    t = torch.ones(1 << 16, device="cuda")
    # Either the enqueue (NCCL connects lazily, which needs the peer) or the
    # GPU wait (watchdog) hits the timeout; both abort and raise CommError.
    with pytest.raises(pycomm.CommError,
                       match=r"timed out after \d+ ms|did not finish within the timeout"):
        w = comm.all_reduce(t, async_op=True)
        _wait_completed(w, limit=60.0)  # failed by the watchdog
        w.wait()
    assert comm._impl.aborted
    with pytest.raises(pycomm.CommError):
        comm.all_reduce(t)


def test_timeout_aborts_and_raises():
    # 10 s, not less: the timeout also bounds the communicator's creation (NCCL
    # init, two splits, the p2p lanes' connect) on a GPU that may start cold.
    run_ranks(2, _timeout, comm_timeout=10, allow_close_error=True)


def _ops_off_the_current_device(comm, store):
    # The communicator is on cuda:1 and the caller's current device stays
    # cuda:0 (init never calls set_device): every Work's event must still be
    # made on cuda:1, where the op's streams are.
    assert comm.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
    t = torch.full((1 << 20,), float(comm.rank + 1), device="cuda:1")
    comm.all_reduce(t)
    w = comm.all_reduce(t, async_op=True)
    w.wait()
    torch.cuda.synchronize("cuda:1")
    want = float(sum(range(1, comm.world_size + 1)) * comm.world_size)
    assert torch.equal(t, torch.full_like(t, want))
    assert torch.cuda.current_device() == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_communicator_off_the_current_device():
    run_ranks(2, _ops_off_the_current_device, device="cuda:1")


# ---------------------------------------------------------------- pipeline

def _pipeline_two_stages(comm, store):
    """Two pipeline stages on the one GPU (1F1B and GPipe, 4 microbatches,
    uneven split) against the whole model in one process on the same GPU."""
    from torch import nn

    import pycomm.pipeline as pp

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 32, generator=g).cuda(), torch.randn(10, 32, generator=g).cuda()
    ref = model().cuda()
    losses = [nn.functional.mse_loss(ref(a), b) for a, b in zip(x.chunk(4), y.chunk(4))]
    torch.stack(losses).mean().backward()
    want = [p.grad for p in pp.split_sequential(ref, 2, balance=[2, 2])[comm.rank].parameters()]
    for cls in (pp.Schedule1F1B, pp.ScheduleGPipe):
        part = pp.split_sequential(model(), 2, balance=[2, 2])[comm.rank]
        stage = pp.PipelineStage(part, comm.rank, 2, comm, device="cuda:0")
        sched = cls(stage, 4, nn.functional.mse_loss)
        sched.step(x) if stage.is_first else sched.step(target=y)
        for got, exp in zip(stage.submod.parameters(), want):
            torch.testing.assert_close(got.grad, exp, rtol=1e-4, atol=1e-5)


def test_pipeline_two_stages_share_the_gpu():
    run_ranks(2, _pipeline_two_stages)


# ---------------------------------------------------------------- DDP (pycomm.parallel)

def _ddp_matches_full_batch(comm, store, bucket_view, hook):
    """pycomm's DistributedDataParallel over NCCL: after SGD steps the
    parameters equal one process trained on the full batch."""
    from torch import nn

    from pycomm.parallel import DistributedDataParallel

    n, r = comm.world_size, comm.rank

    def mlp(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                             nn.Linear(16, 3)).cuda()

    def sum_then_scale(state, bucket):
        fut = state.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(n))

    ddp = DistributedDataParallel(mlp(100 + r), comm, bucket_cap_mb=0.001, first_bucket_mb=0.0005,
                                  gradient_as_bucket_view=bucket_view)
    if hook:
        ddp.register_comm_hook(comm, sum_then_scale)
    reference = mlp(100)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, reference)]
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        x, y = torch.randn(4 * n, 6, generator=g).cuda(), torch.randn(4 * n, 3, generator=g).cuda()
        for opt in opts:
            opt.zero_grad()
        nn.functional.mse_loss(ddp(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
        nn.functional.mse_loss(reference(x), y).backward()
        for opt in opts:
            opt.step()
    torch.cuda.synchronize()
    for p, q in zip(ddp.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    stats = ddp.stats()
    assert len(stats.buckets) > 1 and stats.rebuilt_after == 1 and len(stats.iterations) == 4


@pytest.mark.parametrize("bucket_view,hook", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_matches_full_batch_over_nccl(world, bucket_view, hook):
    run_ranks(world, _ddp_matches_full_batch, bucket_view=bucket_view, hook=hook)
# ---------------------------------------------------------------- wire dtype + DDP hooks (issue 12)

def _wire_matches_cpu(comm, store):
    """The CUDA wire-dtype ring runs the CPU's arithmetic in the CPU's order
    (same slices): bitwise the result of a CPU communicator on the same data."""
    import torch.distributed as dist

    import pycomm

    cpu = pycomm.init(rank=comm.rank, world_size=comm.world_size,
                      store=dist.PrefixStore("cpu-wire", store), transport="gloo",
                      slice_bytes=64 * 1024, set_default=False)
    try:
        for wire in (torch.float16, torch.bfloat16):
            for op in ("sum", "avg", "max"):
                for n in COUNTS:
                    x = _inputs(comm.rank, torch.float32, n, op, 11)
                    g = x.cuda()
                    comm.all_reduce(g, op=op, algo="auto", wire_dtype=wire)
                    c = x.clone()
                    cpu.all_reduce(c, op=op, algo="ring", wire_dtype=wire)
                    assert torch.equal(g.cpu(), c), (wire, op, n)
        with pytest.raises(ValueError, match="nccl"):
            comm.all_reduce(torch.ones(4, device="cuda"), algo="nccl", wire_dtype=torch.float16)
    finally:
        cpu.close()


@pytest.mark.parametrize("world", [2, 3])
def test_wire_dtype_all_reduce_bitwise_equals_cpu(world):
    run_ranks(world, _wire_matches_cpu, slice_bytes=64 * 1024)


def _ddp_hooks_over_nccl(comm, store):
    """torch DDP on an NCCL group, each hook on the pycomm NCCL communicator,
    against DDP without a hook; then a CPU model's bucket: a clear error."""
    import torch.distributed as dist
    import torch.nn as nn

    from pycomm import hooks

    dist.init_process_group("nccl", store=dist.PrefixStore("ddp-pg", store), rank=comm.rank,
                            world_size=comm.world_size, device_id=torch.device("cuda:0"))
    try:
        def train(hook):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).cuda()
            ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
            if hook is not None:
                ddp.register_comm_hook(comm, hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.2)
            g = torch.Generator().manual_seed(comm.rank)
            for _ in range(4):
                x, y = torch.randn(6, 16, generator=g).cuda(), torch.randn(6, 4, generator=g).cuda()
                opt.zero_grad()
                nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
            return [p.detach().cpu() for p in model.parameters()]

        plain = train(None)
        for hook, tol in ((hooks.allreduce_hook, 1e-5), (hooks.fp16_compress_hook, 4e-4),
                          (hooks.ring_fp16_hook, 4e-4), (hooks.ring_bf16_hook, 4e-3)):
            got = train(hook)
            diff = max((a - b).abs().max().item() for a, b in zip(got, plain))
            assert diff < tol, (hook.__name__, diff)
        # A CPU model's buckets with a CUDA communicator: ValueError at the first bucket.
        cpu_model = nn.parallel.DistributedDataParallel(
            nn.Linear(4, 4), process_group=dist.new_group(backend="gloo"))
        cpu_model.register_comm_hook(comm, hooks.allreduce_hook)
        with pytest.raises(Exception, match="bucket 0 is on cpu but the communicator runs on cuda"):
            cpu_model(torch.randn(2, 4)).sum().backward()
    finally:
        dist.destroy_process_group()


def test_ddp_hooks_over_nccl():
    run_ranks(2, _ddp_hooks_over_nccl)


# ---------------------------------------------------------------- torch.distributed backend on CUDA

@contextlib.contextmanager
def _pycomm_process_group(comm, store, backend="pycomm"):
    """torch.distributed's default group over pycomm's backend, on the ranks
    of the harness (whose own communicator the tests leave alone)."""
    import torch.distributed as dist

    import pycomm  # noqa: F401  (registers the backend)

    dist.init_process_group(backend, store=dist.PrefixStore(f"pg/{backend}", store),
                            rank=comm.rank, world_size=comm.world_size,
                            timeout=timedelta(seconds=120))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _cuda_communicators():
    import pycomm

    return [c for c in pycomm.backend._communicators.values()
            if c.transport == "nccl" and not c.closed]


def _backend_every_op(comm, store, backend):
    """tests/test_backend.py's op sweep (every op, sync and async, against
    float64 references; staged list and non-contiguous variants; p2p) on CUDA
    tensors through torch.distributed; the CUDA communicator appears at the
    first CUDA op; a subgroup and a CUDA barrier."""
    import torch.distributed as dist

    import pycomm
    from tests.test_backend import _gathers_and_broadcast, _p2p_and_layouts, _reductions

    r, n = comm.rank, comm.world_size
    with _pycomm_process_group(comm, store, backend):
        t = torch.full((3,), float(r + 1))
        dist.all_reduce(t)  # CPU
        dist.barrier()
        assert _cuda_communicators() == [], "the CUDA communicator must wait for a CUDA op"
        checked = (_reductions(r, n, "cuda") + _gathers_and_broadcast(r, n, "cuda")
                   + _p2p_and_layouts(r, n, "cuda"))
        assert checked > 100
        gpu = pycomm.backend.get_communicator(device="cuda")
        assert (gpu.transport, str(gpu.device), gpu.rank, gpu.world_size) == ("nccl", "cuda:0", r, n)
        assert len(_cuda_communicators()) == 1
        sub = dist.new_group([0, 1])
        if r < 2:
            x = torch.full((5,), float(r + 1), device="cuda")
            dist.all_reduce(x, group=sub)
            assert torch.equal(x.cpu(), torch.full((5,), 3.0))
            assert pycomm.backend.get_communicator(sub, device="cuda").world_size == 2
        dist.barrier(device_ids=[0])  # on the CUDA communicator
        # A call mixing devices: ValueError, the group stays usable.
        with pytest.raises(ValueError, match=r"output_tensor_list\[0\] is on cpu but input is on cuda:0"):
            dist.all_gather([torch.empty(2) for _ in range(n)], torch.ones(2, device="cuda"))
        y = torch.full((2,), float(r), device="cuda")
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        assert torch.equal(y.cpu(), torch.full((2,), float(n - 1)))


@pytest.mark.parametrize("world,backend", [(2, "pycomm"), (3, "pycomm"),
                                           (2, "cpu:pycomm,cuda:pycomm")])
def test_backend_every_op_on_cuda(world, backend):
    run_ranks(world, _backend_every_op, backend=backend)


def _backend_streams(comm, store):
    """ProcessGroupNCCL's stream semantics through the pycomm backend: an op
    runs after the caller's current stream, Work.wait() orders that stream
    after the op (and after the copy back of a staged output) without the
    host, get_future()/then() are stream-ordered, Work.wait(timeout) waits
    for the GPU. A GPU sleep in front of each input makes a race visible."""
    import torch.distributed as dist

    r, n = comm.rank, comm.world_size
    expect = n * (n + 1) / 2
    big = 1 << 20
    with _pycomm_process_group(comm, store):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            t = torch.zeros(big, device="cuda")
            torch.cuda._sleep(int(2e8))
            t.fill_(float(r + 1))
            work = dist.all_reduce(t, async_op=True)
            work.wait()
            t.mul_(2)  # on s, after the all-reduce
        s.synchronize()
        assert torch.all(t == 2 * expect).item()

        s2 = torch.cuda.Stream()
        with torch.cuda.stream(s2):
            base = torch.zeros(big, 2, device="cuda")
            torch.cuda._sleep(int(2e8))
            base[:, 0].fill_(float(r + 1))
            col = base[:, 0]  # non-contiguous: staged, copied back after the op
            doubled = dist.all_reduce(col, async_op=True).get_future().then(
                lambda f: f.value()[0] * 2).wait()
            outs = [torch.empty(big, device="cuda") for _ in range(n)]
            torch.cuda._sleep(int(2e8))
            mine = torch.full((big,), float(r), device="cuda")
            dist.all_gather(outs, mine, async_op=True).wait()  # staged list
            gathered = torch.stack(outs)  # on s2, after the copies out
        s2.synchronize()
        assert torch.all(doubled == 2 * expect).item()
        assert torch.all(base[:, 0] == expect).item() and torch.all(base[:, 1] == 0).item()
        for q in range(n):
            assert torch.all(gathered[q] == q).item()

        # A sync op orders the current stream after it, the copy back included.
        u = torch.full((4, 6), float(r + 1), device="cuda").t()
        dist.all_reduce(u)
        u.add_(1)
        torch.cuda.synchronize()
        assert torch.all(u == expect + 1).item()

        # wait(timeout): the host waits until the GPU has run the op.
        with torch.cuda.stream(s):
            v = torch.zeros(big, device="cuda")
            torch.cuda._sleep(int(2e8))
            v.fill_(1.0)
            work = dist.all_reduce(v, async_op=True)
            assert work.wait(timeout=timedelta(seconds=60))
            assert work.is_completed() and work.is_success() and work.exception() is None
        s.synchronize()
        assert torch.all(v == n).item()


def test_backend_stream_semantics():
    run_ranks(2, _backend_streams)


def _backend_ddp(comm, store):
    """torch DDP (several buckets) over backend="pycomm" on CUDA equals one
    process trained on the full batch (tests/test_backend.py's CPU test)."""
    from tests.test_backend import DDP_MLP, _batch, _ddp_train, _mlp, _train

    steps = 4
    with _pycomm_process_group(comm, store):
        out = _ddp_train(comm.rank, comm.world_size, steps, torch.device("cuda", 0))
    assert out["backend"] == ("pycomm", "pycomm")
    assert len(out["buckets"]) >= 3, out["buckets"]
    ref = _mlp(**DDP_MLP).cuda()
    x, y = _batch()
    _train(ref, x.cuda(), y.cuda(), steps)
    for p, q in zip(out["params"], ref.parameters()):
        torch.testing.assert_close(torch.from_numpy(p), q.detach().cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_backend_ddp_on_cuda_equals_one_process(world):
    run_ranks(world, _backend_ddp)
