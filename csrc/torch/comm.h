// The C++ communicator behind pycomm.Communicator: validates tensors, turns a
// call into a task over raw pointers, runs it on the worker (CPU) and hands
// back a Work. No algorithm logic lives here (see csrc/core/algorithms.h).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../core/algorithms.h"
#include "../core/check.h"
#include "../core/transport.h"
#include "../core/worker.h"

namespace pycomm {

// Handle of one operation: completion, error and a torch Future of its output
// tensors (what DDP comm hooks return).
class Work : public c10::intrusive_ptr_target {
 public:
  Work(std::string op, uint64_t seq, std::vector<at::Tensor> outputs);

  // Blocks until done; rethrows the operation's error (CommError, ...).
  // CudaWork (cuda_comm.cpp) overrides it with stream semantics.
  virtual void wait();
  bool is_completed() const { return future_->completed(); }
  bool is_success() const { return future_->completed() && !future_->hasError(); }
  // Completed with the list of output tensors, or with the error.
  c10::intrusive_ptr<c10::ivalue::Future> future() const { return future_; }
  const std::string& op() const { return op_; }
  uint64_t seq() const { return seq_; }

  // Both ignore a future the user already completed (set_result on the
  // future of a pending op): the op's own outcome is then dropped.
  void complete();
  void fail(std::exception_ptr e);
  // The worker that runs this op: wait() on that thread before completion
  // (from a Future callback) would wait for itself, so it throws instead.
  void set_worker(const Worker* w) { worker_ = w; }
  // Called (with a reason) when wait() on the main thread is interrupted
  // by SIGINT before the op completed: the communicator aborts it.
  void set_on_interrupt(std::function<void(const std::string&)> f) { on_interrupt_ = std::move(f); }

 private:
  std::string op_;
  uint64_t seq_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  const Worker* worker_ = nullptr;
  std::function<void(const std::string&)> on_interrupt_;
  // wait() on the main thread: sleeps in short slices, checking for signals.
  void wait_interruptibly();
};

struct CommOptions {
  int64_t timeout_ms = 300000;
  int64_t slice_bytes = 512 * 1024;
  std::string device = "cpu";
  // Checked mode: compare call fingerprints across ranks before each
  // collective (csrc/core/check.h); a mismatch raises ValueError on all ranks.
  bool check = false;
};

// One tensor-level p2p request of batch_isend_irecv.
struct TensorP2P {
  bool send;
  at::Tensor tensor;
  int peer;
};

class Comm {
 public:
  Comm(std::unique_ptr<Transport> transport, CommOptions options);
  ~Comm();

  int rank() const { return rank_; }
  int world_size() const { return size_; }
  std::string transport_name() const { return transport_name_; }
  std::string device() const { return options_.device; }
  int64_t slice_bytes() const { return options_.slice_bytes; }
  uint64_t seq() const { return seq_; }
  bool closed() const { return closed_; }
  bool aborted() const { return aborted_; }
  bool check() const { return options_.check; }
  void set_check(bool on) { options_.check = on; }  // equal on all ranks, between ops
  // True in a child forked after the communicator was created: its worker
  // thread and connections belong to the parent, so every call raises.
  bool forked() const;

  // Each returns nullptr when async_op is false (it has waited), else a Work.
  // all_reduce: wire_dtype -1, or a DType (float16 / bfloat16) in which a
  // float32 tensor travels (ring_all_reduce_wire).
  c10::intrusive_ptr<Work> all_reduce(const at::Tensor& t, int op, const std::string& algo,
                                      bool async_op, int wire_dtype = -1);
  c10::intrusive_ptr<Work> reduce_scatter(const at::Tensor& out, const at::Tensor& in, int op,
                                          const std::string& algo, bool async_op);
  c10::intrusive_ptr<Work> all_gather(const at::Tensor& out, const at::Tensor& in,
                                      const std::string& algo, bool async_op);
  c10::intrusive_ptr<Work> broadcast(const at::Tensor& t, int src, const std::string& algo,
                                     bool async_op);
  c10::intrusive_ptr<Work> send(const at::Tensor& t, int dst, bool async_op);
  c10::intrusive_ptr<Work> recv(const at::Tensor& t, int src, bool async_op);
  c10::intrusive_ptr<Work> batch_p2p(const std::vector<TensorP2P>& ops);
  // Synchronous unless async_op (then a Work, like the other ops).
  c10::intrusive_ptr<Work> barrier(bool async_op = false);

  // Waits for queued work, then releases the transport. Idempotent.
  void close();
  // Fails pending and future operations at once.
  void abort(const std::string& why);

