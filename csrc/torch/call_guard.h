// Comm::CallGuard (comm.h), shared by the comm*.cpp files that run ops.
#pragma once

#include <stdexcept>
#include <thread>

#include "comm.h"

namespace pycomm {

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

}  // namespace pycomm
