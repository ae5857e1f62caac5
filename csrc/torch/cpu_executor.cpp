// The CPU executor: the transport's ops run on a worker thread in submission
// order; synchronous calls run inline when nothing is queued.
#include <chrono>
#include <mutex>

#include "../core/check.h"
#include "../core/deferred_p2p.h"
#include "../core/reduce.h"
#include "../core/worker.h"
#include "checks.h"
#include "executor.h"

namespace pycomm {

std::unique_ptr<Executor> Executor::split(int, int, const CommOptions&) {
  throw UsageError(join_msg({"split: the ", transport_name(),
                             " transport has no split of its own (groups of it are built "
                             "through the store: Communicator.new_group / split)"}));
}

void Executor::share_worker_of(Executor&, bool) {
  throw UsageError(join_msg(
      {"share_worker_of: the ", transport_name(), " executor has no worker thread to share"}));
}

size_t scratch_bytes(size_t slice_bytes, int world_size) {
  return std::max(2 * slice_bytes + 64, static_cast<size_t>(world_size) * sizeof(Fingerprint));
}

namespace {

class CpuExecutor final : public Executor, private DeferredP2P::Transfers {
 public:
  CpuExecutor(std::unique_ptr<Transport> transport, const CommOptions& options)
      : Executor(transport->rank(), transport->world_size(), transport->name()),
        transport_(std::move(transport)),
        timeout_(options.timeout_ms),
        slice_bytes_(static_cast<size_t>(options.slice_bytes)),
        scratch_(scratch_bytes(slice_bytes_, transport_->world_size())) {
    transport_->set_timeout(timeout_);
    if (transport_->checks_interrupts()) transport_->set_interrupt_check(&check_interrupt);
    worker_ = std::make_shared<Worker>();
    owns_idle_wait_ = true;
    poll_id_ = worker_->add_idle_poll([this] { return deferred_.poll(); });
    // The worker's owner (the executor that made it) is the last to close.
    worker_->set_idle_wait([this](int64_t ns) { return transport_->idle_wait(ns); },
                           [this] { transport_->interrupt(); });
  }

  void share_worker_of(Executor& owner, bool idle_wait) override {
    auto* other = dynamic_cast<CpuExecutor*>(&owner);
    if (other == nullptr || other == this) {
      throw UsageError("share_worker_of: needs another CPU executor");
    }
    worker_->drain();
    worker_->remove_idle_poll(poll_id_);
    worker_ = other->worker_;  // this one's own thread ends here
    owns_idle_wait_ = false;
    poll_id_ = worker_->add_idle_poll([this] { return deferred_.poll(); });
    if (idle_wait) {
      worker_->set_idle_wait([this](int64_t ns) { return transport_->idle_wait(ns); },
                             [this] { transport_->interrupt(); });
      owns_idle_wait_ = true;
      other->owns_idle_wait_ = false;
    }
  }
  std::function<bool()> progress_fn() override {
    // Only on the worker: the transport is the worker's alone (gloo's
    // background waiters block as they are).
    return
        [this] { return worker_ && worker_->is_current() && transport_ && transport_->progress(); };
  }
  void set_while_blocked(std::function<bool()> f) override {
    transport_->set_while_blocked(std::move(f));
  }

  // Without close() (it was refused on the worker thread, say): a worker
  // shared across hosts outlives this executor, so its poll and idle wait,
  // which reach into it, go (not from the worker itself, which runs them).
  ~CpuExecutor() override {
    if (!worker_ || worker_->is_current()) return;
    worker_->remove_idle_poll(poll_id_);
    if (owns_idle_wait_) worker_->set_idle_wait(nullptr, nullptr);
  }

  c10::Device device() const override { return c10::Device(c10::kCPU); }
  bool shared_buffers() const override { return transport_->shared_buffers() != nullptr; }
  uint64_t symmetric_domain() const override {
    return transport_->shared_buffers() ? transport_->shared_buffers()->symmetric_domain() : 0;
  }
  bool native_collectives() const override { return transport_->native() != nullptr; }
  bool on_own_thread() const override { return worker_ && worker_->is_current(); }
  at::Tensor empty_like(const at::Tensor& t) override { return at::empty_like(t); }

  c10::intrusive_ptr<Work> new_work(const char* op, uint64_t seq,
                                    std::vector<at::Tensor> outputs) override {
    auto work = c10::make_intrusive<Work>(op, seq, std::move(outputs));
    work->set_worker(worker_.get());
    // A wait on the worker thread (in a Future callback) for a pending
    // isend/irecv drives them itself, after posting the isend/irecv other
    // threads queued meanwhile (deferred_p2p.h, rule 7).
    work->set_pump([this](const Work* target) {
      if (worker_ && !aborted_) worker_->run_posts_ahead();
      return deferred_.poll(target);
    });
    work->set_on_interrupt([this](const std::string& why) { abort(why); });
    return work;
  }

