#include "check.h"

namespace pycomm {
namespace cuda {

const char* nccl_result_name(ncclResult_t res) {
  switch (res) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "ncclResult?";
  }
}

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  const std::string msg =
      cat("CUDA error in ", call, " at ", file, ":", line, ": ", cudaGetErrorString(err), " (",
          cudaGetErrorName(err), ", code ", static_cast<int>(err), ")");
  // Clear a sticky-free error so that later unrelated checks do not report it
  // again (sticky errors, e.g. an illegal address, stay and are reported anew).
  (void)cudaGetLastError();
  throw CommError(msg);
}

std::string nccl_error_message(ncclResult_t res, const char* call, const char* file, int line,
                               ncclComm_t comm) {
  std::string msg =
      cat("NCCL error in ", call, " at ", file, ":", line, ": ", ncclGetErrorString(res), " (",
          nccl_result_name(res), ", code ", static_cast<int>(res), ")");
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') msg += cat("; NCCL last error: ", last);
  if (res == ncclSystemError || res == ncclRemoteError) {
    msg += " (a peer may have died or the network failed; NCCL_DEBUG=INFO shows more)";
  }
  return msg;
}

void throw_nccl_error(ncclResult_t res, const char* call, const char* file, int line,
                      ncclComm_t comm) {
  throw CommError(nccl_error_message(res, call, file, line, comm));
}

}  // namespace cuda
}  // namespace pycomm
