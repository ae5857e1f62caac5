// The shm transport's waiting (block, the doorbell) and peer health (abort,
// dead peers, timeouts, SIGINT checks).
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>

#include <algorithm>
#include <cstdio>
#include <limits>

#include "shm_layout.h"
#include "stop_signals.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace pycomm {

// ------------------------------------------------------------ failure

void ShmTransport::fail(const std::string& msg) {
  // Tell the peers at once, and why: they fail fast with the same reason
  // instead of waiting for a timeout.
  abort_with(msg);
  throw CommError(msg);
}

void ShmTransport::abort() { abort_with(""); }

void ShmTransport::abort_with(const char* reason, size_t len) {
  aborted_.store(true, std::memory_order_release);
  if (!seg_) return;
  uint32_t zero = 0;
  if (seg_->hdr->abort.compare_exchange_strong(zero, static_cast<uint32_t>(rank_ + 1)) &&
      len != 0) {
    const size_t m = std::min(len, kReasonBytes - 1);
    std::memcpy(seg_->hdr->reason, reason, m);
    seg_->hdr->reason[m] = 0;
    seg_->hdr->reason_ready.store(1, std::memory_order_release);
  }
  for (int r = 0; r < size_; ++r) {
    seg_->ranks[r].doorbell.fetch_add(1);
    futex_wake(&seg_->ranks[r].doorbell);
  }
}

// Inside a SIGTERM/SIGHUP handler (stop_signals.h): the peers fail at once
// with "rank R was stopped by SIGTERM" instead of finding a dead process.
void ShmTransport::on_stop_signal(void* self, int signo) {
  auto* t = static_cast<ShmTransport*>(self);
  char reason[64];
  stop_reason(reason, sizeof(reason), t->rank_, signo);
  t->abort_with(reason, std::strlen(reason));
}

bool ShmTransport::peer_dead(int* who) {
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const int32_t pid = seg_->ranks[r].pid.load(std::memory_order_acquire);
    if (pid <= 0) continue;  // not attached yet
    if (pidfds_[r] < 0 && pidfd_ok_[r]) {
      const long fd = syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0);
      if (fd >= 0) {
        pidfds_[r] = static_cast<int>(fd);
      } else if (errno == ESRCH) {
        *who = r;
        return true;
      } else {
        pidfd_ok_[r] = false;  // old kernel or seccomp: fall back to kill + /proc
      }
    }
    if (pidfds_[r] >= 0) {
      // A pidfd polls readable once the process has exited (zombie or reaped).
      pollfd p{pidfds_[r], POLLIN, 0};
      if (poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR))) {
        *who = r;
        return true;
      }
      continue;
    }
    if (kill(pid, 0) != 0 && errno == ESRCH) {
      *who = r;
      return true;
    }
    // An unreaped killed child still answers kill(): look for a zombie.
    char path[64];
    std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
    if (FILE* f = std::fopen(path, "r")) {
      char buf[512];
      const size_t m = std::fread(buf, 1, sizeof(buf) - 1, f);
      std::fclose(f);
      buf[m] = 0;
      const char* rp = std::strrchr(buf, ')');
      if (rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X')) {
        *who = r;
        return true;
      }
    }
  }
  return false;
}

std::string ShmTransport::aborted_by(uint32_t a) const {
  std::string s = (a != 0 ? "rank " + std::to_string(a - 1) : std::string("this rank")) +
                  " aborted the communicator";
  if (a != 0 && seg_->hdr->reason_ready.load(std::memory_order_acquire)) {
    return s + ": " + seg_->hdr->reason;
  }
  return s + " (it hit an error or was aborted)";
}

// Throws if this rank or any peer aborted, naming the rank that did and why.
void ShmTransport::check_not_aborted(const char* what) {
  const uint32_t a = seg_->hdr->abort.load(std::memory_order_acquire);
  if (a == 0 && !aborted_.load(std::memory_order_acquire)) return;
  throw CommError(std::string("shm transport: ") + what + " on rank " + std::to_string(rank_) +
                  ": " + aborted_by(a));
}

