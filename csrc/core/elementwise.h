// Element-wise reduction arithmetic, written once for host and device.
//
// The CPU reductions (reduce.cc) and the CUDA kernels (csrc/cuda/reduce_kernels.cu)
// both instantiate these functors, so the CPU tests pin the arithmetic the GPU
// runs. fp16 and bf16 are stored as raw 16-bit patterns and accumulate in fp32:
// load -> float, combine, round-to-nearest-even back to 16 bits.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "types.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define PYCOMM_HD __host__ __device__ __forceinline__
#else
#define PYCOMM_HD inline
#endif

namespace pycomm {

// 16-bit float storage types (bit patterns, no arithmetic of their own).
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

// The same 32 bits read as another type. memcpy is the defined way in C++17
// (no std::bit_cast yet); on both host and device it compiles to a register move.
template <typename To, typename From>
PYCOMM_HD To same_bits(From v) {
  static_assert(sizeof(To) == sizeof(From), "same_bits needs equal sizes");
  To out;
  memcpy(&out, &v, sizeof(out));
  return out;
}
PYCOMM_HD uint32_t float_bits(float f) { return same_bits<uint32_t>(f); }
PYCOMM_HD float bits_float(uint32_t u) { return same_bits<float>(u); }

// bf16 is the top half of an fp32.
PYCOMM_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

PYCOMM_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
#if defined(__CUDA_ARCH__)
  // Device fast path: cvt.rn.bf16.f32 is IEEE round-to-nearest-even without
  // flush-to-zero, i.e. the software rounding below; only NaN differs (the
  // hardware returns a canonical NaN), so NaN keeps the software encoding.
  if ((u & 0x7fffffffu) <= 0x7f800000u) return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#endif
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // qNaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}

// IEEE binary16 <-> binary32 without hardware support (exact, RNE).
PYCOMM_HD float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
#if defined(__CUDA_ARCH__)
  // Device: cvt.f32.f16 is exact for every non-NaN half (subnormals
  // included), so it equals the software path below; NaN keeps its payload
  // bits exactly as the software path does (the hardware may canonicalise).
  // A select, not a branch: a branch to the software path, inlined for each
  // of the many halves a kernel thread holds, made the fp16 reduction kernel
  // far slower than bf16's (benchmarks/results/gpu/kernel-select-2026-11-27).
  const float hw = __half2float(__ushort_as_half(h));
  const float nan = bits_float(sign | 0x7f800000u | ((h & 0x3ffu) << 13));
  return (h & 0x7fffu) > 0x7c00u ? nan : hw;
#else
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1fu) {
    u = sign | 0x7f800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (mant << 13);  // normal: rebias 15 -> 127
  } else if (mant == 0) {
    u = sign;  // +-0
  } else {
    // subnormal: normalise the mantissa
    uint32_t e = 113u;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    u = sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
  return bits_float(u);
#endif
}

PYCOMM_HD uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
#if defined(__CUDA_ARCH__)
  // Device: cvt.rn.f16.f32 (no .ftz) rounds to nearest even with subnormals
  // and overflow to inf exactly like the software path below; NaN keeps the
  // software encoding (sign | 0x7e00), not the canonical 0x7fff. A select,
  // as in half_to_float.
  const uint16_t hw = __half_as_ushort(__float2half_rn(f));
  return abs > 0x7f800000u ? static_cast<uint16_t>(sign | 0x7e00u) : hw;
#else
  if (abs >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {
    // result is subnormal or zero: shift the (implicit-1) mantissa into place, RNE
    if (abs < 0x33000001u) return static_cast<uint16_t>(sign);  // < half the smallest subnormal
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  // normal: rebias, round mantissa 23 -> 10 bits, ties to even (carry may bump exponent)
  uint32_t r = abs - 0x38000000u;
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
#endif
}

// Storage <-> accumulation type. 16-bit floats accumulate in float.
template <class T>
struct Codec {
  using Acc = T;
  PYCOMM_HD static Acc load(T v) { return v; }
  PYCOMM_HD static T store(Acc v) { return v; }
};
template <>
struct Codec<Half> {
  using Acc = float;
  PYCOMM_HD static float load(Half v) { return half_to_float(v.bits); }
  PYCOMM_HD static Half store(float v) { return Half{float_to_half(v)}; }
};
template <>
struct Codec<BFloat16> {
  using Acc = float;
  PYCOMM_HD static float load(BFloat16 v) { return bf16_to_float(v.bits); }
  PYCOMM_HD static BFloat16 store(float v) { return BFloat16{float_to_bf16(v)}; }
};

// The binary ops. MAX/MIN propagate NaN like torch.maximum/minimum.
struct SumFn {
  template <class A>
  PYCOMM_HD A operator()(A a, A b) const {
    return a + b;
  }
};
struct ProdFn {
  template <class A>
  PYCOMM_HD A operator()(A a, A b) const {
    return a * b;
  }
};
struct MaxFn {
  template <class A>
  PYCOMM_HD A operator()(A a, A b) const {
    return (a != a || a > b) ? a : b;
  }
};
struct MinFn {
  template <class A>
  PYCOMM_HD A operator()(A a, A b) const {
    return (a != a || a < b) ? a : b;
  }
};

// dst = op(dst, src) for one element of storage type T.
template <class T, class Fn>
PYCOMM_HD T combine(T dst, T src, Fn fn) {
  return Codec<T>::store(fn(Codec<T>::load(dst), Codec<T>::load(src)));
}

// dst = dst * factor, the scale that finishes an AVG. Computed in the
// accumulation type (double for float64, float otherwise).
template <class T>
PYCOMM_HD T scale_one(T v, double factor) {
  using Acc = typename Codec<T>::Acc;
  return Codec<T>::store(static_cast<Acc>(Codec<T>::load(v) * static_cast<Acc>(factor)));
}

// Calls f(Fn{}) for the functor of a reduce op (AVG reduces as SUM).
template <class F>
auto dispatch_op(ReduceOp op, F&& f) {
  switch (op) {
    case ReduceOp::kMax: return f(MaxFn{});
    case ReduceOp::kMin: return f(MinFn{});
    case ReduceOp::kProduct: return f(ProdFn{});
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
    default: return f(SumFn{});
  }
}

// Calls f(T{}) with the storage type of a dtype.
template <class F>
auto dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32: return f(float{});
    case DType::kFloat64: return f(double{});
    case DType::kFloat16: return f(Half{});
    case DType::kBFloat16: return f(BFloat16{});
    case DType::kInt32: return f(int32_t{});
    case DType::kInt64: return f(int64_t{});
    case DType::kUInt8: return f(uint8_t{});
    case DType::kInt8:
    default: return f(int8_t{});
  }
}

// Calls f(W{}) with the 16-bit storage type of a wire dtype (host code: the
// CPU reducer and the CUDA launchers of all_reduce(wire_dtype=...) share it).
template <class F>
void dispatch_wire(DType wire, F&& f) {
  if (wire == DType::kFloat16) {
    f(Half{});
  } else if (wire == DType::kBFloat16) {
    f(BFloat16{});
  } else {
    throw UsageError(std::string("wire dtype must be float16 or bfloat16, got ") +
                     dtype_name(wire));
  }
}

}  // namespace pycomm
