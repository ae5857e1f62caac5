// Checked mode (init(check=True) / PYCOMM_CHECK=1): before each collective the
// ranks all-gather a small fixed-size fingerprint of the call (op, collective
// sequence number, element count, dtype, reduce op, root) and compare every
// entry, so that mismatched calls (different sizes, dtypes, ops, roots, or a
// rank that skipped a collective) raise on ALL ranks with every side's
// fingerprint instead of hanging or silently corrupting data, like
// TORCH_DISTRIBUTED_DEBUG=DETAIL.
//
// The exchange is one ring_all_gather of n * sizeof(Fingerprint) bytes over
// the communicator's own Transport (no torch, no extra connection). Every rank
// receives the same n entries and runs the same comparison, so either all
// ranks raise or none does. A mismatch throws UsageError (-> ValueError in
// Python) before any payload byte was sent, so the communicator stays usable.
#pragma once

#include <cstdint>
#include <string>

#include "algorithms.h"

namespace pycomm {

// Plain bytes on the wire: fixed-width fields, no padding (48 bytes).
struct Fingerprint {
  // The op's header (op_header.h) as its three words: sequence number,
  // elements per rank, and kind, dtype, reduce op, root and algo packed.
  uint64_t seq = 0;
  uint64_t count = 0;
  uint64_t packed = 0;
  // Tunables that change the messages or the algorithm auto picks; ranks
  // that differ in them would mismatch silently or hang.
  uint64_t slice_bytes = 0;       // ring slice size
  uint64_t direct_max_bytes = 0;  // PYCOMM_DIRECT_MAX_BYTES (auto: direct up to this)
  uint32_t magic = 0;             // kMagic: marks a checked-mode peer
  uint32_t unused = 0;
  static constexpr uint32_t kMagic = 0x70634b32;  // "pcK2"

  // The op's fields from its header (op_header.h).
  static Fingerprint of(const OpHeader& h, uint64_t slice_bytes, uint64_t direct_max_bytes);

  bool operator==(const Fingerprint& o) const;
  bool operator!=(const Fingerprint& o) const { return !(*this == o); }
  std::string str() const;  // "all_reduce #3 (count=8, dtype=float32, op=sum)"
};
static_assert(sizeof(Fingerprint) == 48, "Fingerprint must have no padding");

// All-gathers `mine` (whose magic it sets) over ctx.transport and throws
// UsageError on every rank, listing the fingerprints of the ranks that differ,
// when they are not all equal. Throws CommError like any transfer on a
// transport failure.
void check_fingerprints(const Context& ctx, Fingerprint mine);

}  // namespace pycomm
