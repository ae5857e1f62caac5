"""pycomm.bench: the performance study toolkit.

``python -m pycomm.bench {allreduce,reducescatter,allgather,broadcast,sendrecv}``
prints nccl-tests' table for several algorithms side by side (pycomm's ring,
auto, nccl, and torch.distributed's own backend), writes JSON rows and a
busbw plot; ``python -m pycomm.bench model RESULTS.json`` fits the alpha-beta
model and predicts larger worlds. See benchmarks/allreduce/README.md.

The modules: ``cli`` (flags), ``collectives`` (per-collective bytes, busbw
factor, data, expected result, runners), ``runner`` (the per-rank harness),
``launch`` (torchrun, spawned or mpiexec's ranks), ``report`` (table,
JSON, plot), ``model`` (alpha-beta fit and predictions), ``bounds`` (the
copy every series is read against), ``peers`` (MPICH's and DeepSpeed's
all-reduce as series).
"""

from __future__ import annotations

from .cli import parse_size, size_sweep
from .collectives import busbw_factor, count_wrong, expected_result
from .model import fit_alpha_beta, ring_allreduce_time

__all__ = [
    "busbw_factor",
    "count_wrong",
    "expected_result",
    "fit_alpha_beta",
    "parse_size",
    "ring_allreduce_time",
    "size_sweep",
]
