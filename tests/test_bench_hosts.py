"""The study across hosts without starting a rank: --hosts parsing, the
ranks' argv, and the two-level model recovering known link costs."""

from __future__ import annotations

import pytest

from pycomm.bench import cli, hosts_model, launch
from pycomm.bench.model import Fit


def test_hosts_flag_defaults_to_the_three_way_comparison():
    a = cli.parse_args(["allreduce", "--hosts", "2", "--nproc", "2"])
    assert a.hosts == 2 and a.algo == ["auto", "flat", "torch"]
    assert cli.parse_args(["allreduce"]).algo == ["ring", "torch"]


def test_ranks_argv_drops_the_launch_flags():
    argv = ["allreduce", "--hosts", "2", "--nproc=2", "-b", "4K", "--hosts=3"]
    assert launch._without_launch_flags(argv) == ["allreduce", "-b", "4K"]


def _rows(model: hosts_model.TwoLevel, hosts: int, per_host: int) -> list[dict]:
    rows = []
    for size in (4096, 65536, 1 << 20, 16 << 20):
        for algo, f in (("flat", hosts_model.flat_time), ("auto", hosts_model.hier_time)):
            rows.append({"collective": "allreduce", "size": size, "algo": algo, "wrong": 0,
                         "world_size": hosts * per_host,
                         "transport": "gloo" if algo == "flat" else "shm+gloo",
                         "time_us": f(hosts, per_host, size, model) * 1e6})
    return rows


def test_two_level_fit_recovers_the_links():
    true = hosts_model.TwoLevel(intra=Fit(5e-6, 1 / 5e9, 0, 0.0), inter=Fit(300e-6, 1 / 0.5e9, 0, 0.0))
    fit = hosts_model.fit_two_level(_rows(true, 2, 2), 2, 2)
    for got, want in ((fit.intra, true.intra), (fit.inter, true.inter)):
        assert got.alpha == pytest.approx(want.alpha, rel=1e-6)
        assert got.beta == pytest.approx(want.beta, rel=1e-6)
    # More hosts: the hierarchy's inter part grows with H, the flat ring's with H*L.
    assert hosts_model.hier_time(16, 8, 16 << 20, fit) < hosts_model.flat_time(16, 8, 16 << 20, fit)
    report = hosts_model.format_hosts_report(fit, [(16, 8)], [16 << 20])
    assert "16 x     8" in report and "speedup" in report


def test_two_level_fit_needs_both_kinds_of_rows():
    with pytest.raises(ValueError, match="flat"):
        hosts_model.fit_two_level([], 2, 2)
    with pytest.raises(ValueError, match=">= 2 hosts"):
        hosts_model.fit_two_level([], 1, 4)


def test_hier_time_counts_the_hierarchy_steps():
    """The hierarchical time sums the hierarchy's own steps
    (pycomm._hierarchy.ALL_REDUCE_STEPS): 2(L-1) intra steps at every size
    (reduce-scatter + all-gather, or the small intra all-reduce), the inter
    all-reduce over B/L bytes (large) or B (small)."""
    from pycomm._hierarchy import SMALL_BYTES

    unit = Fit(1.0, 0.0, 0, 0.0)  # alpha 1 s, no bandwidth term: counts steps
    zero = Fit(0.0, 0.0, 0, 0.0)
    for hosts, L in ((2, 2), (4, 8)):
        for b in (1024, SMALL_BYTES * 4):
            intra = hosts_model.hier_time(hosts, L, b, hosts_model.TwoLevel(unit, zero))
            inter = hosts_model.hier_time(hosts, L, b, hosts_model.TwoLevel(zero, unit))
            assert intra == 2 * (L - 1) and inter == 2 * (hosts - 1)
    bw = Fit(0.0, 1.0, 0, 0.0)  # 1 s per byte: counts bytes
    big = SMALL_BYTES * 4
    inter = hosts_model.hier_time(2, 4, big, hosts_model.TwoLevel(zero, bw))
    assert inter == pytest.approx(2 * 1 / 2 * big / 4)
    intra = hosts_model.hier_time(2, 4, big, hosts_model.TwoLevel(bw, zero))
    assert intra == pytest.approx(2 * 3 / 4 * big)
