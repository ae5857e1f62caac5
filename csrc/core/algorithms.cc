#include "algorithms.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace pycomm {
namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

// The two receive slots of ring_reduce_scatter in ctx.scratch. Item k
// receives into slot k % 2 (item k+1 is posted while item k is in flight; slot
// (k+1) % 2 was last used by item k-1, already finished). When the scratch
// has room for a spare kChunkAlignBytes per slot (the bindings allocate
// 2 * slice_bytes + 64), a slice is received at the same address modulo 16 as
// the destination it is reduced into, so that the CUDA kernel's 16-byte pack
// path (dst, a and b equally aligned) is taken even for chunks that do not
// start 16-byte aligned (reduce_scatter's Chunks{m, 0} with m * elem_size not
// a multiple of 16); otherwise at the slot's start.
struct RecvSlots {
  char* base;
  size_t stride;
  bool match;
  char* at(size_t k, const char* dst) const {
    char* p = base + (k % 2) * stride;
    if (match) {
      p += (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(p)) % kChunkAlignBytes;
    }
    return p;
  }
};

RecvSlots recv_slots(const Context& ctx, size_t slice_bytes) {
  const size_t padded = ceil_div(slice_bytes, kChunkAlignBytes) * kChunkAlignBytes;
  const bool match = ctx.scratch_bytes >= 2 * (padded + kChunkAlignBytes);
  return RecvSlots{static_cast<char*>(ctx.scratch), match ? padded + kChunkAlignBytes : slice_bytes,
                   match};
}

// Elements of slice j of a chunk of `len` elements, cut every `per` elements.
struct Slice {
  size_t begin;
  size_t count;
};
Slice slice_of(size_t len, size_t per, size_t j) {
  const size_t b = std::min(len, j * per);
  return Slice{b, std::min(len, b + per) - b};
}

// Drives K items through a two-deep pipeline:
//
//   post(0)
//   for k in 0..K-1:
//     post(k+1)      (1) next transfer in flight ...
//     wait(k)        (2)
//     finish(k)      (3) ... while this one is reduced / consumed
//
// Step (1) happens before (3) only when item k+1 does not depend on item k
// (`overlap`): the ring algorithms pass overlap = (slices per chunk >= 2),
// since item k+1 then touches data finished by item k+1-slices <= k-1 and a
// scratch slot last used by item k-1.
template <class Post, class Finish>
void pipeline(size_t K, bool overlap, Transport& tr, Post&& post, Finish&& finish) {
  if (K == 0) return;
  std::vector<Handle> h(K);
  h[0] = post(0);
  for (size_t k = 0; k < K; ++k) {
    if (overlap && k + 1 < K) h[k + 1] = post(k + 1);
    tr.wait(h[k]);
    finish(k);
    if (!overlap && k + 1 < K) h[k + 1] = post(k + 1);
  }
}

}  // namespace

