"""The alpha-beta cost model of all-reduce: fit it to measured rows, predict
larger worlds.

One step of a ring moves a chunk to the next rank: it costs a latency
``alpha`` (seconds) plus ``bytes * beta`` (seconds per byte). A ring
all-reduce of B bytes over n ranks is 2(n-1) steps of B/n bytes::

    ring              t = 2(n-1)·alpha + 2(n-1)/n·B·beta
    recursive doubling t = ceil(log2 n)·(alpha + B·beta)      (latency-optimal)
    halving-doubling  t = 2·ceil(log2 n)·alpha + 2(n-1)/n·B·beta
                      (Rabenseifner: recursive-halving reduce-scatter, then
                       recursive-doubling all-gather)

The fit is least squares on the ring formula over the measured sizes,
weighted by 1/t so that the microsecond-scale small messages (which fix
alpha) count as much as the large ones (which fix beta). Everything here is
a pure function; ``python -m pycomm.bench model RESULTS.json`` is
:func:`pycomm.bench.model_cli.main`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from .cli import format_size

__all__ = [
    "Fit",
    "fit_alpha_beta",
    "fit_rows",
    "halving_doubling_time",
    "predict",
    "recursive_doubling_time",
    "ring_allreduce_time",
]


def ring_allreduce_time(n: int, nbytes: float, alpha: float, beta: float) -> float:
    """Seconds of a ring all-reduce: 2(n-1)·alpha + 2(n-1)/n·bytes·beta."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


def recursive_doubling_time(n: int, nbytes: float, alpha: float, beta: float) -> float:
    """Seconds of recursive doubling: ceil(log2 n) steps exchanging the
    whole message."""
    if n <= 1:
        return 0.0
    return math.ceil(math.log2(n)) * (alpha + nbytes * beta)


def halving_doubling_time(n: int, nbytes: float, alpha: float, beta: float) -> float:
    """Seconds of Rabenseifner's all-reduce (recursive halving + doubling):
    the ring's bandwidth term with a logarithmic number of steps."""
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * alpha + 2 * (n - 1) / n * nbytes * beta


FORMULAS = {
    "ring": ring_allreduce_time,
    "rec-doubling": recursive_doubling_time,
    "halving-doubling": halving_doubling_time,
}


@dataclass(frozen=True)
class Fit:
    """alpha (s per step), beta (s per byte), the number of points and the
    root-mean-square relative error of the fit."""

    alpha: float
    beta: float
    points: int
    rel_rms: float

    @property
    def bandwidth_GBps(self) -> float:
        """1/beta in GB/s (the link bandwidth the model implies)."""
        return 1.0 / self.beta / 1e9 if self.beta > 0 else float("inf")


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


def fit_alpha_beta(samples: Iterable[tuple[int, float, float]], weighting: str = "relative") -> Fit:
    """Fits the ring formula to ``(world_size, bytes, seconds)`` samples.

    Args:
        weighting: "relative" (minimise relative error; default) or
            "absolute" (plain least squares on seconds).

    Raises:
        ValueError: fewer than two usable samples (world_size >= 2, t > 0),
            or an unknown weighting.
    """
    pts = [(int(n), float(b), float(t)) for n, b, t in samples if n >= 2 and t > 0]
    if len(pts) < 2:
        raise ValueError("the fit needs at least two measurements with world_size >= 2")
    if weighting not in ("relative", "absolute"):
        raise ValueError(f"weighting must be 'relative' or 'absolute', got {weighting!r}")
    X = np.array([[2.0 * (n - 1), 2.0 * (n - 1) / n * b] for n, b, _ in pts])
    y = np.array([t for _, _, t in pts])
    w = 1.0 / y if weighting == "relative" else np.ones_like(y)
    # Scale the beta column so both unknowns are O(1) for the solver.
    scale = np.array([1.0, 1.0 / max(float(X[:, 1].max()), 1.0)])
    theta = _lstsq(X * scale * w[:, None], y * w) * scale
    alpha, beta = float(theta[0]), float(theta[1])
    pred = X @ np.array([alpha, beta])
    rel_rms = float(np.sqrt(np.mean(((pred - y) / y) ** 2)))
    return Fit(alpha, beta, len(pts), rel_rms)


def fit_rows(rows: Sequence[dict[str, Any]], weighting: str = "relative") -> dict[str, Fit]:
    """One fit per algo from ``--json`` rows of all-reduce (rows with wrong
    results and the bounds' rows are left out; in-place and out-of-place
    rows pool together)."""
    by_algo: dict[str, list[tuple[int, float, float]]] = {}
    for r in rows:
        if r.get("collective", "allreduce") != "allreduce" or r.get("wrong") or r.get("bound"):
            continue
        by_algo.setdefault(r["algo"], []).append((r["world_size"], r["size"], r["time_us"] * 1e-6))
    if not by_algo:
        raise ValueError("no all-reduce rows to fit (the model is of all-reduce; run "
                         "`python -m pycomm.bench allreduce ... --json FILE`)")
    return {a: fit_alpha_beta(s, weighting) for a, s in by_algo.items()}


def predict(fit: Fit, worlds: Sequence[int], sizes: Sequence[int]) -> list[dict[str, Any]]:
    """Predicted all-reduce seconds per formula for every (world, size)."""
    out = []
    for n in worlds:
        for b in sizes:
            times = {name: f(n, b, fit.alpha, fit.beta) for name, f in FORMULAS.items()}
            out.append({"world_size": n, "size": b, **times, "best": min(times, key=times.__getitem__)})
    return out


def _fmt_us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:12.1f}" if us < 1e7 else f"{us:12.4g}"


def format_report(fits: dict[str, Fit], worlds: Sequence[int], sizes: Sequence[int],
                  source: str = "") -> str:
    lines = [f"# alpha-beta fit of all-reduce{(' (' + source + ')') if source else ''}:",
             "#   t = 2(n-1)*alpha + 2(n-1)/n*bytes*beta   (least squares, weighted 1/t)",
             f"#{'algo':>9}  {'points':>6}  {'alpha(us)':>10}  {'1/beta(GB/s)':>12}  {'rms rel err':>11}"]
    for algo, f in fits.items():
        lines.append(f" {algo:>9}  {f.points:6d}  {f.alpha * 1e6:10.2f}  {f.bandwidth_GBps:12.3f}  "
                     f"{f.rel_rms * 100:10.1f}%")
    lines += ["#",
              "# predicted all-reduce time (us) with these alpha and beta for larger worlds.",
              "# They are this run's link costs; a multi-host network has its own (measure it,",
              "# or pass --alpha-us/--bw-gbps to plan with the network's numbers).",
              f"#{'algo':>9}  {'ranks':>6}  {'size':>6}  " + "  ".join(f"{k:>12}" for k in FORMULAS)
              + f"  {'best':>16}"]
    for algo, f in fits.items():
        for p in predict(f, worlds, sizes):
            lines.append(f" {algo:>9}  {p['world_size']:6d}  {format_size(p['size']):>6}  "
                         + "  ".join(_fmt_us(p[k]) for k in FORMULAS) + f"  {p['best']:>16}")
    return "\n".join(lines)
