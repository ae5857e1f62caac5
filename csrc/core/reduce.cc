#include "reduce.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "elementwise.h"
#include "x86_simd.h"

namespace pycomm {
namespace {

// PYCOMM_CPU_SIMD: unset, "" or "auto" (vector paths where the CPU has them)
// or "scalar" (the portable loops only). Another value throws UsageError, at
// every call, so a typo cannot silently select a path.
bool cpu_simd_forced_scalar() {
  static const bool scalar = [] {
    const char* v = std::getenv("PYCOMM_CPU_SIMD");
    const std::string s = v ? v : "";
    if (s.empty() || s == "auto") return false;
    if (s == "scalar") return true;
    throw UsageError("environment variable PYCOMM_CPU_SIMD='" + s + "' is not 'auto' or 'scalar'");
  }();
  return scalar;
}

// Plain loops: the compiler vectorises the 32/64-bit cases (with a runtime
// overlap check, since dst may alias a). The aliasing case (dst == a) is the
// common one and still vectorises because each element is read before it is
// written.
template <class T, class Fn>
void reduce_loop(T* dst, const T* a, const T* b, size_t n, Fn fn) {
  for (size_t i = 0; i < n; ++i) dst[i] = combine(a[i], b[i], fn);
}

// d0[i] = d1[i] = combine(a[i], b[i]), scaled for AVG (kScale): one pass that
// stores each result to both outputs. Exact aliasing of an output with an
// input is fine: each element is read before it is written.
template <bool kScale, class T, class Fn>
__attribute__((always_inline)) inline void reduce_to_two(T* d0, T* d1, const T* a, const T* b,
                                                         size_t n, Fn fn, double factor) {
  for (size_t i = 0; i < n; ++i) {
    const T v = kScale ? scale_one(combine(a[i], b[i], fn), factor) : combine(a[i], b[i], fn);
    d0[i] = v;
    d1[i] = v;
  }
}

// 16-bit floats, portable path: convert a block to fp32, combine there,
// convert back, each step in its own tight loop.
template <class T, class Fn>
void reduce_block16(T* dst, const T* a, const T* b, size_t n, Fn fn) {
  constexpr size_t kBlock = 512;
  float fa[kBlock], fb[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    for (size_t i = 0; i < m; ++i) fa[i] = Codec<T>::load(a[base + i]);
    for (size_t i = 0; i < m; ++i) fb[i] = Codec<T>::load(b[base + i]);
    for (size_t i = 0; i < m; ++i) fa[i] = fn(fa[i], fb[i]);
    for (size_t i = 0; i < m; ++i) dst[base + i] = Codec<T>::store(fa[i]);
  }
}

#if PYCOMM_X86_SIMD
// ---- x86 AVX2 + F16C paths, chosen at run time (the build targets baseline
// x86-64). Bitwise identical to the functors of elementwise.h:
//  * fp16 -> fp32 (vcvtph2ps) is exact for every non-NaN half, like
//    half_to_float; a NaN stays a NaN of the same sign, and the store below
//    re-encodes every NaN the software way, so NaN payloads cannot leak.
//  * fp32 -> fp16 (vcvtps2ph, imm = round to nearest even) rounds like
//    float_to_half (subnormals and overflow to inf included); NaN lanes are
//    redone with float_to_half.
//  * bf16 is the integer RNE of float_to_bf16 on 8 lanes; NaN lanes redone.
//  * the ops are the same IEEE single operations as the scalar functors
//    (MAX/MIN: a if a is NaN or a > b, else b; as blends).
//
// PYCOMM_CPU_SIMD=scalar (read once, at the first reduction) forces the
// portable paths on a CPU that has AVX2, so that tests can compare the two.
bool have_avx2_f16c() {
  static const bool ok =
      !cpu_simd_forced_scalar() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return ok;
}

#define PYCOMM_AVX2 __attribute__((target("avx2,f16c")))

template <class T>
PYCOMM_AVX2 inline __m256 load8(const T* p);
template <>
PYCOMM_AVX2 inline __m256 load8<Half>(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <>
PYCOMM_AVX2 inline __m256 load8<BFloat16>(const BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// Redo the NaN lanes (bits of `mask`) with the scalar conversion.
template <class T>
PYCOMM_AVX2 inline __m128i fix_nans(__m128i h, __m256 f, int mask) {
  alignas(32) float fs[8];
  alignas(16) uint16_t hs[8];
  _mm256_store_ps(fs, f);
  _mm_store_si128(reinterpret_cast<__m128i*>(hs), h);
  for (int i = 0; i < 8; ++i) {
    if (mask & (1 << i)) hs[i] = Codec<T>::store(fs[i]).bits;
  }
  return _mm_load_si128(reinterpret_cast<const __m128i*>(hs));
}

template <class T>
PYCOMM_AVX2 inline void store8(T* p, __m256 f);
template <>
PYCOMM_AVX2 inline void store8<Half>(Half* p, __m256 f) {
  __m128i h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const int nan = _mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  if (nan) h = fix_nans<Half>(h, f, nan);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}
template <>
PYCOMM_AVX2 inline void store8<BFloat16>(BFloat16* p, __m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  const int nan = _mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  if (nan) h = fix_nans<BFloat16>(h, f, nan);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}

PYCOMM_AVX2 inline __m256 apply8(SumFn, __m256 a, __m256 b) { return _mm256_add_ps(a, b); }
PYCOMM_AVX2 inline __m256 apply8(ProdFn, __m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
PYCOMM_AVX2 inline __m256 apply8(MaxFn, __m256 a, __m256 b) {
  const __m256 take_a =
      _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(a, b, _CMP_GT_OQ));
  return _mm256_blendv_ps(b, a, take_a);
}
PYCOMM_AVX2 inline __m256 apply8(MinFn, __m256 a, __m256 b) {
  const __m256 take_a =
      _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(a, b, _CMP_LT_OQ));
  return _mm256_blendv_ps(b, a, take_a);
}

template <class T, class Fn>
PYCOMM_AVX2 void reduce16_avx2(T* dst, const T* a, const T* b, size_t n, Fn fn) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store8<T>(dst + i, apply8(fn, load8<T>(a + i), load8<T>(b + i)));
  for (; i < n; ++i) dst[i] = combine(a[i], b[i], fn);
}

template <class T>
PYCOMM_AVX2 void scale16_avx2(T* d, size_t n, double factor) {
  const __m256 f = _mm256_set1_ps(static_cast<float>(factor));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store8<T>(d + i, _mm256_mul_ps(load8<T>(d + i), f));
  for (; i < n; ++i) d[i] = scale_one(d[i], factor);
}

// The generic loop, compiled for AVX2 (twice the width of the baseline SSE2).
template <class T, class Fn>
PYCOMM_AVX2 void reduce_loop_avx2(T* dst, const T* a, const T* b, size_t n, Fn fn) {
  for (size_t i = 0; i < n; ++i) dst[i] = combine(a[i], b[i], fn);
}

// reduce then scale fused element by element (float32/float64): the same two
// roundings as reduce_loop then the scale, in one pass over memory.
template <class T, class Fn>
PYCOMM_AVX2 void reduce_scale_loop_avx2(T* dst, const T* a, const T* b, size_t n, Fn fn,
                                        double factor) {
  for (size_t i = 0; i < n; ++i) dst[i] = scale_one(combine(a[i], b[i], fn), factor);
}

// reduce_to_two, compiled for AVX2 (inlined here, so vectorised at its width).
template <bool kScale, class T, class Fn>
PYCOMM_AVX2 void reduce_to_two_avx2(T* d0, T* d1, const T* a, const T* b, size_t n, Fn fn,
                                    double factor) {
  reduce_to_two<kScale>(d0, d1, a, b, n, fn, factor);
}

// Wire-dtype conversions, 8 lanes at a time (same codec as above).
template <class W>
PYCOMM_AVX2 void to_wire_avx2(W* dst, const float* src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store8<W>(dst + i, _mm256_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = Codec<W>::store(src[i]);
}
template <class W>
PYCOMM_AVX2 void from_wire_avx2(float* dst, const W* src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8<W>(src + i));
  for (; i < n; ++i) dst[i] = Codec<W>::load(src[i]);
}
template <class W, class Fn>
PYCOMM_AVX2 void reduce_wire_avx2(float* dst, const float* a, const W* b, size_t n, Fn fn) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, apply8(fn, _mm256_loadu_ps(a + i), load8<W>(b + i)));
  }
  for (; i < n; ++i) dst[i] = fn(a[i], Codec<W>::load(b[i]));
}
#endif  // PYCOMM_X86_SIMD

}  // namespace

