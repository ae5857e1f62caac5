// The raw CUDA reduction kernels as Python functions, on the caller's current
// stream: tests (bitwise equality with reduce_/scale_ on CPU) and
// benchmarks/gpu (kernel bandwidth). Compiled only into the CUDAExtension
// (PYCOMM_WITH_CUDA); in the CPU build it is empty.
#ifdef PYCOMM_WITH_CUDA

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>

#include "../cuda/reduce_kernels.h"
#include "checks.h"

namespace py = pybind11;

namespace pycomm {
namespace {

void check_kernel_args(const at::Tensor& dst, const at::Tensor* src, const char* what) {
  TORCH_CHECK_VALUE(dst.is_cuda() && dst.is_contiguous(), what, ": contiguous CUDA tensors only");
  if (src != nullptr) {
    TORCH_CHECK_VALUE(src->is_cuda() && src->is_contiguous(), what,
                      ": contiguous CUDA tensors only");
    TORCH_CHECK_VALUE(src->device() == dst.device(), what, ": dst and src on different devices");
    TORCH_CHECK_VALUE(dst.numel() == src->numel(), what, ": dst and src differ in numel");
    TORCH_CHECK_TYPE(dst.scalar_type() == src->scalar_type(), what,
                     ": dst and src differ in dtype");
  }
}

cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

}  // namespace

// Called from bind_cuda (cuda_comm.cpp).
void bind_cuda_kernels(py::module_& m) {
  m.def(
      "cuda_reduce_",
      [](at::Tensor dst, const at::Tensor& src, int op) {
        check_kernel_args(dst, &src, "cuda_reduce_");
        TORCH_CHECK_VALUE(op >= 0 && op < kNumReduceOps, "cuda_reduce_: unknown op");
        const DType dt = to_dtype(dst.scalar_type(), "dst");
        c10::cuda::CUDAGuard g(dst.device());
        cuda::launch_reduce(dst.data_ptr(), dst.data_ptr(), src.data_ptr(), dst.numel(), dt,
                            static_cast<ReduceOp>(op), current_stream(dst));
      },
      py::arg("dst"), py::arg("src"), py::arg("op"));
  m.def(
      "cuda_reduce_scale_",
      [](at::Tensor dst, const at::Tensor& src, int op, double factor) {
        check_kernel_args(dst, &src, "cuda_reduce_scale_");
        TORCH_CHECK_VALUE(op >= 0 && op < kNumReduceOps, "cuda_reduce_scale_: unknown op");
        const DType dt = to_dtype(dst.scalar_type(), "dst");
        TORCH_CHECK_VALUE(is_floating(dt), "cuda_reduce_scale_: floating dtype only");
        c10::cuda::CUDAGuard g(dst.device());
        cuda::launch_reduce_scale(dst.data_ptr(), dst.data_ptr(), src.data_ptr(), dst.numel(), dt,
                                  static_cast<ReduceOp>(op), factor, current_stream(dst));
      },
      py::arg("dst"), py::arg("src"), py::arg("op"), py::arg("factor"));
  m.def(
      "cuda_scale_",
      [](at::Tensor dst, double factor) {
        check_kernel_args(dst, nullptr, "cuda_scale_");
        const DType dt = to_dtype(dst.scalar_type(), "dst");
        TORCH_CHECK_VALUE(is_floating(dt), "cuda_scale_: floating dtype only");
        c10::cuda::CUDAGuard g(dst.device());
        cuda::launch_scale(dst.data_ptr(), dst.numel(), dt, factor, current_stream(dst));
      },
      py::arg("dst"), py::arg("factor"));
}

}  // namespace pycomm

#endif  // PYCOMM_WITH_CUDA
