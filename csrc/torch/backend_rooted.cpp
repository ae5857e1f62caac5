// ProcessGroupPycomm's rooted collectives (reduce, gather, scatter), its
// all-to-alls and the coalesced variants of all_gather / reduce_scatter. Each
// maps onto one pycomm::Comm op (comm.h; the algorithms are the core's):
//
//   reduce                           Comm::reduce (non-roots reduce in a copy:
//                                    their tensor is left as it was, as gloo)
//   gather / scatter                 Comm::gather / Comm::scatter
//   alltoall / alltoall_base         Comm::all_to_all / all_to_all_single
//   allgather_into_tensor_coalesced  one Comm::all_gather of the inputs (one
//                                    tensor: _allgather_base, unpacked)
//   allgather_coalesced              concatenated, copied out per tensor
//   reduce_scatter_tensor_coalesced  one Comm::reduce_scatter of the inputs'
//                                    rank blocks regrouped, split per tensor
//                                    (one tensor: _reduce_scatter_base)
//
// Staging is backend.cpp's: non-contiguous tensors go through contiguous
// buffers that are copied back when the op completes.
#include <cstring>
#include "backend.h"
#include "backend_util.h"

namespace pycomm {

using namespace backend_detail;  // NOLINT(google-build-using-namespace)

namespace {

// Contiguous stand-ins for the tensors of `list` (backend_detail::contiguous_buffer).
std::vector<at::Tensor> contiguous_buffers(const std::vector<at::Tensor>& list) {
  std::vector<at::Tensor> bufs;
  bufs.reserve(list.size());
  for (const auto& t : list) bufs.push_back(contiguous_buffer(t));
  return bufs;
}

// Copies each staged buffer of `bufs` back into its tensor of `list`;
// nothing to do when none was staged.
std::function<void()> copy_back_list(const std::vector<at::Tensor>& list,
                                     const std::vector<at::Tensor>& bufs) {
  bool staged = false;
  for (size_t i = 0; i < list.size(); ++i) staged = staged || !list[i].is_same(bufs[i]);
  if (!staged) return {};
  return [list, bufs] {
    for (size_t i = 0; i < list.size(); ++i) copy_back(list[i], bufs[i]);
  };
}

// Every tensor of `list` has the dtype of the first (the coalesced ops move
// them in one flat buffer).
void check_one_dtype(const std::vector<at::Tensor>& list, const char* arg, const char* op) {
  for (size_t i = 0; i < list.size(); ++i) {
    TORCH_CHECK_TYPE(list[i].scalar_type() == list[0].scalar_type(), op, ": ", arg, "[", i,
                     "] has dtype ", list[i].scalar_type(), " but ", arg, "[0] has ",
                     list[0].scalar_type(), "; the pycomm backend coalesces one dtype per call");
  }
}

// Element counts of the tensors of `list`.
// A coalesced op's lists: pairs of one dtype, the whole side (outputs for
// the all-gathers, inputs for the reduce-scatter) world_size times the
// other. Returns the op's device.
c10::Device check_coalesced(const std::vector<at::Tensor>& outputs,
                            const std::vector<at::Tensor>& inputs, bool outputs_whole, int size,
                            const char* op) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), op, ": got ", outputs.size(), " outputs for ",
                    inputs.size(), " inputs");
  const c10::Device dev =
      OpDevice(op).add_list(outputs, "outputs").add_list(inputs, "inputs").get();
  check_one_dtype(inputs, "inputs", op);
  const char* whole = outputs_whole ? "outputs" : "inputs";
  const char* part = outputs_whole ? "inputs" : "outputs";
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK_TYPE(outputs[i].scalar_type() == inputs[i].scalar_type(), op, ": outputs[", i,
                     "] has dtype ", outputs[i].scalar_type(), " but inputs[", i, "] has ",
                     inputs[i].scalar_type());
    const int64_t w = (outputs_whole ? outputs : inputs)[i].numel();
    const int64_t p = (outputs_whole ? inputs : outputs)[i].numel();
    TORCH_CHECK_VALUE(w == p * size, op, ": ", whole, "[", i, "] must have world_size * ", part,
                      "[", i, "].numel() = ", p * size, " elements, got ", w);
  }
  return dev;
}

// gather's and scatter's arguments, checked: the one tensor every rank
// passes, the list (the root's; empty elsewhere) and the op's device.
struct RootedArgs {
  at::Tensor one;
  std::vector<at::Tensor> list;
  c10::Device dev = c10::kCPU;
};

