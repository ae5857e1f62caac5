// Pipelining helpers shared by the algorithms that cut their data into slices
// (algorithms.cc, classic.cc): where a received slice lands in ctx.scratch,
// how a run of elements is cut, and the two-deep post / wait / finish loop.
// Internal to csrc/core.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithms.h"

namespace pycomm {

// The two receive slots of ring_reduce_scatter in ctx.scratch. Item k
// receives into slot k % 2 (item k+1 is posted while item k is in flight; slot
// (k+1) % 2 was last used by item k-1, already finished). When the scratch
// has room for a spare kChunkAlignBytes per slot (the bindings allocate
// 2 * slice_bytes + 64), a slice is received at the same address modulo 16 as
// the destination it is reduced into, so that the CUDA kernel's 16-byte pack
// path (dst, a and b equally aligned) is taken even for chunks that do not
// start 16-byte aligned (reduce_scatter's Chunks{m, 0} with m * elem_size not
// a multiple of 16); otherwise at the slot's start.
struct RecvSlots {
  char* base;
  size_t stride;
  bool match;
  char* at(size_t k, const char* dst) const {
    char* p = base + (k % 2) * stride;
    if (match) {
      p += (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(p)) % kChunkAlignBytes;
    }
    return p;
  }
};

inline RecvSlots recv_slots(const Context& ctx, size_t slice_bytes) {
  const size_t padded = round_up(slice_bytes, kChunkAlignBytes);
  const bool match = ctx.scratch_bytes >= 2 * (padded + kChunkAlignBytes);
  return RecvSlots{static_cast<char*>(ctx.scratch), match ? padded + kChunkAlignBytes : slice_bytes,
                   match};
}

// Elements of slice j of a chunk of `len` elements, cut every `per` elements.
struct Slice {
  size_t begin;
  size_t count;
};
inline Slice slice_of(size_t len, size_t per, size_t j) {
  const size_t b = std::min(len, j * per);
  return Slice{b, std::min(len, b + per) - b};
}

// Drives K items through a two-deep pipeline:
//
//   post(0)
//   for k in 0..K-1:
//     post(k+1)      (1) next transfer in flight ...
//     wait(k)        (2)
//     finish(k)      (3) ... while this one is reduced / consumed
//
// Step (1) happens before (3) only when item k+1 does not depend on item k
// (`overlap`): the ring algorithms pass overlap = (slices per chunk >= 2),
// since item k+1 then touches data finished by item k+1-slices <= k-1 and a
// scratch slot last used by item k-1.
template <class Post, class Finish>
void pipeline(size_t K, bool overlap, Transport& tr, Post&& post, Finish&& finish) {
  if (K == 0) return;
  std::vector<Handle> h(K);
  h[0] = post(0);
  for (size_t k = 0; k < K; ++k) {
    if (overlap && k + 1 < K) h[k + 1] = post(k + 1);
    tr.wait(h[k]);
    finish(k);
    if (!overlap && k + 1 < K) h[k + 1] = post(k + 1);
  }
}

}  // namespace pycomm
