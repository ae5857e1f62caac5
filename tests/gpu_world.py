"""Many multi-rank test cases in one spawned world: the GPU check's runner.

Spawning a rank and importing torch costs seconds, NCCL's bootstrap more:
a world per test does not fit a few minutes of GPU time. Here ``size``
processes are spawned once and run the cases one after the other::

    parent (this module)                     rank r (spawned once per world)
    --------------------                     -------------------------------
    TCPStore server, a pipe      <-- 1.   client TCPStore (once), ("ready", r)
                                          for each case i:
                                      2.    barrier: case{i}/ready/<rank> keys
                                      3.    comm = pycomm.init(case i's kwargs,
                                              store=PrefixStore("case{i}"))
                                      4.    fn(comm, store, **kwargs); comm.close()
    case i ends when every rank  <-- 5.    ("done", r, i, status, traceback, s)
    reported; case i+1's deadline
    clock starts (the first case's:
    when every rank is ready)

Step 2 keeps the ranks in step: a case that fails on one rank (which moves
on) makes its peers fail or time out in the same case, never in the next.
A case still running at its deadline is *hung*: the parent asks the ranks
that did not finish for their Python stacks (faulthandler, SIGUSR1), kills
the world, records the case with those stacks and spawns a fresh world for
the remaining cases. A rank that dies (SIGSEGV, SIGABRT, os._exit) makes
the case *died*, with the exit status, and the world is replaced the same
way. ``budget_s`` bounds the whole run: a case that had started and is
still running when the budget ends is *hung* too (its stacks say where it
was), and the cases that could not start in time are *cut* (a status of
their own: not a skip, the run is incomplete). *skipped* is only what the
case itself declines (``min_gpus``, ``pytest.skip`` in its body).

``python -m tests.gpu_world --plan quick --size 2 --json OUT`` runs one world
of a plan (tests/gpu_plan.py) and writes the results as JSON after every
case (atomically: a reader never sees half a file); ``run_world`` is the
same from Python (tests/test_gpu.py runs one case per world through it).
Case bodies are module-level functions ``fn(comm, store, **kwargs)`` (they
travel to the ranks by pickling).
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, cast

_CTX = mp.get_context("spawn")
# cut: not run (or its world not started) because the run's budget ran out.
STATUSES = ("passed", "failed", "hung", "died", "skipped", "cut")
# Seconds granted to a fresh world before its first case's clock starts
# (spawn, import torch and pycomm, CUDA context).
DEFAULT_STARTUP_S = 60.0
# The ranks' store client waits this long at most (the parent's deadlines
# end a world much earlier).
_STORE_TIMEOUT = timedelta(seconds=900)


@dataclass(frozen=True)
class Case:
    """One test case: ``fn(comm, store, **kwargs)`` on every rank.

    Attributes:
        name: unique within a world (reported as ``world<size>/<name>``).
        fn: a module-level function (pickled to the ranks).
        kwargs: keyword arguments of ``fn``.
        init: ``pycomm.init`` keyword arguments over the world's defaults
            (transport, device, timeout=120): slice_bytes, check, timeout...
        deadline_s: the case is hung after this many seconds.
        close_may_fail: an error from ``comm.close()`` does not fail the case
            (the communicator was aborted on purpose).
        min_gpus: skipped (not run) with fewer visible GPUs.
    """

    name: str
    fn: Callable[..., Any]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    init: Mapping[str, Any] = field(default_factory=dict)
    deadline_s: float = 90.0
    close_may_fail: bool = False
    min_gpus: int = 0


@dataclass
class CaseResult:
    """What became of one case. ``status`` is one of STATUSES; ``detail``
    holds every failing rank's traceback, a hung rank's stack, the exit
    status of a dead rank, or a skip's reason; ``ranks`` each rank's own
    status (``"running"`` for one still inside the case when it was hung)."""

    name: str
    world: int
    status: str
    seconds: float
    detail: str = ""
    ranks: dict[int, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------ the ranks

def _die_with_parent() -> None:
    """SIGKILL this rank when the parent dies (Linux), so that an outer
    timeout killing the parent leaves no rank behind, even one stuck in NCCL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _skip_exception() -> type[BaseException] | None:
    """pytest.skip's exception (bodies may skip), None without pytest."""
    try:
        import pytest
    except ImportError:
        return None
    return pytest.skip.Exception


