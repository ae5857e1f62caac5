#include "pg_transport.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <thread>

namespace pycomm {

namespace {
constexpr int kTagBase = 0x7c0;  // header tag = base + lane; gloo matches per (peer, tag) in order
constexpr int kPayloadTagBase = 0x10000;  // + (index mod 2^20) * lanes + lane
constexpr uint32_t kPayloadIndices = 1u << 20;
// Lanes: kCollective, kUser (user p2p with tag 0), kTagged (other tags).
constexpr int kTagged = 2;
constexpr int kLanes = 3;
constexpr uint64_t kAbortSeq = ~uint64_t{0};  // an abort header: its inline bytes are the reason
// Every message starts with a frame of this fixed size: the header, then the
// payload itself when it fits (one message, its receive posted in advance,
// so small messages cost no extra round trip), else the payload follows on
// its own tag, received once the header checked out.
constexpr size_t kFrameBytes = 4096;
constexpr auto kAbortNotice = std::chrono::milliseconds(200);  // broadcast_abort's patience
constexpr auto kAbortPoll = std::chrono::milliseconds(200);    // the store watcher's period
constexpr auto kBlockedSlice = std::chrono::microseconds(20);  // wait_work's polling period
const char* const kAbortKey = "abort";  // in the communicator's store: the first failure's reason

at::Tensor bytes_of(void* p, size_t n) {
  return at::from_blob(p, {static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte));
}

std::string describe(int kind, int peer, int tag = 0) {
  return std::string(kind == P2POp::kSend ? "send to" : "recv from") +
         (peer == kAnySource ? std::string(" any rank") : " rank " + std::to_string(peer)) +
         (tag != 0 ? " with tag " + std::to_string(tag) : std::string());
}

at::Tensor new_frame() {
  return at::empty({static_cast<int64_t>(kFrameBytes)}, at::TensorOptions().dtype(at::kByte));
}
}  // namespace

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::Backend> backend,
                                             c10::intrusive_ptr<c10d::Store> store)
    : store_(std::move(store)),
      backend_(std::move(backend)),
      rank_(backend_->getRank()),
      size_(backend_->getSize()) {
  sent_.assign(static_cast<size_t>(size_) * kLanes, 0);
  if (store_) watch_store(store_);
}

void ProcessGroupTransport::watch_store(c10::intrusive_ptr<c10d::Store> store) {
  watch_ = std::make_shared<AbortWatch>();
  watch_->told = [this](const std::string& reason) { told(reason); };
  std::thread([w = watch_, store = std::move(store)] {
    std::unique_lock<std::mutex> lk(w->mu);
    while (!w->cv.wait_for(lk, kAbortPoll, [&] { return w->stop; })) {
      lk.unlock();
      std::string reason;
      try {
        if (store->check({kAbortKey})) {
          const std::vector<uint8_t> v = store->get(kAbortKey);
          reason.assign(v.begin(), v.end());
        }
      } catch (const std::exception&) {
        return;  // the store is gone: nothing more can come through it
      }
      lk.lock();
      if (!reason.empty()) {
        if (!w->stop && w->told) w->told(reason);
        return;
      }
    }
  }).detach();
}

void ProcessGroupTransport::stop_watching() {
  if (!watch_) return;
  std::lock_guard<std::mutex> lk(watch_->mu);  // waits for a told() under way
  watch_->stop = true;
  watch_->told = nullptr;
  watch_->cv.notify_all();
}

void ProcessGroupTransport::told(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (aborted_ || rank_of_abort_ >= 0) return;  // this rank failed first, or was told
    rank_of_abort_ = size_;  // no abort frames from here: every peer reads the store
  }
  {
    std::lock_guard<std::mutex> lk(told_mu_);
    told_reason_ = reason;
  }
  abort();
}

