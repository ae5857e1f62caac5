"""all_reduce(wire_dtype=torch.int8 / float8_e4m3fn / float8_e5m2): the
block-scaled kernels against a reference written here in torch (float8
codes by torch's own conversion, and bounds against float64), the quantized
all-reduce bitwise equal to the same algorithm in Python on 1-4 ranks (4 in the slow run) and
every CPU transport, every rank identical, error feedback's telescoping,
and the errors of bad calls."""

from __future__ import annotations

import math
import pytest
import torch

from pycomm._ext import _C
from tests._dist import run_ranks, spawn_ranks
from tests.reference import SWEEP_WORLDS, digest
from tests.test_algorithms import all_reduce_error

BLOCK = 256
SIZES = [0, 1, BLOCK - 1, BLOCK, 1031, 70001]  # 1031, 70001: primes
# format -> (torch dtype of the codes, largest code value M)
FORMATS = {"int8": (torch.int8, 127.0), "float8_e4m3fn": (torch.float8_e4m3fn, 448.0),
           "float8_e5m2": (torch.float8_e5m2, 57344.0)}
# The format's half step below its smallest normal, relative to the value
# above it: (half ulp of a normal code / |code|, half of the subnormal step).
HALF_STEP = {"float8_e4m3fn": (2.0 ** -4, 2.0 ** -10), "float8_e5m2": (2.0 ** -3, 2.0 ** -17)}


