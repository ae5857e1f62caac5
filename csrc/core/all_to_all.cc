// All-to-all with per-peer counts: a pairwise schedule, after a
// verification that every sender and receiver agree on each block's size.
// See collectives.h for the contract.
#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives.h"

namespace pycomm {

void verify_all_to_all_counts(const Context& ctx, const size_t* send_count,
                              const size_t* recv_count) {
  const int n = ctx.transport.world_size();
  const int r = ctx.transport.rank();
  // Entry of rank i for peer j: {send_count to j, recv_count from j}, as
  // uint64. All-gathered in blocks of q peers so that the n * q entries fit
  // the scratch (device memory on a GPU, read back on the host: download).
  const size_t entry = 2 * sizeof(uint64_t);
  const size_t un = static_cast<size_t>(n);
  const size_t q = std::max<size_t>(1, std::min(un, ctx.scratch_bytes / (entry * un)));
  if (ctx.scratch_bytes < entry * un) {
    throw UsageError("all_to_all: scratch of " + std::to_string(ctx.scratch_bytes) +
                     " bytes is too small for " + std::to_string(n) + " split sizes");
  }
  std::vector<uint64_t> sends(un * un), recvs(un * un);  // [i * n + j]: rank i, peer j
  std::vector<uint64_t> mine(2 * q), table(2 * q * un);
  char* dev = static_cast<char*>(ctx.scratch);
  for (size_t b0 = 0; b0 < un; b0 += q) {
    const size_t b = std::min(q, un - b0);
    for (size_t j = 0; j < b; ++j) {
      mine[2 * j] = send_count[b0 + j];
      mine[2 * j + 1] = recv_count[b0 + j];
    }
    const size_t chunk = b * entry;
    ctx.reducer.upload(dev + static_cast<size_t>(r) * chunk, mine.data(), chunk);
    ring_all_gather(ctx, dev, Chunks{chunk, 0}, 1);
    ctx.reducer.download(table.data(), dev, un * chunk);
    for (size_t i = 0; i < un; ++i) {
      for (size_t j = 0; j < b; ++j) {
        sends[i * un + b0 + j] = table[i * 2 * b + 2 * j];
        recvs[i * un + b0 + j] = table[i * 2 * b + 2 * j + 1];
      }
    }
  }
  // Every rank holds the same tables, so every rank throws the same error.
  std::string msg;
  int bad = 0;
  for (size_t i = 0; i < un; ++i) {
    for (size_t j = 0; j < un; ++j) {
      const uint64_t s = sends[i * un + j], e = recvs[j * un + i];
      if (s == e) continue;
      if (bad < 8) {
        msg += cat(bad ? "; " : "", "rank ", i, " sends ", s, " elements to rank ", j,
                   ", which expects ", e);
      }
      ++bad;
    }
  }
  if (bad == 0) return;
  std::string out =
      cat("all_to_all: split sizes differ between senders and receivers (a sender's input split "
          "for a peer must equal that peer's output split for the sender): ",
          msg);
  if (bad > 8) out += cat("; ... (", bad, " mismatched pairs in all)");
  throw CommError(out);
}

void all_to_all(const Context& ctx, const void* const* send, const size_t* send_count,
                void* const* recv, const size_t* recv_count, size_t es) {
  Transport& tr = ctx.transport;
  const int n = tr.world_size();
  const int r = tr.rank();
  verify_all_to_all_counts(ctx, send_count, recv_count);
  if (send_count[r] != recv_count[r]) {  // verified above: unreachable
    throw CommError("all_to_all: rank " + std::to_string(r) + " sends " +
                    std::to_string(send_count[r]) + " elements to itself but expects " +
                    std::to_string(recv_count[r]));
  }
  if (n == 1) {
    ctx.reducer.copy(recv[r], send[r], send_count[r] * es);
    return;
  }
  // Step k = 1..n-1: send to r+k, receive from r-k, one group: rank r+k's
  // step k receives from r, rank r-k's step k sends to r, so every group's
  // partners are in the same step and no order of ranks can deadlock. The
  // blocks of different steps are disjoint, so step k+1 is posted while step
  // k is in flight.
  auto post = [&](int k) {
    const int to = mod(r + k, n), from = mod(r - k, n);
    P2POp ops[2] = {
        {P2POp::kSend, const_cast<void*>(send[to]), send_count[to] * es, to},
        {P2POp::kRecv, recv[from], recv_count[from] * es, from},
    };
    return tr.post(ops, 2);
  };
  std::vector<Handle> h(static_cast<size_t>(n));
  h[1] = post(1);
  // The block to itself, while step 1 is in flight: in slices, between which
  // test() moves step 1 on (a CPU transport progresses only when called; a
  // 32 MiB copy in one piece would stall it). Copying in place (send[r] ==
  // recv[r]) is a no-op.
  bool first_done = false;
  const size_t self = send_count[r] * es, piece = std::max<size_t>(ctx.slice_bytes, 1);
  for (size_t off = 0; off < self; off += piece) {
    ctx.reducer.copy(static_cast<char*>(recv[r]) + off, static_cast<const char*>(send[r]) + off,
                     std::min(piece, self - off));
    if (!first_done) first_done = tr.test(h[1]);
  }
  for (int k = 1; k < n; ++k) {
    if (k + 1 < n) h[static_cast<size_t>(k + 1)] = post(k + 1);
    if (k > 1 || !first_done) tr.wait(h[static_cast<size_t>(k)]);
  }
}

}  // namespace pycomm
