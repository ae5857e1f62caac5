// The `shm` transport: ranks on one host exchange bytes through one POSIX
// shared-memory segment per communicator. Plain C++17 + POSIX (Linux futex).
//
// Segment layout (all offsets page aligned, every shared word on its own
// cache line):
//
//   Header      magic, version, world size, ring geometry, abort word and
//               the first aborting rank's reason, attach counter,
//               RankInfo[n] { pid, doorbell (futex), sleeping, epoch,
//                             current op header (op_header.h) }
//   Channels    one per ordered pair (src -> dst), src != dst, and per
//               message channel (kCollective, kUser: independent streams):
//                 Ctrl { head  (written by src: slots published),
//                        tail  (written by dst: slots consumed),
//                        meta[slots] { bytes in the slot, bytes of its
//                                      message, sender's op header,
//                                      user tag } }
//                 data[slots][slot_bytes]
//   Direct      per rank direct_buffers buffers of direct_bytes (SharedBuffers)
//   BufferOp    per direct buffer: the op header of the piece in it, and the
//               tag of its owner's last arrival
//
// Symmetric memory (SharedBuffers::allocate_symmetric) lives outside the
// segment: rank r's part of allocation k is a segment of its own,
// "<segment name>.s<k>.<r>", created and reserved by r (O_EXCL, 0600), mapped
// by every rank (after the ranks agreed that every part was created: a flag
// in a direct buffer), and unlinked once every rank has mapped it (a second
// arrival) by every rank, each name by all (ENOENT is fine), so that a rank
// killed right after that arrival leaves nothing behind either. A rank that
// fails or sees a peer die half way unlinks every rank's name too.
//
// Protocol of a channel (single producer, single consumer): head and tail are
// 64-bit sequence numbers that never wrap; slot = seq % slots. The producer
// may fill slot `head` while head - tail < slots, writes data and len, then
// publishes head + 1 with a release store. The consumer sees head with an
// acquire load, copies the slot out, then publishes tail + 1 (release). A
// message of B bytes occupies ceil(B / slot_bytes) consecutive slots; since
// both sides post their ops in the same order, messages match in order, and
// meta lets the receiver detect a size mismatch and, on the collective
// channel, a different op (count, dtype, reduce op, root, algo, sequence).
// On the user channel a receive matches by tag and may name any source
// (P2POp): the receive side there is shm_match.cc's.
//
// Progress: post() queues its ops per peer and pushes as much as fits at once;
// wait() keeps making progress on *every* pending op (all groups, all peers,
// in per-peer FIFO order) until its group is done, so a send into a full ring
// never blocks a receive the peer is waiting for.
//
// Waiting: spin (pause) briefly, then sched_yield, then sleep on this rank's
// doorbell futex with a short timeout. A rank that publishes (head or tail)
// rings the peer's doorbell only if the peer announced it sleeps
// (store sleeping; fence; check  vs  store head; fence; load sleeping), so the
// fast path makes no syscall. While waiting it checks the deadline, the local
// and shared abort words, and whether peer processes are still alive (pidfd,
// or kill(pid, 0) + /proc state as a fallback), so a dead peer raises
// CommError within a few milliseconds.
//
// Lifetime: rank 0 creates the segment (O_CREAT | O_EXCL, mode 0600) and the
// others attach after rank 0 has published its name (through the c10d Store,
// in pycomm/comm.py); the last rank to map it unlinks it (a counter in the
// header), so nothing is left in /dev/shm even if a process is killed later.
// A rank that dies before every rank mapped it leaves the name to the
// survivors: pycomm/comm.py publishes the name before creating the segment
// and every rank unlinks it when init fails or is interrupted. The
// destructor unmaps (and unlinks, in case that step never ran).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport.h"

