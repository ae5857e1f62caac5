// The GPU communicator behind pycomm.Communicator (transport "nccl"): the same
// Python methods and signatures as Comm (bindings.cpp), with ProcessGroupNCCL
// stream semantics. Compiled only into the CUDAExtension (PYCOMM_WITH_CUDA);
// in the CPU build this file is empty.
//
// Streams (see csrc/cuda/streams.h). Each operation
//   1. records an event on the caller's current stream; the communicator's
//      reduction and comm streams wait for it (CudaStreams::begin);
//   2. enqueues the algorithm (csrc/core, or the native NCCL collective) on
//      those streams and returns without blocking the host;
//   3. records a `done` event on the reduction stream, which every transfer
//      group of the operation was joined into, and records the tensors on both
//      streams for the caching allocator (recordStream), so memory the caller
//      frees is not reused before the communicator is done with it;
//   4. sync op: the caller's current stream waits for `done` (no host block);
//      async op: Work.wait() does that. Work.get_future() completes on the
//      host once `done` has (a watchdog thread polls the events in order).
//
// User point-to-point (send/recv/isend/irecv/batch_isend_irecv, channel
// kUser) runs on a lane of its own, like ProcessGroupNCCL's p2p: a second NCCL
// communicator split from the first at construction (every rank constructs
// its CudaComm at the same point, so the collective split is matched), with
// its own CudaStreams (the NCCL group on its comm stream, joined into its
// reduction stream, which carries no kernels) and NcclTransport. Steps 1-4
// above are the same, on the lane's streams. So NCCL can never pair a user
// send with a ring step's receive, and a pending irecv blocks neither the
// GPU work nor the Works of later collectives. The ring algorithms' own
// transfers (kCollective) stay on the first communicator. The two lanes are
// ordered only through the caller's stream. One lock serialises enqueueing
// on both communicators (NCCL forbids concurrent calls on communicators of
// one device). As with ProcessGroupNCCL, NCCL connects a pair of ranks lazily
// on its first transfer, which needs the peer to post its side too: until
// then the enqueue waits on the host (bounded by the timeout).
//
// Timeouts / dead peers. The watchdog also checks ncclCommGetAsyncError on
// both communicators while work is pending and enforces the timeout per
// operation; on an error or timeout it aborts both NCCL communicators
// (kernels exit, streams drain) and fails every pending Work with CommError;
// later calls raise. Works complete in order per lane.
//
// CUDA graph capture. Capturing a collective should work but is untested:
// begin() forks both internal streams off the capturing stream by an event and
// `done` joins them back (the fork/join pattern capture supports), NCCL
// ncclSend/ncclRecv and collectives are capturable (NCCL >= 2.9), our kernels
// and cudaMemcpyAsync are, and the nonblocking-NCCL polling is host-only. What
// cannot be captured is host waiting: under capture the watchdog (timeouts,
// get_future) is skipped and the Work completes at once, and barrier() raises.
// Replays are ordered only with the stream they are launched on, not with
// eager calls on the same communicator (which share its scratch buffer).
#ifdef PYCOMM_WITH_CUDA

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <sstream>
#include <thread>

#include "../core/algorithms.h"
#include "../cuda/check.h"
#include "../cuda/cuda_reducer.h"
#include "../cuda/nccl_transport.h"
#include "../cuda/reduce_kernels.h"
#include "../cuda/streams.h"
#include "comm.h"

namespace py = pybind11;

namespace pycomm {
namespace {

using Clock = std::chrono::steady_clock;

// op -> [(max_bytes, algo), ...]: the first rule with bytes <= max_bytes (or
// max_bytes < 0, no limit) picks the algorithm of algo="auto".
using AutoTable = std::map<std::string, std::vector<std::pair<int64_t, std::string>>>;

class CudaWork final : public Work {
 public:
  CudaWork(std::string op, uint64_t seq, std::vector<at::Tensor> outputs, int device)
      // No devices for the Future: it is completed on the host only after the
      // GPU work has finished, so its value needs no stream synchronisation.
      : Work(std::move(op), seq, std::move(outputs)), device_(device), done_(cuda::make_event()) {}
  ~CudaWork() override { (void)cudaEventDestroy(done_); }

