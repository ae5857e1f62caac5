// Comm::all_reduce (comm.h): its checks, the algorithm choice and its body.
#include <optional>

#include "call_guard.h"
#include "comm.h"

namespace pycomm {

namespace {
// The ring with a 16-bit wire (all_reduce(wire_dtype=...)).
AlgoKind wire_kind(DType wire) {
  return wire == DType::kFloat16 ? AlgoKind::kRingWireF16 : AlgoKind::kRingWireBF16;
}
// The quantized all-reduce in format f (op_header.h: kQuantInt8 + format).
AlgoKind quant_kind(QuantFormat f) {
  return static_cast<AlgoKind>(static_cast<int32_t>(AlgoKind::kQuantInt8) + static_cast<int>(f));
}

// One all_reduce as its body runs it (Comm::all_reduce decided all of it).
struct AllReduceCall {
  AlgoKind kind;
  void* data;
  size_t count;
  DType dt;
  ReduceOp rop;
  Wire wire;        // a 16-bit cast or a quantized format
  float* residual;  // quantized: error feedback, or null
  size_t block;     // quantized: elements per scale
  void* qbuf;       // quantized: work space
  std::shared_ptr<SymmetricMemory> symmetric;
  SymmetricMemory::Decision sym;  // kDirect: the registration decided
};

void run_all_reduce(const Context& ctx, const AllReduceCall& c) {
  switch (c.kind) {
    case AlgoKind::kQuantInt8:
    case AlgoKind::kQuantFp8E4M3:
    case AlgoKind::kQuantFp8E5M2:
      quantized_all_reduce(ctx, c.data, c.dt, c.count, c.residual, c.block, *c.wire.quant, c.rop,
                           c.qbuf);
      break;
    case AlgoKind::kRingWireF16:
    case AlgoKind::kRingWireBF16:
      ring_all_reduce_wire(ctx, static_cast<float*>(c.data), c.count, *c.wire.cast, c.rop);
      break;
    case AlgoKind::kDirect:
      c.symmetric->all_reduce(ctx, c.sym, c.data, c.count, c.dt, c.rop);
      break;
    case AlgoKind::kNative:
      ctx.transport.wait(ctx.transport.native()->all_reduce(c.data, c.data, c.count, c.dt, c.rop));
      break;
    case AlgoKind::kRecursiveDoubling:
      recursive_doubling_all_reduce(ctx, c.data, c.count, c.dt, c.rop);
      break;
    case AlgoKind::kHalvingDoubling:
      halving_doubling_all_reduce(ctx, c.data, c.count, c.dt, c.rop);
      break;
    case AlgoKind::kTree: tree_all_reduce(ctx, c.data, c.count, c.dt, c.rop); break;
    default: ring_all_reduce(ctx, c.data, c.count, c.dt, c.rop); break;
  }
}
}  // namespace

c10::intrusive_ptr<Work> Comm::all_reduce(const at::Tensor& t, int op, const std::string& algo,
                                          bool async_op, int wire_dtype, bool to_register,
                                          int64_t wire_block,
                                          const std::optional<at::Tensor>& residual) {
  constexpr const char* kOp = "all_reduce";
  check_open(kOp);
  check_tensor(t, "tensor", kOp);
  const DType dt = to_dtype(t.scalar_type(), "tensor");
  const ReduceOp rop = to_op(op, dt, kOp);
  const Wire wire = to_wire(wire_dtype, dt, kOp);
  const bool quantized = wire.quant.has_value();
  if (quantized) check_quantized_wire(t, *wire.quant, rop, algo, wire_block, residual, kOp);
  if (residual && !quantized) {
    throw UsageError(
        "all_reduce: residual (error feedback) needs a quantized wire_dtype (torch.int8, "
        "torch.float8_e4m3fn or torch.float8_e5m2)");
  }
  if (hierarchy_ &&
      hierarchy_->takes_all_reduce(t, algo, op, wire.cast.has_value(), quantized, to_register)) {
    std::optional<Hierarchy::QuantWire> qw;
    if (quantized) {
      qw = Hierarchy::QuantWire{wire_dtype, int32_t(quant_kind(*wire.quant)), wire_block, residual};
    }
    return all_reduce_across_hosts(t, op, algo, async_op, to_register, std::move(qw));
  }
  AlgoKind kind = quantized ? quant_kind(*wire.quant)
                            : pick(algo, CollKind::kAllReduce, t.nbytes(), wire.cast.has_value());
  if (wire.cast) kind = wire_kind(*wire.cast);
  void* data = t.data_ptr();
  const size_t count = t.numel();
  const size_t block = static_cast<size_t>(wire_block);
  at::Tensor qwork = quantized ? at::empty({static_cast<int64_t>(quantized_all_reduce_work_bytes(
                                               count, block, size_, dt))},
                                           t.options().dtype(at::kByte))
                               : at::Tensor();
  void* qbuf = quantized ? qwork.data_ptr() : nullptr;
  float* res = residual ? residual->data_ptr<float>() : nullptr;
  SymmetricMemory::Decision sym;
  if (kind == AlgoKind::kDirect) {
    sym = symmetric_->decide(t, to_register, exec_->on_own_thread() && !in_composed_op());
  }
  // A registration holds one caller at a time until the move is done: another
  // thread's op on the tensor issued meanwhile would take the old address.
  std::optional<CallGuard> guard;
  if (sym.decided) guard.emplace(*this, kOp);
  const AllReduceCall call{kind, data, count, dt, rop, wire, res, block, qbuf, symmetric_, sym};
  c10::intrusive_ptr<Work> work =
      launch(kOp, {t},
             collective(OpHeader::of(CollKind::kAllReduce, count, int32_t(dt), int32_t(rop),
                                     quantized ? int32_t(wire_block) : -1, kind),
                        [call](const Context& ctx) { run_all_reduce(ctx, call); }),
             wait_of(async_op),
             quantized ? std::vector<at::Tensor>{qwork, residual.value_or(qwork)}
                       : std::vector<at::Tensor>{});
  if (work) SymmetricMemory::wait_for_decision(*work, sym);
  return work;
}

}  // namespace pycomm
