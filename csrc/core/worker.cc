#include "worker.h"

namespace pycomm {

Worker::Worker() : thread_([this] { loop(); }) {}

Worker::~Worker() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Worker::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_all();
}

bool Worker::try_run_inline(const std::function<void()>& task) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (busy_ || !queue_.empty()) return false;
    busy_ = true;
  }
  struct Release {
    Worker* w;
    ~Release() {
      {
        std::lock_guard<std::mutex> lk(w->mu_);
        w->busy_ = false;
      }
      w->cv_.notify_all();
    }
  } release{this};
  task();
  return true;
}

void Worker::drain() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [this] { return queue_.empty() && !busy_; });
}

void Worker::loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [this] { return (!queue_.empty() && !busy_) || (stop_ && queue_.empty() && !busy_); });
    if (queue_.empty()) return;  // stop requested and drained
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lk.unlock();
    task();  // tasks catch their own exceptions (they complete a Work)
    lk.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

}  // namespace pycomm
