#include "thread_cache.h"

#include <pthread.h>

#include <utility>

namespace pycomm {

ThreadCache::~ThreadCache() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

std::future<void> ThreadCache::run(std::function<void()> job) {
  std::packaged_task<void()> task(std::move(job));
  std::future<void> done = task.get_future();
  std::lock_guard<std::mutex> lk(mu_);
  // Every queued job needs a thread of its own: a job may block until
  // another one, queued behind it, has run (two receives whose senders
  // wait on each other), so none may wait for a busy thread.
  if (idle_ < jobs_.size() + 1) {
    // Started first: where it cannot be, the job is not queued (the caller
    // gets std::system_error, as from std::async) and takes no one's thread.
    threads_.emplace_back([this] { loop(); });
    pthread_setname_np(threads_.back().native_handle(), name_);
  }
  jobs_.push_back(std::move(task));
  cv_.notify_all();  // the idle ones look (a handful at most)
  return done;
}

void ThreadCache::loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(lk, [this] { return stop_ || !jobs_.empty(); });
    --idle_;
    if (jobs_.empty()) return;  // stopped, and nothing left to run
    std::packaged_task<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    lk.unlock();
    job();  // its exception goes to its future
    lk.lock();
  }
}

}  // namespace pycomm