def _reset_torch_distributed() -> None:
    """Destroys a default process group a failed body left behind, so the
    next case can create its own."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort; the next case reports what is broken
            traceback.print_exc()


def _run_case(rank: int, world: int, store: Any, case: Case, init: Mapping[str, Any]) -> tuple[str, str]:
    """(status, detail) of one case on this rank: steps 3 and 4 of the diagram."""
    import pycomm

    skip = _skip_exception()
    try:
        comm = pycomm.init(rank=rank, world_size=world, store=store, key_prefix="comm",
                           set_default=False, **{**init, **case.init})
        try:
            case.fn(comm, store, **case.kwargs)
        finally:
            try:
                comm.close()
            except Exception:
                if not case.close_may_fail:
                    raise
        return "passed", ""
    except BaseException as e:  # noqa: BLE001 - every outcome goes back to the parent
        if skip is not None and isinstance(e, skip):
            return "skipped", str(e)
        return "failed", traceback.format_exc()
    finally:
        _reset_torch_distributed()


def _rank_main(rank: int, world: int, port: int, init: Mapping[str, Any], env: Mapping[str, str],
               cases: Sequence[tuple[int, Case]], events: Any, stack_file: str) -> None:
    """A rank of the world: the loop of the diagram over ``cases``, each
    step reported on ``events`` (this rank's pipe to the parent)."""
    _die_with_parent()
    os.environ.update(env)
    stacks = open(stack_file, "w")  # noqa: SIM115 - open for the process's lifetime
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # A fatal signal (SIGSEGV, SIGABRT, ...) prints every thread's Python
    # stack to stderr, the step's log: the "last words" a died case names.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    try:
        import torch.distributed as dist

        base = dist.TCPStore("127.0.0.1", port, world, False, timeout=_STORE_TIMEOUT)
    except BaseException:  # noqa: BLE001
        events.send(("error", rank, -1, "failed", traceback.format_exc(), 0.0))
        return
    events.send(("ready", rank, -1, "", "", 0.0))
    for index, case in cases:
        store = dist.PrefixStore(f"case{index}", base)
        store.set(f"ready/{rank}", "1")  # step 2
        store.wait([f"ready/{q}" for q in range(world)])
        start = time.monotonic()
        status, detail = _run_case(rank, world, store, case, init)
        events.send(("done", rank, index, status, detail, time.monotonic() - start))
    events.send(("exit", rank, -1, "", "", 0.0))


# ------------------------------------------------------------------ the parent

def _signal_name(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


class _World:
    """``size`` spawned ranks working through ``cases``, the store they share
    and a pipe from each (a pipe, not a queue: a message sent is in the
    pipe at once, so a rank that dies right after reporting a case has
    still reported it)."""

    def __init__(self, size: int, cases: Sequence[tuple[int, Case]], init: Mapping[str, Any],
                 env_for_rank: Callable[[int], Mapping[str, str]] | None, tmp: str) -> None:
        import torch.distributed as dist

        self.size = size
        self.store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=_STORE_TIMEOUT,
                                   wait_for_workers=False)
        self.stack_files = [os.path.join(tmp, f"stacks-{time.monotonic_ns()}-{r}.txt")
                            for r in range(size)]
        self.procs, self.conns = [], []
        for r in range(size):
            env = dict(env_for_rank(r)) if env_for_rank else {}
            parent, child = _CTX.Pipe(duplex=False)
            p = _CTX.Process(target=_rank_main, daemon=True,
                             args=(r, size, self.store.port, dict(init), env, list(cases),
                                   child, self.stack_files[r]))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self.live = list(self.conns)  # pipes not yet closed by their rank
        self.exited: set[int] = set()

    def poll(self, timeout: float) -> list[tuple[Any, ...]]:
        """The messages the ranks sent, waiting up to ``timeout`` for one."""
        out = []
        for ready in wait(self.live, timeout=timeout):
            conn = cast("Connection", ready)
            try:
                out.append(conn.recv())
            except (EOFError, OSError):  # the rank ended (or died mid-message)
                self.live.remove(conn)
        return out

    def dead(self) -> dict[int, int]:
        """rank -> exit code of ranks that ended without reporting their exit."""
        return {r: p.exitcode for r, p in enumerate(self.procs)
                if p.exitcode is not None and r not in self.exited}

    def stacks(self, ranks: Sequence[int]) -> str:
        """The Python stacks of ``ranks`` (asked with SIGUSR1), for a hang report."""
        for r in ranks:
            pid = self.procs[r].pid
            if pid is not None and self.procs[r].is_alive():
                os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)
        out = []
        for r in ranks:
            text = Path(self.stack_files[r]).read_text(errors="replace").strip()
            out.append(f"--- rank {r} stack ---\n{text or '(no stack: the rank did not answer)'}")
        return "\n".join(out)

    def kill(self, grace: float = 0.0) -> None:
        """Ends the ranks: after ``grace`` seconds to exit by themselves
        (a finished world), SIGKILL."""
        end = time.monotonic() + grace
        for p in self.procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        for conn in self.conns:
            conn.close()


