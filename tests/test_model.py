"""Tests of pycomm.bench.model (and its command line, model_cli): each
algorithm's formula, the per-algorithm fit, predicted and measured
crossovers, the prediction table and the printed report. Never on time:
every number comes from a formula or from the recorded file in tests/data."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pycomm.bench import hosts_model, model, model_cli, report
from pycomm.bench.model import Fit, OrderChange

DATA = Path(__file__).resolve().parent / "data"

#: Known link costs per algorithm (distinct, so that a fit that mixed the
#: algorithms up would show).
TRUE = {
    "ring": (10e-6, 1 / 5e9),
    "recursive_doubling": (12e-6, 1 / 4e9),
    "halving_doubling": (8e-6, 1 / 6e9),
    "tree": (15e-6, 1 / 10e9),
}
SIZES = [1 << k for k in range(10, 27, 2)]  # 1K .. 64M, x4


def _row(algo: str = "ring", size: int = 1024, time_us: float = 10.0, world_size: int = 2, **kw):
    r = {"collective": "allreduce", "size": size, "count": size // 4, "dtype": "float32", "op": "sum",
         "root": -1, "algo": algo, "in_place": True, "time_us": time_us, "p50_us": time_us,
         "p99_us": time_us, "algbw": 0.0, "busbw": 0.0,
         "wrong": 0, "world_size": world_size, "transport": "shm", "device": "cpu"}
    r.update(kw)
    return r


def _synthetic_rows(worlds, algos=tuple(TRUE), sizes=SIZES):
    """Rows whose times are each algorithm's formula with its TRUE costs."""
    return [_row(a, b, model.allreduce_time(a, n, b, *TRUE[a]) * 1e6, n)
            for a in algos for n in worlds for b in sizes]


# ------------------------------------------------------------------ formulas

def test_formula_coefficients():
    """(alpha coefficient, beta coefficient) at n = 1..8, as the module
    docstring's table gives them (the fold shows at 3, 5, 6, 7)."""
    grid = {a: [(f.alpha_coef(n), f.beta_coef(n)) for n in range(2, 9)] for a, f in model.FORMULAS.items()}
    assert grid == {
        #                      n=2        3           4          5            6            7            8
        "ring":               [(2, 1.0), (4, 4 / 3), (6, 1.5), (8, 8 / 5), (10, 10 / 6), (12, 12 / 7),
                               (14, 1.75)],
        "recursive_doubling": [(1, 1), (3, 3), (2, 2), (4, 4), (4, 4), (4, 4), (3, 3)],
        "halving_doubling":   [(2, 1.0), (4, 3.0), (4, 1.5), (6, 3.5), (6, 3.5), (6, 3.5), (6, 1.75)],
        "tree":               [(2, 2), (2, 4), (4, 4), (4, 4), (4, 4), (4, 4), (6, 4)],
    }
    for algo in model.FORMULAS:
        assert model.allreduce_time(algo, 1, 1e9, 1.0, 1.0) == 0.0


def test_formula_times():
    assert model.ring_allreduce_time(4, 1000, 1e-6, 1e-9) == pytest.approx(6e-6 + 1.5e-6)
    assert model.allreduce_time("recursive_doubling", 8, 1000, 1e-6, 1e-9) == pytest.approx(3 * 2e-6)
    assert model.allreduce_time("halving_doubling", 8, 1000, 1e-6, 1e-9) == pytest.approx(6e-6 + 1.75e-6)
    assert model.allreduce_time("tree", 7, 1000, 1e-6, 1e-9) == pytest.approx(4e-6 + 4e-6)
    with pytest.raises(KeyError):
        model.allreduce_time("torch", 8, 1000, 1e-6, 1e-9)


# ------------------------------------------------------------------ fit

@pytest.mark.parametrize("weighting", ["relative", "absolute"])
def test_fit_recovers_alpha_beta(weighting):
    alpha, beta = 25e-6, 1 / 5e9
    samples = [(n, float(b), model.ring_allreduce_time(n, b, alpha, beta)) for n in (2, 4) for b in SIZES]
    fit = model.fit_alpha_beta(samples, weighting)
    assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.beta == pytest.approx(beta, rel=1e-6)
    assert fit.rel_rms < 1e-6 and fit.points == len(samples) and fit.formula == "ring"


