#include "comm.h"

#include <pybind11/pybind11.h>  // check_interrupt: signals, with the GIL
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <c10/core/CPUAllocator.h>
#include <deque>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <sstream>
#include <thread>

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
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()), std::move(devices))) {}

void Work::wait() {
  if (worker_ && worker_->is_current() && !future_->completed()) {
    // A Future callback runs on the worker that completes ops: waiting there
    // for a later op would wait for ourselves, forever.
    throw std::runtime_error(
        op_ + " #" + std::to_string(seq_) +
        ": wait() called on the communicator's worker thread (inside a Future callback) "
        "before the op completed; it would deadlock. Return the op's future from the "
        "callback, or chain with then(), instead of waiting inside it");
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

// ---------------------------------------------------------------- checks

DType to_dtype(at::ScalarType t, const char* arg) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kByte: return DType::kUInt8;
    case at::kChar: return DType::kInt8;
    default: break;
  }
  std::ostringstream msg;
  msg << arg << " has unsupported dtype " << c10::toString(t)
      << "; pycomm supports float32, float64, float16, bfloat16, int32, int64, uint8, int8";
  throw UsageTypeError(msg.str());
}

std::string join_msg(std::initializer_list<std::string> parts) {
  std::string s;
  for (const auto& p : parts) s += p;
  return s;
}

void check_tensor(const at::Tensor& t, const char* arg, const char* op, const c10::Device& device) {
  if (!t.defined()) throw UsageError(join_msg({op, ": ", arg, " is an undefined tensor"}));
  if (t.is_sparse()) throw UsageError(join_msg({op, ": ", arg, " must be a dense tensor"}));
  to_dtype(t.scalar_type(), arg);
  // A CPU communicator takes any CPU tensor; a CUDA one, its own device only.
  if (t.device().type() != device.type() ||
      (device.has_index() && t.device().index() != device.index())) {
    throw UsageError(join_msg({op, ": ", arg, " is on ", t.device().str(),
                               " but the communicator runs on ", device.str()}));
  }
  if (!t.is_contiguous()) {
    throw UsageError(join_msg(
        {op, ": ", arg, " must be contiguous (pass t.contiguous() and copy the result back)"}));
  }
}

void check_peer(int peer, const char* arg, const char* op, int rank, int size, bool allow_self) {
  if (peer < 0 || peer >= size) {
    std::ostringstream msg;
    msg << op << ": " << arg << "=" << peer << " is out of range for world_size " << size;
    throw UsageError(msg.str());
  }
  if (!allow_self && peer == rank) {
    std::ostringstream msg;
    msg << op << ": " << arg << "=" << peer << " is this rank; point-to-point needs another rank";
    throw UsageError(msg.str());
  }
}

void check_scatter_sizes(const at::Tensor& big, const char* big_arg, const at::Tensor& small,
                         const char* small_arg, int world_size, const char* op) {
  if (big.scalar_type() != small.scalar_type()) {
    throw UsageTypeError(
        join_msg({op, ": ", big_arg, " dtype ", c10::toString(big.scalar_type()), " differs from ",
                  small_arg, " dtype ", c10::toString(small.scalar_type())}));
  }
  if (big.numel() != small.numel() * world_size) {
    std::ostringstream msg;
    msg << op << ": " << big_arg << " must have world_size * " << small_arg
        << ".numel() = " << world_size << " * " << small.numel() << " elements, got "
        << big.numel();
    throw UsageError(msg.str());
  }
}

ReduceOp to_op(int op, DType dtype, const char* opname) {
  if (op < 0 || op >= kNumReduceOps) {
    throw UsageError(join_msg({opname, ": unknown reduce op ", std::to_string(op)}));
  }
  const ReduceOp r = static_cast<ReduceOp>(op);
  if (r == ReduceOp::kAvg && !is_floating(dtype)) {
    throw UsageError(join_msg({opname, ": ReduceOp.AVG needs a floating dtype, got ",
                               dtype_name(dtype), " (use SUM and divide)"}));
  }
  return r;
}

std::optional<DType> to_wire_dtype(int wire_dtype, DType tensor_dtype, const char* opname) {
  if (wire_dtype < 0) return std::nullopt;
  const DType w = static_cast<DType>(wire_dtype);
  if (wire_dtype >= kNumDTypes || (w != DType::kFloat16 && w != DType::kBFloat16)) {
    throw UsageError(
        join_msg({opname, ": wire_dtype must be torch.float16 or torch.bfloat16, got ",
                  wire_dtype < kNumDTypes ? dtype_name(w) : std::to_string(wire_dtype)}));
  }
  if (tensor_dtype != DType::kFloat32) {
    throw UsageError(join_msg({opname,
                               ": wire_dtype needs a float32 tensor (it is reduced in "
                               "float32 and sent as ",
                               dtype_name(w), "), got ", dtype_name(tensor_dtype)}));
  }
  return w;
}

std::string failure_message(const Work& work, int rank, const std::string& transport,
                            int world_size, const std::string& device, const std::string& why) {
  std::ostringstream msg;
  msg << work.op() << " #" << work.seq() << " on rank " << rank << " (" << transport
      << " transport, world_size " << world_size << ", " << device << ") failed: " << why;
  return msg.str();
}

