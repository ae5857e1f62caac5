// pycomm as a torch.distributed backend: init_process_group(backend="pycomm").
//
// ProcessGroupPycomm is a thin c10d::Backend over one pycomm::Comm (the same
// C++ communicator behind pycomm.Communicator): it maps c10d's calls and
// options onto Comm's ops, stages what Comm cannot take directly (tensor lists,
// non-contiguous tensors) through contiguous buffers, and wraps pycomm::Work in
// a c10d::Work. No algorithm lives here. pycomm/backend.py registers it.
//
// CPU only: the CUDA communicator (CudaComm) has a different C++ class and is
// not wired in yet, so a CUDA tensor raises a clear error naming the way out.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm.h"

namespace pycomm {

// A c10d::Work whose completion, error and result come from one future: the
// pycomm op's own, or a continuation of it that copies staged outputs back.
class BackendWork final : public c10d::Work {
 public:
  // `op` (may be null for ops that already finished) is waited on first:
  // pycomm::Work::wait() refuses to block the communicator's worker thread.
  BackendWork(int rank, c10d::OpType type, c10::intrusive_ptr<pycomm::Work> op,
              c10::intrusive_ptr<c10::ivalue::Future> future, std::vector<at::Tensor> outputs);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override {}
  // timeout 0 (c10d's kNoTimeout) waits without limit; the communicator's
  // own timeout bounds every transfer anyway.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<pycomm::Work> op_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::vector<at::Tensor> outputs_;
};

class ProcessGroupPycomm final : public c10d::Backend {
 public:
  // `algo`: the all_reduce algorithm ("auto", "ring", "direct"); the other
  // collectives use "auto".
  ProcessGroupPycomm(std::shared_ptr<Comm> comm, std::string algo);
  ~ProcessGroupPycomm() override;

  const std::string getBackendName() const override { return "pycomm"; }
  bool supportsCoalescing() const override { return true; }
  const std::shared_ptr<Comm>& comm() const { return comm_; }
  const std::string& algo() const { return algo_; }

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
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // batch_isend_irecv: between the two, send/recv only collect; the batch is
  // posted together (Comm::batch_p2p) by endCoalescing.
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  void shutdown() override;  // closes the communicator (waits for queued ops)
  void abort() override;     // fails pending and later ops at once

 private:
  // Runs after the op succeeds: copies staged results into the caller's
  // tensors (on the worker thread for async ops, the caller's for sync ones).
  using Finish = std::function<void()>;
  // Issues the Comm op with the given async_op; returns its Work (null when
  // it ran synchronously).
  using Issue = std::function<c10::intrusive_ptr<pycomm::Work>(bool async_op)>;

  c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, const char* op, bool async_op,
                                        std::vector<at::Tensor> outputs, const Issue& issue,
                                        Finish finish);
  c10::intrusive_ptr<c10d::Work> p2p(c10d::OpType type, const char* op,
                                     std::vector<at::Tensor>& tensors, int peer, int tag);
  void check_not_coalescing(const char* op) const;
  int reduce_op(const c10d::ReduceOp& op, const char* opname) const;

  std::shared_ptr<Comm> comm_;
  std::string algo_;
  struct Coalesced {
    TensorP2P req;
    at::Tensor user;  // the caller's tensor when `req.tensor` is a staging copy
    c10::intrusive_ptr<c10::ivalue::Future> future;
  };
  bool coalescing_ = false;  // c10d calls a backend from one thread at a time
  std::vector<Coalesced> coalesced_;
};

}  // namespace pycomm