void cpu_to_wire(void* dst, const float* src, size_t count, DType wire) {
  dispatch_wire(wire, [&](auto tag) {
    using W = decltype(tag);
    W* d = static_cast<W*>(dst);
#if PYCOMM_X86_SIMD
    if (have_avx2_f16c()) return to_wire_avx2(d, src, count);
#endif
    for (size_t i = 0; i < count; ++i) d[i] = Codec<W>::store(src[i]);
  });
}

void cpu_from_wire(float* dst, const void* src, size_t count, DType wire) {
  dispatch_wire(wire, [&](auto tag) {
    using W = decltype(tag);
    const W* s = static_cast<const W*>(src);
#if PYCOMM_X86_SIMD
    if (have_avx2_f16c()) return from_wire_avx2(dst, s, count);
#endif
    for (size_t i = 0; i < count; ++i) dst[i] = Codec<W>::load(s[i]);
  });
}

void cpu_reduce_wire(float* dst, const float* a, const void* b, size_t count, DType wire,
                     ReduceOp op) {
  dispatch_wire(wire, [&](auto tag) {
    using W = decltype(tag);
    const W* y = static_cast<const W*>(b);
    dispatch_op(op, [&](auto fn) {
#if PYCOMM_X86_SIMD
      if (have_avx2_f16c()) {
        reduce_wire_avx2(dst, a, y, count, fn);
        return 0;
      }
#endif
      for (size_t i = 0; i < count; ++i) dst[i] = fn(a[i], Codec<W>::load(y[i]));
      return 0;
    });
  });
}

