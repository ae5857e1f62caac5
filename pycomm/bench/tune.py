"""``python -m pycomm.bench tune``: measure every algorithm of a collective
on this machine, transport and world size, and write the fastest per size
as an entry of ``algo="auto"``'s table (:mod:`pycomm._auto_table`)::

    python -m pycomm.bench tune --nproc 4 --transport gloo --out auto_table.json
    PYCOMM_AUTO_TABLE=auto_table.json python train.py

``--hosts H --nproc 1`` (root: simulated hosts, pycomm/bench/simhosts.py,
with ``--link-rate``) measures gloo between H hosts, a rank on each, and
writes an entry of world size H marked ``"hosts": true``, the one gloo
groups that span hosts take.

Each collective is one run of the study (``python -m pycomm.bench <coll>
--algo <its algorithms>``, interleaved in rounds like any study run); the
entry records the commit and the command. ``--out`` is merged into: an
entry of the same device, transport and world size is replaced, the others
stay. The built-in table (pycomm/auto_table.json) is written by this command.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from .. import _auto_table
from .cli import add_hosts_argument, check_hosts, parse_args
from .collectives import SPECS
from .launch import launch
from .report import git_commit

__all__ = ["TOLERANCE", "best_by_size", "main"]

#: Study sub-command -> the table's collective name (the C++ side's).
TABLE_NAMES = {"allreduce": "all_reduce", "allgather": "all_gather"}


#: An algorithm within this factor of the fastest at a size counts as fast
#: enough there: the choice then stays with the previous size's algorithm,
#: so that measurement noise between near-equal algorithms (at 2 ranks the
#: ring, recursive doubling and halving-doubling send nearly the same) does
#: not cut the table into many rules.
TOLERANCE = 1.05


def best_by_size(rows: Sequence[dict[str, Any]], algos: Sequence[str],
                 tolerance: float = TOLERANCE) -> list[tuple[int, str]]:
    """An algorithm of ``algos`` per measured size, sizes ascending: the
    previous size's choice while it is within ``tolerance`` of the fastest,
    else the fastest (rows with wrong results do not compete)."""
    times: dict[int, dict[str, float]] = {}
    for r in rows:
        if r["algo"] in algos and not r.get("wrong") and r["time_us"] > 0:
            times.setdefault(r["size"], {})[r["algo"]] = r["time_us"]
    out: list[tuple[int, str]] = []
    for size in sorted(times):
        by_algo = times[size]
        fastest = min(by_algo, key=by_algo.__getitem__)
        prev = out[-1][1] if out else None
        keep = prev in by_algo and by_algo[prev] <= tolerance * by_algo[fastest]
        out.append((size, prev if keep and prev is not None else fastest))
    return out


def _candidates(coll: str, transport: str) -> list[str]:
    """The algorithms a table may choose for ``coll``: the collective's own,
    and "direct" (all-reduce over shared memory) where it can run."""
    algos = list(SPECS[coll].algos)
    if coll == "allreduce" and transport in ("auto", "shm"):
        algos.append("direct")
    return algos


def _measure(args: argparse.Namespace, coll: str, out: Path) -> dict[str, Any]:
    argv = [coll, "--nproc", str(args.nproc), "--transport", args.transport, "--device", args.device,
            "-b", args.minbytes, "-e", args.maxbytes, "-f", str(args.stepfactor),
            "--algo", ",".join(_candidates(coll, args.transport)), "--json", str(out)]
    if args.hosts:
        argv += ["--hosts", str(args.hosts)]
        if args.link_rate:
            argv += ["--link-rate", args.link_rate]
    code = launch(parse_args(argv))
    if code != 0:
        raise SystemExit(f"pycomm.bench tune: the {coll} study failed (exit {code})")
    return json.loads(out.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pycomm.bench tune --nproc N [--transport T] --out FILE``."""
    p = argparse.ArgumentParser(
        prog="python -m pycomm.bench tune",
        description="Measure every algorithm and write algo='auto''s table entry for this "
                    "device, transport and world size.")
    p.add_argument("--nproc", type=int, required=True,
                   help="ranks (world size of the entry); with --hosts, 1 (a rank a host)")
    p.add_argument("--transport", default="auto", choices=("auto", "shm", "gloo", "nccl"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--collectives", default="allreduce,allgather",
                   help="comma-separated, of " + ", ".join(TABLE_NAMES))
    p.add_argument("-b", "--minbytes", default="1K")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("--out", required=True, help="table file to write (merged into if it exists)")
    add_hosts_argument(p)
    given = list(sys.argv[2:] if argv is None else argv)
    args = p.parse_args(given)
    if args.hosts and (args.transport != "gloo" or args.nproc != 1 or args.hosts < 2):
        p.error("--hosts H measures gloo between H >= 2 hosts, a rank on each: give "
                "--transport gloo --nproc 1")
    check_hosts(p, args)
    world_size = args.hosts or args.nproc  # --hosts: a rank on each
    colls = [c.strip() for c in args.collectives.split(",") if c.strip()]
    for c in colls:
        if c not in TABLE_NAMES:
            p.error(f"--collectives: {c!r} has no table (choose from {', '.join(TABLE_NAMES)})")
    if world_size < 2:
        p.error("--nproc must be at least 2 (one rank has nothing to choose)")
    if Path(args.out).exists():
        _auto_table.load(args.out)  # a bad file fails now, not after the measurements
    rules: dict[str, list[list[Any]]] = {}
    transport = args.transport
    with tempfile.TemporaryDirectory() as tmp:
        for coll in colls:
            data = _measure(args, coll, Path(tmp) / f"{coll}.json")
            transport = data["rows"][0]["transport"] if data["rows"] else transport
            best = best_by_size(data["rows"], _candidates(coll, args.transport))
            rules[TABLE_NAMES[coll]] = _auto_table.rules_from_best(best)
            print(f"# tune {coll}: " + ", ".join(f"{s} B {a}" for s, a in best))
    entry = {"device": args.device, "transport": transport, "world_size": world_size,
             **({"hosts": True} if args.hosts else {}), "rules": rules,
             "measured": {"commit": git_commit(),
                          "command": "python -m pycomm.bench tune " + shlex.join(given)}}
    table = _auto_table.with_entry(args.out, entry)
    Path(args.out).write_text(json.dumps(table, indent=2) + "\n")
    place = f" on {args.hosts} hosts" if args.hosts else ""
    print(f"# wrote {args.out}: {args.device}/{transport}/{world_size} ranks{place}: "
          + json.dumps(rules))
    return 0
