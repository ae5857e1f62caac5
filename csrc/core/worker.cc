#include "worker.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

namespace pycomm {

Worker::Worker() : thread_([this] { loop(); }) {
  // Named, so that a rank's workers can be counted (/proc/<pid>/task/*/comm).
  pthread_setname_np(thread_.native_handle(), kThreadName);
}

Worker::~Worker() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Worker::submit(std::function<void()> task, bool post_only) {
  bool waiting;
  {
    std::lock_guard<std::mutex> lk(mu_);
    (is_current() ? urgent_ : queue_).push_back({std::move(task), post_only});
    waiting = in_idle_wait_;
  }
  cv_.notify_all();
  if (waiting) wake_();
}

void Worker::run_posts_ahead() {
  if (!is_current()) throw std::logic_error("Worker::run_posts_ahead() off the worker thread");
  for (;;) {
    std::function<void()> task;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!urgent_.empty() || queue_.empty() || !queue_.front().post_only) return;
      task = std::move(queue_.front().run);
      queue_.pop_front();
    }
    ++ahead_;  // the worker is busy already (it runs the waiting task or poll)
    struct Done {
      int& n;
      ~Done() { --n; }
    } done{ahead_};
    task();
  }
}

int Worker::add_idle_poll(std::function<bool()> poll) {
  std::lock_guard<std::mutex> lk(polls_mu_);
  polls_.emplace_back(next_poll_id_, std::move(poll));
  return next_poll_id_++;
}

void Worker::remove_idle_poll(int id) {
  std::lock_guard<std::mutex> lk(polls_mu_);
  polls_.erase(
      std::remove_if(polls_.begin(), polls_.end(), [id](const auto& p) { return p.first == id; }),
      polls_.end());
}

bool Worker::poll_all() {
  std::lock_guard<std::mutex> lk(polls_mu_);
  bool more = false;
  for (auto& p : polls_) more = p.second() || more;  // every one, each time
  return more;
}

bool Worker::claim_idle() {
  std::lock_guard<std::mutex> lk(mu_);
  if (busy_ || has_task()) return false;
  busy_ = true;
  return true;
}

void Worker::release_inline() {
  std::lock_guard<std::mutex> lk(mu_);
  busy_ = false;
  // Only when a waiter can go on now: a notify always wakes the idle worker,
  // a context switch per synchronous op otherwise. Under the lock: a drainer
  // that goes on may destroy the Worker right after.
  if (has_task() || poll_pending_ || stop_ || drainers_ > 0) cv_.notify_all();
}

void Worker::drain() {
  if (is_current()) throw std::logic_error("Worker::drain() called on the worker thread");
  std::unique_lock<std::mutex> lk(mu_);
  ++drainers_;
  cv_.wait(lk, [this] { return !has_task() && !busy_ && !poll_pending_; });
  --drainers_;
}

void Worker::loop() {
  std::unique_lock<std::mutex> lk(mu_);
  int idle_rounds = 0;
  for (;;) {
    if (has_task() && !busy_) {
      auto& q = urgent_.empty() ? queue_ : urgent_;
      std::function<void()> task = std::move(q.front().run);
      q.pop_front();
      busy_ = true;
      lk.unlock();
      task();  // tasks catch their own exceptions (they complete a Work)
      lk.lock();
      busy_ = false;
      idle_rounds = 0;
      cv_.notify_all();
      continue;
    }
    if (poll_pending_ && !busy_) {
      busy_ = true;
      poll_pending_ = false;  // a kick() during the round (a post run ahead) is kept
      lk.unlock();
      const bool more = poll_all();
      lk.lock();
      busy_ = false;
      poll_pending_ = poll_pending_ || more;
      cv_.notify_all();
      if (more && !has_task()) {
        // back off: a few yields, then short sleeps that a new task interrupts
        if (++idle_rounds < 16) {
          lk.unlock();
          std::this_thread::yield();
          lk.lock();
        } else {
          const int nap_us = std::min(200, 10 * (idle_rounds - 15));
          bool waited = false;
          if (idle_wait_) {
            // Sleep until a peer moves (shm doorbell) or a task arrives.
            busy_ = in_idle_wait_ = true;
            lk.unlock();
            waited = idle_wait_(static_cast<int64_t>(nap_us) * 1000);
            lk.lock();
            busy_ = in_idle_wait_ = false;
            cv_.notify_all();
          }
          if (!waited) {
            cv_.wait_for(lk, std::chrono::microseconds(nap_us), [this] { return has_task(); });
          }
        }
      }
      continue;
    }
    if (stop_ && !has_task() && !busy_ && !poll_pending_) return;
    idle_rounds = 0;
    cv_.wait(lk, [this] {
      return (has_task() && !busy_) || (poll_pending_ && !busy_) ||
             (stop_ && !has_task() && !busy_);
    });
  }
}

}  // namespace pycomm
