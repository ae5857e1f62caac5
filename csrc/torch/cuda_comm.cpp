// The GPU executor of pycomm::Comm (comm.h; transport "nccl"): the ops,
// their checks and their bodies are Comm's, shared with the CPU; this file
// only runs the bodies, with ProcessGroupNCCL's stream semantics. Compiled
// only into the CUDAExtension (PYCOMM_WITH_CUDA); in the CPU build it is empty.
//
// Streams (csrc/cuda/streams.h). Every op runs on one or more lanes (below);
// a lane is an NCCL communicator with its own comm and reduction streams.
// enqueue() takes an op through these steps:
//
//   caller's current stream --(1) event--+-------------------------+--(5) wait
//                                        |                         |    `done`
//                                        v                         |
//   each lane of the op:  comm stream       (2) NCCL groups --+    |
//                         reduction stream  (2) kernels <-----+    |
//                                        |                         |
//                                        | (3) join                |
//                                        v                         |
//   last lane:            reduction stream  (4) record `done` -----+
//                                        |
//   watchdog thread                      +--(6) poll `done`, in order per lane
//
//   1. An event on the caller's current stream; the lane's comm and
//      reduction streams wait for it (CudaStreams::begin).
//   2. The body (a csrc/core algorithm, or the native NCCL collective)
//      enqueues NCCL groups on the comm stream and reductions on the
//      reduction stream, which waits for each group, and returns without
//      blocking the host.
//   3. An op on several lanes (batch_isend_irecv) joins every other lane's
//      reduction stream into the last one's with an event.
//   4. `done` is recorded on the last lane's reduction stream, and the
//      tensors on every lane's streams for the caching allocator
//      (recordStream), so memory the caller frees is not reused before the
//      communicator is done with it.
//   5. Sync op: the caller's current stream waits for `done` (no host block);
//      async op: Work.wait() does that; a barrier (Wait::kHost) also blocks
//      the host until `done`. Work.get_future() is CUDA-aware, as
//      ProcessGroupNCCL's: it is completed right after the enqueue with an
//      event on the reduction stream, so value(), wait() and then() callbacks
//      are ordered on the caller's current stream and never block the host
//      (DDP comm hooks rely on it).
//   6. A watchdog thread polls the `done` events in order to complete
//      Work.is_completed() and enforce the timeout; an op that fails after
//      its enqueue fails its Work (wait() raises) and aborts the
//      communicator, but its future has already been completed.
//
// User point-to-point (send/recv/isend/irecv/batch_isend_irecv, channel
// kUser) runs on lanes of its own: two NCCL communicators split from the
// first at construction (every rank constructs its communicator at the same
// point, so the collective splits are matched), one per direction: rank r's
// sends to higher ranks and receives from lower ones go to the "up" lane, the
// others to the "down" lane. Each lane has its own CudaStreams (the NCCL group
// on its comm stream, joined into its reduction stream, which carries no
// kernels) and NcclTransport; steps 1-6 above are the same, on the lane's
// streams. So NCCL can never pair a user send with a ring step's receive, a
// pending irecv blocks neither the GPU work nor the Works of later
// collectives, and isend(x, p); irecv(y, p) on both ranks completes at any
// size: on each rank the send and the receive are on different lanes, so
// neither waits behind the other (on one stream, each rank's receive would
// queue behind its own send, which waits for the peer's receive). A
// batch_isend_irecv posts one group per lane it touches; its Work completes
// when both have. With three or more ranks, unbatched ops can still wait in
// a cycle once messages exceed what NCCL buffers (every rank isends to every
// peer before its first irecv: rank 1's receive from 0 queues behind its send
// to 2, which waits for rank 2's receive from 1, queued behind its receive
// from 0, which waits for rank 0's second send, queued behind its first); a
// batch_isend_irecv never does (NCCL runs a group's ops together). Like
// ProcessGroupNCCL's per-peer communicators, the lanes rely on kernels of
// different communicators running concurrently, launched in different orders
// on different ranks, which NCCL warns can deadlock where kernels serialise
// (CUDA_LAUNCH_BLOCKING=1, some MPS setups). The lanes are ordered only
// through the caller's stream.
// One lock per device serialises enqueueing on all communicators (NCCL forbids
// concurrent calls on communicators of one device). NCCL connects a pair of
// ranks lazily on its first transfer, and that enqueue waits on the host for
// the peer; construction therefore connects every pair on both p2p lanes
// with one group per lane (connect_p2p_lanes), so user p2p never waits there.
//
// Timeouts / dead peers. The watchdog also checks ncclCommGetAsyncError on
// every communicator while work is pending and enforces the timeout per
// operation; on an error or timeout it aborts all NCCL communicators
// (kernels exit, streams drain) and fails every pending Work with CommError;
// later calls raise. Works complete in order per lane.
//
// CUDA graph capture: begin() forks both internal streams off the capturing
// stream by an event and `done` joins them back (the fork/join pattern
// capture supports), NCCL ncclSend/ncclRecv and collectives are capturable
// (NCCL >= 2.9), our kernels and cudaMemcpyAsync are, and the
// nonblocking-NCCL polling is host-only. What cannot be captured is host
// waiting: under capture the watchdog (timeouts) is skipped and the Work
// completes at once, and barrier() raises. Replays are ordered only with the
// stream they are launched on, not with eager calls on the same
// communicator (which share its scratch buffer).
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
#include <functional>
#include <map>
#include <thread>

