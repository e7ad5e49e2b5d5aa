"""Closed-loop staleness control end to end (real processes): an async run whose stale ESS
can never reach its target backs the allowed lag off, every step's trained tokens respect the
limit their batch was cut under, and workers keep the learner fed while the limit drops."""
import pytest

from pipeline_testlib import make_init_checkpoint, read_jsonl, run_train

pytestmark = pytest.mark.slow


def test_auto_lag_backs_off_when_the_stale_ess_misses_its_target(tmp_path):
    init = make_init_checkpoint(str(tmp_path / "init"))
    workdir = tmp_path / "run"
    run_train(workdir, "--config.mode=async", "--config.max_lag=2",
              f"--config.warm_start.checkpoint={init}", "--config.learner.total_steps=8",
              "--config.learner.eval_every=0", "--config.learner.checkpoint_every=8",
              "--config.lag_control.enabled=True",
              # ESS <= 1 always: a target of 1 is missed by any stale step -> back off
              "--config.lag_control.target=1.0", "--config.lag_control.open_at=1.0",
              "--config.lag_control.window=1", "--config.lag_control.patience=1000",
              "--config.lag_control.min_tokens=1",
              # a policy that moves: length-shaped rewards (the random model is never right)
              # and a large step size, so stale tokens' ESS is visibly below 1
              "--config.rollout.advantage.overlong=penalty",
              "--config.rollout.advantage.overlong_buffer=8",
              "--config.learner.optimizer.learning_rate=0.01")
    steps = [r for r in read_jsonl(workdir / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, 9))
    limits = [r["lag_control/max_lag"] for r in steps]
    assert limits[0] == 2 and limits[-1] < 2, limits  # it started open and backed off
    assert all(b <= a for a, b in zip(limits, limits[1:])), limits  # never opened again
    for r in steps:
        # the step's batch was cut under the limit announced after the step before
        assert r["lag/max"] <= r["lag_control/max_lag"], r
        assert r["lag_control/next_max_lag"] - r["lag_control/max_lag"] == r["lag_control/action"]
    assert all(a["lag_control/next_max_lag"] == b["lag_control/max_lag"]
               for a, b in zip(steps, steps[1:]))
