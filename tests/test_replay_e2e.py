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


def _same_ids(group_id):
    """A group id without its per-process nonce (`w0-1a2b3c-7` -> `w0-7`): the request seed
    and prompt follow the worker's sequence number, the nonce only keeps restarts apart."""
    return re.sub(r"^(w\d+)-[0-9a-f]+-(\d+)$", r"\1-\2", group_id)


def test_async_with_max_lag_0_trains_on_the_sync_runs_data(tmp_path, init_ckpt):
    """`max_lag=0` admits a group for batch v only while the engine holds version v, which is
    what sync mode does (it sets max_lag=0): the same seeds give the same batches."""
    runs = {}
    for mode in ("sync", "async"):
        run_train(tmp_path / mode, f"--config.mode={mode}", "--config.max_lag=0",
                  "--config.learner.eval_every=0", f"--config.warm_start.checkpoint={init_ckpt}",
                  *RUN_FLAGS)
        rows = [r for r in read_jsonl(tmp_path / mode / "metrics.jsonl") if r["step"] > 0]
        batches = [b for b in read_jsonl(tmp_path / mode / "batches.jsonl")
                   if b["action"] == "trained"]
        index = recording.read_index(str(tmp_path / mode / "recorded"))
        runs[mode] = rows, batches, index
    (sync_rows, sync_batches, sync_index), (rows, batches, index) = runs["sync"], runs["async"]
    assert [b["step"] for b in batches] == [b["step"] for b in sync_batches] == [1, 2, 3]
    # The same groups in the same steps, the same rows in the same order.
    assert ([[_same_ids(g) for g in b["group_ids"]] for b in batches]
            == [[_same_ids(g) for g in b["group_ids"]] for b in sync_batches])
    assert ([[_same_ids(g) for g in e["group_ids"]] for e in index]
            == [[_same_ids(g) for g in e["group_ids"]] for e in sync_index])
    assert [e["rewards"] for e in index] == [e["rewards"] for e in sync_index]
    for r, s in zip(rows, sync_rows):
        assert r["lag/max"] == s["lag/max"] == 0
        assert r["reward/mean"] == s["reward/mean"]
        for k in [k for k in s if k.startswith("loss/")]:
            np.testing.assert_allclose(r[k], s[k], rtol=1e-5, atol=1e-7, err_msg=k)
    # The trained arrays: token ids, masks and lags exactly; behaviour log-probs to rounding
    # (the engine batches the same requests together at slightly different times).
    for e, s in zip(index, sync_index):
        a = recording.load_arrays(str(tmp_path / "async" / "recorded"), e)
        b = recording.load_arrays(str(tmp_path / "sync" / "recorded"), s)
        for k in a:
            if a[k].dtype.kind == "f" and k != "loss_mask":
                np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
            else:
                np.testing.assert_array_equal(a[k], b[k], err_msg=k)