@pytest.mark.parametrize("weighting", ["relative", "absolute"])
def test_fit_rows_recovers_each_algorithms_own_costs(weighting):
    """Each algorithm's rows, made with its own formula and costs, over
    worlds with and without a fold, give back its alpha and beta."""
    rows = _synthetic_rows([2, 3, 4, 5, 8])
    rows.append(_row("torch", 1024, 500.0))
    rows.append(_row("torch", 1 << 20, 900.0))
    fits = model.fit_rows(rows, weighting)
    assert list(fits) == [*TRUE, "torch"]
    for algo, (alpha, beta) in TRUE.items():
        assert fits[algo].formula == algo
        assert fits[algo].alpha == pytest.approx(alpha, rel=1e-6), algo
        assert fits[algo].beta == pytest.approx(beta, rel=1e-6), algo
        assert fits[algo].rel_rms < 1e-6
    assert fits["torch"].formula == "ring"  # no formula of its own: the ring's


def test_fit_with_noise_and_rows():
    rng = random.Random(0)
    alpha, beta = 40e-6, 1 / 2e9
    noisy = [model.ring_allreduce_time(2, b, alpha, beta) * (1 + rng.uniform(-0.05, 0.05)) for b in SIZES]
    rows = [_row("ring", b, t * 1e6) for b, t in zip(SIZES, noisy)]
    rows.append(_row("ring", 1 << 20, 1.0, wrong=5))  # a wrong row is ignored
    rows.append(_row("ring", 1 << 20, 1.0, collective="broadcast"))  # not all-reduce
    rows.append(_row("copy-core", 1 << 20, 1.0, bound=True))  # a bound, not an algorithm
    fits = model.fit_rows(rows)
    assert set(fits) == {"ring"}
    assert fits["ring"].alpha == pytest.approx(alpha, rel=0.2)
    assert fits["ring"].beta == pytest.approx(beta, rel=0.1)


def test_fit_errors():
    with pytest.raises(ValueError):
        model.fit_alpha_beta([(2, 1024, 1e-3)])
    with pytest.raises(ValueError):
        model.fit_alpha_beta([(1, 1024, 1e-3), (1, 2048, 2e-3)])
    with pytest.raises(ValueError, match="no formula"):
        model.fit_alpha_beta([(2, 1024, 1e-3), (2, 2048, 2e-3)], formula="torch")
    with pytest.raises(ValueError):
        model.fit_rows([_row(collective="broadcast")])


def test_measured_times_pool_placements_and_leave_out_the_rest():
    rows = [_row("ring", 1024, 10.0), _row("ring", 1024, 20.0, in_place=False), _row("ring", 4096, 30.0),
            _row("ring", 4096, 1.0, wrong=3), _row("ring", 4096, 1.0, bound=True),
            _row("ring", 4096, 1.0, collective="broadcast"), _row("tree", 4096, 40.0, world_size=3)]
    assert model.measured_times(rows) == {
        "ring": {2: {1024: pytest.approx(15e-6), 4096: pytest.approx(30e-6)}},  # in/out-of-place: mean
        "tree": {3: {4096: pytest.approx(40e-6)}}}


def test_across_hosts_the_flat_series_is_the_ring():
    """On shm+gloo "ring" is the composition (no formula of n) and "flat" the
    ring over every rank, which the classic algorithms (run flat) meet."""
    rows = [_row("ring", 4096, 10.0, 4, transport="shm+gloo"), _row("flat", 4096, 30.0, 4, transport="gloo"),
            _row("tree", 4096, 20.0, 4, transport="gloo")]
    assert model.measured_times(rows) == {"ring (shm+gloo)": {4: {4096: pytest.approx(10e-6)}},
                                          "ring": {4: {4096: pytest.approx(30e-6)}},
                                          "tree": {4: {4096: pytest.approx(20e-6)}}}
    rows += [_row(r["algo"], 65536, r["time_us"] * 3, 4, transport=r["transport"]) for r in rows]
    fits = model.fit_rows(rows)
    assert fits["ring"].formula == "ring" and fits["ring (shm+gloo)"].formula == "ring"
    assert "flat" not in fits
    # on one host "flat" (gloo) is not the run's ring (shm): kept apart
    one = [_row("ring", 4096, 10.0), _row("flat", 4096, 30.0, transport="gloo")]
    assert set(model.measured_times(one)) == {"ring", "flat"}


