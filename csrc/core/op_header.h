// The op header: what a collective call was on one rank (sequence number,
// collective, count, dtype, reduce op, root, algorithm), carried with its data
// so that a receiver can tell mismatched calls apart on default settings:
//
//   shm   in every ring slot's metadata and next to every direct buffer
//         (shm_transport.cc), plus a "current op" line per rank that a
//         blocked rank peeks at (a peer waiting in a different algorithm)
//   gloo  in a small header message ahead of every payload (pg_transport.cpp)
//
// Comm sets it (Transport::begin_op) before each collective runs; user p2p
// messages carry seq 0 and are checked for their size only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pycomm {

enum class CollKind : int32_t {
  kAllReduce = 1,
  kReduceScatter = 2,
  kAllGather = 3,
  kBroadcast = 4,
  kBarrier = 5,
  kCheck = 6,     // checked mode's fingerprint exchange ahead of a collective
  kRegister = 7,  // Communicator.register_tensor (count: the storage's bytes)
  // Rooted collectives and all-to-all (collectives.h). count: reduce, the
  // tensor's elements; gather / scatter, one rank's block; all_to_all, 0 (its
  // per-peer counts may differ by rank; all_to_all verifies them itself).
  kReduce = 8,
  kGather = 9,
  kScatter = 10,
  kAllToAll = 11,
};
constexpr int32_t kNumCollKinds = 11;
const char* coll_name(CollKind k);

// Algorithm of an op, as far as it changes the messages (the ring with a
// 16-bit wire, all_reduce(wire_dtype=...), sends other bytes than the ring).
enum class AlgoKind : int32_t {
  kNone = 0,
  kRing = 1,
  kDirect = 2,
  kRingWireF16 = 3,
  kRingWireBF16 = 4,
  kNative = 5,  // the transport's own collective (algo="nccl")
  // The classic algorithms (algorithms.h, classic.cc).
  kRecursiveDoubling = 6,
  kHalvingDoubling = 7,
  kTree = 8,
  kBruck = 9,
  // all_reduce(wire_dtype=int8 / float8_e4m3fn / float8_e5m2):
  // quantized_all_reduce, one kind per format (kQuantInt8 + QuantFormat, so
  // that ranks that disagree on the format fail); the header's root carries
  // the wire block size.
  kQuantInt8 = 10,
  kQuantFp8E4M3 = 11,
  kQuantFp8E5M2 = 12,
};
// Whether `a` is one of the quantized kinds.
bool is_quantized(int32_t a);

// The algorithms a caller names (algo="..."), in the order messages list
// them; algo_from_name maps one to its kind (kNone for any other string).
constexpr const char* kAlgoNames[] = {
    "ring", "direct", "nccl", "recursive_doubling", "halving_doubling", "tree", "bruck"};
AlgoKind algo_from_name(const std::string& name);
// An AlgoKind's name as messages print it ("-" for kNone).
const char* algo_name(int32_t a);
// The collectives whose algorithm a caller chooses (algo="..."), by the
// names coll_name gives them; the auto table's keys.
constexpr CollKind kChoosable[] = {CollKind::kAllReduce, CollKind::kReduceScatter,
                                   CollKind::kAllGather, CollKind::kBroadcast};
// Whether the core has algorithm `a` for collective `c` (the ring: every
// collective Comm lets the caller choose for; direct: all_reduce and
// reduce_scatter; the log-step and tree algorithms: all_reduce; bruck:
// all_gather).
bool implements(AlgoKind a, CollKind c);
// The names of the algorithms the core has for `c`, in kAlgoNames' order.
std::vector<std::string> algorithms_of(CollKind c);

struct OpHeader {
  uint64_t seq = 0;    // collective number on this rank (1, 2, ...); 0 = user p2p
  uint64_t count = 0;  // elements per rank (input of reduce_scatter / all_gather)
  int32_t kind = 0;    // CollKind
  int32_t dtype = -1;  // DType, -1 when irrelevant (barrier)
  int32_t op = -1;     // ReduceOp, -1 when the collective has none
  int32_t root = -1;   // broadcast root, -1 otherwise (the wire block where a wire is set)
  int32_t algo = 0;    // AlgoKind
  // The quantized wire (an AlgoKind kQuant*) of the composed all-reduce this
  // op is a part of (hierarchy.h), 0 otherwise: the exact steps inside a host
  // carry it, so that ranks of one host that disagree on it fail there.
  int32_t wire = 0;

  // A collective's header (seq is set when it runs). dtype, op and root are
  // -1 where the collective has none.
  static OpHeader of(CollKind kind, uint64_t count, int32_t dtype = -1, int32_t op = -1,
                     int32_t root = -1, AlgoKind algo = AlgoKind::kRing) {
    OpHeader h;
    h.kind = static_cast<int32_t>(kind);
    h.count = count;
    h.dtype = dtype;
    h.op = op;
    h.root = root;
    h.algo = static_cast<int32_t>(algo);
    return h;
  }
  // kind, dtype, op, algo, root (24 bits: a rank or a wire block, at most
  // 2^20) and wire in one word (for shared slots / the wire).
  uint64_t packed() const;
  static OpHeader unpack(uint64_t seq, uint64_t count, uint64_t packed);
  bool operator==(const OpHeader& o) const {
    return seq == o.seq && count == o.count && packed() == o.packed();
  }
  bool operator!=(const OpHeader& o) const { return !(*this == o); }
  // "all_reduce #3 (count=8, dtype=float32, op=sum, algo=direct)"
  std::string str() const;
};

// The message for a receiver whose own call `mine` met data of `theirs` from
// rank `peer`: names both calls and every field that differs, e.g.
// "rank 0 ran all_reduce #3 (count=4, ...) but rank 1 ran all_reduce #3
// (count=5, ...): count differs (4 vs 5)".
std::string mismatch_message(int me, const OpHeader& mine, int peer, const OpHeader& theirs);

}  // namespace pycomm
