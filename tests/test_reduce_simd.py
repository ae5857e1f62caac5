"""The vectorised CPU reductions (csrc/core/reduce.cc: AVX2/F16C paths chosen
at run time) equal the scalar functors of elementwise.h bit for bit, for every
fp16 / bf16 bit pattern (NaN, inf, subnormals included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pycomm._ext import _C

OPS = {"sum": 0, "product": 4, "max": 2, "min": 3}


def _scalar_ref(a_bits, b_bits, op, to_f, from_f):
    out = []
    for x, y in zip(a_bits, b_bits):
        fx, fy = np.float32(to_f(x)), np.float32(to_f(y))
        if op == "sum":
            r = fx + fy
        elif op == "product":
            r = fx * fy
        elif op == "max":
            r = fx if (fx != fx or fx > fy) else fy
        else:
            r = fx if (fx != fx or fx < fy) else fy
        out.append(from_f(float(np.float32(r))))
    return out


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_reduce_matches_scalar_functors_for_all_patterns(dtype, op):
    to_f, from_f = ((_C.half_to_float, _C.float_to_half) if dtype == torch.float16
                    else (_C.bf16_to_float, _C.float_to_bf16))
    g = torch.Generator().manual_seed(1)
    a = torch.arange(65536, dtype=torch.int32)
    b = a[torch.randperm(65536, generator=g)]
    dst = a.to(torch.int16).view(dtype).clone()
    # odd length and offset: exercise the vector body and the scalar tail
    _C.reduce_(dst[1:], b.to(torch.int16).view(dtype)[1:].clone(), OPS[op])
    got = (dst.view(torch.int16).to(torch.int32) & 0xFFFF).tolist()[1:]
    with np.errstate(all="ignore"):
        ref = _scalar_ref(a.tolist()[1:], b.tolist()[1:], op, to_f, from_f)
    bad = [i for i, (x, y) in enumerate(zip(got, ref)) if x != y]
    assert not bad, f"{len(bad)} mismatches, first at {bad[:5]}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_scale_matches_scalar(dtype):
    to_f, from_f = ((_C.half_to_float, _C.float_to_half) if dtype == torch.float16
                    else (_C.bf16_to_float, _C.float_to_bf16))
    a = torch.arange(65536, dtype=torch.int32)
    t = a.to(torch.int16).view(dtype).clone()
    _C.scale_(t, 1.0 / 3)
    got = (t.view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
    f = np.float32(1.0 / 3)
    with np.errstate(all="ignore"):
        ref = [from_f(float(np.float32(np.float32(to_f(x)) * f))) for x in a.tolist()]
    assert got == ref


# ---------------------------------------------------------------- PYCOMM_CPU_SIMD=scalar
#
# The same computations in two fresh processes, one with PYCOMM_CPU_SIMD=scalar
# (the portable loops of reduce.cc, which never run by default on an AVX2
# machine) and one with the default (AVX2/F16C where the CPU has them).
#
# Bitwise equal: every result of MAX and MIN (they select an operand, NaN
# included), every scale, every conversion to and from the wire dtype, and
# every SUM/PRODUCT element that is not a NaN: the vector paths are the
# scalar functors of elementwise.h lane by lane (the same IEEE single/double
# operations, the same round-to-nearest-even conversions, NaN lanes
# re-encoded by the scalar codec).
# May differ: which NaN a SUM or PRODUCT of two NaNs returns (its sign, and in
# bf16 its payload). IEEE 754 leaves it open; x86 returns the first operand,
# and the compiler may swap the operands of a commutative add or multiply in
# one loop and not in the other (seen: NaN(+) + NaN(-) gives +NaN on the scalar
# path and -NaN on the AVX2 path). The GPU tests accept the same (test_gpu.py
# _bitwise_equal).

WIRE_COUNT = 1031  # odd: vector bodies and scalar tails; 2 chunks of 2 ranks


def _kernel_results() -> dict[str, torch.Tensor]:
    out = {}
    g = torch.Generator().manual_seed(5)
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    perm = bits[torch.randperm(65536, generator=g)]
    for dtype in (torch.float16, torch.bfloat16):
        for op, code in OPS.items():
            dst = bits.view(dtype).clone()
            _C.reduce_(dst[1:], perm.view(dtype)[1:].clone(), code)
            out[f"reduce {dtype} {op}"] = dst
        t = bits.view(dtype).clone()
        _C.scale_(t[3:], 1.0 / 3)
        out[f"scale {dtype}"] = t
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-310, 1e-40])
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8):
        if dtype.is_floating_point:
            a = torch.randn(4099, generator=g, dtype=torch.float64).to(dtype)
            b = torch.randn(4099, generator=g, dtype=torch.float64).to(dtype)
            a[:7], b[2:9] = specials.to(dtype), specials.to(dtype)
        else:
            a = torch.randint(0, 100, (4099,), generator=g).to(dtype)
            b = torch.randint(0, 100, (4099,), generator=g).to(dtype)
        for op, code in OPS.items():
            dst = a.clone()
            _C.reduce_(dst[1:], b[1:].clone(), code)
            out[f"reduce {dtype} {op}"] = dst
        if dtype.itemsize >= 4:  # the fused two-output loop, AVG's scale included
            for op, code in {**OPS, "avg": 1}.items():
                if op == "avg" and not dtype.is_floating_point:
                    continue
                x, y = a.clone(), b.clone()  # odd offset: unaligned vectors
                _C.reduce_to_all_([x[1:], y[1:]], x[1:], y[1:], code, 1 / 3)
                out[f"reduce_to_all {dtype} {op}"] = torch.cat([x, y])
        if dtype.is_floating_point:
            t = a.clone()
            _C.scale_(t, 1.0 / 3)
            out[f"scale {dtype}"] = t
    # the quantized wire (quant.cc), every format: blocks of 256
    # and of 13 (vector bodies and tails), a NaN block and an inf block, -0.0
    # (its error is x - value: -0.0 - +0.0 = -0.0), the error and
    # dequantize(add)
    x = torch.randn(4099, generator=g) * torch.logspace(-4, 4, 4099)
    x[300], x[700] = float("nan"), float("inf")
    x[1000:1020] = -0.0
    for fmt in ("int8", "float8_e4m3fn", "float8_e5m2"):
        for block in (256, 13):
            err = torch.empty_like(x)
            q = _C.quantize(x, block, err, format=fmt)
            back = torch.full_like(x, 0.5)
            _C.dequantize(back, q, block, add=True, format=fmt)
            out[f"quantize {fmt} {block}"] = q
            out[f"quantize {fmt} err {block}"] = err
            out[f"dequantize {fmt} {block}"] = back
        # one block over 12 decades: float8's subnormal codes
        wide = torch.randn(4099, generator=g) * torch.logspace(-12, 0, 4099)
        err = torch.empty_like(wide)
        out[f"quantize {fmt} wide"] = _C.quantize(wide, wide.numel(), err, format=fmt)
        out[f"quantize {fmt} wide err"] = err
    # every float8 code decoded (the vector path computes what the portable
    # one looks up; NaN and infinity codes included), one block of 263
    # codes: 32 vectors of 8 and a tail
    codes = torch.arange(263, dtype=torch.int32).remainder(256).to(torch.uint8)
    for fmt in ("float8_e4m3fn", "float8_e5m2"):
        q = torch.cat([torch.tensor([0.37]).view(torch.uint8), codes])
        back = torch.empty(263)
        _C.dequantize(back, q, 263, format=fmt)
        out[f"dequantize {fmt} every code"] = back
    return out


def _wire_rank(rank: int, world_size: int, port: int) -> dict[str, np.ndarray]:
    import pycomm
    from tests._dist import client_store

    comm = pycomm.init(rank=rank, world_size=world_size, store=client_store(port, world_size),
                       transport="shm", set_default=False)
    out = {}
    try:
        for wire in (torch.float16, torch.bfloat16):
            for op in ("sum", "avg", "max"):
                g = torch.Generator().manual_seed(rank)
                t = torch.randn(WIRE_COUNT, generator=g) * 100
                t[rank] = float("nan") if op == "max" else t[rank]
                comm.all_reduce(t, op=op, algo="ring", wire_dtype=wire)
                # numpy: pickled by value (a tensor would travel as a shared fd)
                out[f"wire all_reduce {wire} {op} rank {rank}"] = t.numpy()
    finally:
        comm.close()
    return out


def _simd_results(path: str) -> None:
    """Runs in a fresh process (see test_scalar_path_equals_the_vector_path)."""
    from tests._dist import spawn_ranks

    results = _kernel_results()
    for per_rank in spawn_ranks(_wire_rank, 2):
        results.update({k: torch.from_numpy(v) for k, v in per_rank.items()})
    torch.save(results, path)


def _results_with(simd: str, path) -> dict[str, torch.Tensor]:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYCOMM_CPU_SIMD=simd,
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    code = "import sys; from tests.test_reduce_simd import _simd_results; _simd_results(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"PYCOMM_CPU_SIMD={simd}: exit {proc.returncode}\n{proc.stderr}"
    return torch.load(path)


def _bits(t: torch.Tensor) -> torch.Tensor:
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


def _same(key: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal; for SUM/PRODUCT (and AVG: a sum) a NaN need only be a NaN."""
    if a.dtype.is_floating_point and any(op in key for op in ("sum", "product", "avg")):
        nan = torch.isnan(a)
        return torch.equal(nan, torch.isnan(b)) and torch.equal(_bits(a[~nan]), _bits(b[~nan]))
    return torch.equal(_bits(a), _bits(b))