#include "../core/algorithms.h"
#include "../cuda/check.h"
#include "../cuda/cuda_reducer.h"
#include "../cuda/nccl_transport.h"
#include "../cuda/streams.h"
#include "comm.h"
#include "cuda_work.h"

namespace py = pybind11;

namespace pycomm {
namespace {

using Clock = std::chrono::steady_clock;

// The executor's lanes: the collectives' one and two for user p2p, one per
// direction (see the top). Each is one NCCL communicator with its streams.
enum LaneId : int { kLaneCollective = 0, kLaneUp = 1, kLaneDown = 2, kNumLanes = 3 };

// One NCCL communicator with its streams, reducer and transport.
struct Lane {
  std::unique_ptr<cuda::NcclComm> nccl;
  std::unique_ptr<cuda::CudaStreams> streams;
  std::unique_ptr<cuda::CudaReducer> reducer;
  std::unique_ptr<cuda::NcclTransport> transport;

  void open(std::unique_ptr<cuda::NcclComm> comm, int device, Channel channel) {
    nccl = std::move(comm);
    streams = std::make_unique<cuda::CudaStreams>(device);
    cuda::NcclComm* c = nccl.get();
    reducer = std::make_unique<cuda::CudaReducer>(
        *streams, [c](cudaEvent_t ev) { c->host_wait(ev, "a host read of GPU data"); });
    transport = std::make_unique<cuda::NcclTransport>(*nccl, *streams, channel);
  }
  void reset() {
    transport.reset();
    reducer.reset();
    streams.reset();
  }
};

class CudaExecutor final : public Executor {
 public:
  // Over the collectives' NCCL communicator `nccl` (from a unique id, or split
  // from another communicator's); splits the p2p lanes off it.
  CudaExecutor(std::unique_ptr<cuda::NcclComm> nccl, const CommOptions& options)
      : Executor(nccl->rank(), nccl->world_size(), "nccl"),
        device_(nccl->device()),
        timeout_(options.timeout_ms),
        slice_bytes_(static_cast<size_t>(options.slice_bytes)),
        enqueue_mu_(device_mutex(device_)) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    nccl->set_timeout(timeout_);
    const int device = device_;
    // The user p2p lanes (see the top). Split now, not lazily on the first
    // p2p: a split is collective, and this point is the same on all ranks.
    auto up = std::make_unique<cuda::NcclComm>(*nccl, "pycomm-p2p-up");
    auto down = std::make_unique<cuda::NcclComm>(*nccl, "pycomm-p2p-down");
    lanes_[kLaneCollective].open(std::move(nccl), device, kCollective);
    lanes_[kLaneUp].open(std::move(up), device, kUser);
    lanes_[kLaneDown].open(std::move(down), device, kUser);
    connect_p2p_lanes();
    {
      // Allocated for the reduction stream (like reduce_scatter's buffer): on
      // the caller's stream the allocator could hand out a block whose last
      // user there is still pending, and our non-blocking streams would not
      // be ordered after it.
      c10::cuda::CUDAStreamGuard g(reduction_stream(kLaneCollective));
      scratch_ = at::empty({static_cast<int64_t>(scratch_bytes(slice_bytes_, world_size()))},
                           at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
    }
    record_on_streams(scratch_, *lanes_[kLaneCollective].streams);
    watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  ~CudaExecutor() override {
    try {
      close();
    } catch (...) {
    }
  }

  c10::Device device() const override {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_));
  }
  bool shared_buffers() const override { return false; }
  bool native_collectives() const override { return true; }
  bool on_own_thread() const override { return false; }