UsageError usage_failure(const Work& work, int rank, const std::exception& e) {
  return UsageError(join_msg({work.op(), " #", std::to_string(work.seq()), " on rank ",
                              std::to_string(rank), ": ", e.what()}));
}

void check_options(const CommOptions& options) {
  if (options.slice_bytes < 64) throw UsageError("slice_bytes must be at least 64");
  if (options.timeout_ms <= 0) throw UsageError("timeout must be positive");
  for (const auto& [op, rules] : options.auto_table) {
    for (const auto& rule : rules) {
      if (rule.second != "ring" && rule.second != "nccl" && rule.second != "direct") {
        throw UsageError(join_msg({"auto_table: unknown algo '", rule.second, "' for ", op}));
      }
    }
  }
}

std::unique_ptr<Executor> Executor::split(int, int, const CommOptions&) {
  throw UsageError(join_msg({"split: the ", transport_name(),
                             " transport has no split of its own (groups of it are built "
                             "through the store: Communicator.new_group / split)"}));
}

size_t scratch_bytes(size_t slice_bytes, int world_size) {
  return std::max(2 * slice_bytes + 64, static_cast<size_t>(world_size) * sizeof(Fingerprint));
}

// ---------------------------------------------------------------- CpuExecutor

namespace {

class CpuExecutor final : public Executor {
 public:
  CpuExecutor(std::unique_ptr<Transport> transport, const CommOptions& options)
      : transport_(std::move(transport)),
        timeout_(options.timeout_ms),
        slice_bytes_(static_cast<size_t>(options.slice_bytes)),
        scratch_(scratch_bytes(slice_bytes_, transport_->world_size())) {
    transport_->set_timeout(timeout_);
    if (transport_->checks_interrupts()) transport_->set_interrupt_check(&check_interrupt);
    worker_ = std::make_unique<Worker>();
    worker_->set_idle_poll([this] { return poll_deferred(); });
    worker_->set_idle_wait([this](int64_t ns) { return transport_->idle_wait(ns); },
                           [this] { transport_->interrupt(); });
  }

  int rank() const override { return transport_->rank(); }
  int world_size() const override { return transport_->world_size(); }
  std::string transport_name() const override { return transport_->name(); }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  bool shared_buffers() const override { return transport_->shared_buffers() != nullptr; }
  uint64_t symmetric_domain() const override {
    return transport_->shared_buffers() ? transport_->shared_buffers()->symmetric_domain() : 0;
  }
  bool native_collectives() const override { return transport_->native() != nullptr; }
  bool on_own_thread() const override { return worker_ && worker_->is_current(); }
  at::Tensor empty_like(const at::Tensor& t) override { return at::empty_like(t); }

  c10::intrusive_ptr<Work> new_work(const char* op, uint64_t seq,
                                    std::vector<at::Tensor> outputs) override {
    auto work = c10::make_intrusive<Work>(op, seq, std::move(outputs));
    work->set_worker(worker_.get());
    work->set_on_interrupt([this](const std::string& why) { abort(why); });
    return work;
  }

  void run(const c10::intrusive_ptr<Work>& work, Body body, Wait wait,
           std::vector<at::Tensor> keep) override {
    std::function<void()> task = [this, work, body = std::move(body), keep = std::move(keep)]() {
      if (fail_if_aborted(work)) return;
      try {
        Context ctx{*transport_, reducer_, scratch_.data(), scratch_.size(), slice_bytes_};
        body(ctx);
        work->complete();
      } catch (const UsageError& e) {
        // Detected by every rank before any payload moved (checked mode):
        // the communicator stays usable.
        work->fail(std::make_exception_ptr(usage_failure(*work, rank(), e)));
      } catch (const std::exception& e) {
        fail_op(work, e);
      }
    };
    if (wait == Wait::kAsync) {
      worker_->submit(std::move(task));  // on the worker thread: ahead of the caller's queue
      return;
    }
    if (worker_->is_current()) {
      // A synchronous op from a Future callback, which runs on the worker as
      // an op completes: run it right here, between that op and the next one
      // (queueing it and waiting would wait for ourselves). Every rank runs it
      // at the same point of its op sequence.
      task();
    } else if (!(transport_->checks_interrupts() || !on_main_thread()) ||
               !worker_->try_run_inline(task)) {
      // Queued behind other work, or on a transport whose waits cannot check
      // for SIGINT (gloo): Work::wait below can.
      worker_->submit(std::move(task));
    }
    work->wait();
  }

