// The C++ communicator behind pycomm.Communicator, one class for CPU and GPU.
//
//   Comm      every op once: argument checks, the algorithm choice, the op
//             header (op_header.h) and checked mode, and the body that calls
//             the algorithm (csrc/core/algorithms.h) over raw pointers.
//   Executor  where a body runs and how its completion is observed; the only
//             part that differs between devices:
//               CpuExecutor (comm.cpp)        a worker thread; a Work completes
//                                             when its body has returned;
//               CudaExecutor (cuda_comm.cpp)  the caller's thread enqueues the
//                                             body on the communicator's CUDA
//                                             streams; a watchdog completes
//                                             Works as their events pass.
//   Work      one op's handle and its torch Future (what DDP hooks return).
//
// No algorithm logic lives here. Errors are plain C++ exceptions (UsageError,
// UsageTypeError, CommError, Interrupted: core/types.h), thrown with or
// without the GIL and translated in one place (bindings.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../core/algorithms.h"
#include "../core/check.h"
#include "../core/transport.h"
#include "../core/worker.h"

namespace pycomm {

struct CompletionFlag;  // below

class Worker;

// Handle of one operation: completion, error and a torch Future of its output
// tensors.
//
// CPU: the future completes when the op has (on the worker thread).
// GPU (CudaWork, cuda_comm.cpp): the future is CUDA-aware, like
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
  // The worker that runs this op: wait() on that thread before completion
  // (from a Future callback) would wait for itself, so it throws instead.
  void set_worker(const Worker* w) { worker_ = w; }
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
  std::function<void(const std::string&)> on_interrupt_;
  std::shared_ptr<std::atomic<bool>> reported_;
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

// op -> [(max_bytes, algo), ...]: the first rule with bytes <= max_bytes (or
// max_bytes < 0, no limit) is what algo="auto" runs (measured on a GPU by
// benchmarks/gpu; pycomm/comm.py passes it to CUDA communicators).
using AutoTable = std::map<std::string, std::vector<std::pair<int64_t, std::string>>>;

struct CommOptions {
  int64_t timeout_ms = 300000;
  int64_t slice_bytes = 512 * 1024;
  // Checked mode: compare call fingerprints across ranks before each
  // collective (csrc/core/check.h); a mismatch raises ValueError on all ranks.
  bool check = false;
  AutoTable auto_table;
};

// UsageError (ValueError) for options no communicator can run with.
void check_options(const CommOptions& options);
// Bytes of an executor's scratch: two ring slices (+ alignment slack), and
// at least checked mode's table of world_size fingerprints.
size_t scratch_bytes(size_t slice_bytes, int world_size);

// One tensor-level p2p request of batch_isend_irecv.
struct TensorP2P {
  bool send;
  at::Tensor tensor;
  int peer;
};

using Body = std::function<void(const Context&)>;

// How a call returns. kAsync: at once, with the Work. kSync: once the op is
// complete for the caller (CPU: the host waited; GPU: the caller's current
// stream waits, the host does not). kHost: once the op is complete, host
// included, on every device (barrier).
enum class Wait { kAsync, kSync, kHost };

// A body's UsageError (checked mode), prefixed with "all_reduce #3 on rank 1: ".
UsageError usage_failure(const Work& work, int rank, const std::exception& e);
// "all_reduce #3 on rank 1 (shm transport, world_size 2, cpu) failed: why".
std::string failure_message(const Work& work, int rank, const std::string& transport,
                            int world_size, const std::string& device, const std::string& why);

// Where ops run (see the top). Comm calls it from one thread at a time (or
// from the executor's own thread, for ops issued by Future callbacks).
class Executor {
 public:
  virtual ~Executor() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string transport_name() const = 0;
  virtual c10::Device device() const = 0;
  // Capabilities of the collectives' transport: shared memory (the direct
  // algorithms) and native collectives (algo="nccl").
  virtual bool shared_buffers() const = 0;
  // SharedBuffers::symmetric_domain() of the transport, 0 when it has none.
  virtual uint64_t symmetric_domain() const { return 0; }
  virtual bool native_collectives() const = 0;