namespace pycomm {

struct ShmConfig {
  // Bytes per ring slot; 0 picks by world size: the largest power of two in
  // [64 KiB, 256 KiB] that keeps all rings (n(n-1) pairs x 2 channels x
  // `slots`) within 32 MiB. Big slots matter for p2p: fewer, larger copies
  // per message (benchmarks/allreduce/README.md, "Measurements behind
  // csrc's defaults").
  size_t slot_bytes = 0;
  size_t slots = 8;  // slots per channel (ring depth)
  // Bytes of each SharedBuffers buffer: pieces this small stay in L2 between
  // the copy-in and the reduction (larger pieces measured slower: the
  // README named above).
  size_t direct_bytes = 256 * 1024;
  // Buffers per rank, used in rotation. More than two lets a peer's cached
  // copy of a buffer age out before the owner writes it again, so the copy-in
  // pays fewer cross-core invalidations.
  size_t direct_buffers = 4;
  // Waiting policy: pause-spins before yielding, yields before sleeping.
  // Short on purpose: on a machine with few cores a long spin starves the
  // peer (or a helper thread) it is waiting for.
  unsigned spin = 500;
  unsigned yields = 50;
  // Overrides from PYCOMM_SHM_SLOT_BYTES, PYCOMM_SHM_SLOTS,
  // PYCOMM_SHM_DIRECT_BYTES, PYCOMM_SHM_DIRECT_BUFFERS, PYCOMM_SHM_SPIN,
  // PYCOMM_SHM_YIELDS.
  static ShmConfig from_env();
};

struct ShmSegment;  // the mapped layout (shm_layout.h)

class ShmTransport final : public Transport, public SharedBuffers {
 public:
  // Rank 0 creates the segment `name` (a POSIX shm name: "/..." without other
  // slashes); it fails if the name exists. Other ranks attach to it (after
  // rank 0's create() returned) and take the geometry from its header; their
  // `cfg` only supplies the waiting policy. Throws CommError.
  ShmTransport(const std::string& name, int rank, int world_size, bool create, ShmConfig cfg);
  ~ShmTransport() override;
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  // Removes the name (ENOENT is fine). Call once every rank has attached.
  static void unlink(const std::string& name);

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  std::string name() const override { return "shm"; }

  Handle post(const P2POp* ops, size_t n) override;
  void wait(Handle h) override;
  bool test(Handle h) override;
  bool idle_wait(int64_t max_ns) override;
  void interrupt() override;
  void abort() override;
  void abort_because(const std::string& why) override { abort_with(why); }
  bool checks_interrupts() const override { return true; }
  SharedBuffers* shared_buffers() override { return this; }

  // SharedBuffers
  size_t capacity() const override;
  int num_buffers() const override;
  void* local(int which) override;
  const void* remote(int r, int which) const override;
  void arrive_and_wait(uint64_t epoch, int which, uint64_t tag = 0) override;
  uint64_t tag(int r, int which) const override;
  int pid(int r) const override;
  std::shared_ptr<SymmetricRegion> allocate_symmetric(size_t bytes, const std::string& refuse,
                                                      std::string* why) override;
  uint64_t symmetric_domain() const override { return symmetric_domain_; }
  void begin_op(const OpHeader& h) override;

  const std::string& segment_name() const { return name_; }
  size_t segment_bytes() const { return map_bytes_; }

 private:
  struct Op {
    char* buf;
    size_t bytes;
    size_t done;
    bool first;  // no slot moved yet (an empty user message still takes one)
    Handle group;
    OpHeader hdr;     // the collective it belongs to (seq 0: user p2p)
    uint64_t packed;  // hdr.packed(), computed once
    int tag = 0;      // user p2p (P2POp::tag)
    int* source = nullptr;
    uint64_t order = 0;  // user receives: posting order (matching picks the earliest)
  };
  // A user message that arrived before a receive matching it was posted,
  // set aside so that the receives waiting for later messages of its sender
  // get theirs (shm_match.cc). A receive posted while it is still arriving
  // claims it and gets the bytes once they are all here.
  struct Unexpected {
    int peer;
    int tag;
    std::vector<char> data;
    bool complete = false;
    bool claimed = false;
    Op claimant{};
  };
  // The user message being taken from a peer: into a receive, or set aside.
  struct Rx {
    bool busy = false;
    Op op{};
    Unexpected* into = nullptr;  // set aside into this entry of unexpected_
  };
  // Moves what fits of the queue to (send) or from `peer` on `channel`.
  bool progress(int peer, int channel, bool send);
  // User p2p receives (shm_match.cc): posts one (matching what was set aside
  // first; returns false when it completed at once), and takes what `peer`
  // sent on the kUser channel into the receives it matches.
  bool post_user_recv(const P2POp& op, Handle group);
  bool progress_user_recv(int peer);
  // Binds the message of `bytes` with `tag` that `peer` starts to send to
  // the earliest matching receive, or sets it aside when receives wait for
  // other messages; false: leave it in the ring for now.
  bool start_user_message(int peer, int tag, size_t bytes);
  void finish_user_message(int peer);
  [[noreturn]] void fail_size(int peer, size_t expected, size_t sent, int channel, int tag);
  // One slot of op's next bytes into / out of the ring; returns the bytes.
  size_t put_slot(int peer, int channel, const Op& op, size_t slot);
  size_t take_slot(int peer, int channel, const Op& op, size_t slot);
  bool progress_all();
  void complete_op(Handle group);

