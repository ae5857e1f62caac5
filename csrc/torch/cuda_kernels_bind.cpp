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

void bind_quant_kernels(py::module_& m);

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
  bind_quant_kernels(m);
}

namespace {
// _C.quantize / _C.dequantize on CUDA tensors (bitwise the CPU's).
void bind_quant_kernels(py::module_& m) {
  m.def(
      "cuda_quantize",
      [](const at::Tensor& src, int64_t block, std::optional<at::Tensor> err,
         const std::string& format) {
        const QuantFormat f = quant_format(format, "cuda_quantize");
        TORCH_CHECK_VALUE(src.is_cuda(), "cuda_quantize: src must be a CUDA tensor");
        check_quantize_args(src, block, err, "cuda_quantize", src.device());
        const size_t n = src.numel(), b = static_cast<size_t>(block);
        at::Tensor out =
            at::empty({static_cast<int64_t>(quant_bytes(n, b))}, src.options().dtype(at::kByte));
        c10::cuda::CUDAGuard g(src.device());
        cuda::launch_quantize(f, out.data_ptr(), src.data_ptr<float>(), n, b,
                              err ? err->data_ptr<float>() : nullptr, current_stream(src));
        return out;
      },
      py::arg("src"), py::arg("block"), py::arg("err") = py::none(), py::arg("format") = "int8");
  m.def(
      "cuda_dequantize_",
      [](at::Tensor dst, const at::Tensor& src, int64_t block, bool add,
         const std::string& format) {
        const QuantFormat f = quant_format(format, "cuda_dequantize_");
        TORCH_CHECK_VALUE(dst.is_cuda(), "cuda_dequantize_: dst must be a CUDA tensor");
        check_dequantize_args(dst, src, block, "cuda_dequantize_", dst.device());
        c10::cuda::CUDAGuard g(dst.device());
        cuda::launch_dequantize(f, dst.data_ptr<float>(), src.data_ptr(), dst.numel(),
                                static_cast<size_t>(block), add, current_stream(dst));
      },
      py::arg("dst"), py::arg("src"), py::arg("block"), py::arg("add") = false,
      py::arg("format") = "int8");
}
}  // namespace

}  // namespace pycomm

#endif  // PYCOMM_WITH_CUDA