  // Synchronous: post and wait like run(). Asynchronous: the task only posts
  // and the worker's idle poll (poll_deferred) completes the Work, so a
  // pending isend never blocks a later irecv or collective.
  void run_p2p(const c10::intrusive_ptr<Work>& work, std::vector<P2POp> ops, Wait wait,
               std::vector<at::Tensor> keep) override {
    if (wait != Wait::kAsync) {
      run(
          work, [ops](const Context& ctx) { ctx.transport.exchange(ops.data(), ops.size()); }, wait,
          std::move(keep));
      return;
    }
    std::ostringstream peers;
    for (size_t i = 0; i < ops.size(); ++i) {
      peers << (i ? ", " : "")
            << (ops[i].kind == P2POp::kSend ? "send to rank " : "recv from rank ") << ops[i].peer;
    }
    worker_->submit([this, work, ops, peers = peers.str(), keep = std::move(keep)] {
      if (fail_if_aborted(work)) return;
      try {
        const Handle h = transport_->post(ops.data(), ops.size());
        deferred_.push_back({work, h, std::chrono::steady_clock::now() + timeout_, peers});
        worker_->kick();
      } catch (const std::exception& e) {
        fail_p2p(work, e, peers);
      }
    });
  }

  void close() override {
    worker_->drain();
    worker_.reset();
    transport_.reset();
  }

  void leak() override {
    (void)worker_.release();
    (void)transport_.release();
  }

  void abort(const std::string& why) override {
    {
      std::lock_guard<std::mutex> lk(abort_mu_);
      if (aborted_) return;
      abort_reason_ = why;
      aborted_ = true;
    }
    if (transport_) transport_->abort_because(why);
  }
  bool aborted() const override { return aborted_; }
  std::string abort_reason() const override {
    std::lock_guard<std::mutex> lk(abort_mu_);
    return abort_reason_;
  }

 private:
  struct Deferred {
    c10::intrusive_ptr<Work> work;
    Handle handle;
    std::chrono::steady_clock::time_point deadline;
    std::string peers;  // "send to rank 1, recv from rank 2": for the timeout message
  };

  // On the worker: fails `work` if an earlier op aborted the communicator.
  bool fail_if_aborted(const c10::intrusive_ptr<Work>& work) {
    if (!aborted_) return false;
    work->fail(std::make_exception_ptr(
        CommError(join_msg({work->op(), " #", std::to_string(work->seq()),
                            ": communicator aborted earlier (", abort_reason(), ")"}))));
    return true;
  }

  void fail_op(const c10::intrusive_ptr<Work>& work, const std::exception& e) {
    const std::string msg =
        failure_message(*work, rank(), transport_->name(), world_size(), "cpu", e.what());
    abort(msg);
    work->fail(dynamic_cast<const Interrupted*>(&e) != nullptr
                   ? std::make_exception_ptr(Interrupted(msg))
                   : std::make_exception_ptr(CommError(msg)));
  }

  // fail_op for a deferred p2p op, naming its peers where the transport's own
  // error does not (gloo's "Connection closed by peer [127.0.0.1]:47338").
  void fail_p2p(const c10::intrusive_ptr<Work>& work, const std::exception& e,
                const std::string& peers) {
    const std::string what = e.what();
    if (dynamic_cast<const Interrupted*>(&e) != nullptr || what.find(peers) != std::string::npos) {
      fail_op(work, e);
    } else {
      fail_op(work, CommError(what + " (" + peers + ")"));
    }
  }

  // On the executing thread; true while any deferred op is pending.
  bool poll_deferred() {
    for (auto it = deferred_.begin(); it != deferred_.end();) {
      bool done = false;
      try {
        if (aborted_) throw CommError("communicator aborted (" + abort_reason() + ")");
        done = transport_->test(it->handle);
        if (!done && std::chrono::steady_clock::now() > it->deadline) {
          std::ostringstream msg;
          msg << "timed out after " << timeout_.count() << " ms (" << it->peers
              << "); is the peer alive and did it post the matching operation?";
          throw CommError(msg.str());
        }
      } catch (const std::exception& e) {
        fail_p2p(it->work, e, it->peers);
        it = deferred_.erase(it);
        continue;
      }
      if (done) {
        it->work->complete();
        it = deferred_.erase(it);
      } else {
        ++it;
      }
    }
    return !deferred_.empty();
  }

  std::unique_ptr<Transport> transport_;
  std::chrono::milliseconds timeout_;
  size_t slice_bytes_;
  CpuReducer reducer_;
  std::vector<char> scratch_;
  std::deque<Deferred> deferred_;  // touched only by the executing thread
  std::unique_ptr<Worker> worker_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex abort_mu_;
  std::string abort_reason_;
};

}  // namespace

std::unique_ptr<Executor> make_cpu_executor(std::unique_ptr<Transport> transport,
                                            const CommOptions& options) {
  check_options(options);
  return std::make_unique<CpuExecutor>(std::move(transport), options);
}

// ---------------------------------------------------------------- Comm

Comm::Comm(std::unique_ptr<Executor> executor, CommOptions options)
    : exec_(std::move(executor)),
      options_(std::move(options)),
      rank_(exec_->rank()),
      size_(exec_->world_size()),
      transport_name_(exec_->transport_name()),
      device_(exec_->device()),
      pid_(static_cast<long>(::getpid())) {
  check_options(options_);
  // Measured (benchmarks/allreduce/table_cpu_{2,3,4}ranks.txt, 2 cores):
  // direct beats the ring over shm from 1 KiB to 64 MiB, but for a tie at
  // 3 ranks and 4 MiB (1290 vs 1233 us, within noise), so auto always takes
  // it on shm; the ring stays available as algo="ring".
  direct_max_bytes_ = std::numeric_limits<size_t>::max();
  if (const char* v = std::getenv("PYCOMM_DIRECT_MAX_BYTES")) {
    direct_max_bytes_ = static_cast<size_t>(std::strtoull(v, nullptr, 10));
  }
}

