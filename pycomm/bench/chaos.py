"""``python -m pycomm.bench chaos``: faults injected into soak traffic.

    python -m pycomm.bench chaos --nproc 3 --transport shm --faults 20 --op-timeout 5

Each trial starts a fresh job of ``--nproc`` ranks running the soak's mixed
traffic (soak.py, every result checked) with the communicator's timeout set
to ``--op-timeout``, waits until every rank is in its traffic, waits a
random moment more, and injects one fault into one random rank:

    kill  SIGKILL (an OOM kill, a node lost)
    term  SIGTERM (a scheduler's preemption)
    stop  SIGSTOP, held until the trial ends (a rank frozen past the timeout)
    exit  the rank leaves mid-program with exit status 0 (SIGUSR1 raises
          SystemExit in it: Python's normal shutdown, no close of its own;
          soak.run_under_chaos is each rank's side)

The rule each trial checks: every survivor raises an error out of its
collective (recorded with its type and message, and whether the message
names the faulty rank) within ``--op-timeout`` + 5 s of the fault; no
process is left running (a survivor still running 30 s past the timeout is
killed and counted as hung); nothing of the job is left in /dev/shm. The
summary gives, per fault kind, the trials, the survivors that raised, the
slowest time from fault to error, and every breach of the rule; the exit
status is 1 if there was one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["FAULTS", "main"]

FAULTS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP,
          "exit": signal.SIGUSR1}
GRACE_S = 5.0  # the rule: an error within the timeout + this
HUNG_S = 30.0  # past the timeout + this a survivor is killed and counted as hung


# ---------------------------------------------------------------- the driver

def _wait_ready(directory: Path, procs: list[subprocess.Popen], limit: float) -> str | None:
    """Waits until every rank is in its traffic; the reason if not."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if all((directory / f"rank{r}.ready").exists() for r in range(len(procs))):
            return None
        dead = [r for r, p in enumerate(procs) if p.poll() is not None]
        if dead:
            return f"rank {dead[0]} exited {procs[dead[0]].returncode} before the fault"
        time.sleep(0.05)
    return f"not every rank started its traffic within {limit:g} s"


def _finish(procs: list[subprocess.Popen], victim: int, deadline: float) -> list[str]:
    """Waits for the survivors until ``deadline`` (monotonic), kills what is
    left (the victim too); the ranks counted as hung."""
    hung = []
    for r, p in enumerate(procs):
        if r == victim:
            continue
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(r)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait()
    return [f"rank {r}" for r in hung]


