"""pycomm.hooks and the wire-dtype all-reduce under them.

* ``all_reduce(wire_dtype=...)`` against a float64 reference on gloo and shm,
  2 and 3 ranks, sizes 0, 1, prime, not divisible by the world size, large,
  with an error bound derived from the wire dtype's rounding.
* torch DDP (built on a gloo process group) with each pycomm hook against DDP
  without a hook and against one process training on the full batch: several
  SGD steps, a tiny ``bucket_cap_mb`` (many buckets), 2 and 3 ranks.
* pycomm's PowerSGD against torch's ``powerSGD_hook`` on the same seeds, data
  and buckets (1e-5).
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import pycomm
from pycomm import _hook_common, _powersgd, hooks
from tests._dist import client_store, run_ranks, spawn_ranks
from tests.reference import digest, ring_chunks

WIRES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Unit roundoff (half an ulp at 1) and the smallest subnormal's half, per wire dtype.
UNIT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
TINY = {torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134}
COUNTS = [0, 1, 13, 1031, 1_048_583]  # primes: not divisible by 2 or 3


# ---------------------------------------------------------------- wire-dtype all-reduce

def _inputs(n: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    # Mixed magnitudes (1e-3 .. 1e2) so that relative rounding matters.
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(1000 * seed + r)
        x = torch.randn(count, generator=g, dtype=torch.float64)
        x *= 10.0 ** torch.randint(-3, 3, (count,), generator=g).double()
        out.append(x.float())
    return out


def wire_bound(inputs: list[torch.Tensor], wire: torch.dtype, avg: bool) -> torch.Tensor:
    """Per-element bound of |wire all-reduce - exact|. With S = sum_i |x_i|:
    n-1 roundings of partial sums (each <= S) to the wire dtype, one of the
    result, the float32 additions and scale, and an absolute term per rounding
    for the wire dtype's subnormals: (n u_w + 2 n u_32) S + n tiny_w."""
    n = len(inputs)
    s = torch.stack([x.double().abs() for x in inputs]).sum(0)
    bound = (n * UNIT[wire] + 2 * n * 2.0 ** -24) * s + n * TINY[wire]
    return bound / n if avg else bound


def _wire_cases(comm, wire_name: str, op: str, algo: str):
    wire = WIRES[wire_name]
    n = comm.world_size
    out = []
    for count in COUNTS:
        xs = _inputs(n, count)
        t = xs[comm.rank].clone()
        comm.all_reduce(t, op=op, algo=algo, wire_dtype=wire_name if count % 2 else wire)
        exact = torch.stack([x.double() for x in xs]).sum(0)
        if op == "avg":
            exact /= n
        err = (t.double() - exact).abs()
        bound = wire_bound(xs, wire, op == "avg")
        bad = (err > bound).nonzero().flatten()
        assert bad.numel() == 0, (f"count={count}: {bad.numel()} elements beyond the bound, "
                                  f"first {bad[:3].tolist()}: err {err[bad[:3]].tolist()} "
                                  f"bound {bound[bad[:3]].tolist()}")
        # The result is a wire value (rounded by its owner), identical everywhere.
        assert torch.equal(t.to(wire).float(), t), f"count={count}: not wire-representable"
        # Cast-everything on the same data: every input rounded, reduced in 16 bits.
        c = xs[comm.rank].to(wire)
        comm.all_reduce(c, op=op, algo="ring")
        cast_err = (c.double() - exact).abs()
        out.append((count, digest(t), err.sum().item(), cast_err.sum().item()))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("wire", sorted(WIRES))
def test_wire_all_reduce_against_float64(transport, world_size, wire):
    per_rank = run_ranks(_wire_cases, world_size, transport, wire, "avg", "auto")
    for r in range(1, world_size):
        assert [c[:2] for c in per_rank[r]] == [c[:2] for c in per_rank[0]], \
            f"rank {r} differs from rank 0"
    for count, _, err, cast_err in per_rank[0]:
        if count >= 1031:  # enough elements for a stable mean
            assert err < cast_err, f"count={count}: wire error {err} not below cast {cast_err}"
            print(f"{transport} n={world_size} {wire} count={count}: mean |err| wire "
                  f"{err / count:.3g} vs cast {cast_err / count:.3g}")


