"""``python -m pycomm.bench model RESULTS.json``: the command line over both
cost models, the one-level alpha-beta fit (:mod:`pycomm.bench.model`) and,
for a ``--hosts`` run, the two-level one (:mod:`pycomm.bench.hosts_model`).
It owns both; neither model imports the other's report.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from .cli import parse_size
from .hosts_model import fit_two_level, format_hosts_report
from .model import FORMULAS, Fit, crossovers, fit_rows, format_report, measured_times, predict_best
from .report import load_json

__all__ = ["main"]

DEFAULT_WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_SIZES = ("64K", "1M", "64M", "1G")


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 2 for v in vals):
        raise argparse.ArgumentTypeError("world sizes must be >= 2")
    return vals


_DEFAULT_CLUSTERS = ((2, 2), (4, 8), (16, 8), (64, 8))


def _cluster_list(text: str) -> list[tuple[int, int]]:
    """"16x8,64x8" -> [(16, 8), (64, 8)]."""
    try:
        out = [tuple(int(v) for v in x.lower().split("x")) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(len(c) != 2 or min(c) < 1 for c in out):
        raise argparse.ArgumentTypeError(f"expected HOSTSxRANKS,..., e.g. 16x8, got {text!r}")
    return [(c[0], c[1]) for c in out]


def _size_list(text: str) -> list[int]:
    try:
        return [parse_size(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pycomm.bench model RESULTS.json [--worlds ...] [--sizes ...]``."""
    p = argparse.ArgumentParser(
        prog="python -m pycomm.bench model",
        description="Fit alpha and beta to all-reduce results, each algorithm with its own formula; "
                    "print predicted and measured crossovers and the fastest algorithm per world and size.")
    p.add_argument("results", help="a --json file of `python -m pycomm.bench allreduce`")
    p.add_argument("--worlds", type=_int_list, default=list(DEFAULT_WORLDS), help="comma-separated ranks")
    p.add_argument("--sizes", type=_size_list, default=[parse_size(s) for s in DEFAULT_SIZES],
                   help="comma-separated message sizes (K/M/G)")
    p.add_argument("--clusters", type=_cluster_list, default=list(_DEFAULT_CLUSTERS),
                   help="HOSTSxRANKS,... predicted by the two-level model (for a --hosts run)")
    p.add_argument("--weighting", choices=("relative", "absolute"), default="relative")
    p.add_argument("--alpha-us", type=float,
                   help="predict with this alpha for every algorithm instead of the fits (with --bw-gbps)")
    p.add_argument("--bw-gbps", type=float,
                   help="predict with this link bandwidth (1/beta) for every algorithm instead of the fits")
    args = p.parse_args(argv)
    if (args.alpha_us is None) != (args.bw_gbps is None):
        p.error("--alpha-us and --bw-gbps go together")
    data = load_json(args.results)
    meta = data.get("meta", {})
    fits = fit_rows(data["rows"], args.weighting)
    found = crossovers(fits, measured_times(data["rows"]))
    plan, given = fits, None
    if args.alpha_us is not None:  # one given link, every algorithm's formula
        given = (args.alpha_us * 1e-6, 1.0 / (args.bw_gbps * 1e9))
        plan = {a: Fit(*given, 0, 0.0, a) for a in FORMULAS}
    modelled = any(a in FORMULAS and f.formula == a for a, f in plan.items())
    cells = predict_best(plan, args.worlds, args.sizes) if modelled else []
    source = f"{args.results}: {meta.get('world_size', '?')} ranks, {meta.get('device', '?')}"
    print(format_report(fits, found, cells, source, given))
    if int(meta.get("hosts", 1)) > 1:  # a --hosts run: the two-level model too
        hosts, per_host = int(meta["hosts"]), int(meta["ranks_per_host"])
        print("#")
        try:
            two = fit_two_level(data["rows"], hosts, per_host)
        except ValueError as e:  # a run without the flat ring: nothing to fit
            print(f"# two-level model: not fitted: {e}")
            return 0
        print(format_hosts_report(two, args.clusters, args.sizes,
                                  f"{args.results}: {hosts} hosts x {per_host} ranks"))
    return 0