def test_scalar_path_equals_the_vector_path(tmp_path):
    scalar = _results_with("scalar", tmp_path / "scalar.pt")
    vector = _results_with("auto", tmp_path / "auto.pt")
    # 10 of 16-bit kernels, 26 + 18 (reduce_to_all) of the others, 8 of each
    # quantized wire format (3) and every code of each float8 one (2), 12 wire
    # all-reduce results
    assert scalar.keys() == vector.keys() and len(scalar) == 92
    bad = [k for k in scalar if not _same(k, scalar[k], vector[k])]
    assert not bad, f"scalar and vector paths differ in: {bad}"


def test_bad_simd_setting_is_a_clear_error(tmp_path):
    # A typo must not silently pick a path: the kernels raise ValueError ...
    with pytest.raises(AssertionError, match=r"ValueError: environment variable "
                       r"PYCOMM_CPU_SIMD='avx9000' is not 'auto' or 'scalar'"):
        _results_with("avx9000", tmp_path / "bad.pt")


def test_bad_simd_setting_fails_init(monkeypatch):
    # ... and init refuses it before any rank waits for another.
    import pycomm

    monkeypatch.setenv("PYCOMM_CPU_SIMD", "fast")
    with pytest.raises(ValueError, match=r"PYCOMM_CPU_SIMD='fast' is not 'auto' or 'scalar'"):
        pycomm.init(rank=0, world_size=1, store=None, transport="gloo", set_default=False)
