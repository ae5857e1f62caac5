"""``python -m pycomm.bench chaos``: faults injected into soak traffic.

    python -m pycomm.bench chaos --nproc 3 --transport shm --faults 20 --op-timeout 5

Each trial starts a fresh job of ``--nproc`` ranks running the soak's mixed
traffic (soak.py, every result checked, groups made mid-program but in
SIGSTOP trials on gloo) with the communicator's timeout set to
``--op-timeout``, waits until every rank is in its traffic,
waits a random moment more, and injects one fault into one random rank:

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
killed and counted as hung); nothing of the job is left in /dev/shm.

Three faults are of the job's surroundings, not of a rank; the job runs a
fixed program (``--steps``) through them:

    slow      one rank gets a tenth of a CPU (stopped 90 ms of every 100,
              a CPU-starved rank) until the job ends
    store     the store's server (a process of its own here) is killed
    shm_full  /dev/shm (a tmpfs of the job's own, in a mount namespace:
              root only) is filled to the last byte, mid-program or
              before the job starts (shm_full trials alternate)

Their rule: every rank finishes its program with every result verified, or
raises ``CommError`` (recorded: a group made after the store died raises
that the store is unreachable, and its peers that it died), within the
trial's limit; none hangs, none exits without one or the other, nothing
is left in /dev/shm; a slow rank is not a dead one, so under ``slow`` no
rank may raise at all. With /dev/shm full before the start, every rank's
``pycomm.init`` must fail with an error that says /dev/shm has no space.

The summary gives, per fault kind, the trials, the survivors that raised
(and the ranks that finished), the slowest time from fault to error, and
every breach of the rule; the exit status is 1 if there was one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["FAULTS", "main"]

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP,
           "exit": signal.SIGUSR1}
ENVIRONMENT = ("slow", "store", "shm_full")
FAULTS = (*SIGNALS, *ENVIRONMENT)
GRACE_S = 5.0  # the rule: an error within the timeout + this
HUNG_S = 30.0  # past the timeout + this a survivor is killed and counted as hung
ENV_STEPS = 150  # the program an environment trial runs to its end
ENV_LIMIT_S = 150.0  # ... within this after the fault (a slow rank runs 10x slower)
SHM_SIZE_MB = 512  # the job's own /dev/shm under shm_full
SHM_HEADROOM_MB = 160  # ... of which the job gets this (a pad fills the rest at its start),
#                        so that the fault's fill is quick and lands mid-program


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
    if kind in ENVIRONMENT:
        return environment_trial(index, kind, victim, delay, args)
    from .launch import start_script
    from .resources import shm_segments

    directory = Path(tempfile.mkdtemp(prefix="pycomm-chaos-"))
    argv = _soak_argv(index, directory, args, groups=kind != "stop" or args.transport != "gloo")
    store, procs = start_script(argv, args.nproc, timeout=args.op_timeout + HUNG_S + 120,
                                env=_rank_env())
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
        os.kill(procs[victim].pid, SIGNALS[kind])
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


def _soak_argv(index: int, directory: Path, args: argparse.Namespace, *,
               groups: bool = True) -> list[str]:
    """A trial's soak; ``groups=False`` leaves out the steps that make a
    group. A group's rendezvous is bounded by the group's timeout (the
    communicator's, --op-timeout) and names a member whose process is gone
    at once (liveness watch), one stopped at that timeout. But gloo's own
    connect to a member stopped inside it waits out gloo's connect timeout
    (25 s seen, chaos_stop_groups_gloo_3ranks_6), outside the signal rule:
    stop trials on gloo leave groups out."""
    return ["-m", "pycomm.bench", "soak", "--transport", args.transport,
            "--seed", str(args.seed + index), "--max-bytes", args.max_bytes,
            "--op-timeout", str(args.op_timeout), "--report", "1e9", "--chaos", str(directory),
            *([] if groups else ["--leave-out", "new_group"])]


def _rank_env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))}


# ------------------------------------------------ faults of the surroundings

_STORE_SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, int(sys.argv[1]), True, wait_for_workers=False,
                      timeout=timedelta(seconds=float(sys.argv[2])))
print(store.port, flush=True)
time.sleep(1e9)
"""


def _store_server(nproc: int, timeout: float) -> tuple[subprocess.Popen, int]:
    """A TCPStore served by a process of its own (so it can be killed): (it, its port)."""
    proc = subprocess.Popen([sys.executable, "-c", _STORE_SERVER, str(nproc), str(timeout)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.strip().isdigit():
        proc.kill()
        raise RuntimeError(f"the store's server did not start (exit {proc.wait()})")
    return proc, int(line)


def _private_shm_reason() -> str | None:
    """What a private /dev/shm lacks here (None: nothing)."""
    if os.geteuid() != 0:
        return "root"
    missing = [t for t in ("unshare", "nsenter") if shutil.which(t) is None]
    return " and ".join(f"the `{t}` command" for t in missing) or None


def _private_shm() -> subprocess.Popen:
    """A process holding a mount namespace whose /dev/shm is a tmpfs of
    SHM_SIZE_MB; ``nsenter --mount=/proc/<its pid>/ns/mnt`` runs a command there."""
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
         f"mount -t tmpfs -o size={SHM_SIZE_MB}m pycomm-chaos /dev/shm && echo ready && exec sleep 1000000"],
        stdout=subprocess.PIPE, text=True)
    if (proc.stdout.readline() if proc.stdout else "").strip() != "ready":
        proc.kill()
        raise RuntimeError(f"no private /dev/shm (exit {proc.wait()}): needs root and unshare")
    return proc


def _throttle(proc: subprocess.Popen, stop: threading.Event) -> None:
    """Gives ``proc`` a tenth of a CPU until ``stop`` or its end: stopped
    90 ms of every 100 (each stall far below any timeout)."""
    try:
        while not stop.is_set() and proc.poll() is None:
            os.kill(proc.pid, signal.SIGSTOP)
            stop.wait(0.09)
            os.kill(proc.pid, signal.SIGCONT)
            stop.wait(0.01)
    except ProcessLookupError:
        pass
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)


