// The Transport interface: point-to-point byte movement between ranks.
//
// An algorithm posts a *group* of sends and receives that must be in flight
// together (a ring step sends to `next` while receiving from `prev`; posting
// them one after the other could deadlock) and later waits for the group.
//
//   CPU transports (gloo, shm): post() starts the transfers, wait() blocks the
//     calling thread until they are done (or the timeout expires -> CommError).
//   GPU transport (nccl): post() enqueues ncclSend/ncclRecv inside
//     ncclGroupStart/End on the comm stream after every reduction enqueued so
//     far, and wait() makes the reduction stream wait for the group's event.
//
// Either way the same algorithm code (algorithms.cc) is correct: it never
// touches a buffer that a group writes before wait()ing for that group, and
// never posts a send of data produced by a reduction before that reduction
// has been issued.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "op_header.h"
#include "types.h"

namespace pycomm {

// Independent message streams between a pair of ranks. Collectives use
// kCollective; user-level isend/irecv use kUser, so a pending user message can
// never be matched by a collective's receive (or the other way round), and a
// pending user receive never holds up later collectives. CPU transports keep
// per-channel queues (shm) or tags (gloo); on GPU each channel has an NCCL
// communicator and streams of its own (nccl_transport.h, cuda_comm.cpp).
enum Channel : int { kCollective = 0, kUser = 1 };

// A receive's peer that matches a send from any rank (kUser channel only).
constexpr int kAnySource = -1;

// User p2p matching (kUser channel), torch.distributed's (and MPI's): a
// receive matches the first message sent to it with its tag, from its peer
// or, for kAnySource, from any rank; messages of one sender with one tag are
// received in the order they were sent, and messages of other tags in between
// do not block them. With tag 0 from a given rank only, that is plain
// posting order. `source`, when set, receives the sender's rank once the
// receive is matched (kAnySource). Collectives ignore both fields.
struct P2POp {
  enum Kind : int { kSend = 0, kRecv = 1 };
  Kind kind;
  void* buf;  // const for sends
  size_t bytes;
  int peer;  // or kAnySource (a kUser receive)
  int channel = kCollective;
  int tag = 0;
  int* source = nullptr;
};

// Identifies a posted group until it is waited for.
using Handle = uint64_t;

// Memory that every rank of a shared-memory transport maps: rank r's copy of
// a region lies at base(r) in this process (like NCCL's registered buffers or
// torch's SymmetricMemory, over POSIX shared memory). Created collectively by
// SharedBuffers::allocate_symmetric. Each process unmaps its views when its
// last reference goes, whatever the peers still hold: the memory itself is
// freed once every process has unmapped it.
class SymmetricRegion {
 public:
  SymmetricRegion(uint64_t domain, uint64_t id, size_t bytes, std::vector<void*> bases,
                  size_t map_bytes);
  ~SymmetricRegion();
  SymmetricRegion(const SymmetricRegion&) = delete;
  SymmetricRegion& operator=(const SymmetricRegion&) = delete;
  // The transport that made it (unique in this process, never reused).
  uint64_t domain() const { return domain_; }
  // Allocation number within that transport: equal on every rank (>= 1).
  uint64_t id() const { return id_; }
  size_t bytes() const { return bytes_; }
  char* base(int r) const { return static_cast<char*>(bases_[static_cast<size_t>(r)]); }

