"""all_reduce(wire_dtype=torch.int8): the block-scaled int8 kernels against
a reference written here in torch (and their bounds against float64), the
quantized all-reduce bitwise equal to the same algorithm in Python on 1-4
ranks and every CPU transport, every rank identical, error feedback's
telescoping, and the errors of bad calls."""

from __future__ import annotations

import math
import pytest
import torch

from pycomm._ext import _C
from tests._dist import run_ranks, spawn_ranks
from tests.reference import digest
from tests.test_algorithms import all_reduce_error

BLOCK = 256
SIZES = [0, 1, BLOCK - 1, BLOCK, 1031, 70001]  # 1031, 70001: primes


def ref_quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, codes) of float32 ``x``, written independently of csrc/core/quant.cc
    from its contract: scale = absmax / 127, code = round-half-even(x * (127 / absmax)),
    a block with a NaN or an infinity: scale NaN, codes 0."""
    n = x.numel()
    nb = math.ceil(n / block)
    pad = torch.zeros(nb * block, dtype=torch.float32)
    pad[:n] = x
    blocks = pad.view(nb, block)
    absmax = blocks.abs().amax(1) if nb else torch.zeros(0)
    bad = ~torch.isfinite(blocks).all(1) if nb else torch.zeros(0, dtype=torch.bool)
    scale = torch.where(absmax > 0, absmax / 127, torch.zeros_like(absmax))
    # 127 / absmax as a true division (torch's scalar / tensor multiplies by
    # the reciprocal, which rounds differently)
    to_code = torch.where(absmax > 0, torch.full_like(absmax, 127).div(absmax),
                          torch.zeros_like(absmax))
    codes = torch.round(blocks * to_code[:, None]).clamp(-127, 127)
    codes[bad] = 0
    scale[bad] = float("nan")
    return scale, codes.reshape(-1)[:n].to(torch.int8)


def ref_values(scale: torch.Tensor, codes: torch.Tensor, block: int) -> torch.Tensor:
    n = codes.numel()
    per = scale.repeat_interleave(block)[:n] if n else torch.zeros(0)
    return per * codes.to(torch.float32)


def split(q: torch.Tensor, n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    nb = math.ceil(n / block)
    return q[:4 * nb].view(torch.float32), q[4 * nb:].view(torch.int8)


def _x(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * scale


@pytest.mark.parametrize("n", SIZES)
def test_quantize_matches_the_reference_and_its_bound(n):
    x = _x(n, n) * torch.logspace(-3, 3, max(n, 1))[:n]  # blocks of very different magnitudes
    err = torch.empty(n)
    q = _C.quantize_int8(x, BLOCK, err)
    assert q.numel() == 4 * math.ceil(n / BLOCK) + n
    scale, codes = split(q, n, BLOCK)
    want_scale, want_codes = ref_quantize(x, BLOCK)
    assert torch.equal(scale, want_scale) and torch.equal(codes, want_codes)
    back = torch.empty(n)
    _C.dequantize_int8(back, q, BLOCK)
    assert torch.equal(back, ref_values(scale, codes, BLOCK))
    assert torch.equal(err, x - back)
    # |x - value| <= scale / 2 (+ float32 rounding), against float64
    bound = scale.double().repeat_interleave(BLOCK)[:n] * (0.5 + 1e-5)
    assert torch.all((x.double() - back.double()).abs() <= bound + 1e-30)
    acc = torch.ones(n)
    _C.dequantize_int8(acc, q, BLOCK, add=True)
    assert torch.equal(acc, torch.ones(n) + back)


def test_zero_nan_and_inf_blocks():
    x = torch.zeros(3 * BLOCK)
    x[BLOCK + 5] = float("nan")
    x[2 * BLOCK] = float("inf")
    x[2 * BLOCK + 1] = 3.0
    err = torch.full_like(x, 7.0)
    q = _C.quantize_int8(x, BLOCK, err)
    back = torch.empty_like(x)
    _C.dequantize_int8(back, q, BLOCK)
    assert torch.equal(back[:BLOCK], torch.zeros(BLOCK))  # all-zero block: scale 0, exact
    assert torch.isnan(back[BLOCK:]).all()  # a NaN or Inf poisons its block, and only it
    assert torch.equal(err, torch.zeros_like(x))  # no NaN goes into the residual


def _reference_all_reduce(inputs: list[torch.Tensor], op: str, block: int) -> torch.Tensor:
    """The algorithm in Python: each rank's contribution quantized once, the
    float32 sum in rank order, AVG scaled by the core's own scale_, the sum
    quantized once. Chunk boundaries are block boundaries, so quantizing the
    whole tensor in blocks is quantizing every chunk."""
    vals = [ref_values(*ref_quantize(x, block), block) for x in inputs]
    total = vals[0].clone()
    for v in vals[1:]:
        total += v
    if op == "avg":
        _C.scale_(total, 1.0 / len(inputs))
    return ref_values(*ref_quantize(total, block), block)


def _quantized_cases(comm):
    out = []
    for block in (BLOCK, 7):
        for n in SIZES:
            for op in ("sum", "avg"):
                inputs = [_x(n, 100 * q + n) for q in range(comm.world_size)]
                t = inputs[comm.rank].clone()
                comm.all_reduce(t, op=op, wire_dtype=torch.int8, wire_block=block)
                want = _reference_all_reduce(inputs, op, block)
                assert torch.equal(t, want), f"int8 all_reduce {op} n={n} block={block}"
                exact = torch.stack(inputs).double().sum(0) / (comm.world_size if op == "avg" else 1)
                if n:  # within a few quantization steps of the float64 value
                    scale = exact.abs().max() / 127 * (comm.world_size + 1)
                    assert (t.double() - exact).abs().max() <= scale
                out.append(digest(t))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_int8_all_reduce_equals_its_reference_on_every_rank(transport, world_size):
    per_rank = run_ranks(_quantized_cases, world_size, transport)
    for r in range(1, world_size):
        assert per_rank[r] == per_rank[0], f"rank {r} differs from rank 0"


def _error_feedback(comm, steps):
    n, r = 5000, comm.rank
    residual = torch.zeros(n)
    sent, given = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for k in range(steps):
        x = _x(n, 1000 * k + r)
        before = residual.clone()
        t = x.clone()
        comm.all_reduce(t, wire_dtype=torch.int8, residual=residual)
        # this rank's contribution was quantize(x + residual): its values are
        # x + before - residual, and they are what the reference quantizes
        contribution = ref_values(*ref_quantize(x + before, BLOCK), BLOCK)
        assert torch.equal(contribution, (x + before) - residual)
        sent += contribution.double()
        given += x.double()
    # telescoping: the sum of what was sent is the sum of the inputs less the
    # last residual (float32 rounding of each step aside)
    assert torch.allclose(sent, given - residual.double(), atol=1e-4)
    return digest(residual)


@pytest.mark.parametrize("world_size", [1, 2])
def test_error_feedback_telescopes(world_size):
    run_ranks(_error_feedback, world_size, "shm", 6)


def _usage_errors(comm):
    f = torch.ones(8)
    errs = {}
    for name, call in [
        ("int tensor", lambda: comm.all_reduce(torch.ones(8, dtype=torch.int32), wire_dtype=torch.int8)),
        ("max", lambda: comm.all_reduce(f, op="max", wire_dtype=torch.int8)),
        ("ring", lambda: comm.all_reduce(f, algo="ring", wire_dtype=torch.int8)),
        ("block", lambda: comm.all_reduce(f, wire_dtype=torch.int8, wire_block=0)),
        ("residual dtype", lambda: comm.all_reduce(f, wire_dtype=torch.int8,
                                                   residual=torch.zeros(8, dtype=torch.float64))),
        ("residual size", lambda: comm.all_reduce(f, wire_dtype=torch.int8, residual=torch.zeros(9))),
        ("residual overlap", lambda: comm.all_reduce(f, wire_dtype=torch.int8, residual=f)),
        ("residual alone", lambda: comm.all_reduce(f, residual=torch.zeros(8))),
        ("int4", lambda: comm.all_reduce(f, wire_dtype=torch.int16)),
    ]:
        try:
            call()
            errs[name] = None
        except (ValueError, TypeError) as e:
            errs[name] = str(e)
    t = torch.ones(8)
    comm.all_reduce(t, wire_dtype=torch.int8)  # still usable
    errs["after"] = t.tolist()
    return errs


def test_bad_calls_name_the_problem():
    got = run_ranks(_usage_errors, 2, "shm")[0]
    assert "needs a float32 tensor" in got["int tensor"]
    assert "needs op SUM or AVG" in got["max"]
    assert "pass algo='auto', not 'ring'" in got["ring"]
    assert "wire_block must be in [1, 1048576]" in got["block"]
    assert "residual must be a contiguous float32 CPU tensor" in got["residual dtype"]
    assert "residual must have tensor's 8 elements, got 9" in got["residual size"]
    assert "must not share memory" in got["residual overlap"]
    assert "residual (error feedback) needs wire_dtype=torch.int8" in got["residual alone"]
    assert "torch.int8" in got["int4"]
    assert got["after"] == [2.0] * 8


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("kwargs,fragment", [
    (({"wire_dtype": torch.int8}, {"wire_dtype": torch.int8, "wire_block": 128}), "wire_block differs"),
    (({"wire_dtype": torch.int8}, {}), "algo differs"),
])
def test_a_different_wire_across_ranks_raises_everywhere(transport, kwargs, fragment):
    errs = spawn_ranks(all_reduce_error, 2, transport, kwargs, timeout=120)
    assert all(isinstance(e, str) and e.startswith("CommError") for e in errs), errs
    assert any(fragment in e for e in errs), errs
