#include "cuda_reducer.h"

#include "check.h"
#include "reduce_kernels.h"

namespace pycomm {
namespace cuda {

void CudaReducer::reduce(void* dst, const void* a, const void* b, size_t count, DType dtype,
                         ReduceOp op) {
  if (count == 0) return;
  launch_reduce(dst, a, b, count, dtype, op, streams_.reduction());
  streams_.note_reduction();
}

void CudaReducer::reduce_scale(void* dst, const void* a, const void* b, size_t count,
                               DType dtype, ReduceOp op, double factor) {
  if (count == 0) return;
  launch_reduce_scale(dst, a, b, count, dtype, op, factor, streams_.reduction());
  streams_.note_reduction();
}

void CudaReducer::scale(void* dst, size_t count, DType dtype, double factor) {
  if (count == 0) return;
  launch_scale(dst, count, dtype, factor, streams_.reduction());
  streams_.note_reduction();
}

void CudaReducer::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  PYCOMM_CUDA_CHECK(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, streams_.reduction()));
  streams_.note_reduction();
}

void CudaReducer::to_wire(void* dst, const float* src, size_t count, DType wire) {
  if (count == 0) return;
  launch_to_wire(dst, src, count, wire, streams_.reduction());
  streams_.note_reduction();
}

void CudaReducer::from_wire(float* dst, const void* src, size_t count, DType wire) {
  if (count == 0) return;
  launch_from_wire(dst, src, count, wire, streams_.reduction());
  streams_.note_reduction();
}

void CudaReducer::reduce_wire(float* dst, const float* a, const void* b, size_t count, DType wire,
                              ReduceOp op) {
  if (count == 0) return;
  launch_reduce_wire(dst, a, b, count, wire, op, streams_.reduction());
  streams_.note_reduction();
}

}  // namespace cuda
}  // namespace pycomm
