// The classic log-step and tree algorithms (algorithms.h), written against
// Transport + Reducer like the ring: recursive doubling, halving-doubling
// (Rabenseifner), a pipelined binary tree, and Bruck's all-gather. Their step
// diagrams are with the declarations; the costs in the README's "Algorithms".
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "algorithms.h"
#include "slices.h"

namespace pycomm {
namespace {

// dst = op(a, b), scaled by `factor` unless it is 1 (AVG's 1/n on the step
// that finishes a result).
void combine(const Context& ctx, void* dst, const void* a, const void* b, size_t count, DType dtype,
             ReduceOp op, double factor) {
  if (factor != 1.0) {
    ctx.reducer.reduce_scale(dst, a, b, count, dtype, op, factor);
  } else {
    ctx.reducer.reduce(dst, a, b, count, dtype, op);
  }
}

// A run of elements: where it starts and how many.
struct Run {
  char* ptr;
  size_t count;
};

// Swaps runs with `peer` and reduces: `send` goes out while the peer's
// matching run arrives, slice by slice through ctx.scratch, and each received
// slice is combined into `dst` as op(lower rank's operand, higher rank's),
// so that two ranks that combine the same operands get the same bits. The
// peer calls it with the counts swapped (either may be 0: a one-way hand-off).
// `factor` != 1 scales the result (AVG's 1/n, fused on the last step).
//
// Slice j of `send` and slice j of `dst` travel as item j of pipeline():
// item j+1 touches neither what item j reduces nor its scratch slot.
void swap_reduce(const Context& ctx, int peer, Run send, Run dst, DType dtype, ReduceOp op,
                 double factor = 1.0) {
  Transport& tr = ctx.transport;
  const size_t es = dtype_size(dtype);
  const size_t per = slice_elems(ctx.slice_bytes, es);
  const RecvSlots slots = recv_slots(ctx, per * es);
  const bool mine_first = tr.rank() < peer;
  const size_t K = ceil_div(std::max(send.count, dst.count), per);
  auto post = [&](size_t k) {
    const Slice s = slice_of(send.count, per, k), d = slice_of(dst.count, per, k);
    P2POp ops[2];
    size_t n = 0;
    if (s.count) ops[n++] = {P2POp::kSend, send.ptr + s.begin * es, s.count * es, peer};
    if (d.count) {
      ops[n++] = {P2POp::kRecv, slots.at(k, dst.ptr + d.begin * es), d.count * es, peer};
    }
    return tr.post(ops, n);
  };
  auto finish = [&](size_t k) {
    const Slice d = slice_of(dst.count, per, k);
    if (d.count == 0) return;
    char* out = dst.ptr + d.begin * es;
    const char* theirs = slots.at(k, out);
    const void* a = mine_first ? static_cast<const void*>(out) : theirs;
    const void* b = mine_first ? static_cast<const void*>(theirs) : out;
    combine(ctx, out, a, b, d.count, dtype, op, factor);
  };
  pipeline(K, /*overlap=*/true, tr, post, finish);
}

// Swaps runs with `peer` without reducing: `send` goes out, the peer's run
// lands in `recv` (either may be empty), in one group.
void swap_copy(Transport& tr, int peer, Run send, Run recv, size_t es) {
  P2POp ops[2];
  size_t n = 0;
  if (send.count) ops[n++] = {P2POp::kSend, send.ptr, send.count * es, peer};
  if (recv.count) ops[n++] = {P2POp::kRecv, recv.ptr, recv.count * es, peer};
  if (n) tr.exchange(ops, n);
}

// MPICH's fold of a world of n ranks onto its largest power of two p2: the
// first 2 * (n - p2) ranks pair off (2i, 2i+1); before the algorithm the even
// one hands its data to the odd one and sits out, after it the odd one hands
// the result back. The p2 ranks that take part are numbered 0 .. p2-1
// ("virtual" ranks) in rank order.
//
//   n = 6, p2 = 4:   ranks  0 1 2 3 4 5
//                    vrank  - 0 - 1 2 3
struct Fold {
  int n, r, p2, extra;
  static Fold of(const Transport& tr) {
    const int n = tr.world_size();
    int p2 = 1;
    while (p2 * 2 <= n) p2 *= 2;
    return Fold{n, tr.rank(), p2, n - p2};
  }
  // This rank's virtual rank, or -1 for a rank that sits out.
  int vrank() const {
    if (r < 2 * extra) return r % 2 ? r / 2 : -1;
    return r - extra;
  }
  // The rank of virtual rank v.
  int real(int v) const { return v < extra ? 2 * v + 1 : v + extra; }
  bool paired() const { return r < 2 * extra; }
  // The partner of a paired rank.
  int partner() const { return r % 2 ? r - 1 : r + 1; }

