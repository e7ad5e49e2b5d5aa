"""The protocol's drift models (ablation/drift.py): seed-paired drops, leave-one-seed-out
R² checked against a direct computation, and the model the data was drawn from wins."""
import math

import numpy as np
import pytest

from pipelinerl_jax.ablation import drift

RATES, LAGS, SEEDS = (5e-5, 1e-4, 2e-4), (4, 8, 16, 32), range(10)


def synthetic(truth, noise=0.01, seed=0):
    """Drop rows drawn from `truth(lr, lag)` plus a per-seed offset and per-row noise."""
    rng = np.random.default_rng(seed)
    offsets = rng.normal(0, noise, len(SEEDS))
    return [{"loss": "ppo", "lr": lr, "lag": lag, "seed": s,
             "drop": truth(lr, lag) + offsets[s] + rng.normal(0, noise)}
            for lr in RATES for lag in LAGS for s in SEEDS]


def test_the_model_the_drops_follow_scores_best():
    product = synthetic(lambda lr, lag: -0.04 * math.log(lr * lag / 5e-5))
    per = drift.drift_models(product)["ppo"]
    r2 = per["cv_r2"]
    assert per["rows"] == 120 and per["seeds"] == 10
    assert r2["log(rate x lag)"] > 0.85 and r2["log(rate x lag)"] >= r2["log lag + log rate"] - 0.01
    assert r2["log lag"] < r2["log(rate x lag)"] - 0.2
    assert r2["log rate"] < r2["log(rate x lag)"] - 0.2
    lag_only = drift.drift_models(synthetic(lambda lr, lag: -0.05 * math.log(lag)))["ppo"]
    assert lag_only["best"] in ("log lag", "log lag + log rate")
    assert lag_only["cv_r2"]["log lag"] > 0.85 and lag_only["cv_r2"]["log rate"] < 0.05


def test_leave_one_seed_out_matches_a_direct_computation():
    rows = synthetic(lambda lr, lag: -0.03 * math.log(lag) + 200 * lr, noise=0.02, seed=3)
    x = np.log([r["lag"] for r in rows])
    y = np.array([r["drop"] for r in rows])
    s = np.array([r["seed"] for r in rows])
    pred = np.empty_like(y)
    for seed in set(s):  # a line fitted without the seed, evaluated on it
        slope, icpt = np.polyfit(x[s != seed], y[s != seed], 1)
        pred[s == seed] = slope * x[s == seed] + icpt
    want = 1 - np.sum((y - pred) ** 2) / np.sum((y - y.mean()) ** 2)
    assert drift.loso_r2(rows, "log lag") == pytest.approx(want, abs=1e-12)
    # in-sample R² is higher: the cross-validation is not a refit on every row
    slope, icpt = np.polyfit(x, y, 1)
    in_sample = 1 - np.sum((y - slope * x - icpt) ** 2) / np.sum((y - y.mean()) ** 2)
    assert in_sample > want


def test_seed_drops_pair_each_seed_with_its_own_lag_zero_run():
    # "runs" are their accuracies here; fn reads them as they are
    grids = {1e-4: {"tis": {0: {0: 0.50, 1: 0.40}, 8: {0: 0.45, 1: 0.41, 2: 0.30}}},
             2e-4: {"tis (lr=0.0002)": {0: {0: 0.55}, 8: {0: 0.35}}}}
    rows = drift.seed_drops(grids, fn=lambda r: r)
    got = sorted((r["lr"], r["lag"], r["seed"], round(r["drop"], 6), r["loss"]) for r in rows)
    assert got == [(1e-4, 8, 0, -0.05, "tis"), (1e-4, 8, 1, 0.01, "tis"),
                   (2e-4, 8, 0, -0.2, "tis")]  # seed 2 has no lag-0 run: no row
    assert drift.drift_models(rows) == {}  # one lag, three rows: nothing to fit
    assert drift.loso_r2(rows[:2], "log lag") is None  # fewer than three seeds


def test_markdown_names_every_model():
    text = drift.drift_models_markdown(drift.drift_models(
        synthetic(lambda lr, lag: -0.04 * math.log(lr * lag))))
    for m in drift.MODELS:
        assert f"CV R², {m}" in text
    assert "| ppo | 120 | 10 |" in text


def test_the_published_terms_figure_is_drawn(tmp_path):
    rows = synthetic(lambda lr, lag: -0.04 * math.log(lr * lag / 5e-5))
    path = drift.published_terms_figure(rows, str(tmp_path))
    assert path.endswith("drop_vs_rate_x_updates.png") and (tmp_path / "drop_vs_rate_x_updates.svg").exists()
    assert [x for _, x in drift.PUBLISHED] == [8e-6, 2.56e-4]  # lr 1e-6 x 8 and x 256 updates