Comm::~Comm() {
  try {
    // Python drops the last reference with the GIL held; close() joins the
    // executor's thread, which may be waiting for the GIL (a Python Future
    // callback), so the GIL is let go for the wait.
    if (Py_IsInitialized() && PyGILState_Check()) {
      PyThreadState* state = PyEval_SaveThread();
      try {
        close();
      } catch (...) {
      }
      PyEval_RestoreThread(state);
    } else {
      close();
    }
  } catch (...) {
  }
}

bool Comm::forked() const { return static_cast<long>(::getpid()) != pid_; }

void Comm::check_open(const char* op) const {
  if (forked()) {
    std::ostringstream msg;
    msg << op << ": this communicator was created in process " << pid_
        << " and cannot be used in a forked child (pid " << ::getpid()
        << "): its threads and connections belong to the parent. Call pycomm.init() in the "
           "child (or use the 'spawn' start method)";
    throw std::runtime_error(msg.str());
  }
  if (closed_) throw std::runtime_error(join_msg({op, ": the communicator is closed"}));
  if (exec_->aborted()) {
    failure_reported_->store(true);
    throw CommError(join_msg({op, ": the communicator was aborted earlier (", exec_->abort_reason(),
                              "); create a new one with pycomm.init()"}));
  }
}

void Comm::check_tensor(const at::Tensor& t, const char* arg, const char* op) const {
  pycomm::check_tensor(t, arg, op, device_);
}

void Comm::close() {
  if (exec_ && !forked() && exec_->on_own_thread()) {
    throw std::runtime_error(
        "close(): called on the communicator's worker thread (inside a Future callback); "
        "it would wait for itself. Close the communicator from the caller's thread");
  }
  if (closed_.exchange(true)) return;
  if (forked()) {
    // The executor's threads and the transport's connections exist only in
    // the parent: joining or tearing them down here would hang or break the
    // parent's. Leak this process's copies instead.
    exec_->leak();
    (void)exec_.release();  // its destructor would touch the parent's threads too
    return;
  }
  exec_->close();
  // A failure nobody waited for (an async op whose Work was dropped) must
  // not vanish: close() reports it, after releasing everything.
  if (exec_->aborted() && !user_aborted_ && !failure_reported_->load()) {
    throw CommError(
        join_msg({"close: an operation failed and aborted the communicator, and "
                  "no call has raised it yet (",
                  exec_->abort_reason(), "); its resources are released"}));
  }
}

void Comm::abort(const std::string& why) {
  if (forked()) return;  // the parent's transport: not ours to abort
  if (!exec_->aborted()) user_aborted_ = true;
  exec_->abort(why);
}

Body Comm::collective(OpHeader h, Body body) {
  return [this, h, check = options_.check, body = std::move(body)](const Context& ctx) mutable {
    h.seq = ++coll_seq_;  // ops run one at a time: execution order
    if (check) {
      // The exchange carries a header equal on every rank, so that a
      // mismatch surfaces as checked mode's report (ValueError, communicator
      // usable) rather than as a header mismatch of its own messages.
      OpHeader x;
      x.seq = h.seq;
      x.kind = static_cast<int32_t>(CollKind::kCheck);
      ctx.transport.begin_op(x);
      check_fingerprints(ctx, Fingerprint::of(h, static_cast<uint64_t>(options_.slice_bytes),
                                              static_cast<uint64_t>(direct_max_bytes_)));
    }
    ctx.transport.begin_op(h);
    body(ctx);
  };
}

