// A single background thread that runs a communicator's CPU operations in the
// order they were submitted (so async ops from one caller keep collective
// order), plus an inline fast path for synchronous calls.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace pycomm {

class Worker {
 public:
  static constexpr const char* kThreadName = "pycomm-worker";
  Worker();
  ~Worker();  // drains the queue, then joins
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Queues `task` behind everything submitted before. Called on the worker
  // thread itself (from a task, typically a Future callback run when a task
  // completes its Work), it queues `task` ahead of everything submitted from
  // other threads, behind earlier such tasks: an op issued by a callback then
  // runs right after the op that triggered it on every rank, however the
  // caller's own submissions interleave with completions on each rank.
  // `post_only`: the task only hands transfers to the transport and never
  // blocks (an async isend/irecv's post), so run_posts_ahead may run it early.
  void submit(std::function<void()> task, bool post_only = false);

  // On the worker thread, inside a task or poll that waits (a Future callback
  // waiting for a p2p op): runs the post-only tasks at the head of the queue
  // now, the ones other threads submitted before any that is not post-only.
  // A peer whose send waits for its matching receive (gloo) may need one of
  // them before it sends what the callback waits for; every other task keeps
  // its turn, and so does anything the worker itself queued (urgent).
  void run_posts_ahead();
  // True on the worker while run_posts_ahead runs a task: the task then
  // posts ahead of its turn, inside a wait (deferred_p2p.h, rule 7).
  bool running_ahead() const { return is_current() && ahead_ > 0; }

  // True on the worker thread (inside a task or the idle poll).
  bool is_current() const { return std::this_thread::get_id() == thread_.get_id(); }

  // Runs `task` on the calling thread if nothing is queued or running (the
  // common case of a synchronous collective), saving two thread hand-offs.
  // Returns false, without running it, otherwise. A template: the task runs
  // as the caller wrote it, with no std::function made per call.
  template <class Task>
  bool try_run_inline(Task& task) {
    if (!claim_idle()) return false;
    struct Release {
      Worker* w;
      ~Release() { w->release_inline(); }
    } release{this};
    task();
    return true;
  }

  // Blocks until every task submitted so far has finished and the idle poll
  // (below) reports nothing pending. Not on the worker thread (it would wait
  // for itself): throws std::logic_error there.
  void drain();

  // Idle polls run on the worker whenever no task is queued, after kick(),
  // until every one returns false ("nothing pending"). They complete
  // operations a task left in flight (user isend/irecv) without holding up
  // later tasks; each executor that runs on this worker adds its own (several
  // share one worker across hosts: csrc/torch/hierarchy.h). Between polls the
  // worker backs off (yield, then an idle wait, below, or sleeps up to
  // 200 us) and wakes at once for a new task. Returns the poll's id for
  // remove_idle_poll, which waits for a poll round in progress to end.
  int add_idle_poll(std::function<bool()> poll);
  void remove_idle_poll(int id);
  // Called by a task (on the executing thread) that left work in flight.
  void kick() {
    std::lock_guard<std::mutex> lk(mu_);
    poll_pending_ = true;
  }

  // Optional: after a few idle yields the worker calls wait(max_ns) (owning
  // the executing role, like a task) instead of napping on its own; wait
  // returns false if it cannot wait (the worker then naps). submit() calls
  // wake() to end such a wait early. Transport::idle_wait / interrupt fit.
  // Cleared (nullptr) by its owner's close, after a drain (no wait runs then).
  void set_idle_wait(std::function<bool(int64_t)> wait, std::function<void()> wake) {
    std::lock_guard<std::mutex> lk(mu_);
    idle_wait_ = std::move(wait);
    wake_ = std::move(wake);
  }

 private:
  // try_run_inline's two halves: claim the worker when it is idle; release it.
  bool claim_idle();
  void release_inline();
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  bool has_task() const { return !queue_.empty() || !urgent_.empty(); }

  struct Task {
    std::function<void()> run;
    bool post_only;
  };
  std::deque<Task> queue_;
  std::deque<Task> urgent_;  // submitted on the worker thread; run first
  bool busy_ = false;
  int ahead_ = 0;              // run_posts_ahead's tasks running (worker thread only)
  bool poll_pending_ = false;  // guarded by mu_
  // Runs every idle poll; true while any has work pending.
  bool poll_all();
  std::mutex polls_mu_;  // held while the polls run
  std::vector<std::pair<int, std::function<bool()>>> polls_;
  int next_poll_id_ = 0;
  std::function<bool(int64_t)> idle_wait_;
  std::function<void()> wake_;
  bool in_idle_wait_ = false;  // guarded by mu_
  bool stop_ = false;
  int drainers_ = 0;  // threads in drain(), guarded by mu_
  std::thread thread_;
};

}  // namespace pycomm