  // ncclCommSplit of the collectives' communicator (a collective of this
  // one: every rank calls it at the same point of its op sequence).
  std::unique_ptr<Executor> split(int color, int key, const CommOptions& options) override {
    std::lock_guard<std::recursive_mutex> lk(enqueue_mu_);
    if (aborted()) {
      throw CommError(
          join_msg({"split: the communicator was aborted earlier (", abort_reason(), ")"}));
    }
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    auto nccl = cuda::NcclComm::split(*lanes_[kLaneCollective].nccl, "pycomm-split", color, key);
    if (!nccl) return nullptr;
    return std::make_unique<CudaExecutor>(std::move(nccl), options);
  }

  at::Tensor empty_like(const at::Tensor& t) override {
    c10::cuda::CUDAStreamGuard g(reduction_stream(kLaneCollective));
    return at::empty_like(t);
  }

  c10::intrusive_ptr<Work> new_work(const char* op, uint64_t seq,
                                    std::vector<at::Tensor> outputs) override {
    return c10::make_intrusive<CudaWork>(op, seq, std::move(outputs), device_);
  }

  // Collectives run on the collectives' lane, with its scratch.
  void run(const c10::intrusive_ptr<Work>& work, Body body, Wait wait,
           std::vector<at::Tensor> keep) override {
    enqueue(work, {{kLaneCollective, std::move(body)}}, wait, keep);
  }

  // User p2p: the ops go to the lane of their direction, as one group per
  // lane; a Work with ops in both directions completes when both groups have.
  void run_p2p(const c10::intrusive_ptr<Work>& work, std::vector<P2POp> ops, Wait wait,
               std::vector<at::Tensor> keep) override {
    std::vector<P2POp> by_lane[kNumLanes];
    for (const P2POp& op : ops) by_lane[lane_of(op)].push_back(op);
    std::vector<std::pair<LaneId, Body>> parts;
    for (LaneId l : {kLaneUp, kLaneDown}) {
      if (by_lane[l].empty()) continue;
      parts.emplace_back(l, [group = std::move(by_lane[l])](const Context& ctx) {
        ctx.transport.exchange(group.data(), group.size());
      });
    }
    enqueue(work, std::move(parts), wait, keep);
  }

  // Waits for pending work (bounded by the timeout: the watchdog aborts),
  // then flushes and destroys both NCCL communicators.
  void close() override {
    {
      std::lock_guard<std::mutex> lk(wd_mu_);
      if (wd_stop_) return;
      wd_stop_ = true;
    }
    wd_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    std::lock_guard<std::recursive_mutex> lk(enqueue_mu_);
    scratch_.reset();  // after recordStream: freed once our streams pass this point
    // The split-off communicator first, on every rank in the same order (a
    // destroy may synchronise the ranks of a host). A failure (which has
    // aborted that communicator) does not keep the other from closing.
    std::exception_ptr err;
    for (LaneId l : {kLaneDown, kLaneUp, kLaneCollective}) {
      try {
        if (lanes_[l].nccl) lanes_[l].nccl->destroy();
      } catch (...) {
        if (!err) err = std::current_exception();
      }
    }
    for (Lane& l : lanes_) l.reset();
    if (err) std::rethrow_exception(err);
  }