void ring_reduce_scatter(const Context& ctx, void* data, Chunks chunks, DType dtype, ReduceOp op) {
  Transport& tr = ctx.transport;
  const int n = tr.world_size();
  const int r = tr.rank();
  const size_t es = dtype_size(dtype);
  char* base = static_cast<char*>(data);
  if (n > 1) {
    const int next = mod(r + 1, n), prev = mod(r - 1, n);
    const size_t per = slice_elems(ctx.slice_bytes, es);  // elements per slice
    const size_t slices = std::max<size_t>(1, ceil_div(chunks.max_length(), per));
    const size_t K = static_cast<size_t>(n - 1) * slices;
    const RecvSlots slots = recv_slots(ctx, per * es);

    // Step s sends chunk r-s-1 (own data, or the partial sum received at step
    // s-1) to next and receives chunk r-s-2 from prev, which it reduces into
    // its copy. After n-1 steps the last chunk received is chunk r.
    auto send_chunk = [&](size_t s) { return mod(r - static_cast<int>(s) - 1, n); };
    auto recv_chunk = [&](size_t s) { return mod(r - static_cast<int>(s) - 2, n); };
    // Where item k's received slice is reduced into, and where it is received.
    auto dst_of = [&](size_t k, const Slice& rs) {
      return base + (chunks.offset(recv_chunk(k / slices)) + rs.begin) * es;
    };

    auto post = [&](size_t k) {
      const size_t s = k / slices, j = k % slices;
      const int sc = send_chunk(s), rc = recv_chunk(s);
      const Slice ss = slice_of(chunks.length(sc), per, j);
      const Slice rs = slice_of(chunks.length(rc), per, j);
      P2POp ops[2] = {
          {P2POp::kSend, base + (chunks.offset(sc) + ss.begin) * es, ss.count * es, next},
          {P2POp::kRecv, slots.at(k, dst_of(k, rs)), rs.count * es, prev},
      };
      return tr.post(ops, 2);
    };
    auto finish = [&](size_t k) {
      const size_t s = k / slices, j = k % slices;
      const int rc = recv_chunk(s);
      const Slice rs = slice_of(chunks.length(rc), per, j);
      if (rs.count == 0) return;
      char* dst = dst_of(k, rs);
      const char* tmp = slots.at(k, dst);
      if (op == ReduceOp::kAvg && s + 2 == static_cast<size_t>(n)) {
        // Last step: rc == r, this slice of our chunk is final; AVG's scale by
        // 1/n is fused into its reduction (one pass instead of two).
        ctx.reducer.reduce_scale(dst, dst, tmp, rs.count, dtype, op, 1.0 / n);
      } else {
        ctx.reducer.reduce(dst, dst, tmp, rs.count, dtype, op);
      }
    };
    pipeline(K, slices >= 2, tr, post, finish);
  }
}

void ring_all_gather(const Context& ctx, void* data, Chunks chunks, size_t es) {
  Transport& tr = ctx.transport;
  const int n = tr.world_size();
  const int r = tr.rank();
  if (n == 1) return;
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  char* base = static_cast<char*>(data);
  const size_t per = slice_elems(ctx.slice_bytes, es);
  const size_t slices = std::max<size_t>(1, ceil_div(chunks.max_length(), per));
  const size_t K = static_cast<size_t>(n - 1) * slices;

  // Step s forwards chunk r-s (own at s = 0, then the one received at s-1)
  // and receives chunk r-s-1 in place.
  auto post = [&](size_t k) {
    const size_t s = k / slices, j = k % slices;
    const int sc = mod(r - static_cast<int>(s), n), rc = mod(r - static_cast<int>(s) - 1, n);
    const Slice ss = slice_of(chunks.length(sc), per, j);
    const Slice rs = slice_of(chunks.length(rc), per, j);
    P2POp ops[2] = {
        {P2POp::kSend, base + (chunks.offset(sc) + ss.begin) * es, ss.count * es, next},
        {P2POp::kRecv, base + (chunks.offset(rc) + rs.begin) * es, rs.count * es, prev},
    };
    return tr.post(ops, 2);
  };
  pipeline(K, slices >= 2, tr, post, [](size_t) {});
}

void ring_reduce_scatter_out(const Context& ctx, const void* in, void* work, void* out, size_t m,
                             DType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype);
  const int n = ctx.transport.world_size();
  ctx.reducer.copy(work, in, n * m * es);
  ring_reduce_scatter(ctx, work, Chunks{m, 0}, dtype, op);
  ctx.reducer.copy(out, static_cast<const char*>(work) + ctx.transport.rank() * m * es, m * es);
}

void ring_all_gather_out(const Context& ctx, const void* in, void* out, size_t m,
                         size_t elem_size) {
  char* mine = static_cast<char*>(out) + ctx.transport.rank() * m * elem_size;
  ctx.reducer.copy(mine, in, m * elem_size);
  ring_all_gather(ctx, out, Chunks{m, 0}, elem_size);
}