// Reads gather's and scatter's arguments as torch passes them: one tensor in
// `one` (named `one_arg`), and the list as [list] on the root, [] elsewhere.
// Checks them and the root.
RootedArgs rooted_args(std::vector<at::Tensor>& one, std::vector<std::vector<at::Tensor>>& lists,
                       const char* one_arg, const char* list_arg, int root, const char* root_arg,
                       int rank, int size, const char* op) {
  check_one(one, op);
  check_peer(root, root_arg, op, rank, size, /*allow_self=*/true);
  RootedArgs a;
  a.one = one[0];
  // The list goes the other way: gather's outputs, scatter's inputs.
  const char* lists_arg = std::strcmp(one_arg, "input") == 0 ? "output" : "input";
  if (!lists.empty()) a.list = one_list(lists, lists_arg, op);
  a.dev = OpDevice(op).add(a.one, one_arg).add_list(a.list, list_arg).get();
  return a;
}

std::vector<int64_t> numels(const std::vector<at::Tensor>& list) {
  std::vector<int64_t> n;
  n.reserve(list.size());
  for (const auto& t : list) n.push_back(t.numel());
  return n;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  constexpr const char* kOp = "reduce";
  const at::Tensor t = root_tensor(tensors, opts.rootTensor, kOp);
  const c10::Device dev = OpDevice(kOp).add(t, "tensor").get();
  const int rop = reduce_op(opts.reduceOp, kOp);
  const int dst = static_cast<int>(opts.rootRank);
  check_peer(dst, "dst", kOp, rank_, size_, /*allow_self=*/true);
  // The root reduces in place; the others in a copy (left as they were).
  const bool root = dst == rank_;
  at::Tensor buf = root ? contiguous_buffer(t) : t.clone(at::MemoryFormat::Contiguous);
  Finish finish = root ? copy_back_when_staged(t, buf) : Finish{};
  return launch(
      c10d::OpType::REDUCE, kOp, dev, opts.asyncOp, {t},
      [buf, dst, rop](Comm& c, bool async_op) { return c.reduce(buf, dst, rop, async_op); },
      std::move(finish));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  constexpr const char* kOp = "gather";
  const int dst = static_cast<int>(opts.rootRank);
  const RootedArgs a =
      rooted_args(inputs, outputs, "input", "gather_list", dst, "dst", rank_, size_, kOp);
  std::vector<at::Tensor> bufs = contiguous_buffers(a.list);
  at::Tensor src = contiguous_buffer(a.one);
  return launch(
      c10d::OpType::GATHER, kOp, a.dev, opts.asyncOp, a.list,
      [bufs, src, dst](Comm& c, bool async_op) { return c.gather(bufs, src, dst, async_op); },
      copy_back_list(a.list, bufs));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  constexpr const char* kOp = "scatter";
  const int src = static_cast<int>(opts.rootRank);
  const RootedArgs a =
      rooted_args(outputs, inputs, "output", "scatter_list", src, "src", rank_, size_, kOp);
  at::Tensor buf = contiguous_buffer(a.one);
  std::vector<at::Tensor> srcs = contiguous_buffers(a.list);
  return launch(
      c10d::OpType::SCATTER, kOp, a.dev, opts.asyncOp, {a.one},
      [buf, srcs, src](Comm& c, bool async_op) { return c.scatter(buf, srcs, src, async_op); },
      copy_back_when_staged(a.one, buf));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::alltoall(std::vector<at::Tensor>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllToAllOptions& opts) {
  constexpr const char* kOp = "alltoall";
  const c10::Device dev = OpDevice(kOp)
                              .add_list(outputs, "output_tensor_list")
                              .add_list(inputs, "input_tensor_list")
                              .get();
  std::vector<at::Tensor> bufs = contiguous_buffers(outputs);
  std::vector<at::Tensor> srcs = contiguous_buffers(inputs);
  return launch(
      c10d::OpType::ALLTOALL, kOp, dev, opts.asyncOp, outputs,
      [bufs, srcs](Comm& c, bool async_op) { return c.all_to_all(bufs, srcs, async_op); },
      copy_back_list(outputs, bufs));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
    std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) {
  constexpr const char* kOp = "alltoall_base";
  const c10::Device dev = OpDevice(kOp).add(output, "output").add(input, "input").get();
  return launch_flat(c10d::OpType::ALLTOALL_BASE, kOp, dev, opts.asyncOp, output, input,
                     [output_splits, input_splits](Comm& c, const at::Tensor& out,
                                                   const at::Tensor& in, bool async_op) {
                       return c.all_to_all_single(out, in, output_splits, input_splits, async_op);
                     });
}

// The coalesced all-gathers: one all_gather of the inputs concatenated
// (`flat_in`, n = sum of their sizes) into `gathered` = [world_size, n], whose
// row r holds rank r's inputs one after another; `copy_out(gathered)` then
// places each piece.
c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr const char* kOp = "allgather_into_tensor_coalesced";
  const c10::Device dev = check_coalesced(outputs, inputs, /*outputs_whole=*/true, size_, kOp);
  // One tensor (DTensor's full_tensor, FSDP2's flat buffer): the flat op,
  // with no packing (each extra buffer is fresh memory to fault in).
  if (inputs.size() == 1) {
    return launch_flat(c10d::OpType::COALESCED, kOp, dev, opts.asyncOp, outputs[0], inputs[0],
                       all_gather_issue());
  }
  at::Tensor flat_in = flatten(inputs);
  at::Tensor gathered = at::empty({size_, flat_in.numel()}, flat_in.options());
  const std::vector<int64_t> n = numels(inputs);
  std::vector<at::Tensor> outs = outputs;
  return launch(
      c10d::OpType::COALESCED, kOp, dev, opts.asyncOp, outs,
      [gathered, flat_in](Comm& c, bool async_op) {
        return c.all_gather(gathered, flat_in, "auto", async_op);
      },
      [outs, gathered, n] {
        int64_t off = 0;
        for (size_t i = 0; i < outs.size(); ++i) {
          copy_back(outs[i], gathered.narrow(1, off, n[i]).contiguous());
          off += n[i];
        }
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr const char* kOp = "allgather_coalesced";
  // output_lists[r][i] receives rank r's inputs[i].
  TORCH_CHECK_VALUE(static_cast<int>(output_lists.size()) == size_, kOp,
                    ": output_tensor_lists must hold world_size = ", size_, " lists, got ",
                    output_lists.size());
  OpDevice device(kOp);
  device.add_list(inputs, "input_tensor_list");
  for (int r = 0; r < size_; ++r) {
    const auto& list = output_lists[static_cast<size_t>(r)];
    const std::string arg = "output_tensor_lists[" + std::to_string(r) + "]";
    device.add_list(list, arg.c_str());
    TORCH_CHECK_VALUE(list.size() == inputs.size(), kOp, ": ", arg, " holds ", list.size(),
                      " tensors but input_tensor_list holds ", inputs.size());
    for (size_t i = 0; i < list.size(); ++i) {
      TORCH_CHECK_TYPE(list[i].scalar_type() == inputs[i].scalar_type(), kOp, ": ", arg, "[", i,
                       "] has dtype ", list[i].scalar_type(), " but input_tensor_list[", i,
                       "] has ", inputs[i].scalar_type());
      TORCH_CHECK_VALUE(list[i].numel() == inputs[i].numel(), kOp, ": ", arg, "[", i, "] has ",
                        list[i].numel(), " elements but input_tensor_list[", i, "] has ",
                        inputs[i].numel());
    }
  }
  const c10::Device dev = device.get();
  check_one_dtype(inputs, "input_tensor_list", kOp);
  at::Tensor flat_in = flatten(inputs);
  at::Tensor gathered = at::empty({size_, flat_in.numel()}, flat_in.options());
  std::vector<at::Tensor> outs;
  for (const auto& list : output_lists) outs.insert(outs.end(), list.begin(), list.end());
  return launch(
      c10d::OpType::ALLGATHER_COALESCED, kOp, dev, opts.asyncOp, outs,
      [gathered, flat_in](Comm& c, bool async_op) {
        return c.all_gather(gathered, flat_in, "auto", async_op);
      },
      [outs, gathered] { unflatten(outs, gathered.view({-1})); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  constexpr const char* kOp = "reduce_scatter_tensor_coalesced";
  const c10::Device dev = check_coalesced(outputs, inputs, /*outputs_whole=*/false, size_, kOp);
  const int rop = reduce_op(opts.reduceOp, kOp);
  if (inputs.size() == 1) {  // as in allgather_into_tensor_coalesced
    return launch_flat(c10d::OpType::COALESCED, kOp, dev, opts.asyncOp, outputs[0], inputs[0],
                       reduce_scatter_issue(rop));
  }
  // Regrouped so that block r of the flat input is rank r's block of every
  // input, one after another: [world_size, sum of the outputs' sizes].
  std::vector<at::Tensor> blocks;
  for (const auto& in : inputs) blocks.push_back(in.reshape({size_, -1}));
  at::Tensor flat_in = at::cat(blocks, 1).reshape({-1});
  at::Tensor flat_out = at::empty({flat_in.numel() / size_}, flat_in.options());
  std::vector<at::Tensor> outs = outputs;
  return launch(
      c10d::OpType::COALESCED, kOp, dev, opts.asyncOp, outs,
      [flat_out, flat_in, rop](Comm& c, bool async_op) {
        return c.reduce_scatter(flat_out, flat_in, rop, "auto", async_op);
      },
      [outs, flat_out] { unflatten(outs, flat_out); });
}

}  // namespace pycomm
