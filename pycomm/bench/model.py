"""The alpha-beta cost model of all-reduce: fit each algorithm's own formula
to its measured rows, compare predicted and measured crossovers, predict
the fastest algorithm for larger worlds.

One message between two ranks costs a latency ``alpha`` (seconds) plus
``bytes * beta`` (seconds per byte). An all-reduce of B bytes over n ranks
then costs ``a(n)·alpha + b(n)·B·beta``, with coefficients that are the
algorithm's (:data:`FORMULAS`; p2 = the largest power of two <= n, fold = 0
if n == p2 else 1: a world that is not a power of two folds first, two
extra steps of the whole vector; depth = floor(log2 n))::

    algo                a(n) (alpha)             b(n) (B·beta)
    ring                2(n-1)                   2(n-1)/n
    recursive_doubling  log2(p2) + 2·fold        log2(p2) + 2·fold
    halving_doubling    2·log2(p2) + 2·fold      2(p2-1)/p2 + 2·fold
    tree                2·depth                  2·min(2, n-1)
                        (pipelined binary tree, children 2r+1 and 2r+2:
                         reduce to rank 0, broadcast down, in slices)

The fit is a non-negative least squares of that formula over the measured
(world size, bytes, seconds) of one algorithm, weighted by 1/t so that the
microsecond-scale small messages (which fix alpha) count as much as the
large ones (which fix beta). Algorithms without a formula of their own
(``auto``, ``torch``, ``symmetric``, ``flat``, ``nccl``, ...) are fitted
with the ring's, so that the fit table still shows their alpha and
bandwidth, and are left out of the crossovers and of the prediction table:
their times are not a formula of n.

At one world size an algorithm's fit is a line in the size,
``t = A + B·size`` (A = a(n)·alpha, B = b(n)·beta): two algorithms'
lines cross at most once (:func:`line_crossover`); the measured times may
change order several times (:func:`measured_crossovers`).

Everything here is a pure function; the ``format_*`` functions only lay
out what the others computed. ``python -m pycomm.bench model RESULTS.json``
is :func:`pycomm.bench.model_cli.main`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from .cli import format_size

__all__ = [
    "FORMULAS",
    "Cell",
    "Crossover",
    "Fit",
    "Formula",
    "OrderChange",
    "allreduce_time",
    "crossovers",
    "fit_alpha_beta",
    "fit_rows",
    "format_crossovers",
    "format_fits",
    "format_predictions",
    "format_report",
    "line_crossover",
    "measured_crossovers",
    "measured_times",
    "predict_best",
    "ring_allreduce_time",
]


@dataclass(frozen=True)
class Formula:
    """An algorithm's cost: ``t = alpha_coef(n)·alpha + beta_coef(n)·bytes·beta``."""

    alpha_coef: Callable[[int], float]
    beta_coef: Callable[[int], float]
    #: The formula as printed above the fit table.
    text: str

    def time(self, n: int, nbytes: float, alpha: float, beta: float) -> float:
        """Seconds of one all-reduce of ``nbytes`` over ``n`` ranks (0 for n <= 1)."""
        if n <= 1:
            return 0.0
        return self.alpha_coef(n) * alpha + self.beta_coef(n) * nbytes * beta


def _log2_p2(n: int) -> int:
    """log2 of the largest power of two <= n (n >= 1)."""
    return n.bit_length() - 1


def _fold(n: int) -> int:
    """1 if n is not a power of two (the extra ranks fold in first), else 0."""
    return 0 if n & (n - 1) == 0 else 1


#: Each modelled algorithm's cost (the module docstring's table), by its
#: ``--algo`` name. The ring comes first: it is the formula of the rest.
FORMULAS: dict[str, Formula] = {
    "ring": Formula(lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n,
                    "2(n-1)·alpha + 2(n-1)/n·B·beta"),
    "recursive_doubling": Formula(lambda n: _log2_p2(n) + 2 * _fold(n),
                                  lambda n: _log2_p2(n) + 2 * _fold(n),
                                  "(log2 p2 + 2 fold)·(alpha + B·beta)"),
    "halving_doubling": Formula(lambda n: 2 * _log2_p2(n) + 2 * _fold(n),
                                lambda n: 2 * ((1 << _log2_p2(n)) - 1) / (1 << _log2_p2(n)) + 2 * _fold(n),
                                "(2 log2 p2 + 2 fold)·alpha + (2(p2-1)/p2 + 2 fold)·B·beta"),
    "tree": Formula(lambda n: 2 * _log2_p2(n), lambda n: 2 * min(2, n - 1),
                    "2 depth·alpha + 2 min(2, n-1)·B·beta"),
}

