// The `gloo` transport: point-to-point through a torch.distributed backend
// (ProcessGroupGloo on CPU tensors). It needs c10d, so it lives in the binding
// layer; the algorithms see only the core Transport interface.
//
// Every message is a fixed 4 KiB frame on the header tag of its lane: a
// 48-byte header {bytes, op seq, op count, op packed (op_header.h), index,
// user tag}, then the payload itself when it fits. A larger payload follows
// as one gloo message on a tag of its own (the sender's index: k-th message
// to that peer on that lane), and the receiver posts its receive only once
// the header says the sizes and (on the collective channel) the op match.
// One message each way moves at the link's rate already (a connection per
// direction, below); splitting it into pieces posted together measured
// slower (benchmarks/hosts/README.md, "One gloo message each way").
//
// Payloads travel on two groups of their own, one per direction: from a
// lower rank to a higher one on `upward`, back on `downward`. gloo sends a
// message only once the receiver said it posted the receive, a notice on
// the same connection, queued behind whatever data this side sent there
// first. On one connection, an exchange's two directions would thus take
// turns (the data a rank sent first holds back its notices to the peer);
// with a connection per direction a rank writes only notices on the one
// its peer's data comes over, and both directions move at once, whatever
// the order of posting (benchmarks/hosts/gloo_duplex.py measures both).
// Headers stay on the first group: a receive from any source must find
// every sender's on one group.
//
// Lanes: collectives; user p2p with tag 0; user p2p with other tags. On the
// first two, gloo pairs the header frames per (peer, tag) in posting order,
// a receive from any source (tag 0) posting gloo's recvAnysource among them:
// that is P2POp's matching already. On the tagged lane the receiver matches:
// while a tagged receive waits, one of the waiting threads takes the next
// header frame from any rank (recvAnysource) and hands frames to the waiting
// receives, the earliest posted first; a frame that none wants yet is set
// aside (only its frame: a larger payload stays with its sender until a
// receive claims it, gloo's own rendezvous). Small messages thus stay one message whose receive
// is posted in advance; large ones pay one extra one-way latency. gloo aborts
// the whole process when a message does not fit the posted receive (an
// enforce in its I/O thread); posting only receives of the announced size
// means that can never happen: a mismatch raises CommError instead. The
// failing rank then sends an "abort" header carrying its reason to every
// peer, so those blocked on it fail with the same reason at once.
//
// A peer blocked in a send never reads that header (a gloo send waits for
// its receive, and gloo closes every pair of a group in which a wait timed
// out), so the reason also goes through the store: the failing rank sets
// kAbortKey, and a watcher thread on every rank polls it (every
// kAbortPoll) and aborts its transport with that reason. An aborted
// transport closes the payload groups' connections while a payload is in
// flight (abort()), so that nothing lands in a buffer after its op failed.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../core/thread_cache.h"
#include "../core/transport.h"

namespace pycomm {

class ProcessGroupTransport final : public Transport {
 public:
  // `backend` carries the headers, `upward` and `downward` (groups of the
  // same ranks, connections of their own) the payloads of each direction.
  // `store` (may be null: no watcher): this communicator's own (prefixed)
  // store, where a failing rank leaves its reason for the others.
  ProcessGroupTransport(c10::intrusive_ptr<c10d::Backend> backend,
                        c10::intrusive_ptr<c10d::Backend> upward,
                        c10::intrusive_ptr<c10d::Backend> downward,
                        c10::intrusive_ptr<c10d::Store> store);
  ~ProcessGroupTransport() override;

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  std::string name() const override { return "gloo"; }

  Handle post(const P2POp* ops, size_t n) override;
  void wait(Handle h) override;
  bool test(Handle h) override;
  void abort() override;
  void abort_because(const std::string& why) override;
  void set_while_blocked(std::function<bool()> f) override { while_blocked_ = std::move(f); }

