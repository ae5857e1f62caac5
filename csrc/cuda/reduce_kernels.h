// CUDA reduction kernels over raw device pointers (no torch). Every op x dtype
// of the CPU path, computed by the same functors (csrc/core/elementwise.h), so
// a GPU result is bitwise the CPU result for the same inputs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "../core/quant.h"
#include "../core/types.h"

namespace pycomm {
namespace cuda {

// dst[i] = op(a[i], b[i]) for i < count, enqueued on `stream`. dst may alias a
// or b exactly (not partially). AVG combines as SUM.
void launch_reduce(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op,
                   cudaStream_t stream);

// dst[i] = scale(op(a[i], b[i]), factor): the last reduce-scatter step of AVG
// fused into one pass. Bitwise equal to launch_reduce followed by launch_scale
// (the combined value is rounded to the storage type before it is scaled).
void launch_reduce_scale(void* dst, const void* a, const void* b, size_t count, DType dtype,
                         ReduceOp op, double factor, cudaStream_t stream);

// dst[i] *= factor (floating dtypes only; computed like pycomm::scale_one).
void launch_scale(void* dst, size_t count, DType dtype, double factor, cudaStream_t stream);

// The wire-dtype operations of ring_all_reduce_wire (csrc/core/reduce.h):
// float32 data, `wire` = kFloat16 or kBFloat16 (UsageError otherwise), the
// codec of elementwise.h, so the results are bitwise the CPU ones.
// dst[i] = wire(src[i])
void launch_to_wire(void* dst, const float* src, size_t count, DType wire, cudaStream_t stream);
// dst[i] = float(src[i])
void launch_from_wire(float* dst, const void* src, size_t count, DType wire, cudaStream_t stream);
// dst[i] = op(a[i], float(b[i])) in float32; dst may alias a.
void launch_reduce_wire(float* dst, const float* a, const void* b, size_t count, DType wire,
                        ReduceOp op, cudaStream_t stream);

// The block-scaled 8-bit wire of quantized_all_reduce (quant.h for the
// layout and the contract; quant_kernels.cu): bitwise cpu_quantize and
// cpu_dequantize (NaN payloads aside), enqueued on `stream`.
void launch_quantize(QuantFormat f, void* dst, const float* src, size_t count, size_t block,
                     float* err, cudaStream_t stream);
void launch_dequantize(QuantFormat f, float* dst, const void* src, size_t count, size_t block,
                       bool add, cudaStream_t stream);

}  // namespace cuda
}  // namespace pycomm