namespace {
OpHeader header(CollKind kind, size_t count, int32_t dtype = -1, int32_t op = -1, int32_t root = -1,
                AlgoKind algo = AlgoKind::kRing) {
  OpHeader h;
  h.kind = static_cast<int32_t>(kind);
  h.count = count;
  h.dtype = dtype;
  h.op = op;
  h.root = root;
  h.algo = static_cast<int32_t>(algo);
  return h;
}

AlgoKind algo_kind(const std::string& algo) {
  if (algo == "direct") return AlgoKind::kDirect;
  if (algo == "nccl") return AlgoKind::kNative;
  return AlgoKind::kRing;
}

Wait wait_of(bool async_op) { return async_op ? Wait::kAsync : Wait::kSync; }

// A registered storage's DataPtr context (Comm::register_tensor): the
// symmetric region it lives in, unmapped here when the storage is freed.
struct SymmetricStorage {
  std::shared_ptr<SymmetricRegion> region;
};
void delete_symmetric_storage(void* ctx) { delete static_cast<SymmetricStorage*>(ctx); }

// Why `storage` must not move into symmetric memory, or "" when it may: its
// memory was made by torch's CPU allocator (or is a region already). Memory
// that something else owns (torch.from_numpy, from_blob, a file mapping,
// share_memory_()) would silently stop being shared with its owner.
std::string storage_refusal(const c10::Storage& storage) {
  const c10::DeleterFnPtr deleter = storage.data_ptr().get_deleter();
  if (deleter != nullptr && (deleter == c10::GetCPUAllocator()->raw_deleter() ||
                             deleter == c10::GetDefaultCPUAllocator()->raw_deleter() ||
                             deleter == &delete_symmetric_storage)) {
    return "";
  }
  return "its storage was not allocated by torch's CPU allocator (torch.from_numpy, "
         "from_blob, a mapping, share_memory_()), and moving it would end that sharing";
}

// A collective step (inside an op's body, on every rank): allocates a
// symmetric region of the storage's size and, if every rank got its part,
// moves the storage into it as Tensor.share_memory_() does: copy, then swap
// the storage's memory, so every view follows. The caller makes sure no op
// holding the old address is queued (register_tensor is synchronous; an
// adopting all_reduce holds its caller until the move). nullptr, with `why`,
// when some rank got no memory or refused (storage_refusal).
std::shared_ptr<SymmetricRegion> move_into_symmetric(SharedBuffers& sb, const c10::Storage& storage,
                                                     int me, std::string* why,
                                                     std::string refuse = "") {
  const size_t bytes = storage.nbytes();
  if (refuse.empty()) refuse = storage_refusal(storage);
  std::shared_ptr<SymmetricRegion> region = sb.allocate_symmetric(bytes, refuse, why);
  if (!region) return nullptr;
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  if (bytes > 0) std::memcpy(region->base(me), impl->data(), bytes);
  impl->set_data_ptr_noswap(c10::DataPtr(region->base(me), new SymmetricStorage{region},
                                         &delete_symmetric_storage, c10::Device(c10::kCPU)));
  return region;
}

// The region the storage of `t` lives in, if the transport of `domain`
// allocated it; else nullptr.
std::shared_ptr<SymmetricRegion> symmetric_region_of(const at::Tensor& t, uint64_t domain) {
  if (domain == 0 || !t.has_storage()) return nullptr;
  const c10::DataPtr& dp = t.storage().data_ptr();
  if (dp.get_deleter() != &delete_symmetric_storage) return nullptr;
  const auto& region = static_cast<const SymmetricStorage*>(dp.get_context())->region;
  return region->domain() == domain ? region : nullptr;
}

// The transport's own collectives (algo="nccl"); pick() only returns "nccl"
// when the transport has them.
NativeCollectives& native(const Context& ctx) { return *ctx.transport.native(); }
}  // namespace

// all_reduce's "auto" picks by size: "direct" over shared memory (one or two
// synchronisations per piece instead of 2(n-1) ring steps; algorithms.h) up
// to direct_max_bytes_; on a GPU the measured auto table decides between the
// ring and NCCL's own collectives.
std::string Comm::pick(const std::string& algo, const char* op, size_t bytes, bool wire) const {
  const bool is_all_reduce = std::string(op) == "all_reduce";
  if (algo == "nccl") {
    if (!exec_->native_collectives()) {
      throw UsageError(join_msg(
          {op, ": algo='nccl' needs a CUDA communicator (transport='nccl'); this one runs on ",
           device_.str(), " over ", transport_name_}));
    }
    if (wire) {
      throw UsageError(
          "all_reduce: wire_dtype needs algo='ring' or 'auto', not 'nccl' "
          "(NCCL's all-reduce sends the tensor's own dtype)");
    }
    return algo;
  }
  if (algo == "direct") {
    if (!is_all_reduce) {
      throw UsageError(join_msg({op, ": algo='direct' is only implemented for all_reduce"}));
    }
    if (wire) {
      throw UsageError(
          "all_reduce: wire_dtype needs algo='ring' or 'auto', not 'direct' "
          "(direct reduces straight from shared memory: nothing is sent)");
    }
    if (!exec_->shared_buffers()) {
      throw UsageError(
          join_msg({"all_reduce: algo='direct' needs transport='shm', this "
                    "communicator uses ",
                    transport_name_}));
    }
    return algo;
  }
  if (algo == "ring") return algo;
  if (algo != "auto") {
    throw UsageError(join_msg(
        {op, ": unknown algo '", algo, "' (expected 'auto', 'ring', 'direct' or 'nccl')"}));
  }
  if (wire) return "ring";  // only the ring sends a wire dtype
  auto it = options_.auto_table.find(op);
  if (it != options_.auto_table.end()) {
    for (const auto& [max_bytes, a] : it->second) {
      // A rule this communicator cannot run (direct without shared memory,
      // nccl without native collectives) is skipped.
      const bool runnable = a == "ring" || (a == "nccl" && exec_->native_collectives()) ||
                            (a == "direct" && is_all_reduce && exec_->shared_buffers());
      if (runnable && (max_bytes < 0 || bytes <= static_cast<size_t>(max_bytes))) return a;
    }
  }
  if (is_all_reduce && exec_->shared_buffers() && bytes <= direct_max_bytes_) return "direct";
  return exec_->native_collectives() ? "nccl" : "ring";
}

