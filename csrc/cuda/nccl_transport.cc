#include "nccl_transport.h"

#include <cstring>
#include <thread>

#include "check.h"

namespace pycomm {
namespace cuda {
namespace {

using Clock = std::chrono::steady_clock;

// Polling back-off: spin briefly (the common case finishes within
// microseconds), then sleep so that a long wait does not burn a core.
void backoff(int& spins) {
  if (++spins < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 1024 ? 20 : 200));
  }
}

std::string ms_str(std::chrono::milliseconds t) { return cat(t.count(), " ms"); }

// The asynchronous state of communicator `c`: ncclSuccess, or ncclInProgress
// while its last nonblocking call runs; `*err` is set instead when NCCL
// reports an error (of the call `what`).
ncclResult_t async_state(ncclComm_t c, const char* what, std::string* err) {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(c, &state);
  if (r != ncclSuccess) {
    *err = nccl_error_message(r, "ncclCommGetAsyncError", __FILE__, __LINE__, c);
  } else if (state != ncclSuccess && state != ncclInProgress) {
    *err = nccl_error_message(state, what, __FILE__, __LINE__, c);
  }
  return state;
}

}  // namespace

ncclDataType_t to_nccl(DType t) {
  switch (t) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    case DType::kUInt8: return ncclUint8;
    case DType::kInt8: return ncclInt8;
  }
  throw UsageError("no NCCL type for dtype " + std::to_string(static_cast<int>(t)));
}

ncclRedOp_t to_nccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kProduct: return ncclProd;
  }
  throw UsageError("no NCCL op for reduce op " + std::to_string(static_cast<int>(op)));
}

// ---------------------------------------------------------------- NcclComm

std::string NcclComm::unique_id() {
  ncclUniqueId id;
  PYCOMM_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
  return std::string(id.internal, NCCL_UNIQUE_ID_BYTES);
}

NcclComm::NcclComm(const std::string& unique_id, int rank, int world_size, int device,
                   std::chrono::milliseconds timeout)
    : rank_(rank), size_(world_size), device_(device), timeout_(timeout) {
  if (unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
    throw UsageError("NCCL unique id must be " + std::to_string(NCCL_UNIQUE_ID_BYTES) +
                     " bytes, got " + std::to_string(unique_id.size()));
  }
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), NCCL_UNIQUE_ID_BYTES);
  DeviceScope scope(device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; we poll (and can abort)
  config.commName = "pycomm";
  try {
    std::lock_guard<std::mutex> lk(mu_);
    ncclComm_t c = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&c, world_size, id, rank, &config);
    comm_.store(c);
    PYCOMM_NCCL_CHECK(r, nullptr);
  } catch (const std::exception& e) {
    abort(e.what());
    throw;
  }
  wait_ready("ncclCommInitRankConfig");  // aborts and throws on error/timeout
}

ncclComm_t NcclComm::run_split(NcclComm& parent, const char* name, int color, int key) {
  DeviceScope scope(parent.device_);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;    // like the parent: we poll (and can abort)
  config.splitShare = 0;  // resources of its own (NCCL_COMM_SPLIT_SHARE_RESOURCES overrides)
  config.commName = name;
  const int nccl_color = color < 0 ? NCCL_SPLIT_NOCOLOR : color;
  // A nonblocking split returns ncclInProgress at once; NCCL's init thread
  // stores the new handle into *slot when the split has run (successfully or
  // not), nullptr until then (and for no color). On the heap: on a failure
  // below it may outlive this call (see split_failed).
  auto* slot = new ncclComm_t(nullptr);
  auto split_failed = [&](const std::string& msg) {
    // ncclCommAbort on the parent also ends the split (NCCL joins the init
    // job linked to the parent), after which *slot is settled.
    parent.abort(msg);
    ncclComm_t child = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (child != nullptr) {
      (void)ncclCommAbort(child);
      delete slot;
    }  // else deliberately leaked: NCCL might still write to it
    throw CommError(msg);
  };
  try {
    parent.call([&](ncclComm_t p) {
      PYCOMM_NCCL_CHECK(ncclCommSplit(p, nccl_color, key, slot, &config), p);
    });
  } catch (const std::exception& e) {
    split_failed(e.what());  // call() has aborted the parent already
  }
  if (nccl_color == NCCL_SPLIT_NOCOLOR) {
    // No communicator for this rank: the split is over once the parent
    // reports ncclSuccess again (wait_ready aborts the parent otherwise).
    parent.wait_ready("ncclCommSplit");  // on a throw, slot is leaked on purpose
    delete slot;
    return nullptr;
  }
  // Poll like wait_ready, on the new communicator once NCCL has published it.
  const auto deadline = Clock::now() + parent.timeout_;
  int spins = 0;
  for (;;) {
    std::string err;
    ncclComm_t child = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (child != nullptr && async_state(child, "ncclCommSplit", &err) == ncclSuccess &&
        err.empty()) {
      break;
    }
    if (err.empty() && Clock::now() > deadline) {
      err = "ncclCommSplit did not finish within the timeout of " + ms_str(parent.timeout_) +
            " (rank " + std::to_string(parent.rank_) + " of " + std::to_string(parent.size_) +
            "; a peer may be dead or not creating the communicator)";
    }
    if (!err.empty()) split_failed(err);
    backoff(spins);
  }
  ncclComm_t child = *slot;
  delete slot;
  // The split was an operation of the parent too: it must report ncclSuccess
  // (NCCL may have put the split's result there) before it is used again.
  try {
    parent.wait_ready("ncclCommSplit");
  } catch (...) {
    (void)ncclCommAbort(child);
    throw;
  }
  return child;
}

