// The memory patterns of pycomm's 2-rank shm all-reduce, without pycomm: how
// fast this machine runs them, next to one core's memcpy (issue 27's bound).
//
//   cc -O3 -o /tmp/memory_patterns benchmarks/allreduce/memory_patterns.c
//   /tmp/memory_patterns [size=64] [reps=15]      size: MiB, or KiB as 64K
//
// Two processes, pinned to cpus 0 and 1, share every buffer (MAP_SHARED).
// Each rank's tensor is S bytes of float32. The patterns, timed from a
// barrier to a barrier (the slower rank's time), interleaved rep by rep, the
// median printed. A rep of a tensor under 1 MiB is 1 MiB / S calls back to
// back (as the study times small sizes), its time per call printed; the
// patterns that wait for nobody (memcpy_alone, inplace_both, cma_alone)
// then repeat in cache.
//   handshake      a barrier alone: the round trip between the two cores
//                  that every 2-rank all-reduce pays at least once
//   memcpy_alone   rank 0 copies its tensor to private memory, rank 1 waits
//   inplace_both   both ranks x += x over their tensors at once: each rank
//                  reads and writes its tensor once, the least any
//                  in-place all-reduce does per rank
//   symmetric      pycomm's symmetric path: barrier (both tensors are
//                  ready), rank r reduces half r from both tensors, storing
//                  each sum to both (one pass), barrier
//   staged         pycomm's staged one-shot (csrc/core/direct.cc): per
//                  piece of up to 256 KiB, copy it into a shared buffer (4
//                  rotate, across calls too), barrier, x += the peer's copy
//   staged_local   the same, each rank reading its own copy: what staged
//                  would take if reading lines another core just wrote
//                  cost nothing more than reading one's own
//   cma_alone      rank 0 copies rank 1's tensor to private memory with
//                  process_vm_readv (the kernel's single copy, as MPICH's
//                  CMA), rank 1 waits: memcpy_alone's copy through the kernel
//   cma            pycomm's PYCOMM_SHM_CMA=1 path (direct.cc's
//                  cross_memory_all_reduce): per 256 KiB piece of its half,
//                  read the peer's piece into private memory with
//                  process_vm_readv and add it into its own tensor; barrier;
//                  read the peer's half, reduced, into its own tensor
#define _GNU_SOURCE
#include <immintrin.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { kPiece = 256 * 1024, kBuffers = 4, kMaxReps = 64 };

static size_t S;
static size_t piece;  // staged's and cma's: kPiece, or S if smaller
static int me;
static long epoch;
static _Atomic long* arrived;  // [2]
static double (*times)[8][kMaxReps];
static char* tensor[2];
static char* stage[2];
static char* priv;
static pid_t peer;  // the other rank's process, for process_vm_readv

static void* shared(size_t bytes) {
  void* p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    perror("mmap");
    exit(1);
  }
  memset(p, 0, bytes);
  return p;
}

static void barrier(void) {
  ++epoch;
  atomic_store(&arrived[me], epoch);
  while (atomic_load(&arrived[1 - me]) < epoch) _mm_pause();
}

// d = a + b, vectorised by the compiler (as pycomm's reduce loops)
__attribute__((target("avx2"))) static void add(float* d, const float* a, const float* b,
                                                size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = a[i] + b[i];
}
__attribute__((target("avx2"))) static void add_to_two(float* d0, float* d1, const float* a,
                                                       const float* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float v = a[i] + b[i];
    d0[i] = v;
    d1[i] = v;
  }
}

