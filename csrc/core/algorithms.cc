#include "algorithms.h"
#include "slices.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace pycomm {
namespace {

// One pass around the ring over `chunks` cut into slices of `per` elements:
// n-1 steps; step s sends chunk r-s-shift to next and receives chunk
// r-s-shift-1 from prev, slice by slice. Item k is slice k % slices of step
// k / slices. Reduce-scatter passes with shift 1 (its own chunk is received
// last), all-gather with shift 0 (its own chunk is sent first).
class RingPass {
 public:
  struct Item {
    size_t k;      // item number (scratch slots alternate with it)
    size_t step;   // s
    int sc, rc;    // the chunk sent, the chunk received
    Slice ss, rs;  // the slices of them this item moves (elements)
  };

  RingPass(Transport& tr, Chunks chunks, size_t per, int shift)
      : tr_(tr),
        chunks_(chunks),
        per_(per),
        slices_(std::max<size_t>(1, ceil_div(chunks.max_length(), per))),
        n_(tr.world_size()),
        r_(tr.rank()),
        shift_(shift) {}

  Item item(size_t k) const {
    const size_t s = k / slices_, j = k % slices_;
    const int sc = mod(r_ - static_cast<int>(s) - shift_, n_), rc = mod(sc - 1, n_);
    return Item{
        k, s, sc, rc, slice_of(chunks_.length(sc), per_, j), slice_of(chunks_.length(rc), per_, j)};
  }
  // Element offset of a slice of chunk `c` in the data.
  size_t offset(int c, const Slice& sl) const { return chunks_.offset(c) + sl.begin; }
  // The last step of a reduce-scatter pass: rc == r, this slice is final.
  bool last_step(const Item& it) const { return it.step + 2 == static_cast<size_t>(n_); }

  // Posts item `it`: its send slice from `src` to next, its receive slice
  // into `dst` from prev, `es` bytes an element.
  Handle post(const Item& it, const void* src, void* dst, size_t es) const {
    P2POp ops[2] = {
        {P2POp::kSend, const_cast<void*>(src), it.ss.count * es, mod(r_ + 1, n_)},
        {P2POp::kRecv, dst, it.rs.count * es, mod(r_ - 1, n_)},
    };
    return tr_.post(ops, 2);
  }

  // Runs every item through pipeline(): post(item) returns its Handle,
  // finish(item) consumes it once waited for.
  template <class Post, class Finish>
  void run(Post&& post, Finish&& finish) const {
    const size_t K = static_cast<size_t>(n_ - 1) * slices_;
    pipeline(
        K, slices_ >= 2, tr_, [&](size_t k) { return post(item(k)); },
        [&](size_t k) { finish(item(k)); });
  }

 private:
  Transport& tr_;
  Chunks chunks_;
  size_t per_, slices_;
  int n_, r_, shift_;
};

}  // namespace

void ring_reduce_scatter(const Context& ctx, void* data, Chunks chunks, DType dtype, ReduceOp op) {
  const int n = ctx.transport.world_size();
  if (n == 1) return;
  const size_t es = dtype_size(dtype);
  char* base = static_cast<char*>(data);
  const size_t per = slice_elems(ctx.slice_bytes, es);  // elements per slice
  const RecvSlots slots = recv_slots(ctx, per * es);
  // Step s sends chunk r-s-1 (own data, or the partial sum received at step
  // s-1) to next and receives chunk r-s-2 from prev, which it reduces into
  // its copy. After n-1 steps the last chunk received is chunk r.
  const RingPass ring(ctx.transport, chunks, per, /*shift=*/1);
  // Where an item's received slice is reduced into.
  auto dst_of = [&](const RingPass::Item& it) { return base + ring.offset(it.rc, it.rs) * es; };
  auto post = [&](const RingPass::Item& it) {
    return ring.post(it, base + ring.offset(it.sc, it.ss) * es, slots.at(it.k, dst_of(it)), es);
  };
  auto finish = [&](const RingPass::Item& it) {
    if (it.rs.count == 0) return;
    char* dst = dst_of(it);
    const char* tmp = slots.at(it.k, dst);
    if (op == ReduceOp::kAvg && ring.last_step(it)) {
      // Last step: rc == r, this slice of our chunk is final; AVG's scale by
      // 1/n is fused into its reduction (one pass instead of two).
      ctx.reducer.reduce_scale(dst, dst, tmp, it.rs.count, dtype, op, 1.0 / n);
    } else {
      ctx.reducer.reduce(dst, dst, tmp, it.rs.count, dtype, op);
    }
  };
  ring.run(post, finish);
}

void ring_all_gather(const Context& ctx, void* data, Chunks chunks, size_t es) {
  if (ctx.transport.world_size() == 1) return;
  char* base = static_cast<char*>(data);
  // Step s forwards chunk r-s (own at s = 0, then the one received at s-1)
  // and receives chunk r-s-1 in place.
  const RingPass ring(ctx.transport, chunks, slice_elems(ctx.slice_bytes, es), /*shift=*/0);
  auto post = [&](const RingPass::Item& it) {
    return ring.post(it, base + ring.offset(it.sc, it.ss) * es,
                     base + ring.offset(it.rc, it.rs) * es, es);
  };
  ring.run(post, [](const RingPass::Item&) {});
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
  const Chunks chunks = Chunks::aligned(count, n, sizeof(float));
  auto at = [&](int c, const Slice& s) { return data + chunks.offset(c) + s.begin; };

  // Reduce-scatter: ring_reduce_scatter's pass. Posting an item rounds the
  // float32 slice it sends into its send slot; finishing it adds the
  // received wire slice into the float32 partial sum.
  const RingPass rs_ring(tr, chunks, per, /*shift=*/1);
  auto rs_post = [&](const RingPass::Item& it) {
    red.to_wire(slot.send(it.k), at(it.sc, it.ss), it.ss.count, wire);
    return rs_ring.post(it, slot.send(it.k), slot.recv(it.k), ws);
  };
  auto rs_finish = [&](const RingPass::Item& it) {
    if (it.rs.count == 0) return;
    float* dst = at(it.rc, it.rs);
    red.reduce_wire(dst, dst, slot.recv(it.k), it.rs.count, wire, op);
    if (op == ReduceOp::kAvg && rs_ring.last_step(it)) {
      red.scale(dst, it.rs.count, DType::kFloat32, 1.0 / n);  // rc == r: final
    }
  };
  rs_ring.run(rs_post, rs_finish);

  // All-gather: ring_all_gather's pass. Step 0 rounds this rank's final
  // chunk to the wire dtype in place (so the owner holds exactly what the
  // others receive) and sends it; later steps forward the chunk received at
  // the previous step, whose float32 values are wire values, so rounding
  // them again is exact.
  const RingPass ag_ring(tr, chunks, per, /*shift=*/0);
  auto ag_post = [&](const RingPass::Item& it) {
    float* src = at(it.sc, it.ss);
    red.to_wire(slot.send(it.k), src, it.ss.count, wire);
    if (it.step == 0) red.from_wire(src, slot.send(it.k), it.ss.count, wire);
    return ag_ring.post(it, slot.send(it.k), slot.recv(it.k), ws);
  };
  auto ag_finish = [&](const RingPass::Item& it) {
    red.from_wire(at(it.rc, it.rs), slot.recv(it.k), it.rs.count, wire);
  };
  ag_ring.run(ag_post, ag_finish);
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
