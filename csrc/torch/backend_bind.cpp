// The c10d backend's Python side: pycomm/backend.py's callables wrapped as
// the C++ types the backend takes (CommFactory, Shrinker),
// and _C.make_backend and its helpers.
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include "backend.h"

namespace py = pybind11;

namespace pycomm {

namespace {

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// A Python callable that C++ keeps: released under the GIL (the backend may
// die on any thread), leaked once the interpreter is gone.
std::shared_ptr<py::object> hold_python(py::object fn) {
  return std::shared_ptr<py::object>(new py::object(std::move(fn)), [](py::object* p) {
    if (!Py_IsInitialized() || python_finalizing()) return;  // the interpreter is gone: leak
    py::gil_scoped_acquire gil;
    delete p;
  });
}

// A Python callable's result as R (under the GIL); py::cast_error if it is
// not one.
template <class R>
R from_python(py::object result) {
  return result.template cast<R>();
}
template <>
c10::intrusive_ptr<c10::ivalue::Future> from_python(py::object result) {
  if (!py::isinstance(result, py::module_::import("torch.futures").attr("Future"))) {
    throw py::cast_error("got " + std::string(py::str(py::type::handle_of(result))));
  }
  return torch::jit::toIValue(result, c10::FutureType::create(c10::AnyType::get())).toFuture();
}

// Calls pycomm/backend.py's callable `fn(args...)` with the GIL taken here
// (c10d's bindings release it around every op) and casts its result to R.
// Its Python exception becomes ValueError / TypeError / RuntimeError with the
// same message, raised without the GIL; a result of another type is a
// TypeError naming `returns` (what it should have returned) and `op`.
template <class R, class... Args>
R call_python(const py::object& fn, const std::string& op, const char* returns, Args&&... args) {
  std::string what;
  PyObject* kind = PyExc_RuntimeError;
  {
    py::gil_scoped_acquire gil;
    try {
      return from_python<R>(fn(std::forward<Args>(args)...));
    } catch (py::error_already_set& e) {
      if (e.matches(PyExc_ValueError)) {
        kind = PyExc_ValueError;
      } else if (e.matches(PyExc_TypeError)) {
        kind = PyExc_TypeError;
      }
      what = py::str(e.value());
    } catch (const py::cast_error& e) {
      kind = PyExc_TypeError;
      what = op + ": the pycomm backend's Python callable did not return " + returns + " (" +
             e.what() + ")";
    }
  }
  TORCH_CHECK_VALUE(kind != PyExc_ValueError, what);
  TORCH_CHECK_TYPE(kind != PyExc_TypeError, what);
  TORCH_CHECK(false, what);
}

// pycomm/backend.py's callable (device string, op name) -> _C.Comm.
CommFactory factory_from_python(py::object fn) {
  if (fn.is_none()) return {};
  return [holder = hold_python(std::move(fn))](const c10::Device& device, const std::string& op) {
    return call_python<std::shared_ptr<Comm>>(*holder, op, "a pycomm._C.Comm", device.str(), op);
  };
}

// pycomm/backend.py's callable (ranks_to_exclude, flags, timeout_ms) -> the
// survivors' backend.
Shrinker shrinker_from_python(py::object fn) {
  if (fn.is_none()) return {};
  return [holder = hold_python(std::move(fn))](const std::vector<int64_t>& exclude, int flags,
                                               int64_t timeout_ms) {
    return call_python<c10::intrusive_ptr<c10d::Backend>>(*holder, "shrink", "a c10d Backend",
                                                          exclude, flags, timeout_ms);
  };
}

ProcessGroupPycomm& as_pycomm(const c10::intrusive_ptr<c10d::Backend>& backend, const char* fn) {
  auto* pg = dynamic_cast<ProcessGroupPycomm*>(backend.get());
  TORCH_CHECK_TYPE(pg != nullptr, fn, ": not a pycomm backend (its name is '",
                   backend->getBackendName(), "')");
  return *pg;
}

}  // namespace

void bind_backend(py::module_& m) {
  m.def(
      "make_backend",
      [](std::shared_ptr<Comm> comm, const std::string& algo, py::object cuda_factory,
         const std::string& cuda_algo, py::object shrinker) -> c10::intrusive_ptr<c10d::Backend> {
        TORCH_CHECK_VALUE(comm, "make_backend: comm is None");
        auto pg = c10::make_intrusive<ProcessGroupPycomm>(
            std::move(comm), algo, factory_from_python(std::move(cuda_factory)), cuda_algo);
        pg->set_shrinker(shrinker_from_python(std::move(shrinker)));
        return pg;
      },
      py::arg("comm"), py::arg("algo"), py::arg("cuda_factory") = py::none(),
      py::arg("cuda_algo") = "auto", py::arg("shrinker") = py::none(),
      "A c10d Backend (torch._C._distributed_c10d.Backend) over the CPU communicator `comm`, "
      "for torch.distributed.Backend.register_backend (pycomm/backend.py). "
      "cuda_factory(device: str, op: str) -> Comm builds the CUDA communicator at the first "
      "CUDA operation (None: CPU tensors only). shrinker(ranks_to_exclude: list[int], flags: int, "
      "timeout_ms: int) -> Backend makes the survivors' backend for torch.distributed.shrink_group "
      "(None: the backend does not support shrinking). Across hosts `comm` is a 'shm+gloo' "
      "communicator, which composes its collectives itself (csrc/torch/hierarchy.h).");
  m.def(
      "backend_comm",
      [](const c10::intrusive_ptr<c10d::Backend>& backend,
         const std::string& device) -> std::shared_ptr<Comm> {
        return as_pycomm(backend, "backend_comm").comm_for(c10::Device(device), "get_communicator");
      },
      py::arg("backend"), py::arg("device") = "cpu", py::call_guard<py::gil_scoped_release>(),
      "The backend's communicator for `device` (CUDA: created now if it does not exist yet, "
      "collectively)");
  m.def(
      "backend_algo",
      [](const c10::intrusive_ptr<c10d::Backend>& backend, const std::string& device) {
        return as_pycomm(backend, "backend_algo").algo_for(c10::Device(device));
      },
      py::arg("backend"), py::arg("device") = "cpu");
}

}  // namespace pycomm
