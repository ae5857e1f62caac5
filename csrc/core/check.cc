#include "check.h"

#include <cstring>
#include <vector>

namespace pycomm {

bool Fingerprint::operator==(const Fingerprint& o) const {
  return std::memcmp(this, &o, sizeof(Fingerprint)) == 0;
}

Fingerprint Fingerprint::of(const OpHeader& h, uint64_t slice_bytes, uint64_t direct_max_bytes) {
  Fingerprint f;
  f.seq = h.seq;
  f.count = h.count;
  f.packed = h.packed();
  f.slice_bytes = slice_bytes;
  f.direct_max_bytes = direct_max_bytes;
  return f;
}

std::string Fingerprint::str() const {
  if (magic != kMagic) return "<not a checked-mode fingerprint: is check enabled on every rank?>";
  return cat(
      OpHeader::unpack(seq, count, packed).str(), " [slice_bytes=", slice_bytes,
      ", PYCOMM_DIRECT_MAX_BYTES=",
      direct_max_bytes == ~uint64_t{0} ? std::string("unset") : std::to_string(direct_max_bytes),
      "]");
}

void check_fingerprints(const Context& ctx, Fingerprint mine) {
  const int n = ctx.transport.world_size();
  const int r = ctx.transport.rank();
  mine.magic = Fingerprint::kMagic;
  if (n == 1) return;
  // Gathered in the communicator's own memory (device memory on a GPU, where
  // the transport cannot send host buffers), then read back on the host.
  const size_t fp = sizeof(Fingerprint);
  if (ctx.scratch_bytes < n * fp) {
    throw UsageError("checked mode: scratch of " + std::to_string(ctx.scratch_bytes) +
                     " bytes is too small for " + std::to_string(n) + " fingerprints");
  }
  char* table = static_cast<char*>(ctx.scratch);
  ctx.reducer.upload(table + r * fp, &mine, fp);
  ring_all_gather(ctx, table, Chunks{fp, 0}, 1);
  std::vector<Fingerprint> all(n);
  ctx.reducer.download(all.data(), table, n * fp);
  bool same = true;
  for (int i = 1; i < n; ++i) same = same && all[i] == all[0];
  if (same) return;
  // Every rank holds the same table, so every rank builds the same report.
  std::string msg =
      "checked mode: ranks called mismatched collectives (nothing was sent; the "
      "communicator is still usable): ";
  int shown = 0;
  for (int i = 0; i < n; ++i) {
    // rank 0, then every rank that differs from rank 0 (at most 16 lines)
    if (i > 0 && all[i] == all[0]) continue;
    if (shown == 16) {
      msg += "; ...";
      break;
    }
    msg += cat(shown ? "; " : "", "rank ", i, ": ", all[i].str());
    ++shown;
  }
  int agree = 0;
  for (int i = 0; i < n; ++i) agree += all[i] == all[0];
  if (n > 2) msg += cat(" (", agree, " of ", n, " ranks match rank 0)");
  (void)r;
  throw UsageError(msg);
}

}  // namespace pycomm
