// Which algorithm an op runs: Comm::pick checks a named algorithm against the
// collective and the transport; "auto" (pick_auto) follows the auto table,
// then the defaults below.

#include "comm.h"

namespace pycomm {
namespace {

// The algorithms `coll` accepts (besides "auto"), quoted, as error messages
// list them.
std::string algos_of(CollKind coll) {
  std::string names;
  for (const std::string& name : algorithms_of(coll)) {
    names += cat(names.empty() ? "'" : ", '", name, "'");
  }
  return names;
}

}  // namespace

// all_reduce's "auto" picks by size: "direct" over shared memory (one or two
// synchronisations per piece instead of 2(n-1) ring steps; algorithms.h) up
// to direct_max_bytes_; on a GPU the auto table (CommOptions::auto_table)
// decides between the ring and NCCL's own collectives.
AlgoKind Comm::pick(const std::string& algo, CollKind coll, size_t bytes, bool wire) const {
  const char* op = coll_name(coll);
  if (algo == "auto") return pick_auto(coll, bytes, wire);
  const AlgoKind kind = algo_from_name(algo);
  if (kind == AlgoKind::kNone) {
    throw UsageError(
        cat(op, ": unknown algo '", algo, "' (expected 'auto', ", algos_of(coll), ")"));
  }
  if (!implements(kind, coll)) {
    throw UsageError(cat(op, ": algo='", algo, "' is not implemented for ", op, " (it has 'auto', ",
                         algos_of(coll), ")"));
  }
  if (wire && kind != AlgoKind::kRing) {
    throw UsageError(cat("all_reduce: wire_dtype needs algo='ring' or 'auto', not '", algo,
                         "' (only the ring sends a wire dtype)"));
  }
  if (kind == AlgoKind::kNative && !exec_->native_collectives()) {
    throw UsageError(cat(op,
                         ": algo='nccl' needs a CUDA communicator (transport='nccl'); this one "
                         "runs on ",
                         device_.str(), " over ", transport_name_));
  }
  if (kind == AlgoKind::kDirect && !exec_->shared_buffers()) {
    throw UsageError(
        cat(op, ": algo='direct' needs transport='shm', this communicator uses ", transport_name_));
  }
  return kind;
}

AlgoKind Comm::pick_auto(CollKind coll, size_t bytes, bool wire) const {
  if (wire) return AlgoKind::kRing;  // only the ring sends a wire dtype
  const bool has_direct = implements(AlgoKind::kDirect, coll);
  auto it = options_.auto_table.find(coll_name(coll));
  if (it != options_.auto_table.end()) {
    for (const auto& [max_bytes, a] : it->second) {
      // A rule this communicator cannot run (direct without shared memory,
      // nccl without native collectives, an algorithm the collective lacks)
      // is skipped.
      const AlgoKind k = algo_from_name(a);
      const bool runnable = implements(k, coll) &&
                            (k != AlgoKind::kNative || exec_->native_collectives()) &&
                            (k != AlgoKind::kDirect || exec_->shared_buffers());
      if (runnable && (max_bytes < 0 || bytes <= static_cast<size_t>(max_bytes))) return k;
    }
  }
  if (has_direct && exec_->shared_buffers() && bytes <= direct_max_bytes_) {
    return AlgoKind::kDirect;
  }
  return exec_->native_collectives() ? AlgoKind::kNative : AlgoKind::kRing;
}

void Comm::set_auto_table(AutoTable table) {
  CommOptions o = options_;
  o.auto_table = std::move(table);
  check_options(o);
  options_ = std::move(o);
}

std::string Comm::auto_algo(const std::string& op, int64_t bytes) const {
  for (CollKind c : kChoosable) {
    if (op == coll_name(c))
      return algo_name(static_cast<int32_t>(pick_auto(c, static_cast<size_t>(bytes), false)));
  }
  throw UsageError(cat("auto_algo: unknown collective '", op, "'"));
}

}  // namespace pycomm
