#include "shm_transport.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <limits>
#include <cstdio>
#include <cstdlib>
#include <cstddef>
#include <cstring>
#include <new>
#include <sstream>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace pycomm {
namespace {

constexpr uint64_t kMagic = 0x316d68735f6d6370ULL;  // "pcm_shm1"
constexpr uint32_t kVersion = 4;
constexpr size_t kLine = 64;
constexpr size_t kPage = 4096;
constexpr int64_t kHealthEveryNs = 1000000;      // liveness check period while waiting: 1 ms
constexpr int64_t kInterruptEveryNs = 20000000;  // SIGINT check period while waiting: 20 ms
// slot_bytes = 0: the automatic slot size (see ShmConfig).
constexpr size_t kAutoSlotMin = 64 * 1024, kAutoSlotMax = 256 * 1024;
constexpr size_t kAutoRingBudget = 32u << 20;
constexpr int64_t kSleepSliceNs = 2000000;  // futex sleeps at most 2 ms between checks
constexpr int64_t kSlowYieldNs = 200000;    // a yield this long gave the core away
constexpr int64_t kNoYieldNs = 100000000;   // then no yields for 100 ms
constexpr int kNumChannels = 2;             // kCollective, kUser (transport.h)
// Per ring slot: {bytes in slot, bytes of its message, op seq, op count, op
// packed} (OpHeader), padded to one cache line.
constexpr size_t kMetaWords = 8;
constexpr size_t kReasonBytes = 1024;  // Header::reason: why the first rank aborted

static_assert(std::atomic<uint32_t>::is_always_lock_free, "need lock-free 32-bit atomics");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "need lock-free 64-bit atomics");

size_t round_up(size_t a, size_t b) { return (a + b - 1) / b * b; }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void futex_wait(std::atomic<uint32_t>* addr, uint32_t val, int64_t timeout_ns) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout_ns / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout_ns % 1000000000);
  // Shared mapping: no FUTEX_PRIVATE_FLAG. EAGAIN / EINTR / ETIMEDOUT all mean
  // "look again".
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, val, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

size_t env_size(const char* name, size_t dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  const unsigned long long x = std::strtoull(v, &end, 10);
  if (end == v) return dflt;
  return static_cast<size_t>(x);
}

std::string errno_str(int e) { return std::string(std::strerror(e)); }

// SymmetricRegion::domain(): one per ShmTransport in this process.
std::atomic<uint64_t> g_symmetric_domains{0};

// Symmetric memory: each rank's part is a segment of its own. In the
// direct buffer used to agree on the outcome (allocate_symmetric): a flag
// word, then the reason a rank failed.
constexpr size_t kSymReasonBytes = 240;
struct SymOutcome {
  uint32_t ok;
  char why[kSymReasonBytes];
};

// Creates, reserves and maps shared memory `name` of `bytes` (a multiple of
// the page size); nullptr with `why` set when it cannot.
void* create_mapping(const std::string& name, size_t bytes, std::string* why) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    *why = "cannot create " + name + ": " + errno_str(errno);
    return nullptr;
  }
  int e = ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  // As for the segment: reserve the pages now, or a full /dev/shm would
  // SIGBUS on first touch instead of failing here.
  if (e == 0) {
    const int fe = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (fe != 0 && fe != EOPNOTSUPP && fe != EINVAL) e = fe;
  }
  void* p = MAP_FAILED;
  if (e == 0) {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (p == MAP_FAILED) e = errno;
  }
  close(fd);
  if (e != 0) {
    shm_unlink(name.c_str());
    *why = "cannot reserve " + std::to_string(bytes) + " bytes of shared memory (" + name +
           "): " + errno_str(e) + " (/dev/shm too small?)";
    return nullptr;
  }
  return p;
}

}  // namespace

SymmetricRegion::SymmetricRegion(uint64_t domain, uint64_t id, size_t bytes,
                                 std::vector<void*> bases, size_t map_bytes)
    : domain_(domain), id_(id), bytes_(bytes), map_bytes_(map_bytes), bases_(std::move(bases)) {}

SymmetricRegion::~SymmetricRegion() {
  for (void* b : bases_) {
    if (b) munmap(b, map_bytes_);
  }
}

// ------------------------------------------------------------ the layout