void ShmTransport::check_health(const char* what, int64_t deadline_ns) {
  const uint32_t a = seg_->hdr->abort.load(std::memory_order_acquire);
  if (aborted_.load(std::memory_order_acquire) && (a == 0 || a == uint32_t(rank_ + 1))) {
    throw CommError(std::string("shm transport: ") + what + " on rank " + std::to_string(rank_) +
                    ": the communicator was aborted");
  }
  if (a != 0) {
    aborted_.store(true, std::memory_order_release);
    throw CommError(std::string("shm transport: ") + what + " on rank " + std::to_string(rank_) +
                    ": " + aborted_by(a));
  }
  const int64_t now = now_ns();
  if (now - last_health_ns_ >= kHealthEveryNs) {
    last_health_ns_ = now;
    // A peer running another op with our sequence number (say, direct while
    // we run a ring) would never send what we wait for: say what differs.
    check_peer_ops();
    int who = -1;
    if (peer_dead(&who)) {
      fail(std::string("shm transport: ") + what + " on rank " + std::to_string(rank_) +
           ": peer rank " + std::to_string(who) + " (pid " +
           std::to_string(seg_->ranks[who].pid.load()) + ") has died; " + pending_desc());
    }
  }
  if (interrupt_check_ && now - last_interrupt_ns_ >= kInterruptEveryNs) {
    last_interrupt_ns_ = now;
    try {
      interrupt_check_();
    } catch (const std::exception& e) {
      abort_with("rank " + std::to_string(rank_) + " was interrupted (" + e.what() + ")");
      throw;
    }
  }
  if (now >= deadline_ns) {
    fail(std::string("shm transport: ") + what + " on rank " + std::to_string(rank_) +
         " timed out after " + std::to_string(timeout_.count()) +
         " ms, the timeout of this communicator; " + pending_desc());
  }
}

std::string ShmTransport::pending_desc() const {
  std::string s = "pending:";
  bool any = false;
  for (size_t qi = 0; qi < sendq_.size(); ++qi) {
    const int r = static_cast<int>(qi) / kNumChannels;
    const char* ch = qi % kNumChannels == kUser ? " [user p2p]" : "";
    if (!sendq_[qi].empty()) {
      s += cat(" send to rank ", r, ch, " (", sendq_[qi].front().done, "/",
               sendq_[qi].front().bytes, " bytes)");
      any = true;
    }
    if (!recvq_[qi].empty()) {
      const Op& o = recvq_[qi].front();
      s += cat(" recv from rank ", r, ch);
      if (o.tag != 0) s += cat(" tag ", o.tag);
      s += cat(" (", o.done, "/", o.bytes, " bytes)");
      any = true;
    }
  }
  for (const Op& o : any_recvq_) {
    s += " recv from any rank [user p2p]";
    if (o.tag != 0) s += cat(" tag ", o.tag);
    s += cat(" (", o.bytes, " bytes)");
    any = true;
  }
  for (int r = 0; r < size_; ++r) {
    if (rx_[r].busy) {
      s += cat(" recv from rank ", r, " [user p2p] under way (", rx_[r].op.done, "/",
               rx_[r].op.bytes, " bytes)");
      any = true;
    }
  }
  if (!any) s += " waiting for peers to arrive";
  s += cat("; this rank ", op_.seq ? "runs " + op_.str() : std::string("ran no collective yet"));
  for (int r = 0; r < size_; ++r) {
    OpHeader h;
    if (r != rank_ && peer_op(r, &h)) s += cat(", rank ", r, " runs ", h.str());
  }
  return s;
}

// ------------------------------------------------------------ waiting

