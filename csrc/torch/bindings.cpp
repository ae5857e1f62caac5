// The Python module pycomm._C: a short table, GIL released around every call
// that can block. One Comm class for CPU and GPU (comm.h: the executor
// differs); argument checks live in the comm*.cpp files and checks.cpp;
// algorithms in csrc/core;
// C++ exceptions become Python ones in the translator below, nowhere else.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include "../core/elementwise.h"
#include "../core/reduce.h"
#include "../core/shm_transport.h"
#include "comm.h"
#include "pg_transport.h"

namespace py = pybind11;
namespace pycomm {
void bind_backend(py::module_& m);  // the torch.distributed backend (backend_bind.cpp)
}
#ifdef PYCOMM_WITH_CUDA
namespace pycomm {
void bind_cuda(py::module_& m);  // make_nccl_comm, CudaWork (cuda_comm.cpp), the raw kernels
                                 // (cuda_kernels_bind.cpp)
}
#endif
using pycomm::Comm;
using pycomm::Work;

namespace {

std::unique_ptr<Comm> make_cpu_comm(std::unique_ptr<pycomm::Transport> transport,
                                    int64_t timeout_ms, int64_t slice_bytes, bool check) {
  pycomm::CommOptions opt;
  opt.timeout_ms = timeout_ms;
  opt.slice_bytes = slice_bytes;
  opt.check = check;
  auto exec = pycomm::make_cpu_executor(std::move(transport), opt);
  return std::make_unique<Comm>(std::move(exec), opt);
}

std::unique_ptr<Comm> make_gloo_comm(c10::intrusive_ptr<c10d::Backend> backend,
                                     c10::intrusive_ptr<c10d::Backend> upward,
                                     c10::intrusive_ptr<c10d::Backend> downward, int64_t timeout_ms,
                                     int64_t slice_bytes, bool check,
                                     c10::intrusive_ptr<c10d::Store> store) {
  if (!backend || !upward || !downward) {
    throw pycomm::UsageError("make_gloo_comm: the header and both payload groups are needed");
  }
  return make_cpu_comm(
      std::make_unique<pycomm::ProcessGroupTransport>(std::move(backend), std::move(upward),
                                                      std::move(downward), std::move(store)),
      timeout_ms, slice_bytes, check);
}

// The shm transport: rank 0 creates the segment `name`, the others attach
// (pycomm/comm.py sequences this through the Store and unlinks the name once
// every rank has mapped it).
std::unique_ptr<Comm> make_shm_comm(const std::string& name, int rank, int world_size, bool create,
                                    int64_t timeout_ms, int64_t slice_bytes) {
  return make_cpu_comm(std::make_unique<pycomm::ShmTransport>(name, rank, world_size, create,
                                                              pycomm::ShmConfig::from_env()),
                       timeout_ms, slice_bytes, /*check=*/false);
}

// The core CPU reduction on tensors: for tests of the shared arithmetic and
// for benchmarks of reduction speed.
void cpu_reduce_(at::Tensor dst, const at::Tensor& src, int op) {
  TORCH_CHECK_VALUE(dst.device().is_cpu() && src.device().is_cpu(), "reduce_: CPU tensors only");
  TORCH_CHECK_VALUE(dst.is_contiguous() && src.is_contiguous(), "reduce_: contiguous tensors only");
  TORCH_CHECK_VALUE(dst.numel() == src.numel(), "reduce_: dst and src differ in numel");
  TORCH_CHECK_TYPE(dst.scalar_type() == src.scalar_type(), "reduce_: dst and src differ in dtype");
  TORCH_CHECK_VALUE(op >= 0 && op < pycomm::kNumReduceOps, "reduce_: unknown op");
  const auto dt = pycomm::to_dtype(dst.scalar_type(), "dst");
  py::gil_scoped_release nogil;
  pycomm::cpu_reduce(dst.data_ptr(), dst.data_ptr(), src.data_ptr(), dst.numel(), dt,
                     static_cast<pycomm::ReduceOp>(op));
}

// The CPU reducer's fused reduce + scale (AVG's last step), for the test
// that it equals reduce_ then scale_ bit for bit.
void cpu_reduce_scale_(at::Tensor dst, const at::Tensor& src, int op, double factor) {
  TORCH_CHECK_VALUE(dst.device().is_cpu() && src.device().is_cpu() && dst.is_contiguous() &&
                        src.is_contiguous() && dst.numel() == src.numel(),
                    "reduce_scale_: contiguous CPU tensors of equal numel only");
  TORCH_CHECK_TYPE(dst.scalar_type() == src.scalar_type(),
                   "reduce_scale_: dst and src differ in dtype");
  TORCH_CHECK_VALUE(op >= 0 && op < pycomm::kNumReduceOps, "reduce_scale_: unknown op");
  const auto dt = pycomm::to_dtype(dst.scalar_type(), "dst");
  TORCH_CHECK_VALUE(pycomm::is_floating(dt), "reduce_scale_: floating dtype only");
  py::gil_scoped_release nogil;
  pycomm::CpuReducer().reduce_scale(dst.data_ptr(), dst.data_ptr(), src.data_ptr(), dst.numel(), dt,
                                    static_cast<pycomm::ReduceOp>(op), factor);
}

// The CPU reducer's reduce into several outputs (the symmetric all-reduce's
// last step): outs[k] = op(a, b), scaled by `factor` for AVG. An output may
// be `a` or `b` itself.
void cpu_reduce_to_all_(const std::vector<at::Tensor>& outs, const at::Tensor& a,
                        const at::Tensor& b, int op, double factor) {
  std::vector<void*> ptrs;
  for (const at::Tensor& t : outs) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.is_contiguous() && t.numel() == a.numel() &&
                          t.scalar_type() == a.scalar_type(),
                      "reduce_to_all_: outputs must be contiguous CPU tensors like a");
    ptrs.push_back(t.data_ptr());
  }
  TORCH_CHECK_VALUE(a.device().is_cpu() && b.device().is_cpu() && a.is_contiguous() &&
                        b.is_contiguous() && a.numel() == b.numel() &&
                        a.scalar_type() == b.scalar_type() && !outs.empty(),
                    "reduce_to_all_: contiguous CPU a and b of equal numel and dtype, and outputs");
  TORCH_CHECK_VALUE(op >= 0 && op < pycomm::kNumReduceOps, "reduce_to_all_: unknown op");
  const auto dt = pycomm::to_dtype(a.scalar_type(), "a");
  py::gil_scoped_release nogil;
  pycomm::CpuReducer().reduce_to_all(ptrs.data(), static_cast<int>(ptrs.size()), a.data_ptr(),
                                     b.data_ptr(), a.numel(), dt, static_cast<pycomm::ReduceOp>(op),
                                     factor);
}

