// The gloo transport's failure handling: telling the peers why this rank
// fails (an abort header on every lane, and the reason in the store), the
// store watcher that hears a peer's reason, and abort(). pg_transport.h says
// why both ways are needed.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "pg_transport.h"

namespace pycomm {

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
  // gloo's abort of a work only wakes its waiter: the receive stays posted,
  // and a healthy peer's payload would still land in a buffer that the
  // failed op may have freed by then. A wait that times out makes gloo close
  // that group's connections (its rule for any timeout), so nothing lands
  // after this. (Headers land in frames the works own.)
  for (auto& kv : pending_) {
    for (auto& m : kv.second.msgs) {
      auto& w = m.payload_work;
      try {
        if (w && !w->isCompleted()) w->wait(std::chrono::milliseconds(1));
      } catch (...) {
      }
    }
  }
  for (auto& kv : pending_) {
    for (auto& m : kv.second.msgs) {
      m.for_each_work([](c10::intrusive_ptr<c10d::Work>& w) {
        try {
          if (w) w->abort();
        } catch (...) {
        }
      });
    }
  }
}

}  // namespace pycomm
