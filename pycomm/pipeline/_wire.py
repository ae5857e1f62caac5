"""How a stage's tensors travel: a small header, then the payload.

An activation is a tensor or a tuple of tensors of any shape and of the
dtypes pycomm's p2p carries (bool travels as uint8). The receiver must size
its buffers before posting them, so the sender first sends a fixed-size int64
header describing every tensor (dtype, shape); the payload follows. Gradients
need no header: they have the shapes of the activations the receiver sent.

Header layout (``HEADER_LEN`` int64)::

    [n_tensors, (dtype_code, ndim, dim_0 .. dim_{ndim-1}) x n_tensors, 0 ...]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HEADER_LEN", "TensorMeta", "as_tuple", "decode_header", "encode_header", "from_wire",
           "meta_of", "to_wire", "wire_buffer"]

HEADER_LEN = 64

# Codes on the wire (both ends run the same pycomm, so a list index is enough).
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
           torch.int64, torch.uint8, torch.int8, torch.bool]
_CODE = {dt: k for k, dt in enumerate(_DTYPES)}


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one transferred tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def carries_grad(self) -> bool:
        """Floating tensors get a gradient back; masks and indices do not."""
        return self.dtype.is_floating_point


def as_tuple(value: object, what: str) -> tuple[torch.Tensor, ...]:
    """A stage's input or output as a tuple of tensors."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    for k, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a tensor or a tuple of tensors; item {k} is "
                            f"{type(t).__name__}")
    return tuple(items)


def meta_of(tensors: tuple[torch.Tensor, ...], what: str) -> tuple[TensorMeta, ...]:
    for k, t in enumerate(tensors):
        if t.dtype not in _CODE:
            raise TypeError(f"{what} item {k} has dtype {t.dtype}, which pycomm's p2p cannot "
                            f"carry; supported: {', '.join(str(d) for d in _DTYPES)}")
    return tuple(TensorMeta(tuple(t.shape), t.dtype) for t in tensors)


def encode_header(metas: tuple[TensorMeta, ...], what: str) -> torch.Tensor:
    """The int64 header describing `metas` (see the module docstring)."""
    vals = [len(metas)]
    for m in metas:
        vals += [_CODE[m.dtype], len(m.shape), *m.shape]
    if len(vals) > HEADER_LEN:
        raise ValueError(f"{what}: {len(metas)} tensors with {sum(len(m.shape) for m in metas)} "
                         f"dimensions do not fit the {HEADER_LEN}-int header; pass fewer or "
                         "flatter tensors between stages")
    return torch.tensor(vals + [0] * (HEADER_LEN - len(vals)), dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[TensorMeta, ...]:
    vals = header.tolist()
    n, k, metas = vals[0], 1, []
    for _ in range(n):
        code, ndim = vals[k], vals[k + 1]
        metas.append(TensorMeta(tuple(vals[k + 2:k + 2 + ndim]), _DTYPES[code]))
        k += 2 + ndim
    return tuple(metas)


def to_wire(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of a dtype p2p carries (bool as uint8), detached."""
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.contiguous()


def wire_buffer(meta: TensorMeta, device: torch.device) -> torch.Tensor:
    """An empty receive buffer for `meta`."""
    dtype = torch.uint8 if meta.dtype == torch.bool else meta.dtype
    return torch.empty(meta.shape, dtype=dtype, device=device)


def from_wire(buf: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    return buf.to(torch.bool) if meta.dtype == torch.bool else buf