void cpu_scale_(at::Tensor dst, double factor) {
  TORCH_CHECK_VALUE(dst.device().is_cpu() && dst.is_contiguous(),
                    "scale_: contiguous CPU tensor only");
  const auto dt = pycomm::to_dtype(dst.scalar_type(), "dst");
  TORCH_CHECK_VALUE(pycomm::is_floating(dt), "scale_: floating dtype only");
  py::gil_scoped_release nogil;
  pycomm::cpu_scale(dst.data_ptr(), dst.numel(), dt, factor);
}

// The quantized wire's kernels (quant.h) on CPU tensors: tests against a
// reference in Python, and the quantization benchmark (on CUDA tensors:
// cuda_quantize & co., cuda_kernels_bind.cpp). `format` names the codes
// ("int8", "float8_e4m3fn", "float8_e5m2"). quantize returns the quantized
// bytes (uint8, quant_bytes long) and fills `err` when given.
at::Tensor quantize(const at::Tensor& src, int64_t block, std::optional<at::Tensor> err,
                    const std::string& format) {
  const pycomm::QuantFormat f = pycomm::quant_format(format, "quantize");
  pycomm::check_quantize_args(src, block, err, "quantize", c10::Device(c10::kCPU));
  const size_t n = src.numel(), b = static_cast<size_t>(block);
  at::Tensor out = at::empty({static_cast<int64_t>(pycomm::quant_bytes(n, b))}, at::kByte);
  py::gil_scoped_release nogil;
  pycomm::cpu_quantize(f, out.data_ptr(), src.data_ptr<float>(), n, b,
                       err ? err->data_ptr<float>() : nullptr);
  return out;
}

