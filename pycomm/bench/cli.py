"""Command line of ``python -m pycomm.bench``: nccl-tests' flags and meanings.

Pure parsing: nothing here starts torch.distributed, so the tests can check
every flag without starting a rank.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from typing import Callable, Sequence

from . import collectives as C
from . import peers as P
from .collectives import SPECS

__all__ = [
    "ALGOS",
    "COLLECTIVES",
    "DTYPES",
    "HOSTS_ALGOS",
    "OPS",
    "build_parser",
    "error_line",
    "format_size",
    "parse_args",
    "parse_size",
    "refuse",
    "require_module",
    "size_sweep",
]

PROG = "python -m pycomm.bench"

#: Sub-commands that measure a collective (``model`` is handled by __main__):
#: one per :class:`~pycomm.bench.collectives.Collective`.
COLLECTIVES = tuple(SPECS)

#: ``--algo`` values: pycomm's own algorithms plus ``torch``, the same
#: collective through torch.distributed's backend (gloo on CPU, NCCL on GPU),
#: ``flat``: pycomm's ring on a second communicator with
#: ``transport="gloo"`` (across hosts, the flat ring beside the hierarchy),
#: and ``symmetric``: all_reduce of a tensor registered in symmetric memory
#: before timing (shm; sizes where a call did not run symmetric show N/A).
#: The algorithms of one collective each (Collective.algos says whose).
CLASSIC_ALGOS = ("recursive_doubling", "halving_doubling", "tree", "bruck")
# The command as the user typed it (launch.launch), for the JSON's meta.
COMMAND_VAR = "PYCOMM_BENCH_COMMAND"
ALGOS = ("ring", "auto", "direct", "nccl", "torch", "flat", "symmetric", *CLASSIC_ALGOS, "all")

#: What ``--algo all`` adds to a collective's own algorithms
#: (:attr:`~pycomm.bench.collectives.Collective.algos`).
ALL_EXTRA = ("auto", "torch")

#: ``--algo`` with ``--hosts`` when not given: the hierarchy (``auto`` on
#: transport "shm+gloo"), the flat gloo ring and torch's gloo.
HOSTS_ALGOS = ["auto", "flat", "torch"]

#: ``-d`` names (nccl-tests spellings and torch spellings) -> torch dtype name.
DTYPES = {
    "float": "float32", "float32": "float32", "fp32": "float32",
    "double": "float64", "float64": "float64", "fp64": "float64",
    "half": "float16", "float16": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16", "bfp16": "bfloat16",
    "int32": "int32", "int": "int32",
    "int64": "int64",
    "int8": "int8",
    "uint8": "uint8",
}

#: ``-o`` names -> canonical op name (pycomm accepts these strings).
OPS = {"sum": "sum", "prod": "prod", "product": "prod", "max": "max", "min": "min",
       "avg": "avg", "mean": "avg"}

_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes from ``"1K"``, ``"64M"``, ``"2G"``, ``"4096"`` (binary suffixes,
    like nccl-tests: 1K = 1024). ``KB``/``KiB`` are accepted too.

    Raises:
        ValueError: not a size, or negative.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"bad size {text!r}; use bytes with an optional K, M or G suffix, e.g. 1K, 64M")
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def format_size(nbytes: int) -> str:
    """Short binary form for labels: 1024 -> "1K", 67108864 -> "64M"."""
    for suffix, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{suffix}"
    return f"{nbytes}B" if nbytes < 1024 else f"{nbytes / 1024:.1f}K"


def size_sweep(min_bytes: int, max_bytes: int, factor: float = 0, step_bytes: int = 0) -> list[int]:
    """The sizes nccl-tests visits: from ``min_bytes`` up to ``max_bytes``
    (inclusive), multiplying by ``factor`` when it is > 1, else adding
    ``step_bytes``. ``min == max`` gives one size.

    Raises:
        ValueError: min > max, or neither a factor > 1 nor a positive step
            while min < max.
    """
    if min_bytes < 0 or max_bytes < 0:
        raise ValueError("sizes must be >= 0")
    if min_bytes > max_bytes:
        raise ValueError(f"-b {min_bytes} is larger than -e {max_bytes}")
    if min_bytes == max_bytes:
        return [min_bytes]
    if factor and factor > 1:
        if min_bytes == 0:
            raise ValueError("-b 0 cannot grow by a factor; start from 1 byte or more")
        sizes, s = [], float(min_bytes)
        while s <= max_bytes * (1 + 1e-12):
            sizes.append(int(round(s)))
            s *= factor
        return sizes
    if factor and factor != 1:
        raise ValueError(f"-f must be > 1, got {factor}")
    if step_bytes <= 0:
        raise ValueError("a sweep from -b to -e needs -f > 1 or -i > 0")
    return list(range(min_bytes, max_bytes + 1, step_bytes))


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _names(kind: str, choices: Sequence[str], at_least_one: bool = False) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of ``choices`` (lower-cased,
    in order, repeats dropped)."""

    def parse(text: str) -> list[str]:
        names = [a.strip().lower() for a in re.split(r"[,\s]+", text) if a.strip()]
        if at_least_one and not names:
            raise argparse.ArgumentTypeError(f"--{kind} needs at least one of " + ", ".join(choices))
        for a in names:
            if a not in choices:
                raise argparse.ArgumentTypeError(
                    f"unknown {kind} {a!r}; choose from {', '.join(choices)}")
        return list(dict.fromkeys(names))

    return parse


