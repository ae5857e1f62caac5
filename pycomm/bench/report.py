"""Output of a run: nccl-tests' table, the JSON rows, the busbw plot and the
progress bar. Pure functions of rows (dicts) so they can be tested and
re-drawn from a saved JSON file."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence, TextIO

from .cli import format_size
from .peers import SPECS as PEER_SPECS

__all__ = [
    "ROW_KEYS",
    "Progress",
    "avg_busbw",
    "format_header",
    "format_row",
    "format_summary",
    "load_json",
    "plot_results",
    "write_json",
]

SCHEMA = "pycomm.bench/1"

#: Keys every JSON row has (the contract of ``--json``).
ROW_KEYS = ("collective", "size", "count", "dtype", "op", "root", "algo", "in_place", "time_us",
            "p50_us", "p99_us", "algbw", "busbw", "wrong", "world_size", "transport", "device")

_DTYPE_NAMES = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16",
                "int32": "int32", "int64": "int64", "int8": "int8", "uint8": "uint8"}

_GROUP_W = 34  # width of one "time algbw busbw #wrong" column group


def _placement(in_place: bool) -> str:
    return "in-place" if in_place else "out-of-place"


def _group_title(algo: str, in_place: bool | None) -> str:
    return algo if in_place is None else f"{algo} {_placement(in_place)}"


def format_header(groups: Sequence[tuple[str, bool | None]]) -> str:
    """The three header lines; ``groups`` are the (algo, in_place) column
    groups in print order (in_place None: a bound, which has no placement)."""
    top = "#" + " " * 51 + "".join(f"{_group_title(algo, ip):>{_GROUP_W}}" for algo, ip in groups)
    names = (f"#{'size':>11}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}"
             + "".join(f"  {'time':>8}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}" for _ in groups))
    units = (f"#{'(B)':>11}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}"
             + "".join(f"  {'(us)':>8}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}" for _ in groups))
    return "\n".join([top, names, units])


def _fmt_time(us: float) -> str:
    return f"{us:8.2f}" if us < 1e5 else f"{us:8.0f}"


def format_row(rows: Sequence[dict[str, Any] | None]) -> str:
    """One line for one size: the shared columns from the first row, then
    one group per entry of ``rows`` (None prints N/A)."""
    first = next(r for r in rows if r is not None)
    dtype = _DTYPE_NAMES.get(first["dtype"], first["dtype"])
    line = (f"{first['size']:12d}  {first['count']:12d}  {dtype:>8}"
            f"  {first['op']:>6}  {first['root']:6d}")
    for r in rows:
        if r is None:
            line += f"  {'N/A':>8}  {'N/A':>6}  {'N/A':>6}  {'N/A':>6}"
            continue
        wrong = "N/A" if r["wrong"] is None else str(r["wrong"])
        line += f"  {_fmt_time(r['time_us'])}  {r['algbw']:6.2f}  {r['busbw']:6.2f}  {wrong:>6}"
    return line


def avg_busbw(rows: Iterable[dict[str, Any]]) -> float:
    """Mean busbw over rows (what nccl-tests prints as Avg bus bandwidth)."""
    vals = [r["busbw"] for r in rows]
    return sum(vals) / len(vals) if vals else 0.0


#: The series each other series' speedup is printed against, when measured.
BASELINES = ("torch", "mpich")


def format_summary(rows: Sequence[dict[str, Any]], algos: Sequence[str]) -> str:
    """The closing lines: out-of-bounds count, overall and per-algo average
    bus bandwidth (the bound rows aside); then, with several algos, each
    one's speedup over each of :data:`BASELINES` measured (its time / the
    algo's time) at the smallest and largest size, and with bound rows
    (bounds.py) each algo's busbw at the largest size as a fraction of each
    bound's, with the bounds' traffic (bytes read + written per second);
    and each algo's per-call p99 over its median at both ends (the noise a
    difference between two series must exceed)."""
    bounds = [r for r in rows if r.get("bound")]
    rows = [r for r in rows if not r.get("bound")]
    wrong = sum(r["wrong"] or 0 for r in rows)
    lines = [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
             f"# Avg bus bandwidth    : {avg_busbw(rows):g}"]
    if len(algos) > 1:
        for a in algos:
            mine = [r for r in rows if r["algo"] == a]
            if mine:
                lines.append(f"#   {a:<19}: {avg_busbw(mine):g}")
    # Ratios compare rows of one placement (the first one measured).
    first = [r for r in rows if r["in_place"] == rows[0]["in_place"]] if rows else []
    by = {(r["algo"], r["size"]): r for r in first}
    sizes = sorted({r["size"] for r in first})
    for baseline in (b for b in BASELINES if b in algos):
        others = [a for a in algos if a != baseline]
        parts = []
        for size in dict.fromkeys(sizes[:1] + sizes[-1:]):
            base = by.get((baseline, size))
            got = [f"{a} {base['time_us'] / by[(a, size)]['time_us']:.1f}x" for a in others
                   if base and (a, size) in by and by[(a, size)]["time_us"] > 0]
            if got:
                parts.append(f"{format_size(size)}: " + ", ".join(got))
        if parts:
            lines.append(f"# Speedup over {baseline} (time ratio): " + "; ".join(parts))
    ends = list(dict.fromkeys(sizes[:1] + sizes[-1:]))
    spread = [f"{a} " + " ".join(f"{by[(a, s)]['p99_us'] / by[(a, s)]['time_us']:.2f}" for s in ends)
              for a in algos
              if all((a, s) in by and by[(a, s)].get("p99_us") and by[(a, s)]["time_us"] > 0
                     for s in ends)]
    if spread:
        lines.append("# per-call p99 / p50 at " + " and ".join(format_size(s) for s in ends) + ": "
                     + ", ".join(spread))
    sent = [(a, by[(a, sizes[-1])]["sent_bytes"]) for a in algos
            if sizes and by.get((a, sizes[-1]), {}).get("sent_bytes") is not None]
    if any(a.startswith("wire_") for a, _ in sent):
        ring = dict(sent).get("ring")
        where = " (between hosts on shm+gloo)" if any(r["transport"] == "shm+gloo" for r in first) else ""
        lines.append(f"# bytes sent per rank per call{where} at {format_size(sizes[-1])}: " + ", ".join(
            f"{a} {b / 1e6:.3g} MB" + (f" ({b / ring:.2f}x ring)" if ring and a != "ring" else "")
            for a, b in sent))
    for b in (r for r in bounds if sizes and r["size"] == sizes[-1] and r["busbw"] > 0):
        got = [f"{a} {by[(a, b['size'])]['busbw'] / b['busbw']:.0%}" for a in algos
               if (a, b["size"]) in by]
        lines.append(f"# busbw / {b['algo']} busbw at {format_size(b['size'])} "
                     f"(copy traffic {b['traffic_GBps']:.2f} GB/s read + written per rank): "
                     + ", ".join(got))
    lines.append("#")
    return "\n".join(lines)


# ------------------------------------------------------------------ JSON

def git_commit(measured: Sequence[str] = ()) -> str:
    """The commit of the checkout pycomm runs from, for a result file:
    "<sha>-dirty" when the code it measures (``csrc``, ``pycomm`` and the
    ``measured`` paths, relative to the checkout) has uncommitted changes (not
    the result files a study rewrites); "unknown" outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    if not ((root / "csrc").is_dir() and (root / "pycomm").is_dir()):
        return "unknown"  # an installed copy, not a source checkout
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "csrc",
                                "pycomm", *measured], capture_output=True, text=True).stdout
        return sha + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_json(path: str, meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    """Writes ``{"schema", "meta", "rows"}``; every row has :data:`ROW_KEYS`."""
    for r in rows:
        missing = [k for k in ROW_KEYS if k not in r]
        if missing:
            raise ValueError(f"row is missing {missing}: {r}")
    with open(path, "w") as f:
        json.dump({"schema": SCHEMA, "meta": meta, "rows": list(rows)}, f, indent=1)
        f.write("\n")


def load_json(path: str) -> dict[str, Any]:
    """Reads a ``--json`` file back (checks the schema tag)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or "rows" not in data:
        raise ValueError(f"{path} is not a pycomm.bench results file (schema {SCHEMA})")
    return data


# ------------------------------------------------------------------ plot

def plot_results(data: dict[str, Any], path: str) -> None:
    """Left: busbw vs message size (log x), one line per algo (and
    placement) and peer, with the bounds in gray (bounds.py; one core:
    dotted, every rank at once: dash-dot); the y axis turns logarithmic when
    the values span more than 100x.
    Right: time vs size (log-log), where latency floors show, with a cross
    where each classic all-reduce algorithm's time crosses the ring's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, rows = data.get("meta", {}), data["rows"]
    fig, (ax, axt) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=110,
                                  gridspec_kw={"width_ratios": [3, 2]})
    series: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault((r["algo"], r["in_place"]), []).append(r)
    placements = {ip for (a, ip), pts in series.items() if not pts[0].get("bound")}
    for (algo, ip), pts in sorted(series.items(), key=lambda kv: (kv[0][0], not kv[0][1])):
        pts.sort(key=lambda r: r["size"])
        bound = bool(pts[0].get("bound"))
        label = _series_label(algo, pts[0]["transport"], bound)
        if len(placements) > 1 and not bound:
            label += f", {_placement(ip)}"
        style: dict[str, Any] = {"marker": "o", "markersize": 4, "linestyle": "-" if ip else "--"}
        if bound:
            style = {"color": "gray", "marker": ".", "linewidth": 1.5,
                     "linestyle": ":" if algo.endswith("core") else "-."}
        line, = ax.plot([r["size"] for r in pts], [r["busbw"] for r in pts], label=label, **style)
        axt.plot([r["size"] for r in pts], [r["time_us"] for r in pts],
                 label=label, **{**style, "color": line.get_color()})
    _mark_crossovers(axt, rows)
    sizes = sorted({r["size"] for r in rows})
    positive = [r["busbw"] for r in rows if r["busbw"] > 0]
    if positive and max(positive) / min(positive) > 100:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    for a in (ax, axt):
        a.set_xscale("log", base=2)
        if sizes:
            a.set_xticks(sizes)
            a.set_xticklabels([format_size(s) for s in sizes], rotation=45 if len(sizes) > 8 else 0)
        a.minorticks_off() if a is ax else None
        a.set_xlabel("message size (bytes)")
        a.grid(True, which="both", alpha=0.3)
    axt.set_yscale("log")
    axt.set_ylabel("time (us), max over ranks of median")
    axt.set_title("time per call")
    ax.set_ylabel("bus bandwidth (GB/s)")
    coll = meta.get("collective", rows[0]["collective"] if rows else "")
    n = meta.get("world_size", rows[0]["world_size"] if rows else "?")
    ax.set_title(f"{coll} busbw: {n} ranks, {meta.get('device', '')}, {meta.get('dtype', '')}")
    ax.legend(loc="best", fontsize=8)
    fig.suptitle(f"pycomm.bench on {meta.get('host', '?')} ({meta.get('cpu_count', '?')} cpus, "
                 f"torch {meta.get('torch', '?')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _mark_crossovers(axt: Any, rows: Sequence[dict[str, Any]]) -> None:
    """Marks on the time plot where each modelled all-reduce algorithm's
    measured time crosses the ring's (model.measured_crossovers): a cross at
    the crossing size, on the ring's line, labelled with the algorithm."""
    from .model import FORMULAS, measured_crossovers, measured_times

    times = measured_times(rows)
    ring = times.get("ring", {})
    for algo in (a for a in FORMULAS if a != "ring" and a in times):
        for n, mine in times[algo].items():
            if n not in ring:
                continue
            sizes = sorted(ring[n])
            for change in measured_crossovers(mine, ring[n]):
                # the ring's time at the crossing, interpolated in log-log
                lo = max((s for s in sizes if s <= change.size), default=sizes[0])
                hi = min((s for s in sizes if s >= change.size), default=sizes[-1])
                f = 0.0 if hi == lo else math.log(change.size / lo) / math.log(hi / lo)
                t = math.exp((1 - f) * math.log(ring[n][lo]) + f * math.log(ring[n][hi])) * 1e6
                axt.plot([change.size], [t], marker="x", color="black", markersize=7)
                axt.annotate(algo.split("_")[0], (change.size, t), fontsize=6,
                             textcoords="offset points", xytext=(3, 4))


def _series_label(algo: str, transport: str, bound: bool) -> str:
    """A series' name in the plot's legend."""
    if bound:
        return f"bound: {algo} (memmove in place, 2 x size read + written)"
    if algo == "torch":
        return f"torch.distributed ({transport})"
    if algo in PEER_SPECS:  # a peer's rows carry its name as their algo
        return PEER_SPECS[algo].title
    return f"pycomm {algo} ({transport})"


# ------------------------------------------------------------------ progress

class Progress:
    """A one-line bar on stderr, redrawn in place; ``clear()`` before
    printing a table row so the two do not mix."""

    def __init__(self, total: float, enabled: bool, stream: TextIO | None = None) -> None:
        self.total = max(total, 1e-9)
        self.done = 0.0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._drawn = False

    def advance(self, amount: float, label: str = "") -> None:
        self.done += amount
        self.draw(label)

    def draw(self, label: str = "") -> None:
        if not self.enabled:
            return
        frac = min(1.0, self.done / self.total)
        width = 30
        fill = int(math.floor(frac * width))
        self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {frac * 100:5.1f}% {label}\033[K")
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False
