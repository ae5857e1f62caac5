#include "work.h"

#include <pybind11/pybind11.h>  // check_interrupt: signals, with the GIL

#include <chrono>
#include <stdexcept>
#include <thread>

#include "../core/types.h"
#include "../core/worker.h"

namespace py = pybind11;

namespace pycomm {

// ---------------------------------------------------------------- interrupts

namespace {
// The extension is loaded by `import pycomm`, on the main thread.
const std::thread::id g_main_thread = std::this_thread::get_id();
constexpr auto kInterruptPoll = std::chrono::milliseconds(20);
}  // namespace

bool on_main_thread() { return std::this_thread::get_id() == g_main_thread; }

void check_interrupt() {
  if (!on_main_thread() || !Py_IsInitialized()) return;
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return;
  // A handler raised (KeyboardInterrupt, for SIGINT's default one): the op is
  // abandoned and the binding raises KeyboardInterrupt in its place.
  py::error_already_set raised;  // takes (and clears) the Python error
  throw Interrupted(raised.what());
}

// ---------------------------------------------------------------- Work

Work::Work(std::string op, uint64_t seq, std::vector<at::Tensor> outputs,
           std::vector<c10::Device> devices)
    : op_(std::move(op)),
      seq_(seq),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(),
                                                       std::move(devices))) {}

void Work::wait() {
  if (worker_ && worker_->is_current() && !future_->completed()) {
    // A Future callback runs on the worker that completes ops. A pending
    // isend/irecv it issued completes as we poll the transport here.
    while (pump_ && !future_->completed() && pump_(this)) std::this_thread::yield();
  }
  if (worker_ && worker_->is_current() && !future_->completed()) {
    // An op queued behind the running one: waiting for it here would wait
    // for ourselves, forever.
    throw std::runtime_error(
        op_ + " #" + std::to_string(seq_) +
        ": wait() called on the communicator's worker thread (inside a Future callback) "
        "for an op queued behind the running one (issued outside the callback); it would deadlock. "
        "Return the op's future from the callback, or chain with then(), instead of waiting "
        "inside it");
  }
  if (!future_->completed() && on_main_thread()) wait_interruptibly(completion_flag(future_));
  future_->wait();
  if (future_->hasError()) report(future_->exception_ptr());
}

void Work::report(std::exception_ptr e) const {
  if (reported_) reported_->store(true);
  std::rethrow_exception(e);
}

std::shared_ptr<CompletionFlag> completion_flag(const c10::intrusive_ptr<c10::ivalue::Future>& f) {
  auto flag = std::make_shared<CompletionFlag>();
  f->addCallback([flag](c10::ivalue::Future&) { flag->set(); });
  return flag;
}

void Work::wait_interruptibly(const std::shared_ptr<CompletionFlag>& flag) {
  std::unique_lock<std::mutex> lk(flag->mu);
  while (!flag->cv.wait_for(lk, kInterruptPoll, [&] { return flag->done; })) {
    lk.unlock();
    try {
      check_interrupt();
    } catch (const Interrupted& e) {
      const std::string why = op_ + " #" + std::to_string(seq_) +
                              ": interrupted while waiting for it (" + e.what() + ")";
      if (on_interrupt_) on_interrupt_(why);  // aborts: the op fails, peers are told
      throw Interrupted(why);
    }
    lk.lock();
  }
}

void Work::complete() { complete_future(); }

void Work::complete_future(std::optional<std::vector<c10::ivalue::Future::WeakStorage>> storages) {
  if (future_->completed()) return;  // the user set a result already
  try {
    future_->markCompleted(c10::IValue(outputs_), std::move(storages));
  } catch (const std::exception&) {  // lost a race with the user's set_result
  }
}

void Work::fail(std::exception_ptr e) {
  if (future_->completed()) return;
  try {
    future_->setError(std::move(e));
  } catch (const std::exception&) {
  }
}

}  // namespace pycomm
