"""Uneven ring chunks start 16-byte aligned (csrc/core/algorithms.h
Chunks::aligned), and collectives of odd sizes stay exact.

* The partition itself: a small C++ driver compiled against algorithms.h
  prints Chunks::aligned for many (count, ranks, element size); every chunk
  starts at a multiple of 16 bytes, the chunks tile the buffer, their sizes
  differ by at most one 16-byte unit, and the split equals the independent
  Python model tests.reference.ring_chunks (which other tests use to predict
  which rank reduces which element). So does slice_elems, the ring's slice
  length.
* Every reduction of ring_all_reduce and ring_reduce_scatter (the real
  algorithms.cc, one rank's side, against a recording transport and reducer)
  has dst, a and b equal modulo 16, the CUDA kernel's condition for its
  16-byte pack path, and stays inside the data and the scratch.
* The same partition observed through a 3-rank ring's reduction order, in
  four float dtypes, on shm and gloo.
* all_reduce (ring, and direct on shm), the wire-dtype all_reduce,
  reduce_scatter and all_gather of odd sizes (1, 3, 7, 17, 1000003 elements)
  in several dtypes, 2 and 3 ranks, shm and gloo, against float64 / exact
  integer references, bitwise equal on every rank.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests.reference import assert_matches, digest, rank_input, reference, ring_chunks

ROOT = Path(__file__).resolve().parents[1]
COUNTS = [1, 3, 7, 17, 1_000_003]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int32]

# Prints, for each "count n elem_size slice_bytes" line on stdin, the offsets
# and lengths of Chunks::aligned(count, n, elem_size), then
# slice_elems(slice_bytes, elem_size).
_DRIVER = r"""
#include <cstdio>
#include "algorithms.h"
int main() {
  unsigned long count, es, slice;
  int n;
  while (std::scanf("%lu %d %lu %lu", &count, &n, &es, &slice) == 4) {
    const pycomm::Chunks c = pycomm::Chunks::aligned(count, n, es);
    for (int i = 0; i < n; ++i) std::printf("%zu %zu ", c.offset(i), c.length(i));
    std::printf("%zu %zu\n", c.max_length(), pycomm::slice_elems(slice, es));
  }
}
"""


def _build(tmp_path_factory, name: str, source: str, core: list[str]) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the driver")
    d = tmp_path_factory.mktemp(name)
    (d / f"{name}.cc").write_text(source)
    srcs = [str(d / f"{name}.cc")] + [str(ROOT / "csrc" / "core" / f) for f in core]
    proc = subprocess.run([cxx, "-std=c++17", "-O1", f"-I{ROOT / 'csrc' / 'core'}", *srcs,
                           "-o", str(d / name)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return d / name


@pytest.fixture(scope="module")
def chunks_driver(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "chunks", _DRIVER, [])


def _partition_cases():
    counts = list(range(0, 70)) + [1029, 1031, 65_537, 1_000_003, (1 << 20) + 13]
    for es in (1, 2, 4, 8):
        for n in (1, 2, 3, 4, 5, 8):
            for count in counts:
                yield count, n, es


def test_partition_is_aligned_tiles_and_is_balanced(chunks_driver):
    cases = list(_partition_cases())
    slices = [64, 100, 513, 4096, 4 << 20, 15]
    lines = [f"{c} {n} {es} {slices[i % len(slices)]}" for i, (c, n, es) in enumerate(cases)]
    out = subprocess.run([str(chunks_driver)], input="\n".join(lines) + "\n", text=True,
                         capture_output=True, check=True, timeout=120).stdout.splitlines()
    assert len(out) == len(cases)
    for i, ((count, n, es), row) in enumerate(zip(cases, out)):
        vals = [int(v) for v in row.split()]
        got = list(zip(vals[0:2 * n:2], vals[1:2 * n:2]))
        max_len, per = vals[2 * n], vals[2 * n + 1]
        what = f"count={count} n={n} elem_size={es}: {got}"
        unit = 16 // es
        assert got == ring_chunks(count, n, es), what
        assert all(off * es % 16 == 0 for off, _ in got), what  # aligned starts
        assert got[0][0] == 0 and sum(ln for _, ln in got) == count, what  # tiles the buffer
        assert all(got[c][0] + got[c][1] == got[c + 1][0] for c in range(n - 1)), what
        lengths = [ln for _, ln in got]
        assert max(lengths) - min(lengths) <= unit and max_len == max(lengths), what
        slice_bytes = slices[i % len(slices)]
        if slice_bytes >= 16:  # a slice of at least one unit: a whole number of units
            assert per * es % 16 == 0 and 0 < per * es <= slice_bytes, (slice_bytes, es, per)
        else:
            assert per == max(1, slice_bytes // es), (slice_bytes, es, per)


def test_partition_examples():
    # the two worked examples of algorithms.h
    assert ring_chunks(10, 2, 4) == [(0, 4), (4, 6)]
    assert ring_chunks(17, 3, 1) == [(0, 16), (16, 0), (16, 1)]
    # a count not divisible by the world size: no chunk starts mid-unit
    assert ring_chunks(1_000_003, 3, 2) == [(0, 333_336), (333_336, 333_336), (666_672, 333_331)]


# ---------------------------------------------------------------- every reduction takes the pack path

# Runs one rank's side of ring_all_reduce / ring_reduce_scatter (the real
# csrc/core/algorithms.cc) against a transport that completes every transfer
# at once and a reducer that only records its arguments, with the buffers the
# bindings give it (a 64-byte aligned tensor; scratch of 2 * slice_bytes + 64
# bytes). Prints, per "algo count n rank dtype slice_bytes" line: the number
# of reductions, how many of them the CUDA kernel could not run on 16-byte
# packs (dst, a and b not equal modulo 16), and how many read or received
# outside the scratch or the data.
_TRACE = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include "algorithms.h"
using namespace pycomm;
struct Span { const char* lo; const char* hi; bool has(const void* p, size_t n) const {
  auto c = static_cast<const char*>(p); return c >= lo && c + n <= hi; } };
struct FakeTransport : Transport {
  int r, n; Span data, scratch; long* bad; Handle h = 0;
  int rank() const override { return r; }
  int world_size() const override { return n; }
  std::string name() const override { return "fake"; }
  Handle post(const P2POp* ops, size_t k) override {
    for (size_t i = 0; i < k; ++i) {
      const Span& s = ops[i].kind == P2POp::kRecv && !data.has(ops[i].buf, ops[i].bytes) ? scratch : data;
      if (ops[i].bytes && !s.has(ops[i].buf, ops[i].bytes)) ++*bad;
    }
    return ++h;
  }
  void wait(Handle) override {}
};
struct Recorder : Reducer {
  size_t es; Span data, scratch; long calls = 0, unpacked = 0, bad = 0;
  void reduce(void* d, const void* a, const void* b, size_t c, DType, ReduceOp) override {
    ++calls;
    auto m = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16; };
    if (m(d) != m(a) || m(d) != m(b)) ++unpacked;
    if (!data.has(d, c * es) || !scratch.has(b, c * es)) ++bad;
  }
  void scale(void*, size_t, DType, double) override {}
  void copy(void*, const void*, size_t) override {}
};
int main() {
  char algo[16]; unsigned long count, slice; int n, r, dt;
  while (std::scanf("%15s %lu %d %d %d %lu", algo, &count, &n, &r, &dt, &slice) == 6) {
    const DType dtype = static_cast<DType>(dt);
    const size_t es = dtype_size(dtype), bytes = count * es + 64, sbytes = 2 * slice + 64;
    char* data = static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    char* scratch = static_cast<char*>(std::aligned_alloc(64, (sbytes + 63) / 64 * 64));
    long bad = 0;
    FakeTransport tr; tr.r = r; tr.n = n; tr.bad = &bad;
    tr.data = Span{data, data + count * es}; tr.scratch = Span{scratch, scratch + sbytes};
    Recorder red; red.es = es; red.data = tr.data; red.scratch = tr.scratch;
    Context ctx{tr, red, scratch, sbytes, slice};
    if (std::strcmp(algo, "allreduce") == 0) ring_all_reduce(ctx, data, count, dtype, ReduceOp::kSum);
    else ring_reduce_scatter(ctx, data, Chunks{count / n, 0}, dtype, ReduceOp::kSum);
    std::printf("%ld %ld %ld\n", red.calls, red.unpacked, red.bad + bad);
    std::free(data); std::free(scratch);
  }
}
"""
_CORE = ["algorithms.cc", "reduce.cc", "types.cc", "op_header.cc", "quant.cc"]
# DType codes of csrc/core/types.h: float32, float64, float16, int8
_DTYPE_CODES = (0, 1, 2, 7)


