#include "checks.h"

#include <algorithm>
#include <iterator>

#include "executor.h"

namespace pycomm {

DType to_dtype(at::ScalarType t, const char* arg, const char* op) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kByte: return DType::kUInt8;
    case at::kChar: return DType::kInt8;
    default: break;
  }
  throw UsageTypeError(
      cat(op ? op : "", op ? ": " : "", arg, " has unsupported dtype ", c10::toString(t),
          "; pycomm supports float32, float64, float16, bfloat16, int32, int64, uint8, int8"));
}

std::string join_msg(std::initializer_list<std::string> parts) {
  std::string s;
  for (const auto& p : parts) s += p;
  return s;
}

void check_tensor(const at::Tensor& t, const char* arg, const char* op, const c10::Device& device) {
  if (!t.defined()) throw UsageError(join_msg({op, ": ", arg, " is an undefined tensor"}));
  if (t.is_sparse()) throw UsageError(join_msg({op, ": ", arg, " must be a dense tensor"}));
  to_dtype(t.scalar_type(), arg, op);
  // A CPU communicator takes any CPU tensor; a CUDA one, its own device only.
  if (t.device().type() != device.type() ||
      (device.has_index() && t.device().index() != device.index())) {
    throw UsageError(join_msg({op, ": ", arg, " is on ", t.device().str(),
                               " but the communicator runs on ", device.str()}));
  }
  if (!t.is_contiguous()) {
    throw UsageError(join_msg(
        {op, ": ", arg, " must be contiguous (pass t.contiguous() and copy the result back)"}));
  }
}

void check_peer(int peer, const char* arg, const char* op, int rank, int size, bool allow_self) {
  if (peer < 0 || peer >= size) {
    throw UsageError(cat(op, ": ", arg, "=", peer, " is out of range for world_size ", size));
  }
  if (!allow_self && peer == rank) {
    throw UsageError(
        cat(op, ": ", arg, "=", peer, " is this rank; point-to-point needs another rank"));
  }
}

void check_scatter_sizes(const at::Tensor& big, const char* big_arg, const at::Tensor& small,
                         const char* small_arg, int world_size, const char* op) {
  if (big.scalar_type() != small.scalar_type()) {
    throw UsageTypeError(
        join_msg({op, ": ", big_arg, " dtype ", c10::toString(big.scalar_type()), " differs from ",
                  small_arg, " dtype ", c10::toString(small.scalar_type())}));
  }
  if (big.numel() != small.numel() * world_size) {
    throw UsageError(cat(op, ": ", big_arg, " must have world_size * ", small_arg, ".numel() = ",
                         world_size, " * ", small.numel(), " elements, got ", big.numel()));
  }
}

ReduceOp to_op(int op, DType dtype, const char* opname) {
  if (op < 0 || op >= kNumReduceOps) {
    throw UsageError(join_msg({opname, ": unknown reduce op ", std::to_string(op)}));
  }
  const ReduceOp r = static_cast<ReduceOp>(op);
  if (r == ReduceOp::kAvg && !is_floating(dtype)) {
    throw UsageError(join_msg({opname, ": ReduceOp.AVG needs a floating dtype, got ",
                               dtype_name(dtype), " (use SUM and divide)"}));
  }
  return r;
}