struct alignas(kLine) RankInfo {
  std::atomic<int32_t> pid;  // getpid() of the rank, 0 until it has attached
  char pad0[kLine - 4];
  std::atomic<uint32_t> doorbell;  // futex word: bumped by peers that publish while we sleep
  std::atomic<uint32_t> sleeping;  // 1 while this rank may be in futex_wait
  char pad1[kLine - 8];
  std::atomic<uint64_t> epoch;  // SharedBuffers: last epoch this rank arrived at
  char pad2[kLine - 8];
  // The collective this rank runs now (OpHeader), for a blocked peer to
  // compare with its own: seq is stored 0 first and last (release) after the
  // other words, so a reader that sees the same nonzero seq before and after
  // reading them has a consistent copy.
  std::atomic<uint64_t> op_seq;
  std::atomic<uint64_t> op_count;
  std::atomic<uint64_t> op_packed;
  char pad3[kLine - 24];
};

// Next to each direct buffer: the OpHeader of the piece in it and the
// arrival's tag (SharedBuffers::arrive_and_wait), written before the owner
// arrives (its epoch store releases them) and read by the peers after.
struct alignas(kLine) BufferOp {
  std::atomic<uint64_t> seq;
  std::atomic<uint64_t> count;
  std::atomic<uint64_t> packed;
  std::atomic<uint64_t> tag;
  char pad[kLine - 32];
};

struct alignas(kLine) Header {
  std::atomic<uint64_t> magic;  // stored last (release) by the creator
  uint32_t version;
  uint32_t world_size;
  uint64_t slot_bytes;
  uint64_t slots;
  uint64_t direct_bytes;
  uint64_t direct_buffers;
  uint64_t total_bytes;
  uint64_t ranks_offset;
  uint64_t chan_offset;
  uint64_t chan_stride;
  uint64_t ctrl_bytes;
  uint64_t direct_offset;
  uint64_t bufop_offset;
  alignas(kLine) std::atomic<uint32_t> abort;  // 0, or 1 + the rank that aborted
  std::atomic<uint32_t> reason_ready;          // 1 once `reason` is written (release)
  std::atomic<uint32_t> attached;              // ranks that mapped the segment
  char reason[kReasonBytes];                   // written by the rank that set `abort`
};

struct alignas(kLine) ChanCtrl {
  std::atomic<uint64_t> head;  // slots published by the sender
  char pad0[kLine - 8];
  std::atomic<uint64_t> tail;  // slots consumed by the receiver
  char pad1[kLine - 8];
  // followed by meta[kMetaWords * slots] (kMetaWords)
};

struct ShmSegment {
  char* base;
  Header* hdr;
  RankInfo* ranks;
  int n;
  size_t slot_bytes, slots, direct_bytes, direct_buffers;

  // One ring per (src, dst, channel), src != dst.
  size_t chan_index(int src, int dst, int ch) const {
    return (static_cast<size_t>(src) * (n - 1) + (dst < src ? dst : dst - 1)) * kNumChannels + ch;
  }
  char* chan(int src, int dst, int ch) const {
    return base + hdr->chan_offset + chan_index(src, dst, ch) * hdr->chan_stride;
  }
  ChanCtrl* ctrl(int src, int dst, int ch) const {
    return reinterpret_cast<ChanCtrl*>(chan(src, dst, ch));
  }
  std::atomic<uint64_t>* meta(int src, int dst, int ch) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(chan(src, dst, ch) + sizeof(ChanCtrl));
  }
  char* data(int src, int dst, int ch) const { return chan(src, dst, ch) + hdr->ctrl_bytes; }
  char* direct(int r, int which) const {
    return base + hdr->direct_offset +
           (static_cast<size_t>(r) * direct_buffers + which) * direct_bytes;
  }
  BufferOp* bufop(int r, int which) const {
    return reinterpret_cast<BufferOp*>(base + hdr->bufop_offset) +
           static_cast<size_t>(r) * direct_buffers + which;
  }
};

ShmConfig ShmConfig::from_env() {
  ShmConfig c;
  c.slot_bytes = env_size("PYCOMM_SHM_SLOT_BYTES", c.slot_bytes);
  c.slots = env_size("PYCOMM_SHM_SLOTS", c.slots);
  c.direct_bytes = env_size("PYCOMM_SHM_DIRECT_BYTES", c.direct_bytes);
  c.direct_buffers = env_size("PYCOMM_SHM_DIRECT_BUFFERS", c.direct_buffers);
  c.spin = static_cast<unsigned>(env_size("PYCOMM_SHM_SPIN", c.spin));
  c.yields = static_cast<unsigned>(env_size("PYCOMM_SHM_YIELDS", c.yields));
  return c;
}

