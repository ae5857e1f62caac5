// pycomm::Reducer on the GPU: every call enqueues a kernel (or a D2D copy) on
// the communicator's reduction stream and returns at once. Ordering against
// transfers comes from CudaStreams (see streams.h): the kernel runs after the
// groups the algorithm wait()ed for, and the next NCCL group waits for it.
#pragma once

#include <functional>

#include "../core/reduce.h"
#include "streams.h"

namespace pycomm {
namespace cuda {

class CudaReducer final : public Reducer {
 public:
  // `host_wait` blocks the host until an event on the reduction stream has
  // completed, bounded by the communicator's timeout (NcclComm::host_wait):
  // download() uses it, so a dead peer cannot hang a host read.
  CudaReducer(CudaStreams& streams, std::function<void(cudaEvent_t)> host_wait)
      : streams_(streams), host_wait_(std::move(host_wait)) {}
  ~CudaReducer() override;

  void reduce(void* dst, const void* a, const void* b, size_t count, DType dtype,
              ReduceOp op) override;
  void reduce_scale(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op,
                    double factor) override;
  void scale(void* dst, size_t count, DType dtype, double factor) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  // Through a pinned staging buffer (grown on demand), so the copy is
  // asynchronous and its completion observable by an event.
  void upload(void* dst, const void* host, size_t bytes) override;
  void download(void* host, const void* src, size_t bytes) override;
  void to_wire(void* dst, const float* src, size_t count, DType wire) override;
  void from_wire(float* dst, const void* src, size_t count, DType wire) override;
  void reduce_wire(float* dst, const float* a, const void* b, size_t count, DType wire,
                   ReduceOp op) override;
  void quantize(QuantFormat f, void* dst, const float* src, size_t count, size_t block,
                float* err) override;
  void dequantize(QuantFormat f, float* dst, const void* src, size_t count, size_t block,
                  bool add) override;

 private:
  void* staging(size_t bytes);  // pinned host memory of at least `bytes`

  CudaStreams& streams_;
  std::function<void(cudaEvent_t)> host_wait_;
  void* pinned_ = nullptr;
  size_t pinned_bytes_ = 0;
  cudaEvent_t staged_ = nullptr;  // the staging buffer's last use
};

}  // namespace cuda
}  // namespace pycomm
