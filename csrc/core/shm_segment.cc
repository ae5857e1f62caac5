// The shm transport's segment: the mapping helpers, creating or attaching
// the segment (the constructor), and symmetric allocations.
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <new>

#include "shm_layout.h"
#include "stop_signals.h"

namespace pycomm {
namespace {

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

}  // namespace

namespace shm {

void* create_mapping(const std::string& name, size_t bytes, bool populate, const char* hint,
                     std::string* why) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    *why = "cannot create shared memory " + name + ": " + errno_str(errno);
    return nullptr;
  }
  int e = ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  // Reserve the pages now: tmpfs accepts a sparse size beyond its limit and
  // would SIGBUS on first touch; this turns a small /dev/shm into an error.
  if (e == 0) {
    const int fe = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (fe != 0 && fe != EOPNOTSUPP && fe != EINVAL) e = fe;
  }
  void* p = MAP_FAILED;
  if (e == 0) {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd,
             0);
    if (p == MAP_FAILED) e = errno;
  }
  close(fd);
  if (e != 0) {
    shm_unlink(name.c_str());
    *why = "cannot reserve " + std::to_string(bytes) + " bytes of shared memory (" + name +
           "): " + errno_str(e) + " (/dev/shm too small?" + hint + ")";
    return nullptr;
  }
  return p;
}

void* open_mapping(const std::string& name, size_t* bytes, bool populate, std::string* why) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    *why = "cannot open shared memory " + name + ": " + errno_str(errno);
    return nullptr;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size == 0 || static_cast<size_t>(st.st_size) < *bytes) {
    *why = name + " has " + std::to_string(st.st_size) + " bytes, not " +
           std::to_string(*bytes == 0 ? 1 : *bytes);
    close(fd);
    return nullptr;
  }
  if (*bytes == 0) *bytes = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, *bytes, PROT_READ | PROT_WRITE,
                 MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
  const int e = errno;
  close(fd);
  if (p == MAP_FAILED) {
    *why = "cannot map " + name + ": " + errno_str(e);
    return nullptr;
  }
  return p;
}

}  // namespace shm

SymmetricRegion::SymmetricRegion(uint64_t domain, uint64_t id, size_t bytes,
                                 std::vector<void*> bases, size_t map_bytes)
    : domain_(domain), id_(id), bytes_(bytes), map_bytes_(map_bytes), bases_(std::move(bases)) {}

SymmetricRegion::~SymmetricRegion() {
  for (void* b : bases_) {
    if (b) munmap(b, map_bytes_);
  }
}

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