def test_every_ring_reduction_can_take_the_pack_path(tmp_path_factory):
    trace = _build(tmp_path_factory, "trace", _TRACE, _CORE)
    lines = []
    for algo in ("allreduce", "reducescatter"):
        for code in _DTYPE_CODES:
            for n in (2, 3, 4):
                for per_rank in (1, 3, 7, 17, 1029):
                    count = per_rank * n if algo == "reducescatter" else per_rank * n + n - 1
                    for slice_bytes in (64, 100, 4096):
                        for r in range(n):
                            lines.append(f"{algo} {count} {n} {r} {code} {slice_bytes}")
    out = subprocess.run([str(trace)], input="\n".join(lines) + "\n", text=True,
                         capture_output=True, check=True, timeout=300).stdout.splitlines()
    assert len(out) == len(lines)
    total = 0
    for line, row in zip(lines, out):
        calls, unpacked, bad = (int(v) for v in row.split())
        assert unpacked == 0 and bad == 0, (line, calls, unpacked, bad)
        total += calls
    assert total > 10 * len(lines)  # (a rank whose chunks are all empty reduces nothing)


# ---------------------------------------------------------------- the partition, seen from Python

# With 3 ranks the ring reduces chunk c as x_c + (x_{c+2} + x_{c+1}): its owner
# adds last. Let rank c hold 1 and the others half an ulp of 1 (`tiny`): in
# chunk c the tiny values first add up to a whole ulp, so the sum is 1 + ulp;
# in the other chunks 1 + tiny is a tie that rounds to even, 1, and stays 1.
# Hence the elements equal to 1 + ulp are exactly chunk c.
_TINY = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53, torch.float16: 2.0 ** -11,
         torch.bfloat16: 2.0 ** -8}


