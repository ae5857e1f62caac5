// CUDA reduction kernels over raw device pointers (no torch). Every op x dtype
// of the CPU path, computed by the same functors (csrc/core/elementwise.h), so
// a GPU result is bitwise the CPU result for the same inputs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

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

}  // namespace cuda
}  // namespace pycomm
