"""Other libraries' all-reduce as series of the study (``--peers``): timed in
the same rounds as pycomm's algos, checked the same way, in the same table,
JSON and plot.

- ``mpich``: MPICH's ``MPI_Allreduce`` through mpi4py (``pip install mpi4py
  mpich``), in place on the tensor's memory (a NumPy view). MPI's ranks must
  be started by its own launcher (``MPI_Init`` in a process that mpiexec did
  not start makes a world of one), so the study re-executes itself under the
  mpich wheel's ``mpiexec`` (``launch.py``); each rank reads its rank from
  MPI (``PMI_RANK``/``PMI_SIZE``), initialises MPI first and torch.distributed
  second, through a store whose port rank 0 broadcasts over MPI.
- ``deepspeed``: DeepSpeed's CPU shared-memory all-reduce
  (``torch.ops.deepspeed.inference_all_reduce_``, what its inference path
  calls on CPU), built on first use by DeepSpeed's ``ShareMemCommBuilder``
  (a JIT compile, about a minute on 2 cores, then cached in torch's
  extensions directory). Sum of float32, bfloat16 or float16, ranks on one
  host. DeepSpeed leaves its segments in ``/dev/shm``; each rank unlinks its
  own once every rank has mapped them.

Where a peer cannot run, :func:`why_not` says why in one line at argument
parsing (``cli.py``), and :func:`prepare` (the DeepSpeed build) before any
rank starts.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

__all__ = ["PEERS", "SPECS", "PeerSpec", "mpi_world", "mpiexec", "open_peers", "prepare", "why_not"]


@dataclass(frozen=True)
class PeerSpec:
    """What a peer needs and can do: its Python module (and the command that
    installs it), its label in the plot, and the dtypes and ops it reduces."""

    name: str
    title: str
    module: str
    fix: str
    dtypes: tuple[str, ...]
    ops: tuple[str, ...]


SPECS: dict[str, PeerSpec] = {p.name: p for p in (
    PeerSpec("mpich", "MPICH MPI_Allreduce (mpi4py)", "mpi4py", "pip install mpi4py mpich",
             ("float32", "float64", "float16", "int32", "int64", "int8", "uint8"),
             ("sum", "prod", "max", "min")),
    PeerSpec("deepspeed", "DeepSpeed shm all-reduce", "deepspeed", "pip install deepspeed",
             ("float32", "bfloat16", "float16"), ("sum",)),
)}
#: ``--peers`` values.
PEERS = tuple(SPECS)


def mpiexec() -> str | None:
    """The ``mpiexec`` beside this Python (the mpich wheel's), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


def why_not(name: str, args: Any) -> str | None:
    """Why peer ``name`` cannot run the study ``args`` asks for (one line),
    or None. Cheap: imports nothing of the peer's."""
    spec = SPECS[name]
    if args.collective != "allreduce":
        return f"the peers measure allreduce only, not {args.collective}"
    if args.dtype not in spec.dtypes:
        return f"{spec.title} has no {args.dtype}; use -d with one of {', '.join(spec.dtypes)}"
    if args.op not in spec.ops:
        return f"{spec.title} has no op {args.op}; use -o with one of {', '.join(spec.ops)}"
    if args.hosts:
        return "the peers run on one host; drop --hosts"
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        return "the peers reduce CPU tensors; add --device cpu"
    if name == "mpich":
        if mpiexec() is None:
            return f"no mpiexec beside {sys.executable} or on PATH: {spec.fix}"
        if "PMI_RANK" not in os.environ and "RANK" in os.environ:
            return ("MPI starts its own ranks: run with --nproc N (the study re-executes itself "
                    "under mpiexec), not under torchrun")
    return None


@contextlib.contextmanager
def _quiet() -> Iterator[list[str]]:
    """Sends this process's stdout and stderr (file descriptors too: a
    compiler's output) to a file while the block runs; yields a list that
    holds the captured text afterwards."""
    captured: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile(mode="w+") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                yield captured
        finally:
            f.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            f.seek(0)
            captured.append(f.read())


def _deepspeed_op() -> Any:
    """DeepSpeed's shm all-reduce module, built (or loaded from the cache)
    quietly; registers ``torch.ops.deepspeed.inference_all_reduce_``.

    Raises:
        RuntimeError: it did not build; the message is DeepSpeed's first line.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with _quiet() as out:
        try:
            from deepspeed.accelerator import get_accelerator

            op = get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
        except Exception as e:  # DeepSpeed raises what its builders raise
            err: Exception | None = e
        else:
            err = None
    if err is not None:
        lines = [x.strip() for x in f"{err}\n{''.join(out)}".splitlines() if x.strip()]
        raise RuntimeError(f"DeepSpeed's shm all-reduce did not build ({type(err).__name__}"
                           + (f": {lines[0]})" if lines else ")"))
    return op


def _kernel_level(op: Any) -> int:
    """The ISA level DeepSpeed's shm kernels can use here (1: AVX2, float32;
    2: AVX-512BW, also bfloat16 and float16); versions before the probe
    assumed 2."""
    return int(getattr(op, "vector_kernel_level", lambda: 2)())


def prepare(peers: list[str]) -> str | None:
    """Launcher side, before any rank starts: builds what the peers need
    (DeepSpeed's op, once, so the ranks load it from the cache). Returns
    why a peer cannot run, in one line, or None."""
    if "deepspeed" in peers:
        try:
            op = _deepspeed_op()
        except RuntimeError as e:
            return f"--peers deepspeed: {e}"
        if _kernel_level(op) < 1:
            return "--peers deepspeed: DeepSpeed's shm kernels need AVX2, which this CPU lacks"
    return None


def mpi_world() -> Any:
    """MPI's ``COMM_WORLD`` (MPI initialised on first call, at thread level
    funneled: only the main thread calls MPI)."""
    import mpi4py

    mpi4py.rc.thread_level = "funneled"
    from mpi4py import MPI

    return MPI.COMM_WORLD


#: A call of one series.
Run = Callable[[], None]


class _Mpich:
    """``MPI_Allreduce(MPI_IN_PLACE, ...)`` on COMM_WORLD."""

    transport = "mpi"

    def __init__(self, world_size: int) -> None:
        world = mpi_world()  # first: importing mpi4py.MPI initialises MPI
        import mpi4py
        from mpi4py import MPI

        self._mpi, self._world = MPI, world
        if self._world.Get_size() != world_size:
            raise RuntimeError(f"MPI's world has {self._world.Get_size()} ranks, the study "
                               f"{world_size}: start it with --nproc, not under another launcher")
        library = " ".join(MPI.Get_library_version().splitlines()[0].split())
        self.version = f"{library}, mpi4py {mpi4py.__version__}"

    def runner(self, tensor: torch.Tensor, op: str) -> Run:
        MPI = self._mpi
        buf = tensor.numpy()  # the tensor's memory; TypeError for a dtype NumPy lacks
        mpi_op = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}[op]
        allreduce, in_place = self._world.Allreduce, MPI.IN_PLACE

        def run() -> None:
            allreduce(in_place, buf, mpi_op)

        return run


class _DeepSpeed:
    """``torch.ops.deepspeed.inference_all_reduce_`` over DeepSpeed's shm
    workspace, initialised once per process under a name no other run uses."""

    transport = "shm (deepspeed)"

    def __init__(self, rank: int, world_size: int, group: Any) -> None:
        # Its kernels' OpenMP loops run on torch's OpenMP runtime (libgomp
        # from libtorch_cpu), so with the rank's torch.set_num_threads: one
        # thread a rank on 2 cores, not two spinning on each other's core.
        op = _deepspeed_op()
        key = [f"{os.getpid()}"]
        dist.broadcast_object_list(key, src=0, group=group)
        # initialize() names the segments after MASTER_ADDR/PORT and uses shm
        # only when LOCAL_SIZE equals the world's size.
        env = {"MASTER_ADDR": "pycomm-bench", "MASTER_PORT": key[0], "LOCAL_SIZE": str(world_size)}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            op.initialize(world_size, rank)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
        dist.barrier(group=group)  # every rank has mapped every segment
        for path in glob.glob(f"/dev/shm/deepspeed_*_pycomm-bench_{key[0]}_{rank}"):
            os.unlink(path)
        self._level = _kernel_level(op)
        import deepspeed

        self.version = f"DeepSpeed {deepspeed.__version__}"

    def runner(self, tensor: torch.Tensor, op: str) -> Run:
        if self._level < (1 if tensor.dtype == torch.float32 else 2):
            raise ValueError(f"DeepSpeed's {tensor.dtype} kernel needs AVX-512BW here")
        reduce = torch.ops.deepspeed.inference_all_reduce_

        def run() -> None:
            reduce(tensor)

        return run


def open_peers(names: list[str], rank: int, world_size: int, group: Any) -> dict[str, Any]:
    """Each named peer, ready on this rank (every rank calls this together;
    ``group`` is the control group). A peer has ``runner(tensor, op)``
    (one in-place all-reduce per call), ``transport`` and ``version``."""
    peers: dict[str, Any] = {}
    for name in names:
        peers[name] = _Mpich(world_size) if name == "mpich" else _DeepSpeed(rank, world_size, group)
    return peers
