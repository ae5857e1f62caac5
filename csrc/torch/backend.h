// pycomm as a torch.distributed backend: init_process_group(backend="pycomm").
//
// ProcessGroupPycomm is a thin c10d::Backend over pycomm::Comm (the C++
// communicator behind pycomm.Communicator): it maps c10d's calls and options
// onto Comm's ops, stages what Comm cannot take directly (tensor lists,
// non-contiguous tensors) through contiguous buffers, and wraps pycomm::Work in
// a c10d::Work. No algorithm lives here. pycomm/backend.py registers it for
// "cpu" and "cuda".
//
// Devices. torch registers ONE backend object for every device of a group
// when they all name "pycomm", so each call is dispatched by its tensors'
// device (all of a call's tensors on one device, else ValueError):
//   cpu   the group's CPU communicator (shm / gloo), built with the group;
//   cuda  the group's CUDA communicator (nccl), built lazily at the group's
//         first CUDA operation by a factory from pycomm/backend.py, as
//         ProcessGroupNCCL builds its NCCL communicators: a CPU-only user never
//         pays for (or fails on) NCCL setup, and since every rank of the group
//         reaches its first CUDA operation at the same point, the NCCL
//         bootstrap matches. That creation is collective over the whole group
//         (a first CUDA send/recv between two ranks of a larger group waits for
//         the others until the timeout: run a CUDA collective first); a failed
//         creation is final (later CUDA ops raise its error). One CUDA
//         device per group (the first op's); a tensor on another one raises.
// CUDA stream semantics are ProcessGroupNCCL's, inherited from Comm's CUDA
// executor: an op runs after the caller's current stream; a sync op orders the
// current stream after it; Work.wait() makes the current stream wait (the host
// does not, unless a timeout is given); get_future() is CUDA-aware. Staging
// copies run on the caller's stream before the op (inputs) and, after it, on
// the stream of a CUDA-aware future callback (outputs), which the returned
// Work and future are ordered after.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm.h"
#include "lazy_cuda_comm.h"

namespace pycomm {

// A c10d::Work over one pycomm op (`op`) and the future the caller sees:
// the op's own, or a continuation of it that copies staged outputs back.
// CPU: the future completes when the op (and the copy) has. CUDA: both
// futures are CUDA-aware and complete at the enqueue; the op's Work tracks
// the GPU (is_completed, errors after the enqueue).
class BackendWork final : public c10d::Work {
 public:
  // `op` may be null for ops that already finished (synchronous calls).
  BackendWork(int rank, c10d::OpType type, c10::intrusive_ptr<pycomm::Work> op,
              c10::intrusive_ptr<c10::ivalue::Future> future, std::vector<at::Tensor> outputs);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  // A recv's sender (recvAnysource: the rank matched, once complete).
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  // CUDA: the caller's current stream waits for the op (as wait()).
  void synchronize() override;
  // timeout 0 (c10d's kNoTimeout) waits without limit (CPU; the
  // communicator's own timeout bounds every transfer anyway) or without
  // blocking the host (CUDA: the current stream waits). A timeout blocks the
  // host until the op is complete, GPU included (as ProcessGroupNCCL), and
  // raises when it is not by then.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<pycomm::Work> op_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::vector<at::Tensor> outputs_;
};

// Builds the backend of the ranks that remain once `ranks_to_exclude` leave
// (torch.distributed.shrink_group; a collective of the remaining ranks).
// `flags`: c10d's SHRINK_* flags; `timeout_ms` < 0: the group's timeout.
using Shrinker = std::function<c10::intrusive_ptr<c10d::Backend>(
    const std::vector<int64_t>& ranks_to_exclude, int flags, int64_t timeout_ms)>;

class ProcessGroupPycomm final : public c10d::Backend {
 public:
  // `cpu_comm`: the group's CPU communicator; `cuda_factory` (may be empty:
  // CUDA tensors then raise) builds the CUDA one at the first CUDA op.
  // `cpu_algo` / `cuda_algo`: the all_reduce algorithm on each ("auto",
  // "ring", "direct" / "auto", "ring", "nccl"); the other collectives use
  // "auto".
  ProcessGroupPycomm(std::shared_ptr<Comm> cpu_comm, std::string cpu_algo, CommFactory cuda_factory,
                     std::string cuda_algo);
  ~ProcessGroupPycomm() override;

