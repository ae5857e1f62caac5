#include "quant.h"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "reduce.h"
#include "x86_simd.h"

namespace pycomm {
namespace {

// The scale of a block, and the factor that maps it onto codes.
struct BlockScale {
  float scale;    // value = scale * code
  float to_code;  // code = round(x * to_code)
};

// From the block's largest magnitude, or finite = false.
BlockScale scale_of(float absmax, bool finite) {
  if (!finite) return {std::nanf(""), 0.0f};
  if (absmax == 0.0f) return {0.0f, 0.0f};
  return {absmax / 127.0f, 127.0f / absmax};
}

// One block, portable: the reference the AVX2 path equals bit for bit.
BlockScale quantize_block(const float* x, size_t n, int8_t* codes, float* err) {
  float absmax = 0.0f;
  bool finite = true;
  for (size_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    finite = finite && a <= FLT_MAX;  // false for inf and NaN
    absmax = a > absmax ? a : absmax;
  }
  const BlockScale s = scale_of(absmax, finite);
  for (size_t i = 0; i < n; ++i) {
    // ties to even (the default rounding mode); a NaN block's codes are 0
    float q = finite ? std::nearbyint(x[i] * s.to_code) : 0.0f;
    q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
    codes[i] = static_cast<int8_t>(q);
    if (err) err[i] = finite ? x[i] - s.scale * q : 0.0f;
  }
  return s;
}

void dequantize_block(float* dst, const int8_t* codes, size_t n, float scale, bool add) {
  for (size_t i = 0; i < n; ++i) {
    const float v = scale * static_cast<float>(codes[i]);
    dst[i] = add ? dst[i] + v : v;
  }
}

#if PYCOMM_X86_SIMD
#define PYCOMM_AVX2 __attribute__((target("avx2")))

// quantize_block on 8 lanes (the same single-precision operations: |x|,
// max, x * to_code, round to nearest even, clamp, x - scale * q; no FMA),
// the last n % 8 elements by the portable loop's expressions.
PYCOMM_AVX2 BlockScale quantize_block_avx2(const float* x, size_t n, int8_t* codes, float* err) {
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
  bool finite = _mm256_movemask_ps(ok) == 0xff;
  for (size_t k = i; k < n; ++k) {
    const float a = std::fabs(x[k]);
    finite = finite && a <= FLT_MAX;
    absmax = a > absmax ? a : absmax;
  }
  const BlockScale s = scale_of(absmax, finite);
  if (!finite) {
    std::memset(codes, 0, n);
    if (err) std::memset(err, 0, n * sizeof(float));
    return s;
  }
  const __m256 to_code = _mm256_set1_ps(s.to_code), scale = _mm256_set1_ps(s.scale);
  const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    __m256 q =
        _mm256_round_ps(_mm256_mul_ps(v, to_code), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_max_ps(_mm256_min_ps(q, hi), lo);
    const __m256i q32 = _mm256_cvtps_epi32(q);
    const __m128i q16 =
        _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packs_epi16(q16, q16));
    if (err) _mm256_storeu_ps(err + i, _mm256_sub_ps(v, _mm256_mul_ps(scale, q)));
  }
  for (; i < n; ++i) {
    float q = std::nearbyint(x[i] * s.to_code);
    q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
    codes[i] = static_cast<int8_t>(q);
    if (err) err[i] = x[i] - s.scale * q;
  }
  return s;
}

PYCOMM_AVX2 void dequantize_block_avx2(float* dst, const int8_t* codes, size_t n, float scale,
                                       bool add) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
    __m256 v = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8)));
    if (add) v = _mm256_add_ps(_mm256_loadu_ps(dst + i), v);
    _mm256_storeu_ps(dst + i, v);
  }
  dequantize_block(dst + i, codes + i, n - i, scale, add);
}
#endif  // PYCOMM_X86_SIMD

}  // namespace

void cpu_quantize_int8(void* dst, const float* src, size_t count, size_t block, float* err) {
  const size_t blocks = ceil_div(count, block);
  char* scales = static_cast<char*>(dst);
  int8_t* codes = reinterpret_cast<int8_t*>(scales + blocks * sizeof(float));
#if PYCOMM_X86_SIMD
  const bool avx2 = cpu_uses_avx2();
#endif
  for (size_t b = 0; b < blocks; ++b) {
    const size_t lo = b * block, n = count - lo < block ? count - lo : block;
    float* e = err ? err + lo : nullptr;
#if PYCOMM_X86_SIMD
    const BlockScale s = avx2 ? quantize_block_avx2(src + lo, n, codes + lo, e)
                              : quantize_block(src + lo, n, codes + lo, e);
#else
    const BlockScale s = quantize_block(src + lo, n, codes + lo, e);
#endif
    std::memcpy(scales + b * sizeof(float), &s.scale, sizeof(float));
  }
}

void cpu_dequantize_int8(float* dst, const void* src, size_t count, size_t block, bool add) {
  const size_t blocks = ceil_div(count, block);
  const char* scales = static_cast<const char*>(src);
  const int8_t* codes = reinterpret_cast<const int8_t*>(scales + blocks * sizeof(float));
#if PYCOMM_X86_SIMD
  const bool avx2 = cpu_uses_avx2();
#endif
  for (size_t b = 0; b < blocks; ++b) {
    const size_t lo = b * block, n = count - lo < block ? count - lo : block;
    float scale;
    std::memcpy(&scale, scales + b * sizeof(float), sizeof(float));
#if PYCOMM_X86_SIMD
    if (avx2) {
      dequantize_block_avx2(dst + lo, codes + lo, n, scale, add);
      continue;
    }
#endif
    dequantize_block(dst + lo, codes + lo, n, scale, add);
  }
}

}  // namespace pycomm
