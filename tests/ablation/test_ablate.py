"""The ablation runner end to end on a 2x2 micro-grid of 2-step tiny pipelines (real
processes, real gRPC), then the cheap contracts: grid expansion errors and resume states."""
import ast
import csv
import json
import os
import subprocess
import sys
import time

import pytest

from pipeline_testlib import ROOT, TINY_FLAGS, make_init_checkpoint
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.ablation import grid, runner


def _tiny_experiment():
    sys.path.insert(0, ROOT)
    from configs import default
    e = default.get_config("quick")
    for flag in TINY_FLAGS:
        key, _, value = flag[len("--config."):].partition("=")
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass  # a string, e.g. the empty core list
        node = e
        *path, leaf = key.split(".")
        for p in path:
            node = node[p]
        node[leaf] = value
    e.learner.total_steps = 2
    e.learner.eval_every = 0  # the evaluator's compile would double the test's time
    e.learner.checkpoint_every = 2
    e.lag_injection.enabled = True
    return e


def _micro_grid(init_ckpt):
    c = grid.ablation_config(_tiny_experiment())
    c.experiment.warm_start.checkpoint = init_ckpt
    c.axes.lag = grid.sweep("lag_injection.k", (0, 1), also=("lag_injection.max_k",))
    c.axes.seed = grid.sweep("seed", (0, 1))
    c.runner.parallel = 2
    return c


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("ablate")
    init = make_init_checkpoint(str(base / "init"))
    c = _micro_grid(init)
    workdir = str(base / "grid")
    first = runner.run_grid(c, workdir, log=lambda m: None)
    return c, workdir, first


NAMES = ["lag=0,seed=0", "lag=0,seed=1", "lag=1,seed=0", "lag=1,seed=1"]


