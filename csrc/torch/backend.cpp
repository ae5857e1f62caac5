#include "backend.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/utils/pybind.h>

#include <condition_variable>
#include <mutex>
#include <sstream>

namespace py = pybind11;

namespace pycomm {

namespace {

c10::TypePtr tensor_list_type() { return c10::ListType::create(c10::TensorType::get()); }

c10::intrusive_ptr<c10::ivalue::Future> completed_future(const std::vector<at::Tensor>& outputs) {
  auto f = c10::make_intrusive<c10::ivalue::Future>(tensor_list_type());
  f->markCompleted(c10::IValue(outputs));
  return f;
}

// A contiguous stand-in for `t` that the communicator can work in: `t`
// itself when it is contiguous, else a contiguous copy.
at::Tensor contiguous_buffer(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// Copies `src` (same number of elements) into the caller's tensor `dst`
// unless they are the same storage view.
void copy_back(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.is_same(src)) return;
  at::NoGradGuard no_grad;
  dst.copy_(src.view(dst.sizes()));
}

// What an op on `buf` (contiguous_buffer(dst), or a flat staging buffer) must
// do once it completes: copy the result into `dst`; nothing when `buf` is
// `dst` itself (no callback is chained then).
std::function<void()> copy_back_when_staged(const at::Tensor& dst, const at::Tensor& buf) {
  if (buf.is_same(dst)) return {};
  return [dst, buf] { copy_back(dst, buf); };
}

void check_one(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK_VALUE(tensors.size() == 1, op, ": the pycomm backend takes one tensor per call, got ",
                    tensors.size());
}

// The CUDA communicator (CudaComm) is a separate class that this backend
// does not drive yet; say so instead of failing deep inside the op.
void check_cpu(const at::Tensor& t, const char* arg, const char* op) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", arg, " is an undefined tensor");
  TORCH_CHECK_NOT_IMPLEMENTED(
      t.device().is_cpu(), op, ": ", arg, " is on ", t.device().str(),
      "; the pycomm torch.distributed backend runs on CPU tensors only (its CUDA communicator "
      "is not wired into the backend yet). Use backend=\"cpu:pycomm,cuda:nccl\" for CUDA "
      "tensors, or pycomm.init(device=\"cuda\") directly");
}

// list variants: every tensor of `list` has `like`'s dtype and element count.
void check_list(const std::vector<at::Tensor>& list, const char* list_arg, const at::Tensor& like,
                const char* like_arg, int world_size, const char* op) {
  TORCH_CHECK_VALUE(static_cast<int>(list.size()) == world_size, op, ": ", list_arg,
                    " must hold world_size = ", world_size, " tensors, got ", list.size());
  for (size_t r = 0; r < list.size(); ++r) {
    check_cpu(list[r], list_arg, op);
    TORCH_CHECK_TYPE(list[r].scalar_type() == like.scalar_type(), op, ": ", list_arg, "[", r,
                     "] has dtype ", list[r].scalar_type(), " but ", like_arg, " has ",
                     like.scalar_type());
    TORCH_CHECK_VALUE(list[r].numel() == like.numel(), op, ": ", list_arg, "[", r, "] has ",
                      list[r].numel(), " elements but ", like_arg, " has ", like.numel());
  }
}

// One flat contiguous tensor holding the tensors of `list` one after another.
at::Tensor flatten(const std::vector<at::Tensor>& list) {
  std::vector<at::Tensor> flat;
  flat.reserve(list.size());
  for (const auto& t : list) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

// Copies consecutive pieces of `flat` back into the tensors of `list`.
void unflatten(const std::vector<at::Tensor>& list, const at::Tensor& flat) {
  int64_t off = 0;
  for (const auto& t : list) {
    copy_back(t, flat.narrow(0, off, t.numel()));
    off += t.numel();
  }
}

const char* c10d_op_name(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

}  // namespace

// ---------------------------------------------------------------- BackendWork

BackendWork::BackendWork(int rank, c10d::OpType type, c10::intrusive_ptr<pycomm::Work> op,
                         c10::intrusive_ptr<c10::ivalue::Future> future,
                         std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type),
      op_(std::move(op)),
      future_(std::move(future)),
      outputs_(std::move(outputs)) {}

bool BackendWork::isCompleted() { return future_->completed(); }

bool BackendWork::isSuccess() const { return future_->completed() && !future_->hasError(); }

std::exception_ptr BackendWork::exception() const {
  return future_->completed() && future_->hasError() ? future_->exception_ptr() : nullptr;
}

std::vector<at::Tensor> BackendWork::result() { return outputs_; }

bool BackendWork::wait(std::chrono::milliseconds timeout) {
  if (timeout == kNoTimeout) {
    // The pycomm op first: its wait() throws rather than deadlock when called
    // on the worker thread (inside a Future callback) before completion.
    if (op_) op_->wait();
    future_->wait();
  } else if (!future_->completed()) {
    struct Done {
      std::mutex mu;
      std::condition_variable cv;
      bool done = false;
    };
    auto done = std::make_shared<Done>();
    future_->addCallback([done](c10::ivalue::Future&) {
      std::lock_guard<std::mutex> lk(done->mu);
      done->done = true;
      done->cv.notify_all();
    });
    std::unique_lock<std::mutex> lk(done->mu);
    if (!done->cv.wait_for(lk, timeout, [&] { return done->done; })) {
      throw std::runtime_error("pycomm backend: " + c10d::opTypeToString(opType_) +
                               " did not complete within " + std::to_string(timeout.count()) +
                               " ms (Work.wait timeout)");
    }
  }
  if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
  return true;
}

// ---------------------------------------------------------------- ProcessGroupPycomm

ProcessGroupPycomm::ProcessGroupPycomm(std::shared_ptr<Comm> comm, std::string algo)
    : c10d::Backend(comm->rank(), comm->world_size()),
      comm_(std::move(comm)),
      algo_(std::move(algo)) {
  TORCH_CHECK_VALUE(comm_->device() == "cpu",
                    "the pycomm backend needs a CPU communicator, got one on ", comm_->device());
  init();
}

ProcessGroupPycomm::~ProcessGroupPycomm() = default;

void ProcessGroupPycomm::check_not_coalescing(const char* op) const {
  TORCH_CHECK_NOT_IMPLEMENTED(
      !coalescing_, op,
      ": the pycomm backend coalesces only send/recv (batch_isend_irecv); issue collectives "
      "outside the coalescing manager");
}

int ProcessGroupPycomm::reduce_op(const c10d::ReduceOp& op, const char* opname) const {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return static_cast<int>(ReduceOp::kSum);
    case c10d::ReduceOp::AVG: return static_cast<int>(ReduceOp::kAvg);
    case c10d::ReduceOp::MAX: return static_cast<int>(ReduceOp::kMax);
    case c10d::ReduceOp::MIN: return static_cast<int>(ReduceOp::kMin);
    case c10d::ReduceOp::PRODUCT: return static_cast<int>(ReduceOp::kProduct);
    default: break;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, opname, ": ReduceOp.", c10d_op_name(op.op_),
                              " is not supported by the pycomm backend (supported: SUM, AVG, "
                              "MAX, MIN, PRODUCT)");
  return -1;  // not reached: the check above throws
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::launch(c10d::OpType type, const char* op,
                                                          bool async_op,
                                                          std::vector<at::Tensor> outputs,
                                                          const Issue& issue, Finish finish) {
  check_not_coalescing(op);
  if (!async_op) {
    // Synchronous: Comm runs the op on this thread when its worker is idle
    // (no hand-off), waits, and throws on failure.
    issue(false);
    if (finish) finish();
    return c10::make_intrusive<BackendWork>(rank_, type, nullptr, completed_future(outputs),
                                            outputs);
  }
  c10::intrusive_ptr<pycomm::Work> work = issue(true);
  c10::intrusive_ptr<c10::ivalue::Future> future = work->future();
  if (finish) {
    // Runs on the worker as the op completes, before anyone waiting on the
    // returned Work or its future sees it; an error of the op passes through.
    future = future->then(
        [finish = std::move(finish), outputs](c10::ivalue::Future& done) {
          done.value();  // rethrows the op's error
          finish();
          return c10::IValue(outputs);
        },
        tensor_list_type());
  }
  return c10::make_intrusive<BackendWork>(rank_, type, std::move(work), std::move(future),
                                          std::move(outputs));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  constexpr const char* kOp = "allreduce";
  check_one(tensors, kOp);
  const at::Tensor t = tensors[0];
  check_cpu(t, "tensor", kOp);
  TORCH_CHECK_NOT_IMPLEMENTED(!opts.sparseIndices.has_value(),
                              "allreduce: the pycomm backend does not support sparse tensors");
  const int rop = reduce_op(opts.reduceOp, kOp);
  at::Tensor buf = contiguous_buffer(t);
  Finish finish = copy_back_when_staged(t, buf);
  return launch(
      c10d::OpType::ALLREDUCE, kOp, opts.asyncOp, {t},
      [this, buf, rop](bool async_op) { return comm_->all_reduce(buf, rop, algo_, async_op); },
      std::move(finish));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  constexpr const char* kOp = "allreduce_coalesced";
  TORCH_CHECK_VALUE(!tensors.empty(), kOp, ": needs at least one tensor");
  for (const auto& t : tensors) {
    check_cpu(t, "tensors", kOp);
    TORCH_CHECK_TYPE(t.scalar_type() == tensors[0].scalar_type(), kOp,
                     ": every tensor must have the same dtype, got ", tensors[0].scalar_type(),
                     " and ", t.scalar_type());
  }
  const int rop = reduce_op(opts.reduceOp, kOp);
  // One all_reduce over a flat copy of all tensors, copied back on completion.
  at::Tensor flat = flatten(tensors);
  std::vector<at::Tensor> list = tensors;
  return launch(
      c10d::OpType::ALLREDUCE_COALESCED, kOp, opts.asyncOp, list,
      [this, flat, rop](bool async_op) { return comm_->all_reduce(flat, rop, algo_, async_op); },
      [list, flat] { unflatten(list, flat); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  constexpr const char* kOp = "broadcast";
  check_one(tensors, kOp);
  TORCH_CHECK_VALUE(opts.rootTensor == 0, kOp, ": rootTensor must be 0, got ", opts.rootTensor);
  const at::Tensor t = tensors[0];
  check_cpu(t, "tensor", kOp);
  at::Tensor buf = contiguous_buffer(t);
  Finish finish = copy_back_when_staged(t, buf);
  const int src = static_cast<int>(opts.rootRank);
  return launch(
      c10d::OpType::BROADCAST, kOp, opts.asyncOp, {t},
      [this, buf, src](bool async_op) { return comm_->broadcast(buf, src, "auto", async_op); },
      std::move(finish));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr const char* kOp = "allgather";
  check_one(inputs, kOp);
  TORCH_CHECK_VALUE(outputs.size() == 1, kOp,
                    ": the pycomm backend takes one output list per call, got ", outputs.size());
  const at::Tensor in = inputs[0];
  check_cpu(in, "input", kOp);
  std::vector<at::Tensor> outs = outputs[0];
  check_list(outs, "output_tensor_list", in, "input", size_, kOp);
  // Gathered into one flat staging buffer, then copied out to the list.
  at::Tensor flat = at::empty({in.numel() * size_}, in.options());
  at::Tensor src = contiguous_buffer(in);
  return launch(
      c10d::OpType::ALLGATHER, kOp, opts.asyncOp, outs,
      [this, flat, src](bool async_op) { return comm_->all_gather(flat, src, "auto", async_op); },
      [outs, flat] { unflatten(outs, flat); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  constexpr const char* kOp = "_allgather_base";
  check_cpu(output, "output", kOp);
  check_cpu(input, "input", kOp);
  const at::Tensor out = output;
  at::Tensor buf = contiguous_buffer(out);
  at::Tensor src = contiguous_buffer(input);
  Finish finish = copy_back_when_staged(out, buf);
  return launch(
      c10d::OpType::_ALLGATHER_BASE, kOp, opts.asyncOp, {out},
      [this, buf, src](bool async_op) { return comm_->all_gather(buf, src, "auto", async_op); },
      std::move(finish));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  constexpr const char* kOp = "reduce_scatter";
  check_one(outputs, kOp);
  TORCH_CHECK_VALUE(inputs.size() == 1, kOp,
                    ": the pycomm backend takes one input list per call, got ", inputs.size());
  const at::Tensor out = outputs[0];
  check_cpu(out, "output", kOp);
  check_list(inputs[0], "input_list", out, "output", size_, kOp);
  const int rop = reduce_op(opts.reduceOp, kOp);
  // The list is concatenated into one flat input (Comm reduces in a copy of it).
  at::Tensor flat = flatten(inputs[0]);
  at::Tensor buf = contiguous_buffer(out);
  Finish finish = copy_back_when_staged(out, buf);
  return launch(
      c10d::OpType::REDUCE_SCATTER, kOp, opts.asyncOp, {out},
      [this, buf, flat, rop](bool async_op) {
        return comm_->reduce_scatter(buf, flat, rop, "auto", async_op);
      },
      std::move(finish));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  constexpr const char* kOp = "_reduce_scatter_base";
  check_cpu(output, "output", kOp);
  check_cpu(input, "input", kOp);
  const int rop = reduce_op(opts.reduceOp, kOp);
  const at::Tensor out = output;
  at::Tensor buf = contiguous_buffer(out);
  at::Tensor src = contiguous_buffer(input);
  Finish finish = copy_back_when_staged(out, buf);
  return launch(
      c10d::OpType::_REDUCE_SCATTER_BASE, kOp, opts.asyncOp, {out},
      [this, buf, src, rop](bool async_op) {
        return comm_->reduce_scatter(buf, src, rop, "auto", async_op);
      },
      std::move(finish));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::barrier(const c10d::BarrierOptions& opts) {
  return launch(
      c10d::OpType::BARRIER, "barrier", opts.asyncOp, {},
      [this](bool async_op) { return comm_->barrier(async_op); }, nullptr);
}

// ---------------------------------------------------------------- point to point

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::p2p(c10d::OpType type, const char* op,
                                                       std::vector<at::Tensor>& tensors, int peer,
                                                       int tag) {
  check_one(tensors, op);
  const bool is_send = type == c10d::OpType::SEND;
  const at::Tensor t = tensors[0];
  check_cpu(t, "tensor", op);
  // pycomm pairs the messages between two ranks in posting order; a tag
  // could only be ignored, which would pair the wrong messages.
  TORCH_CHECK_NOT_IMPLEMENTED(tag == 0, op, ": tag=", tag,
                              " is not supported by the pycomm backend (messages between two "
                              "ranks pair in posting order); use tag=0");
  at::Tensor buf = contiguous_buffer(t);
  if (coalescing_) {
    // Validated now, posted with the batch by endCoalescing.
    check_peer(peer, is_send ? "dst" : "src", op, rank_, size_, /*allow_self=*/false);
    auto future = c10::make_intrusive<c10::ivalue::Future>(tensor_list_type());
    coalesced_.push_back({TensorP2P{is_send, buf, peer}, is_send ? at::Tensor() : t, future});
    return c10::make_intrusive<BackendWork>(rank_, type, nullptr, future,
                                            std::vector<at::Tensor>{t});
  }
  Finish finish = is_send ? Finish{} : copy_back_when_staged(t, buf);
  // Always asynchronous: the send/recv of c10d returns a Work to wait on.
  return launch(
      type, op, /*async_op=*/true, {t},
      [this, buf, peer, is_send](bool async_op) {
        return is_send ? comm_->send(buf, peer, async_op) : comm_->recv(buf, peer, async_op);
      },
      std::move(finish));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::send(std::vector<at::Tensor>& tensors, int dst,
                                                        int tag) {
  return p2p(c10d::OpType::SEND, "send", tensors, dst, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::recv(std::vector<at::Tensor>& tensors, int src,
                                                        int tag) {
  return p2p(c10d::OpType::RECV, "recv", tensors, src, tag);
}

void ProcessGroupPycomm::startCoalescing() {
  TORCH_CHECK(!coalescing_, "pycomm backend: startCoalescing called twice without endCoalescing");
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::endCoalescing() {
  TORCH_CHECK(coalescing_, "pycomm backend: endCoalescing without startCoalescing");
  coalescing_ = false;
  std::vector<Coalesced> items;
  items.swap(coalesced_);
  std::vector<at::Tensor> outputs;
  std::vector<TensorP2P> reqs;
  for (const auto& c : items) {
    reqs.push_back(c.req);
    outputs.push_back(c.user.defined() ? c.user : c.req.tensor);
  }
  if (reqs.empty()) {
    return c10::make_intrusive<BackendWork>(rank_, c10d::OpType::COALESCED, nullptr,
                                            completed_future({}), outputs);
  }
  c10::intrusive_ptr<pycomm::Work> work = comm_->batch_p2p(reqs);
  // On completion: staged receives copied back, then each op's own future.
  auto future = work->future()->then(
      [items, outputs](c10::ivalue::Future& done) {
        try {
          done.value();
          for (const auto& c : items) {
            if (c.user.defined() && !c.req.send) copy_back(c.user, c.req.tensor);
          }
        } catch (...) {
          for (const auto& c : items) c.future->setError(std::current_exception());
          throw;
        }
        for (const auto& c : items)
          c.future->markCompleted(
              c10::IValue(std::vector<at::Tensor>{c.user.defined() ? c.user : c.req.tensor}));
        return c10::IValue(outputs);
      },
      tensor_list_type());
  return c10::make_intrusive<BackendWork>(rank_, c10d::OpType::COALESCED, std::move(work),
                                          std::move(future), std::move(outputs));
}

void ProcessGroupPycomm::shutdown() { comm_->close(); }

void ProcessGroupPycomm::abort() { comm_->abort("aborted through torch.distributed"); }

// ---------------------------------------------------------------- Python

void bind_backend(py::module_& m) {
  m.def(
      "make_backend",
      [](std::shared_ptr<Comm> comm, const std::string& algo) -> c10::intrusive_ptr<c10d::Backend> {
        TORCH_CHECK_VALUE(comm, "make_backend: comm is None");
        return c10::make_intrusive<ProcessGroupPycomm>(std::move(comm), algo);
      },
      py::arg("comm"), py::arg("algo"),
      "A c10d Backend (torch._C._distributed_c10d.Backend) over `comm`, for "
      "torch.distributed.Backend.register_backend (pycomm/backend.py)");
  m.def(
      "backend_comm",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) -> std::shared_ptr<Comm> {
        auto* pg = dynamic_cast<ProcessGroupPycomm*>(backend.get());
        TORCH_CHECK_TYPE(pg != nullptr, "backend_comm: not a pycomm backend (its name is '",
                         backend->getBackendName(), "')");
        return pg->comm();
      },
      py::arg("backend"));
  m.def(
      "backend_algo",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) -> std::string {
        auto* pg = dynamic_cast<ProcessGroupPycomm*>(backend.get());
        TORCH_CHECK_TYPE(pg != nullptr, "backend_algo: not a pycomm backend");
        return pg->algo();
      },
      py::arg("backend"));
}

}  // namespace pycomm