 private:
  // Shared with pg_transport_failure.cpp.
  static constexpr int kTagBase = 0x7c0;  // header tag = base + lane; gloo pairs per (peer, tag)
  // Lanes: kCollective, kUser (user p2p with tag 0), kTagged (other tags).
  static constexpr int kTagged = 2;
  static constexpr int kLanes = 3;
  static constexpr uint64_t kAbortSeq = ~uint64_t{0};  // an abort header: inline bytes = reason
  // Every message starts with a frame of this size (the top comment).
  static constexpr size_t kFrameBytes = 4096;
  // broadcast_abort's patience, and the store watcher's period
  static constexpr auto kAbortNotice = std::chrono::milliseconds(200);
  static constexpr auto kAbortPoll = std::chrono::milliseconds(200);
  static constexpr const char* kAbortKey = "abort";  // in the store: the first failure's reason
  static at::Tensor new_frame();                     // kFrameBytes, uninitialized
  // Waits for gloo work `w` until `deadline` (throwing its error or the
  // timeout); while while_blocked_ reports work pending elsewhere it polls
  // in short slices, driving it, instead of blocking inside gloo.
  void wait_work(c10d::Work& w, std::chrono::steady_clock::time_point deadline);
  std::function<bool()> while_blocked_;
  struct Wire {  // the header message, plain bytes
    uint64_t bytes;
    uint64_t seq;
    uint64_t count;
    uint64_t packed;
    uint64_t index;  // the sender's message count on its lane to this peer
    int64_t tag;     // user p2p
  };
  // Payload bytes that travel inside the fixed-size first frame.
  static constexpr size_t kInline = kFrameBytes - sizeof(Wire);
  // A tagged receive waiting for its header frame (the tagged lane).
  struct Want {
    int peer;  // or kAnySource
    int tag;
    bool got = false;
    int from = -1;     // the sender, once got
    at::Tensor frame;  // its header frame, once got
  };
  struct Message {
    int kind;  // P2POp::Kind
    int peer;  // kAnySource until a receive from any source has its header
    int channel;
    int lane;  // kCollective, kUser (tag 0), or the tagged lane
    void* buf;
    size_t bytes;
    uint32_t index;              // sends: k-th message to the peer on its lane
    OpHeader hdr;                // of the op that posted it (seq 0: user p2p)
    int tag;                     // user p2p
    int* source;                 // P2POp::source
    at::Tensor wire;             // the header (sent, or received into)
    std::shared_ptr<Want> want;  // tagged receives
    c10::intrusive_ptr<c10d::Work> header_work;
    // Above kInline; receives: posted once the header checked out.
    c10::intrusive_ptr<c10d::Work> payload_work;
    template <typename F>
    void for_each_work(F&& f) {
      f(header_work);
      f(payload_work);
    }
  };
  struct Pending {
    std::vector<Message> msgs;
    // Set once the group was handed to a background waiter (waiters_): gloo's
    // send/recv works report completion only through a blocking wait().
    std::future<void> waiter;
  };
  // Blocks on every message of p, all within one `timeout`, posting each
  // receive's payload once its header checked out (throws CommError naming
  // the failed message and, for a mismatch, what differs).
  void wait_all(Pending& p, std::chrono::milliseconds timeout);
  // The entry of posted group `h` (it stays valid until erased: unordered_map
  // keeps elements in place); CommError for an unknown handle.
  Pending* find(Handle h);
  // Checks a received header against the receive; posts its payload.
  void accept_header(Message& m);
  // Posts send m's header and its payload; mu_ held.
  void post_send(Message& m);
  // The group a payload from rank `from` to rank `to` travels on.
  c10d::Backend& payload_group(int from, int to) const;
  // Gives m its payload's work, aborting it if abort() ran.
  void attach_payload(Message& m, c10::intrusive_ptr<c10d::Work> work);
  // Blocks until the tagged receive `m` has its header frame (m.wire,
  // m.peer), taking frames from the wire meanwhile if no other thread does.
  void take_tagged(Message& m, std::chrono::steady_clock::time_point deadline);
  // Hands frames set aside to the waiting tagged receives (match_mu_ held).
  void match_locked();
  // Best effort: tells every peer why this rank fails (an abort header and
  // the reason as its payload), waiting at most a moment for each.
  void broadcast_abort(const std::string& reason);
  int payload_tag(int lane, uint32_t index) const;
  // Posts the send or receive (`kind`) of a payload.
  c10::intrusive_ptr<c10d::Work> post_payload(int kind, void* buf, size_t bytes, int peer, int lane,
                                              uint32_t index);
  // The watcher of the store's abort key: a detached thread (a store call
  // may block up to the store's own timeout; closing must not wait for it)
  // that shares this state with the transport; `told` is cleared (under
  // `mu`) when the transport goes, so the thread never reaches it after.
  struct AbortWatch {
    std::mutex mu;
    std::condition_variable cv;
    bool stop = false;
    std::function<void(const std::string&)> told;
  };
  void watch_store(c10::intrusive_ptr<c10d::Store> store);
  void stop_watching();
  // The watcher found a peer's reason: abort with it (unless aborted already).
  void told(const std::string& reason);
  // `msg`, or the reason a peer left in the store followed by `msg`: the
  // error of a wait that an abort through the store cut short.
  std::string with_told_reason(const std::string& msg);
  std::mutex told_mu_;
  std::string told_reason_;  // guarded by told_mu_
  std::shared_ptr<AbortWatch> watch_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> backend_;   // headers
  c10::intrusive_ptr<c10d::Backend> upward_;    // payloads to a higher rank
  c10::intrusive_ptr<c10d::Backend> downward_;  // payloads to a lower rank
  int rank_;
  int size_;
  Handle next_ = 1;
  // Thread safety: post/wait/test run on the communicator's executing thread;
  // abort() may come from any thread (Communicator.abort() to unblock a hung
  // collective). mu_ guards the map; entries stay in it while being waited
  // for, so abort() can reach their works, and only the executing thread (or
  // the destructor) erases them.
  std::mutex mu_;
  std::unordered_map<Handle, Pending> pending_;
  std::atomic<bool> aborted_{false};
  // Messages sent so far per (peer, lane), to pair payload tags.
  std::vector<uint32_t> sent_;
  int rank_of_abort_ = -1;
  // The tagged lane's matching (take_tagged). Lock order: mu_, then match_mu_.
  struct Arrival {
    int peer;
    int tag;
    at::Tensor frame;
  };
  std::mutex match_mu_;
  std::condition_variable match_cv_;
  std::list<std::shared_ptr<Want>> wants_;  // waiting, in posting order
  std::deque<Arrival> arrivals_;            // set aside, in arrival order
  bool pulling_ = false;                    // a thread waits for the next frame
  c10::intrusive_ptr<c10d::Work> pull_work_;
  // The background waiters' threads (reused: thread_cache.h says why). Last,
  // so it goes first: the destructor has waited for every waiter by then.
  ThreadCache waiters_{"pycomm-waiter"};
};

}  // namespace pycomm
