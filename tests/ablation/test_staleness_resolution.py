"""Reading the staleness grid honestly: identical arms are flagged, every comparison gets its
half-width and minimum detectable effect, decoupled losses are labelled with what they reduce
to at minibatches=1, and the drift analysis tells lag from drift."""
import csv
import math
import os
import sys

import numpy as np

from pipelinerl_jax.ablation import results, staleness, stats

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic  # noqa: E402


def _grid(tmp_path, arms, lags=(0, 4), seeds=(0, 1, 2), lr=1e-4):
    """arms: {label: (loss name, acc_fn(seed, lag, step))}."""
    for label, (loss, acc) in arms.items():
        for k in lags:
            for s in seeds:
                synthetic.write_run(str(tmp_path / f"{label}_{k}_{s}"), loss=loss, injected=True,
                                    k=k, seed=s, lr=lr,
                                    acc_fn=lambda st, s=s, k=k, acc=acc: acc(s, k, st),
                                    labels={"loss": label, "lag": str(k), "seed": str(s)})
    runs, problems = results.load_runs([str(tmp_path)])
    assert not problems
    return staleness.lag_grid(runs)


def test_identical_arms_are_flagged_and_near_identical_ones_are_not(tmp_path):
    same = lambda s, k, st: 0.3 + 0.01 * st - 0.01 * k + 0.001 * s  # noqa: E731
    near = lambda s, k, st: same(s, k, st) + (1e-4 if k else 0.0)  # noqa: E731
    grid = _grid(tmp_path, {"decoupled_ppo": ("decoupled_ppo", same),
                            # the same update under another name (as the first staleness_clip)
                            "staleness_clip": ("decoupled_ppo", same),
                            "tis": ("decoupled_ppo", near)})
    pairs = {(p["a"], p["b"]): p for p in staleness.identical_arms(grid)}
    full = pairs[("decoupled_ppo", "staleness_clip")]
    assert full["identical"] == full["shared"] == 6 and full["lags"] == [0, 4]
    # tis equals them at lag 0 only (its rows differ at lag 4 in the 4th digit)
    assert pairs[("tis", "decoupled_ppo")]["lags"] == [0]  # registry order
    text = staleness.identical_markdown(staleness.identical_arms(grid), {})
    assert "**decoupled_ppo and staleness_clip are identical**" in text
    assert "Identical at lag 0 only" in text


def test_pairwise_resolution_reports_half_width_and_mde(tmp_path):
    rng = np.random.default_rng(0)
    noise = {(s, k): rng.normal(0, 0.03) for s in range(8) for k in (0, 4)}
    a = lambda s, k, st: 0.4 + noise[(s, k)]  # noqa: E731
    b = lambda s, k, st: 0.3 + noise[(s, k)] + 0.01 * (s % 2)  # noqa: E731
    grid = _grid(tmp_path, {"ppo": ("ppo", a), "tis": ("tis", b)}, seeds=range(8))
    rows = staleness.pairwise(grid)
    assert len(rows) == 1 and rows[0]["lag"] == 4 and rows[0]["n"] == 8
    d = [0.1 - 0.01 * (s % 2) for s in range(8)]
    assert math.isclose(rows[0]["diff"], np.mean(d), abs_tol=1e-9)
    assert math.isclose(rows[0]["sd"], np.std(d, ddof=1), rel_tol=1e-6)
    want_mde = (stats.t_ppf(0.975, 7) + stats.t_ppf(0.8, 7)) * np.std(d, ddof=1) / math.sqrt(8)
    assert math.isclose(rows[0]["mde"], want_mde, rel_tol=1e-6)
    (res,) = staleness.resolution(rows)
    assert res["goal_met"] and res["significant"] == 1 and res["seeds"] == 8
    want = stats.seeds_for_half_width(np.std(d, ddof=1), 0.05)
    assert res["seeds_needed_median"] == res["seeds_needed_max"] == want == 2  # SD ~0.005
    text = staleness.resolution_markdown(rows)
    assert "half-width <= 5 pts" in text and "| yes | 2 / 2 / 2 |" in text


def test_resolution_of_the_near_lags_is_its_own_table(tmp_path):
    # the report prints lags 1-2 apart from the goal's lags (>= 4): pairwise(min_lag=1) covers
    # them, and each table's footnote names the lags it holds, not the goal's
    flat = lambda s, k, st: 0.3 + 0.01 * s  # noqa: E731
    worse = lambda s, k, st: 0.3 + 0.01 * s - 0.02 * k  # noqa: E731
    grid = _grid(tmp_path, {"ppo": ("ppo", flat), "tis": ("tis", worse)}, lags=(0, 1, 2, 4))
    assert [r["lag"] for r in staleness.pairwise(grid)] == [4]
    near = [r for r in staleness.pairwise(grid, min_lag=1) if r["lag"] in (1, 2)]
    assert [r["lag"] for r in near] == [1, 2]
    assert "Every pair of arms at lag 1, 2," in staleness.resolution_markdown(near)
    assert "Every pair of arms at lag 4," in staleness.resolution_markdown(
        staleness.pairwise(grid))


