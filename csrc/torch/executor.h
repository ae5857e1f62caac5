// Where Comm's ops run (Executor) and the options they run with. The
// executors: CpuExecutor (cpu_executor.cpp), a worker thread; CudaExecutor
// (cuda_comm.cpp), the caller's thread enqueues on CUDA streams.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../core/algorithms.h"
#include "../core/transport.h"
#include "work.h"

namespace pycomm {

// op -> [(max_bytes, algo), ...]: the first rule with bytes <= max_bytes (or
// max_bytes < 0, no limit) is what algo="auto" runs (chosen from
// benchmarks/gpu's runs; pycomm/comm.py passes it to CUDA communicators).
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

using Body = std::function<void(const Context&)>;

// How a call returns. kAsync: at once, with the Work. kSync: once the op is
// complete for the caller (CPU: the host waited; GPU: the caller's current
// stream waits, the host does not). kHost: once the op is complete, host
// included, on every device (barrier).
enum class Wait { kAsync, kSync, kHost };
inline Wait wait_of(bool async_op) { return async_op ? Wait::kAsync : Wait::kSync; }

// Where ops run (see the top). Comm calls it from one thread at a time (or
// from the executor's own thread, for ops issued by Future callbacks).
class Executor {
 public:
  // Who the executor is, fixed for its life: its transport's rank, size and name.
  Executor(int rank, int world_size, std::string transport_name)
      : rank_(rank), size_(world_size), transport_name_(std::move(transport_name)) {}
  virtual ~Executor() = default;

  int rank() const { return rank_; }
  int world_size() const { return size_; }
  const std::string& transport_name() const { return transport_name_; }
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

  // Across hosts (hierarchy.h): this executor's ops run on `owner`'s worker
  // thread from then on, in one queue with owner's (its own thread ends);
  // with `idle_wait`, the worker's idle waits are this transport's (shm's
  // doorbell). Both idle, before their first op; CPU executors only
  // (UsageError).
  virtual void share_worker_of(Executor& owner, bool idle_wait);
  // Across hosts: this transport's progress() (Transport::progress), and
  // the hook this transport's blocking waits call (set_while_blocked).
  virtual std::function<bool()> progress_fn() {
    return [] { return false; };
  }
  virtual void set_while_blocked(std::function<bool()> f) { (void)f; }
  // `f(why)` runs once this executor aborted, whoever aborted it: the
  // hierarchy aborts its other parts with it. Set before the first op;
  // cleared (nullptr) when the hierarchy closes.
  void set_on_abort(std::function<void(const std::string&)> f) {
    std::lock_guard<std::mutex> lk(on_abort_mu_);
    on_abort_ = std::move(f);
  }

 protected:
  // Called by abort() once, after the executor's own state says aborted.
  void aborted_now(const std::string& why) {
    std::lock_guard<std::mutex> lk(on_abort_mu_);
    if (on_abort_) on_abort_(why);
  }

 private:
  std::mutex on_abort_mu_;
  std::function<void(const std::string&)> on_abort_;
  const int rank_;
  const int size_;
  const std::string transport_name_;
};

// The failure policy of every executor, written once: `e` was thrown by the
// body of `work`. A UsageError (checked mode: every rank detected it before
// any payload moved) fails only this op, the communicator stays usable; any
// other error aborts the communicator (abort_op). Returns the error `work`
// failed with (a synchronous caller rethrows it).
std::exception_ptr fail_op(Executor& executor, Work& work, const std::exception& e,
                           const std::string& device);
// The policy's second half: aborts the communicator and fails `work` with a
// CommError (an Interrupted stays one) naming the op, the rank, the
// transport and `device`.
std::exception_ptr abort_op(Executor& executor, Work& work, const std::exception& e,
                            const std::string& device);

// The CPU executor: the transport's ops run on a worker thread in submission
// order; synchronous calls run inline when nothing is queued.
std::unique_ptr<Executor> make_cpu_executor(std::unique_ptr<Transport> transport,
                                            const CommOptions& options);

}  // namespace pycomm
