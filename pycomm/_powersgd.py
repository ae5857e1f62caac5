"""PowerSGD for pycomm.hooks: :class:`PowerSGDState` and :func:`powerSGD_hook`
(import them from :mod:`pycomm.hooks`).

Torch's PowerSGD (low-rank compression with error feedback and warm start)
with its all-reduces on a pycomm communicator, chained through futures so
that no thread blocks between them; on the same seeds and data it gives the
parameters of torch's ``powerSGD_hook`` up to float32 rounding.
"""

import logging
from collections import defaultdict
from typing import Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from ._hook_common import _allreduce_avg, _check_bucket, _comm_of, then_async
from ._hook_doc import _hook_doc
from .comm import Communicator

__all__ = ["PowerSGDState", "powerSGD_hook"]

# The public module's logger, where PowerSGD has always logged.
logger = logging.getLogger("pycomm.hooks")


def _orthonormalize(matrices: torch.Tensor, epsilon: float) -> None:
    """Orthonormalizes the columns of each matrix of a (batch, rows, cols)
    tensor in place: Gram-Schmidt for rank <= 2 or 16-bit dtypes, QR else
    (torch's choice, so that both give the same bits)."""
    rank = matrices.shape[2]
    if rank > 2 and matrices.dtype not in (torch.float16, torch.bfloat16):
        q = torch.linalg.qr(matrices).Q
        matrices.copy_(q)
        return
    for i in range(rank):
        col = matrices[:, :, i:i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        col /= norm + epsilon if epsilon else norm
        if i + 1 < rank:
            rest = matrices[:, :, i + 1:]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


class PowerSGDState:
    """Hyperparameters and per-bucket memory of :func:`powerSGD_hook`.

    The parameters mean what they mean in torch's ``PowerSGDState`` (see its
    documentation for tuning advice); ``comm`` replaces ``process_group``.

    Args:
        comm: the communicator the hook reduces on.
        matrix_approximation_rank: rank of the P Q^T approximation of each
            compressed gradient matrix (lower compresses more).
        start_powerSGD_iter: plain averaging (:func:`allreduce_hook`) before
            this iteration; must be > 1 with error feedback or warm start
            (DDP rebuilds its buckets after the first iteration).
        min_compression_rate: compress a matrix only where
            (rows + cols) * rank * rate < rows * cols.
        use_error_feedback: add the previous step's compression error to
            the gradient before compressing.
        warm_start: start each step's power iteration from the previous Q.
        orthogonalization_epsilon: added to column norms (avoids dividing by 0).
        random_seed: seeds the initial Qs (numpy RandomState, as torch does).
        batch_tensors_with_same_shape: compress same-shaped matrices as one
            batched matmul.

    Raises:
        TypeError: ``comm`` is not a Communicator.
        ValueError: ``start_powerSGD_iter <= 1`` with error feedback or warm
            start, or ``matrix_approximation_rank < 1``.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = pycomm.hooks.PowerSGDState(comm, matrix_approximation_rank=1,
        ...                                    start_powerSGD_iter=10)
        >>> ddp_model.register_comm_hook(state, pycomm.hooks.powerSGD_hook)
    """

    def __init__(
        self,
        comm: Communicator,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        if not isinstance(comm, Communicator):
            raise TypeError(f"PowerSGDState: comm must be a pycomm.Communicator, got "
                            f"{type(comm).__name__}")
        if matrix_approximation_rank < 1:
            raise ValueError(f"PowerSGDState: matrix_approximation_rank must be >= 1, got "
                             f"{matrix_approximation_rank}")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                "PowerSGDState: start_powerSGD_iter must be > 1 when use_error_feedback or "
                f"warm_start is on (got {start_powerSGD_iter}): DDP rebuilds its buckets after "
                "the first iteration, which would invalidate the memorised tensors")
        self.comm = comm
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Counts iterations: one per last bucket."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                logger.info("PowerSGD starts at iteration %d", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """(compression rate, elements before, elements after) so far."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after else 0.0
        return rate, self.total_numel_before_compression, after


class _LowRank:
    """One bucket's split for PowerSGD: matrices to compress (as batches of
    (1 or k, rows, cols) views), their P and Q views into the state's memory,
    and the tensors reduced as they are."""

    def __init__(self, state: PowerSGDState, bucket: dist.GradBucket,
                 buffer: torch.Tensor) -> None:
        rank = state.matrix_approximation_rank
        by_shape: dict[torch.Size, list[torch.Tensor]] = defaultdict(list)
        self.uncompressed: list[torch.Tensor] = []
        p_total = q_total = 0
        for grad in bucket.gradients():
            matrix = grad.view(grad.shape[0], -1)
            rows, cols = matrix.shape
            r = min(rows, cols, rank)
            state.total_numel_before_compression += rows * cols
            if (rows + cols) * r * state.min_compression_rate < rows * cols:
                by_shape[matrix.shape].append(matrix)
                p_total += rows * r
                q_total += cols * r
                state.total_numel_after_compression += (rows + cols) * r
            else:
                self.uncompressed.append(grad)
                state.total_numel_after_compression += rows * cols
        self.by_shape = by_shape
        index = bucket.index()
        self.fresh = not state.warm_start or index not in state.p_memory_dict
        if self.fresh:
            state.p_memory_dict[index] = torch.empty(p_total, device=buffer.device,
                                                     dtype=buffer.dtype)
            state.q_memory_dict[index] = torch.empty(q_total, device=buffer.device,
                                                     dtype=buffer.dtype)
        # Held from here on, never looked up again: without warm start an
        # earlier bucket's chain, ending on the worker thread while DDP calls
        # this bucket's hook, empties the dicts (KeyError, and the ranks'
        # op sequences part: test_powerSGD_many_buckets_same_on_every_rank
        # [cold-2] in a CI rehearsal).
        self.p_memory: torch.Tensor = state.p_memory_dict[index]
        self.q_memory: torch.Tensor = state.q_memory_dict[index]
        self.matrices: list[torch.Tensor] = list(self._batches(state))
        self.ps: list[torch.Tensor] = []
        self.qs: list[torch.Tensor] = []
        p_off = q_off = 0
        for m in self.matrices:
            k, rows, cols = m.shape
            r = min(rows, cols, rank)
            self.ps.append(self.p_memory[p_off:p_off + k * rows * r].view(k, rows, r))
            self.qs.append(self.q_memory[q_off:q_off + k * cols * r].view(k, cols, r))
            p_off += k * rows * r
            q_off += k * cols * r

    def _batches(self, state: PowerSGDState) -> Iterator[torch.Tensor]:
        for same in self.by_shape.values():
            if state.batch_tensors_with_same_shape and len(same) > 1:
                yield torch.stack(same)
            else:
                yield from (m.unsqueeze(0) for m in same)

    def write_back_batches(self) -> None:
        """Stacked batches are copies: write the decompressed matrices back."""
        for m in self.matrices:
            if m.shape[0] > 1:
                for i, original in enumerate(self.by_shape[m.shape[1:]]):
                    original.copy_(m[i])


def _add_error_feedback(state: PowerSGDState, index: int,
                        buffer: torch.Tensor) -> Optional[torch.Tensor]:
    """Step (2)'s error feedback: adds bucket ``index``'s compression error
    of the last step to ``buffer`` (a new bucket starts a zero error) and
    returns a copy of the sum, what the approximation is to be compared
    with; None without error feedback."""
    if not state.use_error_feedback:
        return None
    if index in state.error_dict:
        buffer.add_(state.error_dict[index])
    else:
        state.error_dict[index] = torch.zeros_like(buffer)
    return buffer.detach().clone()


def _compute_ps(state: PowerSGDState, lr: _LowRank, dtype: torch.dtype) -> None:
    """Step (3): each Q random normal (seeded from ``state.rng``) when the
    bucket's memory is fresh, else the previous Q; orthonormalized; P = M Q."""
    if lr.fresh:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q in lr.qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=dtype))
                _orthonormalize(q, state.orthogonalization_epsilon)
    else:
        for q in lr.qs:
            _orthonormalize(q, state.orthogonalization_epsilon)
    for m, q, p in zip(lr.matrices, lr.qs, lr.ps):
        torch.bmm(m, q, out=p)