  const std::string getBackendName() const override { return "pycomm"; }
  bool supportsCoalescing() const override { return true; }
  bool supportsShrinking() const override { return static_cast<bool>(shrinker_); }
  // The survivors' backend, made by the shrinker (pycomm/backend.py: the CPU
  // communicator's Communicator.shrink); then aborts this group's CUDA
  // communicator. torch registers the result for one device type only (the
  // group's bound device, else CPU): see the README's Elastic section.
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranks_to_exclude, int shrink_flags = 0,
      const c10::intrusive_ptr<Options>& opts_override = nullptr) override;
  void set_shrinker(Shrinker shrinker) { shrinker_ = std::move(shrinker); }
  // The communicator for tensors on `device` ("cpu", or CUDA: created now if
  // this is the group's first CUDA use, collectively); `op` names the caller
  // in errors (ValueError for a device this group cannot serve).
  std::shared_ptr<Comm> comm_for(c10::Device device, const char* op);
  const std::string& algo_for(const c10::Device& device) const;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  // Rooted collectives, all-to-all and the coalesced tensor variants
  // (backend_rooted.cpp): each is one Comm op.
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  // Sequence numbers (TORCH_DISTRIBUTED_DEBUG=DETAIL): the number of
  // collectives this backend has issued; it starts at 0 on every rank, so
  // setting it needs no agreement.
  void setSequenceNumberForGroup() override { seq_ = 0; }
  uint64_t getSequenceNumberForGroup() override { return seq_; }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  // Receives from whichever rank sends first with `tag` (CPU; Work.sourceRank).
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // batch_isend_irecv: between the two, send/recv only collect; the batch is
  // posted together (Comm::batch_p2p) by endCoalescing.
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  void shutdown() override;  // closes the communicator (waits for queued ops)
  void abort() override;     // fails pending and later ops at once

 private:
  // Runs after the op succeeds: copies staged results into the caller's
  // tensors. CPU: on the worker thread for async ops, the caller's for sync
  // ones. CUDA: on the caller's current stream for sync ops; for async ones
  // in a CUDA-aware future callback, on a stream ordered after the op.
  using Finish = std::function<void()>;
  // Issues the op on `comm` with the given async_op; returns its Work (null
  // when it ran synchronously).
  using Issue = std::function<c10::intrusive_ptr<pycomm::Work>(Comm& comm, bool async_op)>;

  // Runs `issue` on the communicator of `device` (every tensor of the op is
  // on it: check_devices).
  c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, const char* op,
                                        const c10::Device& device, bool async_op,
                                        std::vector<at::Tensor> outputs, const Issue& issue,
                                        Finish finish);
  // `future`, or (with a `finish`) its continuation that runs `finish` once
  // the op succeeded and completes with `outputs`.
  static c10::intrusive_ptr<c10::ivalue::Future> then_finish(
      c10::intrusive_ptr<c10::ivalue::Future> future, Finish finish,
      const std::vector<at::Tensor>& outputs);
  // Issues an op of one flat output and one flat input (the _base variants,
  // reduce_scatter over its flattened list): the staging path they share.
  // Each tensor is staged in a contiguous buffer when it is not contiguous,
  // and the output's buffer is copied back after the op.
  using IssueFlat = std::function<c10::intrusive_ptr<pycomm::Work>(
      Comm& comm, const at::Tensor& out, const at::Tensor& in, bool async_op)>;
  c10::intrusive_ptr<c10d::Work> launch_flat(c10d::OpType type, const char* op,
                                             const c10::Device& device, bool async_op,
                                             const at::Tensor& output, const at::Tensor& input,
                                             IssueFlat issue);
  // The flat all_gather, and the flat reduce_scatter with reduce op `rop`:
  // the _base variants and their one-tensor coalesced forms issue them.
  static IssueFlat all_gather_issue();
  static IssueFlat reduce_scatter_issue(int rop);
  c10::intrusive_ptr<c10d::Work> p2p(c10d::OpType type, const char* op,
                                     std::vector<at::Tensor>& tensors, int peer, int tag);
  void check_not_coalescing(const char* op) const;
  int reduce_op(const c10d::ReduceOp& op, const char* opname) const;

  std::shared_ptr<Comm> cpu_comm_;
  std::string cpu_algo_;
  LazyCudaComm cuda_;  // the CUDA communicator, made at the first CUDA op
  Shrinker shrinker_;  // empty: supportsShrinking() is false
  std::string cuda_algo_;
  // Every communicator of the group for shutdown / abort, in the order every
  // rank closes them: `cuda` (may be null), the CPU one (across hosts, it
  // closes and aborts its parts: csrc/torch/hierarchy.h).
  std::vector<std::shared_ptr<Comm>> all_comms(std::shared_ptr<Comm> cuda) const;
  struct Coalesced {
    TensorP2P req;
    at::Tensor user;  // the caller's tensor when `req.tensor` is a staging copy
    c10::intrusive_ptr<c10::ivalue::Future> future;
  };
  std::atomic<uint64_t> seq_{0};  // collectives issued (getSequenceNumberForGroup)
  bool coalescing_ = false;       // c10d calls a backend from one thread at a time
  std::vector<Coalesced> coalesced_;
};

}  // namespace pycomm