  // CUDA does not survive fork(): nothing of the parent's is touched.
  void leak() override {
    (void)new std::thread(std::move(watchdog_));  // never joined nor destroyed
    for (Lane& l : lanes_) {
      (void)l.nccl.release();
      (void)l.streams.release();
      (void)l.reducer.release();
      (void)l.transport.release();
    }
    (void)new at::Tensor(std::move(scratch_));
  }

  // Aborts both communicators (idempotent, any thread).
  void abort(const std::string& why) override {
    for (Lane& l : lanes_) {
      if (l.nccl) l.nccl->abort(why);
    }
    wd_cv_.notify_all();
  }

  bool aborted() const override {
    for (const Lane& l : lanes_) {
      if (l.nccl && l.nccl->aborted()) return true;
    }
    return false;
  }

  // Why the communicator was aborted (the first of the two to be aborted).
  std::string abort_reason() const override {
    for (const Lane& l : lanes_) {
      if (l.nccl && l.nccl->aborted()) return l.nccl->abort_reason();
    }
    return "";
  }

 private:
  struct Pending {
    c10::intrusive_ptr<CudaWork> work;
    Clock::time_point start;
  };
  // Rank r's sends to higher ranks and receives from lower ones travel on the
  // up lane, the rest on the down lane: each pair of ranks then uses one lane
  // per direction, so isend(x, p); irecv(y, p) on both ranks never queues a
  // receive behind a send that waits for the peer's receive.
  LaneId lane_of(const P2POp& op) const {
    return (op.kind == P2POp::kSend) == (op.peer > rank()) ? kLaneUp : kLaneDown;
  }

  // NCCL connects a pair of ranks lazily, on the first transfer between them,
  // and the enqueue waits on the host until the peer posts its side: a user's
  // first isend to a peer that is itself in an isend would wait for ever.
  // So every pair is connected now, on both p2p lanes, by one group per lane
  // in which each rank sends to and receives from every peer of the lane's
  // direction (64 KiB: NCCL connects all of a peer's p2p channels at the
  // first transfer, whatever its size). On the lanes' own streams, so work
  // the caller has queued does not count against the timeout.
  void connect_p2p_lanes() {
    constexpr size_t kBytes = 64 << 10;
    if (world_size() < 2) return;
    at::Tensor buf = at::empty({static_cast<int64_t>(kBytes * world_size())},
                               at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_));
    char* base = static_cast<char*>(buf.data_ptr());
    for (LaneId l : {kLaneUp, kLaneDown}) {
      std::vector<P2POp> ops;
      for (int p = 0; p < world_size(); ++p) {
        if (p == rank()) continue;
        for (P2POp::Kind kind : {P2POp::kSend, P2POp::kRecv}) {
          P2POp op{kind, base + p * kBytes, kBytes, p, kUser};
          if (kind == P2POp::kSend) op.buf = base + rank() * kBytes;
          if (lane_of(op) == l) ops.push_back(op);
        }
      }
      Lane& lane = lanes_[l];
      lane.streams->begin(lane.streams->reduction());
      lane.transport->exchange(ops.data(), ops.size());
      cudaEvent_t done = cuda::make_event();
      lane.streams->record_done(done);
      try {
        lane.nccl->host_wait(done, "connecting the p2p lanes");
      } catch (...) {
        (void)cudaEventDestroy(done);
        throw;
      }
      (void)cudaEventDestroy(done);
    }
  }

