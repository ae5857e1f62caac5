// Element types, reduction ops and the error type shared by every layer.
// Plain C++17: no torch, no CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace pycomm {

// The order of both enums is part of the binding's contract (pycomm/comm.py).
enum class DType : int {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kUInt8 = 6,
  kInt8 = 7,
};
constexpr int kNumDTypes = 8;

enum class ReduceOp : int {
  kSum = 0,
  kAvg = 1,  // computed as SUM, then a scale by 1/world_size (floating types only)
  kMax = 2,
  kMin = 3,
  kProduct = 4,
};
constexpr int kNumReduceOps = 5;

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* op_name(ReduceOp op);
bool is_floating(DType t);

// Messages (errors, timeouts' descriptions) are built with cat(), never
// with std::ostringstream: on the GPU machine (torch 2.11, the extension
// built by its own g++ in /opt/gcc) each failure whose message streamed an
// integer into an ostringstream killed the process with SIGSEGV (a peer out
// of range, checked mode's report, the timeout), while messages of strings
// only were raised. cat() needs no iostream or locale: std::to_string.
namespace detail {
inline void cat_one(std::string& s, const std::string& v) { s += v; }
inline void cat_one(std::string& s, const char* v) { s += v; }
inline void cat_one(std::string& s, char v) { s += v; }
template <typename T,
          typename = std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool>>>
inline void cat_one(std::string& s, T v) {
  s += std::to_string(v);
}
}  // namespace detail

// The concatenation of strings, C strings, chars and numbers (as std::to_string
// writes them).
template <typename... Args>
std::string cat(const Args&... args) {
  std::string s;
  (detail::cat_one(s, args), ...);
  return s;
}

// Index arithmetic of the algorithms: `a` modulo `n` in [0, n) for any sign
// of `a` (the rank k steps before or after r is mod(r -/+ k, n)), the
// number of pieces of `b` that hold `a`, and `a` rounded up to a multiple of
// `b` (an alignment, a cache line, a page).
inline int mod(int a, int n) { return ((a % n) + n) % n; }
// constexpr: the CUDA kernels call them too (--expt-relaxed-constexpr).
constexpr size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }
constexpr size_t round_up(size_t a, size_t b) { return ceil_div(a, b) * b; }

// Every failure of a collective (timeout, dead peer, transport error, misuse
// detected in the core) is a CommError. The binding maps it to
// pycomm.CommError, a RuntimeError.
class CommError : public std::runtime_error {
 public:
  explicit CommError(const std::string& what) : std::runtime_error(what) {}
};

// This rank was interrupted (SIGINT) while blocked in an operation; the
// communicator is aborted. The binding maps it to KeyboardInterrupt.
class Interrupted : public CommError {
 public:
  explicit Interrupted(const std::string& what) : CommError(what) {}
};

// A caller's mistake: a bad argument (the binding's checks) or one that only
// the core can see (e.g. fingerprint mismatch across ranks in checked mode).
// Maps to ValueError.
class UsageError : public std::invalid_argument {
 public:
  explicit UsageError(const std::string& what) : std::invalid_argument(what) {}
};

// A caller's mistake about a type (an unsupported dtype, dtypes that differ).
// Maps to TypeError. Not a UsageError: Python's TypeError is no ValueError.
class UsageTypeError : public std::invalid_argument {
 public:
  explicit UsageTypeError(const std::string& what) : std::invalid_argument(what) {}
};

// An operation that this transport cannot do (user p2p tags other than 0 on
// NCCL). Maps to NotImplementedError.
class NotSupported : public std::logic_error {
 public:
  explicit NotSupported(const std::string& what) : std::logic_error(what) {}
};

// These are plain C++ exceptions, safe to throw without the GIL (the binding
// releases it around every call that can block). The binding translates them
// into Python exceptions in one place, with the GIL held (bindings.cpp).

}  // namespace pycomm
