// Direct collectives over Transport::shared_buffers(); see algorithms.h.
#include <algorithm>

#include "algorithms.h"

namespace pycomm {
namespace {

// Pieces of at least this many bytes use the two-shot variant on 3+ ranks.
constexpr size_t kTwoShotMinBytes = 64 * 1024;

// out = ((src(0) op src(1)) op src(2)) ... op src(n-1), scaled by 1/n for AVG
// in the last step (reduce_scale: one pass over memory on the CPU too).
template <class Src>
void reduce_all(Reducer& red, char* out, Src src, int n, size_t m, DType dtype, ReduceOp op) {
  const double factor = 1.0 / n;
  for (int r = 1; r < n; ++r) {
    const char* acc = r == 1 ? src(0) : out;
    if (op == ReduceOp::kAvg && r == n - 1) {
      red.reduce_scale(out, acc, src(r), m, dtype, op, factor);
    } else {
      red.reduce(out, acc, src(r), m, dtype, op);
    }
  }
}

}  // namespace

void direct_all_reduce(const Context& ctx, void* data, size_t count, DType dtype, ReduceOp op) {
  Transport& tr = ctx.transport;
  const int n = tr.world_size();
  const int me = tr.rank();
  if (n == 1 || count == 0) return;
  SharedBuffers* sb = tr.shared_buffers();
  if (sb == nullptr) {
    throw UsageError("algo 'direct' needs a shared-memory transport (transport='shm'), not " +
                     tr.name());
  }
  Reducer& red = ctx.reducer;
  const size_t es = dtype_size(dtype);
  const size_t per = std::max<size_t>(1, sb->capacity() / es);  // elements per piece
  char* base = static_cast<char*>(data);
  for (size_t begin = 0; begin < count; begin += per) {
    const size_t m = std::min(per, count - begin);
    char* dst = base + begin * es;
    const int which = sb->next_buffer();
    red.copy(sb->local(which), dst, m * es);
    sb->arrive_and_wait(sb->next_epoch(), which);
    auto in = [&](int r) { return static_cast<const char*>(sb->remote(r, which)); };
    // The first reduction reads this rank's own input from `dst` (identical
    // to its shared copy, and hot in L2) rather than from the shared buffer,
    // whose lines peers are reading at the same time: 64 MiB on 2 ranks,
    // 9.5 -> 7.1 ms. Later terms must come from the buffers, because `dst`
    // then holds the partial result.
    auto first = [&](int r, const char* own) { return r == me ? own : in(r); };
    if (n == 2 || m * es < kTwoShotMinBytes) {
      // One-shot: every rank reduces the whole piece from all n buffers, in
      // the same order: ((b0 op b1) op b2) ... op b(n-1).
      reduce_all(red, dst, [&](int r) { return r < 2 ? first(r, dst) : in(r); }, n, m, dtype, op);
      continue;
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
          red, out, [&](int r) { return (r < 2 ? first(r, dst) : in(r)) + off; }, n, len, dtype,
          op);
      red.copy(static_cast<char*>(sb->local(which)) + off, out, len * es);
    }
    sb->arrive_and_wait(sb->next_epoch(), which);
    for (int r = 0; r < n; ++r) {
      if (r == me || ch.length(r) == 0) continue;
      const size_t o = ch.offset(r) * es;
      red.copy(dst + o, in(r) + o, ch.length(r) * es);
    }
  }
}

}  // namespace pycomm
