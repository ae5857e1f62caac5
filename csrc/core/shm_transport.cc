#include <algorithm>
#include <limits>

#include "shm_layout.h"

namespace pycomm {

// ------------------------------------------------------------ progress

void ShmTransport::complete_op(Handle group) {
  --pending_ops_;
  auto it = remaining_.find(group);
  if (it != remaining_.end() && --it->second == 0) remaining_.erase(it);
}

// One channel walker for both directions: the sender's position is the
// ring's head, the receiver's its tail; each end moves its own and reads the
// other's.
bool ShmTransport::progress(int peer, int ch, bool send) {
  const int qi = peer * kNumChannels + ch;
  auto& q = send ? sendq_[qi] : recvq_[qi];
  if (q.empty()) return false;
  const size_t slots = seg_->slots;
  ChanCtrl* c = send ? seg_->ctrl(rank_, peer, ch) : seg_->ctrl(peer, rank_, ch);
  std::atomic<uint64_t>& mine = send ? c->head : c->tail;
  std::atomic<uint64_t>& other = send ? c->tail : c->head;
  uint64_t& pos = send ? send_head_[qi] : recv_tail_[qi];
  uint64_t theirs = other.load(std::memory_order_acquire);
  // A slot to fill (ring not full) / to take (something published).
  auto ready = [&] { return send ? pos - theirs < slots : pos != theirs; };
  bool moved = false;
  while (!q.empty()) {
    Op& op = q.front();
    while (op.done < op.bytes || op.first) {
      if (!ready()) {
        theirs = other.load(std::memory_order_acquire);
        if (!ready()) break;
      }
      const size_t slot = static_cast<size_t>(pos % slots);
      const size_t m = send ? put_slot(peer, ch, op, slot) : take_slot(peer, ch, op, slot);
      ++pos;
      mine.store(pos, std::memory_order_release);
      op.done += m;
      op.first = false;
      moved = true;
      notify(peer);
    }
    if (op.done < op.bytes || op.first) break;
    const Handle g = op.group;
    q.pop_front();
    complete_op(g);
  }
  return moved;
}

size_t ShmTransport::put_slot(int peer, int ch, const Op& op, size_t slot) {
  const size_t slot_bytes = seg_->slot_bytes;
  const size_t m = std::min(slot_bytes, op.bytes - op.done);
  std::memcpy(seg_->data(rank_, peer, ch) + slot * slot_bytes, op.buf + op.done, m);
  std::atomic<uint64_t>* sm = seg_->meta(rank_, peer, ch) + kMetaWords * slot;
  sm[0].store(m, std::memory_order_relaxed);
  sm[1].store(op.bytes, std::memory_order_relaxed);
  sm[2].store(op.hdr.seq, std::memory_order_relaxed);
  sm[3].store(op.hdr.count, std::memory_order_relaxed);
  sm[4].store(op.packed, std::memory_order_relaxed);
  sm[5].store(static_cast<uint32_t>(op.tag), std::memory_order_relaxed);
  return m;
}

size_t ShmTransport::take_slot(int peer, int ch, const Op& op, size_t slot) {
  const size_t slot_bytes = seg_->slot_bytes;
  const std::atomic<uint64_t>* sm = seg_->meta(peer, rank_, ch) + kMetaWords * slot;
  const size_t m = sm[0].load(std::memory_order_relaxed);
  const size_t total = sm[1].load(std::memory_order_relaxed);
  const size_t want = std::min(slot_bytes, op.bytes - op.done);
  // The sender's op header: on the collective channel it must be ours.
  const OpHeader theirs = load_op(sm[2], sm[3], sm[4]);
  if (ch == kCollective && theirs != op.hdr) {
    fail("shm transport: " + mismatch_message(rank_, op.hdr, peer, theirs));
  }
  if (m != want || total != op.bytes) fail_size(peer, op.bytes, total, ch, op.tag);
  std::memcpy(op.buf + op.done, seg_->data(peer, rank_, ch) + slot * slot_bytes, m);
  return m;
}

bool ShmTransport::progress_all() {
  bool moved = false;
  if (pending_ops_ == 0) return false;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    for (int ch = 0; ch < kNumChannels; ++ch) {
      // Receive first: it frees the peer's ring (and our data may be waiting).
      moved |= ch == kUser ? progress_user_recv(p) : progress(p, ch, /*send=*/false);
      moved |= progress(p, ch, /*send=*/true);
    }
  }
  if (moved) moved_ = true;
  return moved;
}