 private:
  c10::intrusive_ptr<Work> run(const char* op, std::vector<at::Tensor> outputs,
                               std::function<void(const Context&)> body, bool async_op);
  // A Work for the next op (sequence number, worker) after check_open(op).
  c10::intrusive_ptr<Work> new_work(const char* op, std::vector<at::Tensor> tensors);
  // On the worker: fails `work` if an earlier op aborted the communicator.
  bool fail_if_aborted(const c10::intrusive_ptr<Work>& work);
  // User p2p: sync -> post and wait like run(); async -> the task only posts
  // (channel kUser) and the worker's idle poll completes the Work, so a
  // pending isend never blocks a later irecv or collective.
  c10::intrusive_ptr<Work> run_p2p(const char* op, std::vector<at::Tensor> tensors,
                                   std::vector<P2POp> ops, bool async_op);
  // Wraps a collective's body: assigns the collective sequence number when
  // the body runs (execution order, which is what pairs ops across ranks),
  // hands the op header to the transport (checked against the peers' on
  // every transport, op_header.h), then runs the checked-mode fingerprint
  // exchange when enabled.
  std::function<void(const Context&)> collective(OpHeader h,
                                                 std::function<void(const Context&)> body);
  bool poll_deferred();  // on the executing thread; true while any is pending
  void fail_op(const c10::intrusive_ptr<Work>& work, const std::exception& e);
  void check_open(const char* op) const;
  void check_tensor(const at::Tensor& t, const char* arg, const char* op) const;
  void check_peer(int peer, const char* arg, const char* op, bool allow_self) const;
  std::string algo_for(const std::string& algo, const char* op) const;
  std::string all_reduce_algo(const std::string& algo, size_t bytes, bool wire) const;

  std::unique_ptr<Transport> transport_;
  CpuReducer reducer_;
  CommOptions options_;
  int rank_;
  int size_;
  std::string transport_name_;
  std::vector<char> scratch_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<uint64_t> coll_seq_{0};  // collectives only (op headers, checked mode)
  long pid_;                           // creating process (fork detection)
  std::atomic<bool> closed_{false};
  std::atomic<bool> aborted_{false};
  std::mutex abort_mu_;
  std::string abort_reason_;
  struct Deferred {
    c10::intrusive_ptr<Work> work;
    Handle handle;
    std::chrono::steady_clock::time_point deadline;
    std::string peers;  // "send to rank 1, recv from rank 2": for the timeout message
  };
  std::deque<Deferred> deferred_;  // touched only by the executing thread
  std::unique_ptr<Worker> worker_;
  // Thread safety: one thread at a time issues ops (see CallGuard).
  class CallGuard;
  std::atomic<std::thread::id> caller_{};
  bool has_shared_buffers_ = false;
  // algo="auto" runs direct_all_reduce up to this many bytes when the
  // transport shares memory: no limit unless PYCOMM_DIRECT_MAX_BYTES (ctor).
  size_t direct_max_bytes_ = 0;
};

// SIGINT handling, in one place: on the Python main thread, runs pending
// signal handlers (PyErr_CheckSignals, with the GIL) and throws Interrupted
// if one raised (KeyboardInterrupt). Elsewhere it returns at once. Called
// every few tens of milliseconds by blocked waits: the shm transport's
// (Transport::set_interrupt_check) and Work::wait's.
void check_interrupt();
bool on_main_thread();

// at::ScalarType -> DType; throws UsageTypeError (-> TypeError) for the rest.
DType to_dtype(at::ScalarType t, const char* arg);

// Argument checks shared by Comm and CudaComm (cuda_comm.cpp). They throw
// UsageError (-> ValueError) / UsageTypeError (-> TypeError): plain C++
// exceptions, safe without the GIL, translated in bindings.cpp.
std::string join_msg(std::initializer_list<std::string> parts);
void check_tensor(const at::Tensor& t, const char* arg, const char* op, const std::string& device);
void check_peer(int peer, const char* arg, const char* op, int rank, int size, bool allow_self);
ReduceOp to_op(int op, DType dtype, const char* opname);
// all_reduce's wire_dtype (-1: none): a float16/bfloat16 DType for a float32
// tensor, else UsageError (ValueError) naming the problem.
std::optional<DType> to_wire_dtype(int wire_dtype, DType tensor_dtype, const char* opname);
// reduce_scatter / all_gather: equal dtypes and big = world_size x small elements.
void check_scatter_sizes(const at::Tensor& big, const char* big_arg, const at::Tensor& small,
                         const char* small_arg, int world_size, const char* op);

}  // namespace pycomm