NcclComm::NcclComm(NcclComm& parent, const char* name, int color, int key)
    : rank_(-1), size_(0), device_(parent.device_), timeout_(parent.timeout_) {
  const ncclComm_t c = run_split(parent, name, color, key);  // color >= 0: not null
  comm_.store(c);
  int r = -1, n = 0;
  try {
    PYCOMM_NCCL_CHECK(ncclCommUserRank(c, &r), c);
    PYCOMM_NCCL_CHECK(ncclCommCount(c, &n), c);
  } catch (const std::exception& e) {
    abort(e.what());  // a throwing constructor runs no destructor
    throw;
  }
  rank_ = r;
  size_ = n;
}

std::unique_ptr<NcclComm> NcclComm::split(NcclComm& parent, const char* name, int color, int key) {
  if (color < 0) {
    (void)run_split(parent, name, color, key);
    return nullptr;
  }
  return std::unique_ptr<NcclComm>(new NcclComm(parent, name, color, key));
}

NcclComm::~NcclComm() {
  try {
    destroy();
  } catch (...) {
    // destroy() has aborted the communicator already
  }
}

std::string NcclComm::abort_reason() const {
  std::lock_guard<std::mutex> lk(reason_mu_);
  return abort_reason_;
}

void NcclComm::throw_if_aborted() const {
  if (aborted_) throw CommError("NCCL communicator was aborted: " + abort_reason());
  if (destroyed_ || comm_.load() == nullptr) throw CommError("NCCL communicator was destroyed");
}

void NcclComm::fail(const std::string& msg) {
  abort(msg);
  throw CommError(msg);
}

void NcclComm::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(reason_mu_);
    if (aborted_) return;
    abort_reason_ = why;
    aborted_ = true;  // from here on call() and the polls throw instead of using comm_
  }
  // Under mu_, after the flag: NCCL forbids using a communicator from two
  // threads at once, and call() / the polls use the handle under mu_. They
  // never block inside NCCL while holding it (the communicator is
  // nonblocking: waits are polls that take mu_ per look), so this waits at
  // most for one NCCL call. ncclCommAbort stops NCCL kernels and proxy
  // threads and frees the communicator; the streams then drain. Errors here
  // have nowhere better to go.
  std::lock_guard<std::mutex> lk(mu_);
  const ncclComm_t c = comm_.exchange(nullptr);
  if (c != nullptr) (void)ncclCommAbort(c);
}

void NcclComm::poll_until(const char* what, const char* late, const std::function<bool()>& done) {
  const auto deadline = Clock::now() + timeout_;
  int spins = 0;
  for (;;) {
    if (done()) return;
    if (Clock::now() > deadline) {
      fail(std::string(what) + " " + late + " within the timeout of " + ms_str(timeout_) +
           " (rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
           "; a peer may be dead or not calling the same operation)");
    }
    backoff(spins);
  }
}

void NcclComm::wait_ready(const char* what) {
  poll_until(what, "did not finish", [&] { return check_async(what) == ncclSuccess; });
}

ncclResult_t NcclComm::check_async(const char* what) {
  std::string err;
  ncclResult_t state = ncclSuccess;
  {
    std::lock_guard<std::mutex> lk(mu_);
    throw_if_aborted();
    state = async_state(comm_.load(), what, &err);
  }
  if (!err.empty()) fail(err);
  return state;
}

void NcclComm::host_wait(cudaEvent_t ev, const char* what) {
  poll_until(what, "did not complete on the GPU", [&] {
    if (event_done(ev)) return true;
    check_async(what);
    return false;
  });
}

