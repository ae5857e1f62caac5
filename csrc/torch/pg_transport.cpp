#include "pg_transport.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <thread>

namespace pycomm {

namespace {
// + (index mod 2^20) * lanes + lane: below 2^22
constexpr int kPayloadTagBase = 0x10000;
constexpr uint32_t kPayloadIndices = 1u << 20;
constexpr auto kBlockedSlice = std::chrono::microseconds(20);  // wait_work's polling period

at::Tensor bytes_of(void* p, size_t n) {
  return at::from_blob(p, {static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte));
}

std::string describe(int kind, int peer, int tag = 0) {
  return std::string(kind == P2POp::kSend ? "send to" : "recv from") +
         (peer == kAnySource ? std::string(" any rank") : " rank " + std::to_string(peer)) +
         (tag != 0 ? " with tag " + std::to_string(tag) : std::string());
}

}  // namespace

at::Tensor ProcessGroupTransport::new_frame() {
  return at::empty({static_cast<int64_t>(kFrameBytes)}, at::TensorOptions().dtype(at::kByte));
}

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::Backend> backend,
                                             c10::intrusive_ptr<c10d::Backend> upward,
                                             c10::intrusive_ptr<c10d::Backend> downward,
                                             c10::intrusive_ptr<c10d::Store> store)
    : store_(std::move(store)),
      backend_(std::move(backend)),
      upward_(std::move(upward)),
      downward_(std::move(downward)),
      rank_(backend_->getRank()),
      size_(backend_->getSize()) {
  for (const auto* b : {&upward_, &downward_}) {
    if ((*b)->getRank() != rank_ || (*b)->getSize() != size_) {
      throw UsageError("gloo transport: the payload groups must be of this rank and size");
    }
  }
  sent_.assign(static_cast<size_t>(size_) * kLanes, 0);
  if (store_) watch_store(store_);
}

ProcessGroupTransport::~ProcessGroupTransport() {
  stop_watching();
  // Outstanding transfers would write into freed memory: cancel them, and
  // join the background waiters (woken by the aborts) before the works go.
  if (!pending_.empty()) abort();
  for (auto& kv : pending_) {
    if (kv.second.waiter.valid()) kv.second.waiter.wait();
  }
  pending_.clear();
}