 private:
  uint64_t domain_, id_;
  size_t bytes_, map_bytes_;
  std::vector<void*> bases_;
};

// Optional capability of transports whose ranks share memory (shm): every
// rank owns num_buffers() (>= 2) buffers of capacity() bytes that every rank
// can read, plus a monotonically increasing "epoch" flag. The direct algorithms
// (algorithms.h) build on it: b = next_buffer(); copy into local(b);
// arrive_and_wait(next_epoch()); then read remote(r, b) of every rank.
//
// Reuse rule: a rank arrives at the first epoch of a piece only after it has
// finished every read of the previous piece, so double buffering by piece
// (next_buffer) needs one flag per rank and no extra barrier per operation.
// Rotating through more than two buffers only makes reuse later.
class SharedBuffers {
 public:
  virtual ~SharedBuffers() = default;
  // Bytes of each buffer (equal on every rank).
  virtual size_t capacity() const = 0;
  // Buffers per rank (at least 2).
  virtual int num_buffers() const = 0;
  // This rank's buffer `which` (0 .. num_buffers()-1), writable.
  virtual void* local(int which) = 0;
  // Rank r's buffer `which`, readable (r may be this rank).
  virtual const void* remote(int r, int which) const = 0;
  // Publishes "this rank reached epoch e" (release) and blocks until every
  // rank has (acquire). Honours the timeout, abort and dead peers like wait().
  // `which` is the buffer this rank just filled for the piece: the transport
  // publishes the current op header (Transport::begin_op) next to it and
  // throws CommError, naming what differs, if a peer's op differs. `tag` is
  // published with it, for the peers to read with tag(r, which) once they
  // have arrived too (direct.cc: what piece 0's first arrival negotiates). A rank
  // may arrive again at `which` before a slow peer read the tag, so every
  // arrival of one piece at one buffer publishes the same tag; and a piece's
  // tags must be read before arriving for the next piece (next_buffer()),
  // after which the piece's buffer may be reused.
  virtual void arrive_and_wait(uint64_t epoch, int which, uint64_t tag = 0) = 0;
  virtual uint64_t tag(int r, int which) const = 0;
  // Rank r's process id (for process_vm_readv: cross_memory.h).
  virtual int pid(int r) const = 0;
  // Whether every rank can read every other rank's memory (cross_memory.h):
  // unknown until the first all-reduce that would, then the same on every
  // rank.
  // kOff comes with the reason (cross_memory_why), for the binding to say once.
  enum class CrossMemory { kUnknown, kOn, kOff };
  CrossMemory cross_memory() const { return cross_memory_; }
  const std::string& cross_memory_why() const { return cross_memory_why_; }
  void set_cross_memory(CrossMemory c, std::string why = {}) {
    cross_memory_ = c;
    cross_memory_why_ = std::move(why);
  }
  // Epochs are counted per communicator; all ranks call next_epoch() the same
  // number of times because they run the same collectives in the same order.
  uint64_t next_epoch() { return ++epoch_; }
  // Buffers rotate per piece of work (a piece may span several epochs):
  // piece k's buffer is written again by piece k+B (B = num_buffers() >= 2),
  // which starts after the first arrive_and_wait of piece k+1, i.e. when
  // every rank has finished piece k.
  int next_buffer() { return static_cast<int>(pieces_++ % static_cast<uint64_t>(num_buffers())); }

  // A collective step (inside a collective's body: every rank calls it at the
  // same point of its op sequence): each rank creates `bytes` of shared
  // memory and maps every other rank's. Returns nullptr on every rank when
  // any rank could not create its part (/dev/shm full, disabled with
  // PYCOMM_SHM_SYMMETRIC=0) or declined (a non-empty `refuse`: its reason);
  // `why` then says which rank and why. Throws CommError like
  // arrive_and_wait (a dead peer, the timeout).
  virtual std::shared_ptr<SymmetricRegion> allocate_symmetric(size_t bytes,
                                                              const std::string& refuse,
                                                              std::string* why) = 0;
  // The domain() of the regions this transport allocates.
  virtual uint64_t symmetric_domain() const = 0;

 private:
  uint64_t epoch_ = 0;
  uint64_t pieces_ = 0;
  CrossMemory cross_memory_ = CrossMemory::kUnknown;
  std::string cross_memory_why_;
};

// Optional capability of transports with collectives of their own (nccl):
// the native baseline of algo="nccl". Each call enqueues like post() and
// returns a Handle that the caller completes with Transport::wait (exactly
// once). `out` may equal `in`.
class NativeCollectives {
 public:
  virtual ~NativeCollectives() = default;
  virtual Handle all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op) = 0;
  // `in` holds world_size * recv_count elements; `out` receives this rank's.
  virtual Handle reduce_scatter(const void* in, void* out, size_t recv_count, DType dtype,
                                ReduceOp op) = 0;
  // `out` receives world_size * send_count elements, rank r's at r * send_count.
  virtual Handle all_gather(const void* in, void* out, size_t send_count, DType dtype) = 0;
  virtual Handle broadcast(void* data, size_t bytes, int root) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string name() const = 0;

