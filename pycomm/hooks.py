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
* :func:`int8_hook` / :func:`fp8_hook` keep the bucket in its dtype
  (float32, bfloat16 or float16), sum in float32, and send 8 bits an
  element plus one float32 scale a block (block-scaled int8 or
  float8 codes, ``all_reduce(wire_dtype=...)``), with error feedback: int8
  steps evenly through each block's range, float8 keeps a relative precision
  (3 or 2 significand bits) for the small values of a block.
* :func:`powerSGD_hook` follows torch's PowerSGD (low-rank compression with
  error feedback and warm start); on the same seeds and data it gives the
  parameters of torch's ``powerSGD_hook`` up to float32 rounding.
"""

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ._grad_bucket import GradBucket as PycommGradBucket
from ._hook_common import _allreduce_avg, _check_bucket, _comm_of, _first
from ._hook_doc import _FLOAT32_BUCKET, _FLOAT_BUCKET, _WRAPPER_DOC, _hook_doc, _with_doc
from ._powersgd import PowerSGDState, powerSGD_hook  # its own module; users find it here
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

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


# ---------------------------------------------------------------- helpers

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


@_hook_doc(_FLOAT32_BUCKET, "A future completing with the averaged bucket.", needs="float32")
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


@_hook_doc(_FLOAT32_BUCKET, "A future completing with the averaged bucket.", needs="float32")
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

# The gradient dtypes an 8-bit hook takes (each summed in float32).
_QUANTIZED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_QUANTIZED_NEEDS = "float32, bfloat16 or float16"

class CompressionState:
    """Settings and per-bucket memory of :func:`int8_hook` and :func:`fp8_hook`.

    Args:
        comm: the communicator (what the other hooks take as their state).
        wire_block: elements per float32 scale on the wire (256: 1.6 % more
            bytes than the int8 codes).
        error_feedback: keep each bucket's quantization error (float32, one
            residual per bucket, whatever the bucket's dtype) and send it
            with the next step's gradients, so that no rounding is lost for
            good.
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
        # bucket index -> its parameters, as (data_ptr, numel), when its residual began
        self._layouts: dict[int, tuple[tuple[int, int], ...]] = {}

    def residual(self, bucket: Any, buffer: torch.Tensor) -> Optional[torch.Tensor]:
        """The bucket's residual: zeros for a new bucket, and for one that DDP
        rebuilt with other parameters or another order (even of the same
        size: a residual belongs to positions of parameters); None without
        error feedback."""
        if not self.error_feedback:
            return None
        layout = tuple((p.data_ptr(), p.numel()) for p in bucket.parameters())
        r = self.residuals.get(bucket.index())
        if r is None or r.numel() != buffer.numel() or self._layouts.get(bucket.index()) != layout:
            r = self.residuals[bucket.index()] = torch.zeros_like(buffer, dtype=torch.float32)
            self._layouts[bucket.index()] = layout
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
    if buffer.dtype not in _QUANTIZED_DTYPES:
        raise TypeError(f"pycomm {name}: gradient bucket {bucket.index()} is {buffer.dtype}; "
                        f"the {str(wire).removeprefix('torch.')} wire needs {_QUANTIZED_NEEDS} "
                        "gradients")
    exact = state.exact_slices(bucket)
    # Taken before the op, averaged in float32 whatever the bucket's dtype.
    small = torch.cat([buffer[o:o + n] for o, n in exact]).float() if exact else None
    for o, n in exact:
        # Zeros on the quantized wire, overwritten by the exact average: they
        # neither widen the scale of a block they share with a weight nor
        # leave error in the residual.
        buffer[o:o + n].zero_()
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


@_hook_doc(_FLOAT_BUCKET, "A future completing with the averaged bucket.",
           state="a :class:`CompressionState`.", needs=_QUANTIZED_NEEDS)
def int8_hook(state: CompressionState,
              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket over an 8-bit wire, with error feedback.

    ``all_reduce(wire_dtype=torch.int8)``: each rank's gradients (plus the
    bucket's residual) are quantized once, 8 bits and one float32 scale per
    ``state.wire_block`` elements, summed in float32 by their chunk's owner
    and the average quantized once more: about a quarter of the float32
    bytes, every rank the same bits. The residual keeps what the quantization
    lost. Small and 1-D parameters (``state.exact_below``) are averaged again
    exactly afterwards, in one float32 all-reduce. A bfloat16 or float16
    bucket is summed in float32 too, and rounded to its dtype at the end.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = pycomm.hooks.CompressionState(comm)
        >>> ddp_model.register_comm_hook(state, pycomm.hooks.int8_hook)
    """
    return _quantized_hook(torch.int8, "int8_hook", state, bucket)


@_hook_doc(_FLOAT_BUCKET, "A future completing with the averaged bucket.",
           state="a :class:`CompressionState`.", needs=_QUANTIZED_NEEDS)
def fp8_hook(state: CompressionState,
             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket over a float8 wire, with error feedback.

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
