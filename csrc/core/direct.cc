// Direct (one-shot) collectives over Transport::shared_buffers(); see
// algorithms.h.
#include <algorithm>

#include "algorithms.h"

namespace pycomm {

void direct_all_reduce(const Context& ctx, void* data, size_t count, DType dtype, ReduceOp op) {
  Transport& tr = ctx.transport;
  const int n = tr.world_size();
  if (n == 1 || count == 0) return;
  SharedBuffers* sb = tr.shared_buffers();
  if (sb == nullptr) {
    throw UsageError("algo 'direct' needs a shared-memory transport (transport='shm'), not " +
                     tr.name());
  }
  const size_t es = dtype_size(dtype);
  const size_t per = std::max<size_t>(1, sb->capacity() / es);  // elements per piece
  char* base = static_cast<char*>(data);
  for (size_t begin = 0; begin < count; begin += per) {
    const size_t m = std::min(per, count - begin);
    char* dst = base + begin * es;
    const uint64_t e = sb->next_epoch();
    const int which = static_cast<int>(e & 1);
    ctx.reducer.copy(sb->local(which), dst, m * es);
    sb->arrive_and_wait(e);
    // Same order on every rank: ((b0 op b1) op b2) ... op b(n-1).
    ctx.reducer.reduce(dst, sb->remote(0, which), sb->remote(1, which), m, dtype, op);
    for (int r = 2; r < n; ++r) ctx.reducer.reduce(dst, dst, sb->remote(r, which), m, dtype, op);
    if (op == ReduceOp::kAvg) ctx.reducer.scale(dst, m, dtype, 1.0 / n);
  }
}

}  // namespace pycomm
