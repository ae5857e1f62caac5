"""Model synchronisation across ranks: coalesced broadcast and a shape check."""

from __future__ import annotations

from typing import Sequence

import torch

from ..comm import Communicator

__all__ = ["broadcast_coalesced", "check_same_parameters"]

#: Coalesced broadcasts move at most this many bytes per collective (torch
#: uses 250 MiB for the same job).
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024

# Stable codes for the dtype check (every rank must agree on the numbers).
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
           torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
           torch.bool]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_OTHER_DTYPE = len(_DTYPES)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view (or copy, if not contiguous) of ``t``'s data."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _chunks(tensors: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of at most ``limit`` bytes (a larger tensor alone)."""
    groups: list[list[torch.Tensor]] = []
    size = limit
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    return groups


def broadcast_coalesced(comm: Communicator, tensors: Sequence[torch.Tensor], src: int,
                        chunk_bytes: int = BROADCAST_CHUNK_BYTES) -> None:
    """Overwrites ``tensors`` on every rank with rank ``src``'s, in few collectives.

    The tensors' bytes are packed into flat uint8 buffers of at most
    ``chunk_bytes`` (any dtype mix, one broadcast per buffer) and unpacked.
    Every rank must pass tensors of the same sizes in the same order.

    Args:
        comm: the communicator; tensors live on its device.
        tensors: the tensors to overwrite (parameters, buffers), any dtypes.
        src: the rank whose values win.
        chunk_bytes: the largest buffer broadcast at once.
    """
    if comm.world_size == 1:
        return
    with torch.no_grad():
        for group in _chunks([t for t in tensors if t.numel() > 0], chunk_bytes):
            flat = torch.cat([_as_bytes(t) for t in group])
            comm.broadcast(flat, src=src)
            if comm.rank == src:
                continue
            offset = 0
            for t in group:
                n = t.numel() * t.element_size()
                piece = flat[offset:offset + n]
                if t.is_contiguous():
                    t.detach().reshape(-1).view(torch.uint8).copy_(piece)
                else:  # clone: piece may start at an offset t's dtype cannot view
                    t.detach().copy_(piece.clone().view(t.dtype).view(t.shape))
                offset += n


def _describe(params: Sequence[torch.Tensor]) -> list[int]:
    """[count, then per parameter: dtype code, requires_grad, ndim, *shape]."""
    out = [len(params)]
    for p in params:
        out += [_DTYPE_CODE.get(p.dtype, _OTHER_DTYPE), int(p.requires_grad), p.dim(), *p.shape]
    return out


def _decode(desc: list[int]) -> list[tuple[str, tuple[int, ...]]]:
    """Inverse of _describe: [(dtype name, or "frozen <dtype name>", shape)]."""
    out, i = [], 1
    for _ in range(desc[0]):
        code, trained, ndim = desc[i], desc[i + 1], desc[i + 2]
        name = str(_DTYPES[code]).replace("torch.", "") if code < len(_DTYPES) else "other"
        out.append((name if trained else f"frozen {name}", tuple(desc[i + 3:i + 3 + ndim])))
        i += 3 + ndim
    return out


def _gather_lists(comm: Communicator, values: list[int]) -> list[list[int]]:
    """Every rank's int list (lengths may differ), by two all-gathers."""
    dev = comm.device
    n = comm.world_size
    lengths = torch.zeros(n, dtype=torch.int64, device=dev)
    comm.all_gather(lengths, torch.tensor([len(values)], dtype=torch.int64, device=dev))
    width = int(lengths.max().item())
    mine = torch.zeros(width, dtype=torch.int64, device=dev)
    mine[:len(values)] = torch.tensor(values, dtype=torch.int64)
    everyone = torch.zeros(n * width, dtype=torch.int64, device=dev)
    comm.all_gather(everyone, mine)
    rows = everyone.view(n, width).tolist()
    return [rows[r][:int(lengths[r])] for r in range(n)]


def check_same_parameters(comm: Communicator, params: Sequence[torch.Tensor],
                          names: Sequence[str], local_error: str | None = None) -> None:
    """Raises on every rank unless all ranks have the same parameter shapes,
    dtypes and ``requires_grad`` flags.

    A rank that already failed its own checks passes ``local_error``: the
    other ranks then raise too (naming it and its message) instead of waiting
    for it in a later collective; the failing rank returns and raises its own
    exception.

    Args:
        comm: the communicator (a collective: every rank calls it).
        params: this rank's parameters (frozen ones too), in registration order.
        names: their names, for the error message.
        local_error: this rank's own error message, if any.

    Raises:
        ValueError: the ranks disagree, or another rank reported an error;
            the message names the first mismatching parameter and the ranks.
    """
    if comm.world_size == 1:
        return
    message = list((local_error or "").encode())
    gathered = _gather_lists(comm, [len(message), *message, *_describe(params)])
    errors = {r: bytes(row[1:1 + row[0]]).decode(errors="replace")
              for r, row in enumerate(gathered) if row[0]}
    if errors:
        if local_error:
            return
        r, msg = next(iter(errors.items()))
        raise ValueError(f"DistributedDataParallel: rank {r} failed: {msg}")
    descs = [row[1 + row[0]:] for row in gathered]
    ref = _decode(descs[0])
    for r in range(1, comm.world_size):
        if descs[r] == descs[0]:
            continue
        other = _decode(descs[r])
        if len(other) != len(ref):
            raise ValueError(
                f"DistributedDataParallel: rank 0 has {len(ref)} parameters but rank {r} has "
                f"{len(other)}; every rank must wrap the same model")
        i = next(k for k in range(len(ref)) if ref[k] != other[k])
        raise ValueError(
            f"DistributedDataParallel: parameter {i} ({names[i]!r} on rank {comm.rank}) is "
            f"{ref[i][1]} {ref[i][0]} on rank 0 but {other[i][1]} {other[i][0]} on rank {r}; "
            "every rank must wrap the same model")
