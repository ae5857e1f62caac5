// Cross-memory attach (CMA): reading a peer process's memory with one copy,
// process_vm_readv(2), as MPICH's and Open MPI's shared-memory transports do
// for large messages. With PYCOMM_SHM_CMA=1 on every rank, the shm transport
// uses it to all-reduce tensors that live in private memory (not registered
// in symmetric memory) without staging them through its shared buffers
// (direct.cc). Off by default: where the kernel's copy is much slower than a
// memcpy (on the VMs measured, half as fast), staging wins
// (benchmarks/allreduce/README.md, memory_patterns' cma rows).
//
// What it needs from the kernel: process_vm_readv (Linux 3.2), allowed by
// seccomp, and ptrace access to the peer (same user; Yama's ptrace_scope 1
// also needs the peer's PR_SET_PTRACER, which allow_peer_reads() sets). A
// communicator finds out once, on its first all-reduce in which every rank
// asks for it, with every rank at once (probe_cross_memory): each rank reads
// a word from every peer that the peer also published in shared memory, so
// a refusal or a pid from another pid namespace turns it off on every rank
// alike, and the all-reduce stages instead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pycomm {

class SharedBuffers;

// Lets processes of this user read this one's memory where Yama's
// ptrace_scope 1 would allow only its ancestors (no effect elsewhere). It
// stays so for the life of the process (PR_SET_PTRACER_ANY: any process of
// this user may then trace it), which is what PYCOMM_SHM_CMA=1 asks for.
void allow_peer_reads();

// Copies `bytes` from address `remote` of process `pid` to `local`. False,
// with `why` (the errno's text and how much was copied), when the kernel
// refused or the process is gone.
bool read_peer_memory(int pid, const void* remote, void* local, size_t bytes, std::string* why);

// The same, raising CommError("... rank `peer` ...") on failure: inside a
// collective, where every rank has agreed that reads work, a failure means
// the peer died, the caller freed the tensor during the op, or the tensor
// lives in memory the kernel cannot pin (a driver mapping: EFAULT). The
// communicator is then aborted like after any failed collective; the probe
// cannot foresee the last case, which is one reason the path is opt-in.
void read_peer_or_throw(int peer, int pid, const void* remote, void* local, size_t bytes);

// A collective step (every rank calls it at the same point of its op
// sequence): whether every rank can read every other rank's memory. Uses
// three arrivals of `sb` (three pieces); the same answer on every rank, and
// where it is no, `why` says which rank could not read and, on that rank,
// the kernel's answer.
bool probe_cross_memory(SharedBuffers& sb, int n, int me, std::string* why);

// The tag of an arrival that publishes an address for peers to read
// (direct.cc): the address with this bit set, so that it is never 0 (user
// addresses stay below 2^57 on x86-64 and arm64, 5-level paging included).
constexpr uint64_t kAddressTag = uint64_t{1} << 62;

}  // namespace pycomm
