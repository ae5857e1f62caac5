// CPU reductions and the Reducer interface the algorithms call.
#pragma once

#include <cstddef>

#include "quant.h"
#include "types.h"

namespace pycomm {

// dst[i] = op(a[i], b[i]) for i < count. dst may alias a or b (not partially).
// AVG combines as SUM; finish it with cpu_scale.
void cpu_reduce(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op);

// dst[i] *= factor (floating dtypes only).
void cpu_scale(void* dst, size_t count, DType dtype, double factor);

// Wire-dtype conversions (ring_all_reduce_wire): float32 data, 16-bit float
// traffic; `wire` is kFloat16 or kBFloat16 (UsageError otherwise). The
// arithmetic is the fp16/bf16 codec of elementwise.h (RNE, exact widening).
// dst[i] = wire(src[i])
void cpu_to_wire(void* dst, const float* src, size_t count, DType wire);
// dst[i] = float(src[i])
void cpu_from_wire(float* dst, const void* src, size_t count, DType wire);
// dst[i] = op(a[i], float(b[i])), in float32 (AVG combines as SUM). dst may alias a.
void cpu_reduce_wire(float* dst, const float* a, const void* b, size_t count, DType wire,
                     ReduceOp op);

// Whether the AVX2 paths run: the CPU has AVX2 and F16C, and
// PYCOMM_CPU_SIMD is not "scalar" (reduce.cc; quant.cc asks too).
bool cpu_uses_avx2();

// The reduction half of an algorithm's execution context. On CPU the calls
// execute at once on the calling thread; on GPU they enqueue kernels on the
// reduction stream (ordered after whatever the transport's wait() made it wait
// for) and return immediately.
class Reducer {
 public:
  virtual ~Reducer() = default;
  // dst = op(a, b), elementwise. dst may alias a or b.
  virtual void reduce(void* dst, const void* a, const void* b, size_t count, DType dtype,
                      ReduceOp op) = 0;
  // dst *= factor
  virtual void scale(void* dst, size_t count, DType dtype, double factor) = 0;
  // dst = op(a, b) * factor: the last reduce-scatter step of AVG. Must equal
  // reduce() then scale() bitwise; a GPU reducer fuses it into one pass.
  virtual void reduce_scale(void* dst, const void* a, const void* b, size_t count, DType dtype,
                            ReduceOp op, double factor) {
    reduce(dst, a, b, count, dtype, op);
    scale(dst, count, dtype, factor);
  }
  // outs[k] = op(a, b) for every k < n_outs, scaled by `factor` when op is
  // AVG (as reduce_scale): the last step of a reduction whose result several
  // buffers receive. Bitwise what reduce() or reduce_scale() into outs[0]
  // then copies give, which is this default (except which NaN a SUM or
  // PRODUCT of two NaNs returns: separately compiled loops may order the
  // operands differently, see tests/test_reduce_simd.py). An output may
  // alias a or b, exactly (not partially).
  virtual void reduce_to_all(void* const* outs, int n_outs, const void* a, const void* b,
                             size_t count, DType dtype, ReduceOp op, double factor);
  // memcpy on the reduction stream / thread
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // Between host memory and the memory the reducer works on (the same, on
  // CPU): upload enqueues like copy; download returns once `host` holds the
  // bytes, i.e. after everything enqueued before it (a GPU reducer waits for
  // its stream, bounded by the communicator's timeout). For small host-side
  // decisions inside an op, such as checked mode's fingerprint comparison.
  virtual void upload(void* dst, const void* host, size_t bytes) { copy(dst, host, bytes); }
  virtual void download(void* host, const void* src, size_t bytes) { copy(host, src, bytes); }

  // The wire-dtype operations of ring_all_reduce_wire, and the widening of a
  // 16-bit tensor around quantized_all_reduce (see cpu_to_wire & co. for the
  // contract; the CUDA reducer has them as kernels). A reducer without them
  // keeps these defaults, which throw.
  virtual void to_wire(void* dst, const float* src, size_t count, DType wire);
  virtual void from_wire(float* dst, const void* src, size_t count, DType wire);
  virtual void reduce_wire(float* dst, const float* a, const void* b, size_t count, DType wire,
                           ReduceOp op);
  // The block-scaled 8-bit wire of quantized_all_reduce, in format `f`
  // (quant.h for the contract; the CUDA reducer has them as kernels). A
  // reducer without them (a test's recorder) keeps these defaults, which throw.
  virtual void quantize(QuantFormat f, void* dst, const float* src, size_t count, size_t block,
                        float* err);
  virtual void dequantize(QuantFormat f, float* dst, const void* src, size_t count, size_t block,
                          bool add);
};

class CpuReducer final : public Reducer {
 public:
  void reduce(void* dst, const void* a, const void* b, size_t count, DType dtype,
              ReduceOp op) override {
    cpu_reduce(dst, a, b, count, dtype, op);
  }
  void scale(void* dst, size_t count, DType dtype, double factor) override {
    cpu_scale(dst, count, dtype, factor);
  }
  // reduce() then scale() block by block, each block scaled while it is
  // still in cache: one pass over memory instead of two, the same functions
  // on the same elements, so bitwise what reduce() then scale() give.
  void reduce_scale(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op,
                    double factor) override;
  // Two outputs (float32/64, int32/64): each vector is stored to both while
  // it is in registers, so the outputs' lines are written as they are read,
  // with no pass over a result buffer. Others: the default.
  void reduce_to_all(void* const* outs, int n_outs, const void* a, const void* b, size_t count,
                     DType dtype, ReduceOp op, double factor) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void to_wire(void* dst, const float* src, size_t count, DType wire) override {
    cpu_to_wire(dst, src, count, wire);
  }
  void from_wire(float* dst, const void* src, size_t count, DType wire) override {
    cpu_from_wire(dst, src, count, wire);
  }
  void reduce_wire(float* dst, const float* a, const void* b, size_t count, DType wire,
                   ReduceOp op) override {
    cpu_reduce_wire(dst, a, b, count, wire, op);
  }
  void quantize(QuantFormat f, void* dst, const float* src, size_t count, size_t block,
                float* err) override {
    cpu_quantize(f, dst, src, count, block, err);
  }
  void dequantize(QuantFormat f, float* dst, const void* src, size_t count, size_t block,
                  bool add) override {
    cpu_dequantize(f, dst, src, count, block, add);
  }
};

}  // namespace pycomm