def _finish(case: Case, world: int, per_rank: Mapping[int, tuple[str, str, float]],
            status: str | None = None, extra: str = "", seconds: float | None = None) -> CaseResult:
    """The CaseResult from each rank's (status, detail, seconds); ``status``
    overrides (hung, died) for a case that did not finish everywhere."""
    statuses = {r: s for r, (s, _, _) in per_rank.items()}
    if status is None:
        if "failed" in statuses.values():
            status = "failed"
        elif statuses and all(s == "skipped" for s in statuses.values()):
            status = "skipped"
        else:
            status = "passed"
    details = [f"--- rank {r} ---\n{d}" if s == "failed" else d
               for r, (s, d, _) in sorted(per_rank.items()) if d]
    if status == "skipped" and details:
        details = details[:1]  # the same reason on every rank
    ranks = {r: statuses.get(r, "running") for r in range(world)}
    took = seconds if seconds is not None else max((t for _, _, t in per_rank.values()), default=0.0)
    return CaseResult(case.name, world, status, round(took, 2),
                      "\n".join(details + ([extra] if extra else [])).strip(), ranks)


class _Broken(Exception):
    """The world never started (a rank could not import, unpickle or reach
    the store): every remaining case would fail the same way."""


def _watch(world: _World, todo: Sequence[tuple[int, Case]], stop_at: float, startup_s: float,
           record: Callable[[int, CaseResult], None]) -> bool:
    """Follows one world's events, recording each case as it ends, until
    every case of ``todo`` has ended (True) or the world must be replaced
    (False: a hang, a dead rank). Raises _Broken when the world did not start."""
    pos, clock = 0, time.monotonic() + startup_s  # todo[pos]'s deadline clock
    ready: set[int] = set()
    # case index -> rank -> (status, detail, seconds); nothing orders the
    # ranks' pipes, so a later case's message may come first.
    done: dict[int, dict[int, tuple[str, str, float]]] = {}
    while pos < len(todo):
        index, case = todo[pos]
        if len(done.get(index, {})) == world.size:
            record(index, _finish(case, world.size, done.pop(index)))
            pos, clock = pos + 1, time.monotonic()
            continue
        messages = world.poll(0.25)
        for kind, rank, i, status, detail, secs in messages:
            if kind == "ready":
                ready.add(rank)
                if len(ready) == world.size and pos == 0:
                    clock = time.monotonic()  # started: the first case's own clock
            elif kind == "error":
                raise _Broken(f"rank {rank} could not join the world:\n{detail}")
            elif kind == "exit":
                world.exited.add(rank)
            elif kind == "done":
                done.setdefault(i, {})[rank] = (status, detail, secs)
        if messages:
            continue  # read everything before judging deaths and deadlines
        now, dead = time.monotonic(), world.dead()
        if dead:
            why = "; ".join(f"rank {r} {_signal_name(c)}" for r, c in sorted(dead.items()))
            if len(ready) < world.size:
                raise _Broken(f"the world did not start: {why} (see the log for its traceback)")
            record(index, _finish(case, world.size, done.get(index, {}), "died",
                                  f"the world broke during this case: {why} (a dead rank's "
                                  "last words are in the step's log)"))
            return False
        if now < min(clock + case.deadline_s, stop_at):
            continue
        per_rank = done.get(index, {})
        running = [r for r in range(world.size) if r not in per_rank]
        started = pos > 0 or len(ready) == world.size
        if not started and now < clock + case.deadline_s:  # the budget ended the startup
            for i, c in todo[pos:]:
                record(i, CaseResult(c.name, world.size, "cut", 0.0,
                                     "not started: the run's time ran out while its world started"))
            return False
        if not started:
            raise _Broken(f"the world did not start within {startup_s:.0f} s: ranks "
                          f"{sorted(set(range(world.size)) - ready)} never reached the store")
        if now < clock + case.deadline_s:  # started, and still running when the budget ended
            why = (f"hung: ranks {running} still running when the run's time ran out, "
                   f"{max(now - clock, 0):.0f} s into this case (its deadline: {case.deadline_s:.0f} s)")
        else:
            why = (f"hung: ranks {running} did not finish within the case's deadline "
                   f"({case.deadline_s:.0f} s)")
        record(index, _finish(case, world.size, per_rank, "hung", f"{why}\n{world.stacks(running)}",
                              seconds=now - clock))
        return False
    return True