void NcclComm::destroy() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (aborted_ || destroyed_ || comm_.load() == nullptr) return;
  }
  // Finalize flushes every operation issued so far (bounded by the timeout),
  // then destroy frees the communicator.
  call([](ncclComm_t c) { PYCOMM_NCCL_CHECK(ncclCommFinalize(c), c); });
  wait_ready("ncclCommFinalize");
  std::lock_guard<std::mutex> lk(mu_);
  if (aborted_ || destroyed_) return;
  const ncclComm_t c = comm_.exchange(nullptr);  // nullptr: an abort got there first
  if (c == nullptr) return;
  const ncclResult_t r = ncclCommDestroy(c);
  destroyed_ = true;
  if (r != ncclSuccess && r != ncclInProgress) {
    throw CommError(nccl_error_message(r, "ncclCommDestroy", __FILE__, __LINE__, nullptr));
  }
}

// ---------------------------------------------------------------- transport

NcclTransport::NcclTransport(NcclComm& comm, CudaStreams& streams, Channel channel)
    : comm_(comm), streams_(streams), channel_(channel) {
  Transport::set_timeout(comm.timeout());
}

void NcclTransport::set_timeout(std::chrono::milliseconds timeout) {
  Transport::set_timeout(timeout);
  comm_.set_timeout(timeout);
}

Handle NcclTransport::post(const P2POp* ops, size_t n) {
  // Zero-byte ops complete at once and are not sent: both ends of a ring step
  // compute the same slice sizes, so they skip the same messages.
  size_t live = 0;
  for (size_t i = 0; i < n; ++i) {
    if (ops[i].channel != channel_) {
      throw UsageError("nccl transport of channel " + std::to_string(channel_) +
                       " was given an op of channel " + std::to_string(ops[i].channel));
    }
    live += ops[i].bytes != 0;
  }
  // The comm stream first waits for the reductions enqueued so far: a send may
  // read what they write, a receive may overwrite what they read.
  streams_.comm_after_reductions();
  if (live != 0) {
    cudaStream_t stream = streams_.comm();
    comm_.call([&](ncclComm_t c) {
      PYCOMM_NCCL_CHECK(ncclGroupStart(), c);
      try {
        for (size_t i = 0; i < n; ++i) {
          const P2POp& o = ops[i];
          if (o.bytes == 0) continue;
          if (o.kind == P2POp::kSend) {
            PYCOMM_NCCL_CHECK(ncclSend(o.buf, o.bytes, ncclUint8, o.peer, c, stream), c);
          } else {
            PYCOMM_NCCL_CHECK(ncclRecv(o.buf, o.bytes, ncclUint8, o.peer, c, stream), c);
          }
        }
      } catch (...) {
        (void)ncclGroupEnd();  // close the group before the communicator is aborted
        throw;
      }
      PYCOMM_NCCL_CHECK(ncclGroupEnd(), c);
    });
    // Nonblocking: the group is enqueued on the stream only once NCCL reports
    // ncclSuccess, so the event must be recorded after this.
    comm_.wait_ready("ncclGroupEnd (ncclSend/ncclRecv)");
  }
  return streams_.record_comm();
}

void NcclTransport::wait(Handle h) { streams_.reduction_wait(h); }

template <class F>
Handle NcclTransport::enqueue(const char* what, F&& f) {
  streams_.comm_after_reductions();
  cudaStream_t stream = streams_.comm();
  comm_.call([&](ncclComm_t c) { f(c, stream); });
  comm_.wait_ready(what);
  return streams_.record_comm();
}

Handle NcclTransport::all_reduce(const void* in, void* out, size_t count, DType dtype,
                                 ReduceOp op) {
  return enqueue("ncclAllReduce", [&](ncclComm_t c, cudaStream_t s) {
    if (count == 0) return;
    PYCOMM_NCCL_CHECK(ncclAllReduce(in, out, count, to_nccl(dtype), to_nccl(op), c, s), c);
  });
}

Handle NcclTransport::reduce_scatter(const void* in, void* out, size_t recv_count, DType dtype,
                                     ReduceOp op) {
  return enqueue("ncclReduceScatter", [&](ncclComm_t c, cudaStream_t s) {
    if (recv_count == 0) return;
    PYCOMM_NCCL_CHECK(ncclReduceScatter(in, out, recv_count, to_nccl(dtype), to_nccl(op), c, s), c);
  });
}

Handle NcclTransport::all_gather(const void* in, void* out, size_t send_count, DType dtype) {
  return enqueue("ncclAllGather", [&](ncclComm_t c, cudaStream_t s) {
    if (send_count == 0) return;
    PYCOMM_NCCL_CHECK(ncclAllGather(in, out, send_count, to_nccl(dtype), c, s), c);
  });
}

Handle NcclTransport::broadcast(void* data, size_t bytes, int root) {
  return enqueue("ncclBroadcast", [&](ncclComm_t c, cudaStream_t s) {
    if (bytes == 0) return;
    PYCOMM_NCCL_CHECK(ncclBroadcast(data, data, bytes, ncclUint8, root, c, s), c);
  });
}

}  // namespace cuda
}  // namespace pycomm
