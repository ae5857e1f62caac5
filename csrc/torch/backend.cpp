// ProcessGroupPycomm's ops (backend.h); the rooted ones in backend_rooted.cpp,
// BackendWork in backend_work.cpp, the Python side in backend_bind.cpp.
#include "backend.h"

#include <mutex>

#include "backend_util.h"

namespace pycomm {

using namespace backend_detail;  // NOLINT(google-build-using-namespace)

namespace {

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

// ---------------------------------------------------------------- ProcessGroupPycomm

ProcessGroupPycomm::ProcessGroupPycomm(std::shared_ptr<Comm> cpu_comm, std::string cpu_algo,
                                       CommFactory cuda_factory, std::string cuda_algo)
    : c10d::Backend(cpu_comm->rank(), cpu_comm->world_size()),
      cpu_comm_(std::move(cpu_comm)),
      cpu_algo_(std::move(cpu_algo)),
      cuda_(std::move(cuda_factory), rank_, size_),
      cuda_algo_(std::move(cuda_algo)) {
  TORCH_CHECK_VALUE(cpu_comm_->device() == "cpu",
                    "the pycomm backend needs a CPU communicator, got one on ",
                    cpu_comm_->device());
  // Across hosts, p2p over the flat gloo ring, as torch's gloo backend:
  // receives from any source work (Comm::set_p2p_over_flat).
  cpu_comm_->set_p2p_over_flat(true);
  init();
}

ProcessGroupPycomm::~ProcessGroupPycomm() = default;

std::shared_ptr<Comm> ProcessGroupPycomm::comm_for(c10::Device device, const char* op) {
  if (device.is_cpu()) return cpu_comm_;
  TORCH_CHECK_VALUE(device.is_cuda(), op,
                    ": the pycomm backend runs on CPU and CUDA tensors, got one on ", device.str());
  if (!device.has_index()) device = c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice();
  return cuda_.get(device, op);
}

const std::string& ProcessGroupPycomm::algo_for(const c10::Device& device) const {
  return device.is_cpu() ? cpu_algo_ : cuda_algo_;
}

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
                                                          const c10::Device& device, bool async_op,
                                                          std::vector<at::Tensor> outputs,
                                                          const Issue& issue, Finish finish) {
  check_not_coalescing(op);
  const std::shared_ptr<Comm> comm = comm_for(device, op);
  if (type != c10d::OpType::SEND && type != c10d::OpType::RECV &&
      type != c10d::OpType::RECVANYSOURCE)
    ++seq_;
  if (!async_op) {
    // Synchronous. CPU: Comm runs the op on this thread when its worker is
    // idle (no hand-off), waits, and throws on failure. CUDA: the current
    // stream is ordered after the op, and the copy back runs on it.
    issue(*comm, false);
    if (finish) finish();
    return c10::make_intrusive<BackendWork>(rank_, type, nullptr, completed_future(outputs, device),
                                            outputs);
  }
  c10::intrusive_ptr<pycomm::Work> work = issue(*comm, true);
  c10::intrusive_ptr<c10::ivalue::Future> future = then_finish(work->future(), finish, outputs);
  return c10::make_intrusive<BackendWork>(rank_, type, std::move(work), std::move(future),
                                          std::move(outputs));
}

c10::intrusive_ptr<c10::ivalue::Future> ProcessGroupPycomm::then_finish(
    c10::intrusive_ptr<c10::ivalue::Future> future, Finish finish,
    const std::vector<at::Tensor>& outputs) {
  if (!finish) return future;
  // An error of the op passes through. CPU: runs on the thread that completes
  // the op, before anyone waiting on the returned Work or its future sees it
  // (at once when it is complete already). CUDA: runs now (the op's future
  // completed at the enqueue), on a stream that waits for the op; the
  // continuation's future, and so the Work, are ordered after the copy.
  return future->then(
      [finish = std::move(finish), outputs](c10::ivalue::Future& done) {
        done.value();  // rethrows the op's error
        finish();
        return c10::IValue(outputs);
      },
      tensor_list_type());
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  constexpr const char* kOp = "allreduce";
  check_one(tensors, kOp);
  const at::Tensor t = tensors[0];
  const c10::Device dev = OpDevice(kOp).add(t, "tensor").get();
  TORCH_CHECK_NOT_IMPLEMENTED(!opts.sparseIndices.has_value(),
                              "allreduce: the pycomm backend does not support sparse tensors");
  const int rop = reduce_op(opts.reduceOp, kOp);
  at::Tensor buf = contiguous_buffer(t);
  Finish finish = copy_back_when_staged(t, buf);
  const std::string algo = algo_for(dev);
  return launch(
      c10d::OpType::ALLREDUCE, kOp, dev, opts.asyncOp, {t},
      [buf, rop, algo](Comm& c, bool async_op) { return c.all_reduce(buf, rop, algo, async_op); },
      std::move(finish));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  constexpr const char* kOp = "allreduce_coalesced";
  const c10::Device dev = OpDevice(kOp).add_list(tensors, "tensors").get();
  for (const auto& t : tensors) {
    TORCH_CHECK_TYPE(t.scalar_type() == tensors[0].scalar_type(), kOp,
                     ": every tensor must have the same dtype, got ", tensors[0].scalar_type(),
                     " and ", t.scalar_type());
  }
  const int rop = reduce_op(opts.reduceOp, kOp);
  // One all_reduce over a flat copy of all tensors, copied back on completion.
  at::Tensor flat = flatten(tensors);
  std::vector<at::Tensor> list = tensors;
  const std::string algo = algo_for(dev);
  return launch(
      c10d::OpType::ALLREDUCE_COALESCED, kOp, dev, opts.asyncOp, list,
      [flat, rop, algo](Comm& c, bool async_op) { return c.all_reduce(flat, rop, algo, async_op); },
      [list, flat] { unflatten(list, flat); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  constexpr const char* kOp = "broadcast";
  const at::Tensor t = root_tensor(tensors, opts.rootTensor, kOp);
  const c10::Device dev = OpDevice(kOp).add(t, "tensor").get();
  at::Tensor buf = contiguous_buffer(t);
  Finish finish = copy_back_when_staged(t, buf);
  const int src = static_cast<int>(opts.rootRank);
  return launch(
      c10d::OpType::BROADCAST, kOp, dev, opts.asyncOp, {t},
      [buf, src](Comm& c, bool async_op) { return c.broadcast(buf, src, "auto", async_op); },
      std::move(finish));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr const char* kOp = "allgather";
  check_one(inputs, kOp);
  std::vector<at::Tensor> outs = one_list(outputs, "output", kOp);
  const at::Tensor in = inputs[0];
  const c10::Device dev = OpDevice(kOp).add(in, "input").add_list(outs, "output_tensor_list").get();
  check_list(outs, "output_tensor_list", in, "input", size_, kOp);
  // Gathered into one flat staging buffer, then copied out to the list.
  at::Tensor flat = at::empty({in.numel() * size_}, in.options());
  at::Tensor src = contiguous_buffer(in);
  return launch(
      c10d::OpType::ALLGATHER, kOp, dev, opts.asyncOp, outs,
      [flat, src](Comm& c, bool async_op) { return c.all_gather(flat, src, "auto", async_op); },
      [outs, flat] { unflatten(outs, flat); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::launch_flat(
    c10d::OpType type, const char* op, const c10::Device& device, bool async_op,
    const at::Tensor& output, const at::Tensor& input, IssueFlat issue) {
  at::Tensor buf = contiguous_buffer(output);
  at::Tensor src = contiguous_buffer(input);
  Finish finish = copy_back_when_staged(output, buf);
  return launch(
      type, op, device, async_op, {output},
      [issue = std::move(issue), buf, src](Comm& c, bool async) {
        return issue(c, buf, src, async);
      },
      std::move(finish));
}

ProcessGroupPycomm::IssueFlat ProcessGroupPycomm::all_gather_issue() {
  return [](Comm& c, const at::Tensor& out, const at::Tensor& in, bool async_op) {
    return c.all_gather(out, in, "auto", async_op);
  };
}

ProcessGroupPycomm::IssueFlat ProcessGroupPycomm::reduce_scatter_issue(int rop) {
  return [rop](Comm& c, const at::Tensor& out, const at::Tensor& in, bool async_op) {
    return c.reduce_scatter(out, in, rop, "auto", async_op);
  };
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  constexpr const char* kOp = "_allgather_base";
  const c10::Device dev = OpDevice(kOp).add(output, "output").add(input, "input").get();
  return launch_flat(c10d::OpType::_ALLGATHER_BASE, kOp, dev, opts.asyncOp, output, input,
                     all_gather_issue());
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  constexpr const char* kOp = "reduce_scatter";
  check_one(outputs, kOp);
  const std::vector<at::Tensor>& ins = one_list(inputs, "input", kOp);
  const at::Tensor out = outputs[0];
  const c10::Device dev = OpDevice(kOp).add(out, "output").add_list(ins, "input_list").get();
  check_list(ins, "input_list", out, "output", size_, kOp);
  const int rop = reduce_op(opts.reduceOp, kOp);
  // The list is concatenated into one flat input (Comm reduces in a copy of it).
  return launch_flat(c10d::OpType::REDUCE_SCATTER, kOp, dev, opts.asyncOp, out, flatten(ins),
                     reduce_scatter_issue(rop));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  constexpr const char* kOp = "_reduce_scatter_base";
  const c10::Device dev = OpDevice(kOp).add(output, "output").add(input, "input").get();
  const int rop = reduce_op(opts.reduceOp, kOp);
  return launch_flat(c10d::OpType::_REDUCE_SCATTER_BASE, kOp, dev, opts.asyncOp, output, input,
                     reduce_scatter_issue(rop));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::barrier(const c10d::BarrierOptions& opts) {
  // A CUDA barrier (on the CUDA communicator) when the group is bound to a
  // CUDA device (init_process_group(device_id=...): torch's barrier op does
  // not pass it in opts, the backend holds it) or device_ids are given, and
  // this group can have a CUDA communicator at all: torch fills device_ids in
  // for any accelerator, and on a CPU-only host scripts written for NCCL
  // still pass device_ids=[local_rank]. Otherwise on the CPU communicator.
  const bool cuda_ok = cuda_.has_factory() && at::hasCUDA();
  c10::Device dev(c10::kCPU);
  if (opts.device.has_value()) {
    dev = *opts.device;
  } else if (auto bound = getBoundDeviceId()) {
    dev = *bound;
  } else if (!opts.device_ids.empty()) {
    dev = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(opts.device_ids[0]));
  }
  if (dev.is_cuda() && !cuda_ok) dev = c10::Device(c10::kCPU);
  return launch(
      c10d::OpType::BARRIER, "barrier", dev, opts.asyncOp, {},
      [](Comm& c, bool async_op) { return c.barrier(async_op); }, nullptr);
}

// ---------------------------------------------------------------- point to point

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::p2p(c10d::OpType type, const char* op,
                                                       std::vector<at::Tensor>& tensors, int peer,
                                                       int tag) {
  check_one(tensors, op);
  const bool is_send = type == c10d::OpType::SEND;
  const at::Tensor t = tensors[0];
  const c10::Device dev = OpDevice(op).add(t, "tensor").get();
  at::Tensor buf = contiguous_buffer(t);
  if (coalescing_) {
    // Validated now, posted with the batch by endCoalescing.
    TORCH_CHECK_VALUE(peer != kAnySource, op,
                      ": a receive from any source cannot be part of batch_isend_irecv");
    check_peer(peer, is_send ? "dst" : "src", op, rank_, size_, /*allow_self=*/false);
    auto future = pending_future(dev);
    coalesced_.push_back({TensorP2P{is_send, buf, peer, tag}, is_send ? at::Tensor() : t, future});
    return c10::make_intrusive<BackendWork>(rank_, type, nullptr, future,
                                            std::vector<at::Tensor>{t});
  }
  Finish finish = is_send ? Finish{} : copy_back_when_staged(t, buf);
  // Always asynchronous: the send/recv of c10d returns a Work to wait on.
  return launch(
      type, op, dev, /*async_op=*/true, {t},
      [buf, peer, is_send, tag](Comm& c, bool async_op) {
        return is_send ? c.send(buf, peer, async_op, tag) : c.recv(buf, peer, async_op, tag);
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

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::recvAnysource(std::vector<at::Tensor>& tensors,
                                                                 int tag) {
  return p2p(c10d::OpType::RECVANYSOURCE, "recv_anysource", tensors, kAnySource, tag);
}

void ProcessGroupPycomm::startCoalescing() {
  TORCH_CHECK(!coalescing_, "pycomm backend: startCoalescing called twice without endCoalescing");
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::endCoalescing() {
  constexpr const char* kOp = "batch_isend_irecv";
  TORCH_CHECK(coalescing_, "pycomm backend: endCoalescing without startCoalescing");
  coalescing_ = false;
  std::vector<Coalesced> items;
  items.swap(coalesced_);
  if (items.empty()) {
    return c10::make_intrusive<BackendWork>(rank_, c10d::OpType::COALESCED, nullptr,
                                            completed_future({}, c10::Device(c10::kCPU)),
                                            std::vector<at::Tensor>{});
  }
  std::vector<at::Tensor> outputs;
  std::vector<TensorP2P> reqs;
  OpDevice device(kOp);
  for (size_t i = 0; i < items.size(); ++i) {
    const auto& c = items[i];
    device.add(c.req.tensor, "op " + std::to_string(i) + "'s tensor");
    reqs.push_back(c.req);
    outputs.push_back(c.user.defined() ? c.user : c.req.tensor);
  }
  const std::shared_ptr<Comm> comm = comm_for(device.get(), kOp);
  c10::intrusive_ptr<pycomm::Work> work = comm->batch_p2p(reqs);
  // On completion (CUDA: at the enqueue, on a stream ordered after the batch):
  // staged receives copied back, then each op's own future.
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

c10::intrusive_ptr<c10d::Backend> ProcessGroupPycomm::shrink(
    const std::vector<int64_t>& ranks_to_exclude, int shrink_flags,
    const c10::intrusive_ptr<Options>& opts_override) {
  TORCH_CHECK_NOT_IMPLEMENTED(static_cast<bool>(shrinker_),
                              "this pycomm backend was made without a shrinker "
                              "(_C.make_backend(shrinker=None))");
  const int64_t timeout_ms = opts_override ? opts_override->timeout.count() : -1;
  c10::intrusive_ptr<c10d::Backend> survivors =
      shrinker_(ranks_to_exclude, shrink_flags, timeout_ms);
  // Shrunk (the CPU communicator is closed): this group's CUDA communicator
  // may wait on the ranks that left, and none is made any more.
  cuda_.abort("the process group was shrunk (torch.distributed.shrink_group)");
  return survivors;
}

std::vector<std::shared_ptr<Comm>> ProcessGroupPycomm::all_comms(std::shared_ptr<Comm> cuda) const {
  return {std::move(cuda), cpu_comm_};  // across hosts, the CPU one closes its parts
}

void ProcessGroupPycomm::shutdown() {
  std::shared_ptr<Comm> cuda = cuda_.shut_down();
  // All, on every rank in the same order; the first failure is raised.
  std::exception_ptr err;
  for (const auto& comm : all_comms(cuda)) {
    try {
      if (comm) comm->close();
    } catch (...) {
      if (!err) err = std::current_exception();
    }
  }
  if (err) std::rethrow_exception(err);
}

void ProcessGroupPycomm::abort() {
  const char* why = "aborted through torch.distributed";
  cuda_.abort(why);  // one still being made is aborted when it arrives
  for (const auto& comm : all_comms(nullptr)) {
    if (comm) comm->abort(why);
  }
}

}  // namespace pycomm
