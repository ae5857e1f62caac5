"""The shared arithmetic of csrc/core/elementwise.h, tested on CPU.

The CUDA kernels instantiate the same functors (csrc/cuda/reduce_kernels.cu),
so these tests pin what the GPU computes too; tests/test_gpu.py then checks
the GPU results bitwise against these CPU ones.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from pycomm._ext import _C

OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3, "product": 4}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int32, torch.int64, torch.uint8, torch.int8]
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def _f32_of_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


# ---------------------------------------------------------------- conversions

ALL16 = torch.arange(65536, dtype=torch.int32)


def _same_float(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return struct.pack("<f", a) == struct.pack("<f", b)  # distinguishes -0.0


def test_half_to_float_all_patterns():
    ref = ALL16.to(torch.int16).view(torch.float16).float().tolist()
    bad = [h for h in range(65536) if not _same_float(_C.half_to_float(h), ref[h])]
    assert not bad, f"{len(bad)} mismatches, first {[hex(h) for h in bad[:8]]}"


def test_bf16_to_float_all_patterns():
    ref = ALL16.to(torch.int16).view(torch.bfloat16).float().tolist()
    bad = [h for h in range(65536) if not _same_float(_C.bf16_to_float(h), ref[h])]
    assert not bad, f"{len(bad)} mismatches, first {[hex(h) for h in bad[:8]]}"


def test_half_roundtrip_all_patterns():
    # every non-NaN half survives half -> float -> half exactly
    for h in range(65536):
        if (h & 0x7FFF) > 0x7C00:
            continue
        assert _C.float_to_half(_C.half_to_float(h)) == h, hex(h)


def _edge_floats() -> torch.Tensor:
    """Floats around every rounding boundary that matters for fp16 and bf16."""
    vals = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"),
            65504.0, 65519.996, 65520.0, 65536.0, 1e30, -1e30,
            2.0 ** -14, 2.0 ** -24, 2.0 ** -25, 2.0 ** -26, 3 * 2.0 ** -26, 2.0 ** -149,
            1.1754942e-38, 3.4028235e38, -3.4028235e38]
    bits = set()
    for v in vals:
        bits.add(struct.unpack("<I", struct.pack("<f", v))[0])
    # every half boundary: the midpoints between consecutive halves (ties) and
    # one ulp either side, for all finite halves
    halves = ALL16.to(torch.int16).view(torch.float16)
    finite = halves[torch.isfinite(halves)].double()
    srt = torch.unique(finite)
    mids = ((srt[1:] + srt[:-1]) / 2).float()
    for m in (mids,):
        mb = m.view(torch.int32)
        for d in (-1, 0, 1):
            bits.update((mb + d).tolist())
    # bf16 ties: low 16 bits exactly 0x8000, +-1, for a spread of exponents
    hi = torch.arange(0, 65536, 37, dtype=torch.int64) << 16
    for low in (0x7FFF, 0x8000, 0x8001, 0x0000, 0xFFFF):
        bits.update((hi | low).tolist())
    b = torch.tensor(sorted(x & 0xFFFFFFFF for x in bits), dtype=torch.int64)
    return b.to(torch.int32)  # wraps to the signed view of the same bits


def _random_float_bits(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2 ** 31), 2 ** 31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("target", [torch.float16, torch.bfloat16])
def test_float_to_16_rne_matches_torch(target):
    conv = _C.float_to_half if target == torch.float16 else _C.float_to_bf16
    bits = torch.cat([_edge_floats(), _random_float_bits(200_000)])
    f = bits.view(torch.float32)
    ref = _bits16(f.to(target)).tolist()
    vals = f.tolist()
    bad = []
    for i, v in enumerate(vals):
        got = conv(v)
        if math.isnan(v):
            # NaN stays NaN with its sign (payload encoding may differ from torch)
            exp_mask, man_mask = (0x7C00, 0x3FF) if target == torch.float16 else (0x7F80, 0x7F)
            ok = (got & exp_mask) == exp_mask and (got & man_mask) != 0 and \
                (got >> 15) == (bits[i].item() >> 31 & 1)
        else:
            ok = got == ref[i]
        if not ok:
            bad.append((hex(bits[i].item() & 0xFFFFFFFF), hex(got), hex(ref[i])))
    assert not bad, f"{len(bad)} mismatches (bits, ours, torch), first {bad[:8]}"


def test_float_to_half_nan_encoding():
    # the documented software encoding that the GPU fast path must reproduce
    assert _C.float_to_half(float("nan")) & 0x7E00 == 0x7E00
    neg_nan = struct.unpack("<f", struct.pack("<I", 0xFFC00001))[0]
    assert _C.float_to_half(neg_nan) == 0xFE00
    assert _C.float_to_bf16(neg_nan) == 0xFFC0


# ---------------------------------------------------------------- reduce_ / scale_

def _inputs(dtype: torch.dtype, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype in FLOATS:
        a = (torch.randn(n, generator=g, dtype=torch.float64) * 4)
        b = (torch.randn(n, generator=g, dtype=torch.float64) * 4)
        return a.to(dtype), b.to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    a = torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)
    b = torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)
    return a, b


def _reference(op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dt = a.dtype
    if dt in (torch.float16, torch.bfloat16):
        x, y = a.float(), b.float()  # accumulate in fp32, round once
    else:
        x, y = a, b
    if op in ("sum", "avg"):
        r = x + y
    elif op == "product":
        r = x * y
    elif op == "max":
        r = torch.maximum(x, y)
    else:
        r = torch.minimum(x, y)
    return r.to(dt)


def _assert_bitwise(got: torch.Tensor, ref: torch.Tensor) -> None:
    if got.dtype.is_floating_point:
        gnan, rnan = torch.isnan(got), torch.isnan(ref)
        assert torch.equal(gnan, rnan), "NaN positions differ"
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
        g, r = got[~gnan].view(width), ref[~rnan].view(width)
        bad = (g != r).nonzero().flatten()
        assert bad.numel() == 0, f"{bad.numel()} bit mismatches, first at {bad[:5].tolist()}: " \
            f"{got[~gnan][bad[:5]].tolist()} vs {ref[~rnan][bad[:5]].tolist()}"
    else:
        assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("n", [0, 1, 7, 1031, 100_003])
def test_reduce_matches_torch(op, dtype, n):
    if op == "avg" and dtype not in FLOATS:
        pytest.skip("AVG needs a floating dtype (rejected by the communicator)")
    a, b = _inputs(dtype, n, seed=n + 17)
    if op == "product" and dtype in FLOATS:
        a, b = (a.double() / 4 + 1).to(dtype), (b.double() / 4 + 1).to(dtype)
    ref = _reference(op, a, b)
    dst = a.clone()
    _C.reduce_(dst, b, OPS[op])
    _assert_bitwise(dst, ref)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32], ids=str)
def test_integer_sum_and_product_wrap(dtype):
    info = torch.iinfo(dtype)
    a = torch.tensor([info.max, info.min, info.max, 3], dtype=dtype)
    b = torch.tensor([1, info.max if info.min == 0 else -1, info.max, info.max], dtype=dtype)
    for op in ("sum", "product"):
        dst = a.clone()
        _C.reduce_(dst, b, OPS[op])
        x, y = a.to(torch.int64), b.to(torch.int64)
        r = x + y if op == "sum" else x * y
        # two's-complement wrap to the storage width
        bits = 8 * a.element_size()
        r = r & ((1 << bits) - 1)
        if info.min < 0:
            r = torch.where(r >= (1 << (bits - 1)), r - (1 << bits), r)
        assert dst.tolist() == r.tolist(), (op, dst.tolist(), r.tolist())


@pytest.mark.parametrize("dtype", sorted(FLOATS, key=str), ids=str)
@pytest.mark.parametrize("op", ["max", "min"])
def test_max_min_propagate_nan(op, dtype):
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([nan, 1.0, nan, -inf, 2.0, -0.0, 0.0], dtype=dtype)
    b = torch.tensor([1.0, nan, nan, nan, 3.0, 0.0, -0.0], dtype=dtype)
    dst = a.clone()
    _C.reduce_(dst, b, OPS[op])
    ref = (torch.maximum if op == "max" else torch.minimum)(a.float(), b.float())
    got = dst.float()
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.isnan(got[:4]).all()
    assert got[4].item() == (3.0 if op == "max" else 2.0)
    # NaN in either operand wins, like torch.maximum / torch.minimum
    assert torch.equal(got[~torch.isnan(got)][:1], ref[~torch.isnan(ref)][:1])


@pytest.mark.parametrize("dtype", sorted(FLOATS, key=str), ids=str)
@pytest.mark.parametrize("factor", [0.5, 1 / 3, 0.25, 1 / 7])
def test_scale_matches_accumulation_type(dtype, factor):
    a, _ = _inputs(dtype, 4099, seed=5)
    dst = a.clone()
    _C.scale_(dst, factor)
    if dtype == torch.float64:
        ref = a * factor
    else:
        ref = (a.float() * torch.tensor(factor, dtype=torch.float32)).to(dtype)
    _assert_bitwise(dst, ref)


@pytest.mark.parametrize("dtype", sorted(FLOATS, key=str), ids=str)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
@pytest.mark.parametrize("n", [1, 4099, 100003])
def test_fused_reduce_scale_equals_reduce_then_scale(dtype, op, n):
    """AVG's last step runs reduce + scale fused (element by element for
    float32/float64 with AVX2, else in 16 KiB blocks: one pass over memory):
    bitwise what reduce_ then scale_ give, NaNs included, across the block
    edges and the SIMD tails."""
    a, b = _inputs(dtype, n, seed=11)
    two_pass = a.clone()
    _C.reduce_(two_pass, b, OPS[op])
    _C.scale_(two_pass, 1 / 3)
    fused = a.clone()
    _C.reduce_scale_(fused, b, OPS[op], 1 / 3)
    assert torch.equal(fused.view(torch.uint8), two_pass.view(torch.uint8))


@pytest.mark.parametrize("dtype", sorted(FLOATS, key=str) + [torch.int32, torch.int64, torch.int8],
                         ids=str)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "product"])
@pytest.mark.parametrize("n", [1, 4099, 100003])
def test_reduce_to_all_equals_reduce_then_copies(dtype, op, n):
    """The symmetric all-reduce's last step writes the result to every rank's
    copy at once (two outputs: one fused pass for 32/64-bit types, each
    vector stored to both; else blocks): bitwise what reduce_ (reduce_scale_
    for AVG) then copies give. Outputs: the inputs themselves (2 ranks),
    swapped, three with the last one b and a apart (3 ranks: a holds the
    partial result), or 1 to 3 apart, which leave a and b unchanged; at an
    odd element offset too (unaligned vectors)."""
    if op == "avg" and dtype not in FLOATS:
        pytest.skip("AVG needs a floating dtype")
    a, b = _inputs(dtype, n + 1, seed=13)
    if dtype in FLOATS:
        a[:3], b[1:4] = float("nan"), float("inf")
    ref = a.clone()
    if op == "avg":
        _C.reduce_scale_(ref, b, OPS[op], 1 / 3)
    else:
        _C.reduce_(ref, b, OPS[op])
    for offset in (0, 1):
        want = ref[offset:offset + n]
        for pattern in ("inputs", "swapped", "last is b", "apart1", "apart2", "apart3"):
            x, y = a.clone()[offset:offset + n], b.clone()[offset:offset + n]
            outs = {"inputs": [x, y], "swapped": [y, x],
                    "last is b": [torch.empty_like(x), torch.empty_like(x), y]}.get(pattern)
            if outs is None:
                outs = [torch.empty_like(x) for _ in range(int(pattern[-1]))]
            _C.reduce_to_all_(outs, x, y, OPS[op], 1 / 3)
            for k, out in enumerate(outs):
                assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), (pattern, k)
            if pattern.startswith("apart"):
                assert torch.equal(x.view(torch.uint8), a[offset:offset + n].view(torch.uint8))
                assert torch.equal(y.view(torch.uint8), b[offset:offset + n].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8], ids=str)
def test_scale_rejects_integers(dtype):
    with pytest.raises(ValueError):
        _C.scale_(torch.zeros(4, dtype=dtype), 0.5)