// Ops pair up across ranks by the order each rank issues them. Two threads
// issuing on one communicator at once would interleave differently on each
// rank and silently cross-match data, so a call made while another thread is
// inside one (issuing, or waiting for a synchronous op) is rejected. Calls
// one after the other from different threads (autograd's, say) are fine, and
// so are ops issued by Future callbacks on the CPU worker, which orders them.
class Comm::CallGuard {
 public:
  CallGuard(Comm& c, const char* op) : c_(c) {
    if (c.exec_->on_own_thread()) return;
    std::thread::id none;
    if (c.caller_.compare_exchange_strong(none, std::this_thread::get_id())) {
      owner_ = true;
      return;
    }
    if (none == std::this_thread::get_id()) return;  // nested (the same thread)
    throw std::runtime_error(
        join_msg({op,
                  ": another thread is inside a call on this communicator. Calls issued from "
                  "several threads at once pair up in different orders on different ranks (wrong "
                  "results), so pycomm rejects them: issue ops from one thread at a time (a lock "
                  "around each call, taken in the same order on every rank), or use one "
                  "communicator per thread"}));
  }
  ~CallGuard() {
    if (owner_) c_.caller_.store(std::thread::id());
  }
  CallGuard(const CallGuard&) = delete;
  CallGuard& operator=(const CallGuard&) = delete;

 private:
  Comm& c_;
  bool owner_ = false;
};

c10::intrusive_ptr<Work> Comm::start(
    const char* op, std::vector<at::Tensor> outputs, Wait wait,
    const std::function<void(const c10::intrusive_ptr<Work>&)>& submit) {
  CallGuard guard(*this, op);
  check_open(op);
  auto work = exec_->new_work(op, ++seq_, std::move(outputs));
  work->set_reported_flag(failure_reported_);
  try {
    submit(work);
  } catch (const CommError&) {
    failure_reported_->store(true);  // raised to the caller right here
    throw;
  }
  if (wait == Wait::kAsync) return work;
  return {};
}

c10::intrusive_ptr<Work> Comm::launch(const char* op, std::vector<at::Tensor> outputs, Body body,
                                      Wait wait, std::vector<at::Tensor> keep) {
  // The outputs too: on GPU every tensor an op touches is recorded on the
  // communicator's streams (the allocator must not reuse its memory early).
  keep.insert(keep.end(), outputs.begin(), outputs.end());
  return start(op, std::move(outputs), wait, [&](const c10::intrusive_ptr<Work>& work) {
    exec_->run(work, std::move(body), wait, std::move(keep));
  });
}

c10::intrusive_ptr<Work> Comm::launch_p2p(const char* op, std::vector<at::Tensor> tensors,
                                          std::vector<P2POp> ops, Wait wait) {
  for (auto& o : ops) o.channel = kUser;
  return start(op, tensors, wait, [&](const c10::intrusive_ptr<Work>& work) {
    exec_->run_p2p(work, std::move(ops), wait, std::move(tensors));
  });
}

c10::intrusive_ptr<Work> Comm::all_reduce(const at::Tensor& t, int op, const std::string& algo,
                                          bool async_op, int wire_dtype, bool offer) {
  constexpr const char* kOp = "all_reduce";
  check_open(kOp);
  check_tensor(t, "tensor", kOp);
  const DType dt = to_dtype(t.scalar_type(), "tensor");
  const ReduceOp rop = to_op(op, dt, kOp);
  const std::optional<DType> wire = to_wire_dtype(wire_dtype, dt, kOp);
  const std::string a = pick(algo, kOp, t.nbytes(), wire.has_value());
  AlgoKind kind = algo_kind(a);
  if (wire) kind = *wire == DType::kFloat16 ? AlgoKind::kRingWireF16 : AlgoKind::kRingWireBF16;
  void* data = t.data_ptr();
  const size_t count = t.numel();
  // All of a registered storage: direct_all_reduce may skip the staging.
  std::shared_ptr<SymmetricRegion> sym = symmetric_region_of(t, exec_->symmetric_domain());
  if (sym && (data != sym->base(rank_) || t.nbytes() != sym->bytes())) sym.reset();
  // Or it may offer to move there in this op (direct_all_reduce's adopt).
  // Ops issued later take the tensor's address when issued, so the caller
  // waits until this one has decided, and moved, before issuing more.
  AdoptFn adopt;
  std::shared_ptr<CompletionFlag> decided;  // set by adopt, or when the op ends
  if (!sym && a == "direct" && !wire && offers_to_adopt(t, offer)) {
    const c10::Storage storage = t.storage();
    const int me = rank_;
    auto failed = adopt_failed_;
    auto declined = declined_;
    decided = std::make_shared<CompletionFlag>();
    adopt = [storage, me, failed, declined, decided](SharedBuffers& sb, bool everyone) {
      std::shared_ptr<SymmetricRegion> region;
      if (everyone) {
        std::string why;  // every rank alike: nothing to report, the op stages
        region = move_into_symmetric(sb, storage, me, &why);
        if (!region) failed->store(true);  // stop offering (each op still agrees)
      } else {
        declined->add(storage);
      }
      decided->set();
      return region;
    };
  }
  // One caller at a time until the move is done: another thread's op on the
  // tensor issued meanwhile would take the old address.
  std::optional<CallGuard> guard;
  if (decided) guard.emplace(*this, kOp);
  auto symmetric_ops = symmetric_ops_;
  c10::intrusive_ptr<Work> work =
      launch(kOp, {t},
             collective(header(CollKind::kAllReduce, count, int32_t(dt), int32_t(rop), -1, kind),
                        [=](const Context& ctx) {
                          if (wire) {
                            ring_all_reduce_wire(ctx, static_cast<float*>(data), count, *wire, rop);
                          } else if (a == "direct") {
                            if (direct_all_reduce(ctx, data, count, dt, rop, sym.get(), adopt)) {
                              symmetric_ops->fetch_add(1);
                            }
                          } else if (a == "nccl") {
                            ctx.transport.wait(native(ctx).all_reduce(data, data, count, dt, rop));
                          } else {
                            ring_all_reduce(ctx, data, count, dt, rop);
                          }
                        }),
             wait_of(async_op));
  if (decided && work) {
    // Also when the op fails or ends before deciding (a dead peer, abort).
    work->future()->addCallback([decided](c10::ivalue::Future&) { decided->set(); });
    work->wait_interruptibly(decided);
  }
  return work;
}

