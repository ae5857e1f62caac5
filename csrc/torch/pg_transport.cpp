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
  // Outstanding transfers would write into freed memory: cancel them.
  if (!pending_.empty()) abort();
}

Handle ProcessGroupTransport::post(const P2POp* ops, size_t n) {
  if (aborted_) throw CommError("gloo transport was aborted by an earlier error");
  const Handle h = next_++;
  Pending& p = pending_[h];
  for (size_t i = 0; i < n; ++i) {
    const P2POp& op = ops[i];
    if (op.bytes == 0) continue;
    std::vector<at::Tensor> t{at::from_blob(op.buf, {static_cast<int64_t>(op.bytes)},
                                            at::TensorOptions().dtype(at::kByte))};
    try {
      p.works.push_back(op.kind == P2POp::kSend ? backend_->send(t, op.peer, kTagBase + op.channel)
                                                : backend_->recv(t, op.peer, kTagBase + op.channel));
    } catch (const std::exception& e) {
      std::ostringstream msg;
      msg << "gloo " << (op.kind == P2POp::kSend ? "send to" : "recv from") << " rank "
          << op.peer << " failed to start: " << e.what();
      throw CommError(msg.str());
    }
    p.peers.push_back(op.peer);
    p.kinds.push_back(op.kind);
  }
  return h;
}

void ProcessGroupTransport::wait_all(Pending& p, std::chrono::milliseconds timeout) {
  for (size_t i = 0; i < p.works.size(); ++i) {
    try {
      p.works[i]->wait(timeout);
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
  auto it = pending_.find(h);
  if (it == pending_.end()) throw CommError("gloo transport: unknown handle");
  if (it->second.waiter.valid()) {
    // The waiter thread works on the map entry: join it before erasing.
    std::exception_ptr err;
    try {
      it->second.waiter.get();
    } catch (...) {
      err = std::current_exception();
    }
    pending_.erase(it);
    if (err) std::rethrow_exception(err);
    return;
  }
  Pending p = std::move(it->second);
  pending_.erase(it);
  wait_all(p, timeout_);
}

bool ProcessGroupTransport::test(Handle h) {
  auto it = pending_.find(h);
  if (it == pending_.end()) throw CommError("gloo transport: unknown handle");
  Pending& p = it->second;
  if (!p.waiter.valid()) {
    // The Pending entry (and its works) stays in pending_ until consumed.
    Pending* pp = &p;
    const auto timeout = timeout_;
    p.waiter = std::async(std::launch::async, [pp, timeout] { wait_all(*pp, timeout); });
  }
  if (p.waiter.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
  wait(h);  // consumes the handle, rethrows the waiter's error
  return true;
}

void ProcessGroupTransport::abort() {
  aborted_ = true;
  for (auto& kv : pending_) {
    for (auto& w : kv.second.works) {
      try {
        w->abort();
      } catch (...) {
      }
    }
  }
  for (auto& kv : pending_) {
    if (kv.second.waiter.valid()) kv.second.waiter.wait();  // woken by the aborts above
  }
  pending_.clear();
}

}  // namespace pycomm