def test_min_detectable_effect_and_seeds_needed():
    # 10 seeds at the 3-seed grid's SD of 5.5 points: MDE ~5.5, half-width 3.9
    assert math.isclose(stats.min_detectable_effect(5.5, 10), 5.47, abs_tol=0.01)
    assert stats.seeds_for_half_width(5.5, 5.0) == 8
    assert math.isnan(stats.min_detectable_effect(5.5, 1))


def test_decoupled_losses_are_labelled_with_what_they_reduce_to(tmp_path):
    flat = lambda s, k, st: 0.3  # noqa: E731
    grid = _grid(tmp_path, {"decoupled_ppo": ("decoupled_ppo", flat), "ppo": ("ppo", flat),
                            "staleness_clip": ("staleness_clip", flat)}, seeds=(0,))
    notes = staleness.reductions(grid)
    assert set(notes) == {"decoupled_ppo", "staleness_clip"}
    assert "uncapped" in notes["decoupled_ppo"] and "never binds" in notes["decoupled_ppo"]
    assert "1 + (2 - 1)·s(lag)" in notes["staleness_clip"]


def test_kl_is_described_as_an_outcome_of_the_inputs_never_as_a_predictor():
    # KL grows with rate x lag (the low rate drifts 1/16 as far at each lag): its table says
    # how KL follows the inputs; nothing in it relates KL to the accuracy drop
    rows = []
    for lr in (1e-4, 1.6e-3):
        for k in (1, 2, 4, 8, 16, 32):
            rows.append({"group": f"lr {lr:g}", "lr": lr, "loss": "tis", "lag": k,
                         "kl_k3": 3e-2 * lr * k, "drop": -0.01 * k, "half": 0.01,
                         "verdict": "worse", "ess": 0.5, "n": 3})
    per = staleness.kl_vs_inputs(rows)["tis"]
    assert per["cells"] == 12 and per["r2_kl_on_product"] > 0.999
    assert per["r2_kl_on_lag"] < 0.6 and per["spearman_kl_product"] > 0.99
    assert set(per) == {"cells", "r2_kl_on_lag", "r2_kl_on_product", "spearman_kl_product"}
    text = staleness.drift_markdown(rows, {"tis": per})
    assert "Groups: lr 0.0001, lr 0.0016." in text  # numeric order, not string order
    assert "never used to predict the accuracy drop" in text and "R² on log KL" not in text
    assert staleness.kl_vs_inputs(rows[:6]) == {}  # one rate: nothing pooled


def test_export_of_finished_runs_leaves_out_a_run_stopped_mid_way(tmp_path):
    for name, status in (("a", "done"), ("b", "failed")):
        synthetic.write_run(str(tmp_path / "runs" / name), injected=True, k=1, loss="tis",
                            labels={"loss": name, "seed": "0"})
        with open(tmp_path / "runs" / name / "status.json", "w") as f:
            f.write('{"status": "%s"}' % status)
    out = results.export_tables([str(tmp_path / "runs")], str(tmp_path / "t"),
                                finished_only=True)
    assert out["runs"] == 1 and any("not finished (failed)" in p for p in out["problems"])
    assert results.export_tables([str(tmp_path / "runs")], str(tmp_path / "u"))["runs"] == 2


def test_a_later_sitting_exports_into_its_own_tables_without_duplicates(tmp_path):
    """`--results=WORKDIR,TABLES --out=TABLES`: runs committed earlier and still in the
    workdir are one run each (the directory wins); runs finished since are added."""
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        synthetic.write_run(str(runs / name), injected=True, k=1, loss="tis",
                            labels={"loss": name, "seed": "0"})
    tables = str(tmp_path / "t")
    assert results.export_tables([str(runs)], tables)["runs"] == 2
    synthetic.write_run(str(runs / "c"), injected=True, k=1, loss="tis",
                        labels={"loss": "c", "seed": "0"})
    out = results.export_tables([str(runs), tables], tables)
    assert out["runs"] == 3 and not out["problems"]
    loaded, problems = results.load_runs([tables])
    assert sorted(r.name for r in loaded) == ["loss=a,seed=0", "loss=b,seed=0", "loss=c,seed=0"]
    assert not problems
    # Only in the tables (its workdir is gone, another sitting): kept from the tables.
    import shutil
    shutil.rmtree(runs / "a")
    assert results.export_tables([str(runs), tables], tables)["runs"] == 3


