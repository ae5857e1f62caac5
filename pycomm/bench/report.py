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
            "algbw", "busbw", "wrong", "world_size", "transport", "device")

_DTYPE_NAMES = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16",
                "int32": "int32", "int64": "int64", "int8": "int8", "uint8": "uint8"}

_GROUP_W = 34  # width of one "time algbw busbw #wrong" column group


def _placement(in_place: bool) -> str:
    return "in-place" if in_place else "out-of-place"


def format_header(groups: Sequence[tuple[str, bool]]) -> str:
    """The three header lines; ``groups`` are the (algo, in_place) column
    groups in print order."""
    top = "#" + " " * 51 + "".join(f"{algo + ' ' + _placement(ip):>{_GROUP_W}}" for algo, ip in groups)
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


def format_summary(rows: Sequence[dict[str, Any]], algos: Sequence[str],
                   memcpy_gbps: float | None = None, memcpy_all_gbps: float | None = None,
                   baseline: str = "torch", memcpy_beside_gbps: float | None = None) -> str:
    """The closing lines: out-of-bounds count, overall and per-algo average
    bus bandwidth; then, with several algos, each algo's speedup over
    ``baseline`` (its time / the algo's time) at the smallest and largest
    size, and with ``memcpy_gbps`` (one rank copying alone, before the
    sweep), ``memcpy_beside_gbps`` (the same, timed in the largest size's
    rounds) and ``memcpy_all_gbps`` (every rank copying at once) each algo's
    busbw at the largest size as a fraction of those memcpy bandwidths."""
    wrong = sum(r["wrong"] or 0 for r in rows)
    lines = [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
             f"# Avg bus bandwidth    : {avg_busbw(rows):g}"]
    if len(algos) > 1:
        for a in algos:
            mine = [r for r in rows if r["algo"] == a]
            if mine:
                lines.append(f"#   {a:<8}           : {avg_busbw(mine):g}")
    # Ratios compare rows of one placement (the first one measured).
    first = [r for r in rows if r["in_place"] == rows[0]["in_place"]] if rows else []
    by = {(r["algo"], r["size"]): r for r in first}
    sizes = sorted({r["size"] for r in first})
    others = [a for a in algos if a != baseline]
    if baseline in algos and others and sizes:
        parts = []
        for size in dict.fromkeys((sizes[0], sizes[-1])):
            base = by.get((baseline, size))
            got = [f"{a} {base['time_us'] / by[(a, size)]['time_us']:.1f}x" for a in others
                   if base and (a, size) in by and by[(a, size)]["time_us"] > 0]
            if got:
                parts.append(f"{format_size(size)}: " + ", ".join(got))
        if parts:
            lines.append(f"# Speedup over {baseline} (time ratio): " + "; ".join(parts))
    beside = f"memcpy timed in the same rounds ({memcpy_beside_gbps or 0:.2f} GB/s)"
    for bound, what in ((memcpy_gbps, "memcpy bandwidth"), (memcpy_beside_gbps, beside),
                        (memcpy_all_gbps, "memcpy of every rank at once")):
        if bound and sizes:
            got = [f"{a} {by[(a, sizes[-1])]['busbw'] / bound:.0%}" for a in algos
                   if (a, sizes[-1]) in by]
            lines.append(f"# busbw / {what} at {format_size(sizes[-1])}: " + ", ".join(got))
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
    placement), with the measured memcpy bandwidths (one rank alone: dotted;
    every rank at once: dash-dot) as reference lines; the y axis turns
    logarithmic when the values span more than 100x.
    Right: time vs size (log-log), where latency floors show."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, rows = data.get("meta", {}), data["rows"]
    fig, (ax, axt) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=110,
                                  gridspec_kw={"width_ratios": [3, 2]})
    series: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault((r["algo"], r["in_place"]), []).append(r)
    placements = {ip for _, ip in series}
    for (algo, ip), pts in sorted(series.items(), key=lambda kv: (kv[0][0], not kv[0][1])):
        pts.sort(key=lambda r: r["size"])
        tr = pts[0]["transport"]
        label = f"torch.distributed ({tr})" if algo == "torch" else f"pycomm {algo} ({tr})"
        if len(placements) > 1:
            label += f", {_placement(ip)}"
        style = {"marker": "o", "markersize": 4, "linestyle": "-" if ip else "--"}
        line, = ax.plot([r["size"] for r in pts], [r["busbw"] for r in pts], label=label, **style)
        axt.plot([r["size"] for r in pts], [r["time_us"] for r in pts], color=line.get_color(),
                 label=label, **style)
    bounds = [(meta.get("memcpy_GBps"), ":", "1 rank"),
              (meta.get("memcpy_all_ranks_GBps"), "-.", "every rank at once")]
    for bw, dashes, who in bounds:
        if bw:
            ax.axhline(bw, color="gray", linestyle=dashes, linewidth=1.5,
                       label=f"memcpy {bw:.2f} GB/s (measured, {who})")
    sizes = sorted({r["size"] for r in rows})
    positive = [r["busbw"] for r in rows if r["busbw"] > 0] + [bw for bw, _, _ in bounds if bw]
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
