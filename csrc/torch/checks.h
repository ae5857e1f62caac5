// Argument checks of the binding. They throw UsageError (-> ValueError) /
// UsageTypeError (-> TypeError): plain C++ exceptions, safe without the GIL,
// translated in bindings.cpp.
#pragma once

#include <ATen/ATen.h>

#include <exception>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "../core/quant.h"
#include "../core/types.h"
#include "work.h"

namespace pycomm {

// at::ScalarType -> DType; throws UsageTypeError (-> TypeError) for the rest.
// `op`, when given, prefixes the error ("all_reduce: tensor has unsupported dtype ...").
DType to_dtype(at::ScalarType t, const char* arg, const char* op = nullptr);

std::string join_msg(std::initializer_list<std::string> parts);
void check_tensor(const at::Tensor& t, const char* arg, const char* op, const c10::Device& device);
void check_peer(int peer, const char* arg, const char* op, int rank, int size, bool allow_self);
ReduceOp to_op(int op, DType dtype, const char* opname);
// all_reduce's wire_dtype code (pycomm/_types.py): -1 (none), a DType code
// (float16 / bfloat16: the ring's cast; int8: quantized), or one of the
// float8 codes below (no tensor dtype of pycomm's, so past the DTypes).
constexpr int kWireFp8E4M3 = kNumDTypes;      // 8
constexpr int kWireFp8E5M2 = kNumDTypes + 1;  // 9
struct Wire {
  std::optional<DType> cast;         // float16 / bfloat16: ring_all_reduce_wire
  std::optional<QuantFormat> quant;  // int8 / float8: quantized_all_reduce
};
// Decodes wire_dtype for a float32 tensor, else UsageError (ValueError)
// naming the problem.
Wire to_wire(int wire_dtype, DType tensor_dtype, const char* opname);
// all_reduce(wire_dtype=int8 / float8_*)'s own checks: SUM or AVG, algo
// "auto", a block in [1, 2^20], and `residual`, when given, a float32
// tensor on tensor's device, of its size, that does not overlap it.
void check_quantized_wire(const at::Tensor& t, QuantFormat f, ReduceOp op, const std::string& algo,
                          int64_t block, const std::optional<at::Tensor>& residual,
                          const char* opname);
// The quantization kernels as functions (_C.quantize, _C.cuda_quantize &
// co.): a format by its torch dtype name ("int8", "float8_e4m3fn",
// "float8_e5m2"), and their tensors: contiguous float32 on `device` (err
// like src; src of dequantize quant_bytes(dst.numel(), block) bytes there).
QuantFormat quant_format(const std::string& name, const char* op);
void check_quantize_args(const at::Tensor& src, int64_t block, const std::optional<at::Tensor>& err,
                         const char* op, const c10::Device& device);
void check_dequantize_args(const at::Tensor& dst, const at::Tensor& src, int64_t block,
                           const char* op, const c10::Device& device);
// "name[i]", the argument name of a list's item.
std::string indexed(const char* name, size_t i);
// A list argument of world_size tensors like `like` (same dtype and numel),
// each also passing `check` (given its argument name) when one is given.
// Comm's rooted ops and the c10d backend's list variants share it.
void check_list(const std::vector<at::Tensor>& list, const char* name, const at::Tensor& like,
                const char* like_name, int world_size, const char* op,
                const std::function<void(const at::Tensor&, const std::string&)>& check = {});
// reduce_scatter / all_gather: equal dtypes and big = world_size x small elements.
void check_scatter_sizes(const at::Tensor& big, const char* big_arg, const at::Tensor& small,
                         const char* small_arg, int world_size, const char* op);

}  // namespace pycomm