std::string ProcessGroupTransport::with_told_reason(const std::string& msg) {
  std::lock_guard<std::mutex> lk(told_mu_);
  return told_reason_.empty() ? msg : told_reason_ + " (on this rank: " + msg + ")";
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
        m.index = sent_[static_cast<size_t>(op.peer) * kLanes + m.lane]++;
        m.wire = new_frame();
        *reinterpret_cast<Wire*>(m.wire.data_ptr()) =
            Wire{op.bytes, m.hdr.seq, m.hdr.count, m.hdr.packed(), m.index, m.tag};
        if (op.bytes <= kInline) {
          std::memcpy(static_cast<char*>(m.wire.data_ptr()) + sizeof(Wire), op.buf, op.bytes);
        }
        std::vector<at::Tensor> w{m.wire};
        m.header_work = backend_->send(w, op.peer, kTagBase + m.lane);
        if (op.bytes > kInline) {
          std::vector<at::Tensor> t{bytes_of(op.buf, op.bytes)};
          m.payload_work = backend_->send(t, op.peer, payload_tag(m.lane, m.index));
        }
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
  const bool user_recv = std::any_of(p.msgs.begin(), p.msgs.end(), [](const Message& m) {
    return m.kind == P2POp::kRecv && m.channel == kUser;
  });
  if (user_recv) {
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
  auto reject = [&](const std::string& msg) {
    if (w.bytes > kInline && w.bytes <= (uint64_t{1} << 32)) {
      try {
        std::vector<at::Tensor> t{
            at::empty({static_cast<int64_t>(w.bytes)}, at::TensorOptions().dtype(at::kByte))};
        backend_->recv(t, m.peer, payload_tag(m.lane, static_cast<uint32_t>(w.index)))
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
    std::vector<at::Tensor> t{bytes_of(m.buf, m.bytes)};
    m.payload_work = backend_->recv(t, m.peer, payload_tag(m.lane, static_cast<uint32_t>(w.index)));
  }
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

void ProcessGroupTransport::broadcast_abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (rank_of_abort_ >= 0) return;  // once
    rank_of_abort_ = rank_;
  }
  // Through the store, for the peers blocked where no frame reaches them (a
  // send); the first failure's reason stays (a relayed one names its origin).
  if (store_) {
    try {
      if (!store_->check({kAbortKey})) {
        const std::string told =
            "rank " + std::to_string(rank_) + " aborted the communicator: " + reason;
        store_->set(kAbortKey, std::vector<uint8_t>(told.begin(), told.end()));
      }
    } catch (const std::exception&) {
      // the store is gone: the frames below are all that is left
    }
  }
  // Peers blocked on a header from this rank get this one instead. Headers
  // and payload tags continue this rank's message counts, so they pair with
  // the receives the peers posted.
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> keep;
  std::unique_lock<std::mutex> lk(mu_);  // sent_ is shared with post()
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    for (int lane = 0; lane < kLanes; ++lane) {
      const uint32_t index = sent_[static_cast<size_t>(r) * kLanes + lane]++;
      at::Tensor wire =
          at::zeros({static_cast<int64_t>(kFrameBytes)}, at::TensorOptions().dtype(at::kByte));
      const size_t n = std::min(reason.size(), kInline);
      *reinterpret_cast<Wire*>(wire.data_ptr()) = Wire{n, kAbortSeq, 0, 0, index, 0};
      std::memcpy(static_cast<char*>(wire.data_ptr()) + sizeof(Wire), reason.data(), n);
      std::vector<at::Tensor> w{wire};
      try {
        works.push_back(backend_->send(w, r, kTagBase + lane));
        keep.push_back(wire);
      } catch (const std::exception&) {
        // A send to a dead peer may throw at once (gloo: a pair in error
        // refuses). The peers after it must still be told: one that waits
        // for this rank would otherwise wait out the whole timeout.
        break;  // the next lanes to this peer would fail alike
      }
    }
  }
  lk.unlock();
  // Delivered only to peers that wait for this rank; don't wait for others.
  const auto deadline = std::chrono::steady_clock::now() + kAbortNotice;
  for (auto& w : works) {
    try {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      w->wait(std::max(left, std::chrono::milliseconds(1)));
    } catch (const std::exception&) {
      try {
        w->abort();
      } catch (...) {
      }
    }
  }
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
        for (auto* x : {&o.header_work, &o.payload_work}) {
          if (*x && x != &w) (*x)->abort();
        }
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
    wait_one(m, m.payload_work, "payload");
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

void ProcessGroupTransport::abort_because(const std::string& why) {
  broadcast_abort(why);
  abort();
}

void ProcessGroupTransport::abort() {
  // Any thread. Wakes every blocked wait (they then throw); the entries stay
  // until their wait() or the destructor erases them.
  std::lock_guard<std::mutex> lk(mu_);
  aborted_ = true;
  {
    std::lock_guard<std::mutex> match(match_mu_);
    try {
      if (pull_work_) pull_work_->abort();
    } catch (...) {
    }
  }
  match_cv_.notify_all();
  for (auto& kv : pending_) {
    for (auto& m : kv.second.msgs) {
      for (auto* w : {&m.header_work, &m.payload_work}) {
        try {
          if (*w) (*w)->abort();
        } catch (...) {
        }
      }
    }
  }
}

}  // namespace pycomm
