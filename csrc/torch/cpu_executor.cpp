// The CPU executor: the transport's ops run on a worker thread in submission
// order; synchronous calls run inline when nothing is queued.
#include <chrono>
#include <deque>
#include <list>
#include <mutex>

#include "../core/check.h"
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

size_t scratch_bytes(size_t slice_bytes, int world_size) {
  return std::max(2 * slice_bytes + 64, static_cast<size_t>(world_size) * sizeof(Fingerprint));
}

namespace {

class CpuExecutor final : public Executor {
 public:
  CpuExecutor(std::unique_ptr<Transport> transport, const CommOptions& options)
      : Executor(transport->rank(), transport->world_size(), transport->name()),
        transport_(std::move(transport)),
        timeout_(options.timeout_ms),
        slice_bytes_(static_cast<size_t>(options.slice_bytes)),
        scratch_(scratch_bytes(slice_bytes_, transport_->world_size())) {
    transport_->set_timeout(timeout_);
    if (transport_->checks_interrupts()) transport_->set_interrupt_check(&check_interrupt);
    worker_ = std::make_unique<Worker>();
    worker_->set_idle_poll([this] { return poll_deferred(); });
    worker_->set_idle_wait([this](int64_t ns) { return transport_->idle_wait(ns); },
                           [this] { transport_->interrupt(); });
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
    // isend/irecv drives them itself.
    work->set_pump([this](const Work* target) { return poll_deferred(target); });
    work->set_on_interrupt([this](const std::string& why) { abort(why); });
    return work;
  }

