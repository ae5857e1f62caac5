// The collective algorithms, written once against Transport + Reducer.
//
// Every function here runs the same sequence of post / wait / reduce calls on
// CPU (executed) and GPU (enqueued); see transport.h for the contract.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <memory>

#include "reduce.h"
#include "transport.h"

namespace pycomm {

// What an algorithm runs on.
struct Context {
  Transport& transport;
  Reducer& reducer;
  // Temporary space for received slices, in the same memory as the data
  // (host or device). At least 2 * slice_bytes; with 2 * slice_bytes + 64
  // (as the bindings allocate) ring_reduce_scatter receives every slice at
  // its destination's address modulo 16 (see RecvSlots in slices.h).
  void* scratch;
  size_t scratch_bytes;
  // Transfer granularity: chunks are cut into slices of this many bytes so
  // that the transfer of slice k+1 overlaps the reduction of slice k. Must be
  // equal on every rank.
  size_t slice_bytes;
};

// Alignment, in bytes, of every chunk and slice start the ring algorithms cut
// (relative to the buffer start) and of their scratch slots: the CUDA
// reduction kernel (csrc/cuda/reduce_kernels.cu) takes its 16-byte pack path
// only when destination and both operands share their offset modulo 16, and
// the scratch slot that receives a slice is 16-byte aligned.
constexpr size_t kChunkAlignBytes = 16;

// Elements per alignment unit: the fewest elements of `elem_size` bytes that
// span a multiple of kChunkAlignBytes (1 for elements of 16 bytes or more, or
// of a size that does not divide 16).
inline size_t align_unit(size_t elem_size) {
  return elem_size != 0 && elem_size < kChunkAlignBytes && kChunkAlignBytes % elem_size == 0
             ? kChunkAlignBytes / elem_size
             : 1;
}

// Split of a buffer into chunks laid out back to back: chunk c has `base`
// elements, plus `unit` for the first `rem` chunks, plus `tail` for chunk
// `last`. Chunks{m, 0} is `n` equal chunks of m elements.
//
// Chunks::aligned(count, n, elem_size) cuts `count` elements into n chunks
// whose starts are multiples of align_unit(elem_size) elements (16 bytes from
// the buffer start): the count / unit whole units are dealt out as evenly as
// possible, the first chunks getting one more, and the count % unit leftover
// elements join the last chunk, which never got an extra unit. So chunk sizes
// differ by at most one unit, and every chunk starts 16-byte aligned.
//
//   count = 10 float32, n = 2 (unit 4 elements):  [0, 4) [4, 10)
//   count = 17 int8,    n = 3 (unit 16):          [0, 16) [16, 16) [16, 17)
struct Chunks {
  size_t base;
  size_t rem;
  size_t unit = 1;
  size_t tail = 0;
  size_t last = 0;
  size_t offset(int c) const {
    const size_t i = static_cast<size_t>(c);
    return i * base + std::min(i, rem) * unit;
  }
  size_t length(int c) const {
    const size_t i = static_cast<size_t>(c);
    return base + (i < rem ? unit : 0) + (i == last ? tail : 0);
  }
  // The longest chunk's length.
  size_t max_length() const { return base + std::max(rem ? unit : 0, tail); }
  static Chunks aligned(size_t count, int n, size_t elem_size) {
    const size_t u = align_unit(elem_size), units = count / u, parts = static_cast<size_t>(n);
    return Chunks{units / parts * u, units % parts, u, count % u, parts - 1};
  }
};

// Elements per ring slice of about `slice_bytes` bytes: a multiple of
// align_unit(elem_size) (so slice starts and scratch slots stay 16-byte
// aligned) when slice_bytes holds at least one unit, and never 0.
inline size_t slice_elems(size_t slice_bytes, size_t elem_size) {
  const size_t per = slice_bytes / elem_size, u = align_unit(elem_size);
  return per >= u ? per - per % u : std::max<size_t>(1, per);
}

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

// ---- The classic algorithms (classic.cc) -----------------------------------
//
// The log-step algorithms of MPI libraries (Thakur, Rabenseifner & Gropp,
// 2005) and a pipelined tree, for the study to compare with the ring. In
// place, any dtype and op, every rank bitwise identical: where two ranks
// combine the same two operands they do it as op(lower rank's, higher
// rank's), and every other result is a copy. AVG scales by 1/n on the step
// that finishes a value.
//
// Worlds that are not a power of two fold first (MPICH's way): with p2 the
// largest power of two <= n, ranks 2i and 2i+1 (i < n - p2) pair off, the
// even one adds its vector into the odd one's and waits; the p2 remaining
// ranks run the algorithm; the odd ones hand the result back. Two extra
// steps of the whole vector for the paired ranks.

// Recursive doubling: log2(p2) exchanges of the whole vector, each rank
// swapping with the rank whose (virtual) number differs in bit d and
// combining. Latency-optimal: log2 n * alpha + log2 n * N * beta.
//
//   4 ranks   d=1: 0<->1  2<->3      each holds the sum of its pair
//             d=2: 0<->2  1<->3      each holds the sum of all
void recursive_doubling_all_reduce(const Context& ctx, void* data, size_t count, DType dtype,
                                   ReduceOp op);

// Halving-doubling (Rabenseifner): a reduce-scatter by recursive halving
// (each step swaps half of the range still owned, and keeps reducing the
// other half) then an all-gather by recursive doubling (each step swaps the
// blocks owned, doubling them). log steps and the ring's bytes:
// 2 log2 n * alpha + 2 (n-1)/n * N * beta.
//
//   4 ranks, chunks A B C D      reduce-scatter           all-gather
//     d=2: 0<->2, 1<->3          0,1 keep A B; 2,3 C D    d=1: 0<->1 swap A,B
//     d=1: 0<->1, 2<->3          rank v keeps chunk v     d=2: 0<->2 swap AB,CD
void halving_doubling_all_reduce(const Context& ctx, void* data, size_t count, DType dtype,
                                 ReduceOp op);

// A pipelined binary tree: rank r's children are 2r+1 and 2r+2. In slices
// of ctx.slice_bytes, each rank receives a slice from its children, combines
// them into its own (own op child 1 op child 2) and forwards it to its
// parent while the next slice arrives; rank 0 then broadcasts the result
// down the same tree, slice by slice. 2 log2 n hops of latency, each link
// carries the data twice: about 2 (log2 n + N / slice) slice times.
//
//        0          reduce: 3,4 -> 1; 5,6 -> 2; 1,2 -> 0
//      1   2        broadcast: 0 -> 1,2; 1 -> 3,4; 2 -> 5,6
//     3 4 5 6
void tree_all_reduce(const Context& ctx, void* data, size_t count, DType dtype, ReduceOp op);

// Bruck's all-gather: ceil(log2 n) steps; in the step of distance k each
// rank sends the min(k, n-k) blocks it holds (its own, then those received)
// to rank r-k and receives as many from r+k, so that after it rank r holds
// blocks r .. r+2k-1 (mod n). Written straight into `out` (rank q's block at
// q * m), so no final rotation: log2 n * alpha + (n-1)/n * N * beta.
//
//   4 ranks, rank 0:   k=1: sends [0] to 3, gets [1] from 1     holds 0 1
//                      k=2: sends [0 1] to 2, gets [2 3] from 2  holds 0 1 2 3
void bruck_all_gather(const Context& ctx, const void* in, void* out, size_t m, size_t elem_size);

// All-reduce (SUM or AVG) of float32 `data` (or float16 / bfloat16: widened
// to float32 first, rounded back at the end) over a block-scaled 8-bit wire
// in `format` (int8, float8_e4m3fn or float8_e5m2: quant.h), quantized.cc: every rank quantizes its
// contribution once (data + residual when `residual` is not null; the residual then receives what
// the quantization lost: error feedback), chunk j of it goes to rank j (one all-to-all), the owner
// sums the n contributions in float32 in rank order, quantizes the sum once and sends it to every
// rank (one all-gather), and every rank, the owner too, ends with that quantized sum's values: the
// same bits everywhere. Bytes sent per rank: 2 (n-1)/n quant_bytes(count):
// about a quarter of the float32 ring's. `work`: at least
// quantized_all_reduce_work_bytes(count, block, n, dtype) bytes.
//
//   4 ranks, chunks A B C D:  quantize A B C D | all-to-all: rank j gets
//   every rank's chunk j | sum in float32, quantize | all-gather | dequantize
size_t quantized_all_reduce_work_bytes(size_t count, size_t block, int n, DType dtype);
void quantized_all_reduce(const Context& ctx, void* data, DType dtype, size_t count,
                          float* residual, size_t block, QuantFormat format, ReduceOp op,
                          void* work);

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
//
// `sym`: non-null when `data` is this rank's copy of symmetric region `sym`,
// all of it (data == sym->base(rank), count elements == sym->bytes()). If
// every rank passes the same region, nothing is staged: rank r reduces chunk
// r from every rank's copy and writes the result into every copy (two
// arrivals in all, half the memory traffic on 2 ranks); the same expression,
// so the same bits. If any rank passes no region or another one, every rank
// takes the staged path above.
//
// `registration` (when `sym` is null): this rank asks to register `data`, all
// of an allocation of its owner: to move it into symmetric memory. After the
// first arrival it is called once: registration(sb, true) when every rank
// asked, a collective step
// that allocates a region (SharedBuffers::allocate_symmetric), copies `data`
// into this rank's copy and makes the owner use it from now on (the torch
// binding swaps the storage's memory), then the all-reduce runs from the
// region as above; registration(sb, false) when some rank did not ask
// (nothing moves, the all-reduce stages; the caller learns the decision).
// registration()
// returns nullptr on every rank when the region could not be had; the
// all-reduce then stages.
//
// Neither (`sym` null, no `registration`): staged; or, with
// PYCOMM_SHM_CMA=1 on every rank, a tensor of 1 MiB or more is reduced by
// reading the peers' copies with process_vm_readv where every rank can
// (cross_memory.h, probed on the first one), in the symmetric pattern above
// with the kernel's single copy in place of mappings.
//
// Returns the path the all-reduce took (the same on every rank).
using RegisterFn =
    std::function<std::shared_ptr<SymmetricRegion>(SharedBuffers& sb, bool everyone)>;
enum class DirectPath { kStaged, kSymmetric, kCrossMemory };
DirectPath direct_all_reduce(const Context& ctx, void* data, size_t count, DType dtype, ReduceOp op,
                             const SymmetricRegion* sym = nullptr,
                             const RegisterFn& registration = nullptr);

// Reduce-scatter over SharedBuffers: `in` holds n blocks of `m` elements
// (block r for rank r), `out` gets this rank's block reduced over the ranks
// (rank order, the same expression as direct_all_reduce's one-shot; AVG
// scaled by 1/n). In pieces: each rank stages its n blocks' next piece in a
// shared buffer, all meet, and each reduces its own block's piece straight
// from the buffers (its own input from `in`): per rank one copy of the input
// and one read of it, against the ring's copy of the whole input into a work
// buffer and 2(n-1) steps. Throws UsageError without SharedBuffers.
void direct_reduce_scatter(const Context& ctx, const void* in, void* out, size_t m, DType dtype,
                           ReduceOp op);
// Whether a piece of direct_reduce_scatter holds one element of every rank
// (buffers of `capacity` bytes; the same answer on every rank); if not, it
// runs the ring.
inline bool direct_reduce_scatter_fits(size_t capacity, int n, size_t elem_size) {
  return capacity >= static_cast<size_t>(n) * elem_size;
}

}  // namespace pycomm
