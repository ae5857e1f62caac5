// Comm across hosts (hierarchy.h): composing over the parts, the composed
// ops' launch, and batch_p2p split between shm and the flat ring.
#include <atomic>
#include <mutex>

#include "call_guard.h"
#include "comm.h"

namespace pycomm {

void Comm::compose_hosts(HostLayout layout, std::shared_ptr<Comm> intra,
                         std::shared_ptr<Comm> inter) {
  constexpr const char* kOp = "compose_hosts";
  CallGuard guard(*this, kOp);
  check_open(kOp);
  // Everything checked before anything changes.
  auto unfit = [this](const std::shared_ptr<Comm>& c) {
    return !c || c.get() == this || c->hierarchy_ || c->is_part_ || !c->device_.is_cpu() ||
           c->closed_ || c->exec_->aborted();
  };
  if (hierarchy_ || is_part_ || !device_.is_cpu() || unfit(intra) || unfit(inter) ||
      intra == inter) {
    throw UsageError(
        "compose_hosts: needs three distinct open CPU communicators, none composed yet");
  }
  auto h = std::make_shared<Hierarchy>(std::move(layout), rank_, intra, inter);
  // One worker; its idle waits sleep on shm's doorbell, and the gloo parts'
  // waits drive shm p2p posted before them (Transport::set_while_blocked).
  intra->exec_->share_worker_of(*exec_, /*idle_wait=*/true);
  inter->exec_->share_worker_of(*exec_, /*idle_wait=*/false);
  exec_->set_while_blocked(intra->exec_->progress_fn());
  inter->exec_->set_while_blocked(intra->exec_->progress_fn());
  // One abort for the three: a part failing fails the communicator.
  std::vector<Executor*> all{exec_.get(), intra->exec_.get(), inter->exec_.get()};
  for (Executor* e : all) {
    e->set_on_abort([all](const std::string& why) {
      for (Executor* other : all) other->abort(why);  // returns at once where aborted already
    });
  }
  for (Comm* part : {intra.get(), inter.get()}) {
    part->failure_reported_ = failure_reported_;
    part->is_part_ = true;
    part->set_check(options_.check);
  }
  transport_name_ = "shm+gloo";
  hierarchy_ = std::move(h);
}

c10::intrusive_ptr<Work> Comm::all_reduce_across_hosts(const at::Tensor& t, int op,
                                                       const std::string& algo, bool async_op,
                                                       bool to_register,
                                                       std::optional<Hierarchy::QuantWire> wire) {
  auto h = hierarchy_;
  auto work = compose(
      "all_reduce", {t},
      [h, t, op, algo, to_register, wire] {
        if (wire && t.scalar_type() != at::kFloat) {
          // A 16-bit tensor over a quantized wire is summed in float32 from
          // end to end, as on one host (where core's quantized_all_reduce
          // widens it, quantized.cc): the steps inside a host too.
          at::Tensor wide = t.to(at::kFloat);
          h->all_reduce(wide, op, algo, /*to_register=*/false, wire);
          t.copy_(wide);
          return;
        }
        h->all_reduce(t, op, algo, to_register, wire);
      },
      async_op, /*hold=*/to_register);
  // register=True may move t's storage: decided before the call returns.
  if (work && to_register) work->wait();
  return work;
}

c10::intrusive_ptr<Work> Comm::compose(const char* op, std::vector<at::Tensor> outputs,
                                       std::function<void()> run, bool async_op, bool hold) {
  // A caller that waits holds the call guard meanwhile, as a synchronous op
  // on one host does (and a registration until the move is done).
  std::optional<CallGuard> guard;
  if (!async_op || hold) guard.emplace(*this, op);
  auto work = launch(
      op, std::move(outputs),
      [run = std::move(run)](const Context&) {
        ComposedOpScope scope;
        run();
      },
      Wait::kAsync);
  if (async_op) return work;
  work->wait();  // raises the op's error (and notes that the caller saw it)
  return {};
}

namespace {
// A Work done when both `a` and `b` are, failed with the first error of
// theirs; a wait for it inside a Future callback drives both.
c10::intrusive_ptr<Work> both_of(c10::intrusive_ptr<Work> both, c10::intrusive_ptr<Work> a,
                                 c10::intrusive_ptr<Work> b) {
  both->set_pump([a, b](const Work*) {
    const bool more_a = a->drive();
    const bool more_b = b->drive();
    return more_a || more_b;
  });
  struct Joint {
    std::atomic<int> left{2};
    std::mutex mu;
    std::exception_ptr error;
  };
  auto joint = std::make_shared<Joint>();
  for (const auto& part : {a, b}) {
    part->future()->addCallback([both, joint](c10::ivalue::Future& f) {
      if (f.hasError()) {
        std::lock_guard<std::mutex> lk(joint->mu);
        if (!joint->error) joint->error = f.exception_ptr();
      }
      if (joint->left.fetch_sub(1) != 1) return;
      if (joint->error) {
        both->fail(joint->error);
      } else {
        both->complete();
      }
    });
  }
  return both;
}
}  // namespace

c10::intrusive_ptr<Work> Comm::batch_p2p_across_hosts(const std::vector<TensorP2P>& reqs) {
  constexpr const char* kOp = "batch_isend_irecv";
  std::vector<TensorP2P> near, far;  // peers on this host (local ranks), the others
  for (const auto& q : reqs) {
    auto [part, local_peer] = hierarchy_->route(q.peer, kOp);
    (part != nullptr ? near : far).push_back(q);
    if (part != nullptr) near.back().peer = local_peer;
  }
  CallGuard guard(*this, kOp);
  auto [ops, tensors] = p2p_ops(far);
  if (near.empty()) return launch_p2p(kOp, std::move(tensors), std::move(ops), Wait::kAsync);
  auto on_this_host = hierarchy_->intra().batch_p2p(near);
  if (far.empty()) return on_this_host;
  // Both posted before either is waited for; one Work for the caller.
  auto between_hosts = launch_p2p(kOp, tensors, std::move(ops), Wait::kAsync);
  auto both = exec_->new_work(kOp, seq_, p2p_ops(reqs).second);
  both->set_reported_flag(failure_reported_);
  return both_of(both, on_this_host, between_hosts);
}

}  // namespace pycomm
