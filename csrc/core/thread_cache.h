// Background threads that are kept and reused: run(job) gives the job a
// thread of its own at once, as std::async(std::launch::async) does, taking
// an idle thread where there is one and starting a new one only when every
// thread is busy. So a caller that hands off one blocking wait per message
// starts as many threads as it ever has waits in flight, not one per message.
//
// A thread per message is costly beyond its creation: torch's c10d keeps some
// state per thread that ever waited on a Work (RankLocal, keyed by a thread
// number that is never reused) and never frees it, so a long job that started
// a thread per receive grew by every thread it ever started. Threads stay,
// idle, until the cache goes: as many as jobs ever ran at once (one that
// retired would leave that state behind, and its successor more).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace pycomm {

class ThreadCache {
 public:
  // `name`: the threads' name (/proc/<pid>/task/*/comm, at most 15 chars).
  explicit ThreadCache(const char* name) : name_(name) {}
  ~ThreadCache();  // runs what is queued, then joins every thread
  ThreadCache(const ThreadCache&) = delete;
  ThreadCache& operator=(const ThreadCache&) = delete;

  // Starts `job` on a thread now; the future holds its exception, if any.
  std::future<void> run(std::function<void()> job);

 private:
  void loop();

  const char* name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> jobs_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;  // threads waiting for a job
  bool stop_ = false;
};

}  // namespace pycomm
