"""Multi-process test harness: real ranks, a per-call timeout, tracebacks back.

Two ways to run code on N ranks:

* ``run_ranks(fn, world_size, transport, *args)``: ranks come from a cached pool
  of processes that already hold a communicator (pools are reused across
  tests: a rank's start and its communicator's cost tenths of a second).
  ``fn(comm, *args)`` runs on every rank; its return values come back as a
  list indexed by rank. A failure or timeout kills the pool (its
  communicator may be aborted) and raises with every child's traceback.
* ``spawn_ranks(fn, world_size, *args)``: fresh processes that build their own
  communicator (fault tests: they kill ranks). ``fn(rank, world_size, port,
  *args)``; returns per-rank results, or the exitcode where a rank died.

Either way a deadlock fails the calling test after ``timeout`` seconds instead
of hanging CI.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

# Ranks are forked from a server process that has imported torch already:
# importing it costs ~2 s of CPU a process, the larger part of a short
# multi-rank test on 2 cores (test_torch_suite adds itself, and with it
# pycomm, whose import reads no environment variable). The server starts once
# per test session, so each rank is handed what a spawned one would inherit
# at its start: the test process's environment and its stdout / stderr
# (pytest's capture of the current test).
_CTX = mp.get_context("forkserver")
_PRELOAD = ["torch", "torch.distributed"]
_CTX.set_forkserver_preload(_PRELOAD)


def forkserver_preload(*modules: str) -> None:
    """Adds ``modules`` to what the forkserver (one per process, shared by
    every user of multiprocessing's forkserver) imports when it starts: at
    the first rank of the session, so call this at a module's import."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)
    _CTX.set_forkserver_preload(_PRELOAD)


class _Inherited:
    """The test process's environment and stdio at a rank's start, pickled
    into the rank: unpickling makes the stdio the rank's own and gives back
    the environment (InheritingProcess.run installs it)."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)

    def __reduce__(self) -> tuple:
        # DupFd hands the descriptors to the forkserver's child (as
        # multiprocessing does for a Connection); only while pickling for it.
        from multiprocessing import reduction

        return _Inherited._received, (self.environ, reduction.DupFd(1), reduction.DupFd(2))

    @staticmethod
    def _received(environ: dict[str, str], out: Any, err: Any) -> dict[str, str]:
        for fd, dup in ((1, out), (2, err)):
            got = dup.detach()
            os.dup2(got, fd)
            os.close(got)
        return environ


DEFAULT_TIMEOUT = float(os.environ.get("PYCOMM_TEST_TIMEOUT", "120"))
# The communicator's own timeout in tests: a wedged collective errors out
# well before the harness gives up.
COMM_TIMEOUT = timedelta(seconds=float(os.environ.get("PYCOMM_TEST_COMM_TIMEOUT", "60")))


class RankFailure(AssertionError):
    pass


def master_store(world_size: int) -> dist.TCPStore:
    """A TCPStore server owned by the test process on a free port (no race:
    the OS picks the port and the children connect as clients)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timedelta(seconds=60),
                         wait_for_workers=False)


def client_store(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=60))