  // A Work of this executor's kind for the op about to run.
  virtual c10::intrusive_ptr<Work> new_work(const char* op, uint64_t seq,
                                            std::vector<at::Tensor> outputs) = 0;
  // Runs the collective `body` as `work`: completes or fails `work`,
  // returning as `wait` says;
  // a synchronous op's error is thrown. A body's UsageError (checked mode:
  // every rank detected it before any payload moved) fails only this op;
  // any other error aborts the communicator. `keep` holds tensors the body
  // reads until the op is done.
  virtual void run(const c10::intrusive_ptr<Work>& work, Body body, Wait wait,
                   std::vector<at::Tensor> keep) = 0;
  // User p2p: posts `ops` (channel kUser) and completes `work` when they are
  // done, without holding up later ops (a pending irecv never blocks a later
  // collective or isend).
  virtual void run_p2p(const c10::intrusive_ptr<Work>& work, std::vector<P2POp> ops, Wait wait,
                       std::vector<at::Tensor> keep) = 0;
  // Uninitialised memory like `t` that a body may use as work space.
  virtual at::Tensor empty_like(const at::Tensor& t) = 0;
  // True on a thread of the executor's own (the CPU worker, which runs
  // Future callbacks): ops issued there run in order without the call guard.
  virtual bool on_own_thread() const = 0;
  // The transport's own split (ncclCommSplit): an executor over the ranks
  // that pass the same color >= 0, ranked by (key, rank); nullptr for a
  // negative color. A collective: every rank calls it at the same point of
  // its op sequence. Executors without one throw UsageError (pycomm/comm.py
  // builds such groups through the store instead).
  virtual std::unique_ptr<Executor> split(int color, int key, const CommOptions& options);

  // Waits for queued work (bounded by the timeout), then releases the
  // transport; rethrows a failure met on the way. Not on the own thread.
  virtual void close() = 0;
  // A forked child: drop everything without touching threads or connections
  // that belong to the parent.
  virtual void leak() = 0;
  // Fails pending and future ops at once (any thread, idempotent) and tells
  // the peers `why` where the transport can.
  virtual void abort(const std::string& why) = 0;
  virtual bool aborted() const = 0;
  virtual std::string abort_reason() const = 0;
};

// A bounded set of storages held weakly (freed ones drop out, the oldest go
// first when it is full): what Comm::offers_to_adopt remembers.
struct WeakStorageSet {
  std::mutex mu;
  std::deque<c10::weak_intrusive_ptr<c10::StorageImpl>> storages;
  static constexpr size_t kMax = 64;
  bool contains(const c10::StorageImpl* impl) {
    std::lock_guard<std::mutex> lk(mu);
    for (auto& w : storages) {
      if (!w.expired() && w._unsafe_get_target() == impl) return true;
    }
    return false;
  }
  void add(const c10::Storage& storage) {
    std::lock_guard<std::mutex> lk(mu);
    storages.erase(
        std::remove_if(storages.begin(), storages.end(), [](const auto& w) { return w.expired(); }),
        storages.end());
    if (storages.size() >= kMax) storages.pop_front();
    storages.push_back(storage.getWeakStorageImpl());
  }
};

class Comm {
 public:
  Comm(std::unique_ptr<Executor> executor, CommOptions options);
  // Closes; never joins a thread while holding the GIL (a Future callback
  // on that thread may be waiting for it).
  ~Comm();

  int rank() const { return rank_; }
  int world_size() const { return size_; }
  std::string transport_name() const { return transport_name_; }
  std::string device() const { return device_.str(); }
  int64_t slice_bytes() const { return options_.slice_bytes; }
  uint64_t seq() const { return seq_; }
  bool closed() const { return closed_; }
  bool aborted() const { return exec_ && exec_->aborted(); }
  bool check() const { return options_.check; }
  void set_check(bool on) { options_.check = on; }  // equal on all ranks, between ops
  // True in a child forked after the communicator was created: its threads
  // and connections belong to the parent, so every call raises.
  bool forked() const;