// ------------------------------------------------------------ setup

ShmTransport::ShmTransport(const std::string& name, int rank, int world_size, bool create,
                           ShmConfig cfg)
    : name_(name),
      rank_(rank),
      size_(world_size),
      cfg_(cfg),
      symmetric_domain_(++g_symmetric_domains) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw CommError("shm transport: rank " + std::to_string(rank) +
                    " out of range for world_size " + std::to_string(world_size));
  }
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos ||
      name.size() > 200) {
    throw CommError("shm transport: bad segment name '" + name + "' (want \"/name\")");
  }
  const int n = world_size;
  int fd = -1;
  size_t total = 0;
  if (create) {
    const size_t slots = std::max<size_t>(cfg.slots, 2);
    const size_t nchan = static_cast<size_t>(n) * (n - 1) * kNumChannels;
    size_t want = cfg.slot_bytes;
    if (want == 0) {
      want = kAutoSlotMax;
      while (want > kAutoSlotMin && nchan * slots * want > kAutoRingBudget) want /= 2;
    }
    const size_t slot_bytes = round_up(std::max<size_t>(want, kLine), kLine);
    const size_t direct_bytes = round_up(std::max<size_t>(cfg.direct_bytes, kLine), kLine);
    const size_t direct_buffers = std::min<size_t>(std::max<size_t>(cfg.direct_buffers, 2), 64);
    const size_t ranks_offset = round_up(sizeof(Header), kLine);
    const size_t chan_offset = round_up(ranks_offset + n * sizeof(RankInfo), kPage);
    const size_t ctrl_bytes =
        round_up(sizeof(ChanCtrl) + kMetaWords * slots * sizeof(uint64_t), kPage);
    const size_t chan_stride = round_up(ctrl_bytes + slots * slot_bytes, kPage);
    const size_t direct_offset = chan_offset + nchan * chan_stride;
    const size_t bufop_offset =
        direct_offset + static_cast<size_t>(n) * direct_buffers * direct_bytes;
    total =
        round_up(bufop_offset + static_cast<size_t>(n) * direct_buffers * sizeof(BufferOp), kPage);

    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      throw CommError("shm transport: cannot create shared memory " + name + ": " +
                      errno_str(errno));
    }
    if (ftruncate(fd, static_cast<off_t>(total)) != 0) {
      const int e = errno;
      close(fd);
      shm_unlink(name.c_str());
      throw CommError("shm transport: cannot size " + name + " to " + std::to_string(total) +
                      " bytes: " + errno_str(e) + " (is /dev/shm large enough?)");
    }
    // Reserve the pages now: tmpfs accepts a sparse size beyond its limit and
    // would SIGBUS on first touch; this turns a small /dev/shm into an error.
    const int fe = posix_fallocate(fd, 0, static_cast<off_t>(total));
    if (fe != 0 && fe != EOPNOTSUPP && fe != EINVAL) {
      close(fd);
      shm_unlink(name.c_str());
      throw CommError("shm transport: cannot reserve " + std::to_string(total) + " bytes for " +
                      name + ": " + errno_str(fe) +
                      " (/dev/shm too small? enlarge it, e.g. docker --shm-size, lower "
                      "PYCOMM_SHM_SLOT_BYTES / PYCOMM_SHM_SLOTS, or use transport='gloo')");
    }
    void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int e = errno;
    close(fd);
    if (p == MAP_FAILED) {
      shm_unlink(name.c_str());
      throw CommError("shm transport: cannot map " + name + ": " + errno_str(e));
    }
    map_ = p;
    map_bytes_ = total;
    char* base = static_cast<char*>(p);
    // ftruncate zero-filled the segment; construct the shared words in place.
    Header* h = new (base) Header();
    h->version = kVersion;
    h->world_size = static_cast<uint32_t>(n);
    h->slot_bytes = slot_bytes;
    h->slots = slots;
    h->direct_bytes = direct_bytes;
    h->direct_buffers = direct_buffers;
    h->total_bytes = total;
    h->ranks_offset = ranks_offset;
    h->chan_offset = chan_offset;
    h->chan_stride = chan_stride;
    h->ctrl_bytes = ctrl_bytes;
    h->direct_offset = direct_offset;
    h->bufop_offset = bufop_offset;
    h->abort.store(0, std::memory_order_relaxed);
    h->reason_ready.store(0, std::memory_order_relaxed);
    h->attached.store(0, std::memory_order_relaxed);
    for (int r = 0; r < n; ++r) {
      RankInfo* ri = new (base + ranks_offset + r * sizeof(RankInfo)) RankInfo();
      ri->pid.store(0, std::memory_order_relaxed);
      ri->doorbell.store(0, std::memory_order_relaxed);
      ri->sleeping.store(0, std::memory_order_relaxed);
      ri->epoch.store(0, std::memory_order_relaxed);
      ri->op_seq.store(0, std::memory_order_relaxed);
    }
    for (size_t i = 0; i < static_cast<size_t>(n) * direct_buffers; ++i) {
      new (base + bufop_offset + i * sizeof(BufferOp)) BufferOp();
    }
    for (size_t i = 0; i < nchan; ++i) {
      ChanCtrl* cc = new (base + chan_offset + i * chan_stride) ChanCtrl();
      cc->head.store(0, std::memory_order_relaxed);
      cc->tail.store(0, std::memory_order_relaxed);
    }
    h->magic.store(kMagic, std::memory_order_release);
  } else {
    fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) {
      throw CommError("shm transport: rank " + std::to_string(rank) +
                      " cannot open shared memory " + name + ": " + errno_str(errno) +
                      " (do all ranks share /dev/shm, i.e. one host and IPC namespace?)");
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < sizeof(Header)) {
      close(fd);
      throw CommError("shm transport: " + name + " is not a pycomm segment");
    }
    total = static_cast<size_t>(st.st_size);
    void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int e = errno;
    close(fd);
    if (p == MAP_FAILED) throw CommError("shm transport: cannot map " + name + ": " + errno_str(e));
    map_ = p;
    map_bytes_ = total;
    Header* h = reinterpret_cast<Header*>(p);
    if (h->magic.load(std::memory_order_acquire) != kMagic || h->version != kVersion ||
        h->world_size != static_cast<uint32_t>(n) || h->total_bytes != total) {
      munmap(map_, map_bytes_);
      map_ = nullptr;
      throw CommError("shm transport: " + name + " has a different layout or world size (" +
                      std::to_string(h->world_size) + " vs " + std::to_string(n) + ")");
    }
  }
  char* base = static_cast<char*>(map_);
  Header* h = reinterpret_cast<Header*>(base);
  seg_ = new ShmSegment{base,
                        h,
                        reinterpret_cast<RankInfo*>(base + h->ranks_offset),
                        n,
                        static_cast<size_t>(h->slot_bytes),
                        static_cast<size_t>(h->slots),
                        static_cast<size_t>(h->direct_bytes),
                        static_cast<size_t>(h->direct_buffers)};
  seg_->ranks[rank_].pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
  // The last rank to map the segment removes its name at once: from then on
  // nothing is left in /dev/shm whoever dies, without waiting for the
  // store barrier in pycomm/comm.py (which a dying rank may never reach).
  if (h->attached.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(n)) {
    unlink(name_);
    unlinked_ = true;
  }

  sendq_.resize(n * kNumChannels);
  recvq_.resize(n * kNumChannels);
  send_head_.assign(n * kNumChannels, 0);
  recv_tail_.assign(n * kNumChannels, 0);
  pidfds_.assign(n, -1);
  pidfd_ok_.assign(n, true);
}