int ProcessGroupTransport::payload_tag(int lane, uint32_t index) const {
  return kPayloadTagBase + static_cast<int>(index % kPayloadIndices) * kLanes + lane;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTransport::post_payload(int kind, void* buf,
                                                                   size_t bytes, int peer, int lane,
                                                                   uint32_t index) {
  std::vector<at::Tensor> t{bytes_of(buf, bytes)};
  const int tag = payload_tag(lane, index);
  return kind == P2POp::kSend ? payload_group(rank_, peer).send(t, peer, tag)
                              : payload_group(peer, rank_).recv(t, peer, tag);
}

c10d::Backend& ProcessGroupTransport::payload_group(int from, int to) const {
  return from < to ? *upward_ : *downward_;
}

void ProcessGroupTransport::post_send(Message& m) {
  m.index = sent_[static_cast<size_t>(m.peer) * kLanes + m.lane]++;
  m.wire = new_frame();
  *reinterpret_cast<Wire*>(m.wire.data_ptr()) =
      Wire{m.bytes, m.hdr.seq, m.hdr.count, m.hdr.packed(), m.index, m.tag};
  if (m.bytes <= kInline) {
    std::memcpy(static_cast<char*>(m.wire.data_ptr()) + sizeof(Wire), m.buf, m.bytes);
  }
  std::vector<at::Tensor> w{m.wire};
  m.header_work = backend_->send(w, m.peer, kTagBase + m.lane);
  if (m.bytes > kInline) {
    m.payload_work = post_payload(P2POp::kSend, m.buf, m.bytes, m.peer, m.lane, m.index);
  }
}

Handle ProcessGroupTransport::post(const P2POp* ops, size_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  if (aborted_) {
    throw CommError(with_told_reason(
        "gloo transport was aborted (by an earlier error or Communicator.abort())"));
  }
  const Handle h = next_++;
  Pending& p = pending_[h];  // references into an unordered_map stay valid
  p.msgs.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const P2POp& op = ops[i];
    // Collectives post matching empty chunks on both sides; a user message
    // is sent even when empty, so that 0 elements against 3 is a size error.
    if (op.bytes == 0 && op.channel == kCollective) continue;
    const bool user = op.channel == kUser;
    Message m;
    m.kind = op.kind;
    m.peer = op.peer;
    m.channel = op.channel;
    m.lane = user && op.tag != 0 ? kTagged : op.channel;
    m.buf = op.buf;
    m.bytes = op.bytes;
    m.hdr = user ? OpHeader{} : op_;
    m.tag = user ? op.tag : 0;
    m.source = user ? op.source : nullptr;
    m.index = 0;
    try {
      if (op.kind == P2POp::kSend) {
        post_send(m);
      } else if (m.lane == kTagged) {
        // Matched by take_tagged, in this order among the waiting receives.
        m.want = std::make_shared<Want>(Want{op.peer, op.tag});
        std::lock_guard<std::mutex> match(match_mu_);
        wants_.push_back(m.want);
        match_locked();
      } else {
        m.wire = new_frame();
        std::vector<at::Tensor> w{m.wire};
        m.header_work = op.peer == kAnySource ? backend_->recvAnysource(w, kTagBase + m.lane)
                                              : backend_->recv(w, op.peer, kTagBase + m.lane);
      }
    } catch (const std::exception& e) {
      throw CommError("gloo " + describe(op.kind, op.peer, m.tag) +
                      " failed to start: " + e.what());
    }
    p.msgs.push_back(std::move(m));
  }
  // A user receive's payload is posted only once its header arrived. Its
  // group may stay pending while this rank blocks in a collective that the
  // peer joins only after its send completed (irecv; all_reduce against
  // send; all_reduce): so take the header in a background waiter at once,
  // not when someone first waits for the group.
  const bool background = std::any_of(p.msgs.begin(), p.msgs.end(), [](const Message& m) {
    return m.kind == P2POp::kRecv && m.channel == kUser;
  });
  if (background) {
    Pending* pp = &p;
    const auto timeout = timeout_;
    p.waiter = waiters_.run([this, pp, timeout] { wait_all(*pp, timeout); });
  }
  return h;
}

void ProcessGroupTransport::accept_header(Message& m) {
  const Wire w = *reinterpret_cast<const Wire*>(m.wire.data_ptr());
  const char* inline_bytes = static_cast<const char*>(m.wire.data_ptr()) + sizeof(Wire);
  if (m.source) *m.source = m.peer;
  if (w.seq == kAbortSeq) {
    // The peer failed and says why (inline).
    const std::string reason(inline_bytes, std::min<uint64_t>(w.bytes, kInline));
    const std::string msg =
        "rank " + std::to_string(m.peer) + " aborted the communicator: " + reason;
    broadcast_abort(msg);
    throw CommError(msg);
  }
  // On a mismatch, take the payload into scratch memory first (its sender
  // then completes and learns the reason at its next receive from this
  // rank), then tell every peer and raise.
  const auto index = static_cast<uint32_t>(w.index);
  auto reject = [&](const std::string& msg) {
    if (w.bytes > kInline && w.bytes <= (uint64_t{1} << 32)) {
      try {
        at::Tensor scratch =
            at::empty({static_cast<int64_t>(w.bytes)}, at::TensorOptions().dtype(at::kByte));
        post_payload(P2POp::kRecv, scratch.data_ptr(), w.bytes, m.peer, m.lane, index)
            ->wait(kAbortNotice);
      } catch (const std::exception&) {
      }
    }
    broadcast_abort(msg);
    throw CommError(msg);
  };
  const OpHeader theirs = OpHeader::unpack(w.seq, w.count, w.packed);
  if (m.channel == kCollective && theirs != m.hdr) {
    reject("gloo transport: " + mismatch_message(rank_, m.hdr, m.peer, theirs));
  }
  if (w.bytes != m.bytes) {
    reject(
        cat("gloo transport: rank ", rank_, " expected a message of ", m.bytes, " bytes from rank ",
            m.peer, m.tag != 0 ? " with tag " + std::to_string(m.tag) : std::string(),
            " but it sent ", w.bytes, " bytes",
            m.channel == kUser ? " (point-to-point: the send and the recv tensors differ in size)"
                               : " (mismatched collective calls across ranks?)"));
  }
  if (m.bytes <= kInline) {
    std::memcpy(m.buf, inline_bytes, m.bytes);
  } else {
    attach_payload(m, post_payload(P2POp::kRecv, m.buf, m.bytes, m.peer, m.lane, index));
  }
}

