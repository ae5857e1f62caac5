// Direct collectives over Transport::shared_buffers(); see algorithms.h.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "algorithms.h"
#include "cross_memory.h"

namespace pycomm {
namespace {

// Pieces of at least this many bytes use the two-shot variant on 3+ ranks.
constexpr size_t kTwoShotMinBytes = 64 * 1024;

// First-arrival tag of a rank that asks to register its data (move it into
// symmetric memory, `registration`); a region's tag is its id (| kUnstaged,
// below), which never gets this high.
constexpr uint64_t kRegisterTag = ~uint64_t{0};

// Marks a region's first-arrival tag (region id | kUnstaged): that rank did
// not stage piece 0. When every rank passes the region nobody reads a staged
// copy (symmetric_all_reduce reads the tensors), and at small sizes the copy
// (and the lines of the peer's half it pulls across cores) was most of the
// call. Bit 62 (kAddressTag) is clear in such a tag, set in kRegisterTag.
constexpr uint64_t kUnstaged = uint64_t{1} << 61;
bool is_unstaged(uint64_t tag) { return (tag & (kAddressTag | kUnstaged)) == kUnstaged; }

// With PYCOMM_SHM_CMA=1, plain (not registered) tensors of at least this
// many bytes are reduced by reading the peers' copies
// (cross_memory_all_reduce) where the ranks can; smaller ones stage, which
// costs fewer arrivals and no system calls. The same constant on every rank:
// all must take the same path.
constexpr size_t kCrossMemoryMinBytes = 1 << 20;

// outs[k] = ((src(0) op src(1)) op src(2)) ... op src(n-1) for every
// k < n_outs, scaled by 1/n for AVG in the last step, which writes every
// output at once (reduce_to_all: one pass over memory on the CPU). The
// partial results of the steps before it go to `acc`.
template <class Src>
void reduce_all(Reducer& red, void* const* outs, int n_outs, char* acc, Src src, int n, size_t m,
                DType dtype, ReduceOp op) {
  const char* partial = src(0);
  for (int r = 1; r < n - 1; ++r) {
    red.reduce(acc, partial, src(r), m, dtype, op);
    partial = acc;
  }
  red.reduce_to_all(outs, n_outs, partial, src(n - 1), m, dtype, op, 1.0 / n);
}

// The same into one output, which also holds the partial results.
template <class Src>
void reduce_all(Reducer& red, char* out, Src src, int n, size_t m, DType dtype, ReduceOp op) {
  void* const outs[1] = {out};
  reduce_all(red, outs, 1, out, src, n, m, dtype, op);
}

// The all-reduce over symmetric memory, after the first arrival: rank r
// reduces chunk r of the tensor straight from every rank's copy (same order
// as below), in pieces that stay in L2 (partial results in a buffer of its
// own), the last step writing each result into every rank's copy. Per rank
// that is one read of its chunk on every rank and one write of it to every
// rank, with nothing staged: on 2 ranks half the memory traffic of the
// staged one-shot, and in one pass (reduce_to_all). Nobody reads a chunk's
// inputs but its owner, so the owner may overwrite them as it goes.
void symmetric_all_reduce(SharedBuffers& sb, Reducer& red, const SymmetricRegion& sym, int which,
                          uint64_t tag, int n, int me, size_t count, DType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype);
  // Pieces keep the partial results in cache; 2 ranks have none.
  const size_t per = n == 2 ? count : std::max<size_t>(1, sb.capacity() / es);
  char* acc = static_cast<char*>(sb.local(which));  // nobody reads it now
  const Chunks ch = Chunks::aligned(count, n, es);
  const size_t first = ch.offset(me), len = ch.length(me);
  std::vector<void*> outs(n);
  for (size_t done = 0; done < len; done += per) {
    const size_t m = std::min(per, len - done), off = (first + done) * es;
    for (int r = 0; r < n; ++r) outs[r] = sym.base(r) + off;
    reduce_all(
        red, outs.data(), n, acc, [&](int r) { return static_cast<const char*>(outs[r]); }, n, m,
        dtype, op);
  }
  // The same buffer and tag as the first arrival: a slower peer may not have
  // read this rank's tag yet.
  sb.arrive_and_wait(sb.next_epoch(), which, tag);
}

// Piece 0's first arrival of every all-reduce, which carries the
// negotiation (a region, a registration, reading the peers' copies, or
// neither): stages piece 0 (`bytes` of `data`) in a buffer of its own, unless
// `tag` is a region's unstaged tag, and arrives with `tag` (a region's is
// equal on every rank that allocated it together). All ranks read the same n
// tags, so they all decide alike. If some rank arrived unstaged while not
// every rank passed its region, every rank will stage: the unstaged ones copy
// piece 0 now and all arrive again, at the same buffer with the same tags
// (transport.h allows it), before anyone reads a staged piece.
struct FirstArrival {
  int which;      // piece 0's buffer (staged unless every tag is unstaged)
  bool everyone;  // every rank's tag is `tag`
};
FirstArrival arrive_first(SharedBuffers& sb, Reducer& red, int n, const void* data, size_t bytes,
                          uint64_t tag) {
  const int which = sb.next_buffer();
  const bool staged = !is_unstaged(tag);
  if (staged) red.copy(sb.local(which), data, bytes);
  sb.arrive_and_wait(sb.next_epoch(), which, tag);
  bool all = true, some_unstaged = false;
  for (int r = 0; r < n; ++r) {
    const uint64_t t = sb.tag(r, which);
    all = all && t == tag;
    some_unstaged = some_unstaged || is_unstaged(t);
  }
  if (!all && some_unstaged) {
    if (!staged) red.copy(sb.local(which), data, bytes);
    sb.arrive_and_wait(sb.next_epoch(), which, tag);
  }
  return {which, all};
}

// Reduces one piece (`m` elements at `dst`, staged in buffer `which` by every
// rank, all of which have arrived): one-shot or two-shot (algorithms.h).
// `tag`: the piece's first arrival's, reused by the two-shot's second one.
void reduce_piece(SharedBuffers& sb, Reducer& red, int n, int me, char* dst, size_t m, DType dtype,
                  ReduceOp op, int which, uint64_t tag) {
  const size_t es = dtype_size(dtype);
  auto in = [&](int r) { return static_cast<const char*>(sb.remote(r, which)); };
  // The first reduction reads this rank's own input from `dst` (identical
  // to its shared copy, and hot in L2) rather than from the shared buffer,
  // whose lines peers are reading at the same time. Later terms must come
  // from the buffers, because `dst` then holds the partial result.
  auto first = [&](int r, const char* own) { return r == me ? own : in(r); };
  if (n == 2 || m * es < kTwoShotMinBytes) {
    // One-shot: every rank reduces the whole piece from all n buffers, in
    // the same order: ((b0 op b1) op b2) ... op b(n-1).
    reduce_all(red, dst, [&](int r) { return r < 2 ? first(r, dst) : in(r); }, n, m, dtype, op);
    return;
  }
  // Two-shot: rank r reduces chunk r of the piece (same order as above)
  // into its own output, publishes it in its shared buffer (chunk r of that
  // buffer is read by nobody else, so overwriting it is safe), then every
  // rank copies the other chunks from their owners.
  const Chunks ch = Chunks::aligned(m, n, es);
  const size_t off = ch.offset(me) * es, len = ch.length(me);
  if (len > 0) {
    char* out = dst + off;
    reduce_all(
        red, out, [&](int r) { return (r < 2 ? first(r, dst) : in(r)) + off; }, n, len, dtype, op);
    red.copy(static_cast<char*>(sb.local(which)) + off, out, len * es);
  }
  sb.arrive_and_wait(sb.next_epoch(), which, tag);  // same tag: see transport.h
  for (int r = 0; r < n; ++r) {
    if (r == me || ch.length(r) == 0) continue;
    const size_t o = ch.offset(r) * es;
    red.copy(dst + o, in(r) + o, ch.length(r) * es);
  }
}

// The staged all-reduce: piece by piece, copy into a shared buffer, arrive,
// reduce. `first`: piece 0 is staged and arrived already (by the
// negotiation, with tag `tag`), or nullptr: piece 0 arrives here, with `tag`.
void staged_all_reduce(SharedBuffers& sb, Reducer& red, int n, int me, char* base, size_t count,
                       DType dtype, ReduceOp op, const FirstArrival* first, uint64_t tag) {
  const size_t es = dtype_size(dtype);
  const size_t per = std::max<size_t>(1, sb.capacity() / es);  // elements per piece
  for (size_t begin = 0; begin < count; begin += per) {
    const size_t m = std::min(per, count - begin);
    char* dst = base + begin * es;
    if (begin == 0) {
      // Piece 0 arrives through arrive_first even without a negotiation of
      // its own (a plain all-reduce: tag 0; a start-over): a peer may pass a
      // region and not have staged it.
      const FirstArrival a = first ? *first : arrive_first(sb, red, n, dst, m * es, tag);
      reduce_piece(sb, red, n, me, dst, m, dtype, op, a.which, tag);
      continue;
    }
    const int which = sb.next_buffer();
    red.copy(sb.local(which), dst, m * es);
    sb.arrive_and_wait(sb.next_epoch(), which, 0);
    reduce_piece(sb, red, n, me, dst, m, dtype, op, which, 0);
  }
}

// Whether this rank asks to read its peers' copies in a plain all-reduce of
// `bytes` (PYCOMM_SHM_CMA=1, and not found impossible before).
bool asks_cross_memory(const SharedBuffers& sb, size_t bytes) {
  static const bool wanted = [] {
    const char* env = std::getenv("PYCOMM_SHM_CMA");
    return env != nullptr && std::string(env) == "1";
  }();
  return wanted && bytes >= kCrossMemoryMinBytes &&
         sb.cross_memory() != SharedBuffers::CrossMemory::kOff;
}

// The all-reduce of a tensor in private memory, by reading the peers'
// copies with process_vm_readv (cross_memory.h): symmetric_all_reduce's
// pattern, with the kernel's single copy where that one maps peers' memory.
//   1. Piece 0's first arrival (arrive_first) publishes each rank's address
//      as its tag, and stages piece 0 as the staged path does: if a rank
//      does not ask (another path, another PYCOMM_SHM_CMA), every rank
//      stages from piece 0 (a region's rank after arrive_first's second
//      arrival). The first time every rank asks,
//      they all probe (probe_cross_memory) and, if it fails, start over
//      staged.
//   2. Rank r reduces chunk r of the tensor, piece by piece: it reads the
//      piece of every peer's copy into a private buffer that stays in L2 and
//      reduces them with its own, in rank order (the same expression as
//      every other path), into its own copy. Nobody else reads or writes
//      chunk r of rank r's copy now, nor chunk r of a peer's copy.
//   3. All meet; each rank reads every other chunk, reduced, from its
//      owner's copy into its own.
//   4. All meet again: nobody returns (so its caller may change the tensor)
//      while a peer still reads it.
// Per rank that is one kernel copy of its chunk per peer in step 2 and one of
// the other chunks in step 3, where the staged path copies everything into
// shared buffers and reads every rank's copy there.
DirectPath cross_memory_all_reduce(SharedBuffers& sb, Reducer& red, int n, int me, char* data,
                                   size_t count, DType dtype, ReduceOp op) {
  using CM = SharedBuffers::CrossMemory;
  const size_t es = dtype_size(dtype);
  const size_t per = std::max<size_t>(1, sb.capacity() / es);  // elements per piece
  const uint64_t tag = kAddressTag | reinterpret_cast<uintptr_t>(data);
  const FirstArrival a = arrive_first(sb, red, n, data, std::min(per, count) * es, tag);  // 1.
  std::vector<const char*> base(n);
  std::vector<int> pid(n);
  bool everyone = true;
  for (int r = 0; r < n; ++r) {
    const uint64_t t = sb.tag(r, a.which);  // read before the next arrival
    everyone = everyone && (t & kAddressTag) != 0 && t != kRegisterTag;
    base[r] = reinterpret_cast<const char*>(t & ~kAddressTag);
    pid[r] = sb.pid(r);
  }
  if (!everyone) {
    staged_all_reduce(sb, red, n, me, data, count, dtype, op, &a, tag);
    return DirectPath::kStaged;
  }
  if (sb.cross_memory() == CM::kUnknown) {
    std::string why;
    const bool readable = probe_cross_memory(sb, n, me, &why);
    sb.set_cross_memory(readable ? CM::kOn : CM::kOff, std::move(why));
    if (!readable) {
      staged_all_reduce(sb, red, n, me, data, count, dtype, op, nullptr, 0);
      return DirectPath::kStaged;
    }
  }
  // Slot r holds peer r's piece; slot `me` (unused for that) the partial results.
  thread_local std::vector<char> slots;
  slots.resize(static_cast<size_t>(n) * per * es);
  auto slot = [&](int r) { return slots.data() + r * per * es; };
  const Chunks ch = Chunks::aligned(count, n, es);
  for (size_t done = 0; done < ch.length(me); done += per) {  // 2.
    const size_t m = std::min(per, ch.length(me) - done), off = (ch.offset(me) + done) * es;
    char* mine = data + off;
    for (int r = 0; r < n; ++r) {
      if (r != me) read_peer_or_throw(r, pid[r], base[r] + off, slot(r), m * es);
    }
    void* const outs[1] = {mine};
    reduce_all(
        red, outs, 1, slot(me), [&](int r) -> const char* { return r == me ? mine : slot(r); }, n,
        m, dtype, op);
  }
  const int which = sb.next_buffer();
  sb.arrive_and_wait(sb.next_epoch(), which);  // 3.
  for (int r = 0; r < n; ++r) {
    if (r == me || ch.length(r) == 0) continue;
    const size_t off = ch.offset(r) * es;
    read_peer_or_throw(r, pid[r], base[r] + off, data + off, ch.length(r) * es);
  }
  sb.arrive_and_wait(sb.next_epoch(), which);  // 4.
  return DirectPath::kCrossMemory;
}

// `data` is this rank's copy of `region`: if every rank passes it, reduce
// from symmetric memory; else stage.
DirectPath from_region(SharedBuffers& sb, Reducer& red, int n, int me,
                       const SymmetricRegion& region, void* data, size_t count, DType dtype,
                       ReduceOp op) {
  const size_t es = dtype_size(dtype);
  const size_t first_bytes = std::min(std::max<size_t>(1, sb.capacity() / es), count) * es;
  const uint64_t tag = region.id() | kUnstaged;
  const FirstArrival a = arrive_first(sb, red, n, data, first_bytes, tag);
  if (a.everyone) {
    symmetric_all_reduce(sb, red, region, a.which, tag, n, me, count, dtype, op);
    return DirectPath::kSymmetric;
  }
  staged_all_reduce(sb, red, n, me, static_cast<char*>(data), count, dtype, op, &a, tag);
  return DirectPath::kStaged;
}

}  // namespace