void dequantize(at::Tensor dst, const at::Tensor& src, int64_t block, bool add,
                const std::string& format) {
  const pycomm::QuantFormat f = pycomm::quant_format(format, "dequantize");
  pycomm::check_dequantize_args(dst, src, block, "dequantize", c10::Device(c10::kCPU));
  py::gil_scoped_release nogil;
  pycomm::cpu_dequantize(f, dst.data_ptr<float>(), src.data_ptr(), dst.numel(),
                         static_cast<size_t>(block), add);
}

// Across hosts (hierarchy.h): Comm.compose_hosts, Comm.hierarchy_parts and
// the composed all-reduce's step table (for the cost model and tests).
void bind_hierarchy(py::module_& m, py::class_<Comm, py::smart_holder>& comm) {
  comm.def_property_readonly(
          "hierarchy_parts",
          [](const Comm& c)
              -> std::optional<std::pair<std::shared_ptr<Comm>, std::shared_ptr<Comm>>> {
            if (c.hierarchy() == nullptr) return std::nullopt;
            return std::make_pair(c.hierarchy()->intra_ptr(), c.hierarchy()->inter_ptr());
          },
          "Across hosts: (intra, inter), the communicators the collectives compose over; "
          "else None")
      .def(
          "compose_hosts",
          [](Comm& c, std::vector<int> host, std::vector<int> local, std::shared_ptr<Comm> intra,
             std::shared_ptr<Comm> inter) {
            c.compose_hosts(pycomm::HostLayout{std::move(host), std::move(local)}, std::move(intra),
                            std::move(inter));
          },
          py::arg("host"), py::arg("local"), py::arg("intra"), py::arg("inter"),
          py::call_guard<py::gil_scoped_release>(),
          "Across hosts (csrc/torch/hierarchy.h): rank g is local rank local[g] of host "
          "host[g]; this flat gloo communicator becomes 'shm+gloo' over the parts intra (shm) "
          "and inter (gloo), on one worker thread");
  // The composed all-reduce's steps (hierarchy.h), for the cost model and tests.
  m.def(
      "hierarchy_steps",
      [](const std::string& which) {
        std::vector<std::tuple<std::string, std::string, bool>> steps;
        for (const auto& st : pycomm::all_reduce_steps(which))
          steps.emplace_back(st.comm, st.op, st.shard);
        return steps;
      },
      py::arg("which"));
  m.attr("HIERARCHY_SMALL_BYTES") = pycomm::kSmallBytes;
}

// The Work class: what every op returns.
void bind_work(py::module_& m) {
  py::class_<Work, c10::intrusive_ptr<Work>>(m, "Work")
      .def("wait", &Work::wait, py::call_guard<py::gil_scoped_release>())
      .def("is_completed", &Work::is_completed)
      .def("is_success", &Work::is_success)
      .def("get_future",
           [](const Work& w) { return torch::jit::toPyObject(c10::IValue(w.future())); })
      .def_property_readonly("op", &Work::op)
      .def_property_readonly("seq", &Work::seq)
      .def("source_rank", &Work::source_rank,
           "a recv's sender (from any source: the rank matched, once complete); -1 otherwise");
}

