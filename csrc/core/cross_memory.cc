// Cross-memory attach: see cross_memory.h.
#include "cross_memory.h"

#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <vector>

#include "transport.h"
#include "types.h"

namespace pycomm {

void allow_peer_reads() {
#ifdef PR_SET_PTRACER
  // Every time (once per communicator's probe): a forked child does not
  // inherit the setting. EINVAL where Yama is absent: nothing to allow.
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
#endif
}

bool read_peer_memory(int pid, const void* remote, void* local, size_t bytes, std::string* why) {
  size_t done = 0;
  while (done < bytes) {
    iovec to{static_cast<char*>(local) + done, bytes - done};
    iovec from{const_cast<char*>(static_cast<const char*>(remote)) + done, bytes - done};
    const ssize_t got = process_vm_readv(pid, &to, 1, &from, 1, 0);
    if (got > 0) {
      done += static_cast<size_t>(got);  // partial: a page boundary the kernel stopped at
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    if (why != nullptr) {
      *why = std::string("process_vm_readv: ") + (got < 0 ? std::strerror(errno) : "no progress") +
             " after " + std::to_string(done) + " of " + std::to_string(bytes) + " bytes";
    }
    return false;
  }
  return true;
}

void read_peer_or_throw(int peer, int pid, const void* remote, void* local, size_t bytes) {
  std::string why;
  if (!read_peer_memory(pid, remote, local, bytes, &why)) {
    throw CommError("reading rank " + std::to_string(peer) + "'s tensor (pid " +
                    std::to_string(pid) + ") failed: " + why +
                    "; the peer died, its tensor was freed during the collective, or the "
                    "kernel cannot read that memory (a driver or device mapping: unset "
                    "PYCOMM_SHM_CMA for such tensors)");
  }
}

bool probe_cross_memory(SharedBuffers& sb, int n, int me, std::string* why) {
  allow_peer_reads();
  // 1. Each rank publishes the address of a word of its own...
  uint64_t word = 0;
  while (word == 0) word = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  const int w1 = sb.next_buffer();
  sb.arrive_and_wait(sb.next_epoch(), w1, kAddressTag | reinterpret_cast<uintptr_t>(&word));
  // (A tag must be read before this rank's next arrival: see transport.h.)
  std::vector<uint64_t> address(n);
  for (int r = 0; r < n; ++r) address[r] = sb.tag(r, w1);
  // 2. ...and the word's value, in shared memory.
  const int w2 = sb.next_buffer();
  sb.arrive_and_wait(sb.next_epoch(), w2, word);
  // 3. Each rank reads every peer's word through the kernel and compares,
  //    then all agree: every rank must have read every word.
  bool ok = true;
  std::string mine;
  for (int r = 0; r < n && ok; ++r) {
    if (r == me) continue;
    uint64_t seen = 0;
    ok = read_peer_memory(sb.pid(r), reinterpret_cast<const void*>(address[r] & ~kAddressTag),
                          &seen, sizeof seen, &mine);
    if (ok && seen != sb.tag(r, w2)) {
      ok = false;
      mine = "read another value than the peer's (another pid namespace?)";
    }
    if (!ok)
      mine = "rank " + std::to_string(me) + " reading rank " + std::to_string(r) + ": " + mine;
  }
  // `word` stays alive until every peer has read it: they all arrive here
  // after reading.
  const int w3 = sb.next_buffer();
  sb.arrive_and_wait(sb.next_epoch(), w3, ok ? 1 : 2);
  for (int r = 0; r < n; ++r) {
    if (sb.tag(r, w3) == 1) continue;
    if (why != nullptr) *why = ok ? "rank " + std::to_string(r) + " could not read a peer" : mine;
    return false;
  }
  return true;
}

}  // namespace pycomm