  // Enqueues the parts (a body per lane) as one op: steps 1-6 of the diagram
  // at the top of this file.
  void enqueue(const c10::intrusive_ptr<Work>& w, std::vector<std::pair<LaneId, Body>> parts,
               Wait wait, const std::vector<at::Tensor>& keep) {
    auto work = c10::static_intrusive_pointer_cast<CudaWork>(w);
    if (parts.empty()) {  // batch_isend_irecv of nothing
      work->complete();
      work->enqueued(reduction_stream(kLaneCollective), scratch_);
      return;
    }
    const LaneId last = parts.back().first;
    {
      std::lock_guard<std::recursive_mutex> lk(enqueue_mu_);  // one enqueue at a time
      if (aborted()) {
        throw CommError(join_msg(
            {work->op(), ": the communicator was aborted earlier (", abort_reason(), ")"}));
      }
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
      const cudaStream_t user =
          c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
      const bool in_capture = capturing();
      if (in_capture && wait == Wait::kHost) {
        throw UsageError(join_msg({work->op(),
                                   ": not allowed during CUDA graph capture (it "
                                   "blocks the host)"}));
      }
      std::vector<cudaEvent_t> joins;  // parts before the last one
      try {
        for (auto& [id, body] : parts) {
          Lane& lane = lanes_[id];
          lane.streams->begin(user);  // (1)
          const bool collective = id == kLaneCollective;
          Context ctx{*lane.transport, *lane.reducer, collective ? scratch_.data_ptr() : nullptr,
                      collective ? static_cast<size_t>(scratch_.nbytes()) : 0, slice_bytes_};
          body(ctx);         // (2)
          if (id != last) {  // (3)
            joins.push_back(cuda::make_event());
            lane.streams->record_done(joins.back());
          }
        }
        for (cudaEvent_t ev : joins) {
          PYCOMM_CUDA_CHECK(cudaStreamWaitEvent(lanes_[last].streams->reduction(), ev, 0));
        }
        lanes_[last].streams->record_done(work->done());  // (4)
        for (const auto& [id, body] : parts) {
          for (const auto& t : keep) record_on_streams(t, *lanes_[id].streams);
        }
        // (5) sync op
        if (wait == Wait::kSync) PYCOMM_CUDA_CHECK(cudaStreamWaitEvent(user, work->done(), 0));
      } catch (const std::exception& e) {
        destroy_events(joins);
        std::rethrow_exception(fail_op(*this, *work, e, device().str()));
      }
      destroy_events(joins);  // released once the waits above have passed
      work->enqueued(reduction_stream(last), scratch_);  // (5) the future, on that stream
      if (work->waits_on_host()) {
        // A barrier's Work.wait() blocks the host too (ProcessGroupNCCL's).
        cuda::NcclComm* nccl = lanes_[last].nccl.get();
        work->set_host_wait(
            [nccl, op = work->op()](cudaEvent_t ev) { nccl->host_wait(ev, op.c_str()); });
      }
      if (in_capture) {
        work->complete();  // no host-side tracking of captured work (see the top)
      } else {
        {
          std::lock_guard<std::mutex> wl(wd_mu_);
          pending_[last].push_back({work, Clock::now()});  // (6)
        }
        wd_cv_.notify_one();
      }
    }
    if (wait == Wait::kHost) {
      // (5) barrier: the host waits too. Aborts and throws on an error or the
      // timeout.
      lanes_[last].nccl->host_wait(work->done(), work->op().c_str());
      work->rethrow_if_failed();
    }
  }

  static void destroy_events(const std::vector<cudaEvent_t>& events) {
    for (cudaEvent_t ev : events) (void)cudaEventDestroy(ev);
  }

