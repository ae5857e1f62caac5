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
