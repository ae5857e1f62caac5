#include "reduce.h"

#include <algorithm>
#include <cstring>

#include "elementwise.h"

namespace pycomm {
namespace {

// Plain loops over __restrict pointers: the compiler vectorises the 32/64-bit
// cases. The aliasing case (dst == a) is the common one and still vectorises
// because each element is read before it is written.
template <class T, class Fn>
void reduce_loop(T* dst, const T* a, const T* b, size_t n, Fn fn) {
  for (size_t i = 0; i < n; ++i) dst[i] = combine(a[i], b[i], fn);
}

// 16-bit floats: convert a block to fp32, combine there, convert back. Keeping
// the conversions in separate tight loops lets them vectorise where the target
// allows.
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

}  // namespace

void cpu_reduce(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op) {
  if (count == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_op(op, [&](auto fn) {
      T* d = static_cast<T*>(dst);
      const T* x = static_cast<const T*>(a);
      const T* y = static_cast<const T*>(b);
      if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
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
    for (size_t i = 0; i < count; ++i) d[i] = scale_one(d[i], factor);
    return 0;
  });
}

void CpuReducer::copy(void* dst, const void* src, size_t bytes) {
  if (bytes != 0 && dst != src) std::memcpy(dst, src, bytes);
}

}  // namespace pycomm