static void handshake(void) { barrier(); }
static void memcpy_alone(void) {
  if (me == 0) memcpy(priv, tensor[0], S);
}
static void inplace_both(void) {
  float* x = (float*)tensor[me];
  add(x, x, x, S / 4);
}
static void symmetric(void) {
  const size_t half = S / 2, off = me * half;
  float* a = (float*)(tensor[0] + off);
  float* b = (float*)(tensor[1] + off);
  barrier();
  add_to_two(a, b, a, b, half / 4);
  barrier();
}
static void staged_from(int peer_of_me) {
  static size_t w;  // the buffer to stage in next: rotates across calls as in pycomm
  for (size_t o = 0; o < S; o += piece, w = (w + 1) % kBuffers) {
    memcpy(stage[me] + w * kPiece, tensor[me] + o, piece);
    barrier();
    float* x = (float*)(tensor[me] + o);
    add(x, x, (const float*)(stage[peer_of_me] + w * kPiece), piece / 4);
  }
}
static void staged(void) { staged_from(1 - me); }
static void staged_local(void) { staged_from(me); }
// Copies `n` bytes at `from` in the peer's memory to `to`.
static void read_peer(void* to, const void* from, size_t n) {
  struct iovec local = {to, n}, remote = {(void*)from, n};
  if (process_vm_readv(peer, &local, 1, &remote, 1, 0) != (ssize_t)n) {
    perror("process_vm_readv");
    exit(1);
  }
}
static void cma_alone(void) {
  if (me == 0) read_peer(priv, tensor[1], S);
}
static void cma(void) {
  const size_t half = S / 2, mine = me * half, theirs = (1 - me) * half;
  for (size_t o = 0; o < half; o += piece) {
    const size_t n = half - o < piece ? half - o : piece;
    read_peer(priv, tensor[1 - me] + mine + o, n);
    float* x = (float*)(tensor[me] + mine + o);
    add(x, x, (const float*)priv, n / 4);
  }
  barrier();
  read_peer(tensor[me] + theirs, tensor[1 - me] + theirs, half);
}

static const struct {
  const char* name;
  void (*run)(void);
} kPatterns[] = {{"handshake", handshake},       {"memcpy_alone", memcpy_alone},
                 {"inplace_both", inplace_both},
                 {"symmetric", symmetric},       {"staged", staged},
                 {"staged_local", staged_local}, {"cma_alone", cma_alone},
                 {"cma", cma}};
enum { kNumPatterns = sizeof(kPatterns) / sizeof(kPatterns[0]) };

static int by_value(const void* x, const void* y) {
  const double a = *(const double*)x, b = *(const double*)y;
  return a < b ? -1 : a > b;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  char* unit = "";
  const size_t n = argc > 1 ? strtoul(argv[1], &unit, 10) : 64;
  const int reps = argc > 2 ? atoi(argv[2]) : 15;
  S = strcmp(unit, "K") == 0 ? n << 10 : n << 20;
  if (n == 0 || (*unit && strcmp(unit, "K") != 0) || S % 4096 || reps < 1 || reps > kMaxReps) {
    fprintf(stderr, "usage: %s [MiB >= 1, or KiB as 4K, 8K, ...] [reps <= %d]\n", argv[0],
            kMaxReps);
    return 2;
  }
  piece = S < kPiece ? S : kPiece;
  const int calls = S < (1 << 20) ? (1 << 20) / S : 1;  // per rep
  arrived = shared(2 * sizeof(long));
  times = shared(2 * sizeof(*times));
  for (int r = 0; r < 2; ++r) {
    tensor[r] = shared(S);
    stage[r] = shared(kBuffers * kPiece);
  }
  const pid_t child = fork();
  me = child == 0 ? 1 : 0;
  peer = me == 0 ? child : getppid();
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  CPU_SET(me, &cpus);
  if (sched_setaffinity(0, sizeof(cpus), &cpus) != 0) perror("sched_setaffinity (not pinned)");
  priv = aligned_alloc(4096, S);
  memset(priv, 1, S);
  for (int it = 0; it < reps; ++it) {
    for (int p = 0; p < kNumPatterns; ++p) {
      barrier();
      const double t0 = now();
      for (int c = 0; c < calls; ++c) kPatterns[p].run();
      barrier();
      times[me][p][it] = (now() - t0) / calls;
    }
  }
  if (me == 1) return 0;
  waitpid(child, NULL, 0);
  double med[kNumPatterns], base = 0;
  for (int p = 0; p < kNumPatterns; ++p) {
    double t[kMaxReps];
    for (int it = 0; it < reps; ++it) {
      t[it] = times[0][p][it] > times[1][p][it] ? times[0][p][it] : times[1][p][it];
    }
    qsort(t, reps, sizeof(double), by_value);
    med[p] = t[reps / 2];
    if (kPatterns[p].run == memcpy_alone) base = med[p];
  }
  printf("# %zu KiB per rank, 2 ranks, median of %d reps of %d calls (slower rank)\n", S >> 10,
         reps, calls);
  printf("%-14s %10s %10s %14s\n", "pattern", "us", "GB/s", "memcpy_alone/t");
  for (int p = 0; p < kNumPatterns; ++p) {
    printf("%-14s %10.2f %10.2f %14.2f\n", kPatterns[p].name, med[p] * 1e6, S / med[p] / 1e9,
           base / med[p]);
  }
  return 0;
}
