// CudaWork: the Work of an op on the GPU executor (cuda_comm.cpp), with
// ProcessGroupNCCL's stream semantics: wait() orders the caller's current
// stream after the op without blocking the host, and the future is
// CUDA-aware. Compiled only into the CUDAExtension (PYCOMM_WITH_CUDA).
#pragma once

#ifdef PYCOMM_WITH_CUDA

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "../cuda/check.h"
#include "../cuda/streams.h"
#include "work.h"

namespace pycomm {

// An event in `device`'s context: Works are made on the caller's thread,
// whose current device need not be the communicator's (init never calls
// set_device), and recording an event on another device's stream fails.
inline cudaEvent_t event_on(int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  return cuda::make_event();
}

class CudaWork final : public Work {
 public:
  CudaWork(std::string op, uint64_t seq, std::vector<at::Tensor> outputs, int device)
      : Work(std::move(op), seq, std::move(outputs),
             {c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device))}),
        device_(device),
        done_(event_on(device)) {}
  ~CudaWork() override { (void)cudaEventDestroy(done_); }

  // The op is enqueued: completes the CUDA-aware future with an event on
  // `stream` (the one `done` was recorded on), like ProcessGroupNCCL. The
  // future records events on the devices of its value's storages; an op
  // without outputs (barrier, an empty batch) names `anchor`'s instead, so
  // that its future is still ordered after the op.
  void enqueued(const c10::cuda::CUDAStream& stream, const at::Tensor& anchor) {
    c10::cuda::CUDAStreamGuard guard(stream);
    if (outputs().empty()) {
      complete_future(
          std::vector<c10::ivalue::Future::WeakStorage>{anchor.storage().getWeakStorageImpl()});
    } else {
      complete_future();
    }
  }
  // wait() also blocks the host until the op is done (barrier, like
  // ProcessGroupNCCL's), through `host_wait` (bounded by the timeout).
  void set_host_wait(std::function<void(cudaEvent_t)> host_wait) {
    host_wait_ = std::move(host_wait);
  }

  // The watchdog saw `done` pass / the op failed after (or while) enqueueing.
  void complete() override { state_ = kDone; }
  void fail(std::exception_ptr e) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!error_) error_ = e;
    }
    state_ = kFailed;
    Work::fail(std::move(e));  // only if the future was not completed yet
  }
  bool is_completed() const override { return state_ != kPending; }
  bool is_success() const override { return state_ == kDone; }

  // Stream semantics, like ProcessGroupNCCL's WorkNCCL::wait(): the caller's
  // current stream waits for the operation; the host does not block. Raises
  // if the operation has already failed.
  void wait() override {
    rethrow_if_failed();
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    PYCOMM_CUDA_CHECK(cudaStreamWaitEvent(
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream(), done_,
        0));
    if (host_wait_) {
      host_wait_(done_);
      rethrow_if_failed();
    }
  }
  void rethrow_if_failed() const {
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lk(mu_);
      e = error_;
    }
    if (e) report(e);
  }

  cudaEvent_t done() const { return done_; }

 private:
  enum State { kPending, kDone, kFailed };
  int device_;
  cudaEvent_t done_;
  std::atomic<State> state_{kPending};
  mutable std::mutex mu_;
  std::exception_ptr error_;
  std::function<void(cudaEvent_t)> host_wait_;
};

}  // namespace pycomm

#endif  // PYCOMM_WITH_CUDA
