// The block-scaled 8-bit codes of quant.h, written once for host and device.
//
// The CPU (quant.cc: the portable loops, and the AVX2 paths that equal them)
// and the CUDA kernels (csrc/cuda/quant_kernels.cu) run these functions, so
// the CPU tests pin the scales, codes, values and errors the GPU writes.
// Every step is one IEEE single-precision operation; the kernels are built
// with -fmad=false, so that x - scale * value does not become an FMA on the
// GPU (there is none on the CPU side). Bitwise except NaN payloads: arithmetic
// on a NaN gives the GPU's canonical NaN, while x86 keeps the operand's.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "elementwise.h"  // PYCOMM_HD, float_bits, bits_float
#include "quant.h"

namespace pycomm {

// The float32 quiet NaN std::nanf("") returns, on host and device alike.
constexpr uint32_t kQuantNaNBits = 0x7fc00000u;

// 2^k for a normal exponent k (-126 <= k <= 127), exactly.
PYCOMM_HD float pow2(int k) { return bits_float(static_cast<uint32_t>(k + 127) << 23); }

// A float8 format with kMant mantissa bits and exponent bias kBias.
// round_fp8 maps |x| (float32 bits, finite and below the format's overflow
// threshold) to the code of |x| rounded to nearest, ties to even:
//   subnormal (|x| < 2^(1 - kBias)): |x| + 2^(24 - kBias - kMant), whose
//     float32 ulp is the format's subnormal step, leaves the rounded number
//     of steps in the low bits (the float32 addition rounds to nearest even);
//   normal: rebias the exponent and add half an ulp of the format less one,
//     plus the kept mantissa's lowest bit (ties to even), then truncate.
template <int kMant, int kBias>
struct Fp8Bits {
  static constexpr int kDrop = 23 - kMant;  // float32 mantissa bits the format drops
  static constexpr uint32_t kMinNormal = uint32_t(127 + 1 - kBias) << 23;
  static constexpr uint32_t kDenorm = uint32_t(127 + 24 - kBias - kMant) << 23;
  // the exponent's rebias and half an ulp of the format less one
  static constexpr uint32_t kRound = (uint32_t(kBias - 127) << 23) + ((1u << (kDrop - 1)) - 1u);
};

template <int kMant, int kBias>
PYCOMM_HD uint8_t round_fp8(uint32_t abs_bits) {
  using B = Fp8Bits<kMant, kBias>;
  if (abs_bits < B::kMinNormal) {
    return static_cast<uint8_t>(float_bits(bits_float(abs_bits) + bits_float(B::kDenorm)) -
                                B::kDenorm);
  }
  const uint32_t odd = (abs_bits >> B::kDrop) & 1u;
  return static_cast<uint8_t>((abs_bits + B::kRound + odd) >> B::kDrop);
}

// float8_e4m3fn: |x| >= 480 (the first value that rounds past 0x7e = 448)
// and NaN give NaN (0x7f), as torch's conversion does.
PYCOMM_HD uint8_t encode_e4m3(float x) {
  const uint32_t b = float_bits(x), sign = (b >> 24) & 0x80u, a = b & 0x7fffffffu;
  const uint8_t code = a >= float_bits(480.0f) ? uint8_t{0x7f} : round_fp8<3, 7>(a);
  return static_cast<uint8_t>(code | sign);
}

// float8_e5m2: |x| >= 65536 gives infinity (0x7c), NaN gives NaN (0x7f).
PYCOMM_HD uint8_t encode_e5m2(float x) {
  const uint32_t b = float_bits(x), sign = (b >> 24) & 0x80u, a = b & 0x7fffffffu;
  const uint8_t code = a > 0x7f800000u             ? uint8_t{0x7f}
                       : a >= float_bits(65536.0f) ? uint8_t{0x7c}
                                                   : round_fp8<2, 15>(a);
  return static_cast<uint8_t>(code | sign);
}

// The exact float32 value of a code (int8: the integer). The CPU keeps it
// in a table per format (quant.cc), the GPU computes it.
PYCOMM_HD float quant_value(QuantFormat f, uint8_t c) {
  if (f == QuantFormat::kInt8) return static_cast<float>(static_cast<int8_t>(c));
  const float sign = (c & 0x80) ? -1.0f : 1.0f;
  if (f == QuantFormat::kFp8E4M3) {
    const int e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) return bits_float(kQuantNaNBits);
    return e == 0 ? sign * (static_cast<float>(m) * pow2(-9))
                  : sign * (static_cast<float>(8 + m) * pow2(e - 10));
  }
  const int e = (c >> 2) & 31, m = c & 3;
  if (e == 31) return m == 0 ? sign * bits_float(0x7f800000u) : bits_float(kQuantNaNBits);
  return e == 0 ? sign * (static_cast<float>(m) * pow2(-16))
                : sign * (static_cast<float>(4 + m) * pow2(e - 17));
}

// y = x * (M / absmax) to a code, per format (quant.h).
struct Int8Codes {
  static constexpr QuantFormat kFormat = QuantFormat::kInt8;
  static constexpr float kMax = 127.0f;
  PYCOMM_HD static uint8_t encode(float y) {
#if defined(__CUDA_ARCH__)
    float q = rintf(y);  // ties to even
#else
    float q = std::nearbyint(y);  // ties to even (the default rounding mode)
#endif
    q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
    return static_cast<uint8_t>(static_cast<int8_t>(q));
  }
};
struct E4M3Codes {
  static constexpr QuantFormat kFormat = QuantFormat::kFp8E4M3;
  static constexpr int kMant = 3, kBias = 7;
  static constexpr float kMax = 448.0f;
  PYCOMM_HD static uint8_t encode(float y) {
    return encode_e4m3(y > kMax ? kMax : (y < -kMax ? -kMax : y));
  }
};
struct E5M2Codes {
  static constexpr QuantFormat kFormat = QuantFormat::kFp8E5M2;
  static constexpr int kMant = 2, kBias = 15;
  static constexpr float kMax = 57344.0f;
  PYCOMM_HD static uint8_t encode(float y) {
    return encode_e5m2(y > kMax ? kMax : (y < -kMax ? -kMax : y));
  }
};

// The scale of a block, and the factor that maps it onto codes.
struct BlockScale {
  float scale;    // value = scale * quant_value(code)
  float to_code;  // code = encode(x * to_code)
};

// From the block's largest magnitude, or finite = false (a NaN or an
// infinity in the block: scale NaN, and the callers write codes 0 and error
// 0). A block so small that max / absmax overflows (absmax < max / FLT_MAX,
// around 1e-34 and below) counts as all zero: x * inf would give NaN codes
// for its zeros, and its values go whole into the residual instead.
PYCOMM_HD BlockScale scale_of(float absmax, bool finite, float max) {
  if (!finite) return {bits_float(kQuantNaNBits), 0.0f};
  const float to_code = max / absmax;  // +inf for absmax 0
  if (!(to_code <= FLT_MAX)) return {0.0f, 0.0f};
  return {absmax / max, to_code};
}

}  // namespace pycomm
