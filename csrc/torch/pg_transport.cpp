#include "pg_transport.h"

#include <ATen/ATen.h>

#include <sstream>

namespace pycomm {

namespace {
constexpr int kTagBase = 0x7c0;  // tag = base + channel; gloo matches per (peer, tag) in order
}

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::Backend> backend)
    : backend_(std::move(backend)), rank_(backend_->getRank()), size_(backend_->getSize()) {}

ProcessGroupTransport::~ProcessGroupTransport() {
  // Outstanding transfers would write into freed memory: cancel them, and
  // join the background waiters (woken by the aborts) before the works go.
  if (!pending_.empty()) abort();
  for (auto& kv : pending_) {
    if (kv.second.waiter.valid()) kv.second.waiter.wait();
  }
  pending_.clear();
}

Handle ProcessGroupTransport::post(const P2POp* ops, size_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  if (aborted_)
    throw CommError("gloo transport was aborted (by an earlier error or Communicator.abort())");
  const Handle h = next_++;
  Pending& p = pending_[h];  // references into an unordered_map stay valid
  for (size_t i = 0; i < n; ++i) {
    const P2POp& op = ops[i];
    if (op.bytes == 0) continue;
    std::vector<at::Tensor> t{at::from_blob(op.buf, {static_cast<int64_t>(op.bytes)},
                                            at::TensorOptions().dtype(at::kByte))};
    try {
      p.works.push_back(op.kind == P2POp::kSend
                            ? backend_->send(t, op.peer, kTagBase + op.channel)
                            : backend_->recv(t, op.peer, kTagBase + op.channel));
    } catch (const std::exception& e) {
      std::ostringstream msg;
      msg << "gloo " << (op.kind == P2POp::kSend ? "send to" : "recv from") << " rank " << op.peer
          << " failed to start: " << e.what();
      throw CommError(msg.str());
    }
    p.peers.push_back(op.peer);
    p.kinds.push_back(op.kind);
  }
  return h;
}

void ProcessGroupTransport::wait_all(Pending& p, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (size_t i = 0; i < p.works.size(); ++i) {
    try {
      // One budget for the whole group, not `timeout` per op.
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      p.works[i]->wait(std::max(left, std::chrono::milliseconds(1)));
    } catch (const std::exception& e) {
      std::ostringstream msg;
      msg << "gloo " << (p.kinds[i] == P2POp::kSend ? "send to" : "recv from") << " rank "
          << p.peers[i] << " failed (timeout " << timeout.count() << " ms): " << e.what();
      for (size_t j = i + 1; j < p.works.size(); ++j) p.works[j]->abort();
      throw CommError(msg.str());
    }
  }
}

void ProcessGroupTransport::wait(Handle h) {
  Pending* p;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = pending_.find(h);
    if (it == pending_.end()) throw CommError("gloo transport: unknown handle");
    p = &it->second;
  }
  // Wait without the lock (abort() may come from another thread), then erase.
  std::exception_ptr err;
  try {
    if (p->waiter.valid()) {
      p->waiter.get();  // the waiter thread works on the entry: join it first
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
  Pending* pp;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = pending_.find(h);
    if (it == pending_.end()) throw CommError("gloo transport: unknown handle");
    pp = &it->second;
  }
  Pending& p = *pp;
  if (!p.waiter.valid()) {
    // The Pending entry (and its works) stays in pending_ until consumed.
    const auto timeout = timeout_;
    p.waiter = std::async(std::launch::async, [pp, timeout] { wait_all(*pp, timeout); });
  }
  if (p.waiter.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
  wait(h);  // consumes the handle, rethrows the waiter's error
  return true;
}

void ProcessGroupTransport::abort() {
  // Any thread. Wakes every blocked wait (they then throw); the entries stay
  // until their wait() or the destructor erases them.
  std::lock_guard<std::mutex> lk(mu_);
  aborted_ = true;
  for (auto& kv : pending_) {
    for (auto& w : kv.second.works) {
      try {
        w->abort();
      } catch (...) {
      }
    }
  }
}

}  // namespace pycomm