void direct_reduce_scatter(const Context& ctx, const void* in, void* out, size_t m, DType dtype,
                           ReduceOp op) {
  Transport& tr = ctx.transport;
  const int n = tr.world_size();
  const int me = tr.rank();
  SharedBuffers* sb = tr.shared_buffers();
  if (sb == nullptr) {
    throw UsageError(
        "reduce_scatter: algo 'direct' needs a shared-memory transport "
        "(transport='shm'), not " +
        tr.name());
  }
  const size_t es = dtype_size(dtype);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (n == 1) {
    std::memmove(dst, src, m * es);  // the output may overlap the input
    return;
  }
  if (!direct_reduce_scatter_fits(sb->capacity(), n, es)) {
    // Buffers smaller than one element per rank (a tiny
    // PYCOMM_SHM_DIRECT_BYTES; the same on every rank): the ring, which
    // copies the input first.
    std::vector<char> work(n * m * es);
    ring_reduce_scatter_out(ctx, in, work.data(), out, m, dtype, op);
    return;
  }
  // `out` overlapping `in` other than as its block `me` (in place): read a
  // private copy of the input, so writing `out` cannot change what is staged.
  std::vector<char> copy;
  const size_t in_bytes = n * m * es;
  if (dst < src + in_bytes && src < dst + m * es && dst != src + me * m * es) {
    copy.assign(src, src + in_bytes);
    src = copy.data();
  }
  // Piece of p elements at offset b of every output block: each rank stages
  // its n input blocks' pieces side by side (block r at r * p), arrives, and
  // reduces piece `me` of every rank's buffer into its output, in rank order.
  // Its own block it reads from `in`, not staged, unless it is `out` (in
  // place) on a rank >= 2: reduce_all writes `out` in its first step, before
  // it reads that rank's term.
  const char* own = src + me * m * es;
  const bool stage_own = dst == own && me >= 2;
  const size_t p = sb->capacity() / (es * n);  // >= 1: it fits
  for (size_t b = 0; b < m; b += p) {
    const size_t len = std::min(p, m - b);
    const int which = sb->next_buffer();
    char* staged = static_cast<char*>(sb->local(which));
    for (int r = 0; r < n; ++r) {
      if (r != me || stage_own) {
        ctx.reducer.copy(staged + r * p * es, src + (r * m + b) * es, len * es);
      }
    }
    sb->arrive_and_wait(sb->next_epoch(), which, 0);
    auto block = [&](int r) {
      return r == me && !stage_own ? own + b * es
                                   : static_cast<const char*>(sb->remote(r, which)) + me * p * es;
    };
    reduce_all(ctx.reducer, dst + b * es, block, n, len, dtype, op);
  }
}

