// The block-scaled 8-bit wire's kernels (quant.h's contract): the arithmetic
// of csrc/core/quant_codec.h, the functions the CPU runs, so scales, codes,
// values and errors are bitwise the CPU's, NaN payloads aside (-fmad=false
// keeps the error and the accumulation two roundings each, as on the CPU).
//
// quantize: one CUDA block per quantization block (striding over them when
// there are more than the grid holds). Its threads find the block's largest
// magnitude and whether it is finite (max is exact, so the order of the
// reduction does not matter), then encode an element each per trip.
// dequantize: a grid-stride loop, one element per thread and trip.
#include <cstdint>

#include "../core/quant_codec.h"
#include "check.h"
#include "reduce_kernels.h"

namespace pycomm {
namespace cuda {
namespace {

constexpr int kQuantThreads = 256;
constexpr int kWarps = kQuantThreads / 32;
constexpr size_t kMaxQuantGrid = size_t{1} << 20;  // blocks of threads; more stride

// The largest |x| of x[0, n) and whether every x is finite, on every thread
// of the block.
__device__ float block_absmax(const float* x, size_t n, bool* finite) {
  __shared__ float warp_max[kWarps];
  __shared__ int warp_finite[kWarps];
  float m = 0.0f;
  bool ok = true;
  for (size_t i = threadIdx.x; i < n; i += kQuantThreads) {
    const float a = fabsf(x[i]);
    ok = ok && a <= FLT_MAX;  // false for inf and NaN
    m = a > m ? a : m;
  }
  for (int d = 16; d > 0; d >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, m, d);
    m = o > m ? o : m;
  }
  ok = __all_sync(0xffffffffu, ok);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_max[warp] = m;
    warp_finite[warp] = ok;
  }
  __syncthreads();
  m = 0.0f;
  ok = true;
  for (int w = 0; w < kWarps; ++w) {
    m = warp_max[w] > m ? warp_max[w] : m;
    ok = ok && warp_finite[w];
  }
  __syncthreads();  // the shared slots are free for the next block
  *finite = ok;
  return m;
}

template <class Codes>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_kernel(char* scales, uint8_t* codes, const float* src, size_t count, size_t block,
                    float* err) {
  const size_t blocks = ceil_div(count, block);
  for (size_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const size_t lo = b * block, n = count - lo < block ? count - lo : block;
    bool finite;
    const float absmax = block_absmax(src + lo, n, &finite);
    const BlockScale s = scale_of(absmax, finite, Codes::kMax);
    if (threadIdx.x == 0) memcpy(scales + b * sizeof(float), &s.scale, sizeof(float));
    for (size_t i = threadIdx.x; i < n; i += kQuantThreads) {
      const size_t k = lo + i;
      if (!finite) {  // a NaN block's codes are 0, and so is its error
        codes[k] = 0;
        if (err) err[k] = 0.0f;
        continue;
      }
      const float x = src[k];
      const uint8_t c = Codes::encode(x * s.to_code);
      codes[k] = c;
      if (err) err[k] = x - s.scale * quant_value(Codes::kFormat, c);
    }
  }
}

template <QuantFormat kFormat>
__global__ void __launch_bounds__(kQuantThreads)
    dequantize_kernel(float* dst, const char* scales, const uint8_t* codes, size_t count,
                      size_t block, bool add) {
  const size_t stride = static_cast<size_t>(gridDim.x) * kQuantThreads;
  for (size_t i = static_cast<size_t>(blockIdx.x) * kQuantThreads + threadIdx.x; i < count;
       i += stride) {
    float scale;
    memcpy(&scale, scales + (i / block) * sizeof(float), sizeof(float));
    const float v = scale * quant_value(kFormat, codes[i]);
    dst[i] = add ? dst[i] + v : v;
  }
}

unsigned grid_of(size_t n) {
  return static_cast<unsigned>(n < kMaxQuantGrid ? (n ? n : 1) : kMaxQuantGrid);
}

}  // namespace

void launch_quantize(QuantFormat f, void* dst, const float* src, size_t count, size_t block,
                     float* err, cudaStream_t stream) {
  if (count == 0) return;
  char* scales = static_cast<char*>(dst);
  const size_t blocks = ceil_div(count, block);
  uint8_t* codes = reinterpret_cast<uint8_t*>(scales + blocks * sizeof(float));
  const unsigned grid = grid_of(blocks);
  switch (f) {
    case QuantFormat::kInt8:
      quantize_kernel<Int8Codes>
          <<<grid, kQuantThreads, 0, stream>>>(scales, codes, src, count, block, err);
      break;
    case QuantFormat::kFp8E4M3:
      quantize_kernel<E4M3Codes>
          <<<grid, kQuantThreads, 0, stream>>>(scales, codes, src, count, block, err);
      break;
    case QuantFormat::kFp8E5M2:
      quantize_kernel<E5M2Codes>
          <<<grid, kQuantThreads, 0, stream>>>(scales, codes, src, count, block, err);
      break;
  }
  PYCOMM_CUDA_CHECK_LAUNCH();
}

void launch_dequantize(QuantFormat f, float* dst, const void* src, size_t count, size_t block,
                       bool add, cudaStream_t stream) {
  if (count == 0) return;
  const char* scales = static_cast<const char*>(src);
  const uint8_t* codes =
      reinterpret_cast<const uint8_t*>(scales + ceil_div(count, block) * sizeof(float));
  const unsigned grid = grid_of(ceil_div(count, kQuantThreads));
  switch (f) {
    case QuantFormat::kInt8:
      dequantize_kernel<QuantFormat::kInt8>
          <<<grid, kQuantThreads, 0, stream>>>(dst, scales, codes, count, block, add);
      break;
    case QuantFormat::kFp8E4M3:
      dequantize_kernel<QuantFormat::kFp8E4M3>
          <<<grid, kQuantThreads, 0, stream>>>(dst, scales, codes, count, block, add);
      break;
    case QuantFormat::kFp8E5M2:
      dequantize_kernel<QuantFormat::kFp8E5M2>
          <<<grid, kQuantThreads, 0, stream>>>(dst, scales, codes, count, block, add);
      break;
  }
  PYCOMM_CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace pycomm
