"""Crash and resume: SIGKILL the learner mid-run, restart with the same workdir, and end with
bit-exact the parameters of an uninterrupted run (lag injection + fixed seeds make the data
deterministic; at-least-once delivery + trained-batch ids make the restart exact)."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from pipeline_testlib import ROOT, TINY_FLAGS, make_init_checkpoint, read_jsonl, run_train

pytestmark = pytest.mark.slow

STEPS = 8  # the kill comes after step 2's checkpoint: 6 steps of margin on a loaded machine
FLAGS = ("--config.lag_injection.enabled=True", "--config.lag_injection.k=1",
         f"--config.learner.total_steps={STEPS}", "--config.learner.checkpoint_every=1",
         "--config.learner.keep_checkpoints=10", "--config.learner.eval_every=0",
         "--config.seed=3")


def _final_params(workdir):
    import jax
    from pipelinerl_jax.learner.checkpoint import Checkpointer
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    state, _, step = ckpt.read_state()
    ckpt.close()
    return step, jax.tree.leaves(state)


def _pids(pattern):
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_killed_learner_resumes_bit_exact(tmp_path):
    init = make_init_checkpoint(str(tmp_path / "init"), seed=1)
    flags = FLAGS + (f"--config.warm_start.checkpoint={init}",)
    run_train(tmp_path / "straight", *flags)

    crashed = tmp_path / "crashed"
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
           f"--config={os.path.join(ROOT, 'configs', 'default.py')}:quick",
           f"--workdir={crashed}", *TINY_FLAGS, *flags]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env=env, cwd=ROOT, text=True)
    deadline = time.time() + 300
    metrics = crashed / "metrics.jsonl"
    learner = []  # found before step 2's checkpoint, so the kill follows it with no search
    while time.time() < deadline:
        learner = learner or _pids(f"role=learner --workdir={crashed}")
        if learner and (crashed / "checkpoints" / "2").is_dir():  # step 2 committed
            break
        assert launcher.poll() is None, launcher.stderr.read()
        time.sleep(0.02)
    assert learner, "learner process not found"
    os.kill(learner[0], signal.SIGKILL)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode != 0 and "learner exited with -9" in err

    killed_at = max(r["step"] for r in read_jsonl(metrics))
    assert killed_at < STEPS
    run_train(crashed, *flags)  # same workdir: resumes from the last committed checkpoint
    rows = read_jsonl(metrics)
    assert max(r["step"] for r in rows) == STEPS
    # Every step was logged, and the steps trained after the restart continue where the last
    # checkpoint left off (a step trained but not checkpointed before the kill is redone).
    assert {r["step"] for r in rows if r["step"] > 0} == set(range(1, STEPS + 1))
    learner_log = (crashed / "logs" / "learner.log").read_text()
    assert "resumed from step" in learner_log

    step_a, params_a = _final_params(tmp_path / "straight")
    step_b, params_b = _final_params(crashed)
    assert step_a == step_b == STEPS
    for a, b in zip(params_a, params_b):
        np.testing.assert_array_equal(a, b)
