// Unit tests of csrc/core/deferred_p2p (built and run by
// tests/test_deferred_p2p.py): each scenario drives DeferredP2P through a
// fake transport and a fake clock, on one thread, and cites the rule of
// deferred_p2p.h it checks. The ops' callbacks stand for then() callbacks
// and the peer's reactions (a message arrives once something was sent).
//
//   deferred_p2p_driver --list      the scenarios, one a line
//   deferred_p2p_driver SCENARIO    exit 0 when it passed; else what failed
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "deferred_p2p.h"

using namespace pycomm;
using std::chrono::milliseconds;

namespace {

constexpr milliseconds kTimeout{1000};

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) throw std::runtime_error(cat(__FILE__, ":", __LINE__, ": " #cond)); \
  } while (0)

// Transport::test over handles the scenario marks done; records each test.
struct FakeTransfers final : DeferredP2P::Transfers {
  std::map<Handle, bool> posted;          // handle -> its transfers are done
  std::map<Handle, std::string> failing;  // handle -> the error its test throws
  std::vector<Handle> tested;
  bool aborted = false;
  DeferredP2P::Clock::time_point clock{};

  bool done(Handle h) override {
    tested.push_back(h);
    if (failing.count(h)) throw CommError(failing[h]);
    auto it = posted.find(h);
    if (it == posted.end()) throw std::logic_error(cat("handle ", h, " tested after it ended"));
    if (!it->second) return false;
    posted.erase(it);  // a true test consumes the handle
    return true;
  }
  void check_not_aborted() override {
    if (aborted) throw CommError("communicator aborted (by the test)");
  }
  DeferredP2P::Clock::time_point now() override { return clock; }
};

// One rank's executor, reduced to what the component sees: named ops, a log
// of what their callbacks did, and waits that poll like Work::wait.
class Rank {
 public:
  Rank() : deferred(transfers, kTimeout) {}

  // Posts op `name` (one message) whose callback, run as it completes, is `then`.
  // `ahead`: posted ahead of its turn by a wait (rule 7).
  void post(const std::string& name, P2POp::Kind kind, int peer, int tag = 0,
            std::function<void()> then = {}, bool ahead = false) {
    Rec& rec = ops_[name];
    rec.handle = next_handle_++;
    transfers.posted[rec.handle] = arrived_.count(name) > 0;
    P2POp op{kind, nullptr, 0, peer, kUser, tag};
    DeferredP2P::Completion completion{
        [this, name, then] { ended(name, "", then); },
        [this, name, then](const std::exception& e) { ended(name, e.what(), then); }};
    deferred.add(rec.handle, &op, 1, describe_peers(&op, 1), &rec, std::move(completion), ahead);
  }
  // The message of op `name` arrived (before or after it was posted).
  void arrive(const std::string& name) {
    arrived_.insert(name);
    if (ops_.count(name) && transfers.posted.count(ops_[name].handle)) {
      transfers.posted[ops_[name].handle] = true;
    }
  }
  Handle handle(const std::string& name) { return ops_.at(name).handle; }
  bool tested(const std::string& name) {
    for (Handle h : transfers.tested) {
      if (h == handle(name)) return true;
    }
    return false;
  }
  const std::string& error(const std::string& name) { return ops_.at(name).error; }

  // Work::wait on the worker: polls for `name` until it completed; the fake
  // clock runs 1 ms a poll, so an op held back for ever times out. Returns
  // false where Work::wait raises "queued behind" (rule 6).
  bool wait(const std::string& name) {
    const Rec* id = ops_.count(name) ? &ops_.at(name) : &unknown_;
    for (int i = 0; i < 10 * static_cast<int>(kTimeout.count()); ++i) {
      if (id->finished) return true;
      if (!deferred.poll(id)) return id->finished;
      transfers.clock += milliseconds(1);
    }
    throw std::runtime_error("wait(" + name + ") spun past ten timeouts");
  }

  FakeTransfers transfers;
  DeferredP2P deferred;
  std::vector<std::string> log;  // "begin a" or "fail a: why", then "end a"

 private:
  struct Rec {
    Handle handle = 0;
    bool finished = false;
    std::string error;
  };
  void ended(const std::string& name, const std::string& error, const std::function<void()>& then) {
    Rec& rec = ops_.at(name);
    if (rec.finished) throw std::logic_error(name + " completed twice");
    rec.finished = true;
    rec.error = error;
    log.push_back(error.empty() ? "begin " + name : "fail " + name + ": " + error);
    if (then) then();  // a then() callback runs on failure too
    log.push_back("end " + name);
  }

  std::map<std::string, Rec> ops_;
  std::set<std::string> arrived_;
  Rec unknown_;
  Handle next_handle_ = 1;
};

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " | ") + x;
  return s;
}
#define CHECK_LOG(rank, ...) \
  CHECK_EQ_LOG(joined((rank).log), joined(std::vector<std::string>{__VA_ARGS__}))
