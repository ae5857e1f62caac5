// One error convention for every CUDA and NCCL call (modelled on NCCL's
// src/include/checks.h): wrap the call in PYCOMM_CUDA_CHECK / PYCOMM_NCCL_CHECK;
// a failure throws pycomm::CommError naming the call, file:line, the numeric
// code, its name and description, and for NCCL also ncclGetLastError().
//
//   PYCOMM_CUDA_CHECK(cudaEventRecord(ev, stream));
//   PYCOMM_NCCL_CHECK(ncclGroupEnd(), comm);     // comm may be nullptr
//   PYCOMM_CUDA_CHECK_LAUNCH();                  // after kernel<<<...>>>
//
// ncclInProgress is not an error: it is what nonblocking communicators return
// while an operation is still being set up, so PYCOMM_NCCL_CHECK returns the
// result and the caller polls (see NcclComm::wait_ready).
//
// No torch headers: plain C++17 + CUDA runtime + NCCL.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

#include "../core/types.h"

namespace pycomm {
namespace cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);
[[noreturn]] void throw_nccl_error(ncclResult_t res, const char* call, const char* file, int line,
                                   ncclComm_t comm);

inline void check_cuda(cudaError_t err, const char* call, const char* file, int line) {
  if (err != cudaSuccess) throw_cuda_error(err, call, file, line);
}

inline ncclResult_t check_nccl(ncclResult_t res, const char* call, const char* file, int line,
                               ncclComm_t comm) {
  if (res != ncclSuccess && res != ncclInProgress) throw_nccl_error(res, call, file, line, comm);
  return res;
}

// The message throw_nccl_error throws (also used for asynchronous errors).
std::string nccl_error_message(ncclResult_t res, const char* call, const char* file, int line,
                               ncclComm_t comm);

// Human-readable name of an ncclResult_t ("ncclSystemError", ...).
const char* nccl_result_name(ncclResult_t res);

}  // namespace cuda
}  // namespace pycomm

#define PYCOMM_CUDA_CHECK(call) ::pycomm::cuda::check_cuda((call), #call, __FILE__, __LINE__)
#define PYCOMM_CUDA_CHECK_LAUNCH() \
  ::pycomm::cuda::check_cuda(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
#define PYCOMM_NCCL_CHECK(call, comm) \
  ::pycomm::cuda::check_nccl((call), #call, __FILE__, __LINE__, (comm))