Handle ShmTransport::post(const P2POp* ops, size_t n) {
  check_not_aborted("post");
  const Handle h = next_++;
  size_t cnt = 0;
  for (size_t i = 0; i < n; ++i) {
    const P2POp& op = ops[i];
    const bool any = op.peer == kAnySource && op.kind == P2POp::kRecv && op.channel == kUser;
    if (!any && (op.peer < 0 || op.peer >= size_ || op.peer == rank_)) {
      throw CommError("shm transport: rank " + std::to_string(rank_) + " cannot " +
                      (op.kind == P2POp::kSend ? "send to" : "recv from") + " rank " +
                      std::to_string(op.peer));
    }
    if (op.channel < 0 || op.channel >= kNumChannels) {
      throw CommError("shm transport: unknown channel " + std::to_string(op.channel));
    }
    // Collectives post matching empty chunks on both sides: skip them. A
    // user message takes a slot even when empty, so that 0 elements sent
    // against 3 expected is a size error, not a wait for the timeout.
    if (op.bytes == 0 && op.channel == kCollective) continue;
    if (op.channel == kUser && op.kind == P2POp::kRecv) {
      cnt += post_user_recv(op, h) ? 1 : 0;
      continue;
    }
    const int qi = op.peer * kNumChannels + op.channel;
    auto& q = op.kind == P2POp::kSend ? sendq_[qi] : recvq_[qi];
    // User p2p carries no op header (seq 0): only its size is checked.
    const OpHeader hdr = op.channel == kCollective ? op_ : OpHeader{};
    q.push_back(Op{static_cast<char*>(op.buf), op.bytes, 0, true, h, hdr, hdr.packed(), op.tag});
    ++cnt;
  }
  if (cnt == 0) return h;
  remaining_[h] = cnt;
  pending_ops_ += cnt;
  progress_all();  // start at once: push what fits, take what has arrived
  return h;
}

bool ShmTransport::test(Handle h) {
  if (remaining_.find(h) == remaining_.end()) return true;
  progress_all();
  if (remaining_.find(h) == remaining_.end()) return true;
  // Abort and dead peers raise here too; the caller (Comm) owns the deadline.
  check_health("test", std::numeric_limits<int64_t>::max());
  return false;
}

// ------------------------------------------------------------ SharedBuffers

size_t ShmTransport::capacity() const { return seg_->direct_bytes; }

int ShmTransport::num_buffers() const { return static_cast<int>(seg_->direct_buffers); }

void* ShmTransport::local(int which) { return seg_->direct(rank_, which); }

const void* ShmTransport::remote(int r, int which) const { return seg_->direct(r, which); }

uint64_t ShmTransport::tag(int r, int which) const {
  return seg_->bufop(r, which)->tag.load(std::memory_order_relaxed);
}

int ShmTransport::pid(int r) const { return seg_->ranks[r].pid.load(std::memory_order_acquire); }

void ShmTransport::begin_op(const OpHeader& h) {
  const OpHeader prev = op_;
  op_ = h;
  RankInfo& me = seg_->ranks[rank_];
  me.op_seq.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  me.op_count.store(h.count, std::memory_order_relaxed);
  me.op_packed.store(h.packed(), std::memory_order_relaxed);
  me.op_seq.store(h.seq, std::memory_order_release);
  // A message of an earlier collective that nobody here received (say both
  // ranks broadcast as root: each only sends) would otherwise be taken by a
  // later ring op, or sit there under direct ones. Every collective receives
  // all it was sent before it returns, so an unread slot of an earlier op
  // now is a mismatch.
  // The fence pairs with the peer's: of two ranks that both only sent, at
  // least one sees the other's message here.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    const int qi = p * kNumChannels + kCollective;
    if (!recvq_[qi].empty()) continue;
    const uint64_t tail = recv_tail_[qi];
    if (seg_->ctrl(p, rank_, kCollective)->head.load(std::memory_order_acquire) == tail) continue;
    const std::atomic<uint64_t>* sm =
        seg_->meta(p, rank_, kCollective) + kMetaWords * (tail % seg_->slots);
    const OpHeader theirs = load_op(sm[2], sm[3], sm[4]);
    // The peer may have started this op already (its first message): fine.
    if (theirs.seq == 0 || theirs.seq >= h.seq) continue;
    fail("shm transport: " + mismatch_message(rank_, theirs.seq == prev.seq ? prev : h, p, theirs) +
         "; rank " + std::to_string(p) + " sent data that this rank never received");
  }
}

bool ShmTransport::peer_op(int r, OpHeader* out) const {
  const RankInfo& ri = seg_->ranks[r];
  const uint64_t s1 = ri.op_seq.load(std::memory_order_acquire);
  const uint64_t count = ri.op_count.load(std::memory_order_relaxed);
  const uint64_t p = ri.op_packed.load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (s1 == 0 || ri.op_seq.load(std::memory_order_relaxed) != s1) return false;
  *out = OpHeader::unpack(s1, count, p);
  return true;
}

void ShmTransport::check_peer_ops() {
  // Checked mode's exchange shares its op's number: a peer may still be in
  // it while this rank runs the op itself.
  constexpr int32_t kCheck = static_cast<int32_t>(CollKind::kCheck);
  if (op_.seq == 0 || op_.kind == kCheck) return;
  for (int r = 0; r < size_; ++r) {
    OpHeader h;
    if (r != rank_ && peer_op(r, &h) && h.seq == op_.seq && h.kind != kCheck && h != op_) {
      fail("shm transport: " + mismatch_message(rank_, op_, r, h));
    }
  }
}

}  // namespace pycomm