  // Before: an even paired rank sends `count` elements of `data` to its
  // partner, which reduces them into its own (the even rank's operand first).
  void in(const Context& ctx, char* data, size_t count, DType dtype, ReduceOp op) const {
    if (!paired()) return;
    const Run all{data, count}, none{data, 0};
    if (vrank() < 0) {
      swap_reduce(ctx, partner(), all, none, dtype, op);
    } else {
      swap_reduce(ctx, partner(), none, all, dtype, op);
    }
  }
  // After: the odd paired rank sends the result back.
  void out(const Context& ctx, char* data, size_t count, size_t es) const {
    if (!paired()) return;
    const Run all{data, count}, none{data, 0};
    if (vrank() < 0) {
      swap_copy(ctx.transport, partner(), none, all, es);
    } else {
      swap_copy(ctx.transport, partner(), all, none, es);
    }
  }
};

// AVG's scale, applied by the last combining step of an algorithm.
double last_factor(ReduceOp op, int n) { return op == ReduceOp::kAvg ? 1.0 / n : 1.0; }

}  // namespace

void recursive_doubling_all_reduce(const Context& ctx, void* data, size_t count, DType dtype,
                                   ReduceOp op) {
  const Fold f = Fold::of(ctx.transport);
  if (f.n == 1 || count == 0) return;
  char* base = static_cast<char*>(data);
  const Run all{base, count};
  f.in(ctx, base, count, dtype, op);
  if (const int v = f.vrank(); v >= 0) {
    for (int d = 1; d < f.p2; d *= 2) {
      const double factor = 2 * d == f.p2 ? last_factor(op, f.n) : 1.0;
      swap_reduce(ctx, f.real(v ^ d), all, all, dtype, op, factor);
    }
  }
  f.out(ctx, base, count, dtype_size(dtype));
}

void halving_doubling_all_reduce(const Context& ctx, void* data, size_t count, DType dtype,
                                 ReduceOp op) {
  const Fold f = Fold::of(ctx.transport);
  if (f.n == 1 || count == 0) return;
  char* base = static_cast<char*>(data);
  const size_t es = dtype_size(dtype);
  f.in(ctx, base, count, dtype, op);
  if (const int v = f.vrank(); v >= 0) {
    // p2 chunks; virtual rank v ends the reduce-scatter owning chunk v.
    const Chunks chunks = Chunks::aligned(count, f.p2, es);
    auto run = [&](int lo, int hi) {  // chunks [lo, hi) as a run of elements
      const size_t b = chunks.offset(lo), e = hi == f.p2 ? count : chunks.offset(hi);
      return Run{base + b * es, e - b};
    };
    // Reduce-scatter by recursive halving: keep the half of [lo, hi) on
    // this rank's side of bit d, send the other half to the partner.
    int lo = 0, hi = f.p2;
    for (int d = f.p2 / 2; d >= 1; d /= 2) {
      const int mid = lo + (hi - lo) / 2;
      const bool upper = (v & d) != 0;
      const Run keep = upper ? run(mid, hi) : run(lo, mid),
                give = upper ? run(lo, mid) : run(mid, hi);
      swap_reduce(ctx, f.real(v ^ d), give, keep, dtype, op, d == 1 ? last_factor(op, f.n) : 1.0);
      (upper ? lo : hi) = mid;
    }
    // All-gather by recursive doubling: the blocks of d chunks that v and
    // its partner own are swapped, doubling what each owns.
    for (int d = 1; d < f.p2; d *= 2) {
      const int mine = v & ~(d - 1), theirs = (v ^ d) & ~(d - 1);
      swap_copy(ctx.transport, f.real(v ^ d), run(mine, mine + d), run(theirs, theirs + d), es);
    }
  }
  f.out(ctx, base, count, es);
}

void tree_all_reduce(const Context& ctx, void* data, size_t count, DType dtype, ReduceOp op) {
  Transport& tr = ctx.transport;
  const int n = tr.world_size(), r = tr.rank();
  if (n == 1 || count == 0) return;
  char* base = static_cast<char*>(data);
  const size_t es = dtype_size(dtype);
  const size_t per = slice_elems(ctx.slice_bytes, es);
  const RecvSlots slots = recv_slots(ctx, per * es);
  const size_t K = ceil_div(count, per);
  const int parent = r == 0 ? -1 : (r - 1) / 2;
  int children[2], nc = 0;
  for (int c = 2 * r + 1; c <= 2 * r + 2 && c < n; ++c) children[nc++] = c;
  auto slice = [&](size_t j) {
    const Slice s = slice_of(count, per, j);
    return Run{base + s.begin * es, s.count};
  };
  // Reduce toward rank 0. Item j receives slice j from the children (child c
  // into slot c) while sending slice j-1, reduced by item j-1, to the parent.
  for (size_t j = 0; j <= K; ++j) {
    P2POp ops[3];
    size_t nops = 0;
    if (j < K) {
      for (int c = 0; c < nc; ++c) {
        const Run s = slice(j);
        ops[nops++] = {P2POp::kRecv, slots.at(c, s.ptr), s.count * es, children[c]};
      }
    }
    if (j >= 1 && parent >= 0) {
      const Run s = slice(j - 1);
      ops[nops++] = {P2POp::kSend, s.ptr, s.count * es, parent};
    }
    if (nops) tr.exchange(ops, nops);
    if (j == K) break;
    // own op child 1 op child 2: rank order within the subtree's root and
    // its children; rank 0's result is the one every rank receives.
    const Run s = slice(j);
    for (int c = 0; c < nc; ++c) {
      const double factor = r == 0 && c == nc - 1 ? last_factor(op, n) : 1.0;
      combine(ctx, s.ptr, s.ptr, slots.at(c, s.ptr), s.count, dtype, op, factor);
    }
  }
  // Broadcast from rank 0 down the same tree: item j receives slice j from
  // the parent while forwarding slice j-1 to the children.
  for (size_t j = 0; j <= K; ++j) {
    P2POp ops[3];
    size_t nops = 0;
    if (j < K && parent >= 0) {
      const Run s = slice(j);
      ops[nops++] = {P2POp::kRecv, s.ptr, s.count * es, parent};
    }
    if (j >= 1) {
      const Run s = slice(j - 1);
      for (int c = 0; c < nc; ++c) ops[nops++] = {P2POp::kSend, s.ptr, s.count * es, children[c]};
    }
    if (nops) tr.exchange(ops, nops);
  }
}

void bruck_all_gather(const Context& ctx, const void* in, void* out, size_t m, size_t es) {
  Transport& tr = ctx.transport;
  const int n = tr.world_size(), r = tr.rank();
  char* base = static_cast<char*>(out);
  ctx.reducer.copy(base + static_cast<size_t>(r) * m * es, in, m * es);
  if (n == 1 || m == 0) return;
  // Blocks [first, first + cnt) modulo n as at most two runs in `out`.
  auto runs = [&](int first, int cnt, Run* rs) {
    const int head = std::min(cnt, n - first);
    rs[0] = Run{base + static_cast<size_t>(first) * m * es, static_cast<size_t>(head) * m};
    rs[1] = Run{base, static_cast<size_t>(cnt - head) * m};
  };
  // After the step of distance k this rank holds blocks r .. r + 2k - 1: it
  // sends the ones it has to r - k and receives r + k's.
  for (int k = 1; k < n; k *= 2) {
    const int cnt = std::min(k, n - k);
    Run send[2], recv[2];
    runs(r, cnt, send);
    runs(mod(r + k, n), cnt, recv);
    P2POp ops[4];
    size_t nops = 0;
    for (const Run& s : send) {
      if (s.count) ops[nops++] = {P2POp::kSend, s.ptr, s.count * es, mod(r - k, n)};
    }
    for (const Run& s : recv) {
      if (s.count) ops[nops++] = {P2POp::kRecv, s.ptr, s.count * es, mod(r + k, n)};
    }
    tr.exchange(ops, nops);
  }
}

}  // namespace pycomm