#: The formula of algorithms that have none of their own.
DEFAULT_FORMULA = "ring"


def allreduce_time(algo: str, n: int, nbytes: float, alpha: float, beta: float) -> float:
    """Seconds of ``algo``'s all-reduce (a name in :data:`FORMULAS`).

    Raises:
        KeyError: ``algo`` has no formula.
    """
    return FORMULAS[algo].time(n, nbytes, alpha, beta)


def ring_allreduce_time(n: int, nbytes: float, alpha: float, beta: float) -> float:
    """Seconds of a ring all-reduce: 2(n-1)·alpha + 2(n-1)/n·bytes·beta."""
    return FORMULAS["ring"].time(n, nbytes, alpha, beta)


@dataclass(frozen=True)
class Fit:
    """alpha (s per step), beta (s per byte), the number of points, the
    root-mean-square relative error of the fit and the name of the formula
    (in :data:`FORMULAS`) it was fitted with."""

    alpha: float
    beta: float
    points: int
    rel_rms: float
    formula: str = DEFAULT_FORMULA

    @property
    def bandwidth_GBps(self) -> float:
        """1/beta in GB/s (the link bandwidth the model implies)."""
        return 1.0 / self.beta / 1e9 if self.beta > 0 else float("inf")

    def line(self, n: int) -> tuple[float, float]:
        """(A, B) of ``t = A + B·bytes`` at ``n`` ranks."""
        f = FORMULAS[self.formula]
        return f.alpha_coef(n) * self.alpha, f.beta_coef(n) * self.beta

    def time(self, n: int, nbytes: float) -> float:
        """Predicted seconds at ``n`` ranks and ``nbytes``."""
        return FORMULAS[self.formula].time(n, nbytes, self.alpha, self.beta)