c10::intrusive_ptr<Work> Comm::reduce_scatter(const at::Tensor& out, const at::Tensor& in, int op,
                                              const std::string& algo, bool async_op) {
  constexpr const char* kOp = "reduce_scatter";
  check_open(kOp);
  check_tensor(out, "output", kOp);
  check_tensor(in, "input", kOp);
  check_scatter_sizes(in, "input", out, "output", size_, kOp);
  const DType dt = to_dtype(in.scalar_type(), "input");
  const ReduceOp rop = to_op(op, dt, kOp);
  const std::string a = pick(algo, kOp, in.nbytes(), false);
  const size_t m = out.numel();
  const void* src = in.data_ptr();
  void* dst = out.data_ptr();
  // The ring reduces in place, so it works on a copy of the input.
  at::Tensor buf = a == "nccl" ? at::Tensor() : exec_->empty_like(in);
  void* work = buf.defined() ? buf.data_ptr() : nullptr;
  return launch(kOp, {out},
                collective(header(CollKind::kReduceScatter, size_t(in.numel()), int32_t(dt),
                                  int32_t(rop), -1, algo_kind(a)),
                           [=](const Context& ctx) {
                             if (a == "nccl") {
                               ctx.transport.wait(native(ctx).reduce_scatter(src, dst, m, dt, rop));
                             } else {
                               ring_reduce_scatter_out(ctx, src, work, dst, m, dt, rop);
                             }
                           }),
                wait_of(async_op), {in, buf});
}

c10::intrusive_ptr<Work> Comm::all_gather(const at::Tensor& out, const at::Tensor& in,
                                          const std::string& algo, bool async_op) {
  constexpr const char* kOp = "all_gather";
  check_open(kOp);
  check_tensor(out, "output", kOp);
  check_tensor(in, "input", kOp);
  check_scatter_sizes(out, "output", in, "input", size_, kOp);
  const DType dt = to_dtype(in.scalar_type(), "input");
  const std::string a = pick(algo, kOp, out.nbytes(), false);
  const size_t es = in.element_size();
  const size_t m = in.numel();
  const void* src = in.data_ptr();
  void* dst = out.data_ptr();
  return launch(kOp, {out},
                collective(header(CollKind::kAllGather, m, int32_t(dt), -1, -1, algo_kind(a)),
                           [=](const Context& ctx) {
                             if (a == "nccl") {
                               ctx.transport.wait(native(ctx).all_gather(src, dst, m, dt));
                             } else {
                               ring_all_gather_out(ctx, src, dst, m, es);
                             }
                           }),
                wait_of(async_op), {in});
}

c10::intrusive_ptr<Work> Comm::broadcast(const at::Tensor& t, int src, const std::string& algo,
                                         bool async_op) {
  constexpr const char* kOp = "broadcast";
  check_open(kOp);
  check_tensor(t, "tensor", kOp);
  check_peer(src, "src", kOp, rank_, size_, /*allow_self=*/true);
  const DType dt = to_dtype(t.scalar_type(), "tensor");
  const std::string a = pick(algo, kOp, t.nbytes(), false);
  void* data = t.data_ptr();
  const size_t bytes = t.nbytes();
  return launch(kOp, {t},
                collective(header(CollKind::kBroadcast, size_t(t.numel()), int32_t(dt), -1, src,
                                  algo_kind(a)),
                           [=](const Context& ctx) {
                             if (a == "nccl") {
                               ctx.transport.wait(native(ctx).broadcast(data, bytes, src));
                             } else {
                               chain_broadcast(ctx, data, bytes, src);
                             }
                           }),
                wait_of(async_op));
}