def _observed_chunks(comm, count: int, dtype: torch.dtype):
    tiny = _TINY[dtype]
    found = []
    for owner in range(comm.world_size):
        t = torch.full((count,), 1.0 if comm.rank == owner else tiny, dtype=dtype)
        comm.all_reduce(t, algo="ring")
        assert bool(((t == 1.0) | (t == 1.0 + 2 * tiny)).all()), (owner, t.unique().tolist())
        mine = (t == 1.0 + 2 * tiny).nonzero().flatten()
        begin = int(mine[0]) if mine.numel() else None
        found.append((begin, mine.numel()))
        if mine.numel():  # contiguous
            assert int(mine[-1]) == begin + mine.numel() - 1, (owner, mine.tolist())
    return found


@pytest.mark.parametrize("dtype", list(_TINY), ids=str)
def test_partition_seen_through_the_ring_order(transport, dtype):
    es = torch.empty(0, dtype=dtype).element_size()
    for count in (3, 17, 1029, 100_003):
        got = run_ranks(_observed_chunks, 3, transport, count, dtype)[0]
        want = [(begin if length else None, length) for begin, length in ring_chunks(count, 3, es)]
        assert got == want, (count, dtype)


# ---------------------------------------------------------------- collectives

def _cases():
    for dtype in DTYPES:
        for count in COUNTS:
            if count == COUNTS[-1] and dtype not in (torch.float32, torch.float16, torch.int8):
                continue  # the large size for three dtypes only: time
            ops = ["sum", "max"] + (["avg"] if dtype.is_floating_point else [])
            for op in ops if count < COUNTS[-1] else ["sum"]:
                yield count, dtype, op


def _odd_all_reduce(comm, algo: str):
    digests = []
    for count, dtype, op in _cases():
        inputs = [rank_input(r, count, dtype, op, seed=7) for r in range(comm.world_size)]
        t = inputs[comm.rank].clone()
        comm.all_reduce(t, op=op, algo=algo)
        assert_matches(t, reference(inputs, op), f"{algo} all_reduce {op} {dtype} count={count}")
        digests.append(digest(t))
    return digests


@pytest.mark.parametrize("world_size", [2, 3])
def test_odd_sizes_ring_all_reduce(transport, world_size):
    per_rank = run_ranks(_odd_all_reduce, world_size, transport, "ring")
    for r in range(1, world_size):
        assert per_rank[r] == per_rank[0], f"rank {r} differs from rank 0"


def test_odd_sizes_direct_all_reduce_three_ranks():
    # 3 ranks and 1000003 elements: the two-shot direct variant, whose chunks
    # are Chunks::aligned too.
    per_rank = run_ranks(_odd_all_reduce, 3, "shm", "direct")
    assert per_rank[1] == per_rank[0] == per_rank[2]


def _odd_wire_all_reduce(comm):
    from tests.test_hooks import wire_bound

    digests = []
    for wire in (torch.float16, torch.bfloat16):
        for count in COUNTS:
            inputs = [rank_input(r, count, torch.float32, "sum", seed=9)
                      for r in range(comm.world_size)]
            t = inputs[comm.rank].clone()
            comm.all_reduce(t, op="avg", algo="ring", wire_dtype=wire)
            exact = reference(inputs, "avg")
            err = (t.double() - exact).abs()
            assert bool((err <= wire_bound(inputs, wire, avg=True)).all()), (wire, count)
            digests.append(digest(t))
    return digests


@pytest.mark.parametrize("world_size", [2, 3])
def test_odd_sizes_wire_all_reduce(transport, world_size):
    per_rank = run_ranks(_odd_wire_all_reduce, world_size, transport)
    for r in range(1, world_size):
        assert per_rank[r] == per_rank[0], f"rank {r} differs from rank 0"


def _odd_scatter_gather(comm):
    n, r = comm.world_size, comm.rank
    for dtype in (torch.float32, torch.float16, torch.int8):
        for m in COUNTS[:-1]:  # per-rank chunk sizes
            inputs = [rank_input(q, m * n, dtype, "sum", seed=11) for q in range(n)]
            out = torch.empty(m, dtype=dtype)
            comm.reduce_scatter(out, inputs[r].clone())
            assert_matches(out, reference(inputs, "sum")[r * m:(r + 1) * m],
                           f"reduce_scatter {dtype} m={m}")
            gathered = torch.empty(m * n, dtype=dtype)
            comm.all_gather(gathered, inputs[r][:m].clone())
            assert torch.equal(gathered, torch.cat([x[:m] for x in inputs])), (dtype, m)


@pytest.mark.parametrize("world_size", [2, 3])
def test_odd_sizes_reduce_scatter_all_gather(transport, world_size):
    run_ranks(_odd_scatter_gather, world_size, transport)