  void run(const c10::intrusive_ptr<Work>& work, Body body, Wait wait,
           std::vector<at::Tensor> keep) override {
    auto task = [this, work, body = std::move(body), keep = std::move(keep)]() {
      if (fail_if_aborted(work)) return;
      try {
        Context ctx{*transport_, reducer_, scratch_.data(), scratch_.size(), slice_bytes_};
        body(ctx);
        work->complete();
      } catch (const std::exception& e) {
        fail_op(*this, *work, e, "cpu");
      }
    };
    if (worker_->is_current()) {
      // An op issued from a Future callback, which runs on the worker as an
      // op completes (nested): synchronous or not, it runs right here, between
      // that op and the next one, so a wait on it (Work.wait, or the future's
      // wait, as torch's PowerSGD hook does) finds it complete instead of
      // waiting for ourselves. Callbacks fire in op order, so every rank runs
      // it at the same point of its op sequence.
      task();
      if (wait != Wait::kAsync) work->wait();  // a synchronous op's error is thrown
      return;
    }
    if (wait == Wait::kAsync) {
      worker_->submit(std::move(task));
      return;
    }
    if (!(transport_->checks_interrupts() || !on_main_thread()) || !worker_->try_run_inline(task)) {
      // Queued behind other work, or on a transport whose waits cannot check
      // for SIGINT (gloo): Work::wait below can.
      worker_->submit(std::move(task));
    }
    work->wait();
  }

  // Synchronous: post and wait like run(). Asynchronous: the task only posts
  // and hands the group to deferred_, which the worker's idle poll and waits
  // inside callbacks (Work::set_pump) complete, so a pending isend never
  // blocks a later irecv or collective.
  void run_p2p(const c10::intrusive_ptr<Work>& work, std::vector<P2POp> ops, Wait wait,
               std::vector<at::Tensor> keep) override {
    if (wait != Wait::kAsync) {
      run(
          work, [ops](const Context& ctx) { ctx.transport.exchange(ops.data(), ops.size()); }, wait,
          std::move(keep));
      return;
    }
    std::string peers = describe_peers(ops.data(), ops.size());
    auto post = [this, work, ops, peers = std::move(peers), keep = std::move(keep)] {
      if (fail_if_aborted(work)) return;
      try {
        const Handle h = transport_->post(ops.data(), ops.size());
        DeferredP2P::Completion completion{
            [work] { work->complete(); },
            [this, work, peers](const std::exception& e) { fail_p2p(work, e, peers); }};
        // rule 7: posted ahead of its turn by a wait inside a callback
        deferred_.add(h, ops.data(), ops.size(), peers, work.get(), std::move(completion),
                      worker_->running_ahead());
        worker_->kick();
      } catch (const std::exception& e) {
        fail_p2p(work, e, peers);
      }
    };
    // From a Future callback (on the worker): posted now, in callback order;
    // a wait on it there polls (Work::set_pump) instead of blocking. From
    // another thread: queued, post-only (a wait in a callback may post it
    // ahead of its turn, Worker::run_posts_ahead).
    if (worker_->is_current()) {
      post();
    } else {
      worker_->submit(std::move(post), /*post_only=*/true);
    }
  }

  void close() override {
    worker_->drain();
    worker_->remove_idle_poll(poll_id_);
    if (owns_idle_wait_) worker_->set_idle_wait(nullptr, nullptr);  // it waits on transport_
    worker_.reset();  // the last executor on it joins its thread
    transport_.reset();
  }

  void leak() override {
    new std::shared_ptr<Worker>(std::move(worker_));  // never destroyed: the parent's thread
    (void)transport_.release();
  }

  void abort(const std::string& why) override {
    {
      std::lock_guard<std::mutex> lk(abort_mu_);
      if (aborted_) return;
      abort_reason_ = why;
      aborted_ = true;
    }
    if (transport_) transport_->abort_because(why);
    aborted_now(why);
  }
  bool aborted() const override { return aborted_; }
  std::string abort_reason() const override {
    std::lock_guard<std::mutex> lk(abort_mu_);
    return abort_reason_;
  }

 private:
  // On the worker: fails `work` if an earlier op aborted the communicator.
  bool fail_if_aborted(const c10::intrusive_ptr<Work>& work) {
    if (!aborted_) return false;
    work->fail(std::make_exception_ptr(
        CommError(join_msg({work->op(), " #", std::to_string(work->seq()),
                            ": communicator aborted earlier (", abort_reason(), ")"}))));
    return true;
  }

  // abort_op for a deferred p2p op, naming its peers where the transport's own
  // error does not (gloo's "Connection closed by peer [127.0.0.1]:47338").
  void fail_p2p(const c10::intrusive_ptr<Work>& work, const std::exception& e,
                const std::string& peers) {
    const std::string what = e.what();
    if (dynamic_cast<const Interrupted*>(&e) != nullptr || what.find(peers) != std::string::npos) {
      abort_op(*this, *work, e, "cpu");
    } else {
      abort_op(*this, *work, CommError(what + " (" + peers + ")"), "cpu");
    }
  }

  // DeferredP2P::Transfers: this executor's transport and abort state.
  bool done(Handle h) override { return transport_->test(h); }
  void check_not_aborted() override {
    if (aborted_) throw CommError("communicator aborted (" + abort_reason() + ")");
  }

  std::unique_ptr<Transport> transport_;
  std::chrono::milliseconds timeout_;
  size_t slice_bytes_;
  CpuReducer reducer_;
  std::vector<char> scratch_;
  DeferredP2P deferred_{*this, timeout_};  // user isend/irecv; only the executing thread
  std::shared_ptr<Worker> worker_;         // shared across hosts (share_worker_of)
  int poll_id_ = -1;                       // deferred_'s idle poll on worker_
  bool owns_idle_wait_ = false;            // the worker's idle waits are transport_'s
  std::atomic<bool> aborted_{false};
  mutable std::mutex abort_mu_;
  std::string abort_reason_;
};

}  // namespace

std::unique_ptr<Executor> make_cpu_executor(std::unique_ptr<Transport> transport,
                                            const CommOptions& options) {
  check_options(options);
  return std::make_unique<CpuExecutor>(std::move(transport), options);
}

}  // namespace pycomm