  // Stream semantics, like ProcessGroupNCCL's WorkNCCL::wait(): the caller's
  // current stream waits for the operation; the host does not block. Raises
  // if the operation has already failed.
  void wait() override {
    auto fut = future();
    if (fut->completed() && fut->hasError()) std::rethrow_exception(fut->exception_ptr());
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    PYCOMM_CUDA_CHECK(cudaStreamWaitEvent(
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream(), done_, 0));
  }

  cudaEvent_t done() const { return done_; }

 private:
  int device_;
  cudaEvent_t done_;
};

class CudaComm {
 public:
  CudaComm(const std::string& unique_id, int rank, int world_size, int device,
           CommOptions options, AutoTable table)
      : options_(std::move(options)),
        rank_(rank),
        size_(world_size),
        device_(device),
        table_(std::move(table)) {
    if (options_.slice_bytes < 64) throw py::value_error("slice_bytes must be at least 64");
    if (options_.timeout_ms <= 0) throw py::value_error("timeout must be positive");
    options_.device = "cuda:" + std::to_string(device);
    const auto timeout = std::chrono::milliseconds(options_.timeout_ms);
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    nccl_ = std::make_unique<cuda::NcclComm>(unique_id, rank, world_size, device, timeout);
    // The user p2p lane (see the top). Split now, not lazily on the first
    // p2p: the split is collective, and this point is the same on all ranks.
    p2p_nccl_ = std::make_unique<cuda::NcclComm>(*nccl_, "pycomm-p2p");
    streams_ = std::make_unique<cuda::CudaStreams>(device);
    reducer_ = std::make_unique<cuda::CudaReducer>(*streams_);
    transport_ = std::make_unique<cuda::NcclTransport>(*nccl_, *streams_, kCollective);
    p2p_streams_ = std::make_unique<cuda::CudaStreams>(device);
    p2p_reducer_ = std::make_unique<cuda::CudaReducer>(*p2p_streams_);
    p2p_transport_ = std::make_unique<cuda::NcclTransport>(*p2p_nccl_, *p2p_streams_, kUser);
    {
      // Allocated for the reduction stream (like reduce_scatter's buffer): on
      // the caller's stream the allocator could hand out a block whose last
      // user there is still pending, and our non-blocking streams would not
      // be ordered after it.
      c10::cuda::CUDAStreamGuard g(reduction_stream());
      scratch_ = at::empty({2 * options_.slice_bytes + 64},
                           at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
    }
    record_on_streams(scratch_, *streams_);
    watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  ~CudaComm() {
    try {
      close();
    } catch (...) {
    }
  }

  int rank() const { return rank_; }
  int world_size() const { return size_; }
  std::string transport_name() const { return "nccl"; }
  std::string device() const { return options_.device; }
  int64_t slice_bytes() const { return options_.slice_bytes; }
  uint64_t seq() const { return seq_; }
  bool closed() const { return closed_; }
  bool aborted() const {
    return (nccl_ && nccl_->aborted()) || (p2p_nccl_ && p2p_nccl_->aborted());
  }

  c10::intrusive_ptr<Work> all_reduce(const at::Tensor& t, int op, const std::string& algo,
                                      bool async_op, int wire_dtype) {
    constexpr const char* kOp = "all_reduce";
    check_open(kOp);
    check_cuda_tensor(t, "tensor", kOp);
    const DType dt = to_dtype(t.scalar_type(), "tensor");
    const ReduceOp rop = to_op(op, dt, kOp);
    const std::optional<DType> wire = to_wire_dtype(wire_dtype, dt, kOp);
    if (wire && algo == "nccl") {
      throw UsageError("all_reduce: wire_dtype needs algo='ring' or 'auto', not 'nccl' "
                       "(NCCL's all-reduce sends the tensor's own dtype)");
    }
    // A wire dtype is a ring feature: auto takes the ring for it.
    const bool native = pick(algo, kOp, t.nbytes()) == "nccl" && !wire;
    void* data = t.data_ptr();
    const size_t count = t.numel();
    return launch(kOp, {t}, {},
                  [=](const Context& ctx, cuda::NcclTransport& tr) {
                    if (wire) {
                      ring_all_reduce_wire(ctx, static_cast<float*>(data), count, *wire, rop);
                    } else if (native) {
                      tr.wait(tr.all_reduce(data, data, count, dt, rop));
                    } else {
                      ring_all_reduce(ctx, data, count, dt, rop);
                    }
                  },
                  async_op);
  }

  c10::intrusive_ptr<Work> reduce_scatter(const at::Tensor& out, const at::Tensor& in, int op,
                                          const std::string& algo, bool async_op) {
    constexpr const char* kOp = "reduce_scatter";
    check_open(kOp);
    check_cuda_tensor(out, "output", kOp);
    check_cuda_tensor(in, "input", kOp);
    check_scatter_sizes(in, "input", out, "output", size_, kOp);
    const DType dt = to_dtype(in.scalar_type(), "input");
    const ReduceOp rop = to_op(op, dt, kOp);
    const bool native = pick(algo, kOp, in.nbytes()) == "nccl";
    const size_t m = out.numel(), es = dtype_size(dt);
    const int r = rank_;
    if (native) {
      return launch(kOp, {out}, {in},
                    [=](const Context&, cuda::NcclTransport& tr) {
                      tr.wait(tr.reduce_scatter(in.data_ptr(), out.data_ptr(), m, dt, rop));
                    },
                    async_op);
    }
    // The ring reduces in place: it works on a copy of the input, allocated
    // for the reduction stream (where the copy is made).
    at::Tensor buf;
    {
      c10::cuda::CUDAStreamGuard g(reduction_stream());
      buf = at::empty_like(in);
    }
    return launch(kOp, {out}, {in, buf},
                  [=](const Context& ctx, cuda::NcclTransport&) {
                    ctx.reducer.copy(buf.data_ptr(), in.data_ptr(), in.nbytes());
                    ring_reduce_scatter(ctx, buf.data_ptr(), Chunks{m, 0}, dt, rop);
                    ctx.reducer.copy(out.data_ptr(),
                                     static_cast<char*>(buf.data_ptr()) + r * m * es, m * es);
                  },
                  async_op);
  }

  c10::intrusive_ptr<Work> all_gather(const at::Tensor& out, const at::Tensor& in,
                                      const std::string& algo, bool async_op) {
    constexpr const char* kOp = "all_gather";
    check_open(kOp);
    check_cuda_tensor(out, "output", kOp);
    check_cuda_tensor(in, "input", kOp);
    check_scatter_sizes(out, "output", in, "input", size_, kOp);
    const DType dt = to_dtype(in.scalar_type(), "input");
    const bool native = pick(algo, kOp, out.nbytes()) == "nccl";
    const size_t es = in.element_size(), m = in.numel();
    const int r = rank_;
    return launch(kOp, {out}, {in},
                  [=](const Context& ctx, cuda::NcclTransport& tr) {
                    if (native) {
                      tr.wait(tr.all_gather(in.data_ptr(), out.data_ptr(), m, dt));
                      return;
                    }
                    char* dst = static_cast<char*>(out.data_ptr()) + r * m * es;
                    ctx.reducer.copy(dst, in.data_ptr(), m * es);
                    ring_all_gather(ctx, out.data_ptr(), Chunks{m, 0}, es);
                  },
                  async_op);
  }

  c10::intrusive_ptr<Work> broadcast(const at::Tensor& t, int src, const std::string& algo,
                                     bool async_op) {
    constexpr const char* kOp = "broadcast";
    check_open(kOp);
    check_cuda_tensor(t, "tensor", kOp);
    check_peer(src, "src", kOp, rank_, size_, /*allow_self=*/true);
    const bool native = pick(algo, kOp, t.nbytes()) == "nccl";
    void* data = t.data_ptr();
    const size_t bytes = t.nbytes();
    return launch(kOp, {t}, {},
                  [=](const Context& ctx, cuda::NcclTransport& tr) {
                    if (native) {
                      tr.wait(tr.broadcast(data, bytes, src));
                    } else {
                      chain_broadcast(ctx, data, bytes, src);
                    }
                  },
                  async_op);
  }

  c10::intrusive_ptr<Work> send(const at::Tensor& t, int dst, bool async_op) {
    return p2p("send", P2POp::kSend, t, dst, "dst", async_op);
  }
  c10::intrusive_ptr<Work> recv(const at::Tensor& t, int src, bool async_op) {
    return p2p("recv", P2POp::kRecv, t, src, "src", async_op);
  }

  c10::intrusive_ptr<Work> batch_p2p(const std::vector<TensorP2P>& reqs) {
    constexpr const char* kOp = "batch_isend_irecv";
    check_open(kOp);
    std::vector<P2POp> ops;
    std::vector<at::Tensor> tensors;
    for (const auto& q : reqs) {
      check_cuda_tensor(q.tensor, "tensor", kOp);
      check_peer(q.peer, "peer", kOp, rank_, size_, /*allow_self=*/false);
      ops.push_back({q.send ? P2POp::kSend : P2POp::kRecv, q.tensor.data_ptr(),
                     static_cast<size_t>(q.tensor.nbytes()), q.peer, kUser});
      tensors.push_back(q.tensor);
    }
    return launch(kOp, tensors, {},
                  [ops](const Context&, cuda::NcclTransport& tr) {
                    tr.exchange(ops.data(), ops.size());
                  },
                  /*async_op=*/true, kUser);
  }

  // Blocks the host until every rank has entered (like ProcessGroupNCCL).
  void barrier() {
    if (capturing()) throw py::value_error("barrier: not allowed during CUDA graph capture");
    auto w = launch("barrier", {}, {},
                    [](const Context& ctx, cuda::NcclTransport&) { dissemination_barrier(ctx); },
                    /*async_op=*/true);
    auto* cw = static_cast<CudaWork*>(w.get());
    nccl_->host_wait(cw->done(), "barrier");  // aborts + throws on error / timeout
    w->future()->wait();
    if (w->future()->hasError()) std::rethrow_exception(w->future()->exception_ptr());
  }

  // Waits for pending work (bounded by the timeout: the watchdog aborts),
  // then flushes and destroys both NCCL communicators. Idempotent.
  void close() {
    if (closed_.exchange(true)) return;
    {
      std::lock_guard<std::mutex> lk(wd_mu_);
      wd_stop_ = true;
    }
    wd_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    std::lock_guard<std::mutex> lk(enqueue_mu_);
    scratch_.reset();  // after recordStream: freed once our streams pass this point
    // The split-off communicator first, on every rank in the same order (a
    // destroy may synchronise the ranks of a host). A failure (which has
    // aborted that communicator) does not keep the other from closing.
    std::exception_ptr err;
    for (cuda::NcclComm* c : {p2p_nccl_.get(), nccl_.get()}) {
      try {
        if (c) c->destroy();
      } catch (...) {
        if (!err) err = std::current_exception();
      }
    }
    transport_.reset();
    p2p_transport_.reset();
    reducer_.reset();
    p2p_reducer_.reset();
    streams_.reset();
    p2p_streams_.reset();
    if (err) std::rethrow_exception(err);
  }

  // Aborts both communicators (idempotent, any thread).
  void abort(const std::string& why) {
    if (nccl_) nccl_->abort(why);
    if (p2p_nccl_) p2p_nccl_->abort(why);
    wd_cv_.notify_all();
  }

 private:
  using Body = std::function<void(const Context&, cuda::NcclTransport&)>;

  struct Pending {
    c10::intrusive_ptr<CudaWork> work;
    Clock::time_point start;
  };
  static constexpr int kNumLanes = 2;  // indexed by Channel: kCollective, kUser

  c10::cuda::CUDAStream torch_stream(cudaStream_t s) const {
    return c10::cuda::getStreamFromExternal(s, static_cast<c10::DeviceIndex>(device_));
  }
  c10::cuda::CUDAStream reduction_stream() const { return torch_stream(streams_->reduction()); }

  // Why the communicator was aborted (the first of the two to be aborted).
  std::string abort_reason() const {
    if (nccl_ && nccl_->aborted()) return nccl_->abort_reason();
    if (p2p_nccl_ && p2p_nccl_->aborted()) return p2p_nccl_->abort_reason();
    return "";
  }

  bool capturing() const {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    PYCOMM_CUDA_CHECK(cudaStreamIsCapturing(
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream(), &st));
    return st != cudaStreamCaptureStatusNone;
  }

  void record_on_streams(const at::Tensor& t, const cuda::CudaStreams& streams) {
    if (!t.defined() || !t.has_storage() || t.storage().data_ptr().get() == nullptr) return;
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(),
                                                  torch_stream(streams.reduction()));
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(),
                                                  torch_stream(streams.comm()));
  }