DirectPath direct_all_reduce(const Context& ctx, void* data, size_t count, DType dtype, ReduceOp op,
                             const SymmetricRegion* sym, const RegisterFn& registration) {
  Transport& tr = ctx.transport;
  const int n = tr.world_size();
  const int me = tr.rank();
  if (n == 1 || count == 0) return DirectPath::kStaged;
  SharedBuffers* sb = tr.shared_buffers();
  if (sb == nullptr) {
    throw UsageError("algo 'direct' needs a shared-memory transport (transport='shm'), not " +
                     tr.name());
  }
  Reducer& red = ctx.reducer;
  char* base = static_cast<char*>(data);
  // The negotiation rides on piece 0's first arrival (arrive_first): a
  // region, a registration, reading the peers' copies, or neither.
  if (sym != nullptr) return from_region(*sb, red, n, me, *sym, data, count, dtype, op);
  const size_t es = dtype_size(dtype);
  if (!registration) {
    if (asks_cross_memory(*sb, count * es)) {
      return cross_memory_all_reduce(*sb, red, n, me, base, count, dtype, op);
    }
    staged_all_reduce(*sb, red, n, me, base, count, dtype, op, nullptr, 0);
    return DirectPath::kStaged;
  }
  const size_t first_bytes = std::min(std::max<size_t>(1, sb->capacity() / es), count) * es;
  const FirstArrival a = arrive_first(*sb, red, n, data, first_bytes, kRegisterTag);
  // `data` still holds the input (only piece 0 was copied out), which
  // registration() moves if every rank asked. A slow peer may still be
  // reading the tags at `which`: registration()'s arrivals may come back to that buffer
  // (with 2 of them), but not before every rank has arrived at the next
  // epoch, i.e. has read them.
  const std::shared_ptr<SymmetricRegion> region = registration(*sb, a.everyone);
  if (region) {
    // Every rank moved: from the region (its first arrival also orders every
    // rank's move before anyone reads its copy).
    return from_region(*sb, red, n, me, *region, region->base(me), count, dtype, op);
  }
  // No room (every rank: start over, staged) or some rank did not ask
  // (go on staging from piece 0).
  staged_all_reduce(*sb, red, n, me, base, count, dtype, op, a.everyone ? nullptr : &a,
                    kRegisterTag);
  return DirectPath::kStaged;
}

}  // namespace pycomm
