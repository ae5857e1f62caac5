// Deferred point-to-point: user isend/irecv groups that the CPU executor
// posts and sets aside, and completes later, from its worker's idle poll and
// from waits inside Future callbacks (csrc/torch/cpu_executor.cpp run_p2p).
// Completing an op runs its callbacks right there, and they may post more
// ops and wait for them (Work::wait's pump polls again, nested). Which op
// may complete inside which callback follows the rules below; the code cites
// them by number.
//
//  1. Pairing order. Two ops pair in order when their messages pair with the
//     peer's by posting order: same kind and tag, and the same peer or either
//     from any rank (MatchKey::pairs_in_order_with). An op is not tested while
//     an op it pairs with is unfinished: an earlier one still posted, or one
//     set aside (rule 2) and not completed yet. So such ops end in posting
//     order, as their messages matched, whatever order the transport notices
//     them in (gloo does on threads of its own); callbacks that wait for
//     peers then wait in the same order on every rank.
//  2. Test, then complete. A poll tests the posted ops in posting order and
//     sets aside (kEnded) those that ended; then it completes them, in
//     posting order. Callbacks may post (appended) and poll (nested) at will.
//  3. Callback scope. While a completed op's callbacks run (CallbackScope),
//     a poll nested in them tests only the ops posted since they began, plus
//     the op it waits for (rule 4); older ones complete after the callbacks
//     return, so an older op's callbacks never run inside a newer one's. Set
//     aside ops older than the scope do not hold anything back under rule 1
//     (they complete after the callbacks, which may wait for what they hold
//     back). No order serves every pattern: a callback that waits for what
//     an older op's callbacks send waits until the timeout (chaining with
//     then() instead of waiting avoids it).
//  4. The waited op. A poll for a wait (`waited`) tests that op whatever its
//     age; if an outer poll set it aside already, the wait completes it at
//     once, and the outer poll skips it.
//  5. Failure ends an op. An op fails when the communicator aborted (tested
//     first, so held back ops fail too), its transfers failed, or its
//     deadline passed (also while held back under rule 1). It is set aside
//     and completed like a done op, but its callbacks open no scope (rule 3):
//     a failure aborts the communicator anyway.
//  6. What a poll reports. A poll returns true while an op it may complete
//     (in its scope, or the waited one) is still posted. A wait for any other
//     op (one queued behind the running callback) must stop polling and
//     raise rather than spin.
//  7. Posted ahead. An op another thread issued and a wait inside a callback
//     posted ahead of its turn (Worker::run_posts_ahead: a peer whose send
//     waits for its receive, gloo's, may need it before it sends what the
//     callback waits for) is tested only by the idle poll (`waited` null),
//     where no callback runs: its callbacks never run inside one, and it
//     holds none of their ops back under rule 1 (it is not tested there).
//     Only posts at the head of the caller's queue go ahead: one queued
//     behind a collective, or a synchronous send/recv, keeps its turn.
//
// Single-threaded: only the executing thread (the worker) touches it. No
// torch: an op's completion is a pair of functions, a wait names its op by
// an opaque id (the executor's Work), and the transport is seen through
// Transfers, which tests fake (tests/test_deferred_p2p.py).
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <list>
#include <string>
#include <vector>

#include "transport.h"

namespace pycomm {

// What a user message matches by: its kind, peer and tag.
struct MatchKey {
  int kind;
  int peer;  // or kAnySource
  int tag;
  // Rule 1: same kind and tag, and the same peer or either from any rank.
  bool pairs_in_order_with(const MatchKey& other) const {
    return kind == other.kind && tag == other.tag &&
           (peer == other.peer || peer == kAnySource || other.peer == kAnySource);
  }
};

// "send to rank 1, recv from any rank with tag 3": a group's peers, for errors.
std::string describe_peers(const P2POp* ops, size_t n);

class DeferredP2P {
 public:
  using Clock = std::chrono::steady_clock;

  // The component's view of the transport and the communicator.
  class Transfers {
   public:
    virtual ~Transfers() = default;
    // Transport::test: true once group `h` is done (consuming `h`); throws
    // when its transfers failed.
    virtual bool done(Handle h) = 0;
    // Throws (CommError) once every deferred op must fail: the communicator
    // aborted (rule 5).
    virtual void check_not_aborted() = 0;
    virtual Clock::time_point now() { return Clock::now(); }
  };

  // How an op ends: `complete` on success, `fail` with the error otherwise.
  // Both run the op's callbacks, which may post and poll (rule 2).
  struct Completion {
    std::function<void()> complete;
    std::function<void(const std::exception&)> fail;
  };

  DeferredP2P(Transfers& transfers, std::chrono::milliseconds timeout)
      : transfers_(transfers), timeout_(timeout) {}
  DeferredP2P(const DeferredP2P&) = delete;
  DeferredP2P& operator=(const DeferredP2P&) = delete;

  // Takes group `h`, posted from ops[0..n) (`peers`: describe_peers of
  // them), until it ends; its deadline is the timeout from now. `id` names
  // it for a wait (poll's `waited`). `ahead`: posted ahead of its turn,
  // inside a wait (rule 7).
  void add(Handle h, const P2POp* ops, size_t n, std::string peers, const void* id,
           Completion completion, bool ahead = false);

  // Tests the posted ops and completes those that ended (rules 1-5).
  // `waited`: the id of the op a wait drives (rule 4), nullptr for the idle
  // poll. Returns whether an op it may complete is still posted (rule 6).
  bool poll(const void* waited = nullptr);

  // Ops not completed yet (posted or set aside).
  size_t size() const { return ops_.size(); }

 private:
  enum class State {
    kPosted,      // its transfers are in flight: polls test it
    kEnded,       // done or failed, set aside by a poll until its turn (rule 2)
    kCompleting,  // its callbacks run or ran; the poll that set it aside removes it
  };
  struct Op {
    Handle handle;
    std::vector<MatchKey> keys;  // one per message of the group
    std::string peers;
    const void* id;
    Completion completion;
    Clock::time_point deadline;
    uint64_t seq;  // posting order
    bool ahead;    // rule 7: posted ahead of its turn, inside a wait
    State state = State::kPosted;
    std::exception_ptr error;  // why it failed (rule 5), once ended
  };
  using Ops = std::list<Op>;  // in posting order; nodes stay put while callbacks run

  // Rule 3: while alive, polls test only ops posted from its construction on.
  class CallbackScope {
   public:
    explicit CallbackScope(DeferredP2P& d) : d_(d), outer_(d.floor_) { d.floor_ = d.next_seq_; }
    ~CallbackScope() { d_.floor_ = outer_; }
    CallbackScope(const CallbackScope&) = delete;
    CallbackScope& operator=(const CallbackScope&) = delete;

   private:
    DeferredP2P& d_;
    const uint64_t outer_;
  };

  bool in_scope(const Op& op, const void* waited) const {
    if (waited != nullptr && op.id == waited) return true;  // rule 4
    if (op.ahead) return waited == nullptr;                 // rule 7: the idle poll
    return op.seq >= floor_;                                // rule 3
  }
  std::vector<MatchKey> set_aside_keys() const;
  bool ended(Op& op, const std::vector<MatchKey>& unfinished);
  void complete(Op& op);

  Transfers& transfers_;
  const std::chrono::milliseconds timeout_;
  Ops ops_;
  uint64_t next_seq_ = 0;  // Op::seq of the next one added
  uint64_t floor_ = 0;     // rule 3: polls test ops of this seq or later
};

}  // namespace pycomm