namespace {

// The segment's geometry for `n` ranks under `cfg` (the creator's; the others
// read it from the header), with every offset of the layout.
Geometry layout_for(int n, const ShmConfig& cfg) {
  const size_t nchan = static_cast<size_t>(n) * (n - 1) * kNumChannels;
  Geometry g;
  g.version = kVersion;
  g.world_size = static_cast<uint32_t>(n);
  g.slots = std::max<size_t>(cfg.slots, 2);
  size_t want = cfg.slot_bytes;
  if (want == 0) {
    want = kAutoSlotMax;
    while (want > kAutoSlotMin && nchan * g.slots * want > kAutoRingBudget) want /= 2;
  }
  g.slot_bytes = round_up(std::max<size_t>(want, kLine), kLine);
  g.direct_bytes = round_up(std::max<size_t>(cfg.direct_bytes, kLine), kLine);
  g.direct_buffers = std::min<size_t>(std::max<size_t>(cfg.direct_buffers, 2), 64);
  g.ranks_offset = round_up(sizeof(Header), kLine);
  g.chan_offset = round_up(g.ranks_offset + n * sizeof(RankInfo), kPage);
  g.ctrl_bytes = round_up(sizeof(ChanCtrl) + kMetaWords * g.slots * sizeof(uint64_t), kPage);
  g.chan_stride = round_up(g.ctrl_bytes + g.slots * g.slot_bytes, kPage);
  g.direct_offset = g.chan_offset + nchan * g.chan_stride;
  const size_t nbuf = static_cast<size_t>(n) * g.direct_buffers;
  g.bufop_offset = g.direct_offset + nbuf * g.direct_bytes;
  g.total_bytes = round_up(g.bufop_offset + nbuf * sizeof(BufferOp), kPage);
  return g;
}

// Constructs the shared words of a new (zero-filled) segment at `base` in
// place, with the geometry of `g`, and publishes it (magic, last). Value
// initialisation zeroes every counter, flag and pid.
void init_segment(char* base, const Geometry& g) {
  const int n = static_cast<int>(g.world_size);
  const size_t nchan = static_cast<size_t>(n) * (n - 1) * kNumChannels;
  Header* h = new (base) Header();
  h->geo = g;
  for (int r = 0; r < n; ++r) new (base + g.ranks_offset + r * sizeof(RankInfo)) RankInfo();
  for (size_t i = 0; i < static_cast<size_t>(n) * g.direct_buffers; ++i) {
    new (base + g.bufop_offset + i * sizeof(BufferOp)) BufferOp();
  }
  for (size_t i = 0; i < nchan; ++i) new (base + g.chan_offset + i * g.chan_stride) ChanCtrl();
  h->magic.store(kMagic, std::memory_order_release);
}

}  // namespace

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
  std::string why;
  if (create) {
    const Geometry g = layout_for(n, cfg);
    name_watch_ = watch_name(name);  // until it is unlinked: a SIGTERM now leaves nothing
    map_ = create_mapping(name, g.total_bytes, /*populate=*/false,
                          " enlarge it, e.g. docker --shm-size, lower PYCOMM_SHM_SLOT_BYTES / "
                          "PYCOMM_SHM_SLOTS, or use transport='gloo'",
                          &why);
    if (map_ == nullptr) {
      unwatch_name(name_watch_);
      throw CommError("shm transport: " + why);
    }
    map_bytes_ = g.total_bytes;
    init_segment(static_cast<char*>(map_), g);
  } else {
    map_ = open_mapping(name, &map_bytes_, /*populate=*/false, &why);
    if (map_ == nullptr) {
      throw CommError("shm transport: rank " + std::to_string(rank) + ": " + why +
                      " (do all ranks share /dev/shm, i.e. one host and IPC namespace?)");
    }
    const Header* h = static_cast<const Header*>(map_);
    if (map_bytes_ < sizeof(Header) || h->magic.load(std::memory_order_acquire) != kMagic ||
        h->geo.version != kVersion || h->geo.world_size != static_cast<uint32_t>(n) ||
        h->geo.total_bytes != map_bytes_) {
      const uint32_t theirs = map_bytes_ < sizeof(Header) ? 0 : h->geo.world_size;
      munmap(map_, map_bytes_);
      map_ = nullptr;
      throw CommError("shm transport: " + name + " is not a pycomm segment of this layout or " +
                      "world size (" + std::to_string(theirs) + " vs " + std::to_string(n) + ")");
    }
  }
  char* base = static_cast<char*>(map_);
  Header* h = reinterpret_cast<Header*>(base);
  const Geometry& g = h->geo;
  seg_ = new ShmSegment{base,
                        h,
                        reinterpret_cast<RankInfo*>(base + g.ranks_offset),
                        n,
                        static_cast<size_t>(g.slot_bytes),
                        static_cast<size_t>(g.slots),
                        static_cast<size_t>(g.direct_bytes),
                        static_cast<size_t>(g.direct_buffers)};
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
  rx_.resize(n);
  pidfds_.assign(n, -1);
  pidfd_ok_.assign(n, true);
  stop_watch_ = watch_stop(&ShmTransport::on_stop_signal, this);
}

ShmTransport::~ShmTransport() {
  unwatch_stop(stop_watch_);  // before seg_ goes: the handler reads it
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
  unwatch_name(name_watch_);
}

void ShmTransport::unlink(const std::string& name) { shm_unlink(name.c_str()); }

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
  // This rank's name, until every rank has unlinked it: a SIGTERM in between
  // removes it too (stop_signals.h).
  const int watch = mine_why.empty() ? watch_name(symmetric_name(id, rank_)) : -1;
  struct Unwatch {
    int token;
    ~Unwatch() { unwatch_name(token); }
  } unwatch{watch};
  if (mine_why.empty()) {
    bases[rank_] =
        create_mapping(symmetric_name(id, rank_), map_bytes, /*populate=*/true, "", &mine_why);
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
      size_t got = map_bytes;
      std::string bad;
      void* p = open_mapping(symmetric_name(id, r), &got, /*populate=*/true, &bad);
      if (p == nullptr) {
        throw CommError("shm transport: rank " + std::to_string(r) + "'s symmetric memory: " + bad);
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

}  // namespace pycomm