 public:
  bool progress() override {
    progress_all();
    return pending_ops_ > 0;
  }

 private:
  void notify(int peer);
  // Blocks until poll() returns true (it may make progress, which sets
  // moved_), spinning, yielding, then sleeping on the doorbell futex.
  template <class Poll>
  void block(Poll&& poll, const char* what);
  void check_not_aborted(const char* what);
  void check_health(const char* what, int64_t deadline_ns);
  std::string pending_desc() const;
  // Rank r's current op (RankInfo), false while it is being rewritten.
  bool peer_op(int r, OpHeader* out) const;
  // Fails if a peer runs a different op under our sequence number.
  void check_peer_ops();
  // Sets the shared abort word; the first rank to do so leaves `reason`.
  // The (const char*, size_t) form is async-signal-safe: stop_signals.h's
  // handler calls it through on_stop_signal.
  void abort_with(const std::string& reason) { abort_with(reason.data(), reason.size()); }
  void abort_with(const char* reason, size_t len);
  static void on_stop_signal(void* self, int signo);
  std::string aborted_by(uint32_t abort_word) const;
  bool peer_dead(int* who);
  [[noreturn]] void fail(const std::string& msg);
  // Rank r's part of symmetric allocation `id`: "<segment name>.s<id>.<r>".
  std::string symmetric_name(uint64_t id, int r) const;

  std::string name_;
  int rank_;
  int size_;
  ShmConfig cfg_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  ShmSegment* seg_ = nullptr;  // views into the mapping
  bool unlinked_ = false;
  int name_watch_ = -1;  // stop_signals.h tokens: the name, the abort on SIGTERM/SIGHUP
  int stop_watch_ = -1;

  // Indexed by peer * channels + channel; FIFO per queue.
  std::vector<std::deque<Op>> sendq_, recvq_;
  // User p2p matching (shm_match.cc): receives from kAnySource (posting
  // order), messages set aside (arrival order; std::list: Rx points into
  // it), the message now arriving from each peer, receives posted so far.
  std::deque<Op> any_recvq_;
  std::list<Unexpected> unexpected_;
  std::vector<Rx> rx_;
  uint64_t user_recvs_ = 0;
  std::vector<uint64_t> send_head_, recv_tail_;   // our own counters, per queue
  std::unordered_map<Handle, size_t> remaining_;  // ops left per group
  Handle next_ = 1;
  size_t pending_ops_ = 0;
  bool moved_ = false;
  // Yields are skipped until this time (steady ns) after one was slow: see
  // block(). Touched only by the executing thread.
  int64_t no_yield_until_ = 0;
  int slow_yields_ = 0;  // slow yields in a row

  std::atomic<bool> aborted_{false};
  std::atomic<bool> interrupted_{false};  // interrupt() since the last idle_wait
  std::vector<int> pidfds_;               // per rank, -1 when not open (yet)
  std::vector<bool> pidfd_ok_;            // false: pidfd_open unavailable, use kill + /proc
  int64_t last_health_ns_ = 0;
  int64_t last_interrupt_ns_ = 0;
  uint64_t symmetric_domain_;     // process-unique (SymmetricRegion::domain)
  uint64_t symmetric_count_ = 0;  // allocate_symmetric calls so far
};

}  // namespace pycomm
