// The shm transport's user p2p matching (the kUser channel's receive side):
// tags and receives from any source, torch.distributed's semantics (P2POp).
//
// Each sender's messages still arrive in its ring in sending order; every
// slot's meta carries the message's size and tag. When a peer starts a new
// message (its first slot is published):
//
//   1. the earliest posted receive that matches it (this peer or kAnySource,
//      the same tag) takes it straight from the ring, as before tags: with
//      tag 0 from known peers this is the receive at the front of the peer's
//      queue, and nothing else changes;
//   2. else, when some receive waits for a message from this peer (or from
//      any), the message is set aside (copied into `unexpected_`) so that
//      the peer's later messages can reach it;
//   3. else it stays in the ring (the sender waits, as before tags).
//
// A posted receive first looks for a message set aside (oldest first), and
// claims one that is still arriving. Sizes must match: a mismatch fails the
// communicator with a message naming both sizes (never a partial copy).
#include <algorithm>
#include <cstring>

#include "shm_layout.h"

namespace pycomm {

void ShmTransport::fail_size(int peer, size_t expected, size_t sent, int channel, int tag) {
  fail("shm transport: rank " + std::to_string(rank_) + " expected a message of " +
       std::to_string(expected) + " bytes from rank " + std::to_string(peer) +
       (tag != 0 ? " with tag " + std::to_string(tag) : std::string()) + " but it sent " +
       std::to_string(sent) + " bytes" +
       (channel == kUser ? " (point-to-point: the send and the recv tensors differ in size)"
                         : " (mismatched collective calls across ranks?)"));
}

bool ShmTransport::post_user_recv(const P2POp& op, Handle group) {
  Op o{static_cast<char*>(op.buf), op.bytes, 0,         true,         group, OpHeader{},
       OpHeader{}.packed(),        op.tag,   op.source, ++user_recvs_};
  const bool any = op.peer == kAnySource;
  for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
    if (it->claimed || it->tag != op.tag || (!any && it->peer != op.peer)) continue;
    if (it->data.size() != op.bytes) fail_size(it->peer, op.bytes, it->data.size(), kUser, op.tag);
    if (op.source) *op.source = it->peer;
    if (!it->complete) {  // still arriving: finish_user_message delivers it
      it->claimed = true;
      it->claimant = o;
      return true;
    }
    if (op.bytes) std::memcpy(op.buf, it->data.data(), op.bytes);
    unexpected_.erase(it);
    return false;
  }
  (any ? any_recvq_ : recvq_[op.peer * kNumChannels + kUser]).push_back(o);
  return true;
}

bool ShmTransport::start_user_message(int peer, int tag, size_t bytes) {
  auto& q = recvq_[peer * kNumChannels + kUser];
  auto match = [tag](const Op& o) { return o.tag == tag; };
  auto mine = std::find_if(q.begin(), q.end(), match);
  auto any = std::find_if(any_recvq_.begin(), any_recvq_.end(), match);
  Rx& rx = rx_[peer];
  if (mine != q.end() || any != any_recvq_.end()) {
    const bool from_any = mine == q.end() || (any != any_recvq_.end() && any->order < mine->order);
    rx.op = from_any ? *any : *mine;
    if (from_any) {
      any_recvq_.erase(any);
    } else {
      q.erase(mine);
    }
    if (rx.op.bytes != bytes) fail_size(peer, rx.op.bytes, bytes, kUser, tag);
    if (rx.op.source) *rx.op.source = peer;
    rx.into = nullptr;
  } else if (!q.empty() || !any_recvq_.empty()) {
    unexpected_.push_back(Unexpected{peer, tag, std::vector<char>(bytes)});
    rx.into = &unexpected_.back();
    rx.op = Op{rx.into->data.data(), bytes, 0, true, 0, OpHeader{}, OpHeader{}.packed(), tag};
  } else {
    return false;
  }
  rx.busy = true;
  return true;
}

void ShmTransport::finish_user_message(int peer) {
  Rx& rx = rx_[peer];
  rx.busy = false;
  Unexpected* u = rx.into;
  rx.into = nullptr;
  if (u == nullptr) {
    complete_op(rx.op.group);
    return;
  }
  u->complete = true;
  if (!u->claimed) return;
  if (!u->data.empty()) std::memcpy(u->claimant.buf, u->data.data(), u->data.size());
  const Handle g = u->claimant.group;
  unexpected_.remove_if([u](const Unexpected& e) { return &e == u; });
  complete_op(g);
}

bool ShmTransport::progress_user_recv(int peer) {
  const int qi = peer * kNumChannels + kUser;
  Rx& rx = rx_[peer];
  if (!rx.busy && recvq_[qi].empty() && any_recvq_.empty()) return false;
  const size_t slots = seg_->slots, slot_bytes = seg_->slot_bytes;
  ChanCtrl* c = seg_->ctrl(peer, rank_, kUser);
  uint64_t& pos = recv_tail_[qi];
  bool moved = false;
  while (pos != c->head.load(std::memory_order_acquire)) {
    const size_t slot = static_cast<size_t>(pos % slots);
    const std::atomic<uint64_t>* sm = seg_->meta(peer, rank_, kUser) + kMetaWords * slot;
    const size_t m = sm[0].load(std::memory_order_relaxed);
    if (!rx.busy) {
      const size_t total = sm[1].load(std::memory_order_relaxed);
      const int tag =
          static_cast<int>(static_cast<uint32_t>(sm[5].load(std::memory_order_relaxed)));
      if (!start_user_message(peer, tag, total)) break;
    }
    Op& op = rx.op;
    const size_t want = std::min(slot_bytes, op.bytes - op.done);
    if (m != want) fail_size(peer, op.bytes, op.done + m, kUser, op.tag);
    if (m) std::memcpy(op.buf + op.done, seg_->data(peer, rank_, kUser) + slot * slot_bytes, m);
    ++pos;
    c->tail.store(pos, std::memory_order_release);
    notify(peer);
    moved = true;
    op.done += m;
    op.first = false;
    if (op.done == op.bytes) finish_user_message(peer);
  }
  return moved;
}

}  // namespace pycomm
