"""The single-process lag-injected mode (launch/inprocess.py, `runner.mode='inprocess'`):
bad configs are refused before anything starts, naming the key; and a run trains exactly
what the pipeline's run of the same config trains (the slow test: the pipeline side starts
processes)."""
import json
import os

import ml_collections
import pytest

from tests.pipeline_testlib import make_init_checkpoint
from pipelinerl_jax import run_config
from pipelinerl_jax.ablation import grid, runner
from pipelinerl_jax.ablation.same_run import differences
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.launch.inprocess import check_inprocess
from tests.ablation.test_ablate import _tiny_experiment


def _resolved(edit):
    e = _tiny_experiment()
    edit(e)
    return run_config.resolve(ml_collections.ConfigDict(e.to_dict()))


@pytest.mark.parametrize("edit, key", [
    (lambda e: setattr(e.lag_injection, "enabled", False), "lag_injection.enabled"),
    (lambda e: setattr(e.rollout, "num_workers", 2), "rollout.num_workers"),
])
def test_what_one_process_cannot_run_is_refused_naming_the_key(edit, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_inprocess(_resolved(edit))
    check_inprocess(_resolved(lambda e: None))  # the tiny lag-injected run is fine


def _grid(init, mode):
    c = grid.ablation_config(_tiny_experiment())
    e = c.experiment
    e.warm_start.checkpoint = init
    # rewards that vary within groups (truncation costs -1), so the runs really train
    e.task.truncated_reward = -1.0
    e.learner.batch_groups = 4
    e.learner.total_steps = 3
    e.learner.eval_every = 3  # evaluations at steps 0 and 3
    e.learner.checkpoint_every = 3
    c.axes.lag = grid.sweep("lag_injection.k", (1,), also=("lag_injection.max_k",))
    c.axes.seed = grid.sweep("seed", (5,))
    c.runner.mode = mode
    return c


def test_the_runner_checks_the_mode_and_every_run_before_starting(tmp_path):
    c = _grid(str(tmp_path / "no_model_needed"), "threads")
    with pytest.raises(ConfigError, match=r"runner\.mode"):
        runner.run_grid(c, str(tmp_path / "a"), log=lambda m: None)
    c = _grid(str(tmp_path / "no_model_needed"), "inprocess")
    c.experiment.lag_injection.enabled = False
    with pytest.raises(ConfigError, match=r"lag_injection\.enabled"):
        runner.run_grid(c, str(tmp_path / "b"), log=lambda m: None)
    assert not os.path.exists(tmp_path / "b" / "runs")  # nothing started


@pytest.mark.slow
def test_inprocess_run_trains_what_the_pipeline_run_trains(tmp_path):
    init = make_init_checkpoint(str(tmp_path / "init"))
    dirs = {}
    for mode in ("pipeline", "inprocess"):
        out = runner.run_grid(_grid(init, mode), str(tmp_path / mode), log=lambda m: None)
        assert not out["failed"], out
        (name,) = os.listdir(tmp_path / mode / "runs")
        dirs[mode] = str(tmp_path / mode / "runs" / name)
        status = json.load(open(os.path.join(dirs[mode], "status.json")))
        assert status["mode"] == mode and status["provenance"]["jax"]
    # the same batches, samples, losses and evaluations, bit for bit
    assert differences(dirs["pipeline"], dirs["inprocess"]) == []
    # ... and not vacuously: three steps trained at lag 1, the loss moved, two evaluations
    rows = [json.loads(line) for line in open(os.path.join(dirs["inprocess"], "metrics.jsonl"))]
    trained = [r for r in rows if r["step"] > 0]
    assert len(trained) == 3 and any(r["loss/loss"] != 0.0 for r in trained)
    assert all(r["lag/mean"] == 1.0 for r in trained[1:])
    evals = open(os.path.join(dirs["inprocess"], "eval.jsonl")).read().splitlines()
    assert len(evals) == 2
