"""Recovery time after a lost worker: torchrun restart vs shrink in place.

    python benchmarks/elastic/bench_elastic.py                 # 2 ranks, shm and gloo, 3 trials
    python benchmarks/elastic/bench_elastic.py --nproc 3 --trials 5 --transports shm

Each trial runs examples/elastic_train.py with rank N-1 SIGKILLed in the
middle of step 5's backward, and reads the example's timing events (wall
clock, one JSON line each: the victim's ``killed``, the survivors'
``detected`` (the CommError) and ``resumed`` (the first training step that
completes after the recovery)):

- restart: ``torchrun --max-restarts 1 --rdzv-backend c10d`` (the agent
  stops the survivors, starts every worker again; they import torch,
  rendezvous, load rank 0's checkpoint and train): kill -> resumed;
- shrink: ranks started without an agent (pycomm.bench.launch.run_script);
  the survivors shrink the communicator, rebind the DDP model and redo the
  step: kill -> detected (failure detection), detected -> resumed (the
  shrink itself plus the redone step), kill -> resumed.

Prints the median and range of each over the trials and writes JSON (with
the commit) next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pycomm.bench.launch import run_script  # noqa: E402
from pycomm.bench.report import git_commit  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "elastic_train.py")
ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _events(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _first(events: list[dict], name: str) -> float:
    return min(e["t"] for e in events if e["event"] == name)


def _example_args(transport: str, nproc: int, tmp: str, events: str) -> list[str]:
    return ["--steps", "8", "--transport", transport, "--kill-rank", str(nproc - 1),
            "--kill-step", "5", "--events", events, "--ckpt", os.path.join(tmp, "ckpt.pt")]


def restart_trial(transport: str, nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
        events = os.path.join(tmp, "events.jsonl")
        sk.close()
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
             "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--monitor-interval", "0.1", EXAMPLE,
             *_example_args(transport, nproc, tmp, events)],
            env=dict(os.environ, **ENV), capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"restart trial failed:\n{proc.stderr[-3000:]}")
        ev = _events(events)
    return {"kill_to_resumed_s": _first(ev, "resumed") - _first(ev, "killed")}


def shrink_trial(transport: str, nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        events = os.path.join(tmp, "events.jsonl")
        procs = run_script([EXAMPLE, *_example_args(transport, nproc, tmp, events), "--shrink"],
                           nproc, env=ENV, timeout=300)
        bad = [p for r, p in enumerate(procs) if r != nproc - 1 and p.returncode != 0]
        if bad:
            raise RuntimeError(f"shrink trial failed:\n{bad[0].stderr[-3000:]}")
        ev = _events(events)
    killed, detected, resumed = (_first(ev, "killed"), _first(ev, "detected"),
                                 _first(ev, "resumed"))
    return {"kill_to_detected_s": detected - killed, "detected_to_resumed_s": resumed - detected,
            "kill_to_resumed_s": resumed - killed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--transports", default="shm,gloo")
    ap.add_argument("--json", default=str(Path(__file__).with_name("results_cpu.json")))
    args = ap.parse_args()
    rows, trials = [], {}
    for transport in args.transports.split(","):
        for mode, fn in (("restart", restart_trial), ("shrink", shrink_trial)):
            runs = [fn(transport, args.nproc) for _ in range(args.trials)]
            trials[f"{mode}/{transport}"] = runs
            for metric in runs[0]:
                values = [r[metric] for r in runs]
                rows.append((mode, transport, metric, statistics.median(values), min(values),
                             max(values)))
    print(f"# {args.nproc} ranks, {args.trials} trials, commit {git_commit()}")
    print(f"{'mode':>8} {'transport':>9} {'metric':>22} {'median s':>9} {'min':>7} {'max':>7}")
    for mode, transport, metric, med, lo, hi in rows:
        print(f"{mode:>8} {transport:>9} {metric:>22} {med:9.3f} {lo:7.3f} {hi:7.3f}")
    with open(args.json, "w") as f:
        json.dump({"commit": git_commit(), "nproc": args.nproc, "trials": trials,
                   "summary": [dict(zip(("mode", "transport", "metric", "median_s", "min_s",
                                         "max_s"), row)) for row in rows]}, f, indent=1)
    print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
