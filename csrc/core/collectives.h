// Rooted collectives (reduce, gather, scatter) and all-to-all, written once
// against Transport + Reducer like the ring algorithms (algorithms.h): the
// same post / wait / reduce / copy sequence executes on CPU and enqueues on
// GPU. Local copies go through Reducer::copy, received slices through
// ctx.scratch, so nothing here touches memory the executor did not give it.
//
// Element counts are per rank or per peer; `es` is the element size in bytes.
// Every rank passes the same `root` (the op header carries it; a mismatch is
// a CommError on default settings wherever messages meet, and checked mode
// compares it on every rank before anything moves).
#pragma once

#include <cstddef>
#include <cstdint>

#include "algorithms.h"

namespace pycomm {

// ---- reduce (rooted.cc) ---------------------------------------------------
//
// In-place reduce of `count` elements to `root`: afterwards `data` on root
// holds op over all ranks (AVG: scaled by 1/world_size). On the other ranks
// `data` holds partial results (torch.distributed leaves non-root contents
// undefined after reduce; we overwrite them rather than stage a copy).
void reduce(const Context& ctx, void* data, size_t count, DType dtype, ReduceOp op, int root);

// The algorithm behind reduce(): a pipelined chain toward the root: root+n-1 -> root+n-2 -> ... ->
// root, in slices of about ctx.slice_bytes. Each rank receives a slice of the partial result from
// its successor, reduces its own data into it and forwards it while the next slice is in flight:
// n-1 hops of latency, every link carries the data once, all ranks work at once. Root's result:
// x_root op (x_root+1 op (... op x_root-1)).
//
// reduce() is the chain alone, not ring reduce-scatter + each rank sending
// its reduced chunk to the root. Small: one hop per rank instead of n-1 ring
// steps and a hop to the root. Large: the pipelined chain keeps every rank
// busy at once (receive slice k+1 while reducing slice k and forwarding slice
// k-1) and the root takes in the data once, while the ring's second phase
// (the root receiving (n-1)/n of the data) runs after the first, with the
// other ranks idle. It is also NCCL's ring reduce: a chain ending at the
// root. The measurements: benchmarks/collectives/README.md, "reduce: a chain,
// not ring reduce-scatter + gather".
void chain_reduce(const Context& ctx, void* data, size_t count, DType dtype, ReduceOp op, int root);

// ---- gather / scatter (rooted.cc) -----------------------------------------
//
// gather: every rank's `in` (m elements) lands in out[r] on root (out: an
// array of world_size pointers, read on root only; rank root's own block is
// copied locally, and out[root] may equal `in`). Every non-root rank sends
// straight to the root (one group of n-1 receives there): the root's link
// carries (n-1) m elements whatever the schedule, and this is the fewest
// hops.
void gather(const Context& ctx, const void* in, void* const* out, size_t m, size_t es, int root);

// scatter: out (m elements) on rank r gets in[r] of root (in: world_size
// pointers, read on root only; in[root] may equal `out`).
void scatter(const Context& ctx, const void* const* in, void* out, size_t m, size_t es, int root);

// ---- all-to-all (all_to_all.cc) -------------------------------------------
//
// Rank r sends send_count[p] elements from send[p] to every rank p and
// receives recv_count[p] elements from p into recv[p] (arrays of world_size
// entries; the block to itself is copied locally, send[r] may equal recv[r]).
//
// Pairwise schedule, deadlock-free by construction: step k = 1..n-1 posts
// {send to r+k, recv from r-k} as one group (every rank's step k pairs with
// its partners' step k), with step k+1 posted while step k is in flight.
//
// Before any payload moves, the ranks all-gather every rank's send and
// receive counts (verify_all_to_all_counts) and compare send_count of rank i
// to j with recv_count of rank j from i, for every pair. A mismatch throws
// CommError on every rank alike (the same table, the same message), so a
// split that differs between sender and receiver never truncates, hangs or
// half-succeeds. The op header cannot do this (a rank's counts legitimately
// differ from its peers'), and per-pair checks would leave the other ranks
// finishing normally. Costs one all-gather of 16 n bytes per rank.
void all_to_all(const Context& ctx, const void* const* send, const size_t* send_count,
                void* const* recv, const size_t* recv_count, size_t es);

// The verification step of all_to_all on its own (a collective: every rank
// calls it at the same point). Needs ctx.scratch_bytes >= 16 * world_size
// (the table is exchanged in blocks of peers that fit).
void verify_all_to_all_counts(const Context& ctx, const size_t* send_count,
                              const size_t* recv_count);

}  // namespace pycomm
