"""What DistributedDataParallel measured: buckets, bytes, overlap.

Timing model (per iteration, host clock). Backward starts when the first
gradient of the iteration is ready and ends when autograd has produced all of
them (DDP's end-of-backward callback). Bucket i's all-reduce is launched at
``launch[i]`` and completes at ``done[i]``; the communicator runs async ops in
submission order, so op i is busy during ``[max(launch[i], done[i-1]),
done[i]]``. Communication time is the total busy time; the hidden part is the
busy time before backward ended, the exposed part is what DDP waited for after
it::

    backward  |=========================|
    bucket 0      [====]
    bucket 1              [======]
    bucket 2                      [=========]
                                        ^ backward ends: 2 of bucket 2's
                                          ms are exposed, the rest hidden
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["BucketStats", "IterationStats", "DDPStats", "comm_overlap"]


def comm_overlap(launches: Sequence[float], dones: Sequence[float],
                 backward_end: float) -> tuple[float, float]:
    """Busy and hidden communication time of ops run in submission order.

    Args:
        launches: when each op was submitted (seconds, any common clock).
        dones: when each op completed, same order.
        backward_end: when backward ended.

    Returns:
        ``(comm_s, hidden_s)``: total busy time, and the part of it before
        ``backward_end``.

    Example::
        >>> comm_overlap([0.0, 1.0], [2.0, 3.0], backward_end=2.5)
        (3.0, 2.5)
    """
    if len(launches) != len(dones):
        raise ValueError(f"{len(launches)} launches but {len(dones)} completions")
    comm = hidden = 0.0
    prev_done = float("-inf")
    for launch, done in zip(launches, dones):
        start = max(launch, prev_done)
        end = max(done, start)
        comm += end - start
        hidden += max(0.0, min(end, backward_end) - start)
        prev_done = end
    return comm, hidden


@dataclass
class BucketStats:
    """One bucket: its parameters (names, in buffer order) and size."""

    index: int
    params: list[str]
    numel: int
    nbytes: int
    dtype: str
    device: str


@dataclass
class IterationStats:
    """One synchronised backward pass.

    Attributes:
        iteration: count of synchronised backward passes, from 1.
        backward_s: first gradient ready -> last gradient ready.
        comm_s: time the communicator was busy with this iteration's ops.
        hidden_s: the part of ``comm_s`` before backward ended.
        wait_s: how long the end of backward waited for communication (and
            the write-back of buckets reduced meanwhile).
        bytes_reduced: gradient bytes all-reduced (bucket buffers).
        buckets: number of buckets communicated.
    """

    iteration: int
    backward_s: float
    comm_s: float
    hidden_s: float
    wait_s: float
    bytes_reduced: int
    buckets: int

    @property
    def hidden_fraction(self) -> float:
        """Share of communication time that overlapped backward (0..1)."""
        return self.hidden_s / self.comm_s if self.comm_s > 0 else 0.0


@dataclass
class DDPStats:
    """A snapshot of ``DistributedDataParallel.stats()``; ``str()`` prints tables.

    Attributes:
        buckets: the current buckets, in communication order.
        iterations: per synchronised iteration, oldest first (the most recent
            ``history`` ones).
        rebuilt_after: the iteration after which buckets were rebuilt in
            gradient-ready order (None: not yet).
        world_size: ranks the gradients were averaged over.
    """

    buckets: list[BucketStats]
    iterations: list[IterationStats] = field(default_factory=list)
    rebuilt_after: int | None = None
    world_size: int = 1

    @property
    def bytes_reduced(self) -> int:
        """Gradient bytes all-reduced over the recorded iterations."""
        return sum(it.bytes_reduced for it in self.iterations)

    @property
    def comm_s(self) -> float:
        """Communication time over the recorded iterations."""
        return sum(it.comm_s for it in self.iterations)

    def hidden_fraction(self, skip_first: bool = True) -> float:
        """Share of communication hidden behind backward, over the recorded
        iterations (without the first, which runs before the rebuild, unless
        it is the only one)."""
        its = self.iterations[1:] if skip_first and len(self.iterations) > 1 else self.iterations
        comm = sum(it.comm_s for it in its)
        return sum(it.hidden_s for it in its) / comm if comm > 0 else 0.0

    def table(self, last: int = 10) -> str:
        """The buckets and the ``last`` iterations as two small text tables."""
        total = sum(b.nbytes for b in self.buckets)
        rebuilt = ("not yet rebuilt" if self.rebuilt_after is None
                   else f"rebuilt in ready order after iteration {self.rebuilt_after}")
        lines = [f"pycomm DDP: {len(self.buckets)} buckets, {total / 2**20:.2f} MiB, "
                 f"{self.world_size} ranks, {rebuilt}",
                 f"{'bucket':>6} {'params':>6} {'elements':>10} {'MiB':>8} {'dtype':>9}  names"]
        for b in self.buckets:
            names = ", ".join(b.params)
            if len(names) > 48:
                names = f"{b.params[0]} ... {b.params[-1]}"
            lines.append(f"{b.index:>6} {len(b.params):>6} {b.numel:>10} "
                         f"{b.nbytes / 2**20:>8.3f} {b.dtype:>9}  {names}")
        lines.append(f"{'iter':>6} {'backward ms':>11} {'comm ms':>8} {'hidden':>7} "
                     f"{'wait ms':>8} {'MiB':>8}")
        for it in self.iterations[-last:]:
            lines.append(f"{it.iteration:>6} {it.backward_s * 1e3:>11.2f} {it.comm_s * 1e3:>8.2f} "
                         f"{it.hidden_fraction:>6.0%} {it.wait_s * 1e3:>8.2f} "
                         f"{it.bytes_reduced / 2**20:>8.2f}")
        if self.iterations:
            lines.append(f"{len(self.iterations)} iterations, "
                         f"{self.bytes_reduced / 2**20:.1f} MiB reduced, "
                         f"{self.comm_s * 1e3:.1f} ms communication; hidden behind backward: "
                         f"{self.hidden_fraction():.0%} (first iteration excluded)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
