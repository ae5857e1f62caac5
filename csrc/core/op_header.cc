#include "op_header.h"

#include "types.h"

namespace pycomm {

const char* coll_name(CollKind k) {
  switch (k) {
    case CollKind::kAllReduce: return "all_reduce";
    case CollKind::kReduceScatter: return "reduce_scatter";
    case CollKind::kAllGather: return "all_gather";
    case CollKind::kBroadcast: return "broadcast";
    case CollKind::kBarrier: return "barrier";
    case CollKind::kCheck: return "checked-mode fingerprint exchange";
    case CollKind::kRegister: return "register_tensor";
    case CollKind::kReduce: return "reduce";
    case CollKind::kGather: return "gather";
    case CollKind::kScatter: return "scatter";
    case CollKind::kAllToAll: return "all_to_all";
  }
  return "?";
}

namespace {

const char* kind_name(int32_t k) {
  return k >= 1 && k <= kNumCollKinds ? coll_name(static_cast<CollKind>(k)) : "unknown-op";
}

// 8 bits each for kind, dtype + 1, op + 1, algo and wire; 24 for root + 1.
uint64_t byte_of(int32_t v) { return static_cast<uint64_t>(static_cast<uint8_t>(v)); }

// A quantized kind's wire dtype, as all_reduce(wire_dtype=...) names it.
const char* wire_name(int32_t a) {
  static const char* const names[] = {"int8", "float8_e4m3fn", "float8_e5m2"};
  return names[a - static_cast<int32_t>(AlgoKind::kQuantInt8)];
}

}  // namespace

const char* algo_name(int32_t a) {
  switch (static_cast<AlgoKind>(a)) {
    case AlgoKind::kRing: return "ring";
    case AlgoKind::kDirect: return "direct";
    case AlgoKind::kRingWireF16: return "ring, wire=float16";
    case AlgoKind::kRingWireBF16: return "ring, wire=bfloat16";
    case AlgoKind::kNative: return "nccl";
    case AlgoKind::kRecursiveDoubling: return "recursive_doubling";
    case AlgoKind::kHalvingDoubling: return "halving_doubling";
    case AlgoKind::kTree: return "tree";
    case AlgoKind::kBruck: return "bruck";
    case AlgoKind::kQuantInt8: return "quantized, wire=int8";
    case AlgoKind::kQuantFp8E4M3: return "quantized, wire=float8_e4m3fn";
    case AlgoKind::kQuantFp8E5M2: return "quantized, wire=float8_e5m2";
    case AlgoKind::kNone: break;
  }
  return "-";
}

bool is_quantized(int32_t a) {
  return a >= static_cast<int32_t>(AlgoKind::kQuantInt8) &&
         a <= static_cast<int32_t>(AlgoKind::kQuantFp8E5M2);
}

AlgoKind algo_from_name(const std::string& name) {
  for (int32_t a = 1; a <= static_cast<int32_t>(AlgoKind::kBruck); ++a) {
    const auto k = static_cast<AlgoKind>(a);
    if (k != AlgoKind::kRingWireF16 && k != AlgoKind::kRingWireBF16 && name == algo_name(a)) {
      return k;
    }
  }
  return AlgoKind::kNone;
}

bool implements(AlgoKind a, CollKind c) {
  switch (a) {
    case AlgoKind::kRing:
    case AlgoKind::kNative: return true;
    case AlgoKind::kDirect: return c == CollKind::kAllReduce || c == CollKind::kReduceScatter;
    case AlgoKind::kRecursiveDoubling:
    case AlgoKind::kHalvingDoubling:
    case AlgoKind::kTree: return c == CollKind::kAllReduce;
    case AlgoKind::kBruck: return c == CollKind::kAllGather;
    default: return false;
  }
}

std::vector<std::string> algorithms_of(CollKind c) {
  std::vector<std::string> out;
  for (const char* name : kAlgoNames) {
    if (implements(algo_from_name(name), c)) out.emplace_back(name);
  }
  return out;
}

uint64_t OpHeader::packed() const {
  return byte_of(kind) | byte_of(dtype + 1) << 8 | byte_of(op + 1) << 16 | byte_of(algo) << 24 |
         (static_cast<uint64_t>(static_cast<uint32_t>(root + 1)) & 0xffffff) << 32 |
         byte_of(wire) << 56;
}

OpHeader OpHeader::unpack(uint64_t seq, uint64_t count, uint64_t p) {
  OpHeader h;
  h.seq = seq;
  h.count = count;
  h.kind = static_cast<int32_t>(p & 0xff);
  h.dtype = static_cast<int32_t>((p >> 8) & 0xff) - 1;
  h.op = static_cast<int32_t>((p >> 16) & 0xff) - 1;
  h.algo = static_cast<int32_t>((p >> 24) & 0xff);
  h.root = static_cast<int32_t>((p >> 32) & 0xffffff) - 1;
  h.wire = static_cast<int32_t>((p >> 56) & 0xff);
  return h;
}

std::string OpHeader::str() const {
  std::string s = cat(kind_name(kind), " #", seq);
  if (kind == static_cast<int32_t>(CollKind::kBarrier)) return s;
  s += cat(" (count=", count);
  if (dtype >= 0 && dtype < kNumDTypes) s += cat(", dtype=", dtype_name(static_cast<DType>(dtype)));
  if (op >= 0 && op < kNumReduceOps) s += cat(", op=", op_name(static_cast<ReduceOp>(op)));
  const bool composed = is_quantized(wire) && !is_quantized(algo);  // a part's exact step
  if (root >= 0) s += cat(is_quantized(algo) || composed ? ", wire_block=" : ", root=", root);
  if (algo != 0) s += cat(", algo=", algo_name(algo));
  if (composed) s += cat(", in an all_reduce with wire=", wire_name(wire));
  return s + ")";
}

std::string mismatch_message(int me, const OpHeader& mine, int peer, const OpHeader& theirs) {
  std::string s = cat("mismatched collective calls: rank ", me, " called ", mine.str(),
                      " but rank ", peer, " called ", theirs.str(), ":");
  const char* sep = " ";
  auto differs = [&](const char* what, const std::string& a, const std::string& b) {
    s += cat(sep, what, " differs (", a, " on rank ", me, " vs ", b, " on rank ", peer, ")");
    sep = ", ";
  };
  if (mine.seq != theirs.seq) {
    differs("call number", std::to_string(mine.seq), std::to_string(theirs.seq));
  }
  auto dname = [](int32_t d) {
    return d >= 0 && d < kNumDTypes ? dtype_name(static_cast<DType>(d)) : "-";
  };
  auto oname = [](int32_t o) {
    return o >= 0 && o < kNumReduceOps ? op_name(static_cast<ReduceOp>(o)) : "-";
  };
  if (mine.kind != theirs.kind) {
    // Different collectives: their other fields differ anyway.
    differs("collective", kind_name(mine.kind), kind_name(theirs.kind));
  } else {
    if (mine.count != theirs.count) {
      differs("count", std::to_string(mine.count), std::to_string(theirs.count));
    }
    if (mine.dtype != theirs.dtype) differs("dtype", dname(mine.dtype), dname(theirs.dtype));
    if (mine.op != theirs.op) differs("reduce op", oname(mine.op), oname(theirs.op));
    // Either side's wire makes the root a wire block (-1: none).
    const bool wired =
        is_quantized(mine.algo) || is_quantized(theirs.algo) || mine.wire != 0 || theirs.wire != 0;
    if (mine.root != theirs.root) {
      auto block = [&](int32_t r) {
        return wired && r < 0 ? std::string("none") : std::to_string(r);
      };
      differs(wired ? "wire_block" : "root", block(mine.root), block(theirs.root));
    }
    if (mine.wire != theirs.wire) {  // a composed all-reduce's exact step (hierarchy.h)
      auto name = [](int32_t w) { return is_quantized(w) ? wire_name(w) : "exact"; };
      differs("wire_dtype", name(mine.wire), name(theirs.wire));
    }
    if (mine.algo != theirs.algo && is_quantized(mine.algo) && is_quantized(theirs.algo)) {
      differs("wire_dtype", wire_name(mine.algo), wire_name(theirs.algo));
    } else if (mine.algo != theirs.algo) {
      differs("algo", algo_name(mine.algo), algo_name(theirs.algo));
    }
  }
  if (mine.seq != theirs.seq) {
    s += " (a rank skipped or added a collective call, or ranks issue them in different orders)";
  }
  return s;
}

}  // namespace pycomm
