// pycomm::Reducer on the GPU: every call enqueues a kernel (or a D2D copy) on
// the communicator's reduction stream and returns at once. Ordering against
// transfers comes from CudaStreams (see streams.h): the kernel runs after the
// groups the algorithm wait()ed for, and the next NCCL group waits for it.
#pragma once

#include "../core/reduce.h"
#include "streams.h"

namespace pycomm {
namespace cuda {

class CudaReducer final : public Reducer {
 public:
  explicit CudaReducer(CudaStreams& streams) : streams_(streams) {}

  void reduce(void* dst, const void* a, const void* b, size_t count, DType dtype,
              ReduceOp op) override;
  void reduce_scale(void* dst, const void* a, const void* b, size_t count, DType dtype,
                    ReduceOp op, double factor) override;
  void scale(void* dst, size_t count, DType dtype, double factor) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void to_wire(void* dst, const float* src, size_t count, DType wire) override;
  void from_wire(float* dst, const void* src, size_t count, DType wire) override;
  void reduce_wire(float* dst, const float* a, const void* b, size_t count, DType wire,
                   ReduceOp op) override;

 private:
  CudaStreams& streams_;
};

}  // namespace cuda
}  // namespace pycomm
