// The all-reduce of float32 (and of float16 / bfloat16, through a float32
// copy) with an 8-bit block-scaled wire, int8 or float8
// (algorithms.h, quantized_all_reduce): each rank's contribution is quantized once, its
// owner sums the contributions in float32, and the sum is quantized once more
// for the all-gather. No partial sum is ever re-quantized.
#include <algorithm>
#include <cstddef>
#include <vector>

#include "algorithms.h"
#include "quant.h"

namespace pycomm {
namespace {

// Chunk j of the data: whole blocks dealt out evenly (ceil), so that every
// chunk's blocks are blocks of the whole tensor; the last chunks may be
// short or empty. Its quantized copy sits at a 16-byte aligned offset in the
// work buffer (chunks laid out in rank order).
struct QuantChunks {
  size_t count, block, per;
  static QuantChunks of(size_t count, size_t block, int n) {
    return {count, block, ceil_div(ceil_div(count, block), static_cast<size_t>(n)) * block};
  }
  size_t begin(int j) const { return std::min(count, static_cast<size_t>(j) * per); }
  size_t length(int j) const { return std::min(count, begin(j) + per) - begin(j); }
  size_t bytes(int j) const { return quant_bytes(length(j), block); }
  static size_t stride(size_t bytes) { return round_up(bytes, 16); }
  size_t offset(int j) const { return static_cast<size_t>(j) * stride(quant_bytes(per, block)); }
};

// The float32 copy of a 16-bit tensor, after the quantized chunks.
size_t staging_bytes(size_t count, DType dtype) {
  return dtype == DType::kFloat32 ? 0 : round_up(count * sizeof(float), 16);
}

// The algorithm proper, over float32 `data`.
void quantized_all_reduce_f32(const Context& ctx, float* data, size_t count, float* residual,
                              size_t block, QuantFormat format, ReduceOp op, void* work);

}  // namespace

size_t quantized_all_reduce_work_bytes(size_t count, size_t block, int n, DType dtype) {
  const QuantChunks c = QuantChunks::of(count, block, n);
  // n quantized chunks (this rank's contribution, then the gathered result)
  // + n contributions to this rank's chunk (+ a 16-bit tensor's float32 copy).
  return 2 * c.offset(n) + staging_bytes(count, dtype);
}

void quantized_all_reduce(const Context& ctx, void* data, DType dtype, size_t count,
                          float* residual, size_t block, QuantFormat format, ReduceOp op,
                          void* work) {
  if (dtype == DType::kFloat32) {
    quantized_all_reduce_f32(ctx, static_cast<float*>(data), count, residual, block, format, op,
                             work);
    return;
  }
  // float16 / bfloat16: reduced in float32 like float32 tensors (the same
  // wire, the same bits on every rank), widened before and rounded after.
  // Across hosts the composed op widens the whole tensor first instead
  // (Comm::all_reduce_across_hosts), so its steps inside a host sum in float32.
  const size_t n = static_cast<size_t>(ctx.transport.world_size());
  float* wide = reinterpret_cast<float*>(
      static_cast<char*>(work) + quantized_all_reduce_work_bytes(count, block, int(n), dtype) -
      staging_bytes(count, dtype));
  ctx.reducer.from_wire(wide, data, count, dtype);
  quantized_all_reduce_f32(ctx, wide, count, residual, block, format, op, work);
  ctx.reducer.to_wire(data, wide, count, dtype);
}

namespace {

void quantized_all_reduce_f32(const Context& ctx, float* data, size_t count, float* residual,
                              size_t block, QuantFormat format, ReduceOp op, void* work) {
  Transport& tr = ctx.transport;
  Reducer& red = ctx.reducer;
  const int n = tr.world_size(), r = tr.rank();
  const QuantChunks c = QuantChunks::of(count, block, n);
  char* mine = static_cast<char*>(work);  // chunk j of this rank's contribution at offset(j)
  char* theirs = mine + c.offset(n);      // rank q's contribution to chunk r at offset(q)
  // Error feedback: what is quantized is data + residual, and the residual
  // becomes what the quantization lost.
  if (residual) red.reduce(data, data, residual, count, DType::kFloat32, ReduceOp::kSum);
  for (int j = 0; j < n; ++j) {
    red.quantize(format, mine + c.offset(j), data + c.begin(j), c.length(j), block,
                 residual ? residual + c.begin(j) : nullptr);
  }
  // Reduce-scatter, direct: chunk j of every contribution goes to rank j.
  std::vector<P2POp> ops;
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    ops.push_back({P2POp::kSend, mine + c.offset(j), c.bytes(j), j});
    ops.push_back({P2POp::kRecv, theirs + c.offset(j), c.bytes(r), j});
  }
  if (!ops.empty()) tr.exchange(ops.data(), ops.size());
  // The owner sums the n contributions in float32, in rank order (every
  // element by one expression), into its chunk of `data`.
  float* sum = data + c.begin(r);
  for (int q = 0; q < n; ++q) {
    const char* src = q == r ? mine + c.offset(r) : theirs + c.offset(q);
    red.dequantize(format, sum, src, c.length(r), block, /*add=*/q > 0);
  }
  if (op == ReduceOp::kAvg) red.scale(sum, c.length(r), DType::kFloat32, 1.0 / n);
  // The sum, quantized once, is what every rank gets: the owner too.
  red.quantize(format, mine + c.offset(r), sum, c.length(r), block, nullptr);
  red.dequantize(format, sum, mine + c.offset(r), c.length(r), block, /*add=*/false);
  // All-gather of the quantized sums.
  ops.clear();
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    ops.push_back({P2POp::kSend, mine + c.offset(r), c.bytes(r), j});
    ops.push_back({P2POp::kRecv, mine + c.offset(j), c.bytes(j), j});
  }
  if (!ops.empty()) tr.exchange(ops.data(), ops.size());
  for (int j = 0; j < n; ++j) {
    if (j != r)
      red.dequantize(format, data + c.begin(j), mine + c.offset(j), c.length(j), block, false);
  }
}

}  // namespace
}  // namespace pycomm