  // Each returns nullptr when async_op is false (done, see Wait), else a Work.
  // all_reduce: wire_dtype -1, or a DType (float16 / bfloat16) in which a
  // float32 tensor travels (ring_all_reduce_wire).
  // offer: all_reduce(register=True), see offers_to_adopt.
  c10::intrusive_ptr<Work> all_reduce(const at::Tensor& t, int op, const std::string& algo,
                                      bool async_op, int wire_dtype = -1, bool offer = false);
  c10::intrusive_ptr<Work> reduce_scatter(const at::Tensor& out, const at::Tensor& in, int op,
                                          const std::string& algo, bool async_op);
  c10::intrusive_ptr<Work> all_gather(const at::Tensor& out, const at::Tensor& in,
                                      const std::string& algo, bool async_op);
  c10::intrusive_ptr<Work> broadcast(const at::Tensor& t, int src, const std::string& algo,
                                     bool async_op);
  // Rooted collectives and all-to-all (comm_rooted.cpp; algorithms in
  // core/collectives.h), with torch.distributed's conventions. reduce: in
  // place to `dst` (other ranks' `t` then holds partial results). gather:
  // `outs` is world_size tensors like `in` on dst, empty elsewhere. scatter:
  // `ins` is world_size tensors like `out` on src, empty elsewhere.
  // all_to_all: outs[p] receives rank p's ins[r] (r: this rank), sizes may
  // differ per peer. all_to_all_single: the same over blocks of dim 0 of one
  // tensor each, split_sizes in rows (empty: size(0) / world_size each).
  c10::intrusive_ptr<Work> reduce(const at::Tensor& t, int dst, int op, bool async_op);
  c10::intrusive_ptr<Work> gather(const std::vector<at::Tensor>& outs, const at::Tensor& in,
                                  int dst, bool async_op);
  c10::intrusive_ptr<Work> scatter(const at::Tensor& out, const std::vector<at::Tensor>& ins,
                                   int src, bool async_op);
  c10::intrusive_ptr<Work> all_to_all(const std::vector<at::Tensor>& outs,
                                      const std::vector<at::Tensor>& ins, bool async_op);
  c10::intrusive_ptr<Work> all_to_all_single(const at::Tensor& out, const at::Tensor& in,
                                             const std::vector<int64_t>& out_splits,
                                             const std::vector<int64_t>& in_splits, bool async_op);
  c10::intrusive_ptr<Work> send(const at::Tensor& t, int dst, bool async_op);
  c10::intrusive_ptr<Work> recv(const at::Tensor& t, int src, bool async_op);
  c10::intrusive_ptr<Work> batch_p2p(const std::vector<TensorP2P>& ops);
  // A collective: moves the storage of `t` into symmetric memory (every
  // rank maps every rank's copy; SharedBuffers::allocate_symmetric), in
  // place: the bytes are copied over and the storage's data pointer swapped,
  // so `t` and every view of its storage keep their identity. Every rank
  // passes a tensor whose storage has the same number of bytes. Returns "" when
  // registered, else why not (then on every rank, and nothing changed). A
  // later all_reduce of the whole storage then runs without staging
  // (direct_all_reduce). UsageError where the transport has no shared memory.
  std::string register_tensor(const at::Tensor& t);
  // True when the storage of `t` was registered by this communicator.
  bool is_registered(const at::Tensor& t) const;
  // All-reduces so far that ran from symmetric memory (no staging).
  uint64_t symmetric_all_reduces() const { return symmetric_ops_->load(); }
  // With this on (the backend's Options(symmetric=True)), an all_reduce on
  // shm of a tensor that is all of a storage of >= kAdoptMinBytes that torch's
  // CPU allocator made, and that this communicator reduced before (and is
  // still alive), offers to move it into symmetric memory; if every rank
  // offers, the op moves it (register_tensor's move, inside the op), so a
  // caller's long-lived buffers (DDP's buckets) go the symmetric path from
  // their second all-reduce on. Set it alike on every rank, between ops.
  bool adopt_symmetric() const { return adopt_symmetric_; }
  void set_adopt_symmetric(bool on) { adopt_symmetric_ = on; }
  static constexpr size_t kAdoptMinBytes = 256 * 1024;
  // Blocks the host until every rank has entered, unless async_op.
  c10::intrusive_ptr<Work> barrier(bool async_op = false);
  // A communicator of the ranks that pass the same color >= 0 (ranked by
  // (key, rank)) through the transport's own split (NCCL: ncclCommSplit), with
  // this one's options but `timeout_ms`; nullptr for a negative color. Every
  // rank calls it, in the same order as its collectives. UsageError where the
  // transport has no split of its own (CPU transports).
  std::unique_ptr<Comm> split(int color, int key, int64_t timeout_ms);

  // Waits for queued work, then releases the transport. Idempotent. Raises
  // CommError (once everything is released) if a failed op aborted the
  // communicator and no call raised that failure to the caller yet (an async
  // op whose Work nobody waited for), so that it is never lost.
  void close();
  // Fails pending and future operations at once.
  void abort(const std::string& why);

 private:
  class CallGuard;
  // Checks that the communicator is usable, numbers the op and hands it to
  // the executor.
  c10::intrusive_ptr<Work> launch(const char* op, std::vector<at::Tensor> outputs, Body body,
                                  Wait wait, std::vector<at::Tensor> keep = {});
  c10::intrusive_ptr<Work> launch_p2p(const char* op, std::vector<at::Tensor> tensors,
                                      std::vector<P2POp> ops, Wait wait);
  // What both share: the call guard, check_open, a numbered Work, `submit`
  // to the executor, and noting a CommError raised to the caller.
  c10::intrusive_ptr<Work> start(
      const char* op, std::vector<at::Tensor> outputs, Wait wait,
      const std::function<void(const c10::intrusive_ptr<Work>&)>& submit);
  // Wraps a collective's body: assigns the collective sequence number when
  // the body runs (execution order, which is what pairs ops across ranks),
  // hands the op header to the transport (checked against the peers' on
  // every transport that can, op_header.h), after checked mode's
  // fingerprint exchange when enabled.
  Body collective(OpHeader h, Body body);
  void check_open(const char* op) const;
  void check_tensor(const at::Tensor& t, const char* arg, const char* op) const;
  // The algorithm `algo` resolves to for this op: "ring", "direct" or "nccl".
  std::string pick(const std::string& algo, const char* op, size_t bytes, bool wire) const;

