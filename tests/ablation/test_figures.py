"""The figures script and the results tables on a small synthetic results directory."""
import csv
import json
import math
import os
import subprocess
import sys

import pytest

from pipeline_testlib import ROOT
from pipelinerl_jax.ablation import figures, results

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic  # noqa: E402


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory):
    return synthetic.write_results(str(tmp_path_factory.mktemp("results")))


@pytest.mark.slow
def test_script_draws_every_figure_and_names_bad_runs(results_dir, tmp_path):
    out = tmp_path / "figs"
    missing = str(tmp_path / "no_such_grid")
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "reproduce_figures.py"),
         f"--results={results_dir},{missing}", f"--out={out}"],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
        timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in figures.FIGURES:
        for ext in ("png", "svg"):
            path = out / f"{name}.{ext}"
            assert path.exists() and path.stat().st_size > 5000, path
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert not any("skipped" in f for f in facts["figures"].values())
    # The malformed run and the missing directory are reported by name, and skipped.
    assert any("broken_run" in p for p in facts["problems"])
    assert any("no_such_grid" in p for p in facts["problems"])
    assert "broken_run" in done.stdout and "no_such_grid" in done.stdout
    # What the figures show comes from the logs: async steps are faster in the synthetic runs.
    sva = facts["figures"]["sync_vs_async"]
    assert sva["speedup_to_target"] > 1.0
    assert set(facts["figures"]["lag_ablation"]["losses"]) == {
        "reinforce", "tis", "tis_nocap", "ppo", "m2po", "dppo_mb4", "ppo_mb4",
        "m2po (steps=16)", "tis (steps=16)", "reinforce (lr=2.5e-05)", "tis (lr=2.5e-05)"}
    # drop_vs_drift pairs the two learning rates' cells of each loss (lags 2 and 8)
    drift = facts["figures"]["drop_vs_drift"]
    assert set(drift["per_loss"]) == {"reinforce", "tis"} and drift["cells"] >= 8
    assert facts["figures"]["lag_ablation"]["lags"] == [0, 2, 3, 8, 32, 64]
    # the :long grid's runs have their own figure and stay out of the 60-step one; the
    # low-learning-rate runs (tis, no m2po) are another regime, which has no m2po verdict
    regimes = facts["figures"]["repro_m2po_stale"]["regimes"]
    assert list(regimes) == ["lr=0.0001"]
    assert all("lag 32" in c for c in regimes["lr=0.0001"]["claims"])
    assert all("lag 64" in c
               for c in facts["figures"]["repro_m2po_stale_long"]["regimes"]["lr=0.0001"]["claims"])


@pytest.mark.slow  # renders every figure of the grid
def test_figures_from_committed_tables(results_dir, tmp_path):
    """export_tables -> CSVs -> the same figures with the same numbers (6 digits kept), except
    occupancy_vs_sim, which calibrates the simulator from raw logs."""
    tables = results.export_tables([results_dir], str(tmp_path / "tables"))
    assert any("broken_run" in p for p in tables["problems"])
    assert os.path.getsize(tables["tables"]["steps_csv"]) < 400 * tables["runs"] * 13
    from_csv = figures.make_all([str(tmp_path / "tables")], str(tmp_path / "a"),
                                log=lambda m: None)
    from_runs = figures.make_all([results_dir], str(tmp_path / "b"), log=lambda m: None)
    skipped = {n for n, f in from_csv["figures"].items() if "skipped" in f}
    assert skipped == {"occupancy_vs_sim"}, from_csv["figures"]
    assert from_csv["runs"] == from_runs["runs"]
    for name in ("lag_ablation", "diagnostics_by_lag", "ess_vs_drop", "sync_vs_async",
                 "repro_tinker_kl", "repro_m2po_stale", "repro_m2po_stale_long",
                 "repro_decoupled_ppo", "kv_policy",
                 "lengths_and_lag"):
        a, b = dict(from_csv["figures"][name]), dict(from_runs["figures"][name])
        a.pop("path"), b.pop("path")
        assert json.dumps(a, default=str) == json.dumps(b, default=str) or \
            _close(a, b), name


