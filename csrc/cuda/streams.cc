#include "streams.h"

#include "check.h"

namespace pycomm {
namespace cuda {

DeviceScope::DeviceScope(int device) {
  PYCOMM_CUDA_CHECK(cudaGetDevice(&prev_));
  if (prev_ != device) {
    PYCOMM_CUDA_CHECK(cudaSetDevice(device));
  } else {
    prev_ = -1;
  }
}

DeviceScope::~DeviceScope() {
  if (prev_ >= 0) (void)cudaSetDevice(prev_);
}

cudaEvent_t make_event() {
  cudaEvent_t ev = nullptr;
  PYCOMM_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  return ev;
}

bool event_done(cudaEvent_t ev) {
  const cudaError_t err = cudaEventQuery(ev);
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error; keep it out of later checks
    return false;
  }
  check_cuda(err, "cudaEventQuery(ev)", __FILE__, __LINE__);
  return false;
}

CudaStreams::CudaStreams(int device) : device_(device) {
  DeviceScope scope(device);
  // Non-blocking: no implicit synchronisation with the legacy default stream.
  PYCOMM_CUDA_CHECK(cudaStreamCreateWithFlags(&red_, cudaStreamNonBlocking));
  PYCOMM_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking));
}

CudaStreams::~CudaStreams() {
  // Destroying an event with work pending is allowed: CUDA releases it once
  // the work is done.
  for (cudaEvent_t ev : all_) (void)cudaEventDestroy(ev);
  // The two streams are deliberately never destroyed. The binding records
  // user tensors on them (CUDACachingAllocator::recordStream), and the
  // allocator calls cudaEventRecord on every recorded stream when such a
  // tensor is freed, which may be long after the communicator is closed
  // (e.g. a tensor all-reduced before close() and dropped after it): on a
  // destroyed stream that record fails inside the allocator's deleter (or
  // hits a reused handle). ProcessGroupNCCL avoids this the same way (its
  // streams come from c10's never-destroyed pool). Two streams per
  // CudaStreams (a GPU communicator has two: collectives and user p2p, see
  // cuda_comm.cpp) stay allocated until the process exits.
}

cudaEvent_t CudaStreams::acquire() {
  if (!free_.empty()) {
    cudaEvent_t ev = free_.back();
    free_.pop_back();
    return ev;
  }
  cudaEvent_t ev = make_event();
  all_.push_back(ev);
  return ev;
}

void CudaStreams::begin(cudaStream_t user) {
  // user -> reduction; (user + previous reduction work) -> comm. The
  // reduction stream is already after all previous comm work (every group of
  // the previous operation was waited for on it).
  cudaEvent_t ev = acquire();
  PYCOMM_CUDA_CHECK(cudaEventRecord(ev, user));
  PYCOMM_CUDA_CHECK(cudaStreamWaitEvent(red_, ev, 0));
  release(ev);  // a wait captures the event's state when it is enqueued
  reduction_pending_ = true;
  comm_after_reductions();
}

void CudaStreams::comm_after_reductions() {
  if (!reduction_pending_) return;
  cudaEvent_t ev = acquire();
  PYCOMM_CUDA_CHECK(cudaEventRecord(ev, red_));
  PYCOMM_CUDA_CHECK(cudaStreamWaitEvent(comm_, ev, 0));
  release(ev);
  reduction_pending_ = false;
}

Handle CudaStreams::record_comm() {
  cudaEvent_t ev = acquire();
  try {
    PYCOMM_CUDA_CHECK(cudaEventRecord(ev, comm_));
  } catch (...) {
    release(ev);
    throw;
  }
  return static_cast<Handle>(reinterpret_cast<uintptr_t>(ev));
}

void CudaStreams::reduction_wait(Handle h) {
  cudaEvent_t ev = reinterpret_cast<cudaEvent_t>(static_cast<uintptr_t>(h));
  release(ev);  // reusable as soon as the wait below is enqueued
  PYCOMM_CUDA_CHECK(cudaStreamWaitEvent(red_, ev, 0));
}

void CudaStreams::record_done(cudaEvent_t ev) { PYCOMM_CUDA_CHECK(cudaEventRecord(ev, red_)); }

}  // namespace cuda
}  // namespace pycomm
