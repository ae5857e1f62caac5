"""Reduction-kernel bandwidth vs torch's add_ and a device-to-device copy, in the same run.

    python benchmarks/gpu/bench_kernel.py --out kernel.json [--mib 256]

For dst += src over N bytes per tensor the kernel moves 3N bytes (read dst,
read src, write dst) and a copy 2N (read, write); both are reported as moved
bytes per second, so kernel_bw / copy_bw is the fraction of achievable memory
bandwidth the kernel reaches (target: >= 0.90). torch's own dst.add_(src) is
the reference to match: reduce_over_torch_add >= 1.0 is the goal (issue 36).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pycomm._ext import _C  # noqa: E402


def timed(fn, iters: int) -> float:
    """Seconds per call (CUDA events, after warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    assert torch.cuda.is_available() and _C.WITH_CUDA, "needs CUDA and the CUDA build"
    nbytes = args.mib << 20
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        n = nbytes // torch.tensor([], dtype=dtype).element_size()
        dst = torch.rand(n, device="cuda").to(dtype)
        src = torch.rand(n, device="cuda").to(dtype)
        t_copy = timed(lambda d=dst, s=src: d.copy_(s), args.iters)
        t_red = timed(lambda d=dst, s=src: _C.cuda_reduce_(d, s, 0), args.iters)
        t_red_scale = timed(lambda d=dst, s=src: _C.cuda_reduce_scale_(d, s, 1, 0.5), args.iters)
        t_torch = timed(lambda d=dst, s=src: d.add_(s), args.iters)
        copy_bw = 2 * nbytes / t_copy / 1e9
        red_bw = 3 * nbytes / t_red / 1e9
        row = {
            "dtype": str(dtype).replace("torch.", ""),
            "bytes_per_tensor": nbytes,
            "copy_GBps": round(copy_bw, 1),
            "reduce_GBps": round(red_bw, 1),
            "reduce_scale_GBps": round(3 * nbytes / t_red_scale / 1e9, 1),
            "torch_add_GBps": round(3 * nbytes / t_torch / 1e9, 1),
            "reduce_over_copy": round(red_bw / copy_bw, 3),
            "reduce_over_torch_add": round(t_torch / t_red, 3),
            "target": 0.90,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