def trial(index: int, kind: str, victim: int, delay: float, args: argparse.Namespace) -> dict[str, Any]:
    """One job, one fault: the record of what every rank did."""
    from .launch import start_script
    from .soak import shm_segments

    directory = Path(tempfile.mkdtemp(prefix="pycomm-chaos-"))
    argv = ["-m", "pycomm.bench", "soak", "--transport", args.transport,
            "--seed", str(args.seed + index), "--max-bytes", args.max_bytes,
            "--op-timeout", str(args.op_timeout), "--report", "1e9", "--chaos", str(directory)]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))}
    store, procs = start_script(argv, args.nproc, timeout=args.op_timeout + HUNG_S + 120, env=env)
    record: dict[str, Any] = {"trial": index, "fault": kind, "victim": victim,
                              "delay_s": round(delay, 3), "pids": [p.pid for p in procs]}
    try:
        why = _wait_ready(directory, procs, 120.0)
        if why is not None:
            record["breaches"] = [f"setup: {why}"]
            _finish(procs, -1, time.monotonic())
            return record
        time.sleep(delay)
        fault_at = time.time()
        os.kill(procs[victim].pid, FAULTS[kind])
        deadline = time.monotonic() + args.op_timeout + HUNG_S
        hung = _finish(procs, victim, deadline)
        record.update(_outcomes(directory, procs, victim, fault_at, hung, args))
        record["shm_left"] = shm_segments(record["pids"])
        if record["shm_left"]:
            record["breaches"].append(f"/dev/shm segments left: {record['shm_left']}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
        del store
        shutil.rmtree(directory, ignore_errors=True)
    return record


def _outcomes(directory: Path, procs: list[subprocess.Popen], victim: int, fault_at: float,
              hung: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Each survivor's error (or its absence) against the rule."""
    survivors, breaches = [], [f"{h} hung (killed {HUNG_S:g} s past the timeout)" for h in hung]
    for r, p in enumerate(procs):
        if r == victim:
            continue
        path = directory / f"rank{r}.error"
        if not path.exists():
            if f"rank {r}" not in hung:
                breaches.append(f"rank {r} exited {p.returncode} without raising")
            continue
        err = json.loads(path.read_text())
        after = err["t"] - fault_at
        survivors.append({"rank": r, "after_s": round(after, 3), "type": err["type"],
                          "names_victim": f"rank {victim}" in err["message"],
                          "message": err["message"][:300]})
        if after > args.op_timeout + GRACE_S:
            breaches.append(f"rank {r} raised {after:.1f} s after the fault (rule: "
                            f"{args.op_timeout + GRACE_S:g} s)")
    return {"victim_exit": procs[victim].returncode, "survivors": survivors, "breaches": breaches}


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per fault kind: trials, survivors that raised, slowest and median time
    from fault to error, messages naming the faulty rank; all breaches."""
    kinds: dict[str, Any] = {}
    for kind in dict.fromkeys(r["fault"] for r in records):
        mine = [r for r in records if r["fault"] == kind]
        after = [s["after_s"] for r in mine for s in r.get("survivors", [])]
        kinds[kind] = {"trials": len(mine), "survivors_raised": len(after),
                       "max_s": max(after, default=None),
                       "median_s": statistics.median(after) if after else None,
                       "names_victim": sum(s["names_victim"] for r in mine
                                           for s in r.get("survivors", [])),
                       "error_types": sorted({s["type"] for r in mine
                                              for s in r.get("survivors", [])})}
    breaches = [f"trial {r['trial']} ({r['fault']} rank {r['victim']}): {b}"
                for r in records for b in r.get("breaches", [])]
    return {"faults": len(records), "by_fault": kinds, "breaches": breaches}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pycomm.bench chaos",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=3, help="ranks per job (2-6)")
    p.add_argument("--transport", default="shm", choices=("shm", "gloo"))
    p.add_argument("--faults", type=int, default=20, help="trials, one fault each")
    p.add_argument("--kinds", default=",".join(FAULTS), help="from " + ",".join(FAULTS))
    p.add_argument("--op-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="the communicator's timeout in every job")
    p.add_argument("--max-bytes", default="256K", help="the soak's largest tensor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write every trial and the summary")
    args = p.parse_args(argv)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(args.kinds) - set(FAULTS))
    if unknown or not args.kinds:
        p.error(f"--kinds: choose from {','.join(FAULTS)}, got {unknown or 'none'}")
    if not 2 <= args.nproc <= 6:
        p.error("--nproc must be 2 to 6 (a fault needs a survivor; the soak's inputs stay exact to 6)")
    if args.faults < 1 or args.op_timeout <= 0:
        p.error("--faults must be >= 1 and --op-timeout > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pycomm.bench chaos ...``: returns 1 if the rule was breached."""
    args = parse_args(argv)
    # SIGTERM (or a Ctrl-C) ends the run through trial()'s finally, which
    # kills the trial's ranks: none is left running.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    rng = random.Random(args.seed)
    records = []
    for i in range(args.faults):
        kind, victim = args.kinds[i % len(args.kinds)], rng.randrange(args.nproc)
        rec = trial(i, kind, victim, rng.uniform(0.2, 1.5), args)
        records.append(rec)
        times = ", ".join(f"{s['after_s']:.2f}" for s in rec.get("survivors", []))
        print(f"chaos: trial {i}: {kind} rank {victim} after {rec['delay_s']:.2f} s: survivors "
              f"raised after [{times}] s" + "".join(f"; BREACH {b}" for b in rec.get("breaches", [])),
              flush=True)
    summary = summarize(records)
    for kind, k in summary["by_fault"].items():
        print(f"chaos: {kind}: {k['trials']} trials, {k['survivors_raised']} survivors raised "
              f"({', '.join(k['error_types'])}), max {k['max_s']} s, median {k['median_s']} s, "
              f"{k['names_victim']} messages name the faulty rank", flush=True)
    print(f"chaos: {summary['faults']} faults on {args.nproc} ranks over {args.transport} "
          f"(timeout {args.op_timeout:g} s, seed {args.seed}): {len(summary['breaches'])} breaches",
          flush=True)
    for b in summary["breaches"]:
        print(f"chaos: BREACH {b}", flush=True)
    if args.json:
        from .report import git_commit

        out = {"args": vars(args), "commit": git_commit(),
               "summary": summary, "trials": records}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 1 if summary["breaches"] else 0


if __name__ == "__main__":
    sys.exit(main())