void ring_all_reduce(const Context& ctx, void* data, size_t count, DType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype);
  const Chunks chunks = Chunks::aligned(count, ctx.transport.world_size(), es);
  ring_reduce_scatter(ctx, data, chunks, dtype, op);
  ring_all_gather(ctx, data, chunks, es);
}

namespace {

// The four wire-dtype slots of ring_all_reduce_wire in ctx.scratch: item k
// sends from send(k) and receives into recv(k). Two of each: item k+1 is
// posted while item k is in flight, and slot k+1 % 2 was last used by item
// k-1, already waited for.
struct WireSlots {
  char* base;
  size_t slot_bytes;
  void* send(size_t k) const { return base + (k % 2) * slot_bytes; }
  void* recv(size_t k) const { return base + (2 + k % 2) * slot_bytes; }
};

WireSlots wire_slots(const Context& ctx, size_t per, DType wire) {
  const size_t slot = per * dtype_size(wire);
  if (ctx.scratch_bytes < 4 * slot) {
    throw UsageError("ring_all_reduce_wire: scratch of " + std::to_string(ctx.scratch_bytes) +
                     " bytes is smaller than 4 slots of " + std::to_string(slot));
  }
  return WireSlots{static_cast<char*>(ctx.scratch), slot};
}

}  // namespace

void ring_all_reduce_wire(const Context& ctx, float* data, size_t count, DType wire, ReduceOp op) {
  if (wire != DType::kFloat16 && wire != DType::kBFloat16) {
    throw UsageError(std::string("wire dtype must be float16 or bfloat16, got ") +
                     dtype_name(wire));
  }
  Transport& tr = ctx.transport;
  Reducer& red = ctx.reducer;
  const int n = tr.world_size();
  const int r = tr.rank();
  const size_t ws = dtype_size(wire);
  // Elements per slice: floats in slice_bytes, cut to a multiple of the wire
  // dtype's alignment unit (8), so the float32 slices and the wire slots
  // (per * ws bytes each) all start 16-byte aligned.
  const size_t per = slice_elems(ctx.slice_bytes / sizeof(float) * ws, ws);
  const WireSlots slot = wire_slots(ctx, per, wire);
  if (n == 1) {
    // Nothing to send, but the result is still the owner's value rounded to
    // the wire dtype, as with more ranks.
    for (size_t b = 0; b < count; b += per) {
      const size_t c = std::min(per, count - b);
      red.to_wire(slot.send(0), data + b, c, wire);
      red.from_wire(data + b, slot.send(0), c, wire);
    }
    return;
  }
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  const Chunks chunks = Chunks::aligned(count, n, sizeof(float));
  const size_t slices = std::max<size_t>(1, ceil_div(chunks.max_length(), per));
  const size_t K = static_cast<size_t>(n - 1) * slices;
  auto at = [&](int c, const Slice& s) { return data + chunks.offset(c) + s.begin; };

  // Reduce-scatter: the chunk schedule of ring_reduce_scatter. Posting item
  // k rounds the float32 slice it sends into its send slot; finishing it adds
  // the received wire slice into the float32 partial sum.
  auto rs_post = [&](size_t k) {
    const size_t s = k / slices, j = k % slices;
    const int sc = mod(r - static_cast<int>(s) - 1, n), rc = mod(r - static_cast<int>(s) - 2, n);
    const Slice ss = slice_of(chunks.length(sc), per, j);
    const Slice rs = slice_of(chunks.length(rc), per, j);
    red.to_wire(slot.send(k), at(sc, ss), ss.count, wire);
    P2POp ops[2] = {
        {P2POp::kSend, slot.send(k), ss.count * ws, next},
        {P2POp::kRecv, slot.recv(k), rs.count * ws, prev},
    };
    return tr.post(ops, 2);
  };
  auto rs_finish = [&](size_t k) {
    const size_t s = k / slices, j = k % slices;
    const int rc = mod(r - static_cast<int>(s) - 2, n);
    const Slice rs = slice_of(chunks.length(rc), per, j);
    if (rs.count == 0) return;
    float* dst = at(rc, rs);
    red.reduce_wire(dst, dst, slot.recv(k), rs.count, wire, op);
    if (op == ReduceOp::kAvg && s + 2 == static_cast<size_t>(n)) {
      red.scale(dst, rs.count, DType::kFloat32, 1.0 / n);  // rc == r: final
    }
  };
  pipeline(K, slices >= 2, tr, rs_post, rs_finish);

  // All-gather: step 0 rounds this rank's final chunk to the wire dtype in
  // place (so the owner holds exactly what the others receive) and sends it;
  // later steps forward the chunk received at the previous step, whose
  // float32 values are wire values, so rounding them again is exact.
  auto ag_post = [&](size_t k) {
    const size_t s = k / slices, j = k % slices;
    const int sc = mod(r - static_cast<int>(s), n), rc = mod(r - static_cast<int>(s) - 1, n);
    const Slice ss = slice_of(chunks.length(sc), per, j);
    const Slice rs = slice_of(chunks.length(rc), per, j);
    red.to_wire(slot.send(k), at(sc, ss), ss.count, wire);
    if (s == 0) red.from_wire(at(sc, ss), slot.send(k), ss.count, wire);
    P2POp ops[2] = {
        {P2POp::kSend, slot.send(k), ss.count * ws, next},
        {P2POp::kRecv, slot.recv(k), rs.count * ws, prev},
    };
    return tr.post(ops, 2);
  };
  auto ag_finish = [&](size_t k) {
    const size_t s = k / slices, j = k % slices;
    const int rc = mod(r - static_cast<int>(s) - 1, n);
    const Slice rs = slice_of(chunks.length(rc), per, j);
    red.from_wire(at(rc, rs), slot.recv(k), rs.count, wire);
  };
  pipeline(K, slices >= 2, tr, ag_post, ag_finish);
}

