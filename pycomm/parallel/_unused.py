"""Unused parameters of :class:`DistributedDataParallel`: which parameters a
forward's outputs reach (``find_unused_parameters``, and ``static_graph``'s
first iteration, treat the others as ready at once), and the errors every
rank raises when the used-flags all-reduce shows that a parameter got no
gradient on some rank, or got one after it was treated as unused."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch

__all__ = ["find_tensors", "late_gradient_error", "params_reached", "unused_error"]


def find_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) forward output."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from find_tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from find_tensors(x)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from find_tensors(getattr(obj, f.name))


def params_reached(tensors: list[torch.Tensor], index_of: dict[int, int]) -> set[int]:
    """Indices of the parameters whose AccumulateGrad node is reachable
    from ``tensors``' autograd graph (``index_of``: ``id(parameter)`` -> its index)."""
    reached: set[int] = set()
    stack = []
    for t in tensors:
        if t.grad_fn is None:
            if id(t) in index_of:
                reached.add(index_of[id(t)])
        else:
            stack.append(t.grad_fn)
    seen: set[Any] = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None and id(var) in index_of:
            reached.add(index_of[id(var)])
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return reached


def late_gradient_error(late_names: list[str]) -> str:
    """The message when a parameter treated as unused got its gradient
    later (``late_names``: those of this rank, none if it was another's)."""
    names = ", ".join(late_names) or "(on another rank)"
    return ("DistributedDataParallel: a parameter got its gradient after DDP had treated it "
            f"as unused ({names}): with find_unused_parameters/static_graph, every gradient "
            "must come from the forward's outputs (do not use parameters outside forward)")


def unused_error(names: list[str], missing: list[int], counts: list[int], flags: list[int],
                 active: int) -> str:
    """The message when parameters ``missing`` got a gradient on fewer than
    the ``active`` ranks (``counts``: on how many; ``flags``: on this one)."""
    shown = ", ".join(f"{names[i]!r} (index {i}: got a gradient on {counts[i]} of "
                      f"{active} ranks, {'not ' if not flags[i] else ''}on this one)"
                      for i in missing[:8])
    more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
    return ("DistributedDataParallel: Expected to have finished reduction, but parameters "
            f"did not receive a gradient on every rank: {shown}{more}. This error indicates "
            "that your module has parameters that were not used in producing loss. Pass "
            "find_unused_parameters=True (or static_graph=True if the unused set never "
            "changes), or make sure every output of forward takes part in the loss. "
            "Every rank raises this error; the .grad values are not valid.")
