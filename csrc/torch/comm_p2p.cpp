// Comm's point-to-point ops: send, recv and batch_p2p (batch_isend_irecv),
// with their checks. A communicator across hosts sends to a peer on its own
// host over shm (Hierarchy::route), to the others over the flat transport.

#include "call_guard.h"
#include "comm.h"

namespace pycomm {

c10::intrusive_ptr<Work> Comm::send(const at::Tensor& t, int dst, bool async_op, int tag) {
  return point_to_point("send", P2POp::kSend, t, "dst", dst, async_op, tag);
}

c10::intrusive_ptr<Work> Comm::recv(const at::Tensor& t, int src, bool async_op, int tag) {
  return point_to_point("recv", P2POp::kRecv, t, "src", src, async_op, tag);
}

void Comm::check_matching(const char* op, int tag, bool any_source) const {
  if ((tag == 0 && !any_source) || !device_.is_cuda()) return;
  throw NotSupported(
      join_msg({op, ": ", any_source ? "a receive from any source" : "tag=" + std::to_string(tag),
                " is not supported on CUDA tensors: NCCL pairs the messages between two ranks in "
                "posting order (use tag 0 and a known peer, or CPU tensors)"}));
}

c10::intrusive_ptr<Work> Comm::point_to_point(const char* op, P2POp::Kind kind, const at::Tensor& t,
                                              const char* peer_arg, int peer, bool async_op,
                                              int tag) {
  if (hierarchy_ && (kind == P2POp::kRecv || peer != kAnySource)) {
    auto [part, local_peer] = hierarchy_->route(peer, op);
    if (part != nullptr) {  // a peer on this host: over shm
      CallGuard guard(*this, op);
      check_open(op);
      return kind == P2POp::kSend ? part->send(t, local_peer, async_op, tag)
                                  : part->recv(t, local_peer, async_op, tag);
    }
  }
  check_open(op);
  check_tensor(t, "tensor", op);
  const bool any = kind == P2POp::kRecv && peer == kAnySource;
  if (!any) check_peer(peer, peer_arg, op, rank_, size_, /*allow_self=*/false);
  check_matching(op, tag, any);
  P2POp p{kind, t.data_ptr(), size_t(t.nbytes()), peer};
  p.tag = tag;
  return launch_p2p(op, {t}, {p}, wait_of(async_op));
}

std::pair<std::vector<P2POp>, std::vector<at::Tensor>> Comm::p2p_ops(
    const std::vector<TensorP2P>& reqs) {
  std::pair<std::vector<P2POp>, std::vector<at::Tensor>> out;
  for (const auto& q : reqs) {
    out.first.push_back({q.send ? P2POp::kSend : P2POp::kRecv, q.tensor.data_ptr(),
                         static_cast<size_t>(q.tensor.nbytes()), q.peer});
    out.first.back().tag = q.tag;
    out.second.push_back(q.tensor);
  }
  return out;
}

c10::intrusive_ptr<Work> Comm::batch_p2p(const std::vector<TensorP2P>& reqs) {
  constexpr const char* kOp = "batch_isend_irecv";
  check_open(kOp);
  for (const auto& q : reqs) {
    check_tensor(q.tensor, "tensor", kOp);
    check_peer(q.peer, "peer", kOp, rank_, size_, /*allow_self=*/false);
    check_matching(kOp, q.tag, false);
  }
  if (hierarchy_) return batch_p2p_across_hosts(reqs);
  auto [ops, tensors] = p2p_ops(reqs);
  return launch_p2p(kOp, std::move(tensors), std::move(ops), Wait::kAsync);
}

}  // namespace pycomm