def _close(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_close, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-3, abs=1e-5, nan_ok=True)  # 6 digits in steps.csv
    return a == b


@pytest.mark.slow  # renders every figure of the grid
def test_figures_missing_their_runs_are_skipped_with_a_reason(results_dir, tmp_path):
    only_injected = [os.path.join(results_dir, "runs", d)
                     for d in os.listdir(os.path.join(results_dir, "runs")) if d.startswith("inj_")]
    out = figures.make_all(only_injected, str(tmp_path), log=lambda m: None)["figures"]
    assert "lag_ablation" in out and "path" in out["lag_ablation"]
    for name in ("sync_vs_async", "kv_policy", "occupancy_vs_sim"):
        assert "configs/ablate" in out[name]["skipped"] or "needs" in out[name]["skipped"]


def test_tables_from_run_directories(results_dir):
    tables = results.write_tables(results_dir)
    assert any("broken_run" in p for p in tables["problems"])
    with open(tables["tables"]["runs_csv"]) as f:
        runs = {r["run"]: r for r in csv.DictReader(f)}
    r = runs["lag=8,loss=tis,seed=1"]
    assert r["cell"] == "lag=8,loss=tis" and r["loss"] == "tis" and r["injected_lag"] == "8"
    assert float(r["initial_eval_accuracy"]) == 0.3 and int(r["steps"]) == 12
    with open(tables["tables"]["cells_csv"]) as f:
        cells = {c["cell"]: c for c in csv.DictReader(f)}
    c = cells["lag=8,loss=tis"]
    assert c["runs"] == "2" and c["final_eval_accuracy_n"] == "2"
    assert float(c["final_eval_accuracy_min"]) <= float(c["final_eval_accuracy_mean"]) \
        <= float(c["final_eval_accuracy_max"])
    # The 95% t-interval over the 2 seeds: half = t_{0.975, 1} * s / sqrt(2), s with ddof 1.
    finals = [float(runs[f"lag=8,loss=tis,seed={s}"]["final_eval_accuracy"]) for s in (0, 1)]
    half = 12.706204736174698 * abs(finals[0] - finals[1]) / math.sqrt(2) / math.sqrt(2)
    assert float(c["final_eval_accuracy_half"]) == pytest.approx(half, rel=1e-9)
    assert float(c["final_eval_accuracy_lo"]) == pytest.approx(sum(finals) / 2 - half)


def test_instability_events(tmp_path):
    run = synthetic.write_run(str(tmp_path / "r"), injected=True, k=4)
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    rows[3]["loss/loss"] = "nan"  # how the learner logs a non-finite value
    rows[3]["learner/skipped_steps"] = 1
    rows[5]["loss/kl_k3"] = 2.0
    rows[8]["eval/accuracy"] = 0.05  # below half the step-0 accuracy (0.3)
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    s = results.summarize_run(results.load_run(run), {"target_accuracy": 0.5})
    assert s["nonfinite_steps"] == 1 and s["kl_spike_steps"] == 1
    assert s["collapse_step"] == 8 and s["collapsed"] and s["drift_flag"]
    assert s["steps_to_target"] == 12 and s["time_to_target_s"] == rows[12]["wall_time_s"]
    # A run whose metrics were appended after a resume: the last record of a step wins.
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(dict(rows[12], **{"eval/accuracy": 0.9})) + "\n")
    again = results.load_run(run)
    assert len(again.rows) == 13 and again.evals[-1][2] == 0.9


