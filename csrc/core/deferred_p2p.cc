// Deferred point-to-point ops: the rules are listed in deferred_p2p.h.
#include "deferred_p2p.h"

#include <utility>

namespace pycomm {

namespace {
// Rule 1: whether a message of `keys` pairs in order with one of `unfinished`.
bool pairs_with_any(const std::vector<MatchKey>& keys, const std::vector<MatchKey>& unfinished) {
  for (const MatchKey& k : keys) {
    for (const MatchKey& u : unfinished) {
      if (k.pairs_in_order_with(u)) return true;
    }
  }
  return false;
}
}  // namespace

std::string describe_peers(const P2POp* ops, size_t n) {
  std::string peers;
  for (size_t i = 0; i < n; ++i) {
    peers += cat(i ? ", " : "", ops[i].kind == P2POp::kSend ? "send to " : "recv from ");
    peers += ops[i].peer == kAnySource ? std::string("any rank") : cat("rank ", ops[i].peer);
    if (ops[i].tag != 0) peers += cat(" with tag ", ops[i].tag);
  }
  return peers;
}

void DeferredP2P::add(Handle h, const P2POp* ops, size_t n, std::string peers, const void* id,
                      Completion completion, bool ahead) {
  std::vector<MatchKey> keys;
  for (size_t i = 0; i < n; ++i) keys.push_back({ops[i].kind, ops[i].peer, ops[i].tag});
  ops_.push_back({h, std::move(keys), std::move(peers), id, std::move(completion),
                  transfers_.now() + timeout_, next_seq_++, ahead, State::kPosted, nullptr});
}

bool DeferredP2P::poll(const void* waited) {
  // Rule 4: the waited op, set aside by an outer poll, completes here.
  if (waited != nullptr) {
    for (Op& op : ops_) {
      if (op.id == waited && op.state == State::kEnded) {
        complete(op);
        return true;
      }
    }
  }
  // Rule 2: test, setting aside what ended; rule 1: in posting order, each
  // op held back by the unfinished ops it pairs with.
  std::vector<MatchKey> unfinished = set_aside_keys();
  std::vector<Ops::iterator> set_aside;
  for (auto it = ops_.begin(); it != ops_.end(); ++it) {
    if (it->state != State::kPosted || !in_scope(*it, waited)) continue;  // rules 3, 4
    if (ended(*it, unfinished)) {
      it->state = State::kEnded;
      set_aside.push_back(it);
    } else {
      unfinished.insert(unfinished.end(), it->keys.begin(), it->keys.end());
    }
  }
  // Rule 2: then complete them; a nested wait may have completed one (rule 4).
  for (Ops::iterator it : set_aside) {
    if (it->state == State::kEnded) complete(*it);
    ops_.erase(it);
  }
  for (const Op& op : ops_) {
    if (op.state == State::kPosted && in_scope(op, waited)) return true;  // rule 6
  }
  return false;
}

// Rules 1 and 3: the keys of the ops that outer polls set aside and that
// complete within the running scope.
std::vector<MatchKey> DeferredP2P::set_aside_keys() const {
  std::vector<MatchKey> keys;
  for (const Op& op : ops_) {
    if (op.state == State::kEnded && op.seq >= floor_) {
      keys.insert(keys.end(), op.keys.begin(), op.keys.end());
    }
  }
  return keys;
}

// Whether `op` ended: done (tested unless rule 1 holds it back; a true test
// consumes its handle), or failed (rule 5, recorded in op.error).
bool DeferredP2P::ended(Op& op, const std::vector<MatchKey>& unfinished) {
  try {
    transfers_.check_not_aborted();
    if (!pairs_with_any(op.keys, unfinished) && transfers_.done(op.handle)) return true;
    if (transfers_.now() > op.deadline) {
      throw CommError(cat("timed out after ", timeout_.count(),
                          " ms, the timeout of this communicator (", op.peers,
                          "); is the peer alive and did it post the matching operation?"));
    }
    return false;
  } catch (const std::exception&) {
    op.error = std::current_exception();
    return true;
  }
}

// Runs an ended op's callbacks: in a scope of their own (rule 3) when it is
// done, in the running one when it failed (rule 5).
void DeferredP2P::complete(Op& op) {
  op.state = State::kCompleting;
  if (op.error) {
    try {
      std::rethrow_exception(op.error);
    } catch (const std::exception& e) {
      op.completion.fail(e);
    }
    return;
  }
  CallbackScope scope(*this);
  op.completion.complete();
}

}  // namespace pycomm
