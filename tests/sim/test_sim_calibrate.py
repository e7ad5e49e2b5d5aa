"""Calibration: read a run directory (docs/metrics.md schema) and predict that run."""
import json
import os
import subprocess
import sys

import pytest
from sim_synthetic_run import write_run_dir

from configs.sim import tiny
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.sim.calibrate import calibrate, read_run
from pipelinerl_jax.sim.sim_config import build_setup
from pipelinerl_jax.sim.pipeline import simulate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def truth(tmp_path_factory):
    """A sampler-bound async run (1 sampler, 15 learner devices) written as a run directory."""
    c = tiny.get_config()
    c.steps, c.output.trace_steps = 40, 40
    c.devices, c.split.samplers, c.split.trainers = 16, 1, 15
    c.weight_sync_s = 0.01
    setup = build_setup(c)
    result = simulate(setup)
    run_dir = str(tmp_path_factory.mktemp("run"))
    write_run_dir(result, run_dir)
    return setup, result, run_dir


def test_reader_recovers_what_the_run_did(truth):
    setup, result, run_dir = truth
    m = read_run(run_dir)
    assert (m.engines, m.slots, m.batch_size, m.group_size) == (1, 16, 8, 4)
    assert m.mode == "async" and m.max_lag == 4 and m.prompt_len == 16
    assert m.lengths.size == 40 * 32
    assert m.weight_sync_s == pytest.approx(0.01)
    # The learner's time per token is linear in tokens, so the fit is exact.
    per_token = setup.train.per_token_device_s / setup.trainers
    assert m.train_fit[1] == pytest.approx(per_token, rel=1e-6)
    # Decode: a line through noisy roofline points; it must sit near them.
    a, b = m.decode_fit
    for active in (2, 8, 16):
        ctx = active * (16 + 60)
        assert a + b * active == pytest.approx(float(setup.decode.step_time(active, ctx)), rel=0.25)


def test_prediction_matches_the_measured_run(truth):
    setup, _, run_dir = truth
    out = calibrate(run_dir, setup)
    meas, pred = out["measured"], out["predicted"]
    assert meas["learner_idle_fraction"] > 0.15  # the run was sampler-bound ...
    assert pred["learner_idle_fraction"] == pytest.approx(meas["learner_idle_fraction"], abs=0.1)
    assert pred["sampler_occupancy"] == pytest.approx(meas["sampler_occupancy"], abs=0.05)
    assert pred["step_time_s"] == pytest.approx(meas["step_time_s"], rel=0.1)
    assert pred["lag_mean"] == pytest.approx(meas["lag_mean"], abs=0.3)
    assert pred["start_lag_mean"] == pytest.approx(meas["start_lag_mean"], abs=0.3)


def test_unreadable_run_directory_is_a_config_error(tmp_path, truth):
    setup = truth[0]
    with pytest.raises(ConfigError) as e:
        calibrate(str(tmp_path), setup)
    assert e.value.key == "calibrate_from"
    (tmp_path / "metrics.jsonl").write_text("{not json\n")
    (tmp_path / "samples.jsonl").write_text("")
    (tmp_path / "engine_stats.jsonl").write_text("")
    with pytest.raises(ConfigError):
        calibrate(str(tmp_path), setup)


def _simulate_cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "simulate.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_cli_simulation_and_calibration_write_summary(tmp_path, truth):
    work = tmp_path / "sim"
    p = _simulate_cli("--config=configs/sim/tiny.py", f"--workdir={work}", "--config.steps=6",
                      "--config.mode=sync")
    assert p.returncode == 0, p.stderr
    summary = json.loads((work / "summary.json").read_text())
    assert summary["mode"] == "sync" and summary["steps"] == 6
    assert summary["counters"]["trained"] == 6 * 8 * 4
    assert (work / "run.png").stat().st_size > 1000
    steps_csv = (work / "steps.csv").read_text().splitlines()
    assert steps_csv[0].startswith("step,") and len(steps_csv) == 7
    completion = (work / "sync_completion.csv").read_text().splitlines()
    assert len(completion) == 1 + min(6, 20) * 8 * 4  # every traced sample of every step
    assert (work / "series.csv").exists()
    cal = tmp_path / "cal"
    p = _simulate_cli("--config=configs/sim/tiny.py", f"--workdir={cal}",
                      f"--config.calibrate_from={truth[2]}", "--config.output.plots=False")
    assert p.returncode == 0, p.stderr
    out = json.loads((cal / "summary.json").read_text())
    assert out["kind"] == "calibration" and set(out["predicted"]) == set(out["measured"])
    p = _simulate_cli("--config=configs/sim/tiny.py", f"--workdir={tmp_path / 'bad'}",
                      "--config.split.samplers=9")
    assert p.returncode != 0 and "split.samplers" in p.stderr
    assert not (tmp_path / "bad" / "summary.json").exists()


def test_compile_dominated_reports_of_the_first_weights_are_left_out(truth, tmp_path):
    """Decode buckets compile on first use, so an engine's reports before its first weight
    update show steps many times slower at full occupancy; they must not set the line."""
    import shutil
    setup, result, run_dir = truth
    warm = str(tmp_path / "run")
    shutil.copytree(run_dir, warm)
    path = os.path.join(warm, "engine_stats.jsonl")
    rows = [json.loads(line) for line in open(path)]
    slow = [dict(r, version=-1, active_slots=setup.slots, decode_step_time_s=2.0,
                 tokens_per_s=setup.slots / 2.0) for r in rows[:3]]
    with open(path, "w") as f:
        for r in slow + rows:
            f.write(json.dumps(r) + "\n")
    (a, b), (a0, b0) = read_run(warm).decode_fit, read_run(run_dir).decode_fit
    for active in (4, setup.slots):
        assert a + b * active == pytest.approx(a0 + b0 * active, rel=0.05)
        assert a + b * active < 0.5  # the slow reports, if fitted, would pull it toward 2 s
