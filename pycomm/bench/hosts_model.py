"""The two-level alpha-beta model of all-reduce across hosts: one link cost
inside a host (shm: ``alpha_intra``, ``beta_intra``), one between hosts
(gloo/TCP: ``alpha_inter``, ``beta_inter``). H hosts, L ranks each,
n = H*L, B bytes::

    flat ring         t = 2(n-1)·alpha_inter + 2(n-1)/n·B·beta_inter
                      (every step waits for the slowest link, and H of the
                       n links of a host-by-host ring cross hosts)
    hierarchical      t = 2(L-1)·alpha_intra + 2(L-1)/L·B·beta_intra      intra reduce-scatter
                                                                         + all-gather
                        + 2(H-1)·alpha_inter + 2(H-1)/H·(B/L)·beta_inter  inter all-reduce
                      (B <= SMALL_BYTES: 2(L-1)·alpha_intra + 2(L-1)/L·B·beta_intra
                       + the inter all-reduce of all B bytes)

The hierarchical terms are not written here: they are summed over the steps
the hierarchy itself runs (``pycomm._hierarchy.ALL_REDUCE_STEPS``), each a
ring collective of k ranks over P bytes: reduce-scatter and all-gather
(k-1) steps of P/k bytes, all-reduce 2(k-1) of them.

The fit uses one ``--hosts`` run (``python -m pycomm.bench allreduce --hosts
H --nproc L --json F``): the flat rows (algo "flat", pycomm's ring on
transport="gloo") fix the inter link; the hierarchical rows (transport
"shm+gloo") minus their inter part fix the intra link. Pure functions;
:func:`pycomm.bench.model_cli.main` prints :func:`format_hosts_report` for such
a file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .._hierarchy import all_reduce_steps
from .cli import format_size
from .model import Fit, fit_alpha_beta

__all__ = ["TwoLevel", "fit_two_level", "flat_time", "format_hosts_report", "hier_time"]

@dataclass(frozen=True)
class TwoLevel:
    """The two links' fits."""

    intra: Fit
    inter: Fit


#: Ring steps of each collective over k ranks, in units of (k-1).
_RING_STEPS = {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 2}


def _terms(comm: str, hosts: int, L: int, nbytes: float) -> tuple[float, float]:
    """Coefficients of (alpha, beta) of link ``comm`` ("intra" or "inter")
    in the hierarchical time: the sum over the hierarchy's own steps."""
    a = b = 0.0
    for step in all_reduce_steps(nbytes):
        if step.comm == comm:
            k = L if comm == "intra" else hosts
            steps = _RING_STEPS[step.op] * (k - 1)
            a += steps
            b += steps / k * (nbytes / L if step.shard else nbytes)
    return a, b


def flat_time(hosts: int, per_host: int, nbytes: float, model: TwoLevel) -> float:
    """Seconds of the flat ring over hosts*per_host ranks."""
    n = hosts * per_host
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * model.inter.alpha + 2 * (n - 1) / n * nbytes * model.inter.beta


def hier_time(hosts: int, per_host: int, nbytes: float, model: TwoLevel) -> float:
    """Seconds of the shm+gloo hierarchy (module docstring)."""
    a_i, b_i = _terms("intra", hosts, per_host, nbytes)
    a_h, b_h = _terms("inter", hosts, per_host, nbytes)
    return (a_i * model.intra.alpha + b_i * model.intra.beta
            + a_h * model.inter.alpha + b_h * model.inter.beta)


def fit_two_level(rows: Sequence[dict[str, Any]], hosts: int, per_host: int) -> TwoLevel:
    """Fits both links to the rows of one ``--hosts`` run.

    Raises:
        ValueError: the run lacks flat or hierarchical all-reduce rows, or
            its layout has one host or one rank a host.
    """
    if hosts < 2 or per_host < 2:
        raise ValueError(f"the two-level fit needs >= 2 hosts of >= 2 ranks, got {hosts}x{per_host}")
    good = [r for r in rows if r.get("collective", "allreduce") == "allreduce"
            and not r.get("wrong") and r["time_us"] > 0]
    flat = [(r["world_size"], r["size"], r["time_us"] * 1e-6) for r in good if r["algo"] == "flat"]
    hier = [r for r in good if r.get("transport") == "shm+gloo"]
    if not flat or not hier:
        raise ValueError("the two-level fit needs rows of algo 'flat' and of transport "
                         "'shm+gloo' (python -m pycomm.bench allreduce --hosts H --nproc L)")
    inter = fit_alpha_beta(flat)
    no_intra = TwoLevel(Fit(0.0, 0.0, 0, 0.0), inter)
    # The intra link from what the inter part leaves of each hierarchical time,
    # written as ring samples of L ranks with the same coefficients.
    samples = []
    for r in hier:
        rest = r["time_us"] * 1e-6 - hier_time(hosts, per_host, r["size"], no_intra)
        a_i, b_i = _terms("intra", hosts, per_host, r["size"])
        if rest > 0:
            # fit_alpha_beta's ring over L ranks has coefficients 2(L-1), 2(L-1)/L*B:
            # scale time and bytes so that they match a_i, b_i.
            k = a_i / (2 * (per_host - 1))
            samples.append((per_host, b_i / (k * 2 * (per_host - 1) / per_host), rest / k))
    if len(samples) < 2:
        raise ValueError("the hierarchical times are no longer than their inter-host part; "
                         "the intra link cannot be fitted")
    return TwoLevel(fit_alpha_beta(samples), inter)


def format_hosts_report(model: TwoLevel, clusters: Sequence[tuple[int, int]],
                        sizes: Sequence[int], source: str = "") -> str:
    """The fitted links and the predicted times of flat ring vs hierarchy."""
    lines = [f"# two-level alpha-beta fit of all-reduce across hosts"
             f"{(' (' + source + ')') if source else ''}:",
             f"#{'link':>7}  {'points':>6}  {'alpha(us)':>10}  {'1/beta(GB/s)':>12}  {'rms rel err':>11}"]
    for name, f in (("intra", model.intra), ("inter", model.inter)):
        lines.append(f" {name:>7}  {f.points:6d}  {f.alpha * 1e6:10.2f}  {f.bandwidth_GBps:12.3f}  "
                     f"{f.rel_rms * 100:10.1f}%")
    lines += ["#", "# predicted all-reduce time (us): flat ring over every rank vs the hierarchy",
              f"#{'hosts':>6} {'x':>1} {'ranks':>5}  {'size':>6}  {'flat ring':>12}  "
              f"{'hierarchical':>12}  {'speedup':>7}"]
    for hosts, per_host in clusters:
        for b in sizes:
            tf, th = flat_time(hosts, per_host, b, model), hier_time(hosts, per_host, b, model)
            lines.append(f" {hosts:6d} x {per_host:5d}  {format_size(b):>6}  {tf * 1e6:12.1f}  "
                         f"{th * 1e6:12.1f}  {tf / th if th > 0 else float('inf'):6.1f}x")
    return "\n".join(lines)
