#include "quant.h"

#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "quant_codec.h"
#include "reduce.h"
#include "x86_simd.h"

namespace pycomm {
namespace {

// quant_value of every code of a format, looked up by the portable loops
// (the AVX2 ones compute it: fp8_values_avx2).
using DecodeTable = std::array<float, 256>;

DecodeTable make_table(QuantFormat f) {
  DecodeTable t{};
  for (int c = 0; c < 256; ++c) t[c] = quant_value(f, static_cast<uint8_t>(c));
  return t;
}

const DecodeTable& table_of(QuantFormat f) {
  static const DecodeTable tables[kNumQuantFormats] = {make_table(QuantFormat::kInt8),
                                                       make_table(QuantFormat::kFp8E4M3),
                                                       make_table(QuantFormat::kFp8E5M2)};
  return tables[static_cast<int>(f)];
}

// scale_of, and for a block with a NaN or an infinity its codes and error
// (0 both) written here: the callers quantize finite blocks only.
BlockScale block_scale(float absmax, bool finite, float max, void* codes, float* err, size_t n) {
  if (!finite) {
    std::memset(codes, 0, n);
    if (err) std::memset(err, 0, n * sizeof(float));
  }
  return scale_of(absmax, finite, max);
}

// Elements of a finite block, portable (the AVX2 paths' tails too).
template <class Codes>
void quantize_elements(const float* x, size_t n, BlockScale s, uint8_t* codes, float* err,
                       const DecodeTable& value) {
  for (size_t i = 0; i < n; ++i) {
    const uint8_t c = Codes::encode(x[i] * s.to_code);
    codes[i] = c;
    if (err) err[i] = x[i] - s.scale * value[c];
  }
}

// One block, portable: the reference the AVX2 paths equal bit for bit.
template <class Codes>
BlockScale quantize_block(const float* x, size_t n, uint8_t* codes, float* err,
                          const DecodeTable& value) {
  float absmax = 0.0f;
  bool finite = true;
  for (size_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    finite = finite && a <= FLT_MAX;  // false for inf and NaN
    absmax = a > absmax ? a : absmax;
  }
  const BlockScale s = block_scale(absmax, finite, Codes::kMax, codes, err, n);
  if (!finite) return s;  // a NaN block's codes are 0, and so is its error
  quantize_elements<Codes>(x, n, s, codes, err, value);
  return s;
}

void dequantize_block(float* dst, const uint8_t* codes, size_t n, float scale, bool add,
                      const DecodeTable& value) {
  for (size_t i = 0; i < n; ++i) {
    const float v = scale * value[codes[i]];
    dst[i] = add ? dst[i] + v : v;
  }
}

#if PYCOMM_X86_SIMD
#define PYCOMM_AVX2 __attribute__((target("avx2,f16c")))  // cpu_uses_avx2: both

// The largest |x| of a block, and whether every x is finite, on 8 lanes.
PYCOMM_AVX2 float block_absmax_avx2(const float* x, size_t n, bool* finite) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 big = _mm256_set1_ps(FLT_MAX);
  __m256 vmax = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, big, _CMP_LE_OQ));
    vmax = _mm256_max_ps(vmax, a);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float absmax = 0.0f;
  for (float l : lanes) absmax = l > absmax ? l : absmax;
  *finite = _mm256_movemask_ps(ok) == 0xff;
  for (; i < n; ++i) {
    const float a = std::fabs(x[i]);
    *finite = *finite && a <= FLT_MAX;
    absmax = a > absmax ? a : absmax;
  }
  return absmax;
}

// quantize_block<Int8Codes> on 8 lanes (the same single-precision
// operations: |x|, max, x * to_code, round to nearest even, clamp,
// x - scale * value; no FMA), the last n % 8 elements by the portable loop.
// The error takes the code's value, the integer converted back, not the
// rounded float: that one is -0.0 for small negative x, and -0.0 - (scale
// * -0.0) is +0.0 where the portable loop's -0.0 - 0.0 is -0.0.
PYCOMM_AVX2 BlockScale quantize_int8_block_avx2(const float* x, size_t n, int8_t* codes,
                                                float* err) {
  bool finite;
  const float absmax = block_absmax_avx2(x, n, &finite);
  const BlockScale s = block_scale(absmax, finite, Int8Codes::kMax, codes, err, n);
  if (!finite) return s;
  const __m256 to_code = _mm256_set1_ps(s.to_code), scale = _mm256_set1_ps(s.scale);
  const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    __m256 q =
        _mm256_round_ps(_mm256_mul_ps(v, to_code), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_max_ps(_mm256_min_ps(q, hi), lo);
    const __m256i q32 = _mm256_cvtps_epi32(q);
    const __m128i q16 =
        _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packs_epi16(q16, q16));
    if (err) {
      const __m256 value = _mm256_cvtepi32_ps(q32);
      _mm256_storeu_ps(err + i, _mm256_sub_ps(v, _mm256_mul_ps(scale, value)));
    }
  }
  quantize_elements<Int8Codes>(x + i, n - i, s, reinterpret_cast<uint8_t*>(codes) + i,
                               err ? err + i : nullptr, table_of(QuantFormat::kInt8));
  return s;
}