#define CHECK_EQ_LOG(got, want)                                                      \
  do {                                                                               \
    if ((got) != (want)) {                                                           \
      throw std::runtime_error(                                                      \
          cat(__FILE__, ":", __LINE__, ": log\n  got:  ", got, "\n  want: ", want)); \
    }                                                                                \
  } while (0)

constexpr P2POp::Kind kSend = P2POp::kSend;
constexpr P2POp::Kind kRecv = P2POp::kRecv;

// ---------------------------------------------------------------- scenarios

// test_p2p_both_directions: a posted op completes once its transfers are
// done; the idle poll reports pending ops (rule 6) until none is left.
void completes_posted_ops() {
  Rank r;
  r.post("s", kSend, 1);
  r.post("x", kRecv, 1);
  CHECK(r.deferred.poll());
  CHECK(r.log.empty());
  r.arrive("x");
  CHECK(r.deferred.poll());  // s is still posted
  CHECK_LOG(r, "begin x", "end x");
  r.arrive("s");
  CHECK(!r.deferred.poll());
  CHECK_LOG(r, "begin x", "end x", "begin s", "end s");
  CHECK(r.deferred.size() == 0);
}

// Rule 1 (gloo notices messages in any order): a later receive of the same
// key is not tested, let alone completed, before the earlier one ends.
void same_key_ends_in_posting_order() {
  Rank r;
  r.post("a", kRecv, 1);
  r.post("b", kRecv, 1);
  r.arrive("b");
  CHECK(r.deferred.poll());
  CHECK(r.log.empty() && r.tested("a") && !r.tested("b"));
  r.arrive("a");
  CHECK(!r.deferred.poll());
  CHECK_LOG(r, "begin a", "end a", "begin b", "end b");
}

// Rule 1, which ops pair in order (test_recv_from_any_source,
// test_tags_match_regardless_of_order): a receive from any rank pairs with
// every receive of its tag; other tags, other peers and sends do not pair.
void which_ops_pair_in_order() {
  Rank r;
  r.post("any", kRecv, kAnySource, 3);
  r.post("from2", kRecv, 2, 3);               // pairs with `any`
  r.post("tag4", kRecv, 2, 4);                // other tag
  r.post("send2", kSend, 2, 3);               // other kind
  r.post("from1", kRecv, 1, 0);               // other tag, other peer
  r.post("from1_any", kRecv, kAnySource, 0);  // pairs with from1
  for (const char* name : {"from2", "tag4", "send2", "from1_any"}) r.arrive(name);
  CHECK(r.deferred.poll());
  CHECK_LOG(r, "begin tag4", "end tag4", "begin send2", "end send2");
  CHECK(!r.tested("from2") && !r.tested("from1_any"));
  r.arrive("any");
  r.arrive("from1");
  CHECK(!r.deferred.poll());
  CHECK_LOG(r, "begin tag4", "end tag4", "begin send2", "end send2", "begin any", "end any",
            "begin from2", "end from2", "begin from1", "end from1", "begin from1_any",
            "end from1_any");
  const MatchKey from1{kRecv, 1, 0}, from2{kRecv, 2, 0}, any{kRecv, kAnySource, 0};
  const MatchKey to1{kSend, 1, 0};
  CHECK(from1.pairs_in_order_with(any) && any.pairs_in_order_with(from2));
  CHECK(!from1.pairs_in_order_with(from2) && !to1.pairs_in_order_with(from1));
}

