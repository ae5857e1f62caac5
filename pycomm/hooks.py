"""DDP communication hooks that move gradient traffic onto pycomm.

``torch.nn.parallel.DistributedDataParallel`` calls a communication hook once
per gradient bucket; the hook returns a ``torch.futures.Future[torch.Tensor]``
that completes with the reduced bucket. Registering one of these hooks sends
every gradient byte through a pycomm :class:`~pycomm.Communicator` instead of
the process group DDP was built on (which then only broadcasts the initial
parameters)::

    comm = pycomm.init(group=dist.group.WORLD)           # shm on one host
    ddp.register_comm_hook(comm, pycomm.hooks.allreduce_hook)

Contract (torch's): ``hook(state, bucket) -> Future[Tensor]``, where ``state``
is a pycomm ``Communicator`` or an object with a ``.comm`` attribute holding
one (:class:`PowerSGDState`). The hooks issue asynchronous pycomm ops and
return at once: on CPU the futures complete, and their ``then()`` callbacks
run, on the communicator's worker thread, so the autograd thread keeps
computing gradients while buckets are reduced. Ops that callbacks issue (the
chained all-reduces of PowerSGD) run right after the op that triggered them on
every rank, so all ranks run the same sequence of collectives. On GPU the
futures are CUDA-aware, as ProcessGroupNCCL's: completed as soon as the op is
enqueued, with their ``then()`` callbacks (and DDP's reading of the result)
ordered on CUDA streams after the reduction, so the host never waits for it.

Numerics:

* :func:`allreduce_hook` averages in the bucket's dtype (SUM, then the scale by
  1/world_size fused into the last reduction step): DDP without a hook up to
  float32 rounding.
* :func:`fp16_compress_hook` / :func:`bf16_compress_hook` cast the bucket to
  16 bits, divide by world_size *before* reducing (fp16 does not overflow),
  reduce in 16 bits (each ring step accumulates in float32 and rounds back),
  and cast back into the bucket in place.
* :func:`ring_fp16_hook` / :func:`ring_bf16_hook` keep the bucket float32;
  only the wire carries 16 bits (``Communicator.all_reduce(wire_dtype=...)``),
  and every ring step accumulates in float32. Same bytes on the wire as the
  cast-everything hooks, a smaller error: one rounding per ring step of the
  partial sum instead of rounding every input and every partial sum.
* :func:`int8_hook` / :func:`fp8_hook` keep the bucket float32 and send 8
  bits an element plus one float32 scale a block (block-scaled int8 or
  float8 codes, ``all_reduce(wire_dtype=...)``), with error feedback: int8
  steps evenly through each block's range, float8 keeps a relative precision
  (3 or 2 significand bits) for the small values of a block.
* :func:`powerSGD_hook` follows torch's PowerSGD (low-rank compression with
  error feedback and warm start); on the same seeds and data it gives the
  parameters of torch's ``powerSGD_hook`` up to float32 rounding.
"""

import logging
from collections import defaultdict
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from ._grad_bucket import GradBucket as PycommGradBucket
from ._hook_doc import _FLOAT32_BUCKET, _WRAPPER_DOC, _hook_doc, _with_doc
from .comm import Communicator, ReduceOp

__all__ = [
    "CompressionState",
    "PowerSGDState",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "fp8_hook",
    "int8_hook",
    "powerSGD_hook",
    "ring_bf16_hook",
    "ring_fp16_hook",
]

logger = logging.getLogger(__name__)

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


# ---------------------------------------------------------------- helpers

def _comm_of(state: Any) -> Communicator:
    """The communicator of a hook state: the state itself, or ``state.comm``."""
    comm = state if isinstance(state, Communicator) else getattr(state, "comm", None)
    if not isinstance(comm, Communicator):
        raise TypeError(
            "pycomm hook: state must be a pycomm.Communicator or an object with a .comm "
            f"Communicator (e.g. PowerSGDState), got {type(state).__name__}; register with "
            "ddp.register_comm_hook(comm, hook)"
        )
    return comm


def _check_bucket(comm: Communicator, bucket: dist.GradBucket, tensor: torch.Tensor) -> None:
    """Raises on the first bucket whose device is not the communicator's."""
    if tensor.device != comm.device:
        raise ValueError(
            f"pycomm hook: gradient bucket {bucket.index()} is on {tensor.device} but the "
            f"communicator runs on {comm.device}; create the communicator on the model's device "
            f"(pycomm.init(device={str(tensor.device)!r}, ...)) or move the model to {comm.device}"
        )