// Comm's collectives; every call releases the GIL (the op may block).
void bind_collectives(py::class_<Comm, py::smart_holder>& comm) {
  comm.def("reduce_scatter", &Comm::reduce_scatter, py::arg("output"), py::arg("input"),
           py::arg("op"), py::arg("algo"), py::arg("async_op"),
           py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &Comm::all_gather, py::arg("output"), py::arg("input"), py::arg("algo"),
           py::arg("async_op"), py::call_guard<py::gil_scoped_release>())
      .def("broadcast", &Comm::broadcast, py::arg("tensor"), py::arg("src"), py::arg("algo"),
           py::arg("async_op"), py::call_guard<py::gil_scoped_release>())
      .def("reduce", &Comm::reduce, py::arg("tensor"), py::arg("dst"), py::arg("op"),
           py::arg("async_op"), py::call_guard<py::gil_scoped_release>())
      .def("gather", &Comm::gather, py::arg("gather_list"), py::arg("tensor"), py::arg("dst"),
           py::arg("async_op"), py::call_guard<py::gil_scoped_release>())
      .def("scatter", &Comm::scatter, py::arg("tensor"), py::arg("scatter_list"), py::arg("src"),
           py::arg("async_op"), py::call_guard<py::gil_scoped_release>())
      .def("all_to_all", &Comm::all_to_all, py::arg("output_tensor_list"),
           py::arg("input_tensor_list"), py::arg("async_op"),
           py::call_guard<py::gil_scoped_release>())
      .def("all_to_all_single", &Comm::all_to_all_single, py::arg("output"), py::arg("input"),
           py::arg("output_split_sizes"), py::arg("input_split_sizes"), py::arg("async_op"),
           py::call_guard<py::gil_scoped_release>());
}

// all_reduce_fastcall's arguments, read as pybind11 and comm.py read them
// before it. A tensor, or a TypeError naming the argument:
const at::Tensor& tensor_arg(PyObject* o, const char* name) {
  if (!THPVariable_Check(o)) {
    throw pycomm::UsageTypeError(std::string("all_reduce: ") + name +
                                 " must be a torch.Tensor, got " + Py_TYPE(o)->tp_name);
  }
  return THPVariable_Unpack(o);
}

