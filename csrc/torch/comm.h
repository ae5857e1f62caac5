// The C++ communicator behind pycomm.Communicator, one class for CPU and GPU.
//
//   Comm             every op once: argument checks (checks.h), the
//                    algorithm choice, the op header (op_header.h) and
//                    checked mode, and the body that calls the algorithm
//                    (csrc/core/algorithms.h) over raw pointers. comm.cpp
//                    (life, the other collectives), comm_all_reduce.cpp,
//                    comm_rooted.cpp, comm_p2p.cpp, comm_pick.cpp (the
//                    algorithm choice), comm_hosts.cpp (across hosts).
//   Executor         where a body runs and how its completion is observed
//                    (executor.h); the only part that differs between devices:
//                      CpuExecutor (cpu_executor.cpp)  a worker thread; a Work
//                                                      completes when its body
//                                                      has returned;
//                      CudaExecutor (cuda_comm.cpp)    the caller's thread
//                                                      enqueues the body on
//                                                      the communicator's CUDA
//                                                      streams; a watchdog
//                                                      completes Works as
//                                                      their events pass.
//   Work             one op's handle and its torch Future (work.h).
//   SymmetricMemory  registered storages and the all-reduce's decision about
//                    them (symmetric.h).
//
// No algorithm logic lives here. Errors are plain C++ exceptions (UsageError,
// UsageTypeError, CommError, Interrupted: core/types.h), thrown with or
// without the GIL and translated in one place (bindings.cpp).
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../core/algorithms.h"
#include "../core/check.h"
#include "../core/transport.h"
#include "checks.h"
#include "executor.h"
#include "hierarchy.h"
#include "symmetric.h"
#include "work.h"

namespace pycomm {

// One tensor-level p2p request of batch_isend_irecv.
struct TensorP2P {
  bool send;
  at::Tensor tensor;
  int peer;
  int tag = 0;
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
  // On a thread of its executor's own (a Future callback on the CPU worker).
  bool on_own_thread() const { return exec_ && exec_->on_own_thread(); }
  bool check() const { return options_.check; }
  void set_check(bool on);  // equal on all ranks, between ops (a hierarchy's parts too)
  // algo="auto"'s table (CommOptions::auto_table); set between ops, the
  // same on every rank (pycomm/_auto_table.py picks it). UsageError for an
  // algorithm or collective it does not know.
  const AutoTable& auto_table() const { return options_.auto_table; }
  void set_auto_table(AutoTable table);
  // What algo="auto" runs for collective `op` ("all_reduce", "all_gather",
  // "reduce_scatter", "broadcast") of `bytes` bytes.
  std::string auto_algo(const std::string& op, int64_t bytes) const;
  // True in a child forked after the communicator was created: its threads
  // and connections belong to the parent, so every call raises.
  bool forked() const;

  // Each returns nullptr when async_op is false (done, see Wait), else a Work.
  // all_reduce: wire_dtype -1, or a DType (float16 / bfloat16) in which a
  // float32 tensor travels (ring_all_reduce_wire).
  // to_register: all_reduce(register=True), see SymmetricMemory::decide.
  // wire_dtype int8 / float8 (checks.h, to_wire): quantized_all_reduce in
  // blocks of wire_block elements, with error feedback into `residual` when
  // given (check_quantized_wire).
  c10::intrusive_ptr<Work> all_reduce(const at::Tensor& t, int op, const std::string& algo,
                                      bool async_op, int wire_dtype = -1, bool to_register = false,
                                      int64_t wire_block = 256,
                                      const std::optional<at::Tensor>& residual = std::nullopt);
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
  // User p2p (channel kUser, P2POp's matching): a recv matches the send to it
  // with the same tag; src kAnySource (-1) receives from whichever rank sends
  // first (Work::source_rank). CPU transports only for tag != 0 and
  // kAnySource (NotSupported on NCCL, which pairs in posting order).
  c10::intrusive_ptr<Work> send(const at::Tensor& t, int dst, bool async_op, int tag = 0);
  c10::intrusive_ptr<Work> recv(const at::Tensor& t, int src, bool async_op, int tag = 0);
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
  uint64_t symmetric_all_reduces() const { return symmetric_->ops(); }
  // ...and that read the peers' private copies (cross_memory.h).
  uint64_t cross_memory_all_reduces() const { return symmetric_->cross_memory_ops(); }
  // With this on (the backend's Options(register=True)), an all_reduce on
  // shm of a tensor that is all of a storage of >= kAutoRegisterMinBytes that
  // torch's CPU allocator made, and that this communicator reduced before (and
  // is still alive), asks to register it (as all_reduce(register=True)); if
  // every rank asks, the op moves it (register_tensor's move, inside the op), so a
  // caller's long-lived buffers (DDP's buckets) go the symmetric path from
  // their second all-reduce on. Set it alike on every rank, between ops.
  bool auto_register() const { return symmetric_->auto_register(); }
  void set_auto_register(bool on) { symmetric_->set_auto_register(on); }
  static constexpr size_t kAutoRegisterMinBytes = SymmetricMemory::kAutoRegisterMinBytes;
  // Blocks the host until every rank has entered, unless async_op.
  c10::intrusive_ptr<Work> barrier(bool async_op = false);
  // A communicator of the ranks that pass the same color >= 0 (ranked by
  // (key, rank)) through the transport's own split (NCCL: ncclCommSplit), with
  // this one's options but `timeout_ms`; nullptr for a negative color. Every
  // rank calls it, in the same order as its collectives. UsageError where the
  // transport has no split of its own (CPU transports).
  std::unique_ptr<Comm> split(int color, int key, int64_t timeout_ms);