// test_p2p_posted_and_waited_in_p2p_callbacks: callbacks of ops that ended
// together each post an isend and wait for an irecv there (rule 2: the poll
// survives ops added and completed under it).
void callbacks_post_and_wait() {
  Rank r;
  const int k = 6;
  std::vector<std::string> want;
  for (int i = 0; i < k; ++i) r.post(cat("send", i), kSend, 1);
  for (int i = 0; i < k; ++i) {
    const std::string echo = cat("echo", i);
    r.post(cat("got", i), kRecv, 2, 0, [&r, i, echo] {
      r.post(cat("echo_send", i), kSend, 1, 100 + i);
      r.arrive(cat("echo_send", i));
      r.post(echo, kRecv, 2, 100 + i);
      r.arrive(echo);
      CHECK(r.wait(echo));
    });
    r.arrive(cat("send", i));
    r.arrive(cat("got", i));
  }
  for (int i = 0; i < k; ++i) want.insert(want.end(), {cat("begin send", i), cat("end send", i)});
  for (int i = 0; i < k; ++i) {
    want.insert(want.end(),
                {cat("begin got", i), cat("begin echo_send", i), cat("end echo_send", i),
                 cat("begin echo", i), cat("end echo", i), cat("end got", i)});
  }
  CHECK(!r.deferred.poll());
  CHECK_EQ_LOG(joined(r.log), joined(want));
  CHECK(r.deferred.size() == 0);
}

// Rule 3 (test_p2p_callback_waits_then_sends): the first callback waits for
// x, then sends what the peer needs before it sends y, which the second
// callback waits for. The second op, ended in the same poll (`same_poll`) or
// while the first callback waits, must not complete inside the first one's
// wait: its callback would wait for y until the timeout.
void waits_then_sends(bool same_poll) {
  Rank r;
  r.post("first", kRecv, 1, 0, [&r, same_poll] {
    if (!same_poll) r.arrive("second");
    r.post("x", kRecv, 1, 1);
    CHECK(r.wait("x"));
    r.post("x_plus_1", kSend, 1, 2);
    r.arrive("x_plus_1");
    r.arrive("y");  // the peer's answer to x_plus_1
  });
  r.post("second", kRecv, 1, 0, [&r] {
    r.post("y", kRecv, 1, 3);
    CHECK(r.wait("y"));
  });
  r.arrive("first");
  r.arrive("x");
  if (same_poll) r.arrive("second");
  while (r.deferred.poll()) r.transfers.clock += milliseconds(1);
  // x_plus_1 is not waited for: it completes in posting order, after second
  CHECK_LOG(r, "begin first", "begin x", "end x", "end first", "begin second", "begin y", "end y",
            "end second", "begin x_plus_1", "end x_plus_1");
}
void callback_waits_then_sends_same_poll() { waits_then_sends(true); }
void callback_waits_then_sends_later_poll() { waits_then_sends(false); }

// Rule 7 (test_p2p_callback_waits_then_sends[late]): as above, but the
// caller issues `second` only while the first callback waits for x (its
// wait posts it ahead: on gloo the peer sends x only after second's message
// was received). second, of first's key, must neither be tested inside the
// callback nor hold back `third`, which the callback posts with that key;
// it completes after the callback, and its own callback waits for y.
void posted_ahead_while_a_callback_waits() {
  Rank r;
  r.post("first", kRecv, 1, 0, [&r] {
    r.post("x", kRecv, 1, 1);
    // the wait for x begins by posting second (Worker::run_posts_ahead)
    r.post(
        "second", kRecv, 1, 0,
        [&r] {
          r.post("y", kRecv, 1, 3);
          CHECK(r.wait("y"));
        },
        /*ahead=*/true);
    r.arrive("second");
    r.arrive("x");  // the peer sent x once second received its message
    CHECK(r.wait("x") && r.error("x").empty());
    r.post("third", kRecv, 1, 0);
    r.arrive("third");
    CHECK(r.wait("third") && r.error("third").empty());
    CHECK(!r.tested("second"));
    r.post("x_plus_1", kSend, 1, 2);
    r.arrive("x_plus_1");
    r.arrive("y");
  });
  r.arrive("first");
  while (r.deferred.poll()) r.transfers.clock += milliseconds(1);
  CHECK_LOG(r, "begin first", "begin x", "end x", "begin third", "end third", "end first",
            "begin second", "begin y", "end y", "end second", "begin x_plus_1", "end x_plus_1");
  CHECK(r.deferred.size() == 0);
}

