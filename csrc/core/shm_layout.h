// The shm transport's shared-memory layout and the helpers its sources share
// (shm_segment.cc: create/attach; shm_wait.cc: waiting and peer health;
// shm_transport.cc: progress). Internal to csrc/core.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "shm_transport.h"

namespace pycomm {
namespace shm {

constexpr uint64_t kMagic = 0x316d68735f6d6370ULL;  // "pcm_shm1"
constexpr uint32_t kVersion = 5;
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
// packed} (OpHeader), the user tag (kUser), padded to one cache line.
constexpr size_t kMetaWords = 8;
constexpr size_t kReasonBytes = 1024;  // Header::reason: why the first rank aborted

static_assert(std::atomic<uint32_t>::is_always_lock_free, "need lock-free 32-bit atomics");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "need lock-free 64-bit atomics");

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void futex_wait(std::atomic<uint32_t>* addr, uint32_t val, int64_t timeout_ns) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout_ns / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout_ns % 1000000000);
  // Shared mapping: no FUTEX_PRIVATE_FLAG. EAGAIN / EINTR / ETIMEDOUT all mean
  // "look again".
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, val, &ts, nullptr, 0);
}

inline void futex_wake(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline size_t env_size(const char* name, size_t dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  const unsigned long long x = std::strtoull(v, &end, 10);
  if (end == v) return dflt;
  return static_cast<size_t>(x);
}

inline std::string errno_str(int e) { return std::string(std::strerror(e)); }

// An op header stored as three words (a ring slot's metadata, a BufferOp).
inline OpHeader load_op(const std::atomic<uint64_t>& seq, const std::atomic<uint64_t>& count,
                        const std::atomic<uint64_t>& packed) {
  return OpHeader::unpack(seq.load(std::memory_order_relaxed),
                          count.load(std::memory_order_relaxed),
                          packed.load(std::memory_order_relaxed));
}

// Creates, reserves and maps shared memory `name` of `bytes` (a multiple of
// the page size; MAP_POPULATE when `populate`); nullptr with `why` set (and
// the name removed) when it cannot. `hint` ends the message of a failed
// reservation.
void* create_mapping(const std::string& name, size_t bytes, bool populate, const char* hint,
                     std::string* why);
// Opens and maps shared memory `name` that another rank created: `*bytes` of
// it, or all of it when `*bytes` is 0 (then set to its size); nullptr with
// `why` set when it is missing, smaller, or cannot be mapped.
void* open_mapping(const std::string& name, size_t* bytes, bool populate, std::string* why);

}  // namespace shm

using namespace shm;  // NOLINT: the shm sources share these names

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

// A segment's sizes and offsets: chosen by the creator (layout_for,
// shm_segment.cc), read from the header by the others.
struct Geometry {
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
};

struct alignas(kLine) Header {
  std::atomic<uint64_t> magic;  // stored last (release) by the creator
  Geometry geo;
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
    return base + hdr->geo.chan_offset + chan_index(src, dst, ch) * hdr->geo.chan_stride;
  }
  ChanCtrl* ctrl(int src, int dst, int ch) const {
    return reinterpret_cast<ChanCtrl*>(chan(src, dst, ch));
  }
  std::atomic<uint64_t>* meta(int src, int dst, int ch) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(chan(src, dst, ch) + sizeof(ChanCtrl));
  }
  char* data(int src, int dst, int ch) const { return chan(src, dst, ch) + hdr->geo.ctrl_bytes; }
  char* direct(int r, int which) const {
    return base + hdr->geo.direct_offset +
           (static_cast<size_t>(r) * direct_buffers + which) * direct_bytes;
  }
  BufferOp* bufop(int r, int which) const {
    return reinterpret_cast<BufferOp*>(base + hdr->geo.bufop_offset) +
           static_cast<size_t>(r) * direct_buffers + which;
  }
};

}  // namespace pycomm