  // Across hosts: this communicator (the flat gloo ring over every rank)
  // becomes "shm+gloo", composing collectives over `intra` (shm, this host's
  // ranks) and `inter` (gloo, the ranks with this local index) as
  // hierarchy.h says; the three run on this one's worker thread, abort
  // together and close with it. Every rank calls it on fresh communicators.
  void compose_hosts(HostLayout layout, std::shared_ptr<Comm> intra, std::shared_ptr<Comm> inter);
  const Hierarchy* hierarchy() const { return hierarchy_.get(); }
  // Across hosts: every p2p op over the flat ring, peers on this host too
  // (receives from any source then work, as on gloo). The c10d backend sets
  // it, on every rank, before its first op.
  void set_p2p_over_flat(bool on) {
    if (hierarchy_) hierarchy_->set_p2p_over_flat(on);
  }

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
  // Outputs an op fills whole without reading them (all_gather, gather,
  // all_to_all): on CPU, huge pages where they are fresh (core/huge_pages.h).
  static void advise_filled(const std::vector<at::Tensor>& outputs);
  // send / recv: checks, then one p2p op of `kind` with `peer` (`peer_arg`).
  c10::intrusive_ptr<Work> point_to_point(const char* op, P2POp::Kind kind, const at::Tensor& t,
                                          const char* peer_arg, int peer, bool async_op, int tag);
  // NotSupported for a tag other than 0 or kAnySource where the transport
  // pairs messages in posting order (NCCL).
  void check_matching(const char* op, int tag, bool any_source) const;
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
  // A composed op across hosts: `run` (the parts' ops) as one task of the
  // worker, in issue order, never inline in the caller (the parts' ops run
  // nested in it, on the worker). Waits unless `async_op`.
  // all_reduce across hosts (hierarchy.h): arguments checked; `wire` for a
  // quantized wire.
  c10::intrusive_ptr<Work> all_reduce_across_hosts(const at::Tensor& t, int op,
                                                   const std::string& algo, bool async_op,
                                                   bool to_register,
                                                   std::optional<Hierarchy::QuantWire> wire);
  c10::intrusive_ptr<Work> compose(const char* op, std::vector<at::Tensor> outputs,
                                   std::function<void()> run, bool async_op, bool hold = false);
  // batch_p2p across hosts: the ops to peers on this host over shm, the
  // others over the flat ring, one Work for both.
  c10::intrusive_ptr<Work> batch_p2p_across_hosts(const std::vector<TensorP2P>& reqs);
  // batch_p2p's requests as the transport's ops, and their tensors.
  static std::pair<std::vector<P2POp>, std::vector<at::Tensor>> p2p_ops(
      const std::vector<TensorP2P>& reqs);
  void check_tensor(const at::Tensor& t, const char* arg, const char* op) const;
  // reduce_scatter's and all_gather's checks: `output` and `input` valid, the
  // whole one (`output` when `output_whole`) world_size times the other;
  // returns input's dtype.
  DType check_chunked(const at::Tensor& out, const at::Tensor& in, bool output_whole,
                      const char* op) const;
  // gather's and scatter's checks: `tensor` valid, `root` a rank, and the
  // list: on the root world_size tensors like `tensor` (their data pointers
  // go to `ptrs`), elsewhere empty (torch's None). Returns tensor's dtype.
  DType check_rooted(const at::Tensor& tensor, const std::vector<at::Tensor>& list,
                     const char* list_arg, const char* root_arg, int root, const char* op,
                     std::vector<void*>* ptrs) const;
  // The algorithm `algo` resolves to for this op (UsageError, naming the
  // choices, for one it cannot run); pick_auto for "auto".
  AlgoKind pick(const std::string& algo, CollKind coll, size_t bytes, bool wire) const;
  AlgoKind pick_auto(CollKind coll, size_t bytes, bool wire) const;

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
  // Registered storages and each all-reduce's decision about them.
  std::shared_ptr<SymmetricMemory> symmetric_;
  // Across hosts (compose_hosts): the parts; null on one host.
  std::shared_ptr<Hierarchy> hierarchy_;
  bool is_part_ = false;  // a hierarchy's part: its owner reports failures
};

}  // namespace pycomm
