// Reduction kernels: grid-stride loops over 16-byte packs (one LDG.128 per
// operand per pack), several packs in flight per thread, a scalar prologue to
// reach 16-byte alignment and a scalar epilogue. The arithmetic is
// pycomm::combine / pycomm::scale_one from csrc/core/elementwise.h, the very
// functors the CPU path runs (fp16/bf16 accumulate in fp32, RNE back).
//
// Build with -fmad=false (setup.py and scripts/compile_cuda.sh do): no FMA
// contraction, so every result is bitwise the CPU one.
#include "reduce_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../core/elementwise.h"
#include "check.h"

namespace pycomm {
namespace cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;       // packs in flight per thread and operand
constexpr int kBlocksPerSM = 4;  // 4 x 512 threads = 2048 = a full H100 SM

template <class T>
struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

// The per-element operation: combine, then optionally the AVG scale.
template <class T, class Fn, bool kScale>
struct ElemOp {
  Fn fn;
  double factor;
  __device__ __forceinline__ T operator()(T x, T y) const {
    T r = combine(x, y, fn);
    if constexpr (kScale) r = scale_one(r, factor);
    return r;
  }
};

// Scale only (b is ignored).
template <class T>
struct ScaleOp {
  double factor;
  __device__ __forceinline__ T operator()(T x, T) const { return scale_one(x, factor); }
};

// dst[i] = f(a[i], b[i]). Elements [0, head) and [head + npacks*N, count) are
// done one by one; the packs in between are 16-byte aligned in all three
// arrays. dst may equal a (and b): each thread reads an element before it
// writes it, and no two threads touch the same element.
template <class T, class F, bool kBinary>
__global__ void __launch_bounds__(kThreads)
    elementwise_kernel(T* dst, const T* a, const T* b, size_t head, size_t npacks, size_t count,
                       F f) {
  using P = Pack<T>;
  constexpr int N = P::N;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = static_cast<size_t>(gridDim.x) * blockDim.x;

  const size_t tail = head + npacks * N;
  for (size_t i = tid; i < head; i += nthreads) dst[i] = f(a[i], kBinary ? b[i] : a[i]);
  for (size_t i = tail + tid; i < count; i += nthreads) dst[i] = f(a[i], kBinary ? b[i] : a[i]);

  P* pd = reinterpret_cast<P*>(dst + head);
  const P* pa = reinterpret_cast<const P*>(a + head);
  const P* pb = reinterpret_cast<const P*>((kBinary ? b : a) + head);
  size_t p = tid;
  // Main loop: kUnroll independent packs per thread, all loads issued before
  // any store (so aliasing dst == a cannot serialise them).
  for (; p + (kUnroll - 1) * nthreads < npacks; p += kUnroll * nthreads) {
    P x[kUnroll], y[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      x[u] = pa[p + u * nthreads];
      if constexpr (kBinary) y[u] = pb[p + u * nthreads];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int e = 0; e < N; ++e) x[u].v[e] = f(x[u].v[e], kBinary ? y[u].v[e] : x[u].v[e]);
      pd[p + u * nthreads] = x[u];
    }
  }
  for (; p < npacks; p += nthreads) {
    P x = pa[p];
    P y;
    if constexpr (kBinary) y = pb[p];
#pragma unroll
    for (int e = 0; e < N; ++e) x.v[e] = f(x.v[e], kBinary ? y.v[e] : x.v[e]);
    pd[p] = x;
  }
}