@pytest.mark.slow  # renders every figure of the grid
def test_schedule_and_kv_policy_figures_do_not_pool_other_grids(results_dir, tmp_path):
    """A kv_policy grid (runs labelled kv_policy=..., no schedule label) committed beside a
    schedule grid stays out of sync_vs_async and lengths_and_lag, and the kv_policy figure
    draws from it alone (before, its async runs joined the schedule grid's and vice versa)."""
    base = figures.make_all([results_dir], str(tmp_path / "a"), log=lambda m: None)["figures"]
    kv = tmp_path / "kv_grid" / "runs"
    for policy in ("keep", "recompute"):  # another workload: faster steps, other accuracy
        synthetic.write_run(str(kv / f"kv_{policy}"), max_lag=4, kv=policy, seed=5,
                            labels={"kv_policy": policy, "max_lag": "4", "seed": "5"},
                            acc_fn=lambda step: 0.9)
    both = figures.make_all([results_dir, str(tmp_path / "kv_grid")], str(tmp_path / "b"),
                            log=lambda m: None)["figures"]
    for name in ("sync_vs_async", "lengths_and_lag"):
        a, b = dict(base[name]), dict(both[name])
        a.pop("path"), b.pop("path")
        assert json.dumps(a, default=str) == json.dumps(b, default=str), name
    assert set(both["kv_policy"]["keep"]) == {"4"}
    assert both["kv_policy"]["keep"]["4"]["final_eval_accuracy"] == pytest.approx(0.9)
    assert base["kv_policy"]["keep"]["4"]["final_eval_accuracy"] != pytest.approx(0.9)


@pytest.mark.slow  # renders every figure of the grid
def test_occupancy_figure_from_committed_tables_with_raw_runs(results_dir, tmp_path):
    """export_raw copies two runs' raw logs beside the tables; occupancy_vs_sim (which
    calibrates the simulator from raw logs) then draws from the committed folder alone, with
    the numbers it draws from the run directories, and every other figure is unchanged."""
    out = str(tmp_path / "tables")
    results.export_tables([results_dir], out)
    names = ["schedule=sync,seed=0", "kv=keep,schedule=async4,seed=0"]
    written = results.export_raw([results_dir], names, out)
    assert [os.path.basename(d) for d in written] == names
    assert os.path.isfile(os.path.join(out, "raw", names[0], "engine_stats.jsonl"))
    with pytest.raises(results.RunError, match="no_such_run"):
        results.export_raw([results_dir], ["no_such_run"], out)
    from_csv = figures.make_all([out], str(tmp_path / "a"), log=lambda m: None)["figures"]
    raw_only = [os.path.join(results_dir, "runs", d) for d in
                ("sync_s0", "async4_keep_s0")]
    from_runs = figures.make_all(raw_only, str(tmp_path / "b"), only=["occupancy_vs_sim"],
                                 log=lambda m: None)["figures"]
    a, b = dict(from_csv["occupancy_vs_sim"]), dict(from_runs["occupancy_vs_sim"])
    a.pop("path"), b.pop("path")
    assert json.dumps(a, default=str) == json.dumps(b, default=str)
    assert not any("skipped" in f for f in from_csv.values())


def test_lag_figures_keep_other_grids_settings_apart(results_dir, tmp_path):
    """A repro grid whose loss label matches the staleness grid's but which sits on another
    axis (minibatches=4) gets its own row: before, lag_ablation pooled it into 'ppo' and
    ess_vs_drop's lag grid replaced the staleness runs of the same loss, lag and seed."""
    base = figures.make_all([results_dir], str(tmp_path / "a"), only=["lag_ablation"],
                            log=lambda m: None)["figures"]["lag_ablation"]
    other = tmp_path / "repro" / "runs"
    for seed in (0, 1):
        synthetic.write_run(str(other / f"ppo_mb4_s{seed}"), loss="ppo", injected=True, k=0,
                            seed=seed, minibatches=4, acc_fn=lambda step: 0.05,
                            labels={"loss": "ppo", "lag": "0", "minibatches": "4",
                                    "seed": str(seed)})
    both = figures.make_all([results_dir, str(tmp_path / "repro")], str(tmp_path / "b"),
                            only=["lag_ablation"], log=lambda m: None)["figures"]["lag_ablation"]
    assert both["losses"]["ppo"] == base["losses"]["ppo"]
    assert both["losses"]["ppo (minibatches=4)"]["0"]["seeds"] == 2