def run_world(size: int, cases: Sequence[Case], *, transport: str, device: str,
              env_for_rank: Callable[[int], Mapping[str, str]] | None = None,
              budget_s: float | None = None, startup_s: float = DEFAULT_STARTUP_S,
              gpus: int = 0, on_result: Callable[[CaseResult], None] | None = None,
              comm_timeout: float = 120.0) -> list[CaseResult]:
    """Runs ``cases`` in order on ``size`` ranks (see the module docstring).

    Args:
        transport, device, comm_timeout: every case's ``pycomm.init`` defaults.
        env_for_rank: environment variables of rank r's process (NCCL_HOSTID...).
        budget_s: the whole run's time; cases that cannot start in it are
            ``cut``, a case still running when it ends is ``hung``.
        gpus: visible GPUs, for ``Case.min_gpus``.
        on_result: called with each result as it comes (progress, saving).

    Returns:
        One CaseResult per case, in the order of ``cases``.
    """
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"case names must be unique in a world: {names}")
    report = on_result or (lambda res: None)
    stop_at = time.monotonic() + (budget_s if budget_s is not None else float("inf"))
    init = {"transport": transport, "device": device, "timeout": comm_timeout}
    results: dict[int, CaseResult] = {}

    def record(i: int, res: CaseResult) -> None:
        results[i] = res
        report(res)

    for i, c in enumerate(cases):
        if c.min_gpus > gpus:
            record(i, CaseResult(c.name, size, "skipped", 0.0,
                                 f"needs {c.min_gpus} GPUs, this machine has {gpus}"))
    with tempfile.TemporaryDirectory(prefix="gpu_world-") as tmp:
        while True:
            todo = [(i, c) for i, c in enumerate(cases) if i not in results]
            if not todo:
                break
            if time.monotonic() + 5 > stop_at:
                for i, c in todo:
                    record(i, CaseResult(c.name, size, "cut", 0.0,
                                         "not started: the run's time ran out"))
                break
            world = _World(size, todo, init, env_for_rank, tmp)
            try:
                if _watch(world, todo, stop_at, startup_s, record):
                    world.kill(grace=10.0)  # finished: the ranks are exiting
            except _Broken as e:
                world.kill()
                for i, c in todo:
                    if i not in results:
                        record(i, CaseResult(c.name, size, "failed", 0.0, str(e)))
            finally:
                world.kill()
    return [results[i] for i in range(len(cases))]