void ProcessGroupTransport::attach_payload(Message& m, c10::intrusive_ptr<c10d::Work> work) {
  // Under mu_: abort() (any thread) walks the payload works under it, and
  // one that ran meanwhile is aborted here.
  std::lock_guard<std::mutex> lk(mu_);
  m.payload_work = std::move(work);
  if (aborted_) m.payload_work->abort();
}

void ProcessGroupTransport::match_locked() {
  for (auto it = wants_.begin(); it != wants_.end();) {
    Want& w = **it;
    auto a = std::find_if(arrivals_.begin(), arrivals_.end(), [&](const Arrival& x) {
      return x.tag == w.tag && (w.peer == kAnySource || x.peer == w.peer);
    });
    if (a == arrivals_.end()) {
      ++it;
      continue;
    }
    w.got = true;
    w.from = a->peer;
    w.frame = std::move(a->frame);
    arrivals_.erase(a);
    it = wants_.erase(it);
  }
}

void ProcessGroupTransport::take_tagged(Message& m,
                                        std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lk(match_mu_);
  Want& want = *m.want;
  while (!want.got) {
    if (aborted_) {
      throw CommError(with_told_reason("gloo transport was aborted while a tagged receive waited"));
    }
    if (pulling_) {  // another thread takes the next frame; it wakes us
      if (match_cv_.wait_until(lk, deadline) == std::cv_status::timeout && !want.got) {
        throw CommError("gloo " + describe(P2POp::kRecv, m.peer, m.tag) + " timed out after " +
                        std::to_string(timeout_.count()) +
                        " ms, the timeout of this communicator (no message with its tag arrived)");
      }
      continue;
    }
    // Take the next frame of the tagged lane, from any rank.
    pulling_ = true;
    at::Tensor frame = new_frame();
    std::vector<at::Tensor> w{frame};
    std::exception_ptr err;
    int from = -1;
    try {
      pull_work_ = backend_->recvAnysource(w, kTagBase + kTagged);
      c10::intrusive_ptr<c10d::Work> work = pull_work_;
      lk.unlock();
      wait_work(*work, deadline);
      from = work->sourceRank();
    } catch (const std::exception& e) {
      err = std::make_exception_ptr(CommError(with_told_reason(
          "gloo " + describe(P2POp::kRecv, m.peer, m.tag) + " failed (header, timeout " +
          std::to_string(timeout_.count()) + " ms): " + e.what())));
    }
    if (!lk.owns_lock()) lk.lock();
    pulling_ = false;
    pull_work_.reset();
    match_cv_.notify_all();
    if (err) std::rethrow_exception(err);
    const Wire hdr = *reinterpret_cast<const Wire*>(frame.data_ptr());
    if (hdr.seq == kAbortSeq) {  // the sender failed: this receive reports it (accept_header)
      want.got = true;
      want.from = from;
      want.frame = frame;
      wants_.remove(m.want);
      break;
    }
    arrivals_.push_back(Arrival{from, static_cast<int>(hdr.tag), frame});
    match_locked();
  }
  m.peer = want.from;
  m.wire = want.frame;
}

