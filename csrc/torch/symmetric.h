// Symmetric memory, one component: the storages a communicator moved into
// memory that every rank maps (SharedBuffers::allocate_symmetric), and the
// rules by which an all-reduce registers one (moves it there). Comm asks it for a
// Decision per all-reduce and hands that to the op's body; register_tensor
// uses its move. Only the shm transport has a symmetric domain.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

#include "../core/algorithms.h"
#include "../core/transport.h"
#include "work.h"

namespace pycomm {

// A bounded set of storages held weakly (freed ones drop out, the oldest go
// first when it is full).
class WeakStorageSet {
 public:
  bool contains(const c10::StorageImpl* impl);
  void add(const c10::Storage& storage);

 private:
  static constexpr size_t kMax = 64;
  std::mutex mu_;
  std::deque<c10::weak_intrusive_ptr<c10::StorageImpl>> storages_;
};

class SymmetricMemory : public std::enable_shared_from_this<SymmetricMemory> {
 public:
  // `domain`: Executor::symmetric_domain(), 0 where the transport has none.
  SymmetricMemory(uint64_t domain, int rank) : domain_(domain), rank_(rank) {}

  bool available() const { return domain_ != 0; }

  // What a direct all-reduce of a tensor does about symmetric memory.
  struct Decision {
    // The tensor is all of a registered storage: reduce it without staging.
    std::shared_ptr<SymmetricRegion> region;
    // Or it asks to register the tensor in this op (direct_all_reduce's
    // registration)...
    RegisterFn registration;
    // ...and `decided` is set once the op has decided (and moved): ops
    // issued later take the tensor's address when issued, so the caller
    // waits for it (wait_for_decision) before issuing more.
    std::shared_ptr<CompletionFlag> decided;
  };
  // The decision for an all_reduce(algo direct) of `t`. `to_register`: the caller
  // asks (all_reduce(register=True)); `on_worker`: issued on the executor's
  // own thread (a Future callback), which must never wait for a decision.
  Decision decide(const at::Tensor& t, bool to_register, bool on_worker);
  // The body's all-reduce: direct_all_reduce with the decision; counts the
  // ops that ran from symmetric memory, and those that read the peers'
  // private copies (cross_memory.h).
  void all_reduce(const Context& ctx, const Decision& d, void* data, size_t count, DType dtype,
                  ReduceOp op);
  // Blocks (interruptibly) until the op of `work` has decided: its registration ran,
  // or the op ended without it (a dead peer, abort).
  static void wait_for_decision(Work& work, const Decision& d);

  // A collective step (inside an op's body, on every rank): allocates a
  // symmetric region of the storage's size and, if every rank got its part,
  // moves the storage into it as Tensor.share_memory_() does: copy, then
  // swap the storage's memory, so every view follows. The caller makes sure
  // no op holding the old address is queued (register_tensor is
  // synchronous; a registering all_reduce holds its caller until the move).
  // nullptr, with `why`, when some rank got no memory or refused (`refuse`,
  // or storage_refusal when empty).
  std::shared_ptr<SymmetricRegion> move(SharedBuffers& sb, const c10::Storage& storage,
                                        std::string* why, std::string refuse = "") const;
  // The region the storage of `t` lives in, if this domain allocated it.
  std::shared_ptr<SymmetricRegion> region_of(const at::Tensor& t) const;
  // All-reduces so far that ran from symmetric memory (no staging).
  uint64_t ops() const { return ops_.load(); }
  // All-reduces so far that read the peers' copies through the kernel.
  uint64_t cross_memory_ops() const { return cross_memory_ops_.load(); }
  // Comm::auto_register: see comm.h.
  bool auto_register() const { return auto_register_; }
  void set_auto_register(bool on) { auto_register_ = on; }
  static constexpr size_t kAutoRegisterMinBytes = 256 * 1024;

 private:
  // Whether an all_reduce of `t` asks to register it (move it into symmetric memory): on
  // shm, not after a move found no room, not on the worker thread, not after
  // a rank declined this storage, when `t` is all of a storage that torch's
  // CPU allocator made, and either `to_register` (the caller asks) or
  // auto_register() with a storage of >= kAutoRegisterMinBytes that was
  // reduced before (seen_).
  bool asks_to_register(const at::Tensor& t, bool to_register, bool on_worker);

  const uint64_t domain_;
  const int rank_;
  WeakStorageSet seen_;
  std::atomic<bool> auto_register_{false};
  std::atomic<uint64_t> ops_{0};
  std::atomic<uint64_t> cross_memory_ops_{0};
  std::atomic<bool> cross_memory_off_said_{false};  // PYCOMM_SHM_CMA=1 refused: warned once
  // Storages some rank declined to move: they ask no more, so a rank whose
  // peers never ask (their buckets moved already) does not hold its caller
  // at every all-reduce.
  WeakStorageSet declined_;
  // Set when a move found no room (then on every rank): registrations stop.
  std::atomic<bool> failed_{false};
};

// Why `storage` must not move into symmetric memory, or "" when it may.
std::string storage_refusal(const c10::Storage& storage);

}  // namespace pycomm