// Rule 7 (test_p2p_callback_of_a_collective_waits_then_sends): a wait in
// a callback that no deferred op opened (a collective's, floor 0) posts
// `second` ahead; only the idle poll, after it, tests and completes it.
void posted_ahead_waits_for_the_idle_poll() {
  Rank r;
  r.post("x", kRecv, 1, 1);
  r.post("second", kRecv, 1, 0, {}, /*ahead=*/true);
  r.arrive("second");
  r.arrive("x");
  CHECK(r.wait("x") && r.error("x").empty());
  CHECK(!r.tested("second"));
  CHECK_LOG(r, "begin x", "end x");
  CHECK(!r.deferred.poll());
  CHECK_LOG(r, "begin x", "end x", "begin second", "end second");
}

// Rule 4 (test_p2p_callback_waits_for_older_op): a callback waits for an op
// posted before it began: set aside in the same poll (`same_poll`), the
// wait completes it at once and the outer poll skips it; still posted, the
// wait tests it though it is older than the callback's scope.
void waits_for_older_op(bool same_poll) {
  Rank r;
  r.post("a", kRecv, 1, 0, [&r, same_poll] {
    if (!same_poll) r.arrive("b");
    CHECK(r.wait("b"));
  });
  r.post("b", kRecv, 1, 5);
  r.arrive("a");
  if (same_poll) r.arrive("b");
  CHECK(!r.deferred.poll());
  CHECK_LOG(r, "begin a", "begin b", "end b", "end a");
  CHECK(r.deferred.size() == 0);
}
void callback_waits_for_older_op_set_aside() { waits_for_older_op(true); }
void callback_waits_for_older_op_posted() { waits_for_older_op(false); }

// Rules 1 and 3 (test_p2p_callback_waits_behind_older_same_key): a and b of
// one key end in one poll; a's callback posts and waits for c of that key.
// b, set aside and older than the callback, must not hold c back (it did:
// c timed out).
void set_aside_older_op_holds_nothing_back() {
  Rank r;
  r.post("a", kRecv, 1, 0, [&r] {
    r.post("c", kRecv, 1);
    r.arrive("c");
    CHECK(r.wait("c"));
  });
  r.post("b", kRecv, 1);
  r.arrive("a");
  r.arrive("b");
  CHECK(!r.deferred.poll());
  CHECK_LOG(r, "begin a", "begin c", "end c", "end a", "begin b", "end b");
}

// Rules 3 and 6 (test_p2p_callback_waits_for_queued_op_while_older_pending):
// inside a's callback, a wait for an op the component does not hold (a
// collective queued behind the callback) stops at once although the older z
// is still posted; z is neither tested nor completed there.
void wait_for_unknown_op_stops_while_older_pending() {
  Rank r;
  r.post("z", kRecv, 1, 7);
  bool waited = true;
  r.post("a", kRecv, 1, 0, [&r, &waited] {
    r.arrive("z");
    r.transfers.tested.clear();
    waited = r.wait("queued collective");
    CHECK(!r.tested("z"));
  });
  r.arrive("a");
  CHECK(r.deferred.poll());  // z was tested before a ended: still posted
  CHECK(!waited);
  CHECK_LOG(r, "begin a", "end a");
  CHECK(!r.deferred.poll());
  CHECK_LOG(r, "begin a", "end a", "begin z", "end z");
}

// Rule 5 (test_dead_sender_fails_within_the_timeout, the stuck-peer tests):
// past its deadline an op fails with a message naming the timeout and its
// peers; a later op of its key is tested then, and has a deadline of its own.
void deadline_fails_an_op_naming_its_peers() {
  Rank r;
  r.post("a", kRecv, 1, 3);
  r.transfers.clock += milliseconds(500);
  r.post("b", kRecv, 1, 3);
  r.transfers.clock += milliseconds(500);
  CHECK(r.deferred.poll());
  CHECK(r.log.empty() && !r.tested("b"));
  r.transfers.clock += milliseconds(1);  // past a's deadline, not b's
  CHECK(r.deferred.poll());
  CHECK(r.error("a").find("timed out after 1000 ms") != std::string::npos);
  CHECK(r.error("a").find("(recv from rank 1 with tag 3)") != std::string::npos);
  CHECK_LOG(r, "fail a: " + r.error("a"), "end a");
  CHECK(r.tested("b"));
  r.arrive("b");
  CHECK(!r.deferred.poll());
  CHECK(r.log.back() == "end b");
}