  void run(const c10::intrusive_ptr<Work>& work, Body body, Wait wait,
           std::vector<at::Tensor> keep) override {
    std::function<void()> task = [this, work, body = std::move(body), keep = std::move(keep)]() {
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
  // and the worker's idle poll (poll_deferred) completes the Work, so a
  // pending isend never blocks a later irecv or collective.
  void run_p2p(const c10::intrusive_ptr<Work>& work, std::vector<P2POp> ops, Wait wait,
               std::vector<at::Tensor> keep) override {
    if (wait != Wait::kAsync) {
      run(
          work, [ops](const Context& ctx) { ctx.transport.exchange(ops.data(), ops.size()); }, wait,
          std::move(keep));
      return;
    }
    std::string peers;
    for (size_t i = 0; i < ops.size(); ++i) {
      peers += cat(i ? ", " : "", ops[i].kind == P2POp::kSend ? "send to " : "recv from ");
      peers += ops[i].peer == kAnySource ? std::string("any rank") : cat("rank ", ops[i].peer);
      if (ops[i].tag != 0) peers += cat(" with tag ", ops[i].tag);
    }
    std::function<void()> post = [this, work, ops, peers = std::move(peers),
                                  keep = std::move(keep)] {
      if (fail_if_aborted(work)) return;
      try {
        const Handle h = transport_->post(ops.data(), ops.size());
        std::vector<MatchKey> keys;
        for (const P2POp& op : ops) keys.push_back({op.kind, op.peer, op.tag});
        deferred_.push_back({work, h, std::chrono::steady_clock::now() + timeout_, peers,
                             std::move(keys), next_seq_++});
        worker_->kick();
      } catch (const std::exception& e) {
        fail_p2p(work, e, peers);
      }
    };
    // From a Future callback (on the worker): posted now, in callback order;
    // a wait on it there polls (Work::set_pump) instead of blocking.
    if (worker_->is_current()) {
      post();
    } else {
      worker_->submit(std::move(post));
    }
  }

  void close() override {
    worker_->drain();
    worker_.reset();
    transport_.reset();
  }

  void leak() override {
    (void)worker_.release();
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
  }
  bool aborted() const override { return aborted_; }
  std::string abort_reason() const override {
    std::lock_guard<std::mutex> lk(abort_mu_);
    return abort_reason_;
  }

 private:
  // What a message matches by: two sends (or two receives) with equal keys
  // pair with the peer's messages in posting order. A receive from any rank
  // shares a key with every receive of its tag.
  struct MatchKey {
    int kind;
    int peer;
    int tag;
    bool overtakes(const MatchKey& earlier) const {
      return kind == earlier.kind && tag == earlier.tag &&
             (peer == earlier.peer || peer == kAnySource || earlier.peer == kAnySource);
    }
  };
  struct Deferred {
    c10::intrusive_ptr<Work> work;
    Handle handle;
    std::chrono::steady_clock::time_point deadline;
    std::string peers;           // "send to rank 1, recv from rank 2": for the timeout message
    std::vector<MatchKey> keys;  // one per message of the group
    uint64_t seq;                // posting order
  };

  // An op that ended, set aside by a poll until its turn to complete.
  struct Ending {
    Deferred op;
    std::exception_ptr error;
    bool taken = false;  // completed (or being completed) by some poll
  };

  // Whether `d` would end before an earlier op it pairs in order with.
  static bool ahead_of(const Deferred& d, const std::vector<MatchKey>& pending) {
    for (const MatchKey& k : d.keys) {
      for (const MatchKey& e : pending) {
        if (k.overtakes(e)) return true;
      }
    }
    return false;
  }

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

  // On the executing thread; true while any deferred op is pending. Ops
  // that ended leave deferred_ before their Works complete: completing runs
  // Future callbacks right here, which may post more (push_back) or poll
  // (Work::wait's pump re-enters this function).
  //
  // Ops end in posting order among those that pair in order (MatchKey), as
  // their messages matched: the gloo transport notices its messages on
  // threads of their own, in any order, and a later receive seen first ran
  // its callbacks first. Callbacks that wait for peers then waited in an
  // order no other rank followed (3 ranks, each callback sending an echo and
  // waiting for one: a deadlock in about half the runs). An op is not tested
  // while an earlier one it pairs in order with is pending.
  //
  // In a poll nested in a deferred op's callbacks, only ops posted since
  // they began, and the op waited for, are tested (finish). No order serves
  // every pattern: a callback that waits for a message that depends on
  // another op's callback, one that ended after its own op, waits until the
  // timeout; chaining with then() instead of waiting avoids it.
  //
  // Returns true while an op this poll may complete is pending: a wait on
  // anything else (an op queued behind the running one) must stop pumping
  // and raise rather than spin.
  bool poll_deferred(const Work* target = nullptr) {
    // The waited op may have ended in an outer poll (this is re-entered from
    // callbacks), which set it aside: it completes here, the outer poll skips it.
    for (Ending& e : ending_) {
      if (target != nullptr && !e.taken && e.op.work.get() == target) {
        e.taken = true;
        finish(e);
        return true;
      }
    }
    // Keys that must not be overtaken: the ops that outer polls set aside
    // and have not completed yet, then the pending ones met so far. Those
    // older than the running callback complete after it, so they cannot
    // hold back the ops it waits for (that would wait until the timeout).
    std::vector<MatchKey> pending;
    for (const Ending& e : ending_) {
      if (!e.taken && e.op.seq >= floor_) {
        pending.insert(pending.end(), e.op.keys.begin(), e.op.keys.end());
      }
    }
    std::vector<std::list<Ending>::iterator> ended;
    for (auto it = deferred_.begin(); it != deferred_.end();) {
      // Older than the running callback: after it, unless the callback
      // waits for that very op (`target`, from Work::wait's pump).
      if (it->seq < floor_ && it->work.get() != target) {
        ++it;
        continue;
      }
      std::exception_ptr error;
      if (op_ended(*it, pending, error)) {
        ended.push_back(ending_.insert(ending_.end(), Ending{std::move(*it), error}));
        it = deferred_.erase(it);
      } else {
        pending.insert(pending.end(), it->keys.begin(), it->keys.end());
        ++it;
      }
    }
    for (auto e : ended) {
      if (!e->taken) {
        e->taken = true;
        finish(*e);
      }
      ending_.erase(e);
    }
    for (const Deferred& d : deferred_) {
      if (d.seq >= floor_ || d.work.get() == target) return true;
    }
    return false;
  }

  // Whether deferred op `d` has ended: its transfers are done (a true test()
  // consumes the handle; not tested while it would overtake `pending`), or
  // it failed (`error`: aborted, the transport failed, its deadline passed).
  bool op_ended(const Deferred& d, const std::vector<MatchKey>& pending,
                std::exception_ptr& error) {
    try {
      if (aborted_) throw CommError("communicator aborted (" + abort_reason() + ")");
      if (!ahead_of(d, pending) && transport_->test(d.handle)) return true;
      if (std::chrono::steady_clock::now() > d.deadline) {
        throw CommError(cat("timed out after ", timeout_.count(),
                            " ms, the timeout of this communicator (", d.peers,
                            "); is the peer alive and did it post the matching operation?"));
      }
      return false;
    } catch (const std::exception&) {
      error = std::current_exception();
      return true;
    }
  }

  // Completes (or fails) an op that ended. Its callbacks run now; a poll
  // nested in them (a wait) completes only the ops posted from here on and
  // the one it waits for, so an older deferred op's callbacks never run
  // inside this one's (which may yet send what a peer waits for before it
  // answers an older one). A collective's callbacks (run()) and a failed
  // op's do not set this floor: the failure aborts the communicator anyway.
  void finish(Ending& e) {
    if (e.error) {
      try {
        std::rethrow_exception(e.error);
      } catch (const std::exception& ex) {
        fail_p2p(e.op.work, ex, e.op.peers);
      }
      return;
    }
    const uint64_t outer = floor_;
    floor_ = next_seq_;
    try {
      e.op.work->complete();
    } catch (...) {
      floor_ = outer;
      throw;
    }
    floor_ = outer;
  }

  std::unique_ptr<Transport> transport_;
  std::chrono::milliseconds timeout_;
  size_t slice_bytes_;
  CpuReducer reducer_;
  std::vector<char> scratch_;
  std::deque<Deferred> deferred_;  // touched only by the executing thread
  std::list<Ending> ending_;       // ended, set aside by a poll, not completed yet
  uint64_t next_seq_ = 0;          // Deferred::seq of the next one posted
  uint64_t floor_ = 0;             // polls complete ops of this seq or later
  std::unique_ptr<Worker> worker_;
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