int sm_count() {
  static std::atomic<int> cache[64] = {};
  int dev = 0;
  PYCOMM_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) dev = 0;
  int n = cache[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    PYCOMM_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cache[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Blocks for `n` work items of one thread each: enough to cover them, at most
// kBlocksPerSM per multiprocessor (the threads then stride), at least one.
unsigned grid_for(size_t n) {
  const size_t max_blocks = static_cast<size_t>(sm_count()) * kBlocksPerSM;
  return static_cast<unsigned>(std::max<size_t>(1, std::min(max_blocks, ceil_div(n, kThreads))));
}

template <class T, bool kBinary, class F>
void launch(T* dst, const T* a, const T* b, size_t count, F f, cudaStream_t stream) {
  if (count == 0) return;
  constexpr int N = Pack<T>::N;
  const uintptr_t ad = reinterpret_cast<uintptr_t>(dst), aa = reinterpret_cast<uintptr_t>(a);
  const uintptr_t ab = kBinary ? reinterpret_cast<uintptr_t>(b) : aa;
  size_t head, npacks;
  if (ad % 16 == aa % 16 && ad % 16 == ab % 16 && ad % sizeof(T) == 0) {
    head = std::min(count, ((16 - ad % 16) % 16) / sizeof(T));
    npacks = (count - head) / N;
  } else {
    head = count;  // different misalignments: element by element
    npacks = 0;
  }
  const size_t work = npacks ? ceil_div(npacks, kUnroll) : count;
  elementwise_kernel<T, F, kBinary>
      <<<grid_for(work), kThreads, 0, stream>>>(dst, a, b, head, npacks, count, f);
  PYCOMM_CUDA_CHECK_LAUNCH();
}

template <bool kScale>
void reduce_impl(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op,
                 double factor, cudaStream_t stream) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (kScale && !std::is_floating_point<typename Codec<T>::Acc>::value) {
      throw UsageError("reduce_scale needs a floating dtype");
    } else {
      dispatch_op(op, [&](auto fn) {
        using Fn = decltype(fn);
        launch<T, true>(static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b),
                        count, ElemOp<T, Fn, kScale>{fn, factor}, stream);
        return 0;
      });
    }
    return 0;
  });
}

// ---- Wire-dtype kernels: plain grid-stride loops (one element per thread
// and trip; the ring's slices are small, these are not the bottleneck).
template <class W>
__global__ void __launch_bounds__(kThreads) to_wire_kernel(W* dst, const float* src, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = Codec<W>::store(src[i]);
  }
}

template <class W>
__global__ void __launch_bounds__(kThreads) from_wire_kernel(float* dst, const W* src, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = Codec<W>::load(src[i]);
  }
}

template <class W, class Fn>
__global__ void __launch_bounds__(kThreads)
    reduce_wire_kernel(float* dst, const float* a, const W* b, size_t n, Fn fn) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = fn(a[i], Codec<W>::load(b[i]));
  }
}

}  // namespace

void launch_to_wire(void* dst, const float* src, size_t count, DType wire, cudaStream_t stream) {
  if (count == 0) return;
  dispatch_wire(wire, [&](auto tag) {
    using W = decltype(tag);
    to_wire_kernel<W><<<grid_for(count), kThreads, 0, stream>>>(static_cast<W*>(dst), src, count);
    PYCOMM_CUDA_CHECK_LAUNCH();
  });
}

void launch_from_wire(float* dst, const void* src, size_t count, DType wire, cudaStream_t stream) {
  if (count == 0) return;
  dispatch_wire(wire, [&](auto tag) {
    using W = decltype(tag);
    from_wire_kernel<W>
        <<<grid_for(count), kThreads, 0, stream>>>(dst, static_cast<const W*>(src), count);
    PYCOMM_CUDA_CHECK_LAUNCH();
  });
}

void launch_reduce_wire(float* dst, const float* a, const void* b, size_t count, DType wire,
                        ReduceOp op, cudaStream_t stream) {
  if (count == 0) return;
  dispatch_wire(wire, [&](auto tag) {
    using W = decltype(tag);
    dispatch_op(op, [&](auto fn) {
      reduce_wire_kernel<W, decltype(fn)>
          <<<grid_for(count), kThreads, 0, stream>>>(dst, a, static_cast<const W*>(b), count, fn);
      PYCOMM_CUDA_CHECK_LAUNCH();
      return 0;
    });
  });
}

void launch_reduce(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op,
                   cudaStream_t stream) {
  reduce_impl<false>(dst, a, b, count, dtype, op, 1.0, stream);
}

void launch_reduce_scale(void* dst, const void* a, const void* b, size_t count, DType dtype,
                         ReduceOp op, double factor, cudaStream_t stream) {
  reduce_impl<true>(dst, a, b, count, dtype, op, factor, stream);
}

void launch_scale(void* dst, size_t count, DType dtype, double factor, cudaStream_t stream) {
  if (!is_floating(dtype)) throw UsageError("scale needs a floating dtype");
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_floating_point<typename Codec<T>::Acc>::value) {
      launch<T, false>(static_cast<T*>(dst), static_cast<const T*>(dst), nullptr, count,
                       ScaleOp<T>{factor}, stream);
    }
    return 0;
  });
}

}  // namespace cuda
}  // namespace pycomm
