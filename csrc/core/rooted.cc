// Rooted collectives: reduce (chain or ring), gather, scatter. See
// collectives.h for the contracts.
#include <algorithm>
#include <vector>

#include "collectives.h"

namespace pycomm {

void reduce(const Context& ctx, void* data, size_t count, DType dtype, ReduceOp op, int root) {
  // The chain alone: collectives.h (chain_reduce) says why.
  chain_reduce(ctx, data, count, dtype, op, root);
}

void chain_reduce(const Context& ctx, void* data, size_t count, DType dtype, ReduceOp op,
                  int root) {
  Transport& tr = ctx.transport;
  const int n = tr.world_size();
  const int r = tr.rank();
  if (n == 1 || count == 0) return;  // AVG over one rank: x / 1
  const size_t es = dtype_size(dtype);
  const int pos = mod(r - root, n);   // 0 = root; data flows from pos n-1 down to 0
  const bool has_next = pos < n - 1;  // receives partial results from r+1
  const bool has_prev = pos > 0;      // sends partial results to r-1
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  char* base = static_cast<char*>(data);
  const size_t per = slice_elems(ctx.slice_bytes, es);
  const size_t S = ceil_div(count, per);
  // Two receive slots, 16-byte aligned, one slice each.
  const size_t slot = round_up(per * es, kChunkAlignBytes);
  if (ctx.scratch_bytes < 2 * slot) {
    throw UsageError("chain_reduce: scratch of " + std::to_string(ctx.scratch_bytes) +
                     " bytes is smaller than two slices of " + std::to_string(slot));
  }
  char* scratch = static_cast<char*>(ctx.scratch);
  auto elems = [&](size_t j) { return std::min(per, count - j * per); };

  // Item k receives slice k from next into slot k % 2 and sends slice k - lag
  // to prev; finishing item k reduces slice k into `data`. Item k+1 is posted
  // before item k is finished (two in flight), so a rank that reduces sends
  // with a lag of 2: slice k-1, sent by item k+1, was finished by item k-1.
  // The chain's tail reduces nothing and sends each slice at once.
  //
  //   post(0); for k: post(k+1); wait(k); finish(k)
  const size_t lag = has_next ? 2 : 0;
  const size_t K = S + (has_prev ? lag : 0);
  std::vector<Handle> h(K);
  std::vector<bool> posted(K, false);
  auto post = [&](size_t k) {
    P2POp ops[2];
    size_t nops = 0;
    if (has_next && k < S) {
      ops[nops++] = {P2POp::kRecv, scratch + (k % 2) * slot, elems(k) * es, next};
    }
    if (has_prev && k >= lag && k - lag < S) {
      const size_t j = k - lag;
      ops[nops++] = {P2POp::kSend, base + j * per * es, elems(j) * es, prev};
    }
    if (nops) {
      h[k] = tr.post(ops, nops);
      posted[k] = true;
    }
  };
  auto finish = [&](size_t k) {
    if (!has_next || k >= S) return;
    char* dst = base + k * per * es;
    const char* tmp = scratch + (k % 2) * slot;
    if (op == ReduceOp::kAvg && !has_prev) {
      ctx.reducer.reduce_scale(dst, dst, tmp, elems(k), dtype, op, 1.0 / n);
    } else {
      ctx.reducer.reduce(dst, dst, tmp, elems(k), dtype, op);
    }
  };
  if (K == 0) return;
  post(0);
  for (size_t k = 0; k < K; ++k) {
    if (k + 1 < K) post(k + 1);
    if (posted[k]) tr.wait(h[k]);
    finish(k);
  }
}

void gather(const Context& ctx, const void* in, void* const* out, size_t m, size_t es, int root) {
  Transport& tr = ctx.transport;
  const int n = tr.world_size();
  const int r = tr.rank();
  const size_t bytes = m * es;
  if (r != root) {
    P2POp op{P2POp::kSend, const_cast<void*>(in), bytes, root};
    tr.exchange(&op, 1);
    return;
  }
  std::vector<P2POp> ops;
  for (int p = 0; p < n; ++p) {
    if (p != root) ops.push_back({P2POp::kRecv, out[p], bytes, p});
  }
  Handle h = 0;
  if (!ops.empty()) h = tr.post(ops.data(), ops.size());
  ctx.reducer.copy(out[root], in, bytes);  // while the peers' blocks arrive
  if (!ops.empty()) tr.wait(h);
}

void scatter(const Context& ctx, const void* const* in, void* out, size_t m, size_t es, int root) {
  Transport& tr = ctx.transport;
  const int n = tr.world_size();
  const int r = tr.rank();
  const size_t bytes = m * es;
  if (r != root) {
    P2POp op{P2POp::kRecv, out, bytes, root};
    tr.exchange(&op, 1);
    return;
  }
  std::vector<P2POp> ops;
  for (int p = 0; p < n; ++p) {
    if (p != root) ops.push_back({P2POp::kSend, const_cast<void*>(in[p]), bytes, p});
  }
  Handle h = 0;
  if (!ops.empty()) h = tr.post(ops.data(), ops.size());
  ctx.reducer.copy(out, in[root], bytes);
  if (!ops.empty()) tr.wait(h);
}

}  // namespace pycomm
