// One op's handle (Work) and SIGINT handling for the waits of the binding.
// Errors are plain C++ exceptions (core/types.h), translated in bindings.cpp.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace pycomm {

struct CompletionFlag;  // below

class Worker;

// Handle of one operation: completion, error and a torch Future of its output
// tensors.
//
// CPU: the future completes when the op has (on the worker thread).
// GPU (CudaWork, cuda_work.h): the future is CUDA-aware, like
// ProcessGroupNCCL's: it is completed as soon as the op is enqueued, carrying
// events on the communicator's stream, so value(), wait() and then()
// callbacks are ordered on the caller's current stream without blocking the
// host. is_completed()/wait() follow the GPU work itself.
class Work : public c10::intrusive_ptr_target {
 public:
  Work(std::string op, uint64_t seq, std::vector<at::Tensor> outputs,
       std::vector<c10::Device> devices = {});

  // CPU: blocks until done and rethrows the op's error (CommError, ...).
  // GPU: the caller's current stream waits for the op (the host does not).
  virtual void wait();
  virtual bool is_completed() const { return future_->completed(); }
  virtual bool is_success() const { return future_->completed() && !future_->hasError(); }
  // Completed with the list of output tensors, or with the error.
  c10::intrusive_ptr<c10::ivalue::Future> future() const { return future_; }
  const std::string& op() const { return op_; }
  uint64_t seq() const { return seq_; }

  // The op finished / failed (called by the executor). Both ignore a future
  // the user already completed (set_result on the future of a pending op):
  // the op's own outcome is then dropped.
  virtual void complete();
  virtual void fail(std::exception_ptr e);
  // The worker that runs this op. wait() on that thread (from a Future
  // callback) before completion cannot block: the worker would wait for
  // itself. Ops issued there run at once (nested), so they are complete;
  // a pending isend/irecv is driven by calling `pump` (which polls them and
  // returns whether any is still pending) until it completes; anything else
  // (an op queued behind the running one) throws instead of deadlocking.
  void set_worker(const Worker* w) { worker_ = w; }
  void set_pump(std::function<bool(const Work* target)> pump) { pump_ = std::move(pump); }
  // One round of the pump for this op: whether it is still pending after it.
  bool drive() { return pump_ && !future_->completed() && pump_(this); }
  // Called (with a reason) when wait() on the main thread is interrupted
  // by SIGINT before the op completed: the communicator aborts it.
  void set_on_interrupt(std::function<void(const std::string&)> f) { on_interrupt_ = std::move(f); }
  // Set when wait() raises the op's error: the caller has seen a failure
  // (Comm::close reports one nobody saw).
  void set_reported_flag(std::shared_ptr<std::atomic<bool>> flag) { reported_ = std::move(flag); }
  // Blocks until `flag` is set, in short slices; on the main thread SIGINT
  // ends the wait with Interrupted after aborting the op (on_interrupt).
  // wait() uses it with the flag of the op's completion.
  void wait_interruptibly(const std::shared_ptr<CompletionFlag>& flag);
  // Whether waiting for this op blocks the host on every device (a
  // barrier's, as ProcessGroupNCCL's; the GPU executor's Work.wait() reads
  // it). Set by Comm before the op runs.
  bool waits_on_host() const { return waits_on_host_; }
  void set_waits_on_host(bool on) { waits_on_host_ = on; }
  // A single recv's sender (torch's Work.source_rank): its peer, or for a
  // receive from any source the rank matched, written by the executing thread
  // before the op completes (-1 until then, and for other ops).
  int source_rank() const { return source_rank_; }
  void set_source_rank(int r) { source_rank_ = r; }
  int* source_rank_slot() { return &source_rank_; }

 protected:
  const std::vector<at::Tensor>& outputs() const { return outputs_; }
  // Rethrows e after noting that the caller saw a failure.
  [[noreturn]] void report(std::exception_ptr e) const;
  // Completes the future with the outputs (unless the user set a result
  // already); `storages` names the memory its events cover when the outputs
  // have none (a CUDA-aware future of an op without outputs).
  void complete_future(std::optional<std::vector<c10::ivalue::Future::WeakStorage>> storages = {});

 private:
  std::string op_;
  uint64_t seq_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  const Worker* worker_ = nullptr;
  std::function<bool(const Work*)> pump_;  // polls, driving `target` (this Work) too
  std::function<void(const std::string&)> on_interrupt_;
  std::shared_ptr<std::atomic<bool>> reported_;
  bool waits_on_host_ = false;
  int source_rank_ = -1;
};

// A flag that a callback on `future` sets when it completes, for waits with a
// deadline or a poll: wait on `cv` under `mu` until `done`.
struct CompletionFlag {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  void set() {
    std::lock_guard<std::mutex> lk(mu);
    done = true;
    cv.notify_all();
  }
};
std::shared_ptr<CompletionFlag> completion_flag(const c10::intrusive_ptr<c10::ivalue::Future>& f);

// SIGINT handling, in one place: on the Python main thread, runs pending
// signal handlers (PyErr_CheckSignals, with the GIL) and throws Interrupted
// if one raised (KeyboardInterrupt). Elsewhere it returns at once. Called
// every few tens of milliseconds by blocked waits: the shm transport's
// (Transport::set_interrupt_check) and Work::wait's.
void check_interrupt();
bool on_main_thread();

}  // namespace pycomm