bool cpu_uses_avx2() {
#if PYCOMM_X86_SIMD
  return have_avx2_f16c();
#else
  return false;
#endif
}

void Reducer::quantize(QuantFormat f, void*, const float*, size_t, size_t, float*) {
  throw UsageError(cat("this reducer has no ", quant_format_name(f), " wire"));
}
void Reducer::dequantize(QuantFormat f, float*, const void*, size_t, size_t, bool) {
  throw UsageError(cat("this reducer has no ", quant_format_name(f), " wire"));
}

void Reducer::to_wire(void*, const float*, size_t, DType) {
  throw UsageError("this reducer has no wire-dtype conversions");
}
void Reducer::from_wire(float*, const void*, size_t, DType) {
  throw UsageError("this reducer has no wire-dtype conversions");
}
void Reducer::reduce_wire(float*, const float*, const void*, size_t, DType, ReduceOp) {
  throw UsageError("this reducer has no wire-dtype conversions");
}

void cpu_reduce(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op) {
  if (count == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_op(op, [&](auto fn) {
      T* d = static_cast<T*>(dst);
      const T* x = static_cast<const T*>(a);
      const T* y = static_cast<const T*>(b);
      constexpr bool k16 = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;
#if PYCOMM_X86_SIMD
      if (have_avx2_f16c()) {
        if constexpr (k16) {
          reduce16_avx2(d, x, y, count, fn);
        } else {
          reduce_loop_avx2(d, x, y, count, fn);
        }
        return 0;
      }
#endif
      if constexpr (k16) {
        reduce_block16(d, x, y, count, fn);
      } else {
        reduce_loop(d, x, y, count, fn);
      }
      return 0;
    });
    return 0;
  });
}

void cpu_scale(void* dst, size_t count, DType dtype, double factor) {
  if (!is_floating(dtype)) throw UsageError("scale needs a floating dtype");
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* d = static_cast<T*>(dst);
#if PYCOMM_X86_SIMD
    if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
      if (have_avx2_f16c()) {
        scale16_avx2(d, count, factor);
        return 0;
      }
    }
#endif
    for (size_t i = 0; i < count; ++i) d[i] = scale_one(d[i], factor);
    return 0;
  });
}