def _is_ddp_buffer(bucket: dist.GradBucket, buffer: torch.Tensor) -> bool:
    """True when ``buffer`` looks like DDP's own bucket, which it keeps and
    refills every step (worth moving into symmetric memory), not a copy that
    a wrapper made for this call (fp16_compress_wrapper: another dtype). Only
    a request: the bucket moves if every rank registers it
    (all_reduce(register=)). Under ``join()`` a rank that ran out of data
    registers the zero buckets DDP makes for it; while the others' buckets are
    in symmetric memory already (they do not register), those all-reduces
    just stage."""
    if not isinstance(bucket, (dist.GradBucket, PycommGradBucket)):
        return False  # a bucket some other code made up
    params = bucket.parameters()
    return bool(params) and params[0].dtype == buffer.dtype


def _first(fut: torch.futures.Future) -> torch.Tensor:
    """A pycomm Work future holds the list of output tensors: take the first."""
    return fut.value()[0]


def _allreduce_avg(comm: Communicator, tensor: torch.Tensor,
                   wire_dtype: Optional[torch.dtype] = None,
                   register: bool = False) -> torch.futures.Future[torch.Tensor]:
    """Averages ``tensor`` in place; the future completes with it.
    ``register``: register it, i.e. move it into symmetric memory (all_reduce)."""
    work = comm.all_reduce(tensor, op=ReduceOp.AVG, async_op=True, wire_dtype=wire_dtype,
                           register=register)
    return work.get_future().then(_first)


def _then_async(fut: torch.futures.Future,
                fn: Callable[[torch.futures.Future], torch.futures.Future],
                device: torch.device) -> torch.futures.Future:
    """``fut.then(fn)`` for an ``fn`` that issues an asynchronous op and
    returns its future: the result completes with that future's value, without
    any thread waiting for it. An exception in ``fut`` or ``fn`` fails it.

    On CUDA the result is a CUDA-aware future on ``device``: it is completed
    in the inner future's callback, whose current stream waits for the op, so
    it records that ordering and its own callbacks' streams wait for it. A
    plain future would hand its callbacks the value with no ordering at all:
    they would read the tensors while the all-reduce still writes them (the
    GPU check caught PowerSGD differing from torch's by 0.1)."""
    out: torch.futures.Future = torch.futures.Future(
        devices=[device] if device.type == "cuda" else None)

    def forward(inner: torch.futures.Future) -> None:
        try:
            out.set_result(inner.value())
        except Exception as e:  # noqa: BLE001 - handed to the waiting caller
            out.set_exception(e)

    def start(done: torch.futures.Future) -> None:
        try:
            inner = fn(done)
        except Exception as e:  # noqa: BLE001
            out.set_exception(e)
            return
        inner.add_done_callback(forward)

    fut.add_done_callback(start)
    return out


# ---------------------------------------------------------------- allreduce

@_hook_doc("DDP's gradient bucket; reduced in place.",
           "A future that completes with the averaged bucket once the all-reduce\n"
           "        is done (on CPU, on the communicator's worker thread).")
def allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks with a pycomm all-reduce.

    The same gradients as DDP without a hook (up to float32 rounding: pycomm
    sums, then scales by 1/world_size in the last reduction step, where DDP
    divides first), but the traffic runs on pycomm's transport (``shm``
    between processes of one host, ``gloo``, or ``nccl``). Works whatever
    process group DDP itself was built on.

    On the ``shm`` transport the first all-reduce of each of DDP's buckets
    moves the bucket into symmetric memory
    (``Communicator.all_reduce(register=True)``: when every rank registers, as
    every rank's DDP does). From then on each rank reduces its share of the
    bucket straight from every rank's copy and writes the result into every
    copy, with nothing staged: the same bits, half the memory traffic on 2
    ranks.

    Example::
        >>> # xdoctest: +SKIP
        >>> comm = pycomm.init(group=dist.group.WORLD)
        >>> ddp_model.register_comm_hook(comm, pycomm.hooks.allreduce_hook)
    """
    comm = _comm_of(state)
    buffer = bucket.buffer()
    _check_bucket(comm, bucket, buffer)
    # Register the bucket until it has moved (bucket.parameters() builds a list).
    register = not comm.is_registered(buffer) and _is_ddp_buffer(bucket, buffer)
    return _allreduce_avg(comm, buffer, register=register)


# ---------------------------------------------------------------- cast compression

def _compress_hook(dtype: torch.dtype, state: Any,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    comm = _comm_of(state)
    buffer = bucket.buffer()
    _check_bucket(comm, bucket, buffer)
    # Divide before reducing: a sum of fp16 gradients can overflow.
    compressed = buffer.to(dtype).div_(comm.world_size)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])  # in place: no second full-size buffer
        return buffer

    return comm.all_reduce(compressed, op=ReduceOp.SUM, async_op=True).get_future().then(
        decompress)


@_hook_doc(_FLOAT32_BUCKET, "A future completing with the bucket (its original dtype).")
def fp16_compress_hook(state: Any,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Cast the bucket to ``torch.float16``, divide by world_size, all-reduce,
    cast back into the bucket in place.

    Half the bytes of :func:`allreduce_hook`. Every input is rounded to fp16
    and so is every partial sum (each reduction step computes in float32 and
    rounds back): relative error about ``world_size * 2**-11`` per element,
    and values below fp16's range (|g| / world_size < 6e-8) flush to zero.
    :func:`ring_fp16_hook` sends the same bytes with a smaller error.

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(comm, pycomm.hooks.fp16_compress_hook)
    """
    return _compress_hook(torch.float16, state, bucket)


@_hook_doc(_FLOAT32_BUCKET, "A future completing with the bucket (its original dtype).")
def bf16_compress_hook(state: Any,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Cast the bucket to ``torch.bfloat16``, divide by world_size, all-reduce,
    cast back into the bucket in place.

    Like :func:`fp16_compress_hook` with bfloat16's range (no overflow or
    underflow worth mentioning) and its 8-bit significand: relative error about
    ``world_size * 2**-8`` per element. Unlike torch's, it needs no NCCL: it
    runs on every pycomm transport.

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(comm, pycomm.hooks.bf16_compress_hook)
    """
    return _compress_hook(torch.bfloat16, state, bucket)


# DDP refuses hooks *named* bf16_compress_hook / bf16_compress_wrapper_hook
# unless NCCL >= 2.10 is present (a check meant for torch's own, NCCL-bound
# hooks). pycomm's run on any transport, so they carry another name.
bf16_compress_hook.__name__ = "pycomm_bf16_compress_hook"


def _compress_wrapper(dtype: torch.dtype, hook: Hook) -> Hook:
    def compressed_hook(state: Any,
                        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        bucket.set_buffer(buffer.to(dtype))
        fut = hook(state, bucket)

        def decompress(done: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(done.value())  # back into the original bucket, in place
            return buffer

        return fut.then(decompress)

    # Not "bf16_compress_wrapper_hook": DDP would demand NCCL (see above).
    inner = getattr(hook, "__name__", type(hook).__name__)
    compressed_hook.__name__ = f"pycomm_{str(dtype).split('.')[-1]}_wrapped_{inner}"
    compressed_hook.__qualname__ = compressed_hook.__name__
    return compressed_hook


@_with_doc(_WRAPPER_DOC)
def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a ``torch.float16`` copy of the bucket and cast its
    result back into the bucket.

    ``fp16_compress_wrapper(allreduce_hook)`` reduces like
    :func:`fp16_compress_hook` (it averages after the sum instead of dividing
    first). Useful around :func:`powerSGD_hook` to halve its traffic.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = pycomm.hooks.PowerSGDState(comm, start_powerSGD_iter=10)
        >>> ddp_model.register_comm_hook(state, fp16_compress_wrapper(powerSGD_hook))
    """
    return _compress_wrapper(torch.float16, hook)


@_with_doc(_WRAPPER_DOC)
def bf16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a ``torch.bfloat16`` copy of the bucket and cast its
    result back into the bucket (see :func:`fp16_compress_wrapper`).

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(comm, bf16_compress_wrapper(allreduce_hook))
    """
    return _compress_wrapper(torch.bfloat16, hook)


# ---------------------------------------------------------------- wire-dtype ring

def _ring_hook(wire: torch.dtype, state: Any,
               bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    comm = _comm_of(state)
    buffer = bucket.buffer()
    _check_bucket(comm, bucket, buffer)
    if buffer.dtype != torch.float32:
        raise TypeError(f"pycomm ring_{str(wire).split('.')[-1]}_hook: gradient bucket "
                        f"{bucket.index()} is {buffer.dtype}; the wire-dtype ring needs float32 "
                        "gradients (use fp16_compress_hook / bf16_compress_hook instead)")
    return _allreduce_avg(comm, buffer, wire_dtype=wire)


@_hook_doc(_FLOAT32_BUCKET, "A future completing with the averaged bucket.", needs_float32=True)
def ring_fp16_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a float32 bucket with a ring all-reduce whose traffic is fp16.

    The bucket stays float32. Each reduce-scatter step sends its partial sum
    rounded to fp16 and the receiver adds it in float32; the owner of each
    chunk scales by 1/world_size, rounds once more and sends that in the
    all-gather, so every rank ends with the same bits. Per element that is
    ``world_size - 1`` roundings of partial sums plus one of the result
    (relative error about ``world_size * 2**-11`` of the sum's magnitude) with
    no rounding of the inputs themselves, against a rounding of every input and
    partial sum in :func:`fp16_compress_hook`, for the same bytes. Partial
    sums beyond fp16's range (65504) become inf: scale the loss if gradients
    can be that large.

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(comm, pycomm.hooks.ring_fp16_hook)
    """
    return _ring_hook(torch.float16, state, bucket)


@_hook_doc(_FLOAT32_BUCKET, "A future completing with the averaged bucket.", needs_float32=True)
def ring_bf16_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a float32 bucket with a ring all-reduce whose traffic is bfloat16.

    :func:`ring_fp16_hook` with bfloat16 on the wire: float32's range, an
    8-bit significand (relative error about ``world_size * 2**-8`` of the
    sum's magnitude).

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(comm, pycomm.hooks.ring_bf16_hook)
    """
    return _ring_hook(torch.bfloat16, state, bucket)


# ---------------------------------------------------------------- 8-bit

class CompressionState:
    """Settings and per-bucket memory of :func:`int8_hook` and :func:`fp8_hook`.

    Args:
        comm: the communicator (what the other hooks take as their state).
        wire_block: elements per float32 scale on the wire (256: 1.6 % more
            bytes than the int8 codes).
        error_feedback: keep each bucket's quantization error (float32, one
            residual per bucket) and send it with the next step's gradients,
            so that no rounding is lost for good.
        exact_below: parameters with fewer elements than this, and every 1-D
            parameter (biases, norms), are averaged exactly in float32: few
            bytes, and the ones rounding hurts most.
        fp8_format: :func:`fp8_hook`'s codes, ``torch.float8_e4m3fn`` (3
            significand bits, range 448 per scale) or ``torch.float8_e5m2``
            (2 bits, range 57344: for blocks whose values span more octaves).
    """

    def __init__(self, comm: Communicator, wire_block: int = 256, error_feedback: bool = True,
                 exact_below: int = 1024, fp8_format: torch.dtype = torch.float8_e4m3fn) -> None:
        if fp8_format not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError("CompressionState: fp8_format must be torch.float8_e4m3fn or "
                             f"torch.float8_e5m2, got {fp8_format!r}")
        self.comm = comm
        self.fp8_format = fp8_format
        self.wire_block = wire_block
        self.error_feedback = error_feedback
        self.exact_below = exact_below
        self.residuals: dict[int, torch.Tensor] = {}

    def residual(self, bucket: Any, buffer: torch.Tensor) -> Optional[torch.Tensor]:
        """The bucket's residual (zeros for a new bucket, or one rebuilt with
        another size); None without error feedback."""
        if not self.error_feedback:
            return None
        r = self.residuals.get(bucket.index())
        if r is None or r.numel() != buffer.numel():
            r = self.residuals[bucket.index()] = torch.zeros_like(buffer)
        return r

    def exact_slices(self, bucket: Any) -> list[tuple[int, int]]:
        """(offset, numel) in the bucket of the parameters averaged exactly
        (the bucket holds its parameters' gradients back to back, in order)."""
        out, offset = [], 0
        for p in bucket.parameters():
            if p.dim() <= 1 or p.numel() < self.exact_below:
                out.append((offset, p.numel()))
            offset += p.numel()
        return out


def _quantized_hook(wire: torch.dtype, name: str, state: CompressionState,
                    bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """int8_hook and fp8_hook: the bucket averaged over the quantized ``wire``
    with the state's error feedback, its exact slices averaged again in
    float32 afterwards."""
    comm = _comm_of(state)
    buffer = bucket.buffer()
    _check_bucket(comm, bucket, buffer)
    if buffer.dtype != torch.float32:
        raise TypeError(f"pycomm {name}: gradient bucket {bucket.index()} is {buffer.dtype}; "
                        f"the {str(wire).removeprefix('torch.')} wire needs float32 gradients")
    exact = state.exact_slices(bucket)
    small = torch.cat([buffer[o:o + n] for o, n in exact]) if exact else None  # before the op
    work = comm.all_reduce(buffer, op=ReduceOp.AVG, async_op=True, wire_dtype=wire,
                           wire_block=state.wire_block, residual=state.residual(bucket, buffer))
    if small is None:
        return work.get_future().then(_first)
    # Issued after the quantized op, so it completes after it (one worker, in order).
    exact_work = comm.all_reduce(small, op=ReduceOp.AVG, async_op=True)

    def write_back(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()
        pos = 0
        for o, n in exact:
            buffer[o:o + n].copy_(small[pos:pos + n])
            pos += n
        return buffer

    return exact_work.get_future().then(write_back)


@_hook_doc(_FLOAT32_BUCKET, "A future completing with the averaged bucket.",
           state="a :class:`CompressionState`.", needs_float32=True)
def int8_hook(state: CompressionState,
              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a float32 bucket over an 8-bit wire, with error feedback.

    ``all_reduce(wire_dtype=torch.int8)``: each rank's gradients (plus the
    bucket's residual) are quantized once, 8 bits and one float32 scale per
    ``state.wire_block`` elements, summed in float32 by their chunk's owner
    and the average quantized once more: about a quarter of the float32
    bytes, every rank the same bits. The residual keeps what the quantization
    lost. Small and 1-D parameters (``state.exact_below``) are averaged again
    exactly afterwards, in one float32 all-reduce.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = pycomm.hooks.CompressionState(comm)
        >>> ddp_model.register_comm_hook(state, pycomm.hooks.int8_hook)
    """
    return _quantized_hook(torch.int8, "int8_hook", state, bucket)


@_hook_doc(_FLOAT32_BUCKET, "A future completing with the averaged bucket.",
           state="a :class:`CompressionState`.", needs_float32=True)
def fp8_hook(state: CompressionState,
             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a float32 bucket over a float8 wire, with error feedback.

    :func:`int8_hook` with float8 codes, ``all_reduce(wire_dtype=
    state.fp8_format)``: each block's values are scaled so that its largest
    magnitude is the format's largest (448 for e4m3, 57344 for e5m2) and
    rounded to float8, so small values keep a relative precision (about
    ``2**-4`` for e4m3, ``2**-3`` for e5m2) where int8 steps evenly by
    ``absmax / 127``. Same bytes as int8, same error feedback, the same bits
    on every rank.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = pycomm.hooks.CompressionState(comm, fp8_format=torch.float8_e4m3fn)
        >>> ddp_model.register_comm_hook(state, pycomm.hooks.fp8_hook)
    """
    return _quantized_hook(state.fp8_format, "fp8_hook", state, bucket)


# ---------------------------------------------------------------- PowerSGD

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
    original: Optional[torch.Tensor] = None
    if state.use_error_feedback:
        if index in state.error_dict:
            buffer.add_(state.error_dict[index])
        else:
            state.error_dict[index] = torch.zeros_like(buffer)
        original = buffer.detach().clone()
    lr = _LowRank(state, bucket, buffer)
    # The bucket's P and Q memory, held by lr (see there), not looked up in
    # the dicts: other buckets' chains end on the worker thread meanwhile.
    p_memory, q_memory = lr.p_memory, lr.q_memory
    uncompressed = (torch.cat([t.view(-1) for t in lr.uncompressed]) if lr.uncompressed
                    else buffer.new_empty(0))

    # (3) initial Q and P = M Q.
    if lr.fresh:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q in lr.qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=buffer.dtype))
                _orthonormalize(q, state.orthogonalization_epsilon)
    else:
        for q in lr.qs:
            _orthonormalize(q, state.orthogonalization_epsilon)
    for m, q, p in zip(lr.matrices, lr.qs, lr.ps):
        torch.bmm(m, q, out=p)

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
    reduced_ps = _then_async(first, unpack_then_reduce_ps, buffer.device)
    reduced_qs = _then_async(reduced_ps, compute_then_reduce_qs, buffer.device)
    return reduced_qs.then(decompress)