// int() of it: an int or IntEnum (ReduceOp) as is.
int64_t int_arg(PyObject* o) {
  py::object number = py::reinterpret_borrow<py::object>(o);
  if (!PyLong_Check(o)) number = py::reinterpret_steal<py::object>(PyNumber_Long(o));
  if (!number) throw py::error_already_set();
  const long long v = PyLong_AsLongLong(number.ptr());
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// A flag as pybind11 read async_op: True/False, None, or a number.
bool flag_arg(PyObject* o, const char* name) {
  if (o == Py_True) return true;
  if (o == Py_False || o == Py_None) return false;
  const PyNumberMethods* nb = Py_TYPE(o)->tp_as_number;
  if (nb == nullptr || nb->nb_bool == nullptr) {
    throw pycomm::UsageTypeError(std::string("all_reduce: ") + name + " must be a bool, got " +
                                 Py_TYPE(o)->tp_name);
  }
  const int v = nb->nb_bool(o);
  if (v < 0) throw py::error_already_set();
  return v != 0;
}

// bool() of it.
bool truth_arg(PyObject* o) {
  const int v = PyObject_IsTrue(o);
  if (v < 0) throw py::error_already_set();
  return v != 0;
}

// A str, or a TypeError naming the argument.
std::string str_arg(PyObject* o, const char* name) {
  Py_ssize_t len = 0;
  const char* chars = PyUnicode_Check(o) ? PyUnicode_AsUTF8AndSize(o, &len) : nullptr;
  if (chars == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    throw pycomm::UsageTypeError(std::string("all_reduce: ") + name + " must be a str, got " +
                                 Py_TYPE(o)->tp_name);
  }
  return std::string(chars, static_cast<size_t>(len));
}

// Comm.all_reduce without pybind11's dispatcher, the Python API's most
// frequent call: at small sizes a blocking all-reduce is mostly its call, and
// pybind11's generic argument handling (keywords, defaults, a vector per call)
// cost as much as the op (benchmarks/allreduce/README.md, "call_cost.py").
// A METH_FASTCALL method descriptor: the 8 arguments of Comm::all_reduce,
// positional, converted here; errors go through the module's translators
// like every other binding's.
PyObject* all_reduce_fastcall(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  try {
    if (nargs != 8) {
      throw pycomm::UsageTypeError(
          "Comm.all_reduce takes 8 positional arguments (tensor, op, algo, async_op, wire_dtype, "
          "register, wire_block, residual), got " +
          std::to_string(nargs));
    }
    Comm& comm = py::cast<Comm&>(py::handle(self));
    const at::Tensor& t = tensor_arg(args[0], "tensor");
    const int op = static_cast<int>(int_arg(args[1]));
    const std::string algo = str_arg(args[2], "algo");
    const bool async_op = flag_arg(args[3], "async_op");
    const int wire = static_cast<int>(int_arg(args[4]));
    const bool to_register = truth_arg(args[5]);
    const int64_t block = int_arg(args[6]);
    std::optional<at::Tensor> residual;
    if (args[7] != Py_None) residual = tensor_arg(args[7], "residual");
    c10::intrusive_ptr<Work> work;
    {
      py::gil_scoped_release nogil;
      work = comm.all_reduce(t, op, algo, async_op, wire, to_register, block, residual);
    }
    if (!work) Py_RETURN_NONE;
    return py::cast(std::move(work)).release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
#ifdef __GLIBCXX__
  } catch (abi::__forced_unwind&) {
    throw;  // a cancelled thread unwinds, as in pybind11's own dispatcher
#endif
  } catch (...) {
    py::detail::try_translate_exceptions();
  }
  return nullptr;
}

PyMethodDef all_reduce_def = {
    "all_reduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(all_reduce_fastcall)),
    METH_FASTCALL,
    "all_reduce(tensor, op, algo, async_op, wire_dtype, register, wire_block, residual): "
    "positional only (pycomm/comm.py passes them)"};

// Comm's point-to-point calls, barrier, split and life (close, abort).
void bind_p2p_and_life(py::class_<Comm, py::smart_holder>& comm) {
  comm.def("send", &Comm::send, py::arg("tensor"), py::arg("dst"), py::arg("async_op"),
           py::arg("tag") = 0, py::call_guard<py::gil_scoped_release>())
      .def("recv", &Comm::recv, py::arg("tensor"), py::arg("src"), py::arg("async_op"),
           py::arg("tag") = 0, py::call_guard<py::gil_scoped_release>(),
           "src=-1: from any rank (Work.source_rank() says which, once complete)")
      .def(
          "batch_p2p",
          [](Comm& c, const std::vector<std::tuple<bool, at::Tensor, int, int>>& reqs) {
            std::vector<pycomm::TensorP2P> ops;
            for (const auto& [is_send, t, peer, tag] : reqs) ops.push_back({is_send, t, peer, tag});
            py::gil_scoped_release nogil;
            return c.batch_p2p(ops);
          },
          py::arg("ops"))
      .def("barrier", &Comm::barrier, py::arg("async_op") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("split", &Comm::split, py::arg("color"), py::arg("key"), py::arg("timeout_ms"),
           py::call_guard<py::gil_scoped_release>())
      .def("close", &Comm::close, py::call_guard<py::gil_scoped_release>())
      .def("abort", &Comm::abort, py::arg("reason"), py::call_guard<py::gil_scoped_release>());
}

// The Comm class (pycomm/comm.py wraps it).
void bind_comm(py::module_& m) {
  bind_work(m);
  // smart_holder: the torch.distributed backend shares the communicator
  // (std::shared_ptr) with the Python object that created it.
  py::class_<Comm, py::smart_holder> comm(m, "Comm");
  comm.def_property_readonly("rank", &Comm::rank)
      .def_property_readonly("world_size", &Comm::world_size)
      .def_property_readonly("transport", &Comm::transport_name)
      .def_property_readonly("device", &Comm::device)
      .def_property_readonly("slice_bytes", &Comm::slice_bytes)
      .def_property_readonly("seq", &Comm::seq)
      .def_property_readonly("closed", &Comm::closed)
      .def_property_readonly("aborted", &Comm::aborted)
      .def_property("check", &Comm::check, &Comm::set_check)  // checked mode (core/check.h)
      .def_property("auto_table", &Comm::auto_table, &Comm::set_auto_table)
      .def("auto_algo", &Comm::auto_algo, py::arg("op"), py::arg("nbytes"))
      .def_property_readonly("forked", &Comm::forked)
      .def("register_tensor", &Comm::register_tensor, py::arg("tensor"),
           py::call_guard<py::gil_scoped_release>())
      .def("is_registered", &Comm::is_registered, py::arg("tensor"))
      .def_property("auto_register", &Comm::auto_register, &Comm::set_auto_register)
      .def_property_readonly("symmetric_all_reduces", &Comm::symmetric_all_reduces)
      .def_property_readonly("cross_memory_all_reduces", &Comm::cross_memory_all_reduces);
  bind_collectives(comm);
  PyObject* all_reduce =
      PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(comm.ptr()), &all_reduce_def);
  if (all_reduce == nullptr) throw py::error_already_set();
  comm.attr("all_reduce") = py::reinterpret_steal<py::object>(all_reduce);
  bind_p2p_and_life(comm);
  bind_hierarchy(m, comm);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pycomm C++ core: ring collectives over pluggable transports";

  // The one place where pycomm's C++ exceptions become Python exceptions.
  // C++ code (checks, the core, the workers) throws only C++ types, often
  // with the GIL released; pybind11 calls this translator with the GIL held.
  // Anything else keeps pybind11's / torch's default mapping
  // (std::runtime_error -> RuntimeError, c10::ValueError -> ValueError, ...).
  static py::exception<pycomm::CommError> comm_error(m, "CommError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const pycomm::Interrupted& e) {
      py::set_error(PyExc_KeyboardInterrupt, e.what());
    } catch (const pycomm::CommError& e) {
      py::set_error(comm_error, e.what());
    } catch (const pycomm::UsageError& e) {
      py::set_error(PyExc_ValueError, e.what());
    } catch (const pycomm::UsageTypeError& e) {
      py::set_error(PyExc_TypeError, e.what());
    } catch (const pycomm::NotSupported& e) {
      py::set_error(PyExc_NotImplementedError, e.what());
    }
  });

  m.attr("WITH_CUDA") = false;

  bind_comm(m);

  m.def("make_gloo_comm", &make_gloo_comm, py::arg("backend"), py::arg("upward"),
        py::arg("downward"), py::arg("timeout_ms"), py::arg("slice_bytes"),
        py::arg("check") = false, py::arg("store") = nullptr);
  m.def("make_shm_comm", &make_shm_comm, py::arg("name"), py::arg("rank"), py::arg("world_size"),
        py::arg("create"), py::arg("timeout_ms"), py::arg("slice_bytes"),
        py::call_guard<py::gil_scoped_release>());
  m.def("shm_unlink", &pycomm::ShmTransport::unlink, py::arg("name"));

  // The algorithms a caller may name for a collective ("all_reduce", ...),
  // as pick() accepts them (besides "auto"): the auto table's checks.
  m.def("algorithms_of", [](const std::string& op) {
    for (pycomm::CollKind c : pycomm::kChoosable) {
      if (op == pycomm::coll_name(c)) return pycomm::algorithms_of(c);
    }
    throw pycomm::UsageError(pycomm::cat("algorithms_of: unknown collective '", op, "'"));
  });
  m.def("reduce_", &cpu_reduce_, py::arg("dst"), py::arg("src"), py::arg("op"));
  m.def("scale_", &cpu_scale_, py::arg("dst"), py::arg("factor"));
  m.def("quantize", &quantize, py::arg("src"), py::arg("block"), py::arg("err") = py::none(),
        py::arg("format") = "int8");
  m.def("dequantize", &dequantize, py::arg("dst"), py::arg("src"), py::arg("block"),
        py::arg("add") = false, py::arg("format") = "int8");
  m.def("reduce_scale_", &cpu_reduce_scale_, py::arg("dst"), py::arg("src"), py::arg("op"),
        py::arg("factor"));
  m.def("reduce_to_all_", &cpu_reduce_to_all_, py::arg("outs"), py::arg("a"), py::arg("b"),
        py::arg("op"), py::arg("factor"));
  m.def("half_to_float", [](uint16_t h) { return pycomm::half_to_float(h); });
  m.def("float_to_half", [](float f) { return pycomm::float_to_half(f); });
  m.def("bf16_to_float", [](uint16_t h) { return pycomm::bf16_to_float(h); });
  m.def("float_to_bf16", [](float f) { return pycomm::float_to_bf16(f); });
  pycomm::bind_backend(m);
#ifdef PYCOMM_WITH_CUDA
  pycomm::bind_cuda(m);  // sets WITH_CUDA = True
#endif
}
