"""The sampler-bound workload: its configs validate and expand into the intended grid, and
`scripts/sampler_bound_report.py` computes time-to-target, speedups, the sync balance and the
simulator's prediction from a small synthetic results directory."""
import json
import os
import sys

import pytest

from pipeline_testlib import ROOT

sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(__file__))

from configs import sampler_bound  # noqa: E402
from configs.ablate import sampler_bound as ablate_sampler_bound  # noqa: E402
from pipelinerl_jax import run_config  # noqa: E402
from pipelinerl_jax.ablation import grid  # noqa: E402
from pipelinerl_jax.ablation.results import Run  # noqa: E402
from scripts import sampler_bound_report as report  # noqa: E402
from synthetic import write_run  # noqa: E402


@pytest.mark.parametrize("arg", ["", "quick"])
def test_workload_config_validates_and_a_sync_batch_fits_the_slots(arg):
    c = sampler_bound.get_config(arg)
    run_config.validate(c)
    assert c.engine.max_slots >= c.learner.batch_groups * c.rollout.group_size
    if not arg:  # longer tail, larger groups, more slots than the default task
        from configs import default
        d = default.get_config()
        assert c.task.p99_length > d.task.p99_length and c.task.max_length > d.task.max_length
        assert c.rollout.group_size > d.rollout.group_size
        assert c.engine.max_slots > d.engine.max_slots


def test_ablation_grid_is_sync_and_async_lags_by_three_seeds_one_run_at_a_time():
    c = ablate_sampler_bound.get_config()
    runs = grid.expand(c)
    got = sorted((r.config.mode, r.config.max_lag, r.config.engine.max_slots,
                  r.config.lag_control.enabled, r.config.seed) for r in runs)
    want = sorted((m, k, n, auto, s) for m, k, n, auto in (
        ("sync", 0, 512, False), ("sync", 0, 128, False), ("async", 1, 512, False),
        ("async", 2, 512, False), ("async", 4, 512, False), ("async", 8, 512, True))
        for s in (0, 1, 2))
    assert got == want
    assert c.runner.parallel == 1 and c.runner.warmup_steps > 0
    assert all(r.config.task.to_dict() == c.experiment.task.to_dict() for r in runs)
    assert {r.config.learner.eval_size for r in runs} == {256}
    assert all(r.config.learner.eval_every > 0 for r in runs)
    quick = grid.expand(ablate_sampler_bound.get_config("quick"))
    assert sorted(r.labels["schedule"] for r in quick) == ["async2", "sync"]
    with pytest.raises(ValueError):
        ablate_sampler_bound.get_config("nope")


def _grid(root):
    for seed in (0, 1, 2):
        write_run(os.path.join(root, "runs", f"sync_s{seed}"), mode="sync", max_lag=0, seed=seed,
                  labels={"schedule": "sync", "seed": str(seed)})
        for k in (1, 4):
            write_run(os.path.join(root, "runs", f"async{k}_s{seed}"), max_lag=k, seed=seed,
                      labels={"schedule": f"async{k}", "seed": str(seed)})
    with open(os.path.join(root, "ablation.json"), "w") as f:
        json.dump({"analysis": {"target_accuracy": 0.5}}, f)
    return root


def test_report_on_a_synthetic_grid(tmp_path, capsys):
    # synthetic.write_run: sync 3 s/step, async 1.5 s/step, evaluations every 4 steps; the
    # target 0.5 is first met at step 8 by every run (sync wall 25 s, async 13 s).
    out = report.main(["--results", _grid(str(tmp_path))])
    text = capsys.readouterr().out.strip().splitlines()
    assert json.loads(text[-1])["report"] == "sampler_bound"
    assert any(line.startswith("| async1 | 3 (3) |") for line in text)
    s = out["schedules"]
    assert list(s) == ["sync", "async1", "async4"]
    assert s["sync"]["time_to_target_s"] == [25.0] * 3
    assert s["async4"]["time_to_target_s"] == [13.0] * 3
    assert s["async1"]["speedup_to_target"] == pytest.approx(25 / 13)
    assert s["async1"]["speedup_to_target_ci95"] == pytest.approx([25 / 13, 25 / 13])
    assert s["async1"]["step_speedup_excl_eval"] == pytest.approx((1 + 3.0 * 12) / (1 + 1.5 * 12))
    assert out["goal_met"] and out["best_speedup_to_target"] == pytest.approx(25 / 13)
    b = out["sync_balance"]  # synthetic sync: wait 2.1 s, train 0.8 s, sync 0.1 s per step
    assert b["wait_time_s"] == pytest.approx(2.1) and b["step_time_s"] == pytest.approx(0.8)
    assert b["sampling_over_training"] == pytest.approx(2.1 / 0.8)
    sim = out["simulator"]
    assert sim["calibrated_from"] == 3 and not sim["errors"]
    for label in ("async1", "async4"):  # async overlaps sampling with training
        assert s[label]["sim_step_speedup"] > 1.0
        assert s[label]["sim_speedup_to_target"] == pytest.approx(s[label]["sim_step_speedup"])


