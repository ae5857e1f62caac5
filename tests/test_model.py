"""Tests of pycomm.bench.model and its command line (model_cli): the
formulas, the fit, the predictions. Never on time."""

from __future__ import annotations

import pytest

from pycomm.bench import model, model_cli, report


def _row(**kw):
    r = {"collective": "allreduce", "size": 1024, "count": 256, "dtype": "float32", "op": "sum",
         "root": -1, "algo": "ring", "in_place": True, "time_us": 10.0, "algbw": 0.1024,
         "busbw": 0.1024, "wrong": 0, "world_size": 2, "transport": "gloo", "device": "cpu"}
    r.update(kw)
    return r


# ------------------------------------------------------------------ cost model

def test_model_formulas():
    assert model.ring_allreduce_time(4, 1000, 1e-6, 1e-9) == pytest.approx(6e-6 + 1.5e-6)
    assert model.recursive_doubling_time(8, 1000, 1e-6, 1e-9) == pytest.approx(3 * (1e-6 + 1e-6))
    assert model.halving_doubling_time(8, 1000, 1e-6, 1e-9) == pytest.approx(6e-6 + 1.75e-6)
    assert model.ring_allreduce_time(1, 1e9, 1, 1) == 0.0


@pytest.mark.parametrize("weighting", ["relative", "absolute"])
def test_model_fit_recovers_alpha_beta(weighting):
    alpha, beta = 25e-6, 1 / 5e9
    samples = [(n, float(b), model.ring_allreduce_time(n, b, alpha, beta))
               for n in (2, 4) for b in (1 << k for k in range(10, 27, 2))]
    fit = model.fit_alpha_beta(samples, weighting)
    assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.beta == pytest.approx(beta, rel=1e-6)
    assert fit.rel_rms < 1e-6 and fit.points == len(samples)


def test_model_fit_with_noise_and_rows():
    import random

    rng = random.Random(0)
    alpha, beta = 40e-6, 1 / 2e9
    rows = []
    for b in (1 << k for k in range(10, 27, 2)):
        t = model.ring_allreduce_time(2, b, alpha, beta) * (1 + rng.uniform(-0.05, 0.05))
        rows.append(_row(size=b, time_us=t * 1e6))
    rows.append(_row(size=1 << 20, time_us=1.0, wrong=5))  # a wrong row is ignored
    rows.append(_row(collective="broadcast", size=1 << 20, time_us=1.0))  # not all-reduce
    fits = model.fit_rows(rows)
    assert set(fits) == {"ring"}
    assert fits["ring"].alpha == pytest.approx(alpha, rel=0.2)
    assert fits["ring"].beta == pytest.approx(beta, rel=0.1)


def test_model_fit_errors():
    with pytest.raises(ValueError):
        model.fit_alpha_beta([(2, 1024, 1e-3)])
    with pytest.raises(ValueError):
        model.fit_alpha_beta([(1, 1024, 1e-3), (1, 2048, 2e-3)])
    with pytest.raises(ValueError):
        model.fit_rows([_row(collective="broadcast")])


def test_model_predict_best():
    fit = model.Fit(alpha=10e-6, beta=1e-10, points=2, rel_rms=0.0)
    preds = {(p["world_size"], p["size"]): p for p in model.predict(fit, [1024], [1024, 1 << 30])}
    assert preds[(1024, 1024)]["best"] == "rec-doubling"         # small: latency wins
    assert preds[(1024, 1 << 30)]["best"] == "halving-doubling"  # large: bandwidth + log steps
    assert preds[(1024, 1 << 30)]["ring"] > preds[(1024, 1 << 30)]["halving-doubling"]


def test_model_cli(tmp_path, capsys):
    p = tmp_path / "r.json"
    rows = [_row(size=b, time_us=model.ring_allreduce_time(2, b, 20e-6, 1e-10) * 1e6)
            for b in (1024, 1 << 16, 1 << 20, 1 << 24)]
    report.write_json(str(p), {"world_size": 2, "device": "cpu"}, rows)
    assert model_cli.main([str(p), "--worlds", "8,1024", "--sizes", "1M"]) == 0
    out = capsys.readouterr().out
    assert "20.00" in out and "10.000" in out  # alpha 20 us, 1/beta 10 GB/s
    assert out.count("1024      1M") == 1