  void check_open(const char* op) const {
    if (closed_) throw std::runtime_error(join_msg({op, ": the communicator is closed"}));
    if (aborted()) {
      throw CommError(join_msg({op, ": the communicator was aborted earlier (", abort_reason(),
                                "); create a new one with pycomm.init()"}));
    }
  }

  void check_cuda_tensor(const at::Tensor& t, const char* arg, const char* op) const {
    check_tensor(t, arg, op, options_.device);
    if (t.device().index() != device_) {
      throw py::value_error(join_msg({op, ": ", arg, " is on ", t.device().str(),
                                      " but the communicator runs on ", options_.device}));
    }
  }

  std::string pick(const std::string& algo, const char* op, size_t bytes) const {
    if (algo == "ring" || algo == "nccl") return algo;
    if (algo != "auto") {
      throw py::value_error(
          join_msg({op, ": unknown algo '", algo, "' (expected 'auto', 'ring' or 'nccl')"}));
    }
    auto it = table_.find(op);
    if (it != table_.end()) {
      for (const auto& [max_bytes, a] : it->second) {
        if (max_bytes < 0 || bytes <= static_cast<size_t>(max_bytes)) return a;
      }
    }
    return "nccl";  // not in the table: the native baseline
  }

  c10::intrusive_ptr<Work> p2p(const char* op, P2POp::Kind kind, const at::Tensor& t, int peer,
                               const char* arg, bool async_op) {
    check_open(op);
    check_cuda_tensor(t, "tensor", op);
    check_peer(peer, arg, op, rank_, size_, /*allow_self=*/false);
    const P2POp p{kind, t.data_ptr(), static_cast<size_t>(t.nbytes()), peer, kUser};
    return launch(op, {t}, {},
                  [p](const Context&, cuda::NcclTransport& tr) { tr.exchange(&p, 1); },
                  async_op, kUser);
  }