// round_fp8 on 8 lanes of y (finite, |y| <= the format's max): the codes,
// one in the low byte of each 32-bit lane, by the same integer and float32
// operations.
template <class Codes>
PYCOMM_AVX2 __m256i fp8_codes_avx2(__m256 y) {
  using B = Fp8Bits<Codes::kMant, Codes::kBias>;
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256i a = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i denorm = _mm256_set1_epi32(static_cast<int>(B::kDenorm));
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(denorm))),
      denorm);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, B::kDrop), _mm256_set1_epi32(1));
  const __m256i normal = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(static_cast<int>(B::kRound))), odd),
      B::kDrop);
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(B::kMinNormal)), a);
  return _mm256_or_si256(_mm256_blendv_epi8(normal, sub, is_sub), sign);
}

// quant_value of 8 float8 codes (c16: one in each 16-bit lane), computed
// rather than gathered from the table (a gather of 8 costs more than the
// rest of an element's work on AMD's cores). A float8 code is a half with
// fewer bits: e5m2 is the half's top byte; e4m3's exponent and mantissa sit
// one bit lower, with a bias 8 smaller, so the half's value times 2^8 is
// the code's (subnormals too). vcvtph2ps and that product are exact for
// every non-NaN half; NaN codes take quant_value's NaN bits, which the
// conversion would not (it keeps their sign and payload).
template <class Codes>
PYCOMM_AVX2 __m256 fp8_values_avx2(__m128i c16) {
  const __m128i mag = _mm_and_si128(c16, _mm_set1_epi16(0x7f));
  __m128i half, nan;
  if constexpr (std::is_same_v<Codes, E5M2Codes>) {
    half = _mm_slli_epi16(c16, 8);
    nan = _mm_cmpgt_epi16(mag, _mm_set1_epi16(0x7c));  // 0x7c: infinity
  } else {
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(c16, _mm_set1_epi16(0x80)), 8);
    half = _mm_or_si128(_mm_slli_epi16(mag, 7), sign);
    nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f));
  }
  __m256 v = _mm256_cvtph_ps(half);
  if constexpr (!std::is_same_v<Codes, E5M2Codes>) v = _mm256_mul_ps(v, _mm256_set1_ps(256.0f));
  const __m256 nan_value = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(kQuantNaNBits)));
  return _mm256_blendv_ps(v, nan_value, _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan)));
}

// quantize_block<E4M3Codes / E5M2Codes> on 8 lanes: x * to_code, clamp,
// round_fp8, the error from the codes' values; no FMA.
template <class Codes>
PYCOMM_AVX2 BlockScale quantize_fp8_block_avx2(const float* x, size_t n, uint8_t* codes, float* err,
                                               const DecodeTable& value) {
  bool finite;
  const float absmax = block_absmax_avx2(x, n, &finite);
  const BlockScale s = block_scale(absmax, finite, Codes::kMax, codes, err, n);
  if (!finite) return s;
  const __m256 to_code = _mm256_set1_ps(s.to_code), scale = _mm256_set1_ps(s.scale);
  const __m256 hi = _mm256_set1_ps(Codes::kMax), lo = _mm256_set1_ps(-Codes::kMax);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 y = _mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(v, to_code), hi), lo);
    const __m256i c = fp8_codes_avx2<Codes>(y);
    const __m128i c16 = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packus_epi16(c16, c16));
    if (err) {
      const __m256 q = fp8_values_avx2<Codes>(c16);
      _mm256_storeu_ps(err + i, _mm256_sub_ps(v, _mm256_mul_ps(scale, q)));
    }
  }
  quantize_elements<Codes>(x + i, n - i, s, codes + i, err ? err + i : nullptr, value);
  return s;
}

template <class Codes>
PYCOMM_AVX2 BlockScale quantize_block_avx2(const float* x, size_t n, uint8_t* codes, float* err,
                                           const DecodeTable& value) {
  if constexpr (std::is_same_v<Codes, Int8Codes>) {
    return quantize_int8_block_avx2(x, n, reinterpret_cast<int8_t*>(codes), err);
  } else {
    return quantize_fp8_block_avx2<Codes>(x, n, codes, err, value);
  }
}

// dequantize_block of float8 codes on 8 lanes.
template <class Codes>
PYCOMM_AVX2 void dequantize_fp8_block_avx2(float* dst, const uint8_t* codes, size_t n, float scale,
                                           bool add, const DecodeTable& value) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
    __m256 v = _mm256_mul_ps(s, fp8_values_avx2<Codes>(_mm_cvtepu8_epi16(c8)));
    if (add) v = _mm256_add_ps(_mm256_loadu_ps(dst + i), v);
    _mm256_storeu_ps(dst + i, v);
  }
  dequantize_block(dst + i, codes + i, n - i, scale, add, value);
}