  std::unique_ptr<Executor> exec_;
  CommOptions options_;
  int rank_;
  int size_;
  std::string transport_name_;
  c10::Device device_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<uint64_t> coll_seq_{0};  // collectives only (op headers, checked mode)
  long pid_;                           // creating process (fork detection)
  std::atomic<bool> closed_{false};
  std::atomic<bool> user_aborted_{false};  // abort() called while healthy
  // A failure has reached the caller (a raised CommError: a synchronous op,
  // Work.wait, or a call on the aborted communicator).
  std::shared_ptr<std::atomic<bool>> failure_reported_ = std::make_shared<std::atomic<bool>>(false);
  // Thread safety: one thread at a time issues ops (see CallGuard).
  std::atomic<std::thread::id> caller_{};
  // algo="auto" runs direct_all_reduce up to this many bytes when the
  // transport shares memory: no limit unless PYCOMM_DIRECT_MAX_BYTES (ctor).
  size_t direct_max_bytes_ = 0;
  // Whether an all_reduce of `t` offers to move it into symmetric memory
  // (direct_all_reduce's adopt): on shm, not after a move found no room, not
  // on the worker thread, not after a rank declined this storage, when `t` is
  // all of a storage that torch's CPU allocator made, and either `offer` (the
  // caller asks) or adopt_symmetric() with a storage of >= kAdoptMinBytes
  // that this communicator reduced before (seen_).
  bool offers_to_adopt(const at::Tensor& t, bool offer);
  WeakStorageSet seen_;
  std::atomic<bool> adopt_symmetric_{false};
  std::shared_ptr<std::atomic<uint64_t>> symmetric_ops_ =
      std::make_shared<std::atomic<uint64_t>>(0);
  // Storages some rank declined to move: they offer no more, so a rank whose
  // peers never offer (their buckets moved already) does not hold its caller
  // at every all-reduce.
  std::shared_ptr<WeakStorageSet> declined_ = std::make_shared<WeakStorageSet>();
  // Set when a move found no room (then on every rank): offers stop.
  std::shared_ptr<std::atomic<bool>> adopt_failed_ = std::make_shared<std::atomic<bool>>(false);
};

// The CPU executor: the transport's ops run on a worker thread in submission
// order; synchronous calls run inline when nothing is queued.
std::unique_ptr<Executor> make_cpu_executor(std::unique_ptr<Transport> transport,
                                            const CommOptions& options);

// SIGINT handling, in one place: on the Python main thread, runs pending
// signal handlers (PyErr_CheckSignals, with the GIL) and throws Interrupted
// if one raised (KeyboardInterrupt). Elsewhere it returns at once. Called
// every few tens of milliseconds by blocked waits: the shm transport's
// (Transport::set_interrupt_check) and Work::wait's.
void check_interrupt();
bool on_main_thread();

// at::ScalarType -> DType; throws UsageTypeError (-> TypeError) for the rest.
DType to_dtype(at::ScalarType t, const char* arg);

// Argument checks. They throw UsageError (-> ValueError) / UsageTypeError
// (-> TypeError): plain C++ exceptions, safe without the GIL, translated in
// bindings.cpp.
std::string join_msg(std::initializer_list<std::string> parts);
void check_tensor(const at::Tensor& t, const char* arg, const char* op, const c10::Device& device);
void check_peer(int peer, const char* arg, const char* op, int rank, int size, bool allow_self);
ReduceOp to_op(int op, DType dtype, const char* opname);
// all_reduce's wire_dtype (-1: none): a float16/bfloat16 DType for a float32
// tensor, else UsageError (ValueError) naming the problem.
std::optional<DType> to_wire_dtype(int wire_dtype, DType tensor_dtype, const char* opname);
// reduce_scatter / all_gather: equal dtypes and big = world_size x small elements.
void check_scatter_sizes(const at::Tensor& big, const char* big_arg, const at::Tensor& small,
                         const char* small_arg, int world_size, const char* op);

}  // namespace pycomm