class InheritingProcess(_CTX.Process):  # type: ignore[name-defined,misc]
    """A rank forked by the server with the test process's environment as of
    its creation and its stdio as of its start (see _CTX)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # An _Inherited here; in the rank, once unpickled, the environment.
        self._inherited: Any = _Inherited()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._inherited)
        # Last words into the test's captured stderr: every thread's Python
        # stack on a fatal signal, and on SIGUSR1 (_ask_for_stacks, a hang).
        faulthandler.enable(all_threads=True)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        super().run()


def _ask_for_stacks(procs: list[Any], ranks: Any) -> None:
    """Hung ``ranks`` print their Python stacks to the test's stderr (shown
    with the failure) before they are killed, one rank at a time under a
    label; where gdb is installed, their threads' native stacks follow (a
    wait inside gloo or pycomm's C++), all ranks' within 30 s."""
    asked = [(r, procs[r]) for r in sorted(ranks) if procs[r].is_alive()]
    for r, p in asked:
        print(f"--- rank {r} (pid {p.pid}), Python stacks ---", file=sys.stderr, flush=True)
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:  # it ended meanwhile
            continue
        time.sleep(0.5)  # faulthandler writes from the signal handler
    gdb = shutil.which("gdb")
    if not asked or gdb is None:
        return
    # Attached all at once, under one deadline: a hang report, not a wait.
    runs = [(r, p.pid, subprocess.Popen(
        [gdb, "-p", str(p.pid), "-batch", "-nx", "-ex", "thread apply all bt 40"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) for r, p in asked]
    deadline = time.monotonic() + 30
    for r, pid, run in runs:
        try:
            out, err = run.communicate(timeout=max(0.1, deadline - time.monotonic()))
            stacks = _short_backtrace(out) or f"(no frames; gdb said: {err.strip()[-300:]})"
        except subprocess.TimeoutExpired:
            run.kill()
            run.communicate()
            stacks = "(gdb did not answer within 30 s)"
        print(f"--- rank {r} (pid {pid}), native stacks ---\n{stacks}", file=sys.stderr)


def _short_backtrace(bt: str) -> str:
    """gdb's backtrace, a line per frame ("#3 fn at file"), without the
    interpreter's own frames (the Python stack above says where those were)."""
    out = []
    for line in bt.splitlines():
        if line.startswith("Thread "):
            out.append(line)
            continue
        m = re.match(r"#(\d+)\s+(?:0x[0-9a-f]+ in )?(.+?) \(.*\) (?:at|from) (\S+)$", line)
        if m and not re.match(r"(\./)?(Objects|Python|Modules|Include|Parser)/", m[3]):
            out.append(f"  #{m[1]} {m[2]} at {m[3]}")
    return "\n".join(out[:400])


def _start(target: Callable[..., None], *args: Any) -> Any:
    """Starts a daemon rank running ``target(*args)``; returns the process."""
    p = InheritingProcess(target=target, args=args, daemon=True)
    p.start()
    return p


def _pool_child(rank: int, world_size: int, port: int, transport: str, conn: Any) -> None:
    try:
        import pycomm

        store = client_store(port, world_size)
        comm = pycomm.init(rank=rank, world_size=world_size, store=store, transport=transport,
                           timeout=COMM_TIMEOUT)
        conn.send(("ready", comm.transport))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            comm.close()
            conn.send(("closed", None))
            return
        fn, args = msg
        try:
            conn.send(("ok", fn(comm, *args)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))


