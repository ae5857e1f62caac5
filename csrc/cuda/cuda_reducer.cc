#include "cuda_reducer.h"

#include <cstring>

#include "check.h"
#include "reduce_kernels.h"
#include "streams.h"

namespace pycomm {
namespace cuda {

void CudaReducer::reduce(void* dst, const void* a, const void* b, size_t count, DType dtype,
                         ReduceOp op) {
  if (count == 0) return;
  launch_reduce(dst, a, b, count, dtype, op, streams_.reduction());
  streams_.note_reduction();
}

void CudaReducer::reduce_scale(void* dst, const void* a, const void* b, size_t count, DType dtype,
                               ReduceOp op, double factor) {
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

CudaReducer::~CudaReducer() {
  // Destructors never throw: a failed wait leaves the buffer to the process.
  if (staged_ != nullptr && cudaEventSynchronize(staged_) == cudaSuccess && pinned_ != nullptr) {
    (void)cudaFreeHost(pinned_);
  }
  if (staged_ != nullptr) (void)cudaEventDestroy(staged_);
}

void* CudaReducer::staging(size_t bytes) {
  // Host reads of GPU data (checked mode's fingerprints) cannot be captured
  // into a CUDA graph: say so before touching anything.
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  PYCOMM_CUDA_CHECK(cudaStreamIsCapturing(streams_.reduction(), &st));
  if (st != cudaStreamCaptureStatusNone) {
    throw UsageError(
        "checked mode reads every collective's fingerprints on the host, which CUDA graph "
        "capture does not allow; turn checked mode off (comm.check = False) while capturing");
  }
  if (staged_ == nullptr) staged_ = make_event();
  // The previous upload may still be reading the buffer.
  host_wait_(staged_);
  if (bytes > pinned_bytes_) {
    if (pinned_ != nullptr) PYCOMM_CUDA_CHECK(cudaFreeHost(pinned_));
    pinned_ = nullptr;
    pinned_bytes_ = 0;
    PYCOMM_CUDA_CHECK(cudaMallocHost(&pinned_, bytes));
    pinned_bytes_ = bytes;
  }
  return pinned_;
}

void CudaReducer::upload(void* dst, const void* host, size_t bytes) {
  if (bytes == 0) return;
  void* buf = staging(bytes);
  std::memcpy(buf, host, bytes);
  PYCOMM_CUDA_CHECK(cudaMemcpyAsync(dst, buf, bytes, cudaMemcpyHostToDevice, streams_.reduction()));
  PYCOMM_CUDA_CHECK(cudaEventRecord(staged_, streams_.reduction()));
  streams_.note_reduction();
}

void CudaReducer::download(void* host, const void* src, size_t bytes) {
  if (bytes == 0) return;
  void* buf = staging(bytes);
  PYCOMM_CUDA_CHECK(cudaMemcpyAsync(buf, src, bytes, cudaMemcpyDeviceToHost, streams_.reduction()));
  PYCOMM_CUDA_CHECK(cudaEventRecord(staged_, streams_.reduction()));
  streams_.note_reduction();
  host_wait_(staged_);  // the transfers before it included: bounded by the timeout
  std::memcpy(host, buf, bytes);
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

void CudaReducer::quantize(QuantFormat f, void* dst, const float* src, size_t count, size_t block,
                           float* err) {
  if (count == 0) return;
  launch_quantize(f, dst, src, count, block, err, streams_.reduction());
  streams_.note_reduction();
}

void CudaReducer::dequantize(QuantFormat f, float* dst, const void* src, size_t count, size_t block,
                             bool add) {
  if (count == 0) return;
  launch_dequantize(f, dst, src, count, block, add, streams_.reduction());
  streams_.note_reduction();
}

}  // namespace cuda
}  // namespace pycomm
