"""Cutting an ``nn.Sequential`` into consecutive stages."""

from __future__ import annotations

import copy
import time
from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["balance_by_time", "split_sequential"]


def split_sequential(model: nn.Sequential, num_stages: int,
                     balance: Sequence[int] | None = None) -> list[nn.Sequential]:
    """Cuts ``model`` into ``num_stages`` runs of consecutive layers.

    Args:
        model: the layers, in order.
        num_stages: how many stages (>= 1, at most ``len(model)``).
        balance: layers per stage (sums to ``len(model)``, every entry >= 1);
            by default the cut balances the parameter count (each stage gets at
            least one layer).

    Returns:
        ``num_stages`` ``nn.Sequential`` sharing the layers (not copies) of
        ``model``.

    Raises:
        TypeError: model is not an ``nn.Sequential``.
        ValueError: bad num_stages or balance.

    Example::

        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> [len(s) for s in split_sequential(model, 2, balance=[2, 1])]
        [2, 1]
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model must be an nn.Sequential, got {type(model).__name__}")
    layers = list(model.children())
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) \
            or not 1 <= num_stages <= len(layers):
        raise ValueError(f"num_stages must be an int in 1 .. {len(layers)} (the model's layers), "
                         f"got {num_stages!r}")
    if balance is None:
        weights = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        balance = _balance(weights, num_stages)
    balance = list(balance)
    if len(balance) != num_stages or any(not isinstance(b, int) or b < 1 for b in balance) \
            or sum(balance) != len(layers):
        raise ValueError(f"balance must be {num_stages} ints >= 1 summing to {len(layers)} (the "
                         f"model's layers), got {balance}")
    stages, start = [], 0
    for b in balance:
        stages.append(nn.Sequential(*layers[start:start + b]))
        start += b
    return stages


def balance_by_time(model: nn.Sequential, sample: Any, num_stages: int,
                    repeats: int = 3) -> list[int]:
    """Layers per stage that balance the measured forward + backward time of
    each layer on ``sample`` (a batch for the model's first layer); pass the
    result as ``split_sequential(..., balance=...)``.

    Args:
        model: the layers, in order.
        sample: an input batch for ``model[0]`` (tensor or tuple).
        num_stages: how many stages.
        repeats: timing repetitions per layer (the minimum counts).

    Returns:
        The balance: ``num_stages`` ints summing to ``len(model)``.

    Example::

        >>> balance = balance_by_time(model, torch.randn(32, 8), 2)
        >>> stages = split_sequential(model, 2, balance=balance)
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model must be an nn.Sequential, got {type(model).__name__}")
    x = sample
    times = []
    # Copies of the layers are timed (as torchgpipe does) and the RNG is put
    # back: profiling must not move BatchNorm statistics, .grads or the RNG.
    rng = torch.get_rng_state()
    for layer in map(copy.deepcopy, model.children()):
        best = float("inf")
        for _ in range(max(1, repeats)):
            inputs = tuple(t.detach().requires_grad_(t.is_floating_point())
                           for t in (x if isinstance(x, tuple) else (x,)))
            t0 = time.perf_counter()
            out = layer(*inputs)
            outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            best = min(best, time.perf_counter() - t0)
        times.append(best)
        x = tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()
    torch.set_rng_state(rng)
    return _balance(times, num_stages)


def _balance(weights: Sequence[float], num_stages: int) -> list[int]:
    """Consecutive groups (each >= 1 item) minimising the heaviest group
    (dynamic programming over cut points)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the lightest heaviest group cutting the first i items into k groups
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]
