#include "symmetric.h"

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstring>

namespace pycomm {

bool WeakStorageSet::contains(const c10::StorageImpl* impl) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& w : storages_) {
    if (!w.expired() && w._unsafe_get_target() == impl) return true;
  }
  return false;
}

void WeakStorageSet::add(const c10::Storage& storage) {
  std::lock_guard<std::mutex> lk(mu_);
  storages_.erase(
      std::remove_if(storages_.begin(), storages_.end(), [](const auto& w) { return w.expired(); }),
      storages_.end());
  if (storages_.size() >= kMax) storages_.pop_front();
  storages_.push_back(storage.getWeakStorageImpl());
}

namespace {
// A registered storage's DataPtr context (SymmetricMemory::move): the
// symmetric region it lives in, unmapped here when the storage is freed.
struct SymmetricStorage {
  std::shared_ptr<SymmetricRegion> region;
};
void delete_symmetric_storage(void* ctx) { delete static_cast<SymmetricStorage*>(ctx); }
}  // namespace

// Memory that something else owns (torch.from_numpy, from_blob, a file
// mapping, share_memory_()) would silently stop being shared with its owner;
// torch's CPU allocator's (or a region already) may move.
std::string storage_refusal(const c10::Storage& storage) {
  const c10::DeleterFnPtr deleter = storage.data_ptr().get_deleter();
  if (deleter != nullptr && (deleter == c10::GetCPUAllocator()->raw_deleter() ||
                             deleter == c10::GetDefaultCPUAllocator()->raw_deleter() ||
                             deleter == &delete_symmetric_storage)) {
    return "";
  }
  return "its storage was not allocated by torch's CPU allocator (torch.from_numpy, "
         "from_blob, a mapping, share_memory_()), and moving it would end that sharing";
}

std::shared_ptr<SymmetricRegion> SymmetricMemory::move(SharedBuffers& sb,
                                                       const c10::Storage& storage,
                                                       std::string* why, std::string refuse) const {
  const size_t bytes = storage.nbytes();
  if (refuse.empty()) refuse = storage_refusal(storage);
  std::shared_ptr<SymmetricRegion> region = sb.allocate_symmetric(bytes, refuse, why);
  if (!region) return nullptr;
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  if (bytes > 0) std::memcpy(region->base(rank_), impl->data(), bytes);
  impl->set_data_ptr_noswap(c10::DataPtr(region->base(rank_), new SymmetricStorage{region},
                                         &delete_symmetric_storage, c10::Device(c10::kCPU)));
  return region;
}

std::shared_ptr<SymmetricRegion> SymmetricMemory::region_of(const at::Tensor& t) const {
  if (domain_ == 0 || !t.has_storage()) return nullptr;
  const c10::DataPtr& dp = t.storage().data_ptr();
  if (dp.get_deleter() != &delete_symmetric_storage) return nullptr;
  const auto& region = static_cast<const SymmetricStorage*>(dp.get_context())->region;
  return region->domain() == domain_ ? region : nullptr;
}

SymmetricMemory::Decision SymmetricMemory::decide(const at::Tensor& t, bool to_register,
                                                  bool on_worker) {
  Decision d;
  // All of a registered storage: direct_all_reduce may skip the staging.
  d.region = region_of(t);
  if (d.region && (t.data_ptr() != d.region->base(rank_) || t.nbytes() != d.region->bytes())) {
    d.region.reset();
  }
  if (d.region || !asks_to_register(t, to_register, on_worker)) return d;
  const c10::Storage storage = t.storage();
  auto self = shared_from_this();
  auto decided = std::make_shared<CompletionFlag>();
  d.decided = decided;
  d.registration = [self, storage, decided](SharedBuffers& sb, bool everyone) {
    std::shared_ptr<SymmetricRegion> region;
    if (everyone) {
      std::string why;  // every rank alike: nothing to report, the op stages
      region = self->move(sb, storage, &why);
      if (!region) self->failed_.store(true);  // stop asking (each op still agrees)
    } else {
      self->declined_.add(storage);
    }
    decided->set();
    return region;
  };
  return d;
}

void SymmetricMemory::all_reduce(const Context& ctx, const Decision& d, void* data, size_t count,
                                 DType dtype, ReduceOp op) {
  switch (direct_all_reduce(ctx, data, count, dtype, op, d.region.get(), d.registration)) {
    case DirectPath::kSymmetric: ops_.fetch_add(1); break;
    case DirectPath::kCrossMemory: cross_memory_ops_.fetch_add(1); break;
    case DirectPath::kStaged: break;
  }
  const SharedBuffers* sb = ctx.transport.shared_buffers();
  if (sb != nullptr && sb->cross_memory() == SharedBuffers::CrossMemory::kOff &&
      !cross_memory_off_said_.exchange(true)) {
    TORCH_WARN("pycomm: PYCOMM_SHM_CMA=1, but the ranks cannot read each other's memory (",
               sb->cross_memory_why(),
               "), so all-reduces of unregistered tensors stage through shared memory. Reading "
               "needs process_vm_readv allowed (seccomp) and ptrace access between the ranks "
               "(same user and pid namespace)");
  }
}

void SymmetricMemory::wait_for_decision(Work& work, const Decision& d) {
  if (!d.decided) return;
  // Also when the op fails or ends before deciding (a dead peer, abort).
  work.future()->addCallback([decided = d.decided](c10::ivalue::Future&) { decided->set(); });
  work.wait_interruptibly(d.decided);
}

bool SymmetricMemory::asks_to_register(const at::Tensor& t, bool to_register, bool on_worker) {
  if (domain_ == 0 || failed_.load() || !t.has_storage()) return false;
  if (!to_register && !auto_register_) return false;
  // The caller waits for the op's decision: never on the worker itself (a
  // Future callback), which would wait for its own queue.
  if (on_worker) return false;
  const c10::Storage& storage = t.storage();
  const size_t bytes = storage.nbytes();
  if (bytes == 0 || t.data_ptr() != storage.data() || t.nbytes() != bytes ||
      !storage_refusal(storage).empty() || declined_.contains(storage.unsafeGetStorageImpl())) {
    return false;
  }
  if (to_register) return true;  // the caller knows the tensor lives on (all_reduce(register=True))
  // auto_register: big enough, and reduced before by this communicator and still
  // alive: a buffer the caller keeps and reduces again (DDP's buckets), not
  // a temporary.
  if (bytes < kAutoRegisterMinBytes) return false;
  if (seen_.contains(storage.unsafeGetStorageImpl())) return true;
  seen_.add(storage);
  return false;
}

}  // namespace pycomm
