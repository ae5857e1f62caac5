// The c10d backend's CUDA communicator, made at the group's first CUDA op.
//
// Its whole life in one place: the creation (once, collectively, by the
// factory; never while a lock that shutdown() or abort() take is held, so
// neither waits for an NCCL bootstrap), a failed creation (final: later CUDA
// ops raise the same error), the end (shut down or aborted: no communicator
// is made after it, and one still being made when it comes is aborted as it
// arrives).
#pragma once

#include <c10/core/Device.h>

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "comm.h"

namespace pycomm {

// Builds the group's communicator for `device` (CUDA, with an index) when
// operation `op` first needs it; throws (ValueError / RuntimeError) with the
// reason. bind_backend makes one from pycomm/backend.py's Python callable.
using CommFactory =
    std::function<std::shared_ptr<Comm>(const c10::Device& device, const std::string& op)>;

class LazyCudaComm {
 public:
  // `factory` may be empty: a CUDA tensor then raises ValueError. `rank` and
  // `world_size`: the group's, which the communicator made must match.
  LazyCudaComm(CommFactory factory, int rank, int world_size)
      : factory_(std::move(factory)), rank_(rank), world_size_(world_size) {}

  // The communicator for `device` (CUDA, with an index), made now if this is
  // the group's first CUDA op; `op` names the caller in errors.
  std::shared_ptr<Comm> get(const c10::Device& device, const char* op);
  // Whether a CUDA communicator can be made at all (a factory was given).
  bool has_factory() const { return static_cast<bool>(factory_); }
  // Ends it for shutdown: none is made from now on; returns the one made
  // (null if none) for the caller to close with the group's others.
  std::shared_ptr<Comm> shut_down();
  // Ends it for abort or shrink: none is made from now on; the one made (or
  // still being made) is aborted with `why`.
  void abort(const std::string& why);

 private:
  // The creation, under create_mu_ (cuda_mu_ free meanwhile).
  std::shared_ptr<Comm> create(const c10::Device& device, const char* op);

  CommFactory factory_;
  const int rank_, world_size_;
  std::mutex create_mu_;        // one creation at a time
  std::exception_ptr failure_;  // why the creation failed (guarded by create_mu_)
  std::mutex mu_;               // guards the fields below (held briefly)
  std::shared_ptr<Comm> comm_;  // null until the first CUDA op
  bool shut_down_ = false;
  bool aborted_ = false;
  std::string abort_reason_;  // what abort() said, for one still being made
};

}  // namespace pycomm