  // Enqueues body on the lane of `channel`: kCollective (the collectives'
  // communicator, streams and scratch) or kUser (the user p2p lane: its
  // transport and streams only; no scratch).
  c10::intrusive_ptr<Work> launch(const char* op, std::vector<at::Tensor> outputs,
                                  std::vector<at::Tensor> inputs, const Body& body,
                                  bool async_op, Channel channel = kCollective) {
    std::lock_guard<std::mutex> lk(enqueue_mu_);  // one operation enqueues at a time
    check_open(op);
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    const cudaStream_t user =
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
    const bool in_capture = capturing();
    const uint64_t seq = ++seq_;
    auto work = c10::make_intrusive<CudaWork>(op, seq, outputs, device_);
    const bool p2p = channel == kUser;
    cuda::CudaStreams& streams = p2p ? *p2p_streams_ : *streams_;
    cuda::NcclTransport& transport = p2p ? *p2p_transport_ : *transport_;
    try {
      streams.begin(user);
      Context ctx{transport, p2p ? *p2p_reducer_ : *reducer_,
                  p2p ? nullptr : scratch_.data_ptr(),
                  p2p ? 0 : static_cast<size_t>(scratch_.nbytes()),
                  static_cast<size_t>(options_.slice_bytes)};
      body(ctx, transport);
      streams.record_done(work->done());
    } catch (const std::exception& e) {
      std::ostringstream msg;
      msg << op << " #" << seq << " on rank " << rank_ << " (nccl transport, world_size "
          << size_ << ", " << options_.device << ") failed: " << e.what();
      abort(msg.str());
      throw CommError(msg.str());
    }
    for (const auto& t : outputs) record_on_streams(t, streams);
    for (const auto& t : inputs) record_on_streams(t, streams);
    if (!async_op) PYCOMM_CUDA_CHECK(cudaStreamWaitEvent(user, work->done(), 0));
    if (in_capture) {
      work->complete();  // no host-side tracking of captured work (see the top)
    } else {
      {
        std::lock_guard<std::mutex> wl(wd_mu_);
        pending_[channel].push_back({work, Clock::now()});
      }
      wd_cv_.notify_one();
    }
    if (async_op) return work;
    return {};
  }

