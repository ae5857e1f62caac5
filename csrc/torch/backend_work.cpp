// BackendWork (backend.h): the c10d::Work of every op of the c10d backend.
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "backend.h"
#include "backend_util.h"

namespace pycomm {

using namespace backend_detail;  // NOLINT(google-build-using-namespace)

BackendWork::BackendWork(int rank, c10d::OpType type, c10::intrusive_ptr<pycomm::Work> op,
                         c10::intrusive_ptr<c10::ivalue::Future> future,
                         std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type),
      op_(std::move(op)),
      future_(std::move(future)),
      outputs_(std::move(outputs)) {}

bool BackendWork::isCompleted() { return future_->completed() && (!op_ || op_->is_completed()); }

bool BackendWork::isSuccess() const {
  return future_->completed() && !future_->hasError() && (!op_ || op_->is_success());
}

std::exception_ptr BackendWork::exception() const {
  if (future_->completed() && future_->hasError()) return future_->exception_ptr();
  if (op_ && op_->is_completed() && !op_->is_success()) {
    // CUDA: the op failed after its future was completed (at the enqueue);
    // its wait() rethrows that error before it touches any stream.
    try {
      op_->wait();
    } catch (...) {
      return std::current_exception();
    }
  }
  return nullptr;
}

std::vector<at::Tensor> BackendWork::result() { return outputs_; }

int BackendWork::sourceRank() const {
  if (op_ && op_->source_rank() >= 0) return op_->source_rank();
  return c10d::Work::sourceRank();  // raises: not a recv
}

void BackendWork::synchronize() {
  if (future_->devices().empty()) return;  // CPU: nothing is stream-ordered
  if (op_) op_->wait();
  future_->wait();
}

bool BackendWork::wait(std::chrono::milliseconds timeout) {
  if (timeout != kNoTimeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto timed_out = [&] {
      return std::runtime_error("pycomm backend: " + c10d::opTypeToString(opType_) +
                                " did not complete within " + std::to_string(timeout.count()) +
                                " ms (Work.wait timeout)");
    };
    if (!future_->completed()) {
      auto done = completion_flag(future_);
      std::unique_lock<std::mutex> lk(done->mu);
      if (!done->cv.wait_until(lk, deadline, [&] { return done->done; })) throw timed_out();
    }
    // CUDA: the future completed at the enqueue; the host waits for the GPU
    // (polling the op's state, as ProcessGroupNCCL's wait with a timeout).
    while (op_ && !op_->is_completed()) {
      if (std::chrono::steady_clock::now() >= deadline) throw timed_out();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  // The pycomm op first. CPU: blocks until done; its wait() throws rather
  // than deadlock when called on the worker thread (inside a Future
  // callback) before completion. CUDA: the current stream waits for the op;
  // an error met after the enqueue is raised.
  if (op_) op_->wait();
  // CPU: the copy back; CUDA: the current stream waits for the future's
  // events (recorded after the copy back).
  future_->wait();
  if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
  return true;
}

}  // namespace pycomm