  // Posts ops[0..n) as one group (all in flight together). Zero-byte ops are
  // allowed and complete at once. Ordering: messages between one pair of ranks
  // on one channel are matched in posting order (kUser: per tag, and
  // receives may name kAnySource; see P2POp). A posted group must make
  // progress while the caller waits for *other* groups (user isend/irecv stay
  // posted while later collectives run): wait() and test() progress every
  // pending op, not just their own.
  virtual Handle post(const P2POp* ops, size_t n) = 0;

  // Completes a posted group (see the header comment). Each handle is waited
  // for exactly once. Throws CommError on timeout, a dead peer or abort.
  virtual void wait(Handle h) = 0;

  // Non-blocking completion check. Returns true once the group is done (the
  // handle is then consumed, as by wait); throws CommError like wait. Must not
  // block for long: the worker polls it for deferred user p2p ops.
  virtual bool test(Handle h) {
    wait(h);
    return true;
  }

  // Idle waiting for the worker's poll of deferred groups (worker thread
  // only, like post/wait/test): blocks up to max_ns, returning early once a
  // peer may have made progress for this rank or interrupt() was called.
  // Progresses pending ops first and returns at once if that moved anything.
  // Returns false, at once, when the transport cannot wait on its peers (the
  // caller then naps on its own).
  virtual bool idle_wait(int64_t max_ns) {
    (void)max_ns;
    return false;
  }
  // Ends an idle_wait in progress, or the next one, promptly. Thread-safe.
  virtual void interrupt() {}

  // Moves bytes of the posted groups without completing any for the caller
  // (executing thread, between this transport's own waits); returns whether
  // any is still pending. Across hosts the gloo parts call the shm part's
  // while they block (set_while_blocked), so that shm p2p posted before a
  // gloo op keeps moving: a peer blocked on it may be what that op waits for.
  virtual bool progress() { return false; }
  // `f` (a progress() of another transport on the same thread) is called
  // while this transport's waits block, until it returns false. Set before
  // the first op; transports that block in a single call may ignore it.
  virtual void set_while_blocked(std::function<bool()> f) { (void)f; }

  // Called before each collective runs (on the executing thread): the
  // transport carries `h` with the op's messages and checks it against the
  // peers' (op_header.h), throwing CommError that names what differs. Ops
  // posted until the next begin_op belong to this collective, except user
  // p2p (channel kUser), which carries no header.
  virtual void begin_op(const OpHeader& h) { op_ = h; }
  const OpHeader& current_op() const { return op_; }

  // Bounds every blocking wait from now on.
  virtual void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // Makes pending and future waits fail fast (called after an error, or from
  // another thread to unblock a hung collective). Idempotent.
  virtual void abort() {}
  // abort(), and tells the peers `why` where the transport can (shm: in the
  // segment; gloo: an abort header), so they fail with this reason.
  virtual void abort_because(const std::string& why) {
    (void)why;
    abort();
  }

  // Interrupts (SIGINT): a transport whose waits call `check` every few
  // tens of milliseconds while blocked says so; `check` throws Interrupted
  // to end the wait (the transport then aborts, telling the peers).
  virtual bool checks_interrupts() const { return false; }
  void set_interrupt_check(std::function<void()> check) { interrupt_check_ = std::move(check); }

  // Optional capabilities (nullptr when the transport lacks them).
  virtual SharedBuffers* shared_buffers() { return nullptr; }
  virtual NativeCollectives* native() { return nullptr; }

  // Convenience: post and wait.
  void exchange(const P2POp* ops, size_t n) { wait(post(ops, n)); }

 protected:
  std::chrono::milliseconds timeout_{std::chrono::minutes(5)};
  OpHeader op_;  // the collective now running (seq 0 before the first)
  std::function<void()> interrupt_check_;
};

}  // namespace pycomm