ShmTransport::~ShmTransport() {
  for (int fd : pidfds_) {
    if (fd >= 0) close(fd);
  }
  delete seg_;
  seg_ = nullptr;
  if (map_) munmap(map_, map_bytes_);
  map_ = nullptr;
  // Normally already unlinked right after every rank attached; this covers an
  // init that failed half way. Names are unique, so this never hits another
  // communicator's segment.
  if (!unlinked_) unlink(name_);
}

void ShmTransport::unlink(const std::string& name) { shm_unlink(name.c_str()); }

// ------------------------------------------------------------ failure

void ShmTransport::fail(const std::string& msg) {
  // Tell the peers at once, and why: they fail fast with the same reason
  // instead of waiting for a timeout.
  abort_with(msg);
  throw CommError(msg);
}

void ShmTransport::abort() { abort_with(""); }

void ShmTransport::abort_with(const std::string& reason) {
  aborted_.store(true, std::memory_order_release);
  if (!seg_) return;
  uint32_t zero = 0;
  if (seg_->hdr->abort.compare_exchange_strong(zero, static_cast<uint32_t>(rank_ + 1)) &&
      !reason.empty()) {
    const size_t m = std::min(reason.size(), kReasonBytes - 1);
    std::memcpy(seg_->hdr->reason, reason.data(), m);
    seg_->hdr->reason[m] = 0;
    seg_->hdr->reason_ready.store(1, std::memory_order_release);
  }
  for (int r = 0; r < size_; ++r) {
    seg_->ranks[r].doorbell.fetch_add(1);
    futex_wake(&seg_->ranks[r].doorbell);
  }
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
         " timed out after " + std::to_string(timeout_.count()) + " ms; " + pending_desc());
  }
}

