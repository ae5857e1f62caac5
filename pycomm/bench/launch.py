"""Starting the ranks: under torchrun (one process per rank already), or
``--nproc N`` local ranks spawned here, or, with ``--peers mpich``, the
same ``--nproc N`` ranks started by MPI's ``mpiexec`` (this command run
again under it: MPI's ranks must come from its launcher).

Spawned ranks rendezvous through a TCPStore that this (parent) process
serves on 127.0.0.1 with a port the OS picks, so there is no port race. A
rank that raises writes its traceback to a file the parent prints; the
parent kills the others and fails. Past ``--timeout`` seconds everything is
killed and the run fails, so a hang cannot outlive the limit.
"""

from __future__ import annotations

import contextlib
import glob
import multiprocessing as mp
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, NoReturn, Sequence

from .cli import COMMAND_VAR

__all__ = ["launch", "run_script", "under_mpiexec", "under_torchrun"]


def under_torchrun() -> bool:
    """True when torchrun (or another env:// launcher) started this process."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def under_mpiexec() -> bool:
    """True when an MPI launcher with the PMI interface (MPICH's hydra)
    started this process."""
    return all(k in os.environ for k in ("PMI_RANK", "PMI_SIZE"))


def _backend(device: str) -> str:
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "gloo"
    return "cpu:gloo,cuda:nccl"


def _rank_timeout(args: Any) -> timedelta:
    return timedelta(seconds=max(30.0, min(args.timeout, 300.0)))


def _run_here(args: Any) -> int:
    """This rank's part: ``args.rank_main`` (e.g. the soak's) or the benchmark."""
    from .runner import run_benchmark

    try:
        return getattr(args, "rank_main", run_benchmark)(args)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _watchdog(seconds: float) -> None:
    """Under torchrun nobody else enforces --timeout: exit hard past it."""
    def fire() -> None:
        print(f"pycomm.bench: timed out after {seconds:g} s (-T/--timeout); exiting",
              file=sys.stderr, flush=True)
        os._exit(124)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def _join(args: Any, rank: int, world: int, store: Any) -> None:
    """A local rank's setup: its share of the cores, then torch.distributed
    through ``store``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = _backend(args.device)
    if backend != "gloo" and world > torch.cuda.device_count():
        # More ranks than GPUs: distinct host ids make NCCL use its socket
        # transport between ranks sharing a GPU (correct, not fast).
        os.environ.setdefault("NCCL_HOSTID", f"pycomm-bench-{rank}")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=_rank_timeout(args))