def test_wire_all_reduce_sum_and_ring_on_shm():
    # SUM (no scale) through an explicit algo="ring".
    for wire in WIRES:
        run_ranks(_wire_cases, 2, "shm", wire, "sum", "ring")


def _wire_one_rank(comm):
    """One rank has nothing to send, but the result is still the owner's value
    rounded to the wire dtype, as with more ranks (and as fp16_compress_hook)."""
    out = []
    for wire in WIRES.values():
        for op in ("sum", "avg", "max"):
            for count in (1, 1031):
                x = _inputs(1, count, seed=5)[0]
                t = x.clone()
                comm.all_reduce(t, op=op, algo="ring", wire_dtype=wire)
                out.append(int((t != x.to(wire).float()).sum()))
    return out


def test_wire_all_reduce_one_rank_rounds(transport):
    mismatches = run_ranks(_wire_one_rank, 1, transport)[0]
    assert mismatches == [0] * len(mismatches), mismatches


def _wire_exact_two_ranks(comm, op: str):
    """With 2 ranks the wire all-reduce is short enough to write down: the
    owner r of chunk r adds the other rank's value rounded to the wire dtype to
    its own in float32 (AVG: times 0.5), and rounds the result. Checked bit for
    bit against torch's own conversions (round to nearest even)."""
    out = []
    for wire in WIRES.values():
        for count in (1031, 1_048_583):
            xs = _inputs(2, count, seed=3)
            t = xs[comm.rank].clone()
            comm.all_reduce(t, op=op, algo="ring", wire_dtype=wire)
            expect = torch.empty(count)
            for owner, (begin, length) in enumerate(ring_chunks(count, 2, 4)):
                part = slice(begin, begin + length)  # chunk `owner`, reduced by its owner
                v = xs[owner][part] + xs[1 - owner][part].to(wire).float()
                if op == "avg":
                    v = v * 0.5
                expect[part] = v.to(wire).float()
            out.append(int((t != expect).sum()))
    return out


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_wire_all_reduce_bitwise_on_two_ranks(transport, op):
    for mismatches in run_ranks(_wire_exact_two_ranks, 2, transport, op):
        assert mismatches == [0, 0, 0, 0], mismatches


def _wire_errors(comm):
    msgs = []
    cases = [
        (dict(tensor=torch.zeros(4, dtype=torch.float64), wire_dtype=torch.float16), ValueError),
        (dict(tensor=torch.zeros(4, dtype=torch.float16), wire_dtype=torch.float16), ValueError),
        (dict(tensor=torch.zeros(4), wire_dtype=torch.float32), ValueError),
        (dict(tensor=torch.zeros(4), wire_dtype="int16"), ValueError),
        (dict(tensor=torch.zeros(4), wire_dtype=3), ValueError),
    ]
    if comm.transport == "shm":
        cases.append((dict(tensor=torch.zeros(4), wire_dtype="bfloat16", algo="direct"),
                      ValueError))
    for kwargs, exc in cases:
        with pytest.raises(exc) as info:
            comm.all_reduce(**kwargs)
        msgs.append(str(info.value))
    # Checked mode sees a wire dtype that differs between ranks (the byte
    # counts on the wire would not match) before anything is sent.
    comm._impl.check = True
    try:
        with pytest.raises(ValueError) as info:
            comm.all_reduce(torch.ones(6), wire_dtype="float16" if comm.rank == 0 else None)
        msgs.append(str(info.value))
    finally:
        comm._impl.check = False
    # still usable
    t = torch.ones(5)
    comm.all_reduce(t, wire_dtype="bfloat16")
    assert t.tolist() == [float(comm.world_size)] * 5
    return msgs