std::string ShmTransport::pending_desc() const {
  std::ostringstream s;
  s << "pending:";
  bool any = false;
  for (size_t qi = 0; qi < sendq_.size(); ++qi) {
    const int r = static_cast<int>(qi) / kNumChannels;
    const char* ch = qi % kNumChannels == kUser ? " [user p2p]" : "";
    if (!sendq_[qi].empty()) {
      s << " send to rank " << r << ch << " (" << sendq_[qi].front().done << "/"
        << sendq_[qi].front().bytes << " bytes)";
      any = true;
    }
    if (!recvq_[qi].empty()) {
      s << " recv from rank " << r << ch << " (" << recvq_[qi].front().done << "/"
        << recvq_[qi].front().bytes << " bytes)";
      any = true;
    }
  }
  if (!any) s << " waiting for peers to arrive";
  s << "; this rank " << (op_.seq ? "runs " + op_.str() : std::string("ran no collective yet"));
  for (int r = 0; r < size_; ++r) {
    OpHeader h;
    if (r != rank_ && peer_op(r, &h)) s << ", rank " << r << " runs " << h.str();
  }
  return s.str();
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
      // scheduler slice instead, every wait: a 40 MiB all-reduce with the
      // caller computing took 400-650 ms instead of 17 ms idle (2 ranks,
      // 2 cores; 45 ms without yields). The futex sleep below does not pay
      // that, since the peer's wake-up preempts the computing thread, but a
      // sleep costs tens of microseconds per op where a yield costs one. So
      // two slow yields in a row (one alone is a hiccup) turn yielding off
      // for a while.
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

// ------------------------------------------------------------ progress

void ShmTransport::complete_op(Handle group) {
  --pending_ops_;
  auto it = remaining_.find(group);
  if (it != remaining_.end() && --it->second == 0) remaining_.erase(it);
}

bool ShmTransport::progress_send(int peer, int ch) {
  const int qi = peer * kNumChannels + ch;
  auto& q = sendq_[qi];
  if (q.empty()) return false;
  const size_t slots = seg_->slots, slot_bytes = seg_->slot_bytes;
  ChanCtrl* c = seg_->ctrl(rank_, peer, ch);
  std::atomic<uint64_t>* meta = seg_->meta(rank_, peer, ch);
  char* data = seg_->data(rank_, peer, ch);
  uint64_t head = send_head_[qi];
  uint64_t tail = c->tail.load(std::memory_order_acquire);
  bool moved = false;
  while (!q.empty()) {
    Op& op = q.front();
    while (op.done < op.bytes || op.first) {
      if (head - tail >= slots) {
        tail = c->tail.load(std::memory_order_acquire);
        if (head - tail >= slots) break;  // ring full
      }
      const size_t slot = static_cast<size_t>(head % slots);
      const size_t m = std::min(slot_bytes, op.bytes - op.done);
      std::memcpy(data + slot * slot_bytes, op.buf + op.done, m);
      std::atomic<uint64_t>* sm = meta + kMetaWords * slot;
      sm[0].store(m, std::memory_order_relaxed);
      sm[1].store(op.bytes, std::memory_order_relaxed);
      sm[2].store(op.hdr.seq, std::memory_order_relaxed);
      sm[3].store(op.hdr.count, std::memory_order_relaxed);
      sm[4].store(op.packed, std::memory_order_relaxed);
      ++head;
      c->head.store(head, std::memory_order_release);
      op.done += m;
      op.first = false;
      moved = true;
      notify(peer);
    }
    if (op.done < op.bytes || op.first) break;
    const Handle g = op.group;
    q.pop_front();
    complete_op(g);
  }
  send_head_[qi] = head;
  return moved;
}

bool ShmTransport::progress_recv(int peer, int ch) {
  const int qi = peer * kNumChannels + ch;
  auto& q = recvq_[qi];
  if (q.empty()) return false;
  const size_t slots = seg_->slots, slot_bytes = seg_->slot_bytes;
  ChanCtrl* c = seg_->ctrl(peer, rank_, ch);
  std::atomic<uint64_t>* meta = seg_->meta(peer, rank_, ch);
  const char* data = seg_->data(peer, rank_, ch);
  uint64_t tail = recv_tail_[qi];
  uint64_t head = c->head.load(std::memory_order_acquire);
  bool moved = false;
  while (!q.empty()) {
    Op& op = q.front();
    while (op.done < op.bytes || op.first) {
      if (tail == head) {
        head = c->head.load(std::memory_order_acquire);
        if (tail == head) break;  // nothing published yet
      }
      const size_t slot = static_cast<size_t>(tail % slots);
      const std::atomic<uint64_t>* sm = meta + kMetaWords * slot;
      const size_t m = sm[0].load(std::memory_order_relaxed);
      const size_t total = sm[1].load(std::memory_order_relaxed);
      const size_t want = std::min(slot_bytes, op.bytes - op.done);
      // The sender's op header: on the collective channel it must be ours.
      const uint64_t seq = sm[2].load(std::memory_order_relaxed);
      if (ch == kCollective &&
          (seq != op.hdr.seq || sm[4].load(std::memory_order_relaxed) != op.packed ||
           sm[3].load(std::memory_order_relaxed) != op.hdr.count)) {
        recv_tail_[qi] = tail;
        fail("shm transport: " +
             mismatch_message(rank_, op.hdr, peer,
                              OpHeader::unpack(seq, sm[3].load(std::memory_order_relaxed),
                                               sm[4].load(std::memory_order_relaxed))));
      }
      if (m != want || total != op.bytes) {
        recv_tail_[qi] = tail;
        fail("shm transport: rank " + std::to_string(rank_) + " expected a message of " +
             std::to_string(op.bytes) + " bytes from rank " + std::to_string(peer) +
             " but it sent " + std::to_string(total) + " bytes" +
             (ch == kUser ? " (point-to-point: the send and the recv tensors differ in size)"
                          : " (mismatched collective calls across ranks?)"));
      }
      std::memcpy(op.buf + op.done, data + slot * slot_bytes, m);
      ++tail;
      c->tail.store(tail, std::memory_order_release);
      op.done += m;
      op.first = false;
      moved = true;
      notify(peer);
    }
    if (op.done < op.bytes || op.first) break;
    const Handle g = op.group;
    q.pop_front();
    complete_op(g);
  }
  recv_tail_[qi] = tail;
  return moved;
}

bool ShmTransport::progress_all() {
  bool moved = false;
  if (pending_ops_ == 0) return false;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    for (int ch = 0; ch < kNumChannels; ++ch) {
      // Receive first: it frees the peer's ring (and our data may be waiting).
      moved |= progress_recv(p, ch);
      moved |= progress_send(p, ch);
    }
  }
  if (moved) moved_ = true;
  return moved;
}