void chain_broadcast(const Context& ctx, void* data, size_t bytes, int root) {
  Transport& tr = ctx.transport;
  const int n = tr.world_size();
  const int r = tr.rank();
  if (n == 1 || bytes == 0) return;
  const int pos = mod(r - root, n);  // position along the chain
  const bool has_prev = pos > 0, has_next = pos < n - 1;
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  char* base = static_cast<char*>(data);
  const size_t per = std::max<size_t>(1, ctx.slice_bytes);
  const size_t slices = ceil_div(bytes, per);

  // Item j receives slice j (if there is a previous rank) while forwarding
  // slice j-1, received by item j-1 (if there is a next rank).
  for (size_t j = 0; j <= slices; ++j) {
    P2POp ops[2];
    size_t nops = 0;
    if (has_prev && j < slices) {
      const Slice s = slice_of(bytes, per, j);
      ops[nops++] = {P2POp::kRecv, base + s.begin, s.count, prev};
    }
    if (has_next && j >= 1) {
      const Slice s = slice_of(bytes, per, j - 1);
      ops[nops++] = {P2POp::kSend, base + s.begin, s.count, next};
    }
    if (nops) tr.exchange(ops, nops);
  }
}

void dissemination_barrier(const Context& ctx) {
  Transport& tr = ctx.transport;
  const int n = tr.world_size();
  const int r = tr.rank();
  char* token = static_cast<char*>(ctx.scratch);
  for (int k = 1; k < n; k <<= 1) {
    P2POp ops[2] = {
        {P2POp::kSend, token, 1, mod(r + k, n)},
        {P2POp::kRecv, token + 1, 1, mod(r - k, n)},
    };
    tr.exchange(ops, 2);
  }
}

}  // namespace pycomm