template <class Poll>
void ShmTransport::block(Poll&& poll, const char* what) {
  const int64_t deadline = now_ns() + static_cast<int64_t>(timeout_.count()) * 1000000;
  RankInfo& me = seg_->ranks[rank_];
  unsigned idle = 0;
  for (;;) {
    moved_ = false;
    if (poll()) return;
    if (moved_) {
      idle = 0;
      continue;
    }
    ++idle;
    if (idle <= cfg_.spin) {
      cpu_relax();
      if ((idle & 255) == 0) check_health(what, deadline);
      continue;
    }
    check_health(what, deadline);
    if (idle <= cfg_.spin + cfg_.yields) {
      // On an idle core a yield returns within microseconds. When another
      // thread wants the core (the caller computing its backward while DDP's
      // buckets reduce on the worker), it hands that thread a whole
      // scheduler slice instead, every wait, and an all-reduce with the
      // caller computing takes many times as long as on idle cores
      // (benchmarks/ddp/README.md, "Contention"). The futex sleep below does
      // not pay that, since the peer's wake-up preempts the computing thread,
      // but a sleep costs far more per op than a yield. So two slow yields in
      // a row (one alone is a hiccup) turn yielding off for a while.
      const int64_t t = now_ns();
      if (t >= no_yield_until_) {
        sched_yield();
        if (now_ns() - t <= kSlowYieldNs) {
          slow_yields_ = 0;
        } else if (++slow_yields_ >= 2) {
          slow_yields_ = 0;
          no_yield_until_ = now_ns() + kNoYieldNs;
        }
        continue;
      }
      idle = cfg_.spin + cfg_.yields;  // yields off: straight to the sleep
    }
    // Sleep on our doorbell. Announce it first, then look once more, so a
    // peer that publishes after our last look sees `sleeping` and wakes us.
    const uint32_t v = me.doorbell.load(std::memory_order_acquire);
    me.sleeping.store(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    moved_ = false;
    const bool done = poll();
    if (done || moved_) {
      me.sleeping.store(0, std::memory_order_relaxed);
      if (done) return;
      idle = 0;
      continue;
    }
    const int64_t left = deadline - now_ns();
    futex_wait(&me.doorbell, v, std::max<int64_t>(1000, std::min(left, kSleepSliceNs)));
    me.sleeping.store(0, std::memory_order_relaxed);
    idle = cfg_.spin / 2;  // woken: likely more to come soon, spin a little again
  }
}

void ShmTransport::notify(int peer) {
  // Pairs with the fence in block(): either the sleeper sees what we just
  // published, or we see its `sleeping` flag and wake it.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  RankInfo& ri = seg_->ranks[peer];
  if (ri.sleeping.load(std::memory_order_relaxed)) {
    ri.doorbell.fetch_add(1);
    futex_wake(&ri.doorbell);
  }
}

void ShmTransport::wait(Handle h) {
  if (remaining_.find(h) == remaining_.end()) return;
  block(
      [&] {
        progress_all();
        return remaining_.find(h) == remaining_.end();
      },
      "wait");
}

bool ShmTransport::idle_wait(int64_t max_ns) {
  // block()'s sleeping protocol: announce `sleeping`, then look (progress)
  // once more, so a peer that publishes after that look rings our doorbell.
  // interrupt() sets the flag before it rings, so one that comes before we
  // read the doorbell is seen below, and one that comes after changes it.
  RankInfo& me = seg_->ranks[rank_];
  const uint32_t v = me.doorbell.load(std::memory_order_acquire);
  me.sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const bool moved = progress_all();
  if (!moved && !interrupted_.exchange(false) && !aborted_.load(std::memory_order_acquire)) {
    futex_wait(&me.doorbell, v, std::max<int64_t>(1000, std::min(max_ns, kSleepSliceNs)));
  }
  me.sleeping.store(0, std::memory_order_relaxed);
  return true;
}

void ShmTransport::interrupt() {
  interrupted_.store(true, std::memory_order_release);
  if (!seg_) return;
  seg_->ranks[rank_].doorbell.fetch_add(1);
  futex_wake(&seg_->ranks[rank_].doorbell);
}

void ShmTransport::arrive_and_wait(uint64_t epoch, int which, uint64_t tag) {
  check_not_aborted("direct all-reduce");
  BufferOp* mine = seg_->bufop(rank_, which);
  const uint64_t packed = op_.packed();
  mine->seq.store(op_.seq, std::memory_order_relaxed);
  mine->count.store(op_.count, std::memory_order_relaxed);
  mine->packed.store(packed, std::memory_order_relaxed);
  mine->tag.store(tag, std::memory_order_relaxed);
  seg_->ranks[rank_].epoch.store(epoch, std::memory_order_release);
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) notify(r);
  }
  block(
      [&] {
        for (int r = 0; r < size_; ++r) {
          if (seg_->ranks[r].epoch.load(std::memory_order_acquire) < epoch) return false;
        }
        return true;
      },
      "arrive_and_wait");
  // Every peer wrote its op header next to its buffer before arriving, and
  // cannot rewrite it before we arrive at a later epoch (the reuse rule).
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const BufferOp* b = seg_->bufop(r, which);
    const OpHeader theirs = load_op(b->seq, b->count, b->packed);
    if (theirs != op_) fail("shm transport: " + mismatch_message(rank_, op_, r, theirs));
  }
}

}  // namespace pycomm
