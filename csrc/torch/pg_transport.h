// The `gloo` transport: point-to-point through a torch.distributed backend
// (ProcessGroupGloo on CPU tensors). It needs c10d, so it lives in the binding
// layer; the algorithms see only the core Transport interface.
//
// Every message is a fixed 4 KiB frame on the header tag of its channel: a
// 32-byte header {bytes, op seq, op count, op packed} (op_header.h), then the
// payload itself when it fits. A larger payload follows on a tag of its own
// (k-th message between the pair on that channel), and the receiver posts
// its receive only once the header says the sizes and (on the collective
// channel) the op match. Small messages thus stay one message whose receive
// is posted in advance; large ones pay one extra one-way latency. gloo aborts
// the whole process when a message does not fit the posted receive (an
// enforce in its I/O thread); posting only receives of the announced size
// means that can never happen: a mismatch raises CommError instead. The
// failing rank then sends an "abort" header carrying its reason to every
// peer, so those blocked on it fail with the same reason at once.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <future>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "../core/transport.h"

namespace pycomm {

class ProcessGroupTransport final : public Transport {
 public:
  explicit ProcessGroupTransport(c10::intrusive_ptr<c10d::Backend> backend);
  ~ProcessGroupTransport() override;

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  std::string name() const override { return "gloo"; }

  Handle post(const P2POp* ops, size_t n) override;
  void wait(Handle h) override;
  bool test(Handle h) override;
  void abort() override;
  void abort_because(const std::string& why) override;

 private:
  struct Wire {  // the header message, plain bytes
    uint64_t bytes;
    uint64_t seq;
    uint64_t count;
    uint64_t packed;
  };
  // Payload bytes that travel inside the fixed-size first frame.
  static constexpr size_t kInline = 4096 - sizeof(Wire);
  struct Message {
    int kind;  // P2POp::Kind
    int peer;
    int channel;
    void* buf;
    size_t bytes;
    uint32_t index;   // k-th message of its kind between the pair on its channel
    OpHeader hdr;     // of the op that posted it (seq 0: user p2p)
    at::Tensor wire;  // the header (sent, or received into)
    c10::intrusive_ptr<c10d::Work> header_work;
    c10::intrusive_ptr<c10d::Work> payload_work;  // receives: posted once the header checked out
  };
  struct Pending {
    std::vector<Message> msgs;
    // Set once test() handed the group to a background waiter: gloo's
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
  // Best effort: tells every peer why this rank fails (an abort header and
  // the reason as its payload), waiting at most a moment for each.
  void broadcast_abort(const std::string& reason);
  int payload_tag(int channel, uint32_t index) const;
  c10::intrusive_ptr<c10d::Backend> backend_;
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
  // Messages posted so far per (peer, channel), to pair payload tags.
  std::vector<uint32_t> sent_, received_;
  int rank_of_abort_ = -1;
};

}  // namespace pycomm
