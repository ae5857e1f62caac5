// Helpers shared by the files of ProcessGroupPycomm (backend.cpp,
// backend_rooted.cpp): futures, staging buffers and argument checks.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace pycomm {
namespace backend_detail {

// torch's one List[Tensor] type: no allocation per future.
inline c10::TypePtr tensor_list_type() { return c10::ListType::ofTensors(); }

// The devices a future of an op on `device` synchronises with: none on CPU;
// on CUDA the op's device, which makes the future CUDA-aware (its value and
// callbacks are ordered after the current stream at completion).
inline std::vector<c10::Device> future_devices(const c10::Device& device) {
  if (device.is_cpu()) return {};
  return {device};
}

inline c10::intrusive_ptr<c10::ivalue::Future> pending_future(const c10::Device& device) {
  return c10::make_intrusive<c10::ivalue::Future>(tensor_list_type(), future_devices(device));
}

// A future completed now (for CUDA: after the work queued so far on the
// current stream, which a synchronous op has ordered after itself).
inline c10::intrusive_ptr<c10::ivalue::Future> completed_future(
    const std::vector<at::Tensor>& outputs, const c10::Device& device) {
  auto f = pending_future(device);
  f->markCompleted(c10::IValue(outputs));
  return f;
}

// A contiguous stand-in for `t` that the communicator can work in: `t`
// itself when it is contiguous, else a contiguous copy (on the caller's
// current stream, before the op).
inline at::Tensor contiguous_buffer(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}

// A staging buffer that a copy on the current stream has just read: on a
// device with a caching allocator (CUDA), its memory must not be reused for a
// new allocation before that stream has passed the copy, though the buffer's
// last reference goes away now (it was allocated on another stream).
inline void keep_until_current_stream_passes(const at::Tensor& t) {
  if (!t.defined() || t.device().is_cpu() || !t.has_storage()) return;
  const c10::impl::VirtualGuardImpl impl(t.device().type());
  impl.recordDataPtrOnStream(t.storage().data_ptr(), impl.getStream(t.device()));
}

// Copies `src` (same number of elements) into the caller's tensor `dst`
// unless they are the same storage view.
inline void copy_back(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.is_same(src)) return;
  at::NoGradGuard no_grad;
  dst.copy_(src.view(dst.sizes()));
  keep_until_current_stream_passes(src);
  keep_until_current_stream_passes(dst);  // the caller may drop it before the copy ran
}

// What an op on `buf` (contiguous_buffer(dst), or a flat staging buffer) must
// do once it completes: copy the result into `dst`; nothing when `buf` is
// `dst` itself (no callback is chained then).
inline std::function<void()> copy_back_when_staged(const at::Tensor& dst, const at::Tensor& buf) {
  if (buf.is_same(dst)) return {};
  return [dst, buf] { copy_back(dst, buf); };
}

inline void check_one(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK_VALUE(tensors.size() == 1, op, ": the pycomm backend takes one tensor per call, got ",
                    tensors.size());
}

// A rooted op's one tensor (broadcast, reduce): c10d's rootTensor must be 0.
inline at::Tensor root_tensor(const std::vector<at::Tensor>& tensors, int64_t root_tensor,
                              const char* op) {
  check_one(tensors, op);
  TORCH_CHECK_VALUE(root_tensor == 0, op, ": rootTensor must be 0, got ", root_tensor);
  return tensors[0];
}

// The one device all tensors of an op are on (the communicator it runs on).
// Every tensor must be defined and on the same device as the first.
class OpDevice {
 public:
  explicit OpDevice(const char* op) : op_(op) {}

  OpDevice& add(const at::Tensor& t, const std::string& arg) {
    TORCH_CHECK_VALUE(t.defined(), op_, ": ", arg, " is an undefined tensor");
    // Checked first: a sparse tensor has no strides (is_contiguous() throws).
    TORCH_CHECK_TYPE(t.layout() == c10::kStrided, op_, ": ", arg, " is a sparse tensor (layout ",
                     t.layout(),
                     "); the pycomm backend supports dense (strided) tensors only: pass "
                     "tensor.to_dense(), or use the gloo backend for sparse all_reduce");
    if (!device_) {
      device_ = t.device();
      first_ = arg;
    } else {
      TORCH_CHECK_VALUE(t.device() == *device_, op_, ": ", arg, " is on ", t.device().str(),
                        " but ", first_, " is on ", device_->str(),
                        "; the tensors of one call must be on one device");
    }
    return *this;
  }
  OpDevice& add_list(const std::vector<at::Tensor>& list, const char* arg) {
    for (size_t r = 0; r < list.size(); ++r)
      add(list[r], std::string(arg) + "[" + std::to_string(r) + "]");
    return *this;
  }
  c10::Device get() const {
    TORCH_CHECK_VALUE(device_.has_value(), op_, ": needs at least one tensor");
    return *device_;
  }

 private:
  const char* op_;
  std::optional<c10::Device> device_;
  std::string first_;
};

// list variants: pycomm::check_list (checks.h; devices: OpDevice).

// One flat contiguous tensor holding the tensors of `list` one after another.
inline at::Tensor flatten(const std::vector<at::Tensor>& list) {
  std::vector<at::Tensor> flat;
  flat.reserve(list.size());
  for (const auto& t : list) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

// Copies consecutive pieces of `flat` back into the tensors of `list`.
inline void unflatten(const std::vector<at::Tensor>& list, const at::Tensor& flat) {
  int64_t off = 0;
  for (const auto& t : list) {
    copy_back(t, flat.narrow(0, off, t.numel()));
    off += t.numel();
  }
}

// The one list of a list-of-lists argument (c10d's API allows several).
inline const std::vector<at::Tensor>& one_list(const std::vector<std::vector<at::Tensor>>& lists,
                                               const char* what, const char* op) {
  TORCH_CHECK_VALUE(lists.size() == 1, op, ": the pycomm backend takes one ", what,
                    " list per call, got ", lists.size());
  return lists[0];
}

}  // namespace backend_detail
}  // namespace pycomm
