// The `gloo` transport: point-to-point through a torch.distributed backend
// (ProcessGroupGloo on CPU tensors). It needs c10d, so it lives in the binding
// layer; the algorithms see only the core Transport interface.
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

 private:
  struct Pending {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<int> peers;
    std::vector<int> kinds;
    // Set once test() handed the group to a background waiter: gloo's
    // send/recv works report completion only through a blocking wait().
    std::future<void> waiter;
  };
  // Blocks on every work of p, all within one `timeout` (throws CommError
  // naming the failed op).
  static void wait_all(Pending& p, std::chrono::milliseconds timeout);
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
};

}  // namespace pycomm