void ProcessGroupTransport::wait_work(c10d::Work& w,
                                      std::chrono::steady_clock::time_point deadline) {
  while (while_blocked_ && !w.isCompleted() && std::chrono::steady_clock::now() < deadline &&
         while_blocked_()) {
    std::this_thread::sleep_for(kBlockedSlice);
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  w.wait(std::max(left, std::chrono::milliseconds(1)));
}

void ProcessGroupTransport::wait_all(Pending& p, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto wait_one = [&](Message& m, c10::intrusive_ptr<c10d::Work>& w, const char* part) {
    if (!w) return;
    try {
      wait_work(*w, deadline);  // one budget for the whole group, not `timeout` per op
      // An aborted gloo work may return from wait() as if done: it was not.
      if (aborted_) throw std::runtime_error("aborted before it completed");
    } catch (const std::exception& e) {
      std::string msg = cat("gloo ", describe(m.kind, m.peer, m.tag), " failed (", part,
                            ", timeout ", timeout.count(), " ms): ", e.what());
      if (m.kind == P2POp::kSend) {
        msg += cat(" (a gloo send waits for the matching receive: did rank ", m.peer,
                   " fail, or does it run a different operation, e.g. a broadcast with another "
                   "root?)");
      }
      for (auto& o : p.msgs) {
        o.for_each_work([&](c10::intrusive_ptr<c10d::Work>& x) {
          if (x && &x != &w) x->abort();
        });
      }
      throw CommError(with_told_reason(msg));
    }
  };
  // Receives' headers first, posting their payloads: a send's payload
  // completes only once the peer posted the matching receive, which it does
  // in this same step of its own wait.
  for (auto& m : p.msgs) {
    if (m.kind != P2POp::kRecv) continue;
    if (m.want) {
      take_tagged(m, deadline);
    } else {
      wait_one(m, m.header_work, "header");
      if (m.peer == kAnySource) m.peer = m.header_work->sourceRank();
    }
    accept_header(m);
  }
  for (auto& m : p.msgs) {
    if (m.kind == P2POp::kSend) wait_one(m, m.header_work, "header");
    if (m.payload_work) wait_one(m, m.payload_work, "payload");
  }
}

ProcessGroupTransport::Pending* ProcessGroupTransport::find(Handle h) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = pending_.find(h);
  if (it == pending_.end()) throw CommError("gloo transport: unknown handle");
  return &it->second;
}

void ProcessGroupTransport::wait(Handle h) {
  Pending* p = find(h);
  // Wait without the lock (abort() may come from another thread), then erase.
  std::exception_ptr err;
  try {
    if (p->waiter.valid()) {
      // The waiter thread works on the entry: join it first (driving
      // while_blocked_ meanwhile, as wait_work does).
      while (while_blocked_ &&
             p->waiter.wait_for(std::chrono::seconds(0)) != std::future_status::ready &&
             while_blocked_()) {
        std::this_thread::sleep_for(kBlockedSlice);
      }
      p->waiter.get();
    } else {
      wait_all(*p, timeout_);
    }
  } catch (...) {
    err = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    pending_.erase(h);
  }
  if (err) std::rethrow_exception(err);
}

bool ProcessGroupTransport::test(Handle h) {
  Pending* pp = find(h);
  Pending& p = *pp;
  if (!p.waiter.valid()) {
    // The Pending entry (and its works) stays in pending_ until consumed.
    const auto timeout = timeout_;
    p.waiter = waiters_.run([this, pp, timeout] { wait_all(*pp, timeout); });
  }
  if (p.waiter.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
  wait(h);  // consumes the handle, rethrows the waiter's error
  return true;
}

}  // namespace pycomm