def _div(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """a / b as a float32 division element by element (torch's scalar /
    tensor multiplies by the reciprocal, which rounds differently)."""
    b = b if isinstance(b, torch.Tensor) else torch.full_like(a, b)
    return a.div(b)


def ref_quantize(x: torch.Tensor, block: int,
                 fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, code bytes as uint8) of float32 ``x``, written independently of
    csrc/core/quant.cc from its contract: to_code = M / absmax, scale =
    absmax / M, y = x * to_code; int8: code = round-half-even(y) clamped to
    +-127; float8: code = torch's conversion of y clamped to +-M. A block
    with a NaN or an infinity: scale NaN, codes 0; an all-zero block, or one
    so small that M / absmax is inf: scale 0, to_code 0."""
    dtype, m = FORMATS[fmt]
    n = x.numel()
    nb = math.ceil(n / block)
    pad = torch.zeros(nb * block, dtype=torch.float32)
    pad[:n] = x
    blocks = pad.view(nb, block)
    absmax = blocks.abs().amax(1) if nb else torch.zeros(0)
    bad = ~torch.isfinite(blocks).all(1) if nb else torch.zeros(0, dtype=torch.bool)
    to_code = _div(torch.full_like(absmax, m), absmax)
    zero = torch.isinf(to_code)
    to_code[zero] = 0
    scale = torch.where(zero, torch.zeros_like(absmax), _div(absmax, m))
    y = blocks * to_code[:, None]
    if dtype == torch.int8:
        codes = torch.round(y).clamp(-127, 127).to(torch.int8)
    else:
        codes = y.clamp(-m, m).to(dtype)
    codes = codes.view(torch.uint8)
    codes[bad] = 0
    scale[bad] = float("nan")
    return scale, codes.reshape(-1)[:n]


def ref_values(scale: torch.Tensor, codes: torch.Tensor, block: int,
               fmt: str = "int8") -> torch.Tensor:
    """scale * decode(code), element by element."""
    n = codes.numel()
    per = scale.repeat_interleave(block)[:n] if n else torch.zeros(0)
    return per * codes.view(FORMATS[fmt][0]).to(torch.float32)


def split(q: torch.Tensor, n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    nb = math.ceil(n / block)
    return q[:4 * nb].view(torch.float32), q[4 * nb:]


def _x(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * scale


def _bound(fmt: str, x: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """The largest |x - value| the format allows, in float64 (float32
    rounding of the scaling aside: 1e-5 relative)."""
    per = scale.double().repeat_interleave(block)[:x.numel()]
    if fmt == "int8":
        return per * (0.5 + 1e-5)
    rel, sub = HALF_STEP[fmt]
    return torch.maximum(x.double().abs() * rel, per * sub) * (1 + 1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", SIZES)
def test_quantize_matches_the_reference_and_its_bound(fmt, n):
    x = _x(n, n) * torch.logspace(-3, 3, max(n, 1))[:n]  # blocks of very different magnitudes
    err = torch.empty(n)
    q = _C.quantize(x, BLOCK, err, format=fmt)
    assert q.numel() == 4 * math.ceil(n / BLOCK) + n
    scale, codes = split(q, n, BLOCK)
    want_scale, want_codes = ref_quantize(x, BLOCK, fmt)
    assert torch.equal(scale, want_scale) and torch.equal(codes, want_codes)
    back = torch.empty(n)
    _C.dequantize(back, q, BLOCK, format=fmt)
    assert torch.equal(back, ref_values(scale, codes, BLOCK, fmt))
    assert torch.equal(err, x - back)
    assert torch.all((x.double() - back.double()).abs() <= _bound(fmt, x, scale, BLOCK) + 1e-30)
    acc = torch.ones(n)
    _C.dequantize(acc, q, BLOCK, add=True, format=fmt)
    assert torch.equal(acc, torch.ones(n) + back)


def _every_float8(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a float8 format, and every midpoint between two
    neighbours (the ties), as float32."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    v = torch.unique(v[torch.isfinite(v)])  # sorted
    return torch.cat([v, (v[1:] + v[:-1]) / 2])  # midpoints are exact in float32


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_codes_are_torchs_conversion(fmt):
    """A block whose largest magnitude is M has scale 1 and to_code 1: its
    codes are the conversion of the values themselves, compared with torch's
    x.to(float8) (the ties, the subnormals, random values of every
    magnitude)."""
    dtype, m = FORMATS[fmt]
    g = torch.Generator().manual_seed(3)
    r = torch.randn(20000, generator=g) * torch.logspace(-12, 0, 20000) * m / 4
    x = torch.cat([_every_float8(dtype), r]).clamp(-m, m)
    x = torch.cat([torch.tensor([m]), x, x.nextafter(torch.zeros_like(x)), -x])
    q = _C.quantize(x, x.numel(), format=fmt)
    scale, codes = split(q, x.numel(), x.numel())
    assert scale.item() == 1.0
    assert torch.equal(codes, x.to(dtype).view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_tiny_nan_and_inf_blocks(fmt):
    x = torch.zeros(5 * BLOCK)
    x[BLOCK + 5] = float("nan")
    x[2 * BLOCK] = float("inf")
    x[2 * BLOCK + 1] = 3.0
    x[3 * BLOCK] = 1e-37  # M / absmax overflows float32: counts as zero
    x[3 * BLOCK + 1] = -2e-45
    x[4 * BLOCK] = -1e-30  # small but fine
    err = torch.full_like(x, 7.0)
    q = _C.quantize(x, BLOCK, err, format=fmt)
    back = torch.empty_like(x)
    _C.dequantize(back, q, BLOCK, format=fmt)
    assert torch.equal(back[:BLOCK], torch.zeros(BLOCK))  # all-zero block: scale 0, exact
    assert torch.isnan(back[BLOCK:3 * BLOCK]).all()  # a NaN or Inf poisons its block, and only it
    assert torch.equal(err[:3 * BLOCK], torch.zeros(3 * BLOCK))  # no NaN goes into the residual
    assert torch.equal(back[3 * BLOCK:4 * BLOCK], torch.zeros(BLOCK))  # tiny: zero, no NaN
    assert torch.equal(err[3 * BLOCK:4 * BLOCK], x[3 * BLOCK:4 * BLOCK])  # and kept whole
    assert back[4 * BLOCK].item() == pytest.approx(-1e-30, rel=1e-6)
    assert torch.equal(back[4 * BLOCK + 1:], torch.zeros(BLOCK - 1))
    scale, codes = ref_quantize(x, BLOCK, fmt)
    assert torch.equal(split(q, x.numel(), BLOCK)[1], codes)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_top_of_the_range_saturates(fmt):
    """Blocks whose absmax times M / absmax rounds above M (and every other
    absmax tried): the largest element gets the largest code, no code is an
    infinity or a NaN, and its value is absmax within float32 rounding."""
    dtype, m = FORMATS[fmt]
    g = torch.Generator().manual_seed(5)
    mantissa = 0.1 + 0.9 * torch.rand(4000, generator=g)
    absmax = torch.cat([mantissa * 10.0 ** torch.randint(-30, 30, (4000,), generator=g),
                        torch.tensor([1.0, 3.0, 7.0, 448.0, 57344.0, 1e-33, 3e38])])
    over = (absmax * _div(torch.full_like(absmax, m), absmax)) > m
    assert over.any()  # the case this test is about occurs
    blocks = torch.rand(absmax.numel(), 16, generator=g) * 2 - 1
    blocks[:, 3] = 1.0
    blocks[::2, 3] = -1.0
    blocks = (blocks * absmax[:, None]).reshape(-1)
    q = _C.quantize(blocks, 16, format=fmt)
    _, codes = split(q, blocks.numel(), 16)
    top = codes.view(-1, 16)[:, 3]
    assert torch.equal(top.view(dtype).float().abs(), torch.full(top.shape, m))
    assert torch.isfinite(codes.view(dtype).float()).all()
    back = torch.empty_like(blocks)
    _C.dequantize(back, q, 16, format=fmt)
    top_back = back.view(-1, 16)[:, 3].double()
    want = blocks.view(-1, 16)[:, 3].double()
    assert torch.all((top_back - want).abs() <= want.abs() * 2 ** -22)


def _reference_all_reduce(inputs: list[torch.Tensor], op: str, block: int,
                          fmt: str = "int8") -> torch.Tensor:
    """The algorithm in Python: each rank's contribution quantized once, the
    float32 sum in rank order, AVG scaled by the core's own scale_, the sum
    quantized once. Chunk boundaries are block boundaries, so quantizing the
    whole tensor in blocks is quantizing every chunk."""
    vals = [ref_values(*ref_quantize(x, block, fmt), block, fmt) for x in inputs]
    total = vals[0].clone()
    for v in vals[1:]:
        total += v
    if op == "avg":
        _C.scale_(total, 1.0 / len(inputs))
    return ref_values(*ref_quantize(total, block, fmt), block, fmt)


# How far the quantized sum may be from the float64 one, in units of the
# largest |sum| (a few quantization steps of one rank each).
STEP = {"int8": 1 / 127, "float8_e4m3fn": 2.0 ** -3, "float8_e5m2": 2.0 ** -2}


def _quantized_cases(comm):
    out = []
    for fmt, (dtype, _) in FORMATS.items():
        for block in (BLOCK, 7):
            for n in SIZES:
                for op in ("sum", "avg"):
                    inputs = [_x(n, 100 * q + n) for q in range(comm.world_size)]
                    t = inputs[comm.rank].clone()
                    comm.all_reduce(t, op=op, wire_dtype=dtype, wire_block=block)
                    want = _reference_all_reduce(inputs, op, block, fmt)
                    assert torch.equal(t, want), f"{fmt} all_reduce {op} n={n} block={block}"
                    exact = torch.stack(inputs).double().sum(0)
                    exact /= comm.world_size if op == "avg" else 1
                    if n:  # within a few quantization steps of the float64 value
                        scale = exact.abs().max() * STEP[fmt] * (comm.world_size + 1)
                        assert (t.double() - exact).abs().max() <= scale
                    out.append(digest(t))
    return out


@pytest.mark.parametrize("world_size", SWEEP_WORLDS)
def test_quantized_all_reduce_equals_its_reference_on_every_rank(transport, world_size):
    per_rank = run_ranks(_quantized_cases, world_size, transport)
    for r in range(1, world_size):
        assert per_rank[r] == per_rank[0], f"rank {r} differs from rank 0"


def _sixteen_bit_cases(comm, dtype):
    """A 16-bit tensor over the quantized wire: the float32 algorithm on its
    widened values (the same reference, bitwise), rounded to its dtype; the
    residual (float32) is what the widened contribution lost."""
    out = []
    for fmt, (wire, _) in FORMATS.items():
        for n in (0, 1, BLOCK - 1, 1009):
            inputs = [_x(n, 100 * q + n).to(dtype) for q in range(comm.world_size)]
            for op in ("sum", "avg"):
                t = inputs[comm.rank].clone()
                residual = torch.zeros(n)
                comm.all_reduce(t, op=op, wire_dtype=wire, residual=residual)
                assert t.dtype == dtype
                want = _reference_all_reduce([x.float() for x in inputs], op, BLOCK, fmt)
                assert torch.equal(t, want.to(dtype)), f"{fmt} {dtype} all_reduce {op} n={n}"
                mine = inputs[comm.rank].float()
                sent = ref_values(*ref_quantize(mine, BLOCK, fmt), BLOCK, fmt)
                assert torch.equal(residual, mine - sent), f"{fmt} {dtype} residual n={n}"
                out.append(digest(t))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world_size", [1, 3])
def test_sixteen_bit_tensors_are_reduced_in_float32(transport, world_size, dtype):
    per_rank = run_ranks(_sixteen_bit_cases, world_size, transport, dtype)
    for r in range(1, world_size):
        assert per_rank[r] == per_rank[0], f"rank {r} differs from rank 0"


def _error_feedback(comm, steps):
    n, r = 5000, comm.rank
    for fmt, (dtype, _) in FORMATS.items():
        residual = torch.zeros(n)
        sent, given = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        for k in range(steps):
            x = _x(n, 1000 * k + r)
            before = residual.clone()
            t = x.clone()
            comm.all_reduce(t, wire_dtype=dtype, residual=residual)
            # this rank's contribution was quantize(x + residual): its values are
            # x + before - residual, and they are what the reference quantizes
            contribution = ref_values(*ref_quantize(x + before, BLOCK, fmt), BLOCK, fmt)
            assert torch.equal(contribution, (x + before) - residual), fmt
            sent += contribution.double()
            given += x.double()
        # telescoping: the sum of what was sent is the sum of the inputs less the
        # last residual (float32 rounding of each step aside)
        assert torch.allclose(sent, given - residual.double(), atol=1e-4), fmt
        assert residual.abs().max() > 0, fmt  # something was lost, and kept
    return digest(residual)


@pytest.mark.parametrize("world_size", [1, 2])
def test_error_feedback_telescopes(world_size):
    run_ranks(_error_feedback, world_size, "shm", 6)


def _usage_errors(comm, wire):
    f = torch.ones(8)
    errs = {}
    for name, call in [
        ("int tensor", lambda: comm.all_reduce(torch.ones(8, dtype=torch.int32), wire_dtype=wire)),
        ("max", lambda: comm.all_reduce(f, op="max", wire_dtype=wire)),
        ("product", lambda: comm.all_reduce(f, op="product", wire_dtype=wire)),
        ("ring", lambda: comm.all_reduce(f, algo="ring", wire_dtype=wire)),
        ("block", lambda: comm.all_reduce(f, wire_dtype=wire, wire_block=0)),
        ("residual dtype", lambda: comm.all_reduce(f, wire_dtype=wire,
                                                   residual=torch.zeros(8, dtype=torch.float64))),
        ("residual size", lambda: comm.all_reduce(f, wire_dtype=wire, residual=torch.zeros(9))),
        ("residual overlap", lambda: comm.all_reduce(f, wire_dtype=wire, residual=f)),
        ("residual alone", lambda: comm.all_reduce(f, residual=torch.zeros(8))),
        ("int4", lambda: comm.all_reduce(f, wire_dtype=torch.int16)),
        ("fp8 name", lambda: comm.all_reduce(f, wire_dtype="fp8_e4m2")),
    ]:
        try:
            call()
            errs[name] = None
        except (ValueError, TypeError) as e:
            errs[name] = str(e)
    t = torch.ones(8)
    comm.all_reduce(t, wire_dtype=wire)  # still usable
    errs["after"] = t.tolist()
    return errs


@pytest.mark.parametrize("wire,name", [(torch.int8, "int8"), ("fp8_e4m3", "float8_e4m3fn"),
                                       ("float8_e5m2", "float8_e5m2")])
def test_bad_calls_name_the_problem(wire, name):
    got = run_ranks(_usage_errors, 2, "shm", wire)[0]
    assert f"float32 and sent as {name}), got int32" in got["int tensor"]
    assert f"wire_dtype=torch.{name} needs op SUM or AVG, got max" in got["max"]
    assert "a quantized wire cannot carry it" in got["product"]
    assert "pass algo='auto', not 'ring'" in got["ring"]
    assert "wire_block must be in [1, 1048576]" in got["block"]
    assert "residual must be a contiguous float32 tensor on tensor's cpu, got" in got["residual dtype"]
    assert "residual must have tensor's 8 elements, got 9" in got["residual size"]
    assert "must not share memory" in got["residual overlap"]
    assert "residual (error feedback) needs a quantized wire_dtype" in got["residual alone"]
    assert "torch.float8_e4m3fn or torch.float8_e5m2" in got["int4"]
    assert "'fp8_e4m2'" in got["fp8 name"]
    assert got["after"] == [2.0] * 8


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("kwargs,fragment", [
    (({"wire_dtype": torch.int8}, {"wire_dtype": torch.int8, "wire_block": 128}), "wire_block differs"),
    (({"wire_dtype": torch.int8}, {}), "algo differs"),
    (({"wire_dtype": torch.float8_e4m3fn}, {"wire_dtype": torch.float8_e4m3fn, "wire_block": 64}),
     "wire_block differs"),
    # whichever rank notices names both, in its own order
    (({"wire_dtype": torch.int8}, {"wire_dtype": torch.float8_e4m3fn}),
     ("wire_dtype differs (", "int8 on rank 0", "float8_e4m3fn on rank 1")),
    (({"wire_dtype": "fp8_e4m3"}, {"wire_dtype": "fp8_e5m2"}),
     ("wire_dtype differs (", "float8_e4m3fn on rank 0", "float8_e5m2 on rank 1")),
])
def test_a_different_wire_across_ranks_raises_everywhere(transport, kwargs, fragment):
    errs = spawn_ranks(all_reduce_error, 2, transport, kwargs, timeout=120)
    assert all(isinstance(e, str) and e.startswith("CommError") for e in errs), errs
    parts = (fragment,) if isinstance(fragment, str) else fragment
    assert any(all(p in e for p in parts) for e in errs), errs
