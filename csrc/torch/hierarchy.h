// Collectives across hosts: shared memory inside a host, gloo between.
//
// transport="auto" over ranks on several hosts (pycomm/_hierarchy.py decides
// the layout and builds the parts) gives a rank one communicator, the flat
// gloo Comm over every rank, with a Hierarchy attached (Comm::compose_hosts)
// that holds two more: `intra` (shm, this host's L ranks) and `inter` (gloo,
// the H ranks with this local index). The three run on ONE worker thread, the
// flat one's, from one queue in issue order: a composed op is one task there
// whose parts' ops run nested, each to completion, so every rank issues the
// parts' ops in the same order with no ordering rule of its own.
//
//     host 0: ranks 0 1            host 1: ranks 2 3
//     +----------------+           +----------------+
//     | intra (shm)    |           | intra (shm)    |
//     | {0, 1}         |           | {2, 3}         |
//     +----------------+           +----------------+
//       local 0: inter (gloo) {0, 2}     local 1: inter (gloo) {1, 3}
//       flat (gloo) {0, 1, 2, 3}: every other op, p2p between hosts
//
// all_reduce of B bytes (kAllReduceSteps):
//   1. intra reduce-scatter (in place): local rank l holds shard l (B/L)
//      summed over its host
//   2. inter all-reduce of shard l with the l-th rank of every other host
//   3. intra all-gather of the L shards
// Each rank sends 2(H-1)/H * B/L bytes between hosts instead of the flat
// ring's 2(n-1)/n * B. Up to kSmallBytes: intra all-reduce, then every column
// all-reduces the whole tensor between hosts (the columns hold the same bits,
// so every rank ends with the same result); register=True counts only there.
// A quantized wire quantizes step 2 only (its error feedback on the matching
// slice of `residual`); steps 1 and 3 stay exact in shared memory.
// broadcast, reduce_scatter and all_gather compose likewise (below); send and
// recv take shm inside a host, the flat ring between; every other op, and a
// call the composition does not take (takes_*), runs on the flat ring, so it
// behaves and fails exactly as on transport="gloo".
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pycomm {

class Comm;

// One step of a composed all-reduce: collective `op` on part `comm` ("intra"
// or "inter"), over the whole tensor or, with `shard`, this local rank's 1/L
// of it. The cost model (pycomm/bench/hosts_model.py) counts its ring steps
// from this table (through pycomm._hierarchy.ALL_REDUCE_STEPS).
struct HierStep {
  const char* comm;
  const char* op;
  bool shard;
};
// The steps of an all-reduce of `bytes` bytes: "small" up to kSmallBytes,
// else "large".
const std::vector<HierStep>& all_reduce_steps(size_t bytes);
const std::vector<HierStep>& all_reduce_steps(const std::string& which);
// Largest all-reduce taken as intra all-reduce + inter all-reduce of the whole
// tensor (an estimate: the simulated-hosts timings were too noisy to place the
// crossover).
constexpr size_t kSmallBytes = 256 * 1024;

// Where the ranks run: rank g is local rank local[g] of host host[g]; every
// host has the same number L >= 2 of ranks (pycomm._hierarchy.hierarchy_refusal).
struct HostLayout {
  std::vector<int> host, local;
  int n_hosts() const;
  int n_local() const;
};

class Hierarchy {
 public:
  // The parts of rank `rank`; validates `layout` against their sizes
  // (UsageError).
  Hierarchy(HostLayout layout, int rank, std::shared_ptr<Comm> intra, std::shared_ptr<Comm> inter);

  Comm& intra() const { return *intra_; }
  Comm& inter() const { return *inter_; }
  std::shared_ptr<Comm> intra_ptr() const { return intra_; }
  std::shared_ptr<Comm> inter_ptr() const { return inter_; }
  const HostLayout& layout() const { return layout_; }

  // Whether the composition takes the call (the flat ring runs the others).
  // all_reduce's arguments were checked by Comm::all_reduce already.
  bool takes(const at::Tensor& t, const std::string& algo, int op = -1) const;
  bool takes_all_reduce(const at::Tensor& t, const std::string& algo, int op, bool cast_wire,
                        bool quantized, bool to_register) const;
  bool takes_chunked(const at::Tensor& whole, const at::Tensor& part, const std::string& algo,
                     int op = -1) const;

  // The composed ops. They run on the shared worker (Comm::compose), each
  // part's op to completion; `wire` holds a quantized all-reduce's
  // (wire_dtype, wire_block) and residual.
  struct QuantWire {
    int dtype;
    int32_t kind;  // its AlgoKind (kQuant*), for the op headers of the exact steps
    int64_t block;
    std::optional<at::Tensor> residual;
  };
  void all_reduce(const at::Tensor& t, int op, const std::string& algo, bool to_register,
                  const std::optional<QuantWire>& wire) const;
  void reduce_scatter(const at::Tensor& out, const at::Tensor& in, int op,
                      const std::string& algo) const;
  void all_gather(const at::Tensor& out, const at::Tensor& in, const std::string& algo) const;
  void broadcast(const at::Tensor& t, int src, const std::string& algo) const;

  // Point to point: the part that reaches `peer` and its rank there, or
  // (nullptr, peer) for the flat ring. NotSupported for a receive from any
  // source (it would have to listen on two communicators at once).
  std::pair<Comm*, int> route(int peer, const char* op) const;

  void set_check(bool on) const;
  void set_p2p_over_flat(bool on) { p2p_over_flat_ = on; }
  // Closes both parts (each drains the shared worker first); the first
  // error is rethrown after both are closed.
  void close() const;

 private:
  // Step 2 on `part` (elements `offset` on of the tensor): the ring, or the
  // quantized wire with the matching slice of the residual.
  void between_hosts(const at::Tensor& part, int64_t offset, int op,
                     const std::optional<QuantWire>& wire) const;

  HostLayout layout_;
  int rank_;
  int host_, local_;
  std::shared_ptr<Comm> intra_, inter_;
  // Rank g is row lh_rows_[g] of the blocks ordered by (local, host) that the
  // intra ops see; by_column_ lists the rows' ranks (its inverse).
  at::Tensor lh_rows_, by_column_;
  std::atomic<bool> p2p_over_flat_{false};  // Comm::set_p2p_over_flat
};

// True on the thread running a composed op (set by Comm::compose): its parts'
// ops run in issue order there, not as ops of a Future callback (which may
// not register a tensor: SymmetricMemory::decide).
bool in_composed_op();
class ComposedOpScope {
 public:
  ComposedOpScope();
  ~ComposedOpScope();
  ComposedOpScope(const ComposedOpScope&) = delete;
  ComposedOpScope& operator=(const ComposedOpScope&) = delete;

 private:
  bool outer_;
};

// The quantized wire of the composed all-reduce whose exact steps this
// thread is issuing (Hierarchy::all_reduce sets it), or null. Comm::collective
// writes it into those steps' op headers: two ranks of one host that disagree
// on the wire then fail in the first step inside the host, where step 2 alone
// would not notice (each column between hosts may agree with itself, and the
// columns would end with different sums).
struct ComposedWire {
  int32_t kind;  // AlgoKind kQuant*
  int32_t block;
};
const ComposedWire* composed_wire();
class ComposedWireScope {
 public:
  explicit ComposedWireScope(const ComposedWire* wire);
  ~ComposedWireScope();
  ComposedWireScope(const ComposedWireScope&) = delete;
  ComposedWireScope& operator=(const ComposedWireScope&) = delete;

 private:
  const ComposedWire* outer_;
};

}  // namespace pycomm