void CpuReducer::reduce_scale(void* dst, const void* a, const void* b, size_t count, DType dtype,
                              ReduceOp op, double factor) {
#if PYCOMM_X86_SIMD
  if ((dtype == DType::kFloat32 || dtype == DType::kFloat64) && have_avx2_f16c()) {
    dispatch_dtype(dtype, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
        dispatch_op(op, [&](auto fn) {
          reduce_scale_loop_avx2(static_cast<T*>(dst), static_cast<const T*>(a),
                                 static_cast<const T*>(b), count, fn, factor);
          return 0;
        });
      }
      return 0;
    });
    return;
  }
#endif
  // 16 KiB blocks (a multiple of every SIMD width): L1-sized, so the scale
  // re-reads what the reduce just wrote from cache.
  const size_t es = dtype_size(dtype);
  const size_t block = (16 * 1024) / es;
  char* d = static_cast<char*>(dst);
  const char* pa = static_cast<const char*>(a);
  const char* pb = static_cast<const char*>(b);
  for (size_t i = 0; i < count; i += block) {
    const size_t n = std::min(block, count - i);
    cpu_reduce(d + i * es, pa + i * es, pb + i * es, n, dtype, op);
    cpu_scale(d + i * es, n, dtype, factor);
  }
}

void Reducer::reduce_to_all(void* const* outs, int n_outs, const void* a, const void* b,
                            size_t count, DType dtype, ReduceOp op, double factor) {
  if (op == ReduceOp::kAvg) {
    reduce_scale(outs[0], a, b, count, dtype, op, factor);
  } else {
    reduce(outs[0], a, b, count, dtype, op);
  }
  for (int k = 1; k < n_outs; ++k) copy(outs[k], outs[0], count * dtype_size(dtype));
}

void CpuReducer::reduce_to_all(void* const* outs, int n_outs, const void* a, const void* b,
                               size_t count, DType dtype, ReduceOp op, double factor) {
  const bool wide = dtype == DType::kFloat32 || dtype == DType::kFloat64 ||
                    dtype == DType::kInt32 || dtype == DType::kInt64;
  const bool avg = op == ReduceOp::kAvg;
  if (n_outs == 1) {
    Reducer::reduce_to_all(outs, n_outs, a, b, count, dtype, op, factor);  // no copies
    return;
  }
  if (n_outs != 2 || !wide || (avg && !is_floating(dtype))) {
    // The default, block by block, so that the copies read what the
    // reduction just wrote from cache (64 KiB: a multiple of every SIMD width).
    const size_t es = dtype_size(dtype), block = (64 * 1024) / es;
    std::vector<void*> at(static_cast<size_t>(n_outs));
    for (size_t i = 0; i < count; i += block) {
      for (int k = 0; k < n_outs; ++k) at[k] = static_cast<char*>(outs[k]) + i * es;
      Reducer::reduce_to_all(at.data(), n_outs, static_cast<const char*>(a) + i * es,
                             static_cast<const char*>(b) + i * es, std::min(block, count - i),
                             dtype, op, factor);
    }
    return;
  }
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, Half> && !std::is_same_v<T, BFloat16>) {
      T* d0 = static_cast<T*>(outs[0]);
      T* d1 = static_cast<T*>(outs[1]);
      const T* x = static_cast<const T*>(a);
      const T* y = static_cast<const T*>(b);
      dispatch_op(op, [&](auto fn) {
#if PYCOMM_X86_SIMD
        if (have_avx2_f16c()) {
          if (avg) return reduce_to_two_avx2<true>(d0, d1, x, y, count, fn, factor);
          return reduce_to_two_avx2<false>(d0, d1, x, y, count, fn, factor);
        }
#endif
        if (avg) return reduce_to_two<true>(d0, d1, x, y, count, fn, factor);
        return reduce_to_two<false>(d0, d1, x, y, count, fn, factor);
      });
    }
    return 0;
  });
}

void CpuReducer::copy(void* dst, const void* src, size_t bytes) {
  if (bytes != 0 && dst != src) std::memcpy(dst, src, bytes);
}

}  // namespace pycomm