Wire to_wire(int wire_dtype, DType tensor_dtype, const char* opname) {
  if (wire_dtype < 0) return {};
  Wire w;
  std::string name;
  if (wire_dtype == int(DType::kFloat16) || wire_dtype == int(DType::kBFloat16)) {
    w.cast = static_cast<DType>(wire_dtype);
    name = dtype_name(*w.cast);
  } else if (wire_dtype == int(DType::kInt8) || wire_dtype == kWireFp8E4M3 ||
             wire_dtype == kWireFp8E5M2) {
    w.quant = wire_dtype == kWireFp8E4M3   ? QuantFormat::kFp8E4M3
              : wire_dtype == kWireFp8E5M2 ? QuantFormat::kFp8E5M2
                                           : QuantFormat::kInt8;
    name = quant_format_name(*w.quant);
  } else {
    throw UsageError(cat(opname,
                         ": wire_dtype must be torch.float16, torch.bfloat16, torch.int8, "
                         "torch.float8_e4m3fn or torch.float8_e5m2, got ",
                         wire_dtype < kNumDTypes ? dtype_name(static_cast<DType>(wire_dtype))
                                                 : std::to_string(wire_dtype)));
  }
  // A quantized wire takes 16-bit tensors too (widened to float32 around
  // the op); a 16-bit wire only makes sense for float32.
  const bool takes =
      tensor_dtype == DType::kFloat32 ||
      (w.quant && (tensor_dtype == DType::kFloat16 || tensor_dtype == DType::kBFloat16));
  if (!takes) {
    throw UsageError(join_msg({opname, ": wire_dtype needs a ",
                               w.quant ? "float32, float16 or bfloat16" : "float32",
                               " tensor (it is reduced in float32 and sent as ", name, "), got ",
                               dtype_name(tensor_dtype)}));
  }
  return w;
}

namespace {
// A contiguous float32 tensor on `device` (`whose`: "" or the tensor whose
// device it must share, as "src's "), else UsageError naming `arg`.
void check_float_on(const at::Tensor& t, const char* arg, const char* op, const c10::Device& device,
                    const std::string& whose = "") {
  if (t.device() != device || !t.is_contiguous() || t.scalar_type() != at::kFloat) {
    throw UsageError(cat(op, ": ", arg, " must be a contiguous float32 tensor on ", whose,
                         device.str(), ", got ", c10::toString(t.scalar_type()), " on ",
                         t.device().str(), t.is_contiguous() ? "" : ", not contiguous"));
  }
}

// `arg` a float32 companion of `like` (named `like_name`): contiguous, on
// its device, of its size (a residual, an error buffer).
void check_float_like(const at::Tensor& t, const char* arg, const at::Tensor& like,
                      const char* like_name, const char* op) {
  check_float_on(t, arg, op, like.device(), cat(like_name, "'s "));
  if (t.numel() != like.numel()) {
    throw UsageError(cat(op, ": ", arg, " must have ", like_name, "'s ", like.numel(),
                         " elements, got ", t.numel()));
  }
}
}  // namespace

void check_quantized_wire(const at::Tensor& t, QuantFormat f, ReduceOp op, const std::string& algo,
                          int64_t block, const std::optional<at::Tensor>& residual,
                          const char* opname) {
  const std::string what = cat(": wire_dtype=torch.", quant_format_name(f));
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg) {
    throw UsageError(cat(opname, what, " needs op SUM or AVG, got ", op_name(op),
                         ": a quantized wire cannot carry it (the ", op_name(op),
                         " of quantized values is not that of the values)"));
  }
  if (algo != "auto") {
    throw UsageError(cat(opname, what,
                         " runs its own algorithm (quantized all-to-all, float32 sums, "
                         "all-gather): pass algo='auto', not '",
                         algo, "'"));
  }
  if (block < 1 || block > (int64_t{1} << 20)) {
    throw UsageError(cat(opname, ": wire_block must be in [1, 1048576], got ", block));
  }
  if (!residual) return;
  const at::Tensor& r = *residual;
  check_float_like(r, "residual", t, "tensor", opname);
  const char *a = static_cast<const char*>(t.data_ptr()),
             *b = static_cast<const char*>(r.data_ptr());
  if (t.numel() > 0 && a < b + r.nbytes() && b < a + t.nbytes()) {
    throw UsageError(cat(opname, ": residual must not share memory with tensor"));
  }
}

QuantFormat quant_format(const std::string& name, const char* op) {
  for (int f = 0; f < kNumQuantFormats; ++f) {
    const auto q = static_cast<QuantFormat>(f);
    if (name == quant_format_name(q)) return q;
  }
  throw UsageError(
      cat(op, ": format must be 'int8', 'float8_e4m3fn' or 'float8_e5m2', got '", name, "'"));
}