def _lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with both coefficients kept >= 0 (a 2-variable NNLS:
    if the free solution has a negative coefficient, fit the other alone)."""
    theta, *_ = np.linalg.lstsq(X, y, rcond=None)
    if (theta >= 0).all():
        return theta
    best, best_err = np.zeros(2), float(np.sum(y * y))
    for j in range(2):
        col = X[:, j]
        denom = float(col @ col)
        if denom <= 0:
            continue
        c = max(0.0, float(col @ y) / denom)
        cand = np.zeros(2)
        cand[j] = c
        err = float(np.sum((X @ cand - y) ** 2))
        if err < best_err:
            best, best_err = cand, err
    return best


def fit_alpha_beta(samples: Iterable[tuple[int, float, float]], weighting: str = "relative",
                   formula: str = DEFAULT_FORMULA) -> Fit:
    """Fits ``formula`` (a name in :data:`FORMULAS`; the ring's by default)
    to ``(world_size, bytes, seconds)`` samples.

    Args:
        weighting: "relative" (minimise relative error; default) or
            "absolute" (plain least squares on seconds).

    Raises:
        ValueError: fewer than two usable samples (world_size >= 2, t > 0),
            an unknown weighting or formula.
    """
    if formula not in FORMULAS:
        raise ValueError(f"no formula {formula!r}; choose from {', '.join(FORMULAS)}")
    f = FORMULAS[formula]
    pts = [(int(n), float(b), float(t)) for n, b, t in samples if n >= 2 and t > 0]
    if len(pts) < 2:
        raise ValueError("the fit needs at least two measurements with world_size >= 2")
    if weighting not in ("relative", "absolute"):
        raise ValueError(f"weighting must be 'relative' or 'absolute', got {weighting!r}")
    X = np.array([[f.alpha_coef(n), f.beta_coef(n) * b] for n, b, _ in pts])
    y = np.array([t for _, _, t in pts])
    w = 1.0 / y if weighting == "relative" else np.ones_like(y)
    # Scale the beta column so both unknowns are O(1) for the solver.
    scale = np.array([1.0, 1.0 / max(float(X[:, 1].max()), 1.0)])
    theta = _lstsq(X * scale * w[:, None], y * w) * scale
    alpha, beta = float(theta[0]), float(theta[1])
    pred = X @ np.array([alpha, beta])
    rel_rms = float(np.sqrt(np.mean(((pred - y) / y) ** 2)))
    return Fit(alpha, beta, len(pts), rel_rms, formula)


def _allreduce_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows the model uses: all-reduce, no wrong elements, not a bound
    (a row with ``bound`` set times a copy beside the algorithms, not one)."""
    return [r for r in rows if r.get("collective", "allreduce") == "allreduce"
            and not r.get("wrong") and not r.get("bound")]


def _series(row: dict[str, Any], across: bool) -> str:
    """The algorithm a row is modelled as. In a run across hosts (``across``:
    some row on shm+gloo) "ring" is the composition (shared memory inside a
    host, the ring between hosts: not the ring's formula of n, so named
    "ring (shm+gloo)" and fitted with it as "auto" is), and "flat", the ring
    over every rank on gloo, is the ring the classic algorithms (flat there
    too) are compared with."""
    algo = row["algo"]
    if across and algo == "flat":
        return "ring"
    if algo == "ring" and row.get("transport") == "shm+gloo":  # across hosts by itself
        return "ring (shm+gloo)"
    return algo


def _across_hosts(rows: Sequence[dict[str, Any]]) -> bool:
    return any(r.get("transport") == "shm+gloo" for r in rows)


def fit_rows(rows: Sequence[dict[str, Any]], weighting: str = "relative") -> dict[str, Fit]:
    """One fit per algo from ``--json`` rows of all-reduce, each with its own
    formula (the ring's for algos without one; see :attr:`Fit.formula`).
    Rows with wrong results and the bounds' rows are left out; in-place
    and out-of-place rows pool together. Across hosts the flat ring is
    "ring" (:func:`_series`).

    Raises:
        ValueError: no all-reduce rows, or an algo with fewer than two.
    """
    by_algo: dict[str, list[tuple[int, float, float]]] = {}
    across = _across_hosts(rows)
    for r in _allreduce_rows(rows):
        by_algo.setdefault(_series(r, across), []).append((r["world_size"], r["size"], r["time_us"] * 1e-6))
    if not by_algo:
        raise ValueError("no all-reduce rows to fit (the model is of all-reduce; run "
                         "`python -m pycomm.bench allreduce ... --json FILE`)")
    return {a: fit_alpha_beta(s, weighting, a if a in FORMULAS else DEFAULT_FORMULA)
            for a, s in by_algo.items()}


def measured_times(rows: Sequence[dict[str, Any]]) -> dict[str, dict[int, dict[int, float]]]:
    """algo (as :func:`_series` names it) -> world size -> bytes -> seconds
    of the all-reduce rows (the mean where in-place and out-of-place rows
    share a size)."""
    acc: dict[str, dict[int, dict[int, list[float]]]] = {}
    across = _across_hosts(rows)
    for r in _allreduce_rows(rows):
        by_size = acc.setdefault(_series(r, across), {}).setdefault(int(r["world_size"]), {})
        by_size.setdefault(int(r["size"]), []).append(r["time_us"] * 1e-6)
    return {a: {n: {b: sum(ts) / len(ts) for b, ts in sizes.items()} for n, sizes in worlds.items()}
            for a, worlds in acc.items()}


def line_crossover(a: tuple[float, float], b: tuple[float, float]) -> float | None:
    """The size (bytes) where lines ``t = A + B·size`` a and b cross, or
    None where one is at least as fast at every size from one byte on (a
    crossing below one byte, such as two equal A's fitted a rounding error
    apart, is none)."""
    (a0, a1), (b0, b1) = a, b
    if a1 == b1:
        return None
    s = (b0 - a0) / (a1 - b1)
    return s if s >= 1 else None


class OrderChange(NamedTuple):
    """A measured crossover: the size where two algorithms' order changes,
    and whether the first one is the faster below it."""

    size: float
    first_faster_below: bool


def measured_crossovers(first: Mapping[int, float], second: Mapping[int, float]) -> list[OrderChange]:
    """Where the sign of t_first - t_second changes between consecutive
    sizes measured by both, in size order.

    Between two sizes the crossing is interpolated linearly in
    (log size, log t_first/t_second). A run of equal times between opposite
    orders gives the geometric middle of that run.
    """
    sizes = sorted(s for s in first if s in second and s > 0 and first[s] > 0 and second[s] > 0)
    logs = [math.log(s) for s in sizes]
    ratio = [math.log(first[s] / second[s]) for s in sizes]
    out: list[OrderChange] = []
    prev = None  # index of the last size with a strict order
    for i, r in enumerate(ratio):
        if r == 0:
            continue
        if prev is not None and (ratio[prev] < 0) != (r < 0):
            if i == prev + 1:
                x = logs[prev] + (logs[i] - logs[prev]) * ratio[prev] / (ratio[prev] - r)
            else:  # equal at the sizes between
                x = (logs[prev + 1] + logs[i - 1]) / 2
            out.append(OrderChange(math.exp(x), ratio[prev] < 0))
        prev = i
    return out


@dataclass(frozen=True)
class Crossover:
    """Predicted and measured crossovers of two modelled algorithms at one
    world size. ``first`` is the one predicted faster below ``predicted``
    (faster at every size when ``predicted`` is None)."""

    world_size: int
    first: str
    second: str
    #: bytes where the fitted lines cross; None: ``first`` faster everywhere
    predicted: float | None
    measured: tuple[OrderChange, ...]

    @property
    def ratio(self) -> float | None:
        """predicted / the nearest (in log size) measured crossover where
        ``first`` is the faster below; None without both."""
        same = [c.size for c in self.measured if c.first_faster_below]
        if self.predicted is None or not same:
            return None
        p = self.predicted
        return p / min(same, key=lambda s: abs(math.log(s / p)))


def crossovers(fits: Mapping[str, Fit], times: Mapping[str, Mapping[int, Mapping[int, float]]]
               ) -> list[Crossover]:
    """Every pair of modelled algorithms (in :data:`FORMULAS` order) that
    were fitted and measured at a common world size, per such world size.

    Args:
        fits: :func:`fit_rows`' answer.
        times: :func:`measured_times`' answer.
    """
    algos = [a for a in FORMULAS if a in fits and fits[a].formula == a and a in times]
    out = []
    for a, b in combinations(algos, 2):
        for n in sorted(n for n in set(times[a]) & set(times[b]) if n >= 2):
            la, lb = fits[a].line(n), fits[b].line(n)
            pred = line_crossover(la, lb)
            if pred is None:  # first = the faster from one byte on (the smaller B on a tie)
                a_first = (la[0] + la[1], la[1]) <= (lb[0] + lb[1], lb[1])
            else:  # first = the faster below the crossing
                a_first = la[0] < lb[0]
            first, second = (a, b) if a_first else (b, a)
            measured = measured_crossovers(times[first][n], times[second][n])
            out.append(Crossover(n, first, second, pred, tuple(measured)))
    return out


@dataclass(frozen=True)
class Cell:
    """One (world size, bytes) of the prediction table: each algorithm's
    predicted seconds and the fastest."""

    world_size: int
    size: int
    times: dict[str, float]
    best: str


def predict_best(fits: Mapping[str, Fit], worlds: Sequence[int], sizes: Sequence[int]) -> list[Cell]:
    """For every (world, size), each modelled algorithm's time from its own
    fit in its own formula, and the fastest (the first in :data:`FORMULAS`
    order on a tie). Fits of algos without a formula are left out.

    Raises:
        ValueError: no fit of a modelled algorithm.
    """
    own = [a for a in FORMULAS if a in fits and fits[a].formula == a]
    if not own:
        raise ValueError("no fit of a modelled algorithm (" + ", ".join(FORMULAS) + ")")
    cells = []
    for n in worlds:
        for b in sizes:
            times = {a: fits[a].time(n, b) for a in own}
            cells.append(Cell(n, b, times, min(own, key=times.__getitem__)))
    return cells


# ---------------------------------------------------------------- formatting

def _fmt_bytes(nbytes: float) -> str:
    """A crossover size: 3 significant digits, binary suffix ("12.3K", "285K")."""
    value, suffix = nbytes, "B"
    for s, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= mult:
            value, suffix = nbytes / mult, s
            break
    return (f"{value:.0f}" if value >= 100 else f"{value:.3g}") + suffix


def format_fits(fits: Mapping[str, Fit], source: str = "") -> str:
    """The fit table: algo, formula, points, alpha, 1/beta, rms relative error."""
    used = [f for f in FORMULAS if any(fit.formula == f for fit in fits.values())]
    lines = [f"# alpha-beta fit of all-reduce{(' (' + source + ')') if source else ''},",
             "# each algorithm's own formula (least squares, weighted 1/t, alpha and beta >= 0):"]
    lines += [f"#   {f:<18}  t = {FORMULAS[f].text}" for f in used]
    if any(f != "ring" for f in used):
        lines.append("#   (p2 = the largest power of two <= n, fold = 0 if n == p2 else 1, "
                     "depth = floor(log2 n))")
    lines.append(f"#{'algo':>19}  {'formula':>19}  {'points':>6}  {'alpha(us)':>10}  "
                 f"{'1/beta(GB/s)':>12}  {'rms rel err':>11}")
    borrowed = False
    for algo, f in fits.items():
        label = f.formula if f.formula == algo else f.formula + "*"
        borrowed |= f.formula != algo
        lines.append(f" {algo:>19}  {label:>19}  {f.points:6d}  {f.alpha * 1e6:10.2f}  "
                     f"{f.bandwidth_GBps:12.3f}  {f.rel_rms * 100:10.1f}%")
    if borrowed:
        lines.append("#   * no formula of its own: fitted with the ring's, not in the crossovers "
                     "or predictions")
    return "\n".join(lines)


def format_crossovers(found: Sequence[Crossover]) -> str:
    """Predicted and measured crossovers side by side, one pair a line."""
    lines = ["# crossovers: the size where two algorithms take equal time.",
             "#   predicted: where their fitted lines t = A + B*size cross (each its own fit at n ranks);",
             "#   measured: where the measured times change order between consecutive sizes",
             "#   (log-interpolated). In 'x / y' x is predicted faster below the crossover (everywhere",
             "#   if none); a measured size marked ^ is a change the other way (y faster below it).",
             "#   pred/meas: against the nearest measured change the same way."]
    if not found:
        return "\n".join(lines + ["#   (no two modelled algorithms measured at the same world size: "
                                  "run --algo all)"])
    rows = []
    for c in found:
        pred = "none" if c.predicted is None else _fmt_bytes(c.predicted)
        meas = ",".join(_fmt_bytes(m.size) + ("" if m.first_faster_below else "^")
                        for m in c.measured) or "none"
        rows.append((c.world_size, f"{c.first} / {c.second}", pred, meas,
                     "-" if c.ratio is None else f"{c.ratio:.2f}"))
    wp = max(len(r[1]) for r in rows)
    wm = max(8, *(len(r[3]) for r in rows))
    lines.append(f"#{'ranks':>5}  {'pair':<{wp}}  {'predicted':>9}  {'measured':>{wm}}  {'pred/meas':>9}")
    lines += [f" {n:5d}  {pair:<{wp}}  {pred:>9}  {meas:>{wm}}  {ratio:>9}"
              for n, pair, pred, meas, ratio in rows]
    return "\n".join(lines)


def format_predictions(cells: Sequence[Cell], given: tuple[float, float] | None = None) -> str:
    """One line per world size: the algorithm predicted fastest at each size.

    Args:
        given: (alpha, beta) when ``cells`` were predicted with one given
            link for every algorithm instead of the fits (said so above).
    """
    worlds = list(dict.fromkeys(c.world_size for c in cells))
    sizes = list(dict.fromkeys(c.size for c in cells))
    best = {(c.world_size, c.size): c.best for c in cells}
    algos = list(cells[0].times) if cells else []
    lines = [f"# predicted fastest all-reduce at n ranks, of {', '.join(algos)}:"]
    if given is None:
        lines += ["#   each algorithm's fitted alpha and beta in its own formula. They are this run's",
                  "#   link costs; a multi-host network has its own (measure it, or pass",
                  "#   --alpha-us/--bw-gbps to plan with the network's numbers)."]
    else:
        lines += [f"#   every algorithm's formula with alpha {given[0] * 1e6:g} us and 1/beta "
                  f"{1e-9 / given[1]:g} GB/s (--alpha-us, --bw-gbps), not the fits."]
    lines.append(f"#{'ranks':>5}  " + "  ".join(f"{format_size(b):>18}" for b in sizes))
    for n in worlds:
        lines.append(f" {n:5d}  " + "  ".join(f"{best[(n, b)]:>18}" for b in sizes))
    return "\n".join(lines)


def format_report(fits: Mapping[str, Fit], found: Sequence[Crossover], cells: Sequence[Cell],
                  source: str = "", given: tuple[float, float] | None = None) -> str:
    """The fit table, the crossovers, then the prediction table (left out
    when ``cells`` is empty; ``given`` as :func:`format_predictions`)."""
    parts = [format_fits(fits, source), "#", format_crossovers(found)]
    if cells:
        parts += ["#", format_predictions(cells, given)]
    return "\n".join(parts)