PYCOMM_AVX2 void dequantize_int8_block_avx2(float* dst, const int8_t* codes, size_t n, float scale,
                                            bool add) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
    __m256 v = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8)));
    if (add) v = _mm256_add_ps(_mm256_loadu_ps(dst + i), v);
    _mm256_storeu_ps(dst + i, v);
  }
  dequantize_block(dst + i, reinterpret_cast<const uint8_t*>(codes) + i, n - i, scale, add,
                   table_of(QuantFormat::kInt8));
}
#endif  // PYCOMM_X86_SIMD

// Every block of a run in one format, by quantize_block or, where the CPU
// has AVX2, quantize_block_avx2: the loop is instantiated in an AVX2 function
// too, so that the blocks are inlined into it rather than called one by one
// (a call per block cost e5m2 half its speed).
#define PYCOMM_QUANTIZE_BLOCKS(QUANTIZE_ONE)                                           \
  for (size_t b = 0, lo = 0; lo < count; ++b, lo += block) {                           \
    const size_t n = count - lo < block ? count - lo : block;                          \
    const BlockScale s =                                                               \
        QUANTIZE_ONE<Codes>(src + lo, n, codes + lo, err ? err + lo : nullptr, value); \
    std::memcpy(scales + b * sizeof(float), &s.scale, sizeof(float));                  \
  }

#if PYCOMM_X86_SIMD
template <class Codes>
PYCOMM_AVX2 void quantize_blocks_avx2(char* scales, uint8_t* codes, const float* src, size_t count,
                                      size_t block, float* err, const DecodeTable& value) {
  PYCOMM_QUANTIZE_BLOCKS(quantize_block_avx2)
}
#endif

template <class Codes>
void quantize_blocks(QuantFormat f, char* scales, uint8_t* codes, const float* src, size_t count,
                     size_t block, float* err) {
  const DecodeTable& value = table_of(f);
#if PYCOMM_X86_SIMD
  if (cpu_uses_avx2())
    return quantize_blocks_avx2<Codes>(scales, codes, src, count, block, err, value);
#endif
  PYCOMM_QUANTIZE_BLOCKS(quantize_block)
}
#undef PYCOMM_QUANTIZE_BLOCKS

}  // namespace

const char* quant_format_name(QuantFormat f) {
  switch (f) {
    case QuantFormat::kInt8: return "int8";
    case QuantFormat::kFp8E4M3: return "float8_e4m3fn";
    case QuantFormat::kFp8E5M2: return "float8_e5m2";
  }
  return "?";
}

uint8_t fp8_encode(QuantFormat f, float x) {
  return f == QuantFormat::kFp8E5M2 ? encode_e5m2(x) : encode_e4m3(x);
}
float fp8_decode(QuantFormat f, uint8_t code) { return table_of(f)[code]; }

void cpu_quantize(QuantFormat f, void* dst, const float* src, size_t count, size_t block,
                  float* err) {
  char* scales = static_cast<char*>(dst);
  uint8_t* codes = reinterpret_cast<uint8_t*>(scales + ceil_div(count, block) * sizeof(float));
  switch (f) {
    case QuantFormat::kInt8:
      return quantize_blocks<Int8Codes>(f, scales, codes, src, count, block, err);
    case QuantFormat::kFp8E4M3:
      return quantize_blocks<E4M3Codes>(f, scales, codes, src, count, block, err);
    case QuantFormat::kFp8E5M2:
      return quantize_blocks<E5M2Codes>(f, scales, codes, src, count, block, err);
  }
}

void cpu_dequantize(QuantFormat f, float* dst, const void* src, size_t count, size_t block,
                    bool add) {
  const size_t blocks = ceil_div(count, block);
  const char* scales = static_cast<const char*>(src);
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(scales + blocks * sizeof(float));
  const DecodeTable& value = table_of(f);
#if PYCOMM_X86_SIMD
  const bool avx2 = cpu_uses_avx2();
#endif
  for (size_t b = 0; b < blocks; ++b) {
    const size_t lo = b * block, n = count - lo < block ? count - lo : block;
    float scale;
    std::memcpy(&scale, scales + b * sizeof(float), sizeof(float));
#if PYCOMM_X86_SIMD
    if (avx2) {
      switch (f) {
        case QuantFormat::kInt8:
          dequantize_int8_block_avx2(dst + lo, reinterpret_cast<const int8_t*>(codes + lo), n,
                                     scale, add);
          continue;
        case QuantFormat::kFp8E4M3:
          dequantize_fp8_block_avx2<E4M3Codes>(dst + lo, codes + lo, n, scale, add, value);
          continue;
        case QuantFormat::kFp8E5M2:
          dequantize_fp8_block_avx2<E5M2Codes>(dst + lo, codes + lo, n, scale, add, value);
          continue;
      }
    }
#endif
    dequantize_block(dst + lo, codes + lo, n, scale, add, value);
  }
}

}  // namespace pycomm