Handle ShmTransport::post(const P2POp* ops, size_t n) {
  check_not_aborted("post");
  const Handle h = next_++;
  size_t cnt = 0;
  for (size_t i = 0; i < n; ++i) {
    const P2POp& op = ops[i];
    if (op.peer < 0 || op.peer >= size_ || op.peer == rank_) {
      throw CommError("shm transport: rank " + std::to_string(rank_) + " cannot " +
                      (op.kind == P2POp::kSend ? "send to" : "recv from") + " rank " +
                      std::to_string(op.peer));
    }
    if (op.channel < 0 || op.channel >= kNumChannels) {
      throw CommError("shm transport: unknown channel " + std::to_string(op.channel));
    }
    // Collectives post matching empty chunks on both sides: skip them. A
    // user message takes a slot even when empty, so that 0 elements sent
    // against 3 expected is a size error, not a wait for the timeout.
    if (op.bytes == 0 && op.channel == kCollective) continue;
    const int qi = op.peer * kNumChannels + op.channel;
    auto& q = op.kind == P2POp::kSend ? sendq_[qi] : recvq_[qi];
    // User p2p carries no op header (seq 0): only its size is checked.
    const OpHeader hdr = op.channel == kCollective ? op_ : OpHeader{};
    q.push_back(Op{static_cast<char*>(op.buf), op.bytes, 0, true, h, hdr, hdr.packed()});
    ++cnt;
  }
  if (cnt == 0) return h;
  remaining_[h] = cnt;
  pending_ops_ += cnt;
  progress_all();  // start at once: push what fits, take what has arrived
  return h;
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

bool ShmTransport::test(Handle h) {
  if (remaining_.find(h) == remaining_.end()) return true;
  progress_all();
  if (remaining_.find(h) == remaining_.end()) return true;
  // Abort and dead peers raise here too; the caller (Comm) owns the deadline.
  check_health("test", std::numeric_limits<int64_t>::max());
  return false;
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

// ------------------------------------------------------------ SharedBuffers

size_t ShmTransport::capacity() const { return seg_->direct_bytes; }

int ShmTransport::num_buffers() const { return static_cast<int>(seg_->direct_buffers); }

void* ShmTransport::local(int which) { return seg_->direct(rank_, which); }

const void* ShmTransport::remote(int r, int which) const { return seg_->direct(r, which); }

uint64_t ShmTransport::tag(int r, int which) const {
  return seg_->bufop(r, which)->tag.load(std::memory_order_relaxed);
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
    const uint64_t seq = b->seq.load(std::memory_order_relaxed);
    const uint64_t count = b->count.load(std::memory_order_relaxed);
    const uint64_t p = b->packed.load(std::memory_order_relaxed);
    if (seq != op_.seq || count != op_.count || p != packed) {
      fail("shm transport: " + mismatch_message(rank_, op_, r, OpHeader::unpack(seq, count, p)));
    }
  }
}

std::string ShmTransport::symmetric_name(uint64_t id, int r) const {
  return name_ + ".s" + std::to_string(id) + "." + std::to_string(r);
}

std::shared_ptr<SymmetricRegion> ShmTransport::allocate_symmetric(size_t bytes,
                                                                  const std::string& refuse,
                                                                  std::string* why) {
  const uint64_t id = ++symmetric_count_;
  const size_t map_bytes = round_up(std::max<size_t>(bytes, 1), kPage);
  std::vector<void*> bases(static_cast<size_t>(size_), nullptr);
  // Undoes what this rank holds: its mappings, and every rank's name
  // (ENOENT is fine), so that a rank that died leaves nothing in /dev/shm.
  auto release = [&] {
    for (void*& b : bases) {
      if (b) munmap(b, map_bytes);
      b = nullptr;
    }
    for (int r = 0; r < size_; ++r) shm_unlink(symmetric_name(id, r).c_str());
  };
  std::string mine_why = refuse;  // non-empty: declined by the caller, create nothing
  const char* env = std::getenv("PYCOMM_SHM_SYMMETRIC");
  if (mine_why.empty() && env != nullptr && std::string(env) == "0") {
    mine_why = "symmetric memory is disabled (PYCOMM_SHM_SYMMETRIC=0)";
  }
  if (mine_why.empty()) {
    bases[rank_] = create_mapping(symmetric_name(id, rank_), map_bytes, &mine_why);
  }
  // The reason travels in a direct buffer, cut to what it holds
  // (PYCOMM_SHM_DIRECT_BYTES may make it as small as a cache line).
  const size_t room = std::min(kSymReasonBytes, capacity() - offsetof(SymOutcome, why));
  try {
    // Agree on the outcome: every rank publishes its own in a direct buffer.
    const int which = next_buffer();
    auto* out = static_cast<SymOutcome*>(local(which));
    out->ok = bases[rank_] != nullptr;
    std::snprintf(out->why, room, "%s", mine_why.c_str());
    arrive_and_wait(next_epoch(), which);
    for (int r = 0; r < size_; ++r) {
      const auto* theirs = static_cast<const SymOutcome*>(remote(r, which));
      if (theirs->ok == 1) continue;
      release();
      *why =
          "rank " + std::to_string(r) + ": " + std::string(theirs->why, strnlen(theirs->why, room));
      return nullptr;
    }
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const std::string name = symmetric_name(id, r);
      const int fd = shm_open(name.c_str(), O_RDWR, 0);
      struct stat st;
      std::string bad;
      if (fd < 0 || fstat(fd, &st) != 0) {
        bad = errno_str(errno);
      } else if (static_cast<size_t>(st.st_size) < map_bytes) {
        bad = std::to_string(st.st_size) + " bytes, not " + std::to_string(map_bytes);
      }
      if (!bad.empty()) {
        if (fd >= 0) close(fd);
        throw CommError("shm transport: cannot open rank " + std::to_string(r) +
                        "'s symmetric memory " + name + ": " + bad);
      }
      void* p = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
      const int e = errno;
      close(fd);
      if (p == MAP_FAILED) {
        throw CommError("shm transport: cannot map rank " + std::to_string(r) +
                        "'s symmetric memory " + name + ": " + errno_str(e));
      }
      bases[r] = p;
    }
    // Every rank has mapped every part: the names can go (the memory stays
    // until the last process unmaps it). Every rank removes every name, so a
    // rank killed right here leaves nothing behind.
    arrive_and_wait(next_epoch(), next_buffer());
    for (int r = 0; r < size_; ++r) shm_unlink(symmetric_name(id, r).c_str());
  } catch (...) {
    release();  // a peer failed or died half way
    throw;
  }
  return std::make_shared<SymmetricRegion>(symmetric_domain_, id, bytes, std::move(bases),
                                           map_bytes);
}

