// The collective algorithms, written once against Transport + Reducer.
//
// Every function here runs the same sequence of post / wait / reduce calls on
// CPU (executed) and GPU (enqueued); see transport.h for the contract.
#pragma once

#include <cstddef>

#include "reduce.h"
#include "transport.h"

namespace pycomm {

// What an algorithm runs on.
struct Context {
  Transport& transport;
  Reducer& reducer;
  // Temporary space for received slices, in the same memory as the data
  // (host or device). At least 2 * slice_bytes.
  void* scratch;
  size_t scratch_bytes;
  // Transfer granularity: chunks are cut into slices of this many bytes so
  // that the transfer of slice k+1 overlaps the reduction of slice k. Must be
  // equal on every rank.
  size_t slice_bytes;
};

// Split of `count` elements into world_size chunks: chunk c has base (+1 for
// the first `rem` chunks) elements, laid out back to back.
struct Chunks {
  size_t base;
  size_t rem;
  size_t offset(int c) const { return c * base + (static_cast<size_t>(c) < rem ? c : rem); }
  size_t length(int c) const { return base + (static_cast<size_t>(c) < rem ? 1 : 0); }
  static Chunks even(size_t count, int n) { return Chunks{count / n, count % n}; }
};

// In-place ring reduce-scatter over `data`, laid out as `chunks`. Afterwards
// chunk r (r = this rank) holds op over all ranks; for AVG it is also scaled
// by 1/world_size. Other chunks hold partial results.
void ring_reduce_scatter(const Context& ctx, void* data, Chunks chunks, DType dtype, ReduceOp op);

// In-place ring all-gather: on entry chunk r of `data` is this rank's; on exit
// every chunk holds its owner's.
void ring_all_gather(const Context& ctx, void* data, Chunks chunks, size_t elem_size);

// Out-of-place forms, as the user calls them. reduce_scatter: `in` holds
// world_size * m elements; `work` (same size, may not alias `in` or `out`)
// receives a copy that the ring reduces in place, and `out` (m elements) this
// rank's reduced chunk. all_gather: `in` holds m elements of elem_size bytes;
// `out` receives world_size * m, rank r's at r * m.
void ring_reduce_scatter_out(const Context& ctx, const void* in, void* work, void* out, size_t m,
                             DType dtype, ReduceOp op);
void ring_all_gather_out(const Context& ctx, const void* in, void* out, size_t m, size_t elem_size);

// In-place ring all-reduce = reduce-scatter then all-gather. Every rank ends
// with bitwise-identical results (each chunk is reduced by its owner only, in
// a fixed order, and then copied).
void ring_all_reduce(const Context& ctx, void* data, size_t count, DType dtype, ReduceOp op);

// Ring all-reduce of float32 `data` whose traffic travels in the 16-bit
// float dtype `wire` (kFloat16 or kBFloat16): half the bytes of the float32
// ring, float32 accumulation.
//
//   reduce-scatter: each step rounds the outgoing partial sum to `wire`, and
//     the receiver adds the widened value to its float32 partial sum, so the
//     error grows with one rounding per step (n-1 per element), not with the
//     number of additions done in 16 bits;
//   all-gather: the owner rounds its final chunk to `wire` in place and sends
//     it; receivers widen it (exact).
//
// Every rank therefore ends with the same bits: wire(op over ranks). AVG
// scales the float32 sum by 1/n before that last rounding. world_size 1 sends
// nothing and leaves `data` unrounded. Needs ctx.scratch_bytes >=
// 4 * (slice_bytes / 4) * 2 (two send and two receive slots of a slice of
// slice_bytes / 4 elements); throws UsageError for another `wire`.
void ring_all_reduce_wire(const Context& ctx, float* data, size_t count, DType wire, ReduceOp op);

// Pipelined chain broadcast of `bytes` bytes from `root`: root -> root+1 ->
// ... in slices, each rank forwarding slice k while receiving slice k+1.
void chain_broadcast(const Context& ctx, void* data, size_t bytes, int root);

// Dissemination barrier: ceil(log2 n) rounds of 1-byte exchanges.
void dissemination_barrier(const Context& ctx);

// ---- Direct (one-shot) algorithms over SharedBuffers (direct.cc) ----------
//
// For transports whose ranks share memory (Transport::shared_buffers() is not
// null). Latency-optimal for small messages: one synchronisation per piece
// instead of 2(n-1) ring steps.

// All-reduce in pieces of at most shared_buffers()->capacity() bytes: each
// rank copies its piece into its shared buffer and all ranks meet
// (arrive_and_wait). One-shot (2 ranks, or small pieces): each rank then
// reduces the n buffers straight into `data` in rank order 0, 1, ..., n-1.
// Two-shot (3+ ranks, large pieces): rank r reduces only chunk r (same order)
// and publishes it, all meet again, and each rank copies the other chunks
// from their owners: 1/n of the reduction work per rank. Either way every
// element is computed by the same expression on every rank, so the results
// are bitwise identical. AVG then scales by 1/n. Throws UsageError if the
// transport has no SharedBuffers.
void direct_all_reduce(const Context& ctx, void* data, size_t count, DType dtype, ReduceOp op);

}  // namespace pycomm
