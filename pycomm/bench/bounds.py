"""The study's bound: a STREAM-like copy of each size, timed in the same
rounds as the algos (issue 40).

Two series sit beside the algos in every size's rounds:

- ``copy-core``: rank 0 copies while the other ranks wait (what one core
  moves with the memory system to itself);
- ``copy-ranks``: every rank copies at once (what each core moves while the
  ranks share the memory system, as they do in a collective).

The copy reads ``size`` bytes and writes ``size`` bytes (its traffic, 2 x
size, counts both, as STREAM counts its Copy) in a buffer of the size (plus
a cache line) allocated once per size and written before timing, so its
pages are mapped and its lines warm. On a CPU it is libc's memmove
(``ctypes.memmove``: glibc's AVX/ERMS loop) of the buffer onto itself one
cache line lower: each line is read and written back in turn, as an
in-place all-reduce touches its tensor, and the footprint is the tensor's.
A copy from one buffer to another is no bound for that: its stores go to
lines it has not read (non-temporal past glibc's threshold), so it moves
fewer bytes per second than the in-place pass, and an all-reduce in
symmetric memory beats it (the README's "The bound" has the figures). On a
GPU: one half of the buffer copied onto the other and back (``copy_``;
CUDA copies must not overlap).

How a series reads against them: a bound row's time is the copy's, its
algbw and busbw are those the collective would have if it took that time.
An in-place all-reduce in shared memory must read every rank's input once
and write every rank's result once: at least 2 x size of traffic per rank
when the work is spread over the ranks, which is one ``copy-ranks`` copy.
So ``copy-ranks``' busbw bounds every all-reduce series; an algorithm that
moves k times that traffic (staging through a shared buffer) is bounded by
``copy-ranks`` / k. ``copy-core`` is one core's ceiling, the bound of a
series whose work one rank does alone.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["BOUNDS", "COPY_CORE", "COPY_RANKS", "Copy", "traffic_gbps"]

COPY_CORE = "copy-core"
COPY_RANKS = "copy-ranks"
#: The bound series, in table order.
BOUNDS = (COPY_CORE, COPY_RANKS)

_LINE = 64  # bytes: the CPU copy's shift


class Copy:
    """``nbytes`` read and ``nbytes`` written per call (see the module
    doc), in a buffer of its own on ``device``; ``active=False``: calls do
    nothing (the ranks that wait in ``copy-core``)."""

    def __init__(self, device: torch.device, nbytes: int, active: bool = True) -> None:
        self.nbytes = nbytes if active else 0
        self._buf = torch.ones(self.nbytes + _LINE, dtype=torch.uint8, device=device)
        half = self.nbytes // 2
        self._halves = (self._buf[:half], self._buf[half:2 * half])
        self._on_gpu = device.type == "cuda"
        self._ptr = self._buf.data_ptr()  # kept alive by self._buf
        self()  # fault in and warm the buffer

    def __call__(self) -> None:
        if self._on_gpu:
            a, b = self._halves
            b.copy_(a)
            a.copy_(b)
        elif self.nbytes:
            ctypes.memmove(self._ptr, self._ptr + _LINE, self.nbytes)


def traffic_gbps(nbytes: int, seconds: float) -> float:
    """A copy's memory traffic in GB/s: bytes read + bytes written."""
    return 2 * nbytes / seconds / 1e9 if seconds > 0 else 0.0