void check_quantize_args(const at::Tensor& src, int64_t block, const std::optional<at::Tensor>& err,
                         const char* op, const c10::Device& device) {
  check_float_on(src, "src", op, device);
  if (block < 1) throw UsageError(cat(op, ": block must be >= 1, got ", block));
  if (err) check_float_like(*err, "err", src, "src", op);
}

void check_dequantize_args(const at::Tensor& dst, const at::Tensor& src, int64_t block,
                           const char* op, const c10::Device& device) {
  check_float_on(dst, "dst", op, device);
  if (block < 1) throw UsageError(cat(op, ": block must be >= 1, got ", block));
  const size_t want = quant_bytes(dst.numel(), static_cast<size_t>(block));
  if (src.device() != device || !src.is_contiguous() || src.nbytes() != want) {
    throw UsageError(cat(op, ": src must be ", want, " contiguous bytes on ", device.str(),
                         " (quant_bytes(dst.numel(), block)), got ", src.nbytes(), " on ",
                         src.device().str()));
  }
}

std::string indexed(const char* name, size_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

void check_list(const std::vector<at::Tensor>& list, const char* name, const at::Tensor& like,
                const char* like_name, int world_size, const char* op,
                const std::function<void(const at::Tensor&, const std::string&)>& check) {
  if (list.size() != static_cast<size_t>(world_size)) {
    throw UsageError(
        cat(op, ": ", name, " must hold world_size = ", world_size, " tensors, got ", list.size()));
  }
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string arg = indexed(name, i);
    if (check) check(list[i], arg);
    if (list[i].scalar_type() != like.scalar_type()) {
      throw UsageTypeError(
          join_msg({op, ": ", arg, " dtype ", c10::toString(list[i].scalar_type()),
                    " differs from ", like_name, " dtype ", c10::toString(like.scalar_type())}));
    }
    if (list[i].numel() != like.numel()) {
      throw UsageError(cat(op, ": ", arg, " has ", list[i].numel(), " elements but ", like_name,
                           " has ", like.numel(), "; every tensor of ", name, " must match it"));
    }
  }
}

std::exception_ptr abort_op(Executor& executor, Work& work, const std::exception& e,
                            const std::string& device) {
  // "all_reduce #3 on rank 1 (shm transport, world_size 2, cpu) failed: why".
  const std::string msg = cat(work.op(), " #", work.seq(), " on rank ", executor.rank(), " (",
                              executor.transport_name(), " transport, world_size ",
                              executor.world_size(), ", ", device, ") failed: ", e.what());
  executor.abort(msg);
  const std::exception_ptr error = dynamic_cast<const Interrupted*>(&e) != nullptr
                                       ? std::make_exception_ptr(Interrupted(msg))
                                       : std::make_exception_ptr(CommError(msg));
  work.fail(error);
  return error;
}

std::exception_ptr fail_op(Executor& executor, Work& work, const std::exception& e,
                           const std::string& device) {
  if (dynamic_cast<const UsageError*>(&e) == nullptr) return abort_op(executor, work, e, device);
  // "all_reduce #3 on rank 1: why"; the communicator stays usable.
  const std::exception_ptr error = std::make_exception_ptr(
      UsageError(cat(work.op(), " #", work.seq(), " on rank ", executor.rank(), ": ", e.what())));
  work.fail(error);
  return error;
}

void check_options(const CommOptions& options) {
  if (options.slice_bytes < 64) throw UsageError("slice_bytes must be at least 64");
  if (options.timeout_ms <= 0) throw UsageError("timeout must be positive");
  for (const auto& [op, rules] : options.auto_table) {
    const bool known = std::any_of(std::begin(kChoosable), std::end(kChoosable),
                                   [&](CollKind c) { return op == coll_name(c); });
    if (!known) throw UsageError(cat("auto_table: unknown collective '", op, "'"));
    for (const auto& rule : rules) {
      if (algo_from_name(rule.second) == AlgoKind::kNone) {
        throw UsageError(join_msg({"auto_table: unknown algo '", rule.second, "' for ", op}));
      }
    }
  }
}

}  // namespace pycomm
