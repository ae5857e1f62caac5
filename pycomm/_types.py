"""The API's argument types and their checks: ReduceOp, P2POp, and the
conversions every Communicator method applies to what it is given (reduce
ops and wire dtypes to the C++ enums, tensor and list arguments checked
with errors that name them)."""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
import torch.distributed as dist

__all__ = ["OpLike", "P2POp", "ReduceOp"]


class ReduceOp(enum.IntEnum):
    """Reduction operators. Strings ("sum", "avg", "max", "min", "product")
    and ``torch.distributed.ReduceOp`` values are accepted wherever an op is."""

    SUM = 0
    AVG = 1
    MAX = 2
    MIN = 3
    PRODUCT = 4


_OP_NAMES = {
    "sum": ReduceOp.SUM,
    "avg": ReduceOp.AVG,
    "mean": ReduceOp.AVG,
    "max": ReduceOp.MAX,
    "min": ReduceOp.MIN,
    "product": ReduceOp.PRODUCT,
    "prod": ReduceOp.PRODUCT,
}

OpLike = Union[ReduceOp, str, int, "dist.ReduceOp"]


def _to_op(op: Any) -> int:
    if isinstance(op, ReduceOp):
        return int(op)
    if isinstance(op, str):
        try:
            return int(_OP_NAMES[op.lower()])
        except KeyError:
            raise ValueError(
                f"unknown reduce op {op!r}; expected one of {sorted(_OP_NAMES)}"
            ) from None
    if isinstance(op, dist.ReduceOp) or type(op).__name__ == "RedOpType":
        name = str(op).split(".")[-1].lower()
        if name in _OP_NAMES:
            return int(_OP_NAMES[name])
        raise ValueError(f"torch.distributed reduce op {op} is not supported by pycomm")
    if isinstance(op, int) and not isinstance(op, bool) and 0 <= op < len(ReduceOp):
        return op
    raise ValueError(f"unknown reduce op {op!r}; use pycomm.ReduceOp or a string like 'sum'")


# The binding's wire codes (csrc/torch/checks.h, to_wire): the C++ DType
# codes of float16, bfloat16 and int8 (csrc/core/types.h), then the float8
# formats, which are no tensor dtype of pycomm's.
_WIRE_DTYPES = {torch.float16: 2, torch.bfloat16: 3, torch.int8: 7,
                torch.float8_e4m3fn: 8, torch.float8_e5m2: 9}
_WIRE_NAMES = {"float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "int8": torch.int8,
               "float8_e4m3fn": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
               "float8_e5m2": torch.float8_e5m2, "fp8_e5m2": torch.float8_e5m2}
#: The block-scaled wires (each rank's contribution quantized once, summed in
#: float32): across hosts only the step between hosts uses them (_hierarchy).
QUANTIZED_WIRES = frozenset(_WIRE_DTYPES[t] for t in (torch.int8, torch.float8_e4m3fn,
                                                        torch.float8_e5m2))


def _to_wire(wire_dtype: Any) -> int:
    """all_reduce's wire_dtype -> the binding's wire code."""
    dt = _WIRE_NAMES.get(wire_dtype.lower()) if isinstance(wire_dtype, str) else wire_dtype
    if not isinstance(dt, torch.dtype) or dt not in _WIRE_DTYPES:
        raise ValueError(f"all_reduce: wire_dtype must be None, torch.float16, torch.bfloat16, "
                         f"torch.int8, torch.float8_e4m3fn or torch.float8_e5m2 (or 'float16' / "
                         f"'bfloat16' / 'int8' / 'fp8_e4m3' / 'fp8_e5m2'), got {wire_dtype!r}")
    return _WIRE_DTYPES[dt]


@dataclass
class P2POp:
    """One request of :meth:`Communicator.batch_isend_irecv`.

    Args:
        op: ``"isend"`` or ``"irecv"`` (or the functions/methods of that name,
            as with ``torch.distributed.P2POp(dist.isend, t, peer)``).
        tensor: the tensor to send from or receive into (contiguous).
        peer: the other rank.
        tag: a receive matches the send with the same tag (CPU transports;
            0 on CUDA).
    """

    op: Union[str, Callable[..., Any]]
    tensor: torch.Tensor
    peer: int
    tag: int = 0

    def is_send(self) -> bool:
        name = self.op if isinstance(self.op, str) else getattr(self.op, "__name__", "")
        if name in ("isend", "send"):
            return True
        if name in ("irecv", "recv"):
            return False
        raise ValueError(f"P2POp.op must be 'isend' or 'irecv', got {self.op!r}")


def _need_tensors(op: str, **args: Any) -> None:
    """TypeError naming the argument when one is not a torch.Tensor (a list
    or a numpy array would otherwise get pybind's signature dump)."""
    for name, value in args.items():
        if not isinstance(value, torch.Tensor):
            hint = " (wrap it with torch.as_tensor)" if hasattr(value, "__len__") else ""
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}{hint}")


def _tensor_list(op: str, name: str, value: Any, none_ok: bool = True) -> list[torch.Tensor]:
    """A list argument of tensors (None -> [] where allowed), or a TypeError
    naming it."""
    if value is None and none_ok:
        return []
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list of tensors"
                        f"{' or None' if none_ok else ''}, got {type(value).__name__}")
    for i, t in enumerate(value):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return list(value)


def _splits(name: str, value: Any) -> list[int]:
    """all_to_all_single's split sizes (None -> [], equal blocks)."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value):
        raise TypeError(f"all_to_all_single: {name} must be a list of ints or None, got {value!r}")
    return [int(v) for v in value]
