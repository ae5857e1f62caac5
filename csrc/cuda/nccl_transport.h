// NCCL: the communicator (bootstrap, nonblocking init, timeouts, abort), the
// `nccl` Transport the ring algorithms run on, and the native collectives
// (algo="nccl", the baseline). Raw device pointers, counts, DType and
// cudaStream_t only: no torch.
//
// Bootstrap: rank 0 calls NcclComm::unique_id(); the 128 bytes travel through
// the c10d Store (pycomm/comm.py); every rank constructs NcclComm with them on
// its device.
//
// Errors and timeouts. The communicator is created nonblocking
// (ncclConfig_t.blocking = 0): every NCCL call returns at once, possibly with
// ncclInProgress, and wait_ready() polls ncclCommGetAsyncError until the call
// has finished, an error shows up, or the timeout expires. On an error or a
// timeout the communicator is aborted (ncclCommAbort: NCCL kernels stop, the
// streams drain) and CommError is thrown. Host waits for the GPU (host_wait,
// the binding's watchdog) poll the event and ncclCommGetAsyncError the same
// way, so a dead peer surfaces as a CommError within the timeout instead of a
// hang. abort() may be called from any thread; a lock keeps the ncclComm_t
// from being used after ncclCommAbort has freed it.
//
// Channels (transport.h). The binding keeps user point-to-point traffic
// (kUser) off the collectives' communicator: it splits a second NcclComm from
// the first (ncclCommSplit, same ranks in the same order) and gives it its own
// streams and NcclTransport. NCCL matches sends and receives per communicator,
// so a user's isend can never pair with a ring step's receive, and a pending
// user receive sits on its own stream instead of in front of later
// collectives. Each NcclTransport carries exactly one channel.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "../core/transport.h"
#include "streams.h"

namespace pycomm {
namespace cuda {

class NcclComm {
 public:
  // ncclGetUniqueId, as NCCL_UNIQUE_ID_BYTES raw bytes.
  static std::string unique_id();

  // ncclCommInitRankConfig(nonblocking) on `device`, waiting at most `timeout`.
  NcclComm(const std::string& unique_id, int rank, int world_size, int device,
           std::chrono::milliseconds timeout);
  // ncclCommSplit(parent, color 0, key rank): the same ranks in the same order
  // on a communicator of its own (nonblocking like the parent, splitShare = 0:
  // own channels, connections and proxy, so its operations never queue behind
  // the parent's). Collective over the parent: every rank must call it at the
  // same point of the parent's operation sequence. Waits at most
  // parent.timeout(); on an error or a timeout aborts the parent (which also
  // stops the split) and throws CommError. `name` must outlive the call.
  NcclComm(NcclComm& parent, const char* name) : NcclComm(parent, name, 0, parent.rank()) {}
  // The general split, MPI_Comm_split-like: the ranks that pass the same
  // color >= 0 form one communicator, ranked by (key, parent rank). Every rank
  // of the parent calls it; a rank that passes a negative color joins none
  // and gets nullptr (NCCL_SPLIT_NOCOLOR).
  static std::unique_ptr<NcclComm> split(NcclComm& parent, const char* name, int color, int key);
  ~NcclComm();  // destroys (or aborts, if pending work cannot be flushed)
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return size_; }
  int device() const { return device_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  // Runs f(ncclComm_t) under the lock (throws CommError if aborted). Used to
  // issue NCCL calls; follow with wait_ready().
  // A CommError thrown by f (a failed PYCOMM_NCCL_CHECK) aborts the communicator.
  template <class F>
  void call(F&& f) {
    std::string err;
    {
      std::lock_guard<std::mutex> lk(mu_);
      throw_if_aborted();
      try {
        f(comm_.load());
        return;
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    fail(err);
  }

  // Polls until the last nonblocking call has finished (ncclSuccess). On an
  // asynchronous error or after timeout(): aborts and throws CommError.
  void wait_ready(const char* what);

  // Throws CommError (after aborting) if NCCL reports an asynchronous error;
  // otherwise returns the state: ncclSuccess, or ncclInProgress while the
  // last nonblocking call runs.
  ncclResult_t check_async(const char* what);

  // Blocks the host until `ev` completes, checking for NCCL errors and the
  // timeout while it polls (then aborts and throws).
  void host_wait(cudaEvent_t ev, const char* what);

  // Flushes and destroys the communicator (ncclCommFinalize, ncclCommDestroy).
  // After an abort, does nothing. Idempotent.
  void destroy();

  // ncclCommAbort (idempotent, any thread). Marks the communicator aborted
  // first (pending and later calls throw), then aborts under mu_, which no
  // thread holds across a wait.
  void abort(const std::string& why);
  bool aborted() const { return aborted_.load(); }
  std::string abort_reason() const;

 private:
  void throw_if_aborted() const;                   // mu_ held
  [[noreturn]] void fail(const std::string& msg);  // abort + throw CommError
  // Polls until done() holds, backing off; after timeout(): aborts and throws
  // CommError "<what> <late> within the timeout ...".
  void poll_until(const char* what, const char* late, const std::function<bool()>& done);
  NcclComm(NcclComm& parent, const char* name, int color, int key);
  // Runs ncclCommSplit and waits for it; the new handle, nullptr for no color.
  static ncclComm_t run_split(NcclComm& parent, const char* name, int color, int key);

  int rank_, size_, device_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  // Atomic: read by throw_if_aborted without mu_; used and replaced under it.
  std::atomic<ncclComm_t> comm_{nullptr};
  mutable std::mutex reason_mu_;  // abort_reason_
  std::atomic<bool> aborted_{false};
  bool destroyed_ = false;
  std::string abort_reason_;
};

// The `nccl` Transport. post() = on the comm stream: wait for the reductions
// enqueued so far, ncclGroupStart, ncclSend/ncclRecv (ncclUint8, bytes) per op,
// ncclGroupEnd, record an event -> Handle. wait(h) = the reduction stream
// waits for that event. Neither blocks the host (except to let a nonblocking
// ncclGroupEnd finish its setup). See streams.h for why this overlaps.
class NcclTransport final : public Transport, public NativeCollectives {
 public:
  // Every op posted must be on `channel` (UsageError otherwise): the binding
  // runs each channel on its own communicator and streams.
  NcclTransport(NcclComm& comm, CudaStreams& streams, Channel channel = kCollective);

  int rank() const override { return comm_.rank(); }
  int world_size() const override { return comm_.world_size(); }
  std::string name() const override { return "nccl"; }

  Handle post(const P2POp* ops, size_t n) override;
  void wait(Handle h) override;
  void set_timeout(std::chrono::milliseconds timeout) override;
  void abort() override { comm_.abort("aborted through the transport"); }

  // Native NCCL collectives (algo="nccl", NativeCollectives), enqueued on the
  // comm stream in the same order as post(); complete them with wait().
  NativeCollectives* native() override { return this; }
  Handle all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op) override;
  Handle reduce_scatter(const void* in, void* out, size_t recv_count, DType dtype,
                        ReduceOp op) override;
  Handle all_gather(const void* in, void* out, size_t send_count, DType dtype) override;
  Handle broadcast(void* data, size_t bytes, int root) override;

  NcclComm& comm() { return comm_; }

 private:
  template <class F>
  Handle enqueue(const char* what, F&& f);

  NcclComm& comm_;
  CudaStreams& streams_;
  Channel channel_;
};

ncclDataType_t to_nccl(DType t);
ncclRedOp_t to_nccl(ReduceOp op);

}  // namespace cuda
}  // namespace pycomm