# ------------------------------------------------------------------ crossovers

def test_line_crossover():
    assert model.line_crossover((10.0, 2.0), (20.0, 1.0)) == pytest.approx(10.0)
    assert model.line_crossover((20.0, 1.0), (10.0, 2.0)) == pytest.approx(10.0)
    assert model.line_crossover((10.0, 1.0), (20.0, 1.0)) is None  # parallel
    assert model.line_crossover((10.0, 1.0), (20.0, 2.0)) is None  # a faster everywhere
    assert model.line_crossover((10.0, 1.0), (10.0, 1.0)) is None  # the same line
    assert model.line_crossover((10.0, 1.0), (10.0 + 1e-12, 1.0 - 1e-9)) is None  # below a byte


def test_predicted_crossover_is_the_analytic_one():
    """From rows made with known costs at 4 ranks: the fits' crossover is
    where the true lines cross, and the measured one lies between the two
    measured sizes around it, the same way round."""
    n = 4
    rows = _synthetic_rows([n])
    found = {(c.first, c.second): c
             for c in model.crossovers(model.fit_rows(rows), model.measured_times(rows))}
    assert len(found) == 6 and all(c.world_size == n for c in found.values())

    def line(a):
        f = model.FORMULAS[a]
        return f.alpha_coef(n) * TRUE[a][0], f.beta_coef(n) * TRUE[a][1]

    # recursive doubling: A = 2*12 us, B = 2/4e9; ring: A = 6*10 us, B = 1.5/5e9
    c = found[("recursive_doubling", "ring")]
    exact = (60e-6 - 24e-6) / (2 / 4e9 - 1.5 / 5e9)  # 180 kB
    assert exact == pytest.approx(model.line_crossover(line("recursive_doubling"), line("ring")))
    assert c.predicted == pytest.approx(exact, rel=1e-6)
    assert len(c.measured) == 1 and c.measured[0].first_faster_below
    lo = max(s for s in SIZES if s < exact)
    assert lo < c.measured[0].size < 4 * lo
    assert c.ratio == pytest.approx(exact / c.measured[0].size)
    # tree and ring: the same A (60 us), the ring's smaller B: the ring faster everywhere
    c = found[("ring", "tree")]
    assert c.predicted is None and c.measured == () and c.ratio is None
    for c in found.values():
        pred = model.line_crossover(line(c.first), line(c.second))
        assert c.predicted == (None if pred is None else pytest.approx(pred, rel=1e-6))


K = 1024


@pytest.mark.parametrize("first, second, expected", [
    # one crossing: ratio 1/2 at 4K, 2 at 16K: at their geometric middle, 8K
    ([1, 1, 4, 8], [2, 2, 2, 2], [OrderChange(8 * K, True)]),
    # none: the first faster everywhere, or the second
    ([1, 1, 1, 1], [2, 3, 4, 5], []),
    ([9, 9, 9, 9], [2, 3, 4, 5], []),
    # two: the first faster in the middle only
    ([4, 1, 1, 4], [2, 2, 2, 2], [OrderChange(2 * K, False), OrderChange(32 * K, True)]),
    # equal at 4K between opposite orders: there
    ([1, 2, 4, 4], [2, 2, 2, 2], [OrderChange(4 * K, True)]),
    # equal at 4K and 16K: the geometric middle of the run
    ([1, 2, 2, 4], [2, 2, 2, 2], [OrderChange(8 * K, True)]),
    # equal, then one order: no change
    ([2, 2, 1, 1], [2, 2, 2, 2], []),
])
def test_measured_crossovers(first, second, expected):
    sizes = [K, 4 * K, 16 * K, 64 * K]
    got = model.measured_crossovers(dict(zip(sizes, first)), dict(zip(sizes, second)))
    assert [(pytest.approx(c.size), c.first_faster_below) for c in got] == \
        [(c.size, c.first_faster_below) for c in expected]


