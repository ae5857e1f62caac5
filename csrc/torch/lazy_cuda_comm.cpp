#include "lazy_cuda_comm.h"

#include <c10/util/Exception.h>

namespace pycomm {

std::shared_ptr<Comm> LazyCudaComm::get(const c10::Device& device, const char* op) {
  std::shared_ptr<Comm> comm;
  {
    std::lock_guard<std::mutex> lk(mu_);
    TORCH_CHECK(!shut_down_, op, ": this pycomm process group was shut down");
    comm = comm_;
    // After abort(), no new CUDA communicator (an existing one raises itself).
    TORCH_CHECK(comm || !aborted_, op, ": this pycomm process group was aborted");
  }
  if (!comm) comm = create(device, op);
  TORCH_CHECK_VALUE(comm->device() == device.str(), op, ": a tensor is on ", device.str(),
                    " but this group's CUDA communicator runs on ", comm->device(),
                    " (a pycomm process group uses one CUDA device: the one of its first CUDA "
                    "operation)");
  return comm;
}

std::shared_ptr<Comm> LazyCudaComm::create(const c10::Device& device, const char* op) {
  std::lock_guard<std::mutex> create(create_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (comm_) return comm_;  // made by the call this one waited for
  }
  TORCH_CHECK_VALUE(static_cast<bool>(factory_), op, ": got a tensor on ", device.str(),
                    ", but this pycomm process group was made without a CUDA communicator "
                    "factory (_C.make_backend(cuda_factory=None)): CPU tensors only");
  // A failed creation is final: the ranks that got further may have used up
  // the rendezvous (the NCCL id in the store), so a retry could only
  // mismatch. Later CUDA ops raise the same error.
  if (failure_) std::rethrow_exception(failure_);
  std::shared_ptr<Comm> comm;
  try {
    comm = factory_(device, op);
  } catch (...) {
    failure_ = std::current_exception();
    throw;
  }
  TORCH_CHECK(comm != nullptr && comm->rank() == rank_ && comm->world_size() == world_size_, op,
              ": the CUDA communicator made for this group does not match it (rank ",
              comm ? comm->rank() : -1, " of ", comm ? comm->world_size() : -1,
              ", the group's: rank ", rank_, " of ", world_size_, ")");
  std::lock_guard<std::mutex> lk(mu_);
  if (shut_down_ || aborted_) {
    comm->abort(aborted_ ? abort_reason_
                         : "the process group was shut down while its CUDA communicator was made");
    try {
      comm->close();
    } catch (...) {
    }
    TORCH_CHECK(false, op, ": this pycomm process group was shut down or aborted");
  }
  comm_ = comm;
  return comm;
}

std::shared_ptr<Comm> LazyCudaComm::shut_down() {
  std::lock_guard<std::mutex> lk(mu_);
  shut_down_ = true;
  return comm_;
}

void LazyCudaComm::abort(const std::string& why) {
  std::shared_ptr<Comm> comm;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!aborted_) abort_reason_ = why;
    aborted_ = true;  // one still being made is aborted when it arrives
    comm = comm_;
  }
  if (comm) comm->abort(why);
}

}  // namespace pycomm
