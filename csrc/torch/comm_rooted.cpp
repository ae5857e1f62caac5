// Comm::reduce, gather, scatter, all_to_all and all_to_all_single: argument
// checks, the op header, and a body that calls the core (core/collectives.h).
// Like the other ops in comm.cpp, no algorithm logic lives here: the core
// picks reduce's algorithm by size. Their op headers carry AlgoKind::kNone:
// the core decides, alike on every rank.

#include "../core/collectives.h"
#include "comm.h"

namespace pycomm {
namespace {

// A rooted op's list on a rank other than the root: torch.distributed wants
// None there (an empty list is the same), so a list is a mistake.
void check_no_list(const std::vector<at::Tensor>& list, const char* name, const char* root_arg,
                   int root, int rank, const char* op) {
  if (list.empty()) return;
  throw UsageError(cat(op, ": ", name, " must be None on ranks other than ", root_arg, "=", root,
                       " (this is rank ", rank, "); only the root ",
                       (op[0] == 'g' ? "receives" : "sends"), " a list"));
}

// Rows of `splits` (dim 0 of a tensor of `rows` rows) -> element counts of
// `row` elements each; empty splits: equal blocks.
std::vector<size_t> split_counts(const std::vector<int64_t>& splits, const char* splits_arg,
                                 int64_t rows, int64_t row, const char* tensor_arg, int world_size,
                                 const char* op) {
  std::vector<size_t> counts(static_cast<size_t>(world_size));
  if (splits.empty()) {
    if (rows % world_size != 0) {
      throw UsageError(cat(op, ": ", tensor_arg, ".size(0) = ", rows,
                           " is not divisible by world_size = ", world_size, "; pass ",
                           splits_arg));
    }
    for (auto& c : counts) c = static_cast<size_t>(rows / world_size * row);
    return counts;
  }
  if (splits.size() != static_cast<size_t>(world_size)) {
    throw UsageError(cat(op, ": ", splits_arg, " must have world_size = ", world_size,
                         " entries, got ", splits.size()));
  }
  int64_t sum = 0;
  for (size_t p = 0; p < splits.size(); ++p) {
    if (splits[p] < 0) {
      throw UsageError(cat(op, ": ", splits_arg, "[", p, "] = ", splits[p], " is negative"));
    }
    sum += splits[p];
    counts[p] = static_cast<size_t>(splits[p] * row);
  }
  if (sum != rows) {
    throw UsageError(
        cat(op, ": ", splits_arg, " sum to ", sum, " but ", tensor_arg, ".size(0) = ", rows));
  }
  return counts;
}

// Elements per row of dim 0.
int64_t row_elems(const at::Tensor& t) {
  int64_t row = 1;
  for (int64_t d = 1; d < t.dim(); ++d) row *= t.size(d);
  return row;
}

bool overlap(const at::Tensor& a, const at::Tensor& b) {
  if (!a.has_storage() || !b.has_storage() || a.nbytes() == 0 || b.nbytes() == 0) return false;
  if (!a.storage().is_alias_of(b.storage())) return false;
  const char* pa = static_cast<const char*>(a.data_ptr());
  const char* pb = static_cast<const char*>(b.data_ptr());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

}  // namespace

c10::intrusive_ptr<Work> Comm::reduce(const at::Tensor& t, int dst, int op, bool async_op) {
  constexpr const char* kOp = "reduce";
  check_open(kOp);
  check_tensor(t, "tensor", kOp);
  check_peer(dst, "dst", kOp, rank_, size_, /*allow_self=*/true);
  const DType dt = to_dtype(t.scalar_type(), "tensor");
  const ReduceOp rop = to_op(op, dt, kOp);
  void* data = t.data_ptr();
  const size_t count = t.numel();
  return launch(
      kOp, {t},
      collective(
          OpHeader::of(CollKind::kReduce, count, int32_t(dt), int32_t(rop), dst, AlgoKind::kNone),
          [=](const Context& ctx) { pycomm::reduce(ctx, data, count, dt, rop, dst); }),
      wait_of(async_op));
}

DType Comm::check_rooted(const at::Tensor& tensor, const std::vector<at::Tensor>& list,
                         const char* list_arg, const char* root_arg, int root, const char* op,
                         std::vector<void*>* ptrs) const {
  check_open(op);
  check_tensor(tensor, "tensor", op);
  check_peer(root, root_arg, op, rank_, size_, /*allow_self=*/true);
  const DType dt = to_dtype(tensor.scalar_type(), "tensor");
  if (rank_ != root) {
    check_no_list(list, list_arg, root_arg, root, rank_, op);
    return dt;
  }
  check_list(list, list_arg, tensor, "tensor", size_, op,
             [&](const at::Tensor& x, const std::string& a) { check_tensor(x, a.c_str(), op); });
  for (const auto& t : list) ptrs->push_back(t.data_ptr());
  return dt;
}

c10::intrusive_ptr<Work> Comm::gather(const std::vector<at::Tensor>& outs, const at::Tensor& in,
                                      int dst, bool async_op) {
  constexpr const char* kOp = "gather";
  std::vector<void*> out_ptrs;
  const DType dt = check_rooted(in, outs, "gather_list", "dst", dst, kOp, &out_ptrs);
  const void* src = in.data_ptr();
  const size_t m = in.numel(), es = in.element_size();
  advise_filled(outs);
  return launch(
      kOp, outs,
      collective(
          OpHeader::of(CollKind::kGather, m, int32_t(dt), -1, dst, AlgoKind::kNone),
          [=](const Context& ctx) { pycomm::gather(ctx, src, out_ptrs.data(), m, es, dst); }),
      wait_of(async_op), {in});
}

c10::intrusive_ptr<Work> Comm::scatter(const at::Tensor& out, const std::vector<at::Tensor>& ins,
                                       int src, bool async_op) {
  constexpr const char* kOp = "scatter";
  std::vector<void*> ptrs;
  const DType dt = check_rooted(out, ins, "scatter_list", "src", src, kOp, &ptrs);
  const std::vector<const void*> in_ptrs(ptrs.begin(), ptrs.end());
  void* dst = out.data_ptr();
  const size_t m = out.numel(), es = out.element_size();
  return launch(
      kOp, {out},
      collective(
          OpHeader::of(CollKind::kScatter, m, int32_t(dt), -1, src, AlgoKind::kNone),
          [=](const Context& ctx) { pycomm::scatter(ctx, in_ptrs.data(), dst, m, es, src); }),
      wait_of(async_op), ins);
}

c10::intrusive_ptr<Work> Comm::all_to_all(const std::vector<at::Tensor>& outs,
                                          const std::vector<at::Tensor>& ins, bool async_op) {
  constexpr const char* kOp = "all_to_all";
  check_open(kOp);
  const size_t n = static_cast<size_t>(size_);
  for (const auto& [list, name] :
       {std::pair{&outs, "output_tensor_list"}, std::pair{&ins, "input_tensor_list"}}) {
    if (list->size() != n) {
      throw UsageError(
          cat(kOp, ": ", name, " must hold world_size = ", size_, " tensors, got ", list->size()));
    }
  }
  std::vector<const void*> send(n);
  std::vector<void*> recv(n);
  std::vector<size_t> send_count(n), recv_count(n);
  const at::ScalarType st = ins[0].scalar_type();
  for (size_t p = 0; p < n; ++p) {
    for (const auto& [t, name] :
         {std::pair{&ins[p], "input_tensor_list"}, std::pair{&outs[p], "output_tensor_list"}}) {
      const std::string arg = indexed(name, p);
      check_tensor(*t, arg.c_str(), kOp);
      if (t->scalar_type() != st) {
        throw UsageTypeError(
            join_msg({kOp, ": ", arg, " dtype ", c10::toString(t->scalar_type()),
                      " differs from input_tensor_list[0] dtype ", c10::toString(st)}));
      }
    }
    send[p] = ins[p].data_ptr();
    send_count[p] = ins[p].numel();
    recv[p] = outs[p].data_ptr();
    recv_count[p] = outs[p].numel();
  }
  if (send_count[rank_] != recv_count[rank_]) {
    throw UsageError(cat(kOp, ": input_tensor_list[", rank_, "] has ", send_count[rank_],
                         " elements but output_tensor_list[", rank_, "] has ", recv_count[rank_],
                         " (this rank's block to itself)"));
  }
  const DType dt = to_dtype(st, "input_tensor_list[0]");
  const size_t es = ins[0].element_size();
  advise_filled(outs);
  return launch(
      kOp, outs,
      collective(OpHeader::of(CollKind::kAllToAll, 0, int32_t(dt), -1, -1, AlgoKind::kNone),
                 [=](const Context& ctx) {
                   pycomm::all_to_all(ctx, send.data(), send_count.data(), recv.data(),
                                      recv_count.data(), es);
                 }),
      wait_of(async_op), ins);
}

c10::intrusive_ptr<Work> Comm::all_to_all_single(const at::Tensor& out, const at::Tensor& in,
                                                 const std::vector<int64_t>& out_splits,
                                                 const std::vector<int64_t>& in_splits,
                                                 bool async_op) {
  constexpr const char* kOp = "all_to_all_single";
  check_open(kOp);
  check_tensor(out, "output", kOp);
  check_tensor(in, "input", kOp);
  if (out.scalar_type() != in.scalar_type()) {
    throw UsageTypeError(join_msg({kOp, ": output dtype ", c10::toString(out.scalar_type()),
                                   " differs from input dtype ", c10::toString(in.scalar_type())}));
  }
  for (const auto& [t, name] : {std::pair{&in, "input"}, std::pair{&out, "output"}}) {
    if (t->dim() == 0) {
      throw UsageError(join_msg(
          {kOp, ": ", name, " must have at least one dimension (blocks are rows of dim 0)"}));
    }
  }
  if (overlap(out, in)) {
    throw UsageError(join_msg({kOp, ": output overlaps input; pass separate tensors"}));
  }
  const std::vector<size_t> send_count =
      split_counts(in_splits, "input_split_sizes", in.size(0), row_elems(in), "input", size_, kOp);
  const std::vector<size_t> recv_count = split_counts(out_splits, "output_split_sizes", out.size(0),
                                                      row_elems(out), "output", size_, kOp);
  if (send_count[rank_] != recv_count[rank_]) {
    throw UsageError(cat(kOp, ": this rank's block to itself has ", send_count[rank_],
                         " elements in input (input_split_sizes[", rank_, "]) but ",
                         recv_count[rank_], " in output (output_split_sizes[", rank_, "])"));
  }
  const size_t n = static_cast<size_t>(size_), es = in.element_size();
  std::vector<const void*> send(n);
  std::vector<void*> recv(n);
  const char* src = static_cast<const char*>(in.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (size_t p = 0, so = 0, ro = 0; p < n; ++p) {
    send[p] = src + so * es;
    recv[p] = dst + ro * es;
    so += send_count[p];
    ro += recv_count[p];
  }
  const DType dt = to_dtype(in.scalar_type(), "input");
  advise_filled({out});
  return launch(
      kOp, {out},
      collective(OpHeader::of(CollKind::kAllToAll, 0, int32_t(dt), -1, -1, AlgoKind::kNone),
                 [=](const Context& ctx) {
                   pycomm::all_to_all(ctx, send.data(), send_count.data(), recv.data(),
                                      recv_count.data(), es);
                 }),
      wait_of(async_op), {in});
}

}  // namespace pycomm
