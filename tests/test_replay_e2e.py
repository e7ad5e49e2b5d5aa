"""Record and replay end to end (docs/replay.md): a real async run records its batches, a
fresh learner replays them; and an async run with max_lag=0 trains on the sync run's data."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from pipeline_testlib import ROOT, TINY_FLAGS, make_init_checkpoint, read_jsonl, run_train, \
    train_env

from pipelinerl_jax.learner import recording

pytestmark = pytest.mark.slow

STEPS = 3
# A random model earns no task reward; DAPO's overlong penalty over a short budget makes
# rewards vary with answer length, and only groups with non-zero advantages are trained.
RUN_FLAGS = ("--config.learner.record_batches=True", f"--config.learner.total_steps={STEPS}",
             f"--config.learner.checkpoint_every={STEPS}",
             "--config.rollout.advantage.overlong=penalty",
             "--config.rollout.advantage.overlong_buffer=8",
             "--config.rollout.advantage.drop_zero_variance=True")
# Replayed loss metrics agree with the recorded run's (bit for bit when tried): same program, same
# data, but a separate process (its XLA thread pool may differ).
RTOL, ATOL = 1e-6, 1e-9


@pytest.fixture(scope="module")
def init_ckpt(tmp_path_factory):
    return make_init_checkpoint(str(tmp_path_factory.mktemp("init") / "model"))


def replay(recorded, workdir, *flags):
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "replay.py"),
           f"--config={os.path.join(ROOT, 'configs', 'default.py')}:quick",
           f"--recording={recorded}", f"--workdir={workdir}", *TINY_FLAGS, *RUN_FLAGS, *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, env=train_env(), timeout=600,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def loss_metrics(rows):
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("loss/")}
            for r in rows if r["step"] > 0}


def test_replay_with_the_same_loss_is_exact_and_another_loss_differs(tmp_path, init_ckpt):
    run = tmp_path / "async"
    run_train(run, "--config.mode=async", "--config.max_lag=2", "--config.learner.eval_every=0",
              f"--config.warm_start.checkpoint={init_ckpt}", *RUN_FLAGS)
    recorded = [r for r in read_jsonl(run / "metrics.jsonl") if r["step"] > 0]
    index = recording.read_index(str(run / "recorded"))
    assert [e["step"] for e in index] == list(range(1, STEPS + 1))
    trained = [b for b in read_jsonl(run / "batches.jsonl") if b["action"] == "trained"]
    assert [e["batch_id"] for e in index] == [b["batch_id"] for b in trained]
    assert [sorted(set(e["group_ids"])) for e in index] == [b["group_ids"] for b in trained]
    assert all(np.abs(recording.load_arrays(str(run / "recorded"), e)["advantages"]).max() > 0
               for e in index)  # a loss with something to learn from

    same = replay(run, tmp_path / "same", "--config.learner.eval_every=2")
    want, got = loss_metrics(recorded), loss_metrics(same)
    assert sorted(got) == list(range(1, STEPS + 1)) and got.keys() == want.keys()
    for step in want:
        assert got[step].keys() == want[step].keys()
        for k in want[step]:
            np.testing.assert_allclose(got[step][k], want[step][k], rtol=RTOL, atol=ATOL,
                                       err_msg=f"step {step} {k}")
    # The data metrics are the recording's; held-out eval at 0, 2 and the end.
    for r, w in zip([r for r in same if r["step"] > 0], recorded):
        assert (r["reward/mean"], r["lag/mean"]) == (w["reward/mean"], w["lag/mean"])
    assert [r["step"] for r in same if "eval/accuracy" in r] == [0, 2, STEPS]

    other = replay(run, tmp_path / "ppo", "--config.loss.name=ppo",
                   "--config.learner.eval_every=0")
    moved = loss_metrics(other)
    assert sorted(moved) == list(range(1, STEPS + 1))
    assert all(np.isfinite(v) for m in moved.values() for v in m.values())
    # Another loss on the same data: PPO's clipped ratio surrogate, not TIS's weighted
    # log-likelihood, so its values differ (and its policy from step 2 on).
    assert all(not np.isclose(moved[s]["loss/loss"], want[s]["loss/loss"], rtol=1e-3)
               for s in want)
    assert "loss/clip_frac" in moved[1]
