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


@pytest.mark.parametrize("truth,want", [
    (lambda lr, lag: -0.05 * math.log(lag), "log lag"),  # the rate has no effect
    (lambda lr, lag: -0.05 * math.log(lr / 5e-5), "log rate"),
    (lambda lr, lag: -0.04 * math.log(lr * lag / 5e-5), "log(rate x lag)"),
    (lambda lr, lag: -0.05 * math.log(lag) - 0.01 * math.log(lr / 5e-5), "log lag + log rate"),
    (lambda lr, lag: 0.0, "none")])
def test_the_prestated_rule_names_the_model_the_drops_follow(truth, want):
    # the bare argmax named "log lag + log rate" for lag-only drops (its extra slope fits
    # noise) and a winner for pure noise; the rule tests each added input over seeds
    for seed in range(3):
        per = drift.drift_models(synthetic(truth, seed=seed))["ppo"]
        assert per["best"] == want, (seed, per["cv_r2"], per["tests"])


def test_delta_r2_is_the_difference_of_the_cv_r2s_with_a_seed_interval():
    rows = synthetic(lambda lr, lag: -0.03 * math.log(lag) + 200 * lr, noise=0.02, seed=3)
    both, lag = "log lag + log rate", "log lag"
    t = drift.delta_r2(rows, both, lag)
    assert t["diff"] == pytest.approx(drift.loso_r2(rows, both) - drift.loso_r2(rows, lag),
                                      abs=1e-12)
    assert t["seeds"] == 10 and t["low"] < t["diff"] < t["high"]
    assert t["low"] > 0  # the rate term (200 lr: 3 points over the rates) is there
    swapped = drift.delta_r2(rows, lag, both)
    assert swapped["diff"] == pytest.approx(-t["diff"]) and swapped["high"] < 0


def test_updates_of_staleness_count_the_runs_minibatches():
    # at 4 minibatches a lag of 8 versions is 32 optimizer updates: the published-terms
    # figure's x (rate x updates) must read the run's minibatch count, not assume 1
    run = lambda acc, mb: {"acc": acc, "learner.minibatches": mb}  # noqa: E731
    grids = {1e-4: {"ppo": {0: {0: run(0.5, 4)}, 8: {0: run(0.4, 4)}}},
             2e-4: {"ppo": {0: {0: run(0.5, 1)}, 8: {0: run(0.3, 1)}}}}
    rows = drift.seed_drops(grids, fn=lambda r: r["acc"])
    assert sorted(r["minibatches"] for r in rows) == [1, 4]
    got = drift.rate_x_updates(rows)
    assert got == {("ppo", 1e-4): [(pytest.approx(1e-4 * 32), pytest.approx(-10.0))],
                   ("ppo", 2e-4): [(pytest.approx(2e-4 * 8), pytest.approx(-20.0))]}


@pytest.mark.slow  # runs scripts/staleness_report.py
def test_the_registered_drift_command_on_a_three_rate_grid(tmp_path):
    """The `drift` grid's shape (three rates, several lags and losses, one minibatch) through
    the report script as registered: the drift models with the rule's verdict per loss, KL
    only as an outcome, the rates in numeric order, and the published-terms figure."""
    import os
    import subprocess
    import sys

    from pipeline_testlib import ROOT
    from pipelinerl_jax.ablation import results
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import synthetic as syn

    rng = np.random.default_rng(0)
    for lr in RATES:
        for loss in ("ppo", "tis", "reinforce"):
            for k in (0, 4, 8, 16):
                for s in range(4):
                    final = 0.5 - (0.03 * math.log(lr * k / 5e-5 * 2) if k else 0.0) \
                        + 0.01 * s + rng.normal(0, 0.005) * (k > 0)
                    syn.write_run(str(tmp_path / "runs" / f"{loss}_{lr:g}_{k}_{s}"), loss=loss,
                                  injected=True, k=k, seed=s, lr=lr, steps=12,
                                  acc_fn=lambda st, f=final: 0.3 + (f - 0.3) * st / 12,
                                  kl_fn=lambda st, lr=lr, k=k: 30 * lr * max(k, 1),
                                  labels={"loss": loss, "lag": str(k), "seed": str(s),
                                          "lr": f"{lr:g}"})
    results.export_tables([str(tmp_path / "runs")], str(tmp_path / "drift"))
    out, figs = tmp_path / "report.md", tmp_path / "figs"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "staleness_report.py"),
         f"--results={tmp_path / 'drift'}", "--confirm_arms=reinforce,ppo,tis",
         f"--out={out}", f"--figures={figs}"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    models = text[text.index("## Drift models"):text.index("## Measured drift")]
    for loss in ("ppo", "tis", "reinforce"):
        row = next(line for line in models.splitlines() if line.startswith(f"| {loss} |"))
        assert row.endswith("| log(rate x lag) |"), row  # the drops were drawn from it
    assert "Groups: lr 5e-05, lr 0.0001, lr 0.0002." in text
    assert "never used to predict the accuracy drop" in text and "R² on log KL" not in text
    assert text.count("## Protocol, learning rate") == 3
    assert (figs / "drop_vs_rate_x_updates.png").stat().st_size > 5000