def test_curve_level_and_rescored_accuracy_are_alternative_metrics_of_the_same_runs(tmp_path):
    # evaluations at steps 0, 4, 8, 12 (synthetic.write_run); accuracy = step / 100 + seed
    # offset, so the curve level over steps >= 4 is the mean of steps 4, 8 and 12
    acc = lambda s, k, st: st / 100 + 0.01 * s + (0.05 if k else 0.0)  # noqa: E731
    grid = _grid(tmp_path / "runs", {"ppo": ("ppo", acc), "tis": ("tis", acc)})
    run = grid["ppo"][4][1]
    assert math.isclose(staleness.curve_accuracy(run, from_step=4), 0.08 + 0.01 + 0.05)
    assert staleness.curve_accuracy(run, from_step=13) is None
    assert math.isclose(staleness.final_accuracy(run), 0.12 + 0.01 + 0.05)
    # re-scored accuracies come from the re-evaluation CSV by run name; runs it lacks -> None
    csv_path = tmp_path / "reeval.csv"
    with open(csv_path, "w", newline="") as f:  # run names hold commas: quoted by csv
        w = csv.writer(f)
        w.writerow(["run", "step", "version", "eval_size", "accuracy", "accuracy_256",
                    "logged_accuracy_256", "seconds"])
        for s in (0, 1, 2):
            for label, value in (("ppo", 0.5 + 0.01 * s), ("tis", 0.4 + 0.02 * s)):
                w.writerow([grid[label][4][s].name, 12, 12, 2048, value, 0, 0, 1])
    fn, sizes = staleness.rescored_accuracy([str(csv_path)])
    assert sizes == [2048] and fn(grid["ppo"][0][0]) is None
    (row,) = staleness.pairwise(grid, fn)
    assert row["lag"] == 4 and row["n"] == 3
    assert math.isclose(row["diff"], np.mean([0.1 - 0.01 * s for s in (0, 1, 2)]))
    assert math.isclose(row["sd"], 0.01, rel_tol=1e-6)


def test_resolution_says_how_many_seeds_each_comparison_needs():
    rows = [{"lag": 4, "n": 5, "half": 0.04, "sd": sd, "mde": 0.05, "verdict": "n.s."}
            for sd in (0.03, 0.06, 0.12)] + \
        [{"lag": 8, "n": 5, "half": 0.04, "sd": math.nan, "mde": 0.05, "verdict": "n.s."}]
    (r4,) = [r for r in staleness.resolution(rows) if r["lag"] == 4]
    need = [stats.seeds_for_half_width(sd, 0.05) for sd in (0.03, 0.06, 0.12)]
    assert need[0] < need[1] < need[2]  # the SD, not the current seeds, decides
    assert (r4["seeds_needed_median"], r4["seeds_needed_max"]) == (need[1], need[2])
    assert r4["seeds_needed_p90"] == need[2]  # the 90th percentile is one of the counts
    (r8,) = [r for r in staleness.resolution(rows) if r["lag"] == 8]
    assert r8["seeds_needed_max"] is None  # an SD that is not a number: "-" (JSON-safe)
    assert f"| {need[1]} / " in staleness.resolution_markdown(rows)


def test_all_pairs_table_adjusts_holm_within_each_lag(tmp_path):
    # The protocol's rule for all pairs at a lag is Holm within the lag (docs/staleness_study.md,
    # Protocol): a pair whose raw interval excludes 0 but whose Holm p does not stay under 5% is
    # listed unbolded. Oracle: scipy's paired t-test and Holm's step-down written out here.
    from scipy import stats as sps
    rng = np.random.default_rng(1)
    noise = {(arm, s): rng.normal(0, 0.02) for arm in "abcd" for s in range(8)}
    eff = {"a": 0.0, "b": 0.015, "c": 0.2, "d": 0.0}
    mk = lambda arm: (lambda s, k, st: 0.4 - eff[arm] * (k > 0) + noise[(arm, s)])  # noqa: E731
    grid = _grid(tmp_path, {"ppo": ("ppo", mk("a")), "tis": ("tis", mk("b")),
                            "reinforce": ("reinforce", mk("c")), "m2po": ("m2po", mk("d"))},
                 seeds=range(8))
    rows = staleness.pairwise(grid, min_lag=0)  # lags 0 and 4: Holm runs within each
    assert len(rows) == 12 and [r["lag"] for r in rows] == [0] * 6 + [4] * 6
    for k in (0, 4):
        at = [r for r in rows if r["lag"] == k]
        final = {lab: staleness.per_seed(grid[lab][k], staleness.final_accuracy) for lab in grid}
        ps = []
        for r in at:
            want = sps.ttest_rel([final[r["a"]][s] for s in range(8)],
                                 [final[r["b"]][s] for s in range(8)]).pvalue
            assert math.isclose(r["p"], want, rel_tol=1e-6)
            ps.append(r["p"])
        holm, running = [0.0] * 6, 0.0
        for rank, i in enumerate(np.argsort(ps)):
            running = max(running, min(1.0, (6 - rank) * ps[i]))
            holm[i] = running
        assert [r["p_holm_lag"] for r in at] == holm
    rows = [r for r in rows if r["lag"] == 4]
    raw_only = [r for r in rows if r["verdict"] != "n.s." and r["p_holm_lag"] >= 0.05]
    held = [r for r in rows if r["p_holm_lag"] < 0.05]
    assert raw_only and held  # the fixture has both kinds
    text = staleness.pairwise_markdown(rows)
    assert f"| {raw_only[0]['p_holm_lag']:.3g} |" in text
    assert f"| **{held[0]['p_holm_lag']:.3g}** |" in text
    assert f"{len(held)} of {len(held) + len(raw_only)} hold" in text