@_hook_doc("DDP's gradient bucket; overwritten with the approximation.",
           "A future completing with the bucket once the last all-reduce is done.",
           state="a :class:`PowerSGDState` (holds the communicator).")
def powerSGD_hook(state: PowerSGDState,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD gradient compression (Vogels et al., 2019) over pycomm.

    Torch's ``powerSGD_hook`` algorithm, step for step, with pycomm
    all-reduces chained through futures (no thread blocks between them):

    1. Before ``state.start_powerSGD_iter``: :func:`allreduce_hook`.
    2. Add the previous compression error (error feedback); split the
       bucket's gradients into matrices worth compressing (see
       ``min_compression_rate``) and the rest (biases, small matrices).
    3. Q: random normal (seeded from ``state.rng``) on the first step or
       without warm start, else the previous Q; orthonormalize; P = M Q.
    4. All-reduce the uncompressed tensors (then divide by world_size), then
       all-reduce the Ps; orthonormalize each P; Q = M^T P; all-reduce the Qs
       and divide by world_size; M ~= P Q^T into the bucket; the error is
       what this lost of M.

    On the same seeds and data it produces the parameters of torch's
    ``powerSGD_hook`` on any process group, up to float32 rounding of the
    sums (tests: 1e-5).

    Example::
        >>> # xdoctest: +SKIP
        >>> state = pycomm.hooks.PowerSGDState(comm, matrix_approximation_rank=1,
        ...                                    start_powerSGD_iter=10)
        >>> ddp_model.register_comm_hook(state, pycomm.hooks.powerSGD_hook)
    """
    comm = _comm_of(state)
    buffer = bucket.buffer()
    _check_bucket(comm, bucket, buffer)
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return _allreduce_avg(comm, buffer)

    n = comm.world_size
    index = bucket.index()
    # (2) error feedback: compress gradient + last step's error.
    original = _add_error_feedback(state, index, buffer)
    lr = _LowRank(state, bucket, buffer)
    # The bucket's P and Q memory, held by lr (see there), not looked up in
    # the dicts: other buckets' chains end on the worker thread meanwhile.
    p_memory, q_memory = lr.p_memory, lr.q_memory
    uncompressed = (torch.cat([t.view(-1) for t in lr.uncompressed]) if lr.uncompressed
                    else buffer.new_empty(0))

    # (3) initial Q and P = M Q.
    _compute_ps(state, lr, buffer.dtype)

    # (4) the chained all-reduces.
    def unpack_then_reduce_ps(fut: torch.futures.Future) -> torch.futures.Future:
        summed = fut.value()[0].div_(n)
        offset = 0
        for t in lr.uncompressed:
            t.copy_(summed[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        return comm.all_reduce(p_memory, async_op=True).get_future()

    def compute_then_reduce_qs(fut: torch.futures.Future) -> torch.futures.Future:
        fut.value()
        for p in lr.ps:
            _orthonormalize(p, state.orthogonalization_epsilon)
        for m, p, q in zip(lr.matrices, lr.ps, lr.qs):
            torch.bmm(m.transpose(1, 2), p, out=q)
        return comm.all_reduce(q_memory, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()[0].div_(n)
        for p, q, m in zip(lr.ps, lr.qs, lr.matrices):
            torch.bmm(p, q.transpose(1, 2), out=m)
        if state.batch_tensors_with_same_shape:
            lr.write_back_batches()
        if original is not None:
            state.error_dict[index] = original - buffer
        if not state.warm_start:  # this bucket's memory only: others may be in flight
            state.p_memory_dict.pop(index, None)
            state.q_memory_dict.pop(index, None)
        state.maybe_increase_iter(bucket)
        return buffer

    first = comm.all_reduce(uncompressed, async_op=True).get_future()
    reduced_ps = then_async(first, unpack_then_reduce_ps, buffer.device)
    reduced_qs = then_async(reduced_ps, compute_then_reduce_qs, buffer.device)
    return reduced_qs.then(decompress)