def test_measured_crossovers_use_the_common_sizes():
    first = {K: 1.0, 2 * K: 100.0, 4 * K: 4.0}  # 2K was not measured by the second
    (c,) = model.measured_crossovers(first, {K: 2.0, 4 * K: 2.0})
    assert c.size == pytest.approx(2 * K) and c.first_faster_below
    assert model.measured_crossovers({K: 1.0}, {K: 2.0}) == []


def test_crossover_ratio_against_the_nearest_change_the_same_way():
    both = (OrderChange(1000.0, True), OrderChange(3000.0, False), OrderChange(40000.0, True))
    assert model.Crossover(2, "a", "b", 2500.0, both).ratio == pytest.approx(2.5)
    assert model.Crossover(2, "a", "b", 30000.0, both).ratio == pytest.approx(0.75)
    assert model.Crossover(2, "a", "b", 2500.0, both[1:2]).ratio is None  # only the other way
    assert model.Crossover(2, "a", "b", None, both).ratio is None


def test_crossovers_leave_out_unmodelled_and_other_worlds():
    rows = _synthetic_rows([2], ("ring", "tree")) + _synthetic_rows([4], ("recursive_doubling",))
    # one rank, where the times cross twice: no pair (nothing to model)
    rows += [_row(a, b, t, world_size=1) for a, ts in (("ring", (1, 3, 1)), ("tree", (2, 2, 2)))
             for b, t in zip(SIZES, ts)]
    rows += [_row("torch", b, 100.0 + b * 1e-3) for b in SIZES]
    found = model.crossovers(model.fit_rows(rows), model.measured_times(rows))
    assert [(c.world_size, {c.first, c.second}) for c in found] == [(2, {"ring", "tree"})]


# ------------------------------------------------------------------ prediction table

def test_predict_best():
    same = {a: Fit(10e-6, 1e-10, 2, 0.0, a) for a in model.FORMULAS}
    cells = {(c.world_size, c.size): c for c in model.predict_best(same, [1024], [1024, 1 << 30])}
    assert cells[(1024, 1024)].best == "recursive_doubling"      # small: latency wins
    assert cells[(1024, 1 << 30)].best == "halving_doubling"     # large: ring's bytes, log steps
    assert cells[(1024, 1 << 30)].times["ring"] > cells[(1024, 1 << 30)].times["halving_doubling"]
    # a fit with a borrowed formula takes no part
    fits = {"ring": Fit(10e-6, 1e-10, 2, 0.0), "auto": Fit(1e-9, 1e-15, 2, 0.0)}
    assert {c.best for c in model.predict_best(fits, [8, 64], [1024, 1 << 30])} == {"ring"}
    with pytest.raises(ValueError):
        model.predict_best({"auto": Fit(1e-9, 1e-15, 2, 0.0)}, [8], [1024])


# ------------------------------------------------------------------ printed report