// Rule 5: an abort fails every posted op at once, held back or not, in
// posting order; a transport error fails its op with the transport's words.
void abort_and_transport_errors_fail_ops() {
  Rank r;
  r.post("a", kRecv, 1);
  r.post("b", kRecv, 1);
  r.post("c", kSend, 2);
  r.transfers.failing[r.handle("c")] = "connection closed by peer";
  CHECK(r.deferred.poll());
  CHECK_LOG(r, "fail c: connection closed by peer", "end c");
  CHECK(!r.tested("b"));
  r.transfers.aborted = true;
  CHECK(!r.deferred.poll());
  CHECK_LOG(r, "fail c: connection closed by peer", "end c",
            "fail a: communicator aborted (by the test)", "end a",
            "fail b: communicator aborted (by the test)", "end b");
}

// Rule 5: a failed op's callbacks open no scope; a poll nested in them
// completes an older op (in a done op's callbacks it would not: rule 3).
void failed_op_opens_no_scope() {
  Rank r;
  r.post("old", kRecv, 1, 4);
  r.post("f", kRecv, 2, 0, [&r] {
    r.post("n", kRecv, 3, 9);
    r.arrive("n");
    r.arrive("old");
    CHECK(r.wait("n"));
  });
  r.transfers.failing[r.handle("f")] = "f broke";
  CHECK(!r.deferred.poll());
  CHECK_LOG(r, "fail f: f broke", "begin old", "end old", "begin n", "end n", "end f");
}

// CallbackScope: a callback that throws leaves no scope behind; the older
// op still completes in a later poll.
void scope_ends_when_a_callback_throws() {
  Rank r;
  r.post("old", kRecv, 1, 1);
  r.post("a", kRecv, 1, 0, [] { throw std::runtime_error("callback threw"); });
  r.arrive("a");
  bool thrown = false;
  try {
    r.deferred.poll();
  } catch (const std::runtime_error&) {
    thrown = true;
  }
  CHECK(thrown);
  r.arrive("old");
  CHECK(!r.deferred.poll());
  CHECK(r.log.back() == "end old");
}

const std::map<std::string, void (*)()> kScenarios = {
    {"completes_posted_ops", completes_posted_ops},
    {"same_key_ends_in_posting_order", same_key_ends_in_posting_order},
    {"which_ops_pair_in_order", which_ops_pair_in_order},
    {"callbacks_post_and_wait", callbacks_post_and_wait},
    {"callback_waits_then_sends_same_poll", callback_waits_then_sends_same_poll},
    {"callback_waits_then_sends_later_poll", callback_waits_then_sends_later_poll},
    {"posted_ahead_while_a_callback_waits", posted_ahead_while_a_callback_waits},
    {"posted_ahead_waits_for_the_idle_poll", posted_ahead_waits_for_the_idle_poll},
    {"callback_waits_for_older_op_set_aside", callback_waits_for_older_op_set_aside},
    {"callback_waits_for_older_op_posted", callback_waits_for_older_op_posted},
    {"set_aside_older_op_holds_nothing_back", set_aside_older_op_holds_nothing_back},
    {"wait_for_unknown_op_stops_while_older_pending",
     wait_for_unknown_op_stops_while_older_pending},
    {"deadline_fails_an_op_naming_its_peers", deadline_fails_an_op_naming_its_peers},
    {"abort_and_transport_errors_fail_ops", abort_and_transport_errors_fail_ops},
    {"failed_op_opens_no_scope", failed_op_opens_no_scope},
    {"scope_ends_when_a_callback_throws", scope_ends_when_a_callback_throws},
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s --list | SCENARIO\n", argv[0]);
    return 2;
  }
  const std::string what = argv[1];
  if (what == "--list") {
    for (const auto& [name, run] : kScenarios) std::printf("%s\n", name.c_str());
    return 0;
  }
  auto it = kScenarios.find(what);
  if (it == kScenarios.end()) {
    std::fprintf(stderr, "unknown scenario %s\n", what.c_str());
    return 2;
  }
  try {
    it->second();
  } catch (const std::exception& e) {
    std::printf("FAILED %s: %s\n", what.c_str(), e.what());
    return 1;
  }
  std::printf("passed %s\n", what.c_str());
  return 0;
}