def environment_trial(index: int, kind: str, victim: int, delay: float,
                      args: argparse.Namespace) -> dict[str, Any]:
    """One job running ``ENV_STEPS`` steps, one fault of its surroundings
    (``slow`` throttles rank ``victim``): the record of what every rank did."""
    from .launch import start_script
    from .resources import shm_segments

    directory = Path(tempfile.mkdtemp(prefix="pycomm-chaos-"))
    argv = _soak_argv(index, directory, args) + ["--steps", str(ENV_STEPS)]
    record: dict[str, Any] = {"trial": index, "fault": kind,
                              "victim": victim if kind == "slow" else None,
                              "delay_s": round(delay, 3)}
    server = holder = None
    procs: list[subprocess.Popen] = []
    stop = threading.Event()
    try:
        port, prefix = None, []
        if kind == "store":
            server, port = _store_server(args.nproc, args.op_timeout + HUNG_S + 120)
        if kind == "shm_full":
            holder = _private_shm()
            prefix = ["nsenter", f"--mount=/proc/{holder.pid}/ns/mnt", "--"]
            earlier = sum(args.kinds[j % len(args.kinds)] == kind for j in range(index))
            record["when"] = "before" if earlier % 2 else "during"  # alternating
            if record["when"] == "before":
                _fill(prefix)
                return _full_before_start(record, argv, prefix, args)
            pad = SHM_SIZE_MB - SHM_HEADROOM_MB
            subprocess.run([*prefix, "sh", "-c", f"head -c {pad}M /dev/zero > /dev/shm/chaos-pad"],
                           check=True)
        store, procs = start_script(argv, args.nproc, timeout=args.op_timeout + HUNG_S + 120,
                                    env=_rank_env(), store_port=port, prefix=prefix)
        record["pids"] = [p.pid for p in procs]
        why = _wait_ready(directory, procs, 120.0)
        if why is not None:
            record["breaches"] = [f"setup: {why}"]
            return record
        time.sleep(delay)
        fault_at = time.time()
        if kind == "slow":
            threading.Thread(target=_throttle, args=(procs[victim], stop), daemon=True).start()
        elif kind == "store" and server is not None:
            server.kill()
        elif kind == "shm_full":
            _fill(prefix)
        hung = _finish(procs, -1, time.monotonic() + ENV_LIMIT_S)
        stop.set()
        record["ended_after_s"] = round(time.time() - fault_at, 2)  # every rank out
        record.update(_survival(directory, procs, kind, fault_at, hung))
        record["shm_left"] = _private_segments(prefix) if prefix else shm_segments(record["pids"])
        if record["shm_left"]:
            record["breaches"].append(f"/dev/shm segments left: {record['shm_left']}")
    finally:
        stop.set()
        _end_job(procs, [h for h in (server, holder) if h is not None])
        shutil.rmtree(directory, ignore_errors=True)
    return record