# ------------------------------------------------------------------ command line

def gpu_rank_env(rank: int) -> dict[str, str]:
    """Ranks sharing one GPU: NCCL refuses two ranks of one host on one GPU,
    so each rank claims a host of its own and NCCL talks over loopback
    sockets (PYCOMM_GPU_TEST_MODE=multi: NCCL_MULTI_RANK_GPU_ENABLE=1
    instead, NCCL >= 2.30)."""
    env = {"NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
           "NCCL_IB_DISABLE": os.environ.get("NCCL_IB_DISABLE", "1"), "LOCAL_RANK": "0"}
    if os.environ.get("PYCOMM_GPU_TEST_MODE", "hostid") == "multi":
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    else:
        env["NCCL_HOSTID"] = f"host{rank}"
    return env


def write_json(path: Path, data: Any) -> None:
    """Writes ``data`` as JSON to ``path`` atomically (a temporary file
    beside it, then a rename): a reader sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def counts(results: Sequence[CaseResult]) -> dict[str, int]:
    """How many results have each status."""
    return {s: sum(r.status == s for r in results) for s in STATUSES}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one world of a plan; exit status 0 when nothing failed, hung or
    died (cases cut for time are in the JSON: the driver counts them)."""
    from tests.gpu_plan import PLANS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, choices=sorted(PLANS))
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--json", required=True, help="results, rewritten after every case")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole world")
    ap.add_argument("--transport", default="nccl")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--gpus", type=int, default=None, help="default: torch.cuda.device_count()")
    ap.add_argument("--cases", default="", help="comma-separated names: only these cases")
    args = ap.parse_args(argv)
    cases = PLANS[args.plan].get(args.size)
    if not cases:
        ap.error(f"plan {args.plan} has no world of size {args.size}")
    if args.cases:
        wanted = args.cases.split(",")
        unknown = set(wanted) - {c.name for c in cases}
        if unknown:
            ap.error(f"no case {sorted(unknown)} in world {args.size} of plan {args.plan}")
        cases = [c for c in cases if c.name in wanted]
    if args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count()
    done: list[CaseResult] = []
    out = Path(args.json)

    def on_result(res: CaseResult) -> None:
        done.append(res)
        print(f"gpu_world: world{res.world}/{res.name}: {res.status} ({res.seconds:.1f} s)", flush=True)
        if res.status in ("failed", "hung", "died"):
            print(res.detail, flush=True)
        write_json(out, [r.to_json() for r in done])

    cuda = args.device.startswith("cuda")
    results = run_world(args.size, cases, transport=args.transport, device=args.device,
                        env_for_rank=gpu_rank_env if cuda else None, budget_s=args.budget,
                        gpus=args.gpus, on_result=on_result)
    write_json(out, [r.to_json() for r in results])
    n = counts(results)
    print(f"gpu_world: world{args.size} ({args.plan}): " + ", ".join(f"{v} {k}" for k, v in n.items()),
          flush=True)
    return 1 if n["failed"] + n["hung"] + n["died"] else 0


if __name__ == "__main__":
    # Through the importable module, so that the ranks (spawned) and the plan
    # (tests/gpu_plan.py) see the same classes and functions as this process.
    from tests.gpu_world import main as _main

    sys.exit(_main())