  c10::cuda::CUDAStream torch_stream(cudaStream_t s) const {
    return c10::cuda::getStreamFromExternal(s, static_cast<c10::DeviceIndex>(device_));
  }
  c10::cuda::CUDAStream reduction_stream(LaneId l) const {
    return torch_stream(lanes_[l].streams->reduction());
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
      p.work->fail(std::make_exception_ptr(CommError(
          cat(p.work->op(), " #", p.work->seq(), " on rank ", rank(), " failed: ", why))));
    }
  }

  // Completes each lane's Works in order as their `done` events pass (the
  // lanes independently: a pending irecv does not hold up the Works of later
  // collectives); enforces the timeout and surfaces NCCL's asynchronous
  // errors of both communicators. Polls about every millisecond while work
  // is pending, sleeps otherwise.
  void watchdog_loop() {
    (void)cudaSetDevice(device_);
    // Event queries from this thread must not invalidate a capture that the
    // user runs on another thread (as ProcessGroupNCCL's watchdog).
    cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    for (;;) {
      Pending front[kNumLanes];  // front[l].work is null when lane l is idle
      {
        std::unique_lock<std::mutex> lk(wd_mu_);
        auto idle = [&] {
          for (const auto& lane : pending_) {
            if (!lane.empty()) return false;
          }
          return true;
        };
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
          if (Clock::now() - f.start > timeout_) {
            err = cat("timed out after ", timeout_.count(),
                      " ms, the timeout of this communicator, waiting for the GPU (a peer may be "
                      "dead or not calling the same operation); the communicator was aborted");
            abort(f.work->op() + " #" + std::to_string(f.work->seq()) + ": " + err);
          }
        }
        if (err.empty() && waiting != nullptr) {
          const char* what = waiting->work->op().c_str();
          for (Lane& l : lanes_) l.nccl->check_async(what);
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
      if (!progress) {
        std::unique_lock<std::mutex> lk(wd_mu_);
        wd_cv_.wait_for(lk, std::chrono::milliseconds(1));
      }
    }
  }

  int device_;
  std::chrono::milliseconds timeout_;
  size_t slice_bytes_;
  Lane lanes_[kNumLanes];  // indexed by LaneId
  at::Tensor scratch_;
  // NCCL forbids concurrent calls on communicators of one device, and
  // split() gives several communicators (and executors) per device: one lock
  // per device serialises every enqueue on it. Recursive: split() holds it
  // while the new executor splits and connects its own lanes.
  static std::recursive_mutex& device_mutex(int device) {
    static std::mutex guard;
    static std::map<int, std::unique_ptr<std::recursive_mutex>> per_device;
    std::lock_guard<std::mutex> lk(guard);
    auto& m = per_device[device];
    if (!m) m = std::make_unique<std::recursive_mutex>();
    return *m;
  }
  std::recursive_mutex& enqueue_mu_;  // device_mutex(device_), looked up once

  std::mutex wd_mu_;
  std::condition_variable wd_cv_;
  std::deque<Pending> pending_[kNumLanes];  // per LaneId
  bool wd_stop_ = false;
  std::thread watchdog_;
};

}  // namespace

// The raw reduction kernels (cuda_kernels_bind.cpp).
void bind_cuda_kernels(py::module_& m);

// Registers the GPU half of pycomm._C (called from bindings.cpp).
void bind_cuda(py::module_& m) {
  m.attr("WITH_CUDA") = true;
  m.attr("NCCL_VERSION") = NCCL_VERSION_CODE;  // the headers built against

  py::class_<CudaWork, Work, c10::intrusive_ptr<CudaWork>>(m, "CudaWork");

  m.def("nccl_unique_id", [] { return py::bytes(cuda::NcclComm::unique_id()); });
  m.def(
      "make_nccl_comm",
      [](const py::bytes& unique_id, int rank, int world_size, int device, int64_t timeout_ms,
         int64_t slice_bytes, AutoTable auto_table, bool check) {
        std::string id = unique_id;
        CommOptions opt;
        opt.timeout_ms = timeout_ms;
        opt.slice_bytes = slice_bytes;
        opt.check = check;
        opt.auto_table = std::move(auto_table);
        py::gil_scoped_release nogil;
        check_options(opt);
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
        auto nccl = std::make_unique<cuda::NcclComm>(id, rank, world_size, device,
                                                     std::chrono::milliseconds(timeout_ms));
        auto exec = std::make_unique<CudaExecutor>(std::move(nccl), opt);
        return std::make_unique<Comm>(std::move(exec), opt);
      },
      py::arg("unique_id"), py::arg("rank"), py::arg("world_size"), py::arg("device"),
      py::arg("timeout_ms"), py::arg("slice_bytes"), py::arg("auto_table"),
      py::arg("check") = false);

  bind_cuda_kernels(m);
}

}  // namespace pycomm

#endif  // PYCOMM_WITH_CUDA
