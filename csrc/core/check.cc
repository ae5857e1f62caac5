#include "check.h"

#include <cstring>
#include <sstream>
#include <vector>

namespace pycomm {

const char* coll_name(CollKind k) {
  switch (k) {
    case CollKind::kAllReduce: return "all_reduce";
    case CollKind::kReduceScatter: return "reduce_scatter";
    case CollKind::kAllGather: return "all_gather";
    case CollKind::kBroadcast: return "broadcast";
    case CollKind::kBarrier: return "barrier";
  }
  return "?";
}

bool Fingerprint::operator==(const Fingerprint& o) const {
  return std::memcmp(this, &o, sizeof(Fingerprint)) == 0;
}

std::string Fingerprint::str() const {
  std::ostringstream s;
  if (magic != kMagic) {
    s << "<not a checked-mode fingerprint: is check enabled on every rank?>";
    return s.str();
  }
  const bool known = kind >= 1 && kind <= 5;
  s << (known ? coll_name(static_cast<CollKind>(kind)) : "unknown-op") << " #" << seq;
  if (kind == static_cast<int32_t>(CollKind::kBarrier)) return s.str();
  s << " (count=" << count;
  if (dtype >= 0 && dtype < kNumDTypes) s << ", dtype=" << dtype_name(static_cast<DType>(dtype));
  if (op >= 0 && op < kNumReduceOps) s << ", op=" << op_name(static_cast<ReduceOp>(op));
  if (root >= 0) s << ", root=" << root;
  if (wire >= 0 && wire < kNumDTypes) s << ", wire=" << dtype_name(static_cast<DType>(wire));
  s << ")";
  return s.str();
}

void check_fingerprints(const Context& ctx, Fingerprint mine) {
  const int n = ctx.transport.world_size();
  const int r = ctx.transport.rank();
  mine.magic = Fingerprint::kMagic;
  if (n == 1) return;
  std::vector<Fingerprint> all(n);
  all[r] = mine;
  ring_all_gather(ctx, all.data(), Chunks{sizeof(Fingerprint), 0}, 1);
  bool same = true;
  for (int i = 1; i < n; ++i) same = same && all[i] == all[0];
  if (same) return;
  // Every rank holds the same table, so every rank builds the same report.
  std::ostringstream msg;
  msg << "checked mode: ranks called mismatched collectives (nothing was sent; the "
         "communicator is still usable): ";
  int shown = 0;
  for (int i = 0; i < n; ++i) {
    // rank 0, then every rank that differs from rank 0 (at most 16 lines)
    if (i > 0 && all[i] == all[0]) continue;
    if (shown == 16) {
      msg << "; ...";
      break;
    }
    msg << (shown ? "; " : "") << "rank " << i << ": " << all[i].str();
    ++shown;
  }
  int agree = 0;
  for (int i = 0; i < n; ++i) agree += all[i] == all[0];
  if (n > 2) msg << " (" << agree << " of " << n << " ranks match rank 0)";
  (void)r;
  throw UsageError(msg.str());
}

}  // namespace pycomm