def test_report_target_override_and_missing_sync(tmp_path):
    root = _grid(str(tmp_path))
    out = report.report(root, target_accuracy=0.99, with_sim=False)
    assert out["schedules"]["sync"]["reached"] == 0 and out["best_speedup_to_target"] is None
    assert not out["goal_met"] and out["simulator"] is None
    assert "—" in report.markdown(out)
    only_async = tmp_path / "async_only"
    write_run(str(only_async / "runs" / "a"), max_lag=2, labels={"schedule": "async2",
                                                                 "seed": "0"})
    with pytest.raises(SystemExit, match="needs sync and async"):
        report.report(str(only_async), target_accuracy=0.5)


def test_auto_target_is_three_quarters_of_the_way_to_what_every_schedule_reaches(tmp_path):
    root = _grid(str(tmp_path))
    out = report.report(root, target_accuracy="auto", with_sim=False)
    runs, _ = report.load_runs([root])
    start = sum(r.evals[0][2] for r in runs) / len(runs)  # 0.3 in every synthetic run
    reach = min(sum(max(a for _, _, a in r.evals) for r in runs if report.schedule_of(r) == g)
                / 3 for g in ("sync", "async1", "async4"))
    assert out["target_accuracy"] == pytest.approx(start + 0.75 * (reach - start))
    assert all(s["reached"] == 3 for s in out["schedules"].values())


def test_steps_that_compiled_are_left_out_of_the_sync_balance():
    rows = [{"step": 0, "wall_time_s": 1.0, "eval/accuracy": 0.2}]
    for s in range(1, 9):  # step 1 follows the evaluation; step 5 compiled (30 s)
        rows.append({"step": s, "wall_time_s": 1.0 + 3 * s, "learner/wait_time_s": 2.0,
                     "learner/step_time_s": 30.0 if s == 5 else 1.0,
                     "weight_sync/time_s": 0.0, "sampler/occupancy": 0.1})
    b = report.sync_balance(Run("r", "/x", {}, "all", {"mode": "sync"}, rows, "done"))
    assert b["steps"] == 6 and b["step_time_s"] == 1.0 and b["sampling_over_training"] == 2.0


def test_time_to_target_without_evaluation_time():
    rows = [{"step": 0, "wall_time_s": 5.0, "eval/accuracy": 0.2, "eval/time_s": 5.0},
            {"step": 1, "wall_time_s": 7.0},
            {"step": 2, "wall_time_s": 13.0, "eval/accuracy": 0.4, "eval/time_s": 4.0},
            {"step": 3, "wall_time_s": 15.0},
            {"step": 4, "wall_time_s": 21.0, "eval/accuracy": 0.6, "eval/time_s": 4.0}]
    run = Run("r", "/nonexistent", {}, "all", {"mode": "sync"}, rows, "done")
    assert report.eval_free_time_to_target(run, 0.5) == 21.0 - 13.0
    assert report.eval_free_time_to_target(run, 0.9) is None
    assert report.seconds_per_step(run) == pytest.approx((21.0 - 13.0) / 4)
    assert report.schedule_of(run) == "sync"


def test_speedups_are_against_the_fastest_sync_baseline(tmp_path):
    """A second sync baseline (an engine sized to what sync fills) that reaches the target
    sooner becomes the reference: async must beat sync at its best. (The synthetic run's
    timing follows its mode, so an async-timed run labelled sync128 is a 13 s baseline.)"""
    root = _grid(str(tmp_path))
    for seed in (0, 1, 2):
        write_run(os.path.join(root, "runs", f"sync128_s{seed}"), max_lag=0, seed=seed,
                  labels={"schedule": "sync128", "seed": str(seed)})
    out = report.report(root, target_accuracy=0.5)
    assert out["reference"] == "sync128" and list(out["schedules"])[:2] == ["sync", "sync128"]
    assert out["schedules"]["async1"]["speedup_to_target"] == pytest.approx(1.0)
    assert not out["goal_met"]
    assert out["schedules"]["async1"]["sim_step_speedup"] > 1.0  # vs sync on the same engine
