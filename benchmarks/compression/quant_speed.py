"""Speed of the quantized wire's kernels on one core, per format (int8,
float8_e4m3fn, float8_e5m2): quantize (with and without the error-feedback
residual, which adds a 4-byte write per element) + dequantize-accumulate of
float32, in GB/s of float32 input, for the AVX2 path and the portable one
(PYCOMM_CPU_SIMD=scalar, in a second process), beside a plain copy of the
same bytes (torch copy_).

    python benchmarks/compression/quant_speed.py --json quant_speed.json [--mib 64]

Goal (issue 38): >= 4 GB/s for quantize + dequantize-accumulate (AVX2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

FORMATS = ("int8", "float8_e4m3fn", "float8_e5m2")


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _format_speeds(fmt: str, x: torch.Tensor, block: int, reps: int) -> dict[str, float]:
    """The seconds of each kernel on ``x`` in one format."""
    from pycomm._ext import _C

    err = torch.empty_like(x)
    acc = torch.zeros_like(x)
    q = _C.quantize(x, block, err, format=fmt)
    return {"quantize": _best(lambda: _C.quantize(x, block, err, format=fmt), reps),
            "quantize_no_residual": _best(lambda: _C.quantize(x, block, format=fmt), reps),
            "dequantize_add": _best(lambda: _C.dequantize(acc, q, block, True, format=fmt), reps)}


def measure(mib: int, block: int, reps: int) -> dict[str, dict[str, float]]:
    """GB/s of float32 input of each kernel on this process's path, per wire format."""
    torch.set_num_threads(1)
    n = mib * (1 << 20) // 4
    x = torch.randn(n)
    copy_dst = torch.empty(n)
    t_c = _best(lambda: copy_dst.copy_(x), reps)
    gb = n * 4 / 1e9
    out = {}
    for fmt in FORMATS:
        t = _format_speeds(fmt, x, block, reps)
        t_q, t_q0, t_d = t["quantize"], t["quantize_no_residual"], t["dequantize_add"]
        out[fmt] = {"quantize_GBps": gb / t_q, "quantize_no_residual_GBps": gb / t_q0,
                    "dequantize_add_GBps": gb / t_d, "both_GBps": gb / (t_q + t_d),
                    "both_no_residual_GBps": gb / (t_q0 + t_d), "copy_GBps": gb / t_c}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # this process's path only
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.mib, args.block, args.reps)))
        return 0
    out: dict[str, object] = {"mib": args.mib, "block": args.block}
    for path in ("auto", "scalar"):
        env = dict(os.environ, PYCOMM_CPU_SIMD=path, OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, __file__, "--one", "--mib", str(args.mib),
                               "--block", str(args.block), "--reps", str(args.reps)],
                              env=env, capture_output=True, text=True, check=True)
        out[path] = json.loads(proc.stdout.strip().splitlines()[-1])
        for fmt, speeds in out[path].items():
            print(f"{path:>6} {fmt:>13}: " + ", ".join(f"{k} {v:.2f}" for k, v in speeds.items()))
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                       cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        out["commit"] = None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