def test_report_on_a_recorded_run(capsys):
    """The recorded 2-rank shm run of every algorithm (tests/data): the fit
    table, the six pairs' crossovers side by side, one line per world."""
    path = str(DATA / "model_allreduce_2ranks.json")
    assert model_cli.main([path, "--worlds", "8,64,1024", "--sizes", "64K,1M,64M,1G"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) < 45  # the summary, not a wall
    table = {ln.split()[0]: ln.split() for ln in lines if not ln.startswith("#") and len(ln.split()) == 6}
    assert table["ring"][1:3] == ["ring", "7"] and table["tree"][1] == "tree"
    assert table["auto"][1] == "ring*" and table["torch"][1] == "ring*"
    pairs = {" ".join(ln.split()[1:4]): ln.split()[4:] for ln in lines
             if ln.startswith("     2  ")}
    assert len(pairs) == 6
    assert pairs["tree / ring"] == ["40.1K", "285K", "0.14"]
    assert pairs["tree / halving_doubling"] == ["71.1K", "536K", "0.13"]
    assert pairs["ring / recursive_doubling"] == ["none", "none", "-"]
    assert pairs["ring / halving_doubling"] == ["none", "3.11K,4.45K^,2.8M", "-"]
    assert pairs["tree / recursive_doubling"] == ["none", "1.43M", "-"]
    best = [ln.split() for ln in lines if ln.split()[:1] in (["8"], ["64"], ["1024"])]
    assert best == [["8", "tree", "halving_doubling", "ring", "ring"],
                    ["64", "tree", "halving_doubling", "halving_doubling", "ring"],
                    ["1024", "tree", "halving_doubling", "halving_doubling", "halving_doubling"]]


def test_report_with_given_link(capsys):
    path = str(DATA / "model_allreduce_2ranks.json")
    assert model_cli.main([path, "--worlds", "1024", "--sizes", "1K,1G",
                           "--alpha-us", "5", "--bw-gbps", "25"]) == 0
    out = capsys.readouterr().out
    assert "alpha 5 us and 1/beta 25 GB/s" in out
    assert out.splitlines()[-1].split() == ["1024", "recursive_doubling", "halving_doubling"]
    with pytest.raises(SystemExit):
        model_cli.main([path, "--alpha-us", "5"])


def test_report_without_modelled_algorithms(tmp_path, capsys):
    p = tmp_path / "r.json"
    rows = [_row("ring", b, model.ring_allreduce_time(2, b, 20e-6, 1e-10) * 1e6) for b in SIZES[:4]]
    rows += [_row("torch", b, 300.0 + b * 1e-3) for b in SIZES[:4]]
    report.write_json(str(p), {"world_size": 2, "device": "cpu"}, rows)
    assert model_cli.main([str(p), "--worlds", "8,1024", "--sizes", "1M"]) == 0
    out = capsys.readouterr().out
    assert "20.00" in out and "10.000" in out  # alpha 20 us, 1/beta 10 GB/s
    assert "no two modelled algorithms measured" in out
    assert [ln.split() for ln in out.splitlines()[-2:]] == [["8", "ring"], ["1024", "ring"]]


def test_report_of_a_hosts_run_has_both_models(tmp_path, capsys):
    """A --hosts file: the one-level table (the flat series is fitted as the
    ring, "auto" with the ring's formula, not its own) and the two-level fit
    after it."""
    true = hosts_model.TwoLevel(intra=Fit(5e-6, 1 / 5e9, 0, 0.0), inter=Fit(300e-6, 1 / 0.5e9, 0, 0.0))
    rows = []
    for size in (4096, 65536, 1 << 20, 16 << 20):
        for algo, f in (("flat", hosts_model.flat_time), ("auto", hosts_model.hier_time)):
            rows.append(_row(algo, size, f(2, 2, size, true) * 1e6, 4,
                             transport="gloo" if algo == "flat" else "shm+gloo"))
    p = tmp_path / "h.json"
    report.write_json(str(p), {"world_size": 4, "device": "cpu", "hosts": 2, "ranks_per_host": 2}, rows)
    assert model_cli.main([str(p), "--clusters", "16x8", "--sizes", "16M"]) == 0
    out = capsys.readouterr().out
    fitted = [ln.split()[0] for ln in out.splitlines() if ln.strip().startswith(("ring", "auto", "flat"))]
    assert sorted(fitted) == ["auto", "ring"] and "ring*" in out
    assert "two-level alpha-beta fit" in out and "300.00" in out  # the inter link's alpha


def test_sizes_print_short():
    assert model._fmt_bytes(40.1 * K) == "40.1K" and model._fmt_bytes(3 << 20) == "3M"
    assert model._fmt_bytes(100) == "100B" and model._fmt_bytes(1023.9 * K) == "1024K"
    assert model._fmt_bytes(5000 * (1 << 30)) == "5000G" and model._fmt_bytes(1.5) == "1.5B"
