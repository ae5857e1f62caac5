#include "pg_transport.h"

#include <ATen/ATen.h>

#include <sstream>

namespace pycomm {

namespace {
constexpr int kTag = 0x7c0;  // one tag: messages between a pair match in posting order
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
      p.works.push_back(op.kind == P2POp::kSend ? backend_->send(t, op.peer, kTag)
                                                : backend_->recv(t, op.peer, kTag));
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

void ProcessGroupTransport::wait(Handle h) {
  auto it = pending_.find(h);
  if (it == pending_.end()) throw CommError("gloo transport: unknown handle");
  Pending p = std::move(it->second);
  pending_.erase(it);
  for (size_t i = 0; i < p.works.size(); ++i) {
    try {
      p.works[i]->wait(timeout_);
    } catch (const std::exception& e) {
      std::ostringstream msg;
      msg << "gloo " << (p.kinds[i] == P2POp::kSend ? "send to" : "recv from") << " rank "
          << p.peers[i] << " failed (timeout " << timeout_.count() << " ms): " << e.what();
      for (size_t j = i + 1; j < p.works.size(); ++j) p.works[j]->abort();
      throw CommError(msg.str());
    }
  }
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
  pending_.clear();
}

}  // namespace pycomm