def test_wire_dtype_errors(transport):
    msgs = run_ranks(_wire_errors, 2, transport)[0]
    assert "float32 tensor" in msgs[0] and "float64" in msgs[0]
    assert "float32 tensor" in msgs[1]
    assert "wire_dtype must be" in msgs[2] and "float32" in msgs[2]
    assert "wire_dtype must be None" in msgs[3]
    if transport == "shm":
        assert "direct" in msgs[-2]
    assert "mismatched" in msgs[-1] and "wire=float16" in msgs[-1], msgs[-1]


# ---------------------------------------------------------------- DDP harness

IN, HID, OUT = 12, 24, 5
BATCH = 12  # divisible by 2 and 3: every rank's shard has the same size
STEPS = 5
LR = 0.2
BUCKET_MB = 0.0008  # ~800 bytes: a bucket per one or two parameters
_pg_count = itertools.count()


class Net(nn.Module):
    """An MLP; with ``unused=True`` a branch that never runs (find_unused_parameters)."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HID)
        self.fc2 = nn.Linear(HID, HID)
        self.fc3 = nn.Linear(HID, OUT)
        self.spare = nn.Linear(HID, OUT) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def _fresh_model(unused: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return Net(unused)


def _torch_pg(comm, tag: str, threads: int = 2) -> dist.ProcessGroup:
    """A gloo process group for DDP itself, on the pool's store (unique prefix).
    Built by hand (as init_process_group does) because the pool processes have
    no default group. ``threads``: gloo's worker threads (default 2)."""
    store = dist.PrefixStore(f"ddp-pg/{tag}", comm._store)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    opts._threads = threads
    opts._timeout = timedelta(seconds=60)
    gloo = dist.ProcessGroupGloo(store, comm.rank, comm.world_size, opts)
    pg = dist.ProcessGroup(store, comm.rank, comm.world_size)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg


def _train(comm, pg, hook=None, state=None, steps: int = STEPS, **ddp_kwargs) -> list[torch.Tensor]:
    """DDP training on this rank's shard of each step's batch; the parameters."""
    model = _fresh_model(ddp_kwargs.pop("unused", False))
    ddp_kwargs.setdefault("bucket_cap_mb", BUCKET_MB)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=pg, **ddp_kwargs)
    if hook is not None:
        ddp.register_comm_hook(state if state is not None else comm, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    n, r = comm.world_size, comm.rank
    shard = slice(r * BATCH // n, (r + 1) * BATCH // n)
    for step in range(steps):
        x, y = _data(step)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[shard]), y[shard]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train_single(steps: int = STEPS) -> list[torch.Tensor]:
    """One process on the full batch: what data parallelism must reproduce."""
    model = _fresh_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = _data(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


HOOKS = {
    "allreduce": hooks.allreduce_hook,
    "fp16": hooks.fp16_compress_hook,
    "bf16": hooks.bf16_compress_hook,
    "fp16_wrapper": hooks.fp16_compress_wrapper(hooks.allreduce_hook),
    "bf16_wrapper": hooks.bf16_compress_wrapper(hooks.allreduce_hook),
    "ring_fp16": hooks.ring_fp16_hook,
    "ring_bf16": hooks.ring_bf16_hook,
}
# Parameters after STEPS steps vs DDP without a hook. allreduce: float32
# rounding. The 16-bit hooks: each step's gradient (|g| <~ 0.3 here) is off by
# a few 16-bit roundoffs (2^-11, 2^-8), times LR * STEPS = 1, with room for
# the trajectories to drift apart: 4e-4 (fp16) and 4e-3 (bf16). Measured:
# at most 4e-5 and 4e-4.
TOL = {"allreduce": 1e-5, "fp16": 4e-4, "fp16_wrapper": 4e-4, "ring_fp16": 4e-4,
       "bf16": 4e-3, "bf16_wrapper": 4e-3, "ring_bf16": 4e-3}


def _ddp_hooks_case(comm, names: list[str], flags: dict):
    tag = f"{next(_pg_count)}"
    pg = _torch_pg(comm, tag)
    plain = _train(comm, pg, **flags)
    single = _train_single()
    out = {"plain_vs_single": _max_diff(plain, single)}
    for name in names:
        params = _train(comm, pg, HOOKS[name], **flags)
        out[name] = (_max_diff(params, plain), _max_diff(params, single), digest(params[0]))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_hooks_match_plain_ddp_and_single_process(world_size):
    per_rank = run_ranks(_ddp_hooks_case, world_size, "shm", sorted(HOOKS), {}, timeout=300)
    for res in per_rank:
        assert res["plain_vs_single"] < 1e-5, res
        for name in HOOKS:
            vs_plain, vs_single, _ = res[name]
            assert vs_plain < TOL[name], f"{name}: {vs_plain} vs DDP without hook"
            assert vs_single < TOL[name] + 1e-5, f"{name}: {vs_single} vs one process"
    # Every rank holds the same parameters.
    for name in HOOKS:
        assert len({res[name][2] for res in per_rank}) == 1, name
    print({k: v[0] if isinstance(v, tuple) else v for k, v in per_rank[0].items()})


def _registration_case(comm, view: bool):
    """What allreduce_hook finds registered right after its call: DDP's own
    buckets (symmetric memory from the first call on), never the copies that
    fp16_compress_wrapper hands it."""
    seen: dict[str, list[bool]] = {"plain": [], "wrapped": []}

    def recording(key):
        def hook(state, bucket):
            fut = hooks.allreduce_hook(state, bucket)
            seen[key].append(comm.is_registered(bucket.buffer()))
            return fut
        return hook

    pg = _torch_pg(comm, f"registration-{next(_pg_count)}")
    plain = _train(comm, pg, gradient_as_bucket_view=view)
    params = _train(comm, pg, recording("plain"), gradient_as_bucket_view=view)
    _train(comm, pg, hooks.fp16_compress_wrapper(recording("wrapped")),
           gradient_as_bucket_view=view)
    return seen, _max_diff(params, plain)


@pytest.mark.parametrize("view", [False, True])
def test_allreduce_hook_moves_ddp_buckets_into_symmetric_memory(view):
    for seen, diff in run_ranks(_registration_case, 2, "shm", view, timeout=300):
        assert seen["plain"] and all(seen["plain"]), seen
        assert seen["wrapped"] and not any(seen["wrapped"]), seen
        assert diff < 1e-5, diff


def _join_comm(rank: int, world_size: int, port: int):
    """A fresh process's default gloo group (join() needs one) and an shm
    communicator over it."""
    import pycomm

    dist.init_process_group("gloo", store=client_store(port, world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    return pycomm.init(group=dist.group.WORLD, transport="shm")


def train_joined(comm, register=None) -> list[torch.Tensor]:
    """DDP under join() with uneven inputs (rank 0 runs out after 3 steps, the
    others do 5); ``register(ddp)`` installs a hook. The parameters."""
    n, r = comm.world_size, comm.rank
    shard = slice(r * BATCH // n, (r + 1) * BATCH // n)
    model = _fresh_model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    if register is not None:
        register(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    with ddp.join():
        for step in range(3 if r == 0 else 5):
            x, y = _data(step)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x[shard]), y[shard]).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def run_joined(rank: int, world_size: int, port: int, register, result):
    """In a fresh process: DDP under join() without a hook and with
    ``register``'s; ``result(comm, plain, hooked)`` is returned."""
    comm = _join_comm(rank, world_size, port)
    try:
        plain = train_joined(comm)
        hooked = train_joined(comm, lambda ddp: register(comm, ddp))
        return result(comm, plain, hooked)
    finally:
        comm.close()
        dist.destroy_process_group()


def _join_rank(rank: int, world_size: int, port: int):
    """Uneven inputs under torch DDP's join(): the rank that runs out first
    shadows the others' all-reduces with zero buckets through the hook. Those
    ask to be registered (moved into symmetric memory) while the active ranks' buckets are
    there already, so those all-reduces must stage, not disagree."""
    return run_joined(rank, world_size, port,
                      lambda comm, ddp: ddp.register_comm_hook(comm, hooks.allreduce_hook),
                      lambda comm, plain, hooked: (_max_diff(hooked, plain),
                                                   comm.symmetric_all_reduces))


@pytest.mark.parametrize("world_size", [2, 3])
def test_allreduce_hook_under_join(world_size):
    for diff, symmetric in spawn_ranks(_join_rank, world_size, timeout=300):
        assert diff < 1e-5, diff
        assert symmetric > 0  # the steps before the join ran from symmetric memory


def test_ddp_allreduce_hook_over_gloo_transport():
    per_rank = run_ranks(_ddp_hooks_case, 2, "gloo", ["allreduce", "ring_fp16"], {},
                         timeout=300)
    for res in per_rank:
        assert res["allreduce"][0] < 1e-5 and res["ring_fp16"][0] < TOL["ring_fp16"], res


@pytest.mark.parametrize("flags", [
    {"gradient_as_bucket_view": True},
    {"static_graph": True},
    {"find_unused_parameters": True, "unused": True},
], ids=["bucket_view", "static_graph", "find_unused"])
def test_ddp_hooks_with_ddp_options(flags):
    per_rank = run_ranks(_ddp_hooks_case, 2, "shm", ["allreduce", "ring_bf16", "fp16"], flags,
                         timeout=300)
    for res in per_rank:
        for name in ("allreduce", "ring_bf16", "fp16"):
            assert res[name][0] < TOL[name], (name, res)


# ---------------------------------------------------------------- ring vs cast on one step

def _one_step_errors(comm):
    """Each 16-bit hook's averaged gradient after one backward, against the
    float64 average of every rank's local gradient (computed here from the
    same data): mean |error| over all gradient elements."""
    n = comm.world_size
    x, y = _data(0)
    exact = None
    for r in range(n):  # every rank's local gradient, in float64
        model = _fresh_model().double()
        s = slice(r * BATCH // n, (r + 1) * BATCH // n)
        nn.functional.mse_loss(model(x[s].double()), y[s].double()).backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()])
        exact = g if exact is None else exact + g
    exact /= n
    pg = _torch_pg(comm, f"one-step-{next(_pg_count)}")
    out = {}
    for name in ("fp16", "ring_fp16", "bf16", "ring_bf16", "allreduce"):
        model = _fresh_model()
        ddp = nn.parallel.DistributedDataParallel(model, process_group=pg,
                                                  bucket_cap_mb=BUCKET_MB)
        ddp.register_comm_hook(comm, HOOKS[name])
        s = slice(comm.rank * BATCH // n, (comm.rank + 1) * BATCH // n)
        nn.functional.mse_loss(ddp(x[s]), y[s]).backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
        out[name] = (g - exact).abs().mean().item()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_hooks_error_below_cast_hooks(world_size):
    errs = run_ranks(_one_step_errors, world_size, "shm")[0]
    print(f"n={world_size} mean |grad error| vs float64: {errs}")
    assert errs["allreduce"] < 1e-7
    for bits, unit in (("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8)):
        assert errs[f"ring_{bits}"] < errs[bits], errs
        # bounded: a few roundings of gradients of magnitude <~ 1
        assert errs[f"ring_{bits}"] < world_size * unit, errs


# ---------------------------------------------------------------- PowerSGD vs torch

def _powersgd_case(comm, kwargs: dict):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    # One bucket: torch's powerSGD_hook issues its chained all-reduces from
    # callbacks that run either inline on the autograd thread (future already
    # done) or on a gloo thread, so with several buckets in flight the ranks
    # can issue them in different orders and gloo hangs (seen here with tiny
    # buckets). pycomm's chains run in the same order on every rank; the
    # many-bucket test below covers them.
    pg = _torch_pg(comm, f"psgd-{next(_pg_count)}")
    steps = 7
    one_bucket = {"bucket_cap_mb": 25}
    ref_state = torch_psgd.PowerSGDState(process_group=pg, **kwargs)
    ref = _train(comm, pg, torch_psgd.powerSGD_hook, ref_state, steps=steps, **one_bucket)
    state = hooks.PowerSGDState(comm, **kwargs)
    ours = _train(comm, pg, hooks.powerSGD_hook, state, steps=steps, **one_bucket)
    plain = _train(comm, pg, steps=steps, **one_bucket)
    return _max_diff(ours, ref), _max_diff(ours, plain), state.compression_stats()


def _powersgd_many_buckets(comm, kwargs: dict):
    pg = _torch_pg(comm, f"psgd-many-{next(_pg_count)}")
    state = hooks.PowerSGDState(comm, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                **kwargs)
    ours = _train(comm, pg, hooks.powerSGD_hook, state, steps=STEPS)
    plain = _train(comm, pg, steps=STEPS)
    return digest(torch.cat([p.flatten() for p in ours])), _max_diff(ours, plain)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kwargs", [
    dict(matrix_approximation_rank=1, start_powerSGD_iter=2),
    dict(matrix_approximation_rank=3, start_powerSGD_iter=3, min_compression_rate=1,
         batch_tensors_with_same_shape=True),
    dict(matrix_approximation_rank=2, start_powerSGD_iter=2, use_error_feedback=False,
         warm_start=False),
], ids=["rank1", "rank3_batched", "no_feedback"])
def test_powerSGD_matches_torch(world_size, kwargs):
    per_rank = run_ranks(_powersgd_case, world_size, "shm", kwargs, timeout=300)
    for vs_torch, vs_plain, stats in per_rank:
        assert vs_torch < 1e-5, f"PowerSGD differs from torch's by {vs_torch}"
        # and it did compress (differs from plain averaging)
        assert vs_plain > 1e-4 and stats[0] > 1, (vs_plain, stats)


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kwargs", [{}, dict(use_error_feedback=False, warm_start=False)],
                         ids=["warm", "cold"])
def test_powerSGD_many_buckets_same_on_every_rank(world_size, kwargs):
    # cold: without warm start each bucket's P/Q memory is dropped when its
    # chain ends, while later buckets' chains are still in flight.
    per_rank = run_ranks(_powersgd_many_buckets, world_size, "shm", kwargs, timeout=300)
    assert len({d for d, _ in per_rank}) == 1, "ranks ended with different parameters"
    assert 1e-4 < per_rank[0][1] < 0.5, per_rank[0]  # compressed, and still training


class _FakeBucket:
    """A GradBucket stand-in whose buffer lives on another device (meta)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer]


def _hook_errors(comm):
    bucket = _FakeBucket(torch.zeros(8, device="meta"))
    seq = comm._impl.seq
    msgs = []
    for hook, state in [(hooks.allreduce_hook, comm), (hooks.fp16_compress_hook, comm),
                        (hooks.ring_bf16_hook, comm),
                        (hooks.powerSGD_hook, hooks.PowerSGDState(comm, start_powerSGD_iter=2))]:
        with pytest.raises(ValueError) as info:
            hook(state, bucket)
        msgs.append(str(info.value))
    assert comm._impl.seq == seq, "an op was issued for a bucket on the wrong device"
    with pytest.raises(TypeError, match="Communicator"):
        hooks.allreduce_hook(object(), _FakeBucket(torch.zeros(8)))
    with pytest.raises(TypeError, match="float32"):
        hooks.ring_fp16_hook(comm, _FakeBucket(torch.zeros(8, dtype=torch.float64)))
    with pytest.raises(ValueError, match="start_powerSGD_iter"):
        hooks.PowerSGDState(comm, start_powerSGD_iter=1)
    # Through real DDP: a hook's error surfaces from backward() at the first
    # bucket, with its message (float64 gradients for the float32-only ring).
    pg = _torch_pg(comm, f"errors-{next(_pg_count)}")
    ddp = nn.parallel.DistributedDataParallel(_fresh_model().double(), process_group=pg,
                                              bucket_cap_mb=BUCKET_MB)
    ddp.register_comm_hook(comm, hooks.ring_fp16_hook)
    with pytest.raises(Exception, match=r"bucket 0 is torch.float64; the wire-dtype ring needs"):
        ddp(torch.randn(2, IN, dtype=torch.float64)).sum().backward()
    return msgs


@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_powerSGD_chain_futures_name_the_cuda_device(monkeypatch, device):
    """The futures chaining PowerSGD's all-reduces are CUDA-aware on CUDA: a
    plain future hands its callbacks the tensors without ordering their
    streams after the all-reduce, which then still writes them (the GPU check
    of 2026-11-26: PowerSGD differed from torch's by 0.1 on an H100)."""
    made: list = []
    plain = torch.futures.Future

    def recording(*args, **kwargs):
        made.append(kwargs.get("devices"))
        return plain()

    monkeypatch.setattr(torch.futures, "Future", recording)
    first, inner = plain(), plain()
    out = _hook_common.then_async(first, lambda done: inner, torch.device(device))
    assert made == [[torch.device(device)] if device != "cpu" else None]
    first.set_result(1)
    inner.set_result([torch.ones(2)])
    assert torch.equal(out.wait()[0], torch.ones(2))


class _MatrixBucket(_FakeBucket):
    """A one-gradient bucket whose gradient is a matrix worth compressing."""

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer.view(64, 64)]


def _powersgd_dicts_emptied_midway(comm) -> tuple[bool, bool]:
    """Without warm start a bucket's chain ends on the worker thread by
    dropping P/Q memory, possibly while DDP calls a later bucket's hook on
    its own thread. Here that happens at the worst moment, deterministically:
    the dicts empty while _LowRank builds the bucket's views. The hook must
    neither raise (KeyError: the ranks' op sequences would part) nor change
    its result. Also: a finished chain leaves no memory behind."""
    grads = torch.randn(64 * 64, generator=torch.Generator().manual_seed(5))

    def run(empty_midway: bool) -> torch.Tensor:
        state = hooks.PowerSGDState(comm, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                    use_error_feedback=False, warm_start=False)
        state.iter = state.start_powerSGD_iter
        batches = _powersgd._LowRank._batches

        def emptying(self, st):
            st.p_memory_dict.clear()  # another bucket's chain ended just now
            st.q_memory_dict.clear()
            return batches(self, st)

        if empty_midway:
            _powersgd._LowRank._batches = emptying
        try:
            out = hooks.powerSGD_hook(state, _MatrixBucket(grads.clone())).wait()
        finally:
            _powersgd._LowRank._batches = batches
        assert not state.p_memory_dict and not state.q_memory_dict
        return out

    calm, raced = run(False), run(True)
    return torch.equal(calm, raced), bool((calm - grads).abs().max() > 1e-4)


def test_powerSGD_cold_start_survives_other_chains_ending():
    same, compressed = run_ranks(_powersgd_dicts_emptied_midway, 1, "shm")[0]
    assert same and compressed


def test_bucket_on_another_device_is_a_clear_error():
    for msg in run_ranks(_hook_errors, 2, "shm")[0]:
        assert "bucket 0 is on meta" in msg and "communicator runs on cpu" in msg, msg


def test_hooks_module_is_exported():
    assert pycomm.hooks is hooks
    assert set(hooks.__all__) >= {"allreduce_hook", "powerSGD_hook", "ring_fp16_hook"}


# ---------------------------------------------------------------- the example

@pytest.mark.parametrize("hook", ["allreduce", "powersgd"])
def test_example_ddp_hooks_under_torchrun(hook):
    import re

    from tests._dist import run_torchrun

    proc = run_torchrun("examples/ddp_hooks.py", 2, "--hook", hook)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.findall(rf"rank (\d)/2 hook={hook} \[shm\] last loss [\d.]+, "
                       r"max \|param - plain DDP's\| = ([\d.e+-]+)", proc.stdout)
    assert sorted(r for r, _ in found) == ["0", "1"], proc.stdout
    limit = {"allreduce": 1e-5, "powersgd": 0.1}[hook]  # PowerSGD compresses: close, not equal
    assert all(float(d) < limit for _, d in found), proc.stdout


def test_ddp_benchmark_harness_runs(tmp_path):
    """benchmarks/ddp/bench.py at a toy size, every mode: one table, JSON (with
    the commit and every step time), PNG; the exact variants (hook all-reduce,
    pycomm DDP, torch DDP on backend="pycomm") end with torch-gloo's parameters."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    variants = ["torch-gloo", "hook-allreduce", "hook-ring-fp16", "pycomm-ddp", "backend-pycomm"]
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "ddp" / "bench.py"), "--width", "64",
         "--depth", "1", "--inputs", "32", "--rounds", "2", "--steps", "2", "--warmup", "1",
         "--variants", ",".join(variants), "--mode", "compare,sweep,contention",
         "--sweep", "0.001,25", "--json", str(out_json), "--plot", str(out_png)],
        env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vs torch-gloo" in proc.stdout and "backend-pycomm" in proc.stdout
    assert "parameters differ" not in proc.stdout, proc.stdout
    data = json.loads(out_json.read_text())
    rows = data["rows"]
    assert [(r["phase"], r["variant"], r["bucket_mb"]) for r in rows] == (
        [("compare", v, 25.0) for v in variants]
        + [("sweep", v, cap) for cap in (0.001, 25.0) for v in ("torch-gloo", "pycomm-ddp")]
        + [("contention", c, None) for c in ("pycomm idle", "pycomm busy",
                                             "pycomm-symmetric idle", "pycomm-symmetric busy",
                                             "torch idle", "torch busy")])
    assert all(r["steps"] == 4 and len(r["times_ms"]) == 2 and r["median_ms"] > 0 for r in rows)
    assert all(r["speedup_vs_torch-gloo"] == 1.0 for r in rows if r["variant"] == "torch-gloo")
    for r in rows[:9]:  # exact variants match torch-gloo; fp16 on the wire differs, but little
        assert r["max_param_diff"] < (1e-2 if r["variant"] == "hook-ring-fp16" else 1e-4), r
    ddp = [r for r in rows if r["variant"] == "pycomm-ddp"]
    assert all(0 <= r["hidden_fraction"] <= 1 and r["comm_ms"] > 0 for r in ddp)
    assert len(data["meta"]["commit"]) >= 40 and out_png.stat().st_size > 0


def test_ddp_benchmark_floor_variants_pinned(tmp_path, monkeypatch):
    """The diagnostic variants that bound what a hook can gain (compute-only,
    ddp-no-comm, ddp-one-pass) run; --pin binds each rank to its own CPU; the
    one-pass hook scales every bucket in place by 1/world_size on its thread."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    path = root / "benchmarks" / "ddp" / "bench.py"
    spec = importlib.util.spec_from_file_location("ddp_bench", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look the module up
    spec.loader.exec_module(bench)

    class Bucket:
        def __init__(self, t):
            self.t = t

        def buffer(self):
            return self.t

    t = torch.arange(8, dtype=torch.float32)
    got = bench._one_pass(bench._OnePass(world_size=4), Bucket(t)).wait()
    assert got.data_ptr() == t.data_ptr() and torch.equal(t, torch.arange(8.0) / 4)

    out_json = tmp_path / "r.json"
    variants = ["torch-gloo", "compute-only", "ddp-no-comm", "ddp-one-pass"]
    proc = subprocess.run(
        [sys.executable, str(path), "--width", "64", "--depth", "1", "--inputs", "32",
         "--rounds", "1", "--steps", "2", "--warmup", "1", "--pin", "--variants",
         ",".join(variants), "--json", str(out_json), "--plot", str(tmp_path / "r.png")],
        env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out_json.read_text())
    assert [r["variant"] for r in data["rows"]] == variants
    allowed = sorted(os.sched_getaffinity(0))
    assert data["meta"]["args"]["pin"] is True
    assert data["meta"]["rank_cpus"] == [[allowed[r % len(allowed)]] for r in range(2)]
