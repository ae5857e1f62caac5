// Argument checks of the binding. They throw UsageError (-> ValueError) /
// UsageTypeError (-> TypeError): plain C++ exceptions, safe without the GIL,
// translated in bindings.cpp.
#pragma once

#include <ATen/ATen.h>

#include <exception>
#include <initializer_list>
#include <optional>
#include <string>

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
// all_reduce's wire_dtype (-1: none): a float16/bfloat16 DType for a float32
// tensor, else UsageError (ValueError) naming the problem.
std::optional<DType> to_wire_dtype(int wire_dtype, DType tensor_dtype, const char* opname);
// reduce_scatter / all_gather: equal dtypes and big = world_size x small elements.
void check_scatter_sizes(const at::Tensor& big, const char* big_arg, const at::Tensor& small,
                         const char* small_arg, int world_size, const char* op);

// A body's UsageError (checked mode), prefixed with "all_reduce #3 on rank 1: ".
UsageError usage_failure(const Work& work, int rank, const std::exception& e);
// "all_reduce #3 on rank 1 (shm transport, world_size 2, cpu) failed: why".
std::string failure_message(const Work& work, int rank, const std::string& transport,
                            int world_size, const std::string& device, const std::string& why);

}  // namespace pycomm
