// Reduction kernels: each block owns one tile of kUnroll x kTileThreads
// 16-byte packs (one LDG.128 per operand per pack, all of a thread's loads
// issued before its stores), and the grid has one block per tile. That is the
// shape of torch's vectorized elementwise kernels: the many short blocks let
// the hardware keep every SM's memory pipeline full, where a bounded grid of
// long-lived 512-thread blocks looping over the data stayed below a copy's
// bandwidth (benchmarks/results/gpu/kernel-probe-2026-11-27 compares the
// shapes). The few elements before the first and after the last aligned pack
// go one by one.
//
// The arithmetic is pycomm::combine / pycomm::scale_one from
// csrc/core/elementwise.h, the very functors the CPU path runs (fp16/bf16
// accumulate in fp32, RNE back). Build with -fmad=false (setup.py does): no
// FMA contraction, so every result is bitwise the CPU one.
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

constexpr int kThreads = 512;      // wire kernels (plain grid-stride loops)
constexpr int kBlocksPerSM = 4;    // 4 x 512 threads = 2048 = a full H100 SM
constexpr int kTileThreads = 128;  // reduction kernels: threads per block
constexpr int kUnroll = 4;         // packs per thread and operand
constexpr size_t kTilePacks = static_cast<size_t>(kUnroll) * kTileThreads;

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
// done one by one (grid-stride over the whole grid); the packs in between are
// 16-byte aligned in all three arrays, one tile per block. dst may equal a
// (and b): each thread reads an element before it writes it, and no two
// threads touch the same element.
template <class T, class F, bool kBinary>
__global__ void __launch_bounds__(kTileThreads)
    elementwise_kernel(T* dst, const T* a, const T* b, size_t head, size_t npacks, size_t count,
                       F f) {
  using P = Pack<T>;
  constexpr int N = P::N;
  const size_t tail = head + npacks * N;
  const size_t scalars = head + (count - tail);
  const size_t nthreads = static_cast<size_t>(gridDim.x) * kTileThreads;
  for (size_t i = static_cast<size_t>(blockIdx.x) * kTileThreads + threadIdx.x; i < scalars;
       i += nthreads) {
    const size_t j = i < head ? i : tail + (i - head);
    dst[j] = f(a[j], kBinary ? b[j] : a[j]);
  }

  // This block's tile (launch() sizes the grid to one block per tile).
  P* pd = reinterpret_cast<P*>(dst + head);
  const P* pa = reinterpret_cast<const P*>(a + head);
  const P* pb = reinterpret_cast<const P*>((kBinary ? b : a) + head);
  const size_t base = static_cast<size_t>(blockIdx.x) * kTilePacks + threadIdx.x;
  P x[kUnroll], y[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const size_t p = base + static_cast<size_t>(u) * kTileThreads;
    if (p < npacks) {
      x[u] = pa[p];
      if constexpr (kBinary) y[u] = pb[p];
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const size_t p = base + static_cast<size_t>(u) * kTileThreads;
    if (p < npacks) {
#pragma unroll
      for (int e = 0; e < N; ++e) x[u].v[e] = f(x[u].v[e], kBinary ? y[u].v[e] : x[u].v[e]);
      pd[p] = x[u];
    }
  }
}

constexpr size_t kMaxGrid = 0x7fffffff;  // gridDim.x's limit

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
  const size_t tiles = ceil_div(npacks, kTilePacks);
  if (tiles > kMaxGrid) {
    throw UsageError(cat("reduction of ", count, " elements exceeds one kernel launch's grid"));
  }
  // One block per tile; the scalars (every element when the three arrays are
  // misaligned differently) share that grid, or get one block per tile's
  // worth of them if there are more.
  const size_t scalar_blocks = ceil_div(count - npacks * N, kTilePacks);
  const unsigned blocks =
      static_cast<unsigned>(std::clamp<size_t>(std::max(tiles, scalar_blocks), 1, kMaxGrid));
  elementwise_kernel<T, F, kBinary>
      <<<blocks, kTileThreads, 0, stream>>>(dst, a, b, head, npacks, count, f);
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