_algo_list = _names("algo", (*ALGOS, *(f"wire_{w}" for w in C.WIRES)), at_least_one=True)
_wire_list = _names("wire", tuple(C.WIRES))
_peer_list = _names("peer", P.PEERS)


def _zero_one(text: str) -> int:
    if text not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"expected 0 or 1, got {text!r}")
    return int(text)


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {v}")
        return v

    return parse


_positive_int = _int_at_least(1)


def add_hosts_argument(p: argparse.ArgumentParser) -> None:
    """``--hosts H`` and ``--link-rate``, the same for the study and the soak."""
    p.add_argument("--hosts", type=_positive_int, default=None,
                   help="run on this many simulated hosts (network namespaces, root only; "
                        "pycomm/bench/simhosts.py), --nproc ranks on each")
    p.add_argument("--link-rate", default=None, metavar="RATE",
                   help="with --hosts: cap each simulated host's link at RATE (tc's units, "
                        "e.g. 1gbit), so bytes between hosts cost wire time as on a network")


def check_hosts(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses, at parsing, --link-rate without --hosts or not a rate, and
    --hosts where simulated hosts cannot be made (saying why)."""
    from .simhosts import parse_link_rate, unavailable_reason

    if args.link_rate is not None:
        if args.hosts is None:
            p.error("--link-rate needs --hosts (it shapes the simulated hosts' links)")
        try:
            parse_link_rate(args.link_rate)
        except ValueError as e:
            p.error(f"--link-rate: {e}")
    if args.hosts is not None:
        why = unavailable_reason(args.link_rate)
        if why:
            p.error(f"--hosts: {why}")


_nonneg_int = _int_at_least(0)


def _add_size_args(p: argparse.ArgumentParser) -> None:
    """The message sizes swept (nccl-tests' -b -e -f -i)."""
    p.add_argument("-b", "--minbytes", type=_size_arg, default=parse_size("32M"),
                   metavar="SIZE", help="smallest message in bytes (K/M/G suffixes)")
    p.add_argument("-e", "--maxbytes", type=_size_arg, default=parse_size("32M"),
                   metavar="SIZE", help="largest message in bytes")
    p.add_argument("-f", "--stepfactor", type=float, default=0.0, metavar="F",
                   help="multiply the size by F each step (> 1)")
    p.add_argument("-i", "--stepbytes", type=_size_arg, default=parse_size("1M"), metavar="SIZE",
                   help="add SIZE each step when no -f is given")


def _add_timing_args(p: argparse.ArgumentParser) -> None:
    """How many calls are timed per size, and how they take turns between algos."""
    p.add_argument("-n", "--iters", type=_positive_int, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup_iters", type=_nonneg_int, default=5, help="untimed warm-up iterations")
    p.add_argument("--rounds", type=_positive_int, default=4,
                   help="split the timed iterations of each size into this many rounds that take "
                        "turns between the algos, so a slow spell on a shared machine hits all "
                        "algos alike (1: each algo's iterations in one block, like nccl-tests)")
    p.add_argument("--min-round-ms", type=float, default=20.0, metavar="MS",
                   help="time at least this long per algo and round: small messages get more "
                        "calls than -n gives them (a call's time then settles as in a tight "
                        "loop); 0: exactly -n calls")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """The data of each call: element type, reduction, root, and the check of the result."""
    p.add_argument("-d", "--datatype", default="float", help="element type: " + ", ".join(sorted(DTYPES)))
    p.add_argument("-o", "--op", default="sum", help="reduction: sum, prod, max, min, avg")
    p.add_argument("-r", "--root", type=_nonneg_int, default=0,
                   help="root rank (broadcast, reduce, gather, scatter)")
    p.add_argument("-c", "--check", type=_zero_one, default=1,
                   help="1: count wrong elements against an independently computed result")


def _add_series_args(p: argparse.ArgumentParser) -> None:
    """The series measured side by side: algorithms, quantized wires, other libraries."""
    p.add_argument("--algo", type=_algo_list, default=None,
                   help="comma-separated list of ring, auto, direct (shm), nccl (GPU), torch, flat, "
                        "symmetric, "
                        "recursive_doubling, halving_doubling, tree (allreduce), bruck (allgather), "
                        "or all (every algorithm of the collective, auto and torch); measured "
                        "interleaved per size (default: ring,torch; with --hosts: "
                        "auto,flat,torch)")
    p.add_argument("--wire", type=_wire_list, default=[], metavar="LIST",
                   help=f"allreduce of float32 (sum, avg) also over a quantized wire, one series "
                        f"per name ({', '.join(C.WIRES)}): all_reduce(wire_dtype=..., "
                        f"wire_block={C.WIRE_BLOCK}), bf16: a bfloat16 copy all-reduced (the "
                        "bf16 hook's way); each checked within its rounding bound; the "
                        "JSON and the summary give the bytes each rank sends per call")
    p.add_argument("--peers", type=_peer_list, default=[], metavar="LIST",
                   help=f"comma-separated list of {', '.join(P.PEERS)}: another library's all-reduce "
                        "as one more series in the same rounds (pycomm/bench/peers.py)")


def _add_job_args(p: argparse.ArgumentParser) -> None:
    """Where the ranks run: transport, device, how many, on how many hosts, for how long."""
    p.add_argument("--transport", default="auto", choices=("auto", "gloo", "shm", "nccl"),
                   help="pycomm transport (pycomm.init(transport=...))")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when available")
    p.add_argument("--nproc", type=_positive_int, default=None,
                   help="spawn this many local ranks (default: 1, or torchrun's ranks)")
    add_hosts_argument(p)
    p.add_argument("-T", "--timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="overall limit; ranks are killed and the run fails past it")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """What is written besides the table: JSON, a plot, a progress bar."""
    p.add_argument("--json", metavar="FILE", help="write every measured row as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw busbw vs size per algo")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of one measuring sub-command (collective is positional)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Measure a collective the way nccl-tests does, for several algorithms side by "
            "side (pycomm's ring, auto, nccl, and torch.distributed's own backend). Runs "
            "under torchrun, or spawns --nproc local ranks. "
            "`python -m pycomm.bench model RESULTS.json` fits the alpha-beta cost model."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("collective", choices=COLLECTIVES, help="what to measure")
    _add_size_args(p)
    _add_timing_args(p)
    _add_data_args(p)
    _add_series_args(p)
    _add_job_args(p)
    _add_output_args(p)
    return p


def error_line(message: str, prog: str = PROG) -> str:
    """A usage error as one line, the way argparse starts its own."""
    return f"{prog}: error: {message}\n"


def refuse(parser: argparse.ArgumentParser, message: str) -> None:
    """Ends the program with ``message`` as one line and exit status 2
    (argparse's own errors also print the usage)."""
    parser.exit(2, error_line(message, parser.prog))


def require_module(parser: argparse.ArgumentParser, flag: str, module: str,
                   fix: str | None = None) -> None:
    """Ends the program at argument parsing, with one line naming the fix,
    when ``flag`` needs the optional ``module`` and it cannot be imported:
    never after the measurements are done. ``fix`` defaults to
    ``pip install <module>``. Exit status 2, as argparse's own errors."""
    if importlib.util.find_spec(module) is None:
        refuse(parser, f"{flag} needs {module}, which is not installed: "
                       f"{fix or 'pip install ' + module}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses and cross-checks the flags; exits with a usage error (code 2)
    on a bad combination. Adds ``sizes``, ``dtype`` (torch name) and
    canonical ``op``."""
    p = build_parser()
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else None
    if args.algo is None:
        args.algo = list(HOSTS_ALGOS) if args.hosts else ["ring", "torch"]
    if "all" in args.algo:
        every = [*SPECS[args.collective].algos, *ALL_EXTRA]
        at = args.algo.index("all")
        args.algo = list(dict.fromkeys(args.algo[:at] + every + args.algo[at + 1:]))
    for a in args.algo:
        if a in CLASSIC_ALGOS and a not in SPECS[args.collective].algos:
            p.error(f"--algo {a} is not an algorithm of {args.collective} (it has: "
                    f"{', '.join(SPECS[args.collective].algos)}, auto)")
    dt = DTYPES.get(args.datatype.lower())
    if dt is None:
        p.error(f"unknown datatype {args.datatype!r}; choose from {', '.join(sorted(DTYPES))}")
    args.dtype = dt
    op = OPS.get(args.op.lower())
    if op is None:
        p.error(f"unknown op {args.op!r}; choose from sum, prod, max, min, avg")
    args.op = op
    if op == "avg" and not dt.startswith(("float", "bfloat")):
        p.error(f"-o avg needs a floating datatype, got {dt}")
    try:
        args.sizes = size_sweep(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    except ValueError as e:
        p.error(str(e))
    if args.wire or any(C.wire_of(a) for a in args.algo):  # --algo wire_int8 is --wire int8
        if args.collective != "allreduce" or dt != "float32" or op not in ("sum", "avg"):
            p.error(f"--wire needs allreduce of float32 with -o sum or avg, got "
                    f"{args.collective} of {dt} with -o {op}")
        args.algo += [f"wire_{w}" for w in args.wire if f"wire_{w}" not in args.algo]
    check_hosts(p, args)
    if not SPECS[args.collective].reduces:
        args.op = "none"  # no reduction; printed as nccl-tests does
    if args.plot:
        require_module(p, "--plot", "matplotlib")
    for peer in args.peers:
        require_module(p, f"--peers {peer}", P.SPECS[peer].module, P.SPECS[peer].fix)
        why = P.why_not(peer, args)
        if why:
            refuse(p, f"--peers {peer}: {why}")
    return args