def _end_job(procs: list[subprocess.Popen], helpers: list[subprocess.Popen]) -> None:
    """Kills what is left of an environment trial: its ranks (continued
    first, should the throttle have left one stopped) and its helpers (the
    store's server, the holder of the private /dev/shm); reaps them all."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.communicate()
    for helper in helpers:
        if helper.poll() is None:
            helper.kill()
        helper.communicate()


def _fill(prefix: list[str]) -> None:
    """Fills the /dev/shm that ``prefix`` enters: cat stops at ENOSPC."""
    subprocess.run([*prefix, "sh", "-c", "cat /dev/zero > /dev/shm/chaos-fill"], capture_output=True)


def _private_segments(prefix: list[str]) -> list[str]:
    listing = subprocess.run([*prefix, "ls", "/dev/shm"], capture_output=True, text=True)
    return [n for n in listing.stdout.split() if n.startswith("pycomm-")]


def _full_before_start(record: dict[str, Any], argv: list[str], prefix: list[str],
                       args: argparse.Namespace) -> dict[str, Any]:
    """/dev/shm already full: every rank's init must fail, saying so."""
    from .launch import start_script

    t0 = time.time()
    store, procs = start_script(argv, args.nproc, timeout=args.op_timeout + HUNG_S + 120,
                                env=_rank_env(), prefix=prefix)
    hung = _finish(procs, -1, time.monotonic() + ENV_LIMIT_S)
    record.update(pids=[p.pid for p in procs], finished=0, survivors=[],
                  breaches=[f"{h} hung (killed {ENV_LIMIT_S:g} s after the start)" for h in hung])
    for r, p in enumerate(procs):
        err = (p.stderr.read() if p.stderr else "").strip().splitlines()
        last = err[-1] if err else ""
        if p.returncode == 0:
            record["breaches"].append(f"rank {r} started on a full /dev/shm")
        elif f"rank {r}" not in hung:
            kind = re.search(r"(\w+(?:Error|Exception))\b", last)
            record["survivors"].append({"rank": r, "after_s": round(time.time() - t0, 3),
                                        "type": kind.group(1) if kind else "?", "names_victim": False,
                                        "message": last[:300]})
            if "/dev/shm" not in last or "space" not in last.lower():
                record["breaches"].append(f"rank {r}'s error does not say /dev/shm is full: "
                                          f"{last[:200]!r}")
    del store
    record["shm_left"] = _private_segments(prefix)
    if record["shm_left"]:
        record["breaches"].append(f"/dev/shm segments left: {record['shm_left']}")
    return record


def _survival(directory: Path, procs: list[subprocess.Popen], kind: str, fault_at: float,
              hung: list[str]) -> dict[str, Any]:
    """Each rank's end against the environment rule: finished verified, or raised."""
    survivors, finished = [], 0
    breaches = [f"{h} hung (killed {ENV_LIMIT_S:g} s after the fault)" for h in hung]
    for r, p in enumerate(procs):
        done, error = directory / f"rank{r}.done", directory / f"rank{r}.error"
        if done.exists():
            counts = json.loads(done.read_text())
            finished += 1
            if counts.get("wrong"):
                breaches.append(f"rank {r} had {counts['wrong']} wrong results: "
                                f"{counts.get('first_wrong')}")
        elif error.exists():
            err = json.loads(error.read_text())
            survivors.append({"rank": r, "after_s": round(err["t"] - fault_at, 3),
                              "type": err["type"], "names_victim": False,
                              "message": err["message"][:300]})
            if kind == "slow":
                breaches.append(f"rank {r} raised under a slow peer: {err['type']}: "
                                f"{err['message'][:200]}")
            elif err["type"] != "CommError":  # the documented error, the cause in its message
                breaches.append(f"rank {r} raised {err['type']}, not CommError: "
                                f"{err['message'][:200]}")
        elif f"rank {r}" not in hung:
            breaches.append(f"rank {r} exited {p.returncode} without finishing or raising")
    return {"finished": finished, "survivors": survivors, "breaches": breaches}


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


