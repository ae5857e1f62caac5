// The two streams a GPU communicator enqueues on, and the events between them.
// (The binding has one CudaStreams per lane: the collectives' and the user
// p2p one, whose reduction stream only joins its NCCL groups; cuda_comm.cpp.)
//
//   reduction stream  reduction kernels and copies (CudaReducer) and, through
//                     Transport::wait(h), the completion of every transfer
//                     group. This is "the communicator's stream": once it has
//                     drained, the whole operation has (see record_done).
//   comm stream       every NCCL call: the ncclSend/ncclRecv groups of the ring
//                     algorithms and the native collectives (algo="nccl").
//
// Why slice k+1 is transferred while slice k is reduced. The ring pipeline in
// csrc/core/algorithms.cc issues, for k = 0, 1, ...:
//
//     post(k+1)   comm stream:      wait(last reduction event) ; group k+1 ; record E[k+1]
//     wait(k)     reduction stream: wait(E[k])
//     finish(k)   reduction stream: reduce slice k
//
// With one stream, group k+1 would sit in front of reduce(k) and the two would
// serialise. With two, the GPU sees two dependency chains that only meet at
// events: reduce(k) needs group k (E[k]); group k+1 needs only the reductions
// enqueued before it was posted, i.e. up to reduce(k-1) (it reads data
// finished no later than item k-1 and receives into the scratch slot reduce(k-1)
// read; algorithms.cc guarantees nothing newer is touched). So group k+1 and
// reduce(k) run concurrently on different SMs (NCCL uses a few channels' worth
// of blocks, the reduction kernel fills the rest), and the host returns as soon
// as everything is enqueued: wait() never blocks the host.
//
// Plain C++17 + CUDA runtime: no torch.
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "../core/transport.h"

namespace pycomm {
namespace cuda {

// Makes `device` current for the scope, restoring the previous one.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = -1;
};

// Not thread-safe: one operation at a time enqueues (the binding holds a lock).
class CudaStreams {
 public:
  explicit CudaStreams(int device);
  ~CudaStreams();  // destroys the events, never the streams (see streams.cc)
  CudaStreams(const CudaStreams&) = delete;
  CudaStreams& operator=(const CudaStreams&) = delete;

  int device() const { return device_; }
  cudaStream_t reduction() const { return red_; }
  cudaStream_t comm() const { return comm_; }

  // Starts an operation: both streams wait for everything enqueued so far on
  // `user` (the caller's current stream) and on each other, so an operation
  // never races the previous one over the scratch buffer or user tensors.
  void begin(cudaStream_t user);

  // A reduction/copy was just enqueued on the reduction stream.
  void note_reduction() { reduction_pending_ = true; }

  // Makes the comm stream wait for every reduction enqueued so far (no-op if
  // none was enqueued since the last call). Called by every NCCL enqueue.
  void comm_after_reductions();

  // Records a pooled event on the comm stream and returns it as a Handle.
  Handle record_comm();

  // The reduction stream waits for handle h (from record_comm); h is released.
  void reduction_wait(Handle h);

  // Records `ev` (owned by the caller) on the reduction stream: it completes
  // when the operation begun by begin() has, because every transfer group was
  // waited for on the reduction stream (Transport contract: each handle is
  // waited for exactly once).
  void record_done(cudaEvent_t ev);

 private:
  cudaEvent_t acquire();
  void release(cudaEvent_t ev) { free_.push_back(ev); }

  int device_;
  cudaStream_t red_ = nullptr;
  cudaStream_t comm_ = nullptr;
  std::vector<cudaEvent_t> all_;
  std::vector<cudaEvent_t> free_;
  bool reduction_pending_ = false;
};

// cudaEventCreateWithFlags(cudaEventDisableTiming), checked.
cudaEvent_t make_event();
// True once `ev` has completed; false while pending; throws on a CUDA error.
bool event_done(cudaEvent_t ev);

}  // namespace cuda
}  // namespace pycomm
