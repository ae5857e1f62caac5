// A single background thread that runs a communicator's CPU operations in the
// order they were submitted (so async ops from one caller keep collective
// order), plus an inline fast path for synchronous calls.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace pycomm {

class Worker {
 public:
  Worker();
  ~Worker();  // drains the queue, then joins
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Queues `task` behind everything submitted before.
  void submit(std::function<void()> task);

  // Runs `task` on the calling thread if nothing is queued or running (the
  // common case of a synchronous collective), saving two thread hand-offs.
  // Returns false, without running it, otherwise.
  bool try_run_inline(const std::function<void()>& task);

  // Blocks until every task submitted so far has finished.
  void drain();

 private:
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace pycomm