def _child(rank: int, world: int, port: int, args: Any, err_path: str) -> None:
    try:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_rank_timeout(args))
        _join(args, rank, world, store)
        code = _run_here(args)
    except BaseException:
        with open(err_path, "w") as f:
            f.write(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _spawn(args: Any, nproc: int) -> int:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=_rank_timeout(args))
    # Ranks fork from a server that imported torch once (a forkserver: no
    # thread or CUDA state of this process is inherited), instead of each
    # rank importing it again: seconds of CPU a rank on a small machine.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    tmp = tempfile.mkdtemp(prefix="pycomm-bench-")
    errs = [os.path.join(tmp, f"rank{r}.err") for r in range(nproc)]
    procs = [ctx.Process(target=_child, args=(r, nproc, store.port, args, errs[r]), name=f"rank{r}")
             for r in range(nproc)]
    deadline = time.monotonic() + args.timeout
    failed: list[int] = []
    timed_out = False
    try:
        for p in procs:
            p.start()
        while True:
            codes = [p.exitcode for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            # A wrong result (exit 1, no traceback) still lets the others finish.
            if any(os.path.exists(errs[r]) for r in failed) or any(c is not None and c < 0 for c in codes):
                break
            if all(c is not None for c in codes):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            procs[0].join(0.05)
    except KeyboardInterrupt:
        print("pycomm.bench: interrupted; stopping the ranks", file=sys.stderr)
        timed_out = False
        failed = failed or [-1]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()  # SIGKILL
                p.join()
    tracebacks = [(r, open(errs[r]).read()) for r in range(nproc) if os.path.exists(errs[r])]
    shutil.rmtree(tmp, ignore_errors=True)
    del store
    for r, tb in tracebacks:
        print(f"pycomm.bench: rank {r} failed:\n{tb}", file=sys.stderr, flush=True)
    if timed_out:
        print(f"pycomm.bench: timed out after {args.timeout:g} s (-T/--timeout); ranks killed",
              file=sys.stderr, flush=True)
        return 124
    if tracebacks:
        return 1
    for r, p in enumerate(procs):
        if p.exitcode not in (0, 1):
            print(f"pycomm.bench: rank {r} died with exit code {p.exitcode}", file=sys.stderr, flush=True)
            return 1
    return 1 if any(p.exitcode for p in procs) else 0


def _without_launch_flags(argv: list[str]) -> list[str]:
    """``argv`` less --hosts, --link-rate and --nproc (and their values): a
    rank's argv."""
    out, skip = [], False
    flags = ("--hosts", "--link-rate", "--nproc")
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


def _spawn_hosts(args: Any) -> int:
    """``--hosts H``: H simulated hosts (pycomm/bench/simhosts.py) with
    --nproc ranks each, started as torchrun starts them; prints rank 0's
    output (and every failed rank's errors)."""
    from .simhosts import SimulatedHosts

    argv = _without_launch_flags(list(sys.argv[1:] if args.argv is None else args.argv))
    algo = getattr(args, "algo", None)  # the study's; a subcommand may have none
    if algo and "--algo" not in argv and not any(a.startswith("--algo=") for a in argv):
        argv += ["--algo", ",".join(algo)]
    layout = [args.nproc or 1] * args.hosts
    # args.command: the subcommand (["soak"]) when args.argv is its argv alone
    command = [sys.executable, "-m", "pycomm.bench", *getattr(args, "command", []), *argv]
    with SimulatedHosts(args.hosts, getattr(args, "link_rate", None)) as hosts:
        results = hosts.launch(layout, command, timeout=args.timeout,
                               env={"OMP_NUM_THREADS": "1", COMMAND_VAR: args.typed_command})
    print(results[0].stdout, end="", flush=True)
    code = 0
    for res in results:
        if res.returncode is None:
            print(f"pycomm.bench: rank {res.rank} timed out (-T/--timeout)", file=sys.stderr)
            code = 124
        elif res.returncode != 0:
            print(f"pycomm.bench: rank {res.rank} (host {res.host}) exited {res.returncode}:\n"
                  f"{res.stderr[-4000:]}", file=sys.stderr)
            code = code or 1
    return code


def _spawn_mpiexec(args: Any) -> int:
    """``--peers mpich``: this command again, as ``--nproc`` ranks started
    by ``mpiexec`` (their output is this command's); killed past
    ``--timeout`` (the ranks also watch it themselves). MPICH leaves its
    shared-memory segment behind when a rank aborts: a failed run removes
    the ``/dev/shm/mpich_shm_*`` files that appeared while it ran."""
    from .peers import mpiexec

    argv = _without_launch_flags(list(sys.argv[1:] if args.argv is None else args.argv))
    cmd = [str(mpiexec()), "-n", str(args.nproc or 1), sys.executable, "-m", "pycomm.bench", *argv]
    before = set(glob.glob("/dev/shm/mpich_shm_*"))
    proc = subprocess.Popen(cmd, env={**os.environ, COMMAND_VAR: args.typed_command})
    code = 1
    try:
        code = proc.wait(timeout=args.timeout + 30)
        return code
    except subprocess.TimeoutExpired:
        print(f"pycomm.bench: timed out after {args.timeout:g} s (-T/--timeout); ranks killed",
              file=sys.stderr, flush=True)
        return 124
    except KeyboardInterrupt:
        print("pycomm.bench: interrupted; stopping the ranks", file=sys.stderr)
        return 1
    finally:
        if proc.poll() is None:
            proc.terminate()  # mpiexec passes it on to the ranks
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for path in set(glob.glob("/dev/shm/mpich_shm_*")) - before if code else ():
            with contextlib.suppress(OSError):
                os.unlink(path)


def _mpi_rank(args: Any) -> NoReturn:
    """One rank started by ``mpiexec``: MPI first (its rank and world are
    this rank's), then torch.distributed through a TCPStore that rank 0
    serves, its port broadcast over MPI. A rank that raises aborts every
    rank (MPI_Abort), so none waits for it in a barrier. Like a spawned
    rank, it ends with ``os._exit`` (after MPI_Finalize): no C++ static
    destructors race the threads of the libraries at exit."""
    import torch.distributed as dist

    from .peers import mpi_world

    world = mpi_world()  # before mpi4py.MPI is imported: it sets the thread level
    from mpi4py import MPI

    rank, n = world.Get_rank(), world.Get_size()
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("MPI_LOCALNRANKS", str(n)))
    os.environ.setdefault("LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", str(rank)))
    _watchdog(args.timeout)
    code = 1
    try:
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        store = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                              timeout=_rank_timeout(args)) if rank == 0 else None
        port = world.bcast(store.port if store is not None else None, root=0)
        if store is None:
            store = dist.TCPStore(addr, port, is_master=False, timeout=_rank_timeout(args))
        _join(args, rank, n, store)
        code = _run_here(args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        world.Abort(1)
    sys.stdout.flush()
    sys.stderr.flush()
    MPI.Finalize()
    os._exit(code)


def launch(args: Any) -> int:
    """Runs the benchmark on every rank; returns the exit code (0 ok, 1 a
    rank failed or a result was wrong, 2 a peer cannot run, 124 timeout)."""
    # The command as typed, for the JSON (a rank's argv lacks the launch
    # flags): to forked ranks in args, to hosts' and mpiexec's in COMMAND_VAR,
    # which a rank's own launch() finds set.
    typed = sys.argv[1:] if args.argv is None else [*getattr(args, "command", []), *args.argv]
    args.typed_command = (os.environ.get(COMMAND_VAR)
                          or shlex.join(["python", "-m", "pycomm.bench", *typed]))
    if getattr(args, "hosts", None):
        return _spawn_hosts(args)
    peers = getattr(args, "peers", [])
    if "mpich" in peers and under_mpiexec():
        return _mpi_rank(args)
    if peers:
        from .cli import error_line
        from .peers import prepare

        why = prepare(peers)
        if why:
            sys.stderr.write(error_line(why))
            return 2
    if "mpich" in peers:
        return _spawn_mpiexec(args)
    if under_torchrun():
        if args.nproc is not None:
            raise SystemExit("pycomm.bench: --nproc spawns ranks itself; drop it under torchrun")
        import torch.distributed as dist

        _watchdog(args.timeout)
        dist.init_process_group(_backend(args.device), timeout=_rank_timeout(args))
        return _run_here(args)
    return _spawn(args, args.nproc or 1)


def start_script(argv: list[str], nproc: int, *, timeout: float = 300,
                 env: dict[str, str] | None = None, store_port: int | None = None,
                 prefix: Sequence[str] = ()) -> tuple[Any, list[subprocess.Popen]]:
    """Starts ``python argv...`` as ``nproc`` local ranks (see
    :func:`run_script`) and returns at once: (the store this process
    serves, which must outlive the ranks; the ranks' processes, output
    piped). With ``store_port`` the ranks use a store someone else serves on
    127.0.0.1 (the store returned is None); ``prefix`` goes before the
    command (e.g. ``nsenter`` into a namespace)."""
    import torch.distributed as dist

    store = None
    if store_port is None:
        store = dist.TCPStore("127.0.0.1", 0, nproc, True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout))
        store_port = store.port
    procs = []
    for r in range(nproc):
        rank_env = dict(os.environ, **(env or {}), RANK=str(r), LOCAL_RANK=str(r),
                        WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port),
                        TORCHELASTIC_USE_AGENT_STORE="True")
        procs.append(subprocess.Popen([*prefix, sys.executable, *argv], env=rank_env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return store, procs


def run_script(argv: list[str], nproc: int, *, timeout: float = 300,
               env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Runs ``python argv...`` as ``nproc`` local ranks with torchrun's
    variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) but no elastic agent: a rank that dies leaves the others
    running, as ``Communicator.shrink`` needs. Like torchrun's agent, this
    process serves the store (``TORCHELASTIC_USE_AGENT_STORE``), so the store
    outlives every rank, rank 0 included. Past ``timeout`` seconds every rank
    is killed. Returns each rank's finished process (output captured)."""
    store, procs = start_script(argv, nproc, timeout=timeout, env=env)
    deadline = time.monotonic() + timeout
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    del store
    return done