void ShmTransport::begin_op(const OpHeader& h) {
  const OpHeader prev = op_;
  op_ = h;
  RankInfo& me = seg_->ranks[rank_];
  me.op_seq.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  me.op_count.store(h.count, std::memory_order_relaxed);
  me.op_packed.store(h.packed(), std::memory_order_relaxed);
  me.op_seq.store(h.seq, std::memory_order_release);
  // A message of an earlier collective that nobody here received (say both
  // ranks broadcast as root: each only sends) would otherwise be taken by a
  // later ring op, or sit there under direct ones. Every collective receives
  // all it was sent before it returns, so an unread slot of an earlier op
  // now is a mismatch.
  // The fence pairs with the peer's: of two ranks that both only sent, at
  // least one sees the other's message here.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    const int qi = p * kNumChannels + kCollective;
    if (!recvq_[qi].empty()) continue;
    const uint64_t tail = recv_tail_[qi];
    if (seg_->ctrl(p, rank_, kCollective)->head.load(std::memory_order_acquire) == tail) continue;
    const std::atomic<uint64_t>* sm =
        seg_->meta(p, rank_, kCollective) + kMetaWords * (tail % seg_->slots);
    const OpHeader theirs = OpHeader::unpack(sm[2].load(std::memory_order_relaxed),
                                             sm[3].load(std::memory_order_relaxed),
                                             sm[4].load(std::memory_order_relaxed));
    // The peer may have started this op already (its first message): fine.
    if (theirs.seq == 0 || theirs.seq >= h.seq) continue;
    fail("shm transport: " + mismatch_message(rank_, theirs.seq == prev.seq ? prev : h, p, theirs) +
         "; rank " + std::to_string(p) + " sent data that this rank never received");
  }
}

bool ShmTransport::peer_op(int r, OpHeader* out) const {
  const RankInfo& ri = seg_->ranks[r];
  const uint64_t s1 = ri.op_seq.load(std::memory_order_acquire);
  const uint64_t count = ri.op_count.load(std::memory_order_relaxed);
  const uint64_t p = ri.op_packed.load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (s1 == 0 || ri.op_seq.load(std::memory_order_relaxed) != s1) return false;
  *out = OpHeader::unpack(s1, count, p);
  return true;
}

void ShmTransport::check_peer_ops() {
  // Checked mode's exchange shares its op's number: a peer may still be in
  // it while this rank runs the op itself.
  constexpr int32_t kCheck = static_cast<int32_t>(CollKind::kCheck);
  if (op_.seq == 0 || op_.kind == kCheck) return;
  for (int r = 0; r < size_; ++r) {
    OpHeader h;
    if (r != rank_ && peer_op(r, &h) && h.seq == op_.seq && h.kind != kCheck && h != op_) {
      fail("shm transport: " + mismatch_message(rank_, op_, r, h));
    }
  }
}

}  // namespace pycomm