def _what(record: dict[str, Any]) -> str:
    """"kill rank 2", "store"."""
    victim = record.get("victim")
    return record["fault"] + ("" if victim is None else f" rank {victim}")


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per fault kind: trials, survivors that raised, slowest and median time
    from fault to error, messages naming the faulty rank; all breaches."""
    kinds: dict[str, Any] = {}
    for kind in dict.fromkeys(r["fault"] for r in records):
        mine = [r for r in records if r["fault"] == kind]
        after = [s["after_s"] for r in mine for s in r.get("survivors", [])]
        kinds[kind] = {"trials": len(mine), "survivors_raised": len(after),
                       "ranks_finished": sum(r.get("finished", 0) for r in mine),
                       "max_s": max(after, default=None),
                       "median_s": statistics.median(after) if after else None,
                       "names_victim": sum(s["names_victim"] for r in mine
                                           for s in r.get("survivors", [])),
                       "error_types": sorted({s["type"] for r in mine
                                              for s in r.get("survivors", [])})}
    breaches = [f"trial {r['trial']} ({_what(r)}): {b}" for r in records for b in r.get("breaches", [])]
    return {"faults": len(records), "by_fault": kinds, "breaches": breaches}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pycomm.bench chaos",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=3, help="ranks per job (2-6)")
    p.add_argument("--transport", default="shm", choices=("shm", "gloo"))
    p.add_argument("--faults", type=int, default=20, help="trials, one fault each")
    p.add_argument("--kinds", default=None,
                   help=f"from {','.join(FAULTS)} (default: all; shm_full only as root)")
    p.add_argument("--op-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="the communicator's timeout in every job")
    p.add_argument("--max-bytes", default="256K", help="the soak's largest tensor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write every trial and the summary")
    args = p.parse_args(argv)
    if args.kinds is None:  # shm_full where it applies: the shm transport, a private /dev/shm
        args.kinds = ",".join(k for k in FAULTS if k != "shm_full" or (
            args.transport == "shm" and _private_shm_reason() is None))
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(args.kinds) - set(FAULTS))
    if unknown or not args.kinds:
        p.error(f"--kinds: choose from {','.join(FAULTS)}, got {unknown or 'none'}")
    if not 2 <= args.nproc <= 6:
        p.error("--nproc must be 2 to 6 (a fault needs a survivor; the soak's inputs stay exact to 6)")
    if args.faults < 1 or args.op_timeout <= 0:
        p.error("--faults must be >= 1 and --op-timeout > 0")
    if "shm_full" in args.kinds and args.transport != "shm":
        p.error("--kinds shm_full needs --transport shm (gloo keeps nothing in /dev/shm)")
    if "shm_full" in args.kinds and _private_shm_reason():
        p.error(f"--kinds shm_full needs {_private_shm_reason()} (a private /dev/shm); "
                "leave it out of --kinds")
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
        finished = f", {rec.get('finished', 0)} ranks finished" if kind in ENVIRONMENT else ""
        print(f"chaos: trial {i}: {_what(rec)} after {rec['delay_s']:.2f} s: survivors "
              f"raised after [{times}] s{finished}"
              + "".join(f"; BREACH {b}" for b in rec.get("breaches", [])), flush=True)
    summary = summarize(records)
    for kind, k in summary["by_fault"].items():
        print(f"chaos: {kind}: {k['trials']} trials, {k['survivors_raised']} survivors raised, "
              f"{k['ranks_finished']} ranks finished their program "
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
