"""pycomm: collective communication you can read, change and measure.

Ring all-reduce, broadcast and point-to-point transfer implemented in C++
(csrc/core) over pluggable transports (gloo, shared memory, NCCL), with a
torch.distributed-style API::

    import pycomm
    comm = pycomm.init()                 # under torchrun
    comm.all_reduce(t)                   # in place, SUM
    work = comm.all_reduce(t, op="avg", async_op=True); work.wait()

and, after ``import pycomm``, as a torch.distributed backend::

    torch.distributed.init_process_group(backend="pycomm")
"""

from __future__ import annotations

from datetime import timedelta
from typing import Sequence

import torch

from . import (
    backend,
    comm,
    hooks,  # DDP communication hooks (pycomm.hooks.allreduce_hook, ...)
)

# Re-exported (``X as X``): pycomm.comm.__all__ lists them in __all__ below.
from .comm import CommError as CommError
from .comm import Communicator as Communicator
from .comm import OpLike
from .comm import P2POp as P2POp
from .comm import ReduceOp as ReduceOp
from .comm import Work as Work
from .comm import get_default as get_default
from .comm import init as init
from .comm import is_initialized as is_initialized

# torch.distributed.init_process_group(backend="pycomm") works after `import pycomm`.
backend.register()

__all__ = comm.__all__ + [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "close",
    "gather",
    "hooks",
    "irecv",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "split",
]

__version__ = "0.1.0"


# Module-level twins acting on the default communicator (the last init()).
# Each has its method's signature, parameter for parameter (names, defaults,
# annotations): tests/test_api.py::test_module_twins_match_the_methods fails
# when one drifts.
def all_reduce(tensor: torch.Tensor, op: OpLike = ReduceOp.SUM, algo: str = "auto",
               async_op: bool = False, wire_dtype: torch.dtype | str | None = None,
               register: bool = False, wire_block: int = 256,
               residual: torch.Tensor | None = None) -> Work | None:
    """:meth:`Communicator.all_reduce` on the default communicator."""
    return get_default().all_reduce(tensor, op=op, algo=algo, async_op=async_op,
                                    wire_dtype=wire_dtype, register=register,
                                    wire_block=wire_block, residual=residual)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: OpLike = ReduceOp.SUM,
                   algo: str = "auto", async_op: bool = False) -> Work | None:
    """:meth:`Communicator.reduce_scatter` on the default communicator."""
    return get_default().reduce_scatter(output, input, op=op, algo=algo, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, algo: str = "auto",
               async_op: bool = False) -> Work | None:
    """:meth:`Communicator.all_gather` on the default communicator."""
    return get_default().all_gather(output, input, algo=algo, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, algo: str = "auto",
              async_op: bool = False) -> Work | None:
    """:meth:`Communicator.broadcast` on the default communicator."""
    return get_default().broadcast(tensor, src=src, algo=algo, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int = 0, op: OpLike = ReduceOp.SUM,
           async_op: bool = False) -> Work | None:
    """:meth:`Communicator.reduce` on the default communicator."""
    return get_default().reduce(tensor, dst=dst, op=op, async_op=async_op)


def gather(gather_list: Sequence[torch.Tensor] | None, tensor: torch.Tensor, dst: int = 0,
           async_op: bool = False) -> Work | None:
    """:meth:`Communicator.gather` on the default communicator."""
    return get_default().gather(gather_list, tensor, dst=dst, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: Sequence[torch.Tensor] | None, src: int = 0,
            async_op: bool = False) -> Work | None:
    """:meth:`Communicator.scatter` on the default communicator."""
    return get_default().scatter(tensor, scatter_list, src=src, async_op=async_op)


def all_to_all(output_tensor_list: Sequence[torch.Tensor],
               input_tensor_list: Sequence[torch.Tensor], async_op: bool = False) -> Work | None:
    """:meth:`Communicator.all_to_all` on the default communicator."""
    return get_default().all_to_all(output_tensor_list, input_tensor_list, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      async_op: bool = False) -> Work | None:
    """:meth:`Communicator.all_to_all_single` on the default communicator."""
    return get_default().all_to_all_single(output, input, output_split_sizes,
                                           input_split_sizes, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
    """:meth:`Communicator.send` on the default communicator."""
    get_default().send(tensor, dst, tag)


def recv(tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> int:
    """:meth:`Communicator.recv` on the default communicator."""
    return get_default().recv(tensor, src, tag)


def isend(tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
    """:meth:`Communicator.isend` on the default communicator."""
    return get_default().isend(tensor, dst, tag)


def irecv(tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
    """:meth:`Communicator.irecv` on the default communicator."""
    return get_default().irecv(tensor, src, tag)


def batch_isend_irecv(ops: Sequence[P2POp]) -> list[Work]:
    """:meth:`Communicator.batch_isend_irecv` on the default communicator."""
    return get_default().batch_isend_irecv(ops)


def new_group(ranks: Sequence[int], *,
              timeout: timedelta | float | None = None) -> Communicator | None:
    """:meth:`Communicator.new_group` on the default communicator."""
    return get_default().new_group(ranks, timeout=timeout)


def split(color: int | None, key: int | None = None, *,
          timeout: timedelta | float | None = None) -> Communicator | None:
    """:meth:`Communicator.split` on the default communicator."""
    return get_default().split(color, key, timeout=timeout)


def barrier() -> None:
    """:meth:`Communicator.barrier` on the default communicator."""
    get_default().barrier()


def close() -> None:
    """Closes the default communicator."""
    if is_initialized():
        get_default().close()