  void fail_all(const std::string& why) {
    std::deque<Pending> failed;
    {
      std::lock_guard<std::mutex> lk(wd_mu_);
      for (auto& lane : pending_) {
        failed.insert(failed.end(), lane.begin(), lane.end());
        lane.clear();
      }
    }
    for (auto& p : failed) {
      std::ostringstream msg;
      msg << p.work->op() << " #" << p.work->seq() << " on rank " << rank_ << " failed: " << why;
      p.work->fail(std::make_exception_ptr(CommError(msg.str())));
    }
  }

  // Completes each lane's Works in order as their `done` events pass (the
  // lanes independently: a pending irecv does not hold up the Works of later
  // collectives); enforces the timeout and surfaces NCCL's asynchronous
  // errors of both communicators.
  void watchdog_loop() {
    (void)cudaSetDevice(device_);
    const auto timeout = std::chrono::milliseconds(options_.timeout_ms);
    int idle_spins = 0;
    for (;;) {
      Pending front[kNumLanes];  // front[l].work is null when lane l is idle
      {
        std::unique_lock<std::mutex> lk(wd_mu_);
        auto idle = [&] { return pending_[kCollective].empty() && pending_[kUser].empty(); };
        wd_cv_.wait(lk, [&] { return wd_stop_ || !idle(); });
        if (idle()) return;  // stop requested and drained
        for (int l = 0; l < kNumLanes; ++l) {
          if (!pending_[l].empty()) front[l] = pending_[l].front();
        }
      }
      if (aborted()) {
        fail_all("the communicator was aborted (" + abort_reason() + ")");
        continue;
      }
      std::string err;
      bool progress = false;
      const Pending* waiting = nullptr;  // the first front still running
      try {
        for (int l = 0; l < kNumLanes && err.empty(); ++l) {
          const Pending& f = front[l];
          if (!f.work) continue;
          if (cuda::event_done(f.work->done())) {
            {
              std::lock_guard<std::mutex> lk(wd_mu_);
              pending_[l].pop_front();  // only this thread pops: f is still the front
            }
            f.work->complete();
            progress = true;
            continue;
          }
          if (waiting == nullptr) waiting = &f;
          if (Clock::now() - f.start > timeout) {
            std::ostringstream msg;
            msg << "timed out after " << options_.timeout_ms
                << " ms waiting for the GPU (a peer may be dead or not calling the same "
                   "operation); the communicator was aborted";
            err = msg.str();
            abort(f.work->op() + " #" + std::to_string(f.work->seq()) + ": " + err);
          }
        }
        if (err.empty() && waiting != nullptr) {
          const char* what = waiting->work->op().c_str();
          nccl_->check_async(what);
          p2p_nccl_->check_async(what);
        }
      } catch (const std::exception& e) {
        // check_async aborts its communicator before it throws; a CUDA error
        // from event_done does not; abort both here (idempotent): the Works
        // fail and the communicator must not look healthy with NCCL kernels
        // still queued.
        err = e.what();
        abort(err);
      }
      if (!err.empty()) {
        fail_all(err);
        continue;
      }
      if (progress) {
        idle_spins = 0;
        continue;
      }
      if (++idle_spins < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  CommOptions options_;
  int rank_, size_, device_;
  AutoTable table_;
  // The collectives' lane (kCollective) ...
  std::unique_ptr<cuda::NcclComm> nccl_;
  std::unique_ptr<cuda::CudaStreams> streams_;
  std::unique_ptr<cuda::CudaReducer> reducer_;
  std::unique_ptr<cuda::NcclTransport> transport_;
  // ... and the user p2p lane (kUser); its reducer only makes a Context.
  std::unique_ptr<cuda::NcclComm> p2p_nccl_;
  std::unique_ptr<cuda::CudaStreams> p2p_streams_;
  std::unique_ptr<cuda::CudaReducer> p2p_reducer_;
  std::unique_ptr<cuda::NcclTransport> p2p_transport_;
  at::Tensor scratch_;
  std::mutex enqueue_mu_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<bool> closed_{false};

  std::mutex wd_mu_;
  std::condition_variable wd_cv_;
  std::deque<Pending> pending_[kNumLanes];  // per Channel
  bool wd_stop_ = false;
  std::thread watchdog_;
};

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

}  // namespace

// Registers the GPU half of pycomm._C (called from bindings.cpp).
void bind_cuda(py::module_& m) {
  m.attr("WITH_CUDA") = true;
  m.attr("NCCL_VERSION") = NCCL_VERSION_CODE;  // the headers built against

  py::class_<CudaWork, Work, c10::intrusive_ptr<CudaWork>>(m, "CudaWork");

  py::class_<CudaComm>(m, "CudaComm")
      .def_property_readonly("rank", &CudaComm::rank)
      .def_property_readonly("world_size", &CudaComm::world_size)
      .def_property_readonly("transport", &CudaComm::transport_name)
      .def_property_readonly("device", &CudaComm::device)
      .def_property_readonly("slice_bytes", &CudaComm::slice_bytes)
      .def_property_readonly("seq", &CudaComm::seq)
      .def_property_readonly("closed", &CudaComm::closed)
      .def_property_readonly("aborted", &CudaComm::aborted)
      .def("all_reduce", &CudaComm::all_reduce, py::arg("tensor"), py::arg("op"),
           py::arg("algo"), py::arg("async_op"), py::arg("wire_dtype") = -1,
           py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter", &CudaComm::reduce_scatter, py::arg("output"), py::arg("input"),
           py::arg("op"), py::arg("algo"), py::arg("async_op"),
           py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &CudaComm::all_gather, py::arg("output"), py::arg("input"),
           py::arg("algo"), py::arg("async_op"), py::call_guard<py::gil_scoped_release>())
      .def("broadcast", &CudaComm::broadcast, py::arg("tensor"), py::arg("src"), py::arg("algo"),
           py::arg("async_op"), py::call_guard<py::gil_scoped_release>())
      .def("send", &CudaComm::send, py::arg("tensor"), py::arg("dst"), py::arg("async_op"),
           py::call_guard<py::gil_scoped_release>())
      .def("recv", &CudaComm::recv, py::arg("tensor"), py::arg("src"), py::arg("async_op"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "batch_p2p",
          [](CudaComm& c, const std::vector<std::tuple<bool, at::Tensor, int>>& reqs) {
            std::vector<TensorP2P> ops;
            for (const auto& [is_send, t, peer] : reqs) ops.push_back({is_send, t, peer});
            py::gil_scoped_release nogil;
            return c.batch_p2p(ops);
          },
          py::arg("ops"))
      .def("barrier", &CudaComm::barrier, py::call_guard<py::gil_scoped_release>())
      .def("close", &CudaComm::close, py::call_guard<py::gil_scoped_release>())
      .def("abort", &CudaComm::abort, py::arg("reason"),
           py::call_guard<py::gil_scoped_release>());

  m.def("nccl_unique_id", [] { return py::bytes(cuda::NcclComm::unique_id()); });
  m.def(
      "make_nccl_comm",
      [](const py::bytes& unique_id, int rank, int world_size, int device, int64_t timeout_ms,
         int64_t slice_bytes, AutoTable auto_table) {
        std::string id = unique_id;
        CommOptions opt;
        opt.timeout_ms = timeout_ms;
        opt.slice_bytes = slice_bytes;
        py::gil_scoped_release nogil;
        return std::make_unique<CudaComm>(id, rank, world_size, device, opt,
                                          std::move(auto_table));
      },
      py::arg("unique_id"), py::arg("rank"), py::arg("world_size"), py::arg("device"),
      py::arg("timeout_ms"), py::arg("slice_bytes"), py::arg("auto_table"));

  // The raw kernels on the caller's current stream: tests (bitwise equality
  // with reduce_/scale_ on CPU) and benchmarks/gpu (kernel bandwidth).
  m.def(
      "cuda_reduce_",
      [](at::Tensor dst, const at::Tensor& src, int op) {
        check_kernel_args(dst, &src, "cuda_reduce_");
        TORCH_CHECK_VALUE(op >= 0 && op < kNumReduceOps, "cuda_reduce_: unknown op");
        const DType dt = to_dtype(dst.scalar_type(), "dst");
        c10::cuda::CUDAGuard g(dst.device());
        cuda::launch_reduce(dst.data_ptr(), dst.data_ptr(), src.data_ptr(), dst.numel(), dt,
                            static_cast<ReduceOp>(op),
                            c10::cuda::getCurrentCUDAStream(dst.device().index()).stream());
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
                                  static_cast<ReduceOp>(op), factor,
                                  c10::cuda::getCurrentCUDAStream(dst.device().index()).stream());
      },
      py::arg("dst"), py::arg("src"), py::arg("op"), py::arg("factor"));
  m.def(
      "cuda_scale_",
      [](at::Tensor dst, double factor) {
        check_kernel_args(dst, nullptr, "cuda_scale_");
        const DType dt = to_dtype(dst.scalar_type(), "dst");
        TORCH_CHECK_VALUE(is_floating(dt), "cuda_scale_: floating dtype only");
        c10::cuda::CUDAGuard g(dst.device());
        cuda::launch_scale(dst.data_ptr(), dst.numel(), dt, factor,
                           c10::cuda::getCurrentCUDAStream(dst.device().index()).stream());
      },
      py::arg("dst"), py::arg("factor"));
}

}  // namespace pycomm

#endif  // PYCOMM_WITH_CUDA