class RankPool:
    """world_size spawned processes, each holding a communicator."""

    def __init__(self, world_size: int, transport: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.world_size = world_size
        self.transport = transport
        self._store = master_store(world_size)
        self._conns = []
        self._procs = []
        for r in range(world_size):
            parent, child = _CTX.Pipe()
            p = _start(_pool_child, r, world_size, self._store.port, transport, child)
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._collect("init", timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        errors: list[str] = []
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = mp.connection.wait([self._conns[r] for r in pending], timeout=left)
            for c in ready:
                r = self._conns.index(c)
                pending.discard(r)
                try:
                    status, value = c.recv()
                except EOFError:
                    errors.append(f"rank {r} died (exitcode {self._procs[r].exitcode})")
                    continue
                if status == "err":
                    errors.append(f"rank {r} raised:\n{value}")
                else:
                    results[r] = value
        if pending:
            _ask_for_stacks(self._procs, pending)
            errors.append(f"ranks {sorted(pending)} did not finish {what} within {timeout:.0f} s "
                          "(deadlock? their stacks are in the captured stderr)")
        if errors:
            self.kill()
            raise RankFailure(f"{what} failed on {self.world_size} ranks "
                              f"({self.transport}):\n" + "\n".join(errors))
        return results

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
        for c in self._conns:
            c.send((fn, args))
        return self._collect(getattr(fn, "__name__", "fn"), timeout)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        try:
            for c in self._conns:
                c.send(None)
            self._collect("close", 30)
        except Exception:
            pass
        self.kill()

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        self._procs = [p for p in self._procs if p.is_alive()]


_pools: "OrderedDict[tuple[int, str], RankPool]" = OrderedDict()
_MAX_POOLS = 3


def run_ranks(fn: Callable[..., Any], world_size: int, transport: str, *args: Any,
              timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    key = (world_size, transport)
    pool = _pools.pop(key, None)
    if pool is None or not pool.alive():
        while len(_pools) >= _MAX_POOLS:
            _pools.popitem(last=False)[1].close()
        pool = RankPool(world_size, transport)
    try:
        results = pool.run(fn, *args, timeout=timeout)
    except BaseException:
        pool.kill()
        raise
    _pools[key] = pool
    return results


def close_pools() -> None:
    while _pools:
        _pools.popitem()[1].close()


def _spawn_child(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple,
                 conn: Any) -> None:
    try:
        conn.send(("ok", fn(rank, world_size, port, *args)))
    except BaseException:
        conn.send(("err", traceback.format_exc()))


def spawn_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
                timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """Fresh processes; a rank that dies yields ("died", exitcode) in its slot."""
    store = master_store(world_size)
    conns, procs = [], []
    for r in range(world_size):
        parent, child = _CTX.Pipe()
        p = _start(_spawn_child, fn, r, world_size, store.port, args, child)
        child.close()
        conns.append(parent)
        procs.append(p)
    results: list[Any] = [None] * world_size
    errors = []
    deadline = time.monotonic() + timeout
    pending = set(range(world_size))
    while pending and time.monotonic() < deadline:
        ready = mp.connection.wait([conns[r] for r in pending],
                                   timeout=max(0.0, deadline - time.monotonic()))
        for c in ready:
            r = conns.index(c)
            pending.discard(r)
            try:
                status, value = c.recv()
            except EOFError:
                procs[r].join(timeout=5)
                results[r] = ("died", procs[r].exitcode)
                continue
            if status == "err":
                errors.append(f"rank {r} raised:\n{value}")
            results[r] = value
    if pending:
        _ask_for_stacks(procs, pending)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
    if pending:
        errors.append(f"ranks {sorted(pending)} did not finish within {timeout:.0f} s "
                      "(deadlock? their stacks are in the captured stderr)")
    if errors:
        # A peer that died is the likely cause of another's error or hang.
        errors += [f"rank {r} died (exitcode {res[1]})" for r, res in enumerate(results)
                   if isinstance(res, tuple) and res[:1] == ("died",)]
        raise RankFailure("\n".join(errors))
    return results


def assert_survivors_raised(results: list[Any], victim: int, within: float = 10.0) -> None:
    """For a spawn_ranks run in which rank ``victim`` killed itself during
    shm collectives: every other rank returned ("raised", message, seconds,
    rank 0's pid) with a message that says a peer died, within ``within``
    seconds, and nothing of the communicator (named after rank 0's pid) is
    left in /dev/shm."""
    for r, out in enumerate(results):
        if r == victim:
            continue
        status, msg, elapsed, pid0 = out
        assert status == "raised" and "died" in msg, out
        assert elapsed < within, f"rank {r} took {elapsed:.1f} s to notice"
        left = [f for f in os.listdir("/dev/shm") if f.startswith(f"pycomm-{pid0}-")]
        assert left == [], left


# ------------------------------------------------------------ fault trials

def fork_trials(rank: int, world_size: int, port: int, trial_fn: Callable[..., Any],
                trials: int, trial_timeout: float, *args: Any) -> list[dict]:
    """Runs ``trials`` fault trials from inside a spawn_ranks rank (the host).

    Spawning a rank costs seconds (importing torch); a trial in which a rank
    kills itself needs fresh processes. So each host forks one child per trial
    (the host itself never creates a communicator or thread, which keeps fork
    safe); the child connects to the test's store under a per-trial prefix,
    runs ``trial_fn(rank, world_size, store, trial, *args)``, sends back its
    result and leaves with ``os._exit``. A child that is still alive after
    ``trial_timeout`` seconds is SIGKILLed and reported as hung, so no process
    outlives the trial. Returns one dict per trial: ``pid``, and either
    ``result`` (what trial_fn returned), ``died`` (the signal or exit status
    of a child that ended without a result: the victim) or ``hung``.
    """
    import pickle
    import select

    out = []
    for trial in range(trials):
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the trial rank
            os.close(rfd)
            code = 0
            try:
                store = dist.PrefixStore(f"trial{trial}", client_store(port, world_size))
                payload = ("ok", trial_fn(rank, world_size, store, trial, *args))
            except BaseException:
                payload = ("err", traceback.format_exc())
                code = 1
            try:
                data = pickle.dumps(payload)
                while data:
                    data = data[os.write(wfd, data):]
            finally:
                os._exit(code)
        os.close(wfd)
        chunks, deadline, hung = [], time.monotonic() + trial_timeout, False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                hung = True
                break
            ready, _, _ = select.select([rfd], [], [], left)
            if ready:
                b = os.read(rfd, 1 << 16)
                if not b:
                    break
                chunks.append(b)
        os.close(rfd)
        if hung:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)  # reaps: nothing left behind
        rec: dict = {"trial": trial, "pid": pid}
        if hung:
            rec["hung"] = True
        elif chunks:
            status_, value = pickle.loads(b"".join(chunks))
            if status_ == "err":
                raise RankFailure(f"rank {rank}, trial {trial} raised:\n{value}")
            rec["result"] = value
        else:
            rec["died"] = (-os.WTERMSIG(status) if os.WIFSIGNALED(status)
                           else os.WEXITSTATUS(status))
        out.append(rec)
    return out


def _fork_host(rank: int, world_size: int, port: int, trial_fn: Callable[..., Any], trials: int,
               trial_timeout: float, args: tuple) -> list[dict]:
    return fork_trials(rank, world_size, port, trial_fn, trials, trial_timeout, *args)


def run_fault_trials(trial_fn: Callable[..., Any], world_size: int, trials: int, *args: Any,
                     trial_timeout: float = 60.0) -> list[list[dict]]:
    """``spawn_ranks`` hosts that each run ``fork_trials``; returns
    ``[trial][rank] -> record`` (see fork_trials)."""
    per_rank = spawn_ranks(_fork_host, world_size, trial_fn, trials, trial_timeout, args,
                           timeout=trials * (trial_timeout + 5) + 120)
    return [[per_rank[r][t] for r in range(world_size)] for t in range(trials)]


# ------------------------------------------------------------ torchrun

def run_torchrun(script: str, nproc: int, *args: str, timeout: float = 180,
                 max_restarts: int | None = None) -> "subprocess.CompletedProcess[str]":
    """Runs ``script`` (a path relative to the checkout) with ``args`` under
    ``torchrun --nproc-per-node nproc`` on a free port, with this checkout on
    PYTHONPATH and one OpenMP thread per rank; returns the finished process
    (the caller checks returncode and stdout). ``max_restarts``: an elastic
    job (``--max-restarts N --rdzv-backend c10d``) instead of the static
    rendezvous."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as sk:  # torchrun's rendezvous needs a concrete port
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    if max_restarts is None:
        launch = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    else:
        # The agent SIGTERMs the survivors at its first look after a worker
        # died: every 0.1 s that sometimes came before a gloo survivor had
        # raised and reported the death (a CI rehearsal); 1 s leaves it time.
        launch = ["--max-restarts", str(max_restarts), "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--monitor-interval", "1"]
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *launch,
         str(root / script), *args],
        env=env, capture_output=True, text=True, timeout=timeout)


def run_script_ranks(script: str, nproc: int, *args: str,
                     timeout: float = 180) -> list["subprocess.CompletedProcess[str]"]:
    """``script`` (relative to the checkout) as ``nproc`` ranks with no
    elastic agent and the store served by this process
    (pycomm.bench.launch.run_script), this checkout on PYTHONPATH, one
    OpenMP thread per rank."""
    from pathlib import Path

    from pycomm.bench.launch import run_script

    root = Path(__file__).resolve().parent.parent
    return run_script([str(root / script), *args], nproc, timeout=timeout,
                      env={"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