@pytest.mark.slow
def test_grid_writes_results_table(grid_run):
    c, workdir, first = grid_run
    assert sorted(first["ran"]) == NAMES and not first["failed"] and not first["skipped"]
    with open(os.path.join(workdir, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    cols = rows[0].keys()
    for col in ("run", "cell", "status", "lag", "seed", "mode", "loss", "injected_lag",
                "kv_policy", "learning_rate", "step", "wall_time_s", "accuracy",
                "reward/mean", "lag/mean", "loss/ess", "loss/lag_0/ess", "loss/lag_1/kl_k3"):
        assert col in cols, col
    # One row per run per logged step.
    assert sorted((r["run"], int(r["step"])) for r in rows) == \
        sorted((n, s) for n in NAMES for s in (1, 2))
    for r in rows:
        assert r["lag"] == r["injected_lag"] and r["status"] == "done"
        assert r["cell"] == f"lag={r['lag']}"
        if int(r["step"]) > 0:  # injected lag k: lag min(k, step - 1) at step `step`
            assert float(r["lag/mean"]) == min(int(r["lag"]), int(r["step"]) - 1)
    with open(os.path.join(workdir, "cells.csv")) as f:
        cells = {r["cell"]: r for r in csv.DictReader(f)}
    assert set(cells) == {"lag=0", "lag=1"}
    assert all(cells[k]["runs"] == "2" and cells[k]["lag_mean_n"] == "2" for k in cells)
    summary = json.load(open(os.path.join(workdir, "summary.json")))
    assert len(summary["runs"]) == 4 and not summary["problems"]


@pytest.mark.slow
def test_second_invocation_skips_finished_runs(grid_run):
    c, workdir, _ = grid_run
    metrics = os.path.join(workdir, "runs", "lag=1,seed=0", "metrics.jsonl")
    before = os.stat(metrics).st_mtime_ns
    second = runner.run_grid(c, workdir, log=lambda m: None)
    assert sorted(second["skipped"]) == NAMES and second["ran"] == [] == second["failed"]
    assert os.stat(metrics).st_mtime_ns == before
    # The command line says so too, without starting anything.
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", "ablate.py"),
         f"--config={os.path.join(ROOT, 'configs', 'ablate', 'staleness.py')}:quick",
         f"--workdir={workdir}", "--dry_run"], capture_output=True, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "16 runs" in out.stdout  # the quick grid: 2 losses x 2 lags x 4 seeds


@pytest.mark.slow
def test_reeval_rescores_each_runs_last_checkpoint_once(grid_run, tmp_path):
    """scripts/staleness_reeval.py: every finished run's last checkpoint scored on a larger
    held-out set by one engine; the score is the evaluator's own on those weights; a second
    invocation scores nothing again."""
    _, workdir, _ = grid_run
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import staleness_reeval
    out_csv = str(tmp_path / "reeval.csv")
    first = staleness_reeval.main([f"--results={workdir}", f"--out={out_csv}",
                                   "--eval_size=24"])
    assert first["runs"] == 4 and first["skipped_already_scored"] == 0
    with open(out_csv) as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == NAMES
    assert all(r["step"] == "2" and r["eval_size"] == "24" for r in rows.values())
    # the score of lag=1,seed=1 is the evaluator's accuracy on that run's step-2 parameters
    from pipelinerl_jax.envs import build_task
    from pipelinerl_jax.learner.checkpoint import Checkpointer
    from pipelinerl_jax.models import flat_params
    from pipelinerl_jax.rollout.evaluator import Evaluator
    from pipelinerl_jax.tokenizer import get_tokenizer
    import ml_collections
    run = os.path.join(workdir, "runs", "lag=1,seed=1")
    cfg = ml_collections.ConfigDict(json.load(open(os.path.join(run, "config.json"))))
    cfg.learner.eval_size = 24
    ckpt = Checkpointer(os.path.join(run, "checkpoints"), async_save=False)
    state, _, _ = ckpt.read_state()
    ckpt.close()
    ev = Evaluator.embedded(cfg, open(os.path.join(run, "init_checkpoint.txt")).read().strip(),
                            build_task(cfg), get_tokenizer(cfg.tokenizer))
    try:
        want = ev(flat_params(state["params"]), 7)["eval/accuracy"]
    finally:
        ev.close()
    assert float(rows["lag=1,seed=1"]["accuracy"]) == want
    again = staleness_reeval.main([f"--results={workdir}", f"--out={out_csv}",
                                   "--eval_size=24"])
    assert again["runs"] == 0 and again["skipped_already_scored"] == 4


# ---------------------------------------------------------------------------- cheap contracts

def test_expand_names_runs_and_cells():
    c = grid.ablation_config(_tiny_experiment())
    c.axes.loss = grid.variants(("reinforce", {"loss": {"name": "reinforce"}}),
                                ("tis", {"loss": {"name": "tis", "cap": 3.0}}))
    c.axes.seed = grid.sweep("seed", (0, 1))
    runs = grid.expand(c)
    assert [r.name for r in runs] == ["loss=reinforce,seed=0", "loss=reinforce,seed=1",
                                      "loss=tis,seed=0", "loss=tis,seed=1"]
    tis = runs[2]
    assert tis.cell == "loss=tis" and tis.config.loss.name == "tis" and tis.config.loss.cap == 3.0
    assert tis.config.seed == 0 and runs[0].config.loss.cap is None
    c.axes.loss.only = "tis"
    assert [r.name for r in grid.expand(c)] == ["loss=tis,seed=0", "loss=tis,seed=1"]


@pytest.mark.parametrize("edit,key", [
    (lambda c: setattr(c.axes, "lr", grid.sweep("learner.optimiser.lr", (1e-4,))), "axes.lr"),
    (lambda c: setattr(c.axes.seed, "only", "7"), "axes.seed.only"),
    (lambda c: setattr(c, "seed_axis", "seeds"), "seed_axis"),
    (lambda c: setattr(c.axes, "loss", grid.variants(("ppo", {"loss": {"name": "ppo",
                                                                       "cap": 2.0}}))),
     "experiment.loss.cap"),
    (lambda c: setattr(c.axes, "len", grid.sweep("task.median_length", (4, 5))), "axes"),
])
def test_expand_errors_name_the_key(edit, key):
    c = grid.ablation_config(_tiny_experiment())
    c.axes.seed = grid.sweep("seed", (0, 1))
    edit(c)
    with pytest.raises(ConfigError) as e:
        grid.expand(c)
    assert e.value.key == key


def test_prepare_run_resume_states(tmp_path):
    c = grid.ablation_config(_tiny_experiment())
    c.axes.seed = grid.sweep("seed", (0,))
    run = grid.expand(c)[0]
    d = str(tmp_path / "run")
    assert runner.prepare_run(run, d) == "start"
    # Interrupted before any checkpoint: wiped and restarted.
    open(os.path.join(d, "metrics.jsonl"), "w").write('{"step": 1}\n')
    os.makedirs(os.path.join(d, "checkpoints", "2.orbax-checkpoint-tmp-1"))
    assert runner.run_status(d) == "partial"
    assert runner.prepare_run(run, d) == "start"
    assert sorted(os.listdir(d)) == ["spec.json"]
    # Interrupted after a committed checkpoint: resumed in place.
    open(os.path.join(d, "metrics.jsonl"), "w").write('{"step": 1}\n')
    os.makedirs(os.path.join(d, "checkpoints", "2"))
    assert runner.prepare_run(run, d) == "resume"
    assert os.path.exists(os.path.join(d, "metrics.jsonl"))
    # A run whose grid config changed is not resumed from the old run's checkpoint.
    c.experiment.learner.optimizer.learning_rate = 3e-4
    assert runner.prepare_run(grid.expand(c)[0], d) == "start"
    # Finished (or diverged) runs are skipped.
    json.dump({"status": "diverged"}, open(os.path.join(d, "status.json"), "w"))
    assert runner.prepare_run(run, d) == "skip"


def test_split_cores():
    assert runner.split_cores([0, 1], 2) == ["0", "1"]
    assert runner.split_cores([0, 1, 2, 3], 2) == ["0,1", "2,3"]
    assert runner.split_cores([5], 2) == ["5", "5"]


def test_a_run_diverged_only_when_its_learner_recorded_so(tmp_path):
    from pipelinerl_jax.launch import outcome
    from pipelinerl_jax.learner.loop import TooManySkippedSteps
    d = str(tmp_path / "run")
    os.makedirs(os.path.join(d, "logs"))
    # The word in its logs (a user's message, a traceback of some other failure) is no record.
    for log in ("ablate.log", os.path.join("logs", "learner.log")):
        open(os.path.join(d, log), "w").write("TooManySkippedSteps mentioned\n")
    assert runner.run_outcome(d, 1, since=0.0) == "failed"
    outcome.record_learner_stopped(d, TooManySkippedSteps("3 consecutive steps ..."))
    assert runner.run_outcome(d, 1, since=0.0) == "diverged"
    assert runner.run_outcome(d, 0, since=0.0) == "done"
    # A record of an earlier attempt says nothing about this one.
    assert runner.run_outcome(d, 1, since=time.time() + 1) == "failed"


def test_warmup_runs_a_short_copy_once_and_times_it(tmp_path, monkeypatch):
    """The compile warm-up shared by the runner and the benchmarks: a throwaway run of the
    given config cut to `steps` (evaluating and checkpointing at its end, so the evaluator
    compiles too), in its own directory, skipped once it has finished."""
    started = []

    class FakeChild:
        def __init__(self, d):
            self.d = d

        def wait(self, timeout_s, grace):
            json.dump({}, open(os.path.join(self.d, "summary.json"), "w"))
            return 0

    def fake_run_child(d, env, mode="pipeline"):
        started.append((d, env, mode))
        return FakeChild(d)
    monkeypatch.setattr(runner, "run_child", fake_run_child)
    e = _tiny_experiment()
    d = str(tmp_path / "warmup")
    out = runner.warmup(e, d, 5, {"PIPELINERL_JAX_CACHE": "/x"})
    assert out["exit_code"] == 0 and out["steps"] == 5 and out["wall_s"] >= 0
    cfg = json.load(open(os.path.join(d, "launch_config.json")))
    assert cfg["learner"]["total_steps"] == cfg["learner"]["eval_every"] == 5
    assert cfg["learner"]["checkpoint_every"] == 5 and cfg["seed"] == e.seed
    assert started == [(d, {"PIPELINERL_JAX_CACHE": "/x"}, "pipeline")]
    assert runner.warmup(e, d, 5, {})["wall_s"] == 0 and len(started) == 1  # done: skipped


def test_runs_go_one_replicate_at_a_time():
    c = grid.ablation_config(_tiny_experiment())
    c.axes.lag = grid.sweep("lag_injection.k", (0, 1), also=("lag_injection.max_k",))
    c.axes.seed = grid.sweep("seed", (0, 1))
    assert [r.name for r in runner.replicate_major(c, grid.expand(c))] == [
        "lag=0,seed=0", "lag=1,seed=0", "lag=0,seed=1", "lag=1,seed=1"]


def test_config_conflicts_ignore_keys_only_one_version_has():
    old = {"learner": {"lr": 1e-4, "steps": 60}, "loss": {"name": "tis"}}
    assert runner.config_conflicts(old, {"learner": {"lr": 1e-4, "steps": 60}, "loss":
                                         {"name": "tis"}, "lag_control": {"enabled": False}}) == []
    assert runner.config_conflicts(old, {"learner": {"lr": 3e-4, "steps": 60},
                                         "loss": {"name": "ppo"}}) == ["learner.lr", "loss.name"]


def test_a_finished_run_of_another_config_is_refused_not_skipped(tmp_path):
    """Two grids in one workdir whose runs share a name (e.g. a repro grid with other
    hyperparameters): the second must not take the first one's result as its own."""
    c = grid.ablation_config(_tiny_experiment())
    c.axes.seed = grid.sweep("seed", (0,))
    run = grid.expand(c)[0]
    d = tmp_path / "runs" / run.dirname
    runner.prepare_run(run, str(d))
    json.dump({"status": "done"}, open(d / "status.json", "w"))
    c.experiment.learner.optimizer.learning_rate = 3e-4
    with pytest.raises(ConfigError, match="learner.optimizer.learning_rate"):
        runner.run_grid(c, str(tmp_path), log=lambda m: None)


@pytest.mark.slow
def test_sigterm_stops_the_runs_in_flight(tmp_path):
    """`kill` of the grid process stops its runs (each its own process group), leaving
    nothing behind; re-running the command resumes."""
    init = make_init_checkpoint(str(tmp_path / "init"))
    workdir = str(tmp_path / "grid")
    script = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/tests', "
              "sys.argv[1] + '/tests/ablation']; from test_ablate import _micro_grid; "
              "from pipelinerl_jax.ablation import runner; "
              "c = _micro_grid(sys.argv[2]); c.experiment.learner.total_steps = 200; "
              "runner.run_grid(c, sys.argv[3])")
    p = subprocess.Popen([sys.executable, "-c", script, ROOT, init, workdir], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ours():
        out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
        return [line for line in out.splitlines()
                if workdir in line and str(p.pid) != line.split()[0]]

    deadline = time.time() + 240
    while time.time() < deadline and not any("--role=learner" in line for line in ours()):
        assert p.poll() is None, "the grid ended before its runs started"
        time.sleep(0.5)
    assert any("--role=learner" in line for line in ours())
    p.terminate()
    assert p.wait(timeout=120) != 0
    deadline = time.time() + 60
    while time.time() < deadline and ours():
        time.sleep(0.5)
    assert ours() == []


def test_runs_finished_in_committed_tables_are_not_run_again(tmp_path):
    """A grid resumed on a new machine (its workdir gone) skips the runs whose results were
    committed as tables, and refuses a committed run of another config under the same name."""
    c = grid.ablation_config(_tiny_experiment())
    c.axes.seed = grid.sweep("seed", (0, 1))
    names = [r.name for r in grid.expand(c)]
    tables = tmp_path / "tables"
    tables.mkdir()

    def write(lr):
        with open(tables / "runs.csv", "w", newline="") as f:
            w = csv.DictWriter(f, ["run", "status", "seed", "learning_rate", "lag_injection"])
            w.writeheader()
            for n in names:
                w.writerow({"run": n, "status": "done", "seed": n.split("=")[-1],
                            "learning_rate": lr, "lag_injection": "True"})

    write(c.experiment.learner.optimizer.learning_rate)
    c.runner.finished_tables = str(tables)
    out = runner.run_grid(c, str(tmp_path / "w"), log=lambda m: None)
    assert sorted(out["skipped"]) == sorted(names) and out["ran"] == []
    write(3e-4)
    with pytest.raises(ConfigError, match="learning_rate: table '0.0003'"):
        runner.run_grid(c, str(tmp_path / "w2"), log=lambda m: None)
    c.runner.finished_tables = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="runner.finished_tables"):
        runner.run_grid(c, str(tmp_path / "w3"), log=lambda m: None)