c10::intrusive_ptr<Work> Comm::send(const at::Tensor& t, int dst, bool async_op) {
  constexpr const char* kOp = "send";
  check_open(kOp);
  check_tensor(t, "tensor", kOp);
  check_peer(dst, "dst", kOp, rank_, size_, /*allow_self=*/false);
  return launch_p2p(kOp, {t}, {P2POp{P2POp::kSend, t.data_ptr(), size_t(t.nbytes()), dst}},
                    wait_of(async_op));
}

c10::intrusive_ptr<Work> Comm::recv(const at::Tensor& t, int src, bool async_op) {
  constexpr const char* kOp = "recv";
  check_open(kOp);
  check_tensor(t, "tensor", kOp);
  check_peer(src, "src", kOp, rank_, size_, /*allow_self=*/false);
  return launch_p2p(kOp, {t}, {P2POp{P2POp::kRecv, t.data_ptr(), size_t(t.nbytes()), src}},
                    wait_of(async_op));
}

c10::intrusive_ptr<Work> Comm::batch_p2p(const std::vector<TensorP2P>& reqs) {
  constexpr const char* kOp = "batch_isend_irecv";
  check_open(kOp);
  std::vector<P2POp> ops;
  std::vector<at::Tensor> tensors;
  for (const auto& q : reqs) {
    check_tensor(q.tensor, "tensor", kOp);
    check_peer(q.peer, "peer", kOp, rank_, size_, /*allow_self=*/false);
    ops.push_back({q.send ? P2POp::kSend : P2POp::kRecv, q.tensor.data_ptr(),
                   static_cast<size_t>(q.tensor.nbytes()), q.peer});
    tensors.push_back(q.tensor);
  }
  return launch_p2p(kOp, tensors, ops, Wait::kAsync);
}

std::unique_ptr<Comm> Comm::split(int color, int key, int64_t timeout_ms) {
  CallGuard guard(*this, "split");
  check_open("split");
  CommOptions options = options_;
  options.timeout_ms = timeout_ms;
  check_options(options);
  auto exec = exec_->split(color, key, options);
  if (!exec) return nullptr;
  return std::make_unique<Comm>(std::move(exec), options);
}

std::string Comm::register_tensor(const at::Tensor& t) {
  constexpr const char* kOp = "register_tensor";
  check_open(kOp);
  check_tensor(t, "tensor", kOp);
  if (exec_->symmetric_domain() == 0) {
    throw UsageError(join_msg({kOp,
                               ": symmetric memory needs transport='shm' (ranks of one host "
                               "sharing memory); this communicator runs on ",
                               transport_name_}));
  }
  c10::Storage storage = t.storage();
  const int me = rank_;
  auto why = std::make_shared<std::string>();
  // Inside a Future callback this op runs at once, ahead of async ops the
  // caller queued with the tensor's old address: decline (on every rank
  // alike, through the outcome).
  const std::string refuse =
      exec_->on_own_thread()
          ? "register_tensor was called inside a Future callback (on the worker thread), "
            "where ops queued earlier may still hold the tensor's address"
          : "";
  launch(kOp, {},
         collective(header(CollKind::kRegister, storage.nbytes(), -1, -1, -1, AlgoKind::kNone),
                    [=](const Context& ctx) {
                      move_into_symmetric(*ctx.transport.shared_buffers(), storage, me, why.get(),
                                          refuse);
                    }),
         Wait::kSync, {t});
  return *why;
}

bool Comm::offers_to_adopt(const at::Tensor& t, bool offer) {
  if (exec_->symmetric_domain() == 0 || adopt_failed_->load() || !t.has_storage()) return false;
  if (!offer && !adopt_symmetric_) return false;
  // The caller waits for the op's decision: never on the worker itself (a
  // Future callback), which would wait for its own queue.
  if (exec_->on_own_thread()) return false;
  const c10::Storage& storage = t.storage();
  const size_t bytes = storage.nbytes();
  if (bytes == 0 || t.data_ptr() != storage.data() || t.nbytes() != bytes ||
      !storage_refusal(storage).empty() || declined_->contains(storage.unsafeGetStorageImpl())) {
    return false;
  }
  if (offer) return true;  // the caller knows the tensor lives on (all_reduce(register=True))
  // adopt_symmetric: big enough, and reduced before by this communicator and
  // still alive: a buffer the caller keeps and reduces again (DDP's
  // buckets), not a temporary.
  if (bytes < kAdoptMinBytes) return false;
  if (seen_.contains(storage.unsafeGetStorageImpl())) return true;
  seen_.add(storage);
  return false;
}

bool Comm::is_registered(const at::Tensor& t) const {
  return exec_ && symmetric_region_of(t, exec_->symmetric_domain()) != nullptr;
}

c10::intrusive_ptr<Work> Comm::barrier(bool async_op) {
  return launch("barrier", {},
                collective(header(CollKind::kBarrier, 0),
                           [](const Context& ctx) { dissemination_barrier(ctx); }),
                async_op ? Wait::kAsync : Wait::kHost);
}

}  // namespace pycomm
