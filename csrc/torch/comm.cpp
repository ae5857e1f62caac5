#include "comm.h"

#include <Python.h>  // ~Comm: let go of the GIL while closing
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <limits>
#include <optional>

#include "../core/huge_pages.h"
#include "call_guard.h"

namespace pycomm {

// ---------------------------------------------------------------- Comm

namespace {

// This process's pid without a system call per op (Comm::forked runs on
// every call): cached, and refreshed in every child that fork() makes
// (pthread_atfork), the only way it changes under a running process.
std::atomic<long> g_pid{0};
void refresh_pid() { g_pid.store(static_cast<long>(::getpid()), std::memory_order_relaxed); }
long current_pid() {
  static const bool registered = [] {
    pthread_atfork(nullptr, nullptr, refresh_pid);
    refresh_pid();
    return true;
  }();
  (void)registered;
  return g_pid.load(std::memory_order_relaxed);
}

}  // namespace

Comm::Comm(std::unique_ptr<Executor> executor, CommOptions options)
    : exec_(std::move(executor)),
      options_(std::move(options)),
      rank_(exec_->rank()),
      size_(exec_->world_size()),
      transport_name_(exec_->transport_name()),
      device_(exec_->device()),
      pid_(current_pid()),
      symmetric_(std::make_shared<SymmetricMemory>(exec_->symmetric_domain(), rank_)) {
  check_options(options_);
  // auto always takes direct on shm: it beats or ties the ring at every
  // size recorded (benchmarks/allreduce/README.md); the ring stays available
  // as algo="ring".
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

bool Comm::forked() const { return current_pid() != pid_; }

void Comm::check_open(const char* op) const {
  if (forked()) {
    throw std::runtime_error(
        cat(op, ": this communicator was created in process ", pid_,
            " and cannot be used in a forked child (pid ", static_cast<long>(::getpid()),
            "): its threads and connections belong to the parent. Call pycomm.init() in the "
            "child (or use the 'spawn' start method)"));
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

void Comm::set_check(bool on) {
  options_.check = on;
  if (hierarchy_) hierarchy_->set_check(on);
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
    (void)exec_.release();                // its destructor would touch the parent's threads too
    if (hierarchy_) hierarchy_->close();  // leaks them likewise
    return;
  }
  // This executor first: its close drains the one worker, running every op
  // queued (composed ones too, while the parts are open); then the parts.
  exec_->close();
  std::exception_ptr parts_error;
  if (hierarchy_) {
    // Nothing runs any more: an abort from now on (another thread) stays
    // with the executor it reaches, whose transport may be going.
    for (Executor* e :
         {exec_.get(), hierarchy_->intra().exec_.get(), hierarchy_->inter().exec_.get()}) {
      e->set_on_abort(nullptr);
    }
    try {
      hierarchy_->close();
    } catch (...) {
      parts_error = std::current_exception();
    }
  }
  // A failure nobody waited for (an async op whose Work was dropped) must
  // not vanish: close() reports it, after releasing everything.
  if (exec_->aborted() && !user_aborted_ && !is_part_ && !failure_reported_->load()) {
    throw CommError(
        join_msg({"close: an operation failed and aborted the communicator, and "
                  "no call has raised it yet (",
                  exec_->abort_reason(), "); its resources are released"}));
  }
  if (parts_error) std::rethrow_exception(parts_error);
}

void Comm::abort(const std::string& why) {
  if (forked()) return;  // the parent's transport: not ours to abort
  if (!exec_->aborted()) user_aborted_ = true;
  exec_->abort(why);
}

Body Comm::collective(OpHeader h, Body body) {
  if (const ComposedWire* w = composed_wire(); w && !is_quantized(h.algo)) {
    h.wire = w->kind;  // an exact step of a composed quantized all-reduce (none is rooted)
    if (h.root < 0) h.root = w->block;
  }
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
// The transport's own collectives (algo="nccl"); pick() only returns kNative
// when the transport has them.
NativeCollectives& native(const Context& ctx) { return *ctx.transport.native(); }
}  // namespace

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

void Comm::advise_filled(const std::vector<at::Tensor>& outputs) {
  for (const auto& t : outputs) {
    // Not pinned memory: the CUDA driver's mapping is best left whole.
    if (t.is_cpu() && !t.is_pinned()) advise_huge_pages(t.data_ptr(), t.nbytes());
  }
}

c10::intrusive_ptr<Work> Comm::launch_p2p(const char* op, std::vector<at::Tensor> tensors,
                                          std::vector<P2POp> ops, Wait wait) {
  for (auto& o : ops) o.channel = kUser;
  return start(op, tensors, wait, [&](const c10::intrusive_ptr<Work>& work) {
    // A single receive's sender: known, or set by the transport once matched.
    if (ops.size() == 1 && ops[0].kind == P2POp::kRecv) {
      work->set_source_rank(ops[0].peer);
      if (ops[0].peer == kAnySource) ops[0].source = work->source_rank_slot();
    }
    exec_->run_p2p(work, std::move(ops), wait, std::move(tensors));
  });
}

DType Comm::check_chunked(const at::Tensor& out, const at::Tensor& in, bool output_whole,
                          const char* op) const {
  check_open(op);
  check_tensor(out, "output", op);
  check_tensor(in, "input", op);
  if (output_whole) {
    check_scatter_sizes(out, "output", in, "input", size_, op);
  } else {
    check_scatter_sizes(in, "input", out, "output", size_, op);
  }
  return to_dtype(in.scalar_type(), "input");
}

c10::intrusive_ptr<Work> Comm::reduce_scatter(const at::Tensor& out, const at::Tensor& in, int op,
                                              const std::string& algo, bool async_op) {
  constexpr const char* kOp = "reduce_scatter";
  if (hierarchy_ && hierarchy_->takes_chunked(in, out, algo, op)) {
    auto h = hierarchy_;
    return compose(
        kOp, {out}, [h, out, in, op, algo] { h->reduce_scatter(out, in, op, algo); }, async_op);
  }
  const DType dt = check_chunked(out, in, /*output_whole=*/false, kOp);
  const ReduceOp rop = to_op(op, dt, kOp);
  const AlgoKind kind = pick(algo, CollKind::kReduceScatter, in.nbytes(), false);
  const size_t m = out.numel();
  const void* src = in.data_ptr();
  void* dst = out.data_ptr();
  // The ring reduces in place, so it works on a copy of the input.
  at::Tensor buf = kind == AlgoKind::kRing ? exec_->empty_like(in) : at::Tensor();
  void* work = buf.defined() ? buf.data_ptr() : nullptr;
  return launch(
      kOp, {out},
      collective(OpHeader::of(CollKind::kReduceScatter, size_t(in.numel()), int32_t(dt),
                              int32_t(rop), -1, kind),
                 [=](const Context& ctx) {
                   switch (kind) {
                     case AlgoKind::kNative:
                       ctx.transport.wait(native(ctx).reduce_scatter(src, dst, m, dt, rop));
                       break;
                     case AlgoKind::kDirect:
                       direct_reduce_scatter(ctx, src, dst, m, dt, rop);
                       break;
                     default: ring_reduce_scatter_out(ctx, src, work, dst, m, dt, rop); break;
                   }
                 }),
      wait_of(async_op), {in, buf});
}

c10::intrusive_ptr<Work> Comm::all_gather(const at::Tensor& out, const at::Tensor& in,
                                          const std::string& algo, bool async_op) {
  constexpr const char* kOp = "all_gather";
  if (hierarchy_ && hierarchy_->takes_chunked(out, in, algo)) {
    auto h = hierarchy_;
    return compose(kOp, {out}, [h, out, in, algo] { h->all_gather(out, in, algo); }, async_op);
  }
  const DType dt = check_chunked(out, in, /*output_whole=*/true, kOp);
  const AlgoKind kind = pick(algo, CollKind::kAllGather, out.nbytes(), false);
  const size_t es = in.element_size();
  const size_t m = in.numel();
  const void* src = in.data_ptr();
  void* dst = out.data_ptr();
  advise_filled({out});
  return launch(kOp, {out},
                collective(OpHeader::of(CollKind::kAllGather, m, int32_t(dt), -1, -1, kind),
                           [=](const Context& ctx) {
                             switch (kind) {
                               case AlgoKind::kNative:
                                 ctx.transport.wait(native(ctx).all_gather(src, dst, m, dt));
                                 break;
                               case AlgoKind::kBruck: bruck_all_gather(ctx, src, dst, m, es); break;
                               default: ring_all_gather_out(ctx, src, dst, m, es); break;
                             }
                           }),
                wait_of(async_op), {in});
}

c10::intrusive_ptr<Work> Comm::broadcast(const at::Tensor& t, int src, const std::string& algo,
                                         bool async_op) {
  constexpr const char* kOp = "broadcast";
  if (hierarchy_ && src >= 0 && src < size_ && hierarchy_->takes(t, algo)) {
    auto h = hierarchy_;
    return compose(kOp, {t}, [h, t, src, algo] { h->broadcast(t, src, algo); }, async_op);
  }
  check_open(kOp);
  check_tensor(t, "tensor", kOp);
  check_peer(src, "src", kOp, rank_, size_, /*allow_self=*/true);
  const DType dt = to_dtype(t.scalar_type(), "tensor");
  const AlgoKind kind = pick(algo, CollKind::kBroadcast, t.nbytes(), false);
  void* data = t.data_ptr();
  const size_t bytes = t.nbytes();
  return launch(
      kOp, {t},
      collective(OpHeader::of(CollKind::kBroadcast, size_t(t.numel()), int32_t(dt), -1, src, kind),
                 [=](const Context& ctx) {
                   switch (kind) {
                     case AlgoKind::kNative:
                       ctx.transport.wait(native(ctx).broadcast(data, bytes, src));
                       break;
                     default: chain_broadcast(ctx, data, bytes, src); break;
                   }
                 }),
      wait_of(async_op));
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
  if (!symmetric_->available()) {
    throw UsageError(join_msg({kOp,
                               ": symmetric memory needs transport='shm' (ranks of one host "
                               "sharing memory); this communicator runs on ",
                               transport_name_}));
  }
  c10::Storage storage = t.storage();
  auto why = std::make_shared<std::string>();
  // Inside a Future callback this op runs at once, ahead of async ops the
  // caller queued with the tensor's old address: decline (on every rank
  // alike, through the outcome).
  const std::string refuse =
      exec_->on_own_thread()
          ? "register_tensor was called inside a Future callback (on the worker thread), "
            "where ops queued earlier may still hold the tensor's address"
          : "";
  auto symmetric = symmetric_;
  launch(
      kOp, {},
      collective(OpHeader::of(CollKind::kRegister, storage.nbytes(), -1, -1, -1, AlgoKind::kNone),
                 [=](const Context& ctx) {
                   symmetric->move(*ctx.transport.shared_buffers(), storage, why.get(), refuse);
                 }),
      Wait::kSync, {t});
  return *why;
}

bool Comm::is_registered(const at::Tensor& t) const {
  return exec_ && symmetric_->region_of(t) != nullptr;
}

c10::intrusive_ptr<Work> Comm::barrier(bool async_op) {
  Body body = collective(OpHeader::of(CollKind::kBarrier, 0),
                         [](const Context& ctx) { dissemination_barrier(ctx); });
  const Wait wait = async_op ? Wait::kAsync : Wait::kHost;
  return start("barrier", {}, wait, [&](const c10::intrusive_ptr<Work>& work) {
    work->set_waits_on_host(true);  // its Work.wait() too, on every device
    exec_->run(work, std::move(body), wait, {});
  });
}

}  // namespace pycomm
