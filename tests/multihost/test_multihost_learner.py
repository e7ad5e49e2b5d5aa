"""A learner as 2 jax.distributed processes (gloo collectives on CPU) is the same learner as
one process holding all the devices, and survives the SIGKILL of one of its processes.

Lag injection + fixed seeds make the data deterministic (tests/test_pipeline_resume.py), so
the runs can be compared step by step: the same batches, metrics and final parameters.
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.pipeline_testlib import (ROOT, TINY_FLAGS, make_init_checkpoint, read_jsonl,
                                    run_train, train_env)

pytestmark = pytest.mark.slow

STEPS = 4
FLAGS = ("--config.lag_injection.enabled=True", "--config.lag_injection.k=1",
         f"--config.learner.total_steps={STEPS}", "--config.learner.checkpoint_every=1",
         "--config.learner.keep_checkpoints=10", "--config.learner.eval_every=0",
         "--config.seed=3", "--config.task.truncated_reward=-1.0",  # rewards that differ
         "--config.mesh.shape=(2,2,1)")  # data across processes, fsdp within each
TWO_PROCS = ("--config.launch.learner_processes=2",)
FOUR_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def final_state(workdir, step=None):
    """(step, {leaf path: array}) of a checkpoint, read into this process's first device
    whatever topology wrote it."""
    import jax
    import orbax.checkpoint as ocp
    from pipelinerl_jax.learner.checkpoint import committed_steps
    directory = os.path.join(workdir, "checkpoints")
    step = max(committed_steps(directory)) if step is None else step
    path = os.path.join(directory, str(step), "state")
    ckpt = ocp.StandardCheckpointer()
    tree = ckpt.metadata(path).item_metadata
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), tree)
    state = jax.device_get(ckpt.restore(path, target))
    ckpt.close()
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return step, {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


@pytest.fixture(scope="module")
def init(tmp_path_factory):
    return make_init_checkpoint(str(tmp_path_factory.mktemp("init") / "model"), seed=1)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, init):
    workdir = tmp_path_factory.mktemp("two_procs")
    run_train(workdir, *FLAGS, *TWO_PROCS, f"--config.warm_start.checkpoint={init}")
    return workdir


def test_two_processes_train_like_one_process_with_all_devices(tmp_path, init,
                                                                two_process_run):
    one = tmp_path / "one_proc"
    run_train(one, *FLAGS, f"--config.warm_start.checkpoint={init}", env=FOUR_DEVICES)
    two = two_process_run

    # Two processes: one voice. Only process 0 wrote files, once per step.
    assert sorted(os.listdir(two / "logs")) == ["learner0.log", "learner1.log", "queue.log",
                                               "worker0.log"]
    starts = [e["child"] for e in read_jsonl(two / "events.jsonl") if e["event"] == "start"]
    assert sorted(starts) == ["learner0", "learner1", "queue", "worker0"]
    log1 = (two / "logs" / "learner1.log").read_text()
    assert "learner process 1 of 2 (2 local devices, 4 in all)" in log1

    def trained(workdir):
        return [(r["step"], r["group_ids"]) for r in read_jsonl(workdir / "batches.jsonl")
                if r["action"] == "trained"]
    assert trained(two) == trained(one)  # the same batches, in the same steps
    assert [s for s, _ in trained(two)] == list(range(1, STEPS + 1))

    rows_one = {r["step"]: r for r in read_jsonl(one / "metrics.jsonl")}
    rows_two = {r["step"]: r for r in read_jsonl(two / "metrics.jsonl")}
    assert sorted(rows_two) == sorted(rows_one) == list(range(1, STEPS + 1))
    def keys(row):  # per step: per-engine mismatch keys appear only with lag-0 tokens
        return {k for k in row if k.startswith(("loss/", "lag/mean", "reward/"))
                and isinstance(row[k], (int, float))}
    assert {"loss/loss", "loss/grad_norm"} <= keys(rows_one[1])
    for step in rows_one:
        assert keys(rows_two[step]) == keys(rows_one[step]), step
        for k in keys(rows_one[step]):
            np.testing.assert_allclose(rows_two[step][k], rows_one[step][k], rtol=1e-4,
                                       atol=1e-6, err_msg=f"step {step} {k}")

    step_one, params_one = final_state(one)
    step_two, params_two = final_state(two)
    assert step_one == step_two == STEPS and params_one.keys() == params_two.keys()
    for k in params_one:
        np.testing.assert_allclose(params_two[k], params_one[k], rtol=1e-4, atol=1e-6,
                                   err_msg=k)
    # ...and they did train: the parameters moved.
    _, first = final_state(two, step=1)
    assert any(not np.array_equal(first[k], params_two[k]) for k in first if "params" in k)


def test_killed_learner_process_restarts_the_group_and_resumes(tmp_path, init,
                                                               two_process_run):
    crashed = tmp_path / "crashed"
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
           f"--config={os.path.join(ROOT, 'configs', 'default.py')}:quick",
           f"--workdir={crashed}", *TINY_FLAGS, *FLAGS, *TWO_PROCS,
           f"--config.warm_start.checkpoint={init}", "--config.launch.max_learner_restarts=1"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env=train_env(), cwd=ROOT, text=True)
    record = crashed / "checkpoints" / "committed_steps.json"
    deadline = time.time() + 300
    while time.time() < deadline:
        if record.exists() and 2 in json.loads(record.read_text() or "{}").get("steps", []):
            break
        assert launcher.poll() is None, launcher.stderr.read()
        time.sleep(0.2)
    else:
        launcher.kill()
        pytest.fail("step 2 was never committed")
    pid = [e["pid"] for e in read_jsonl(crashed / "events.jsonl")
           if e["event"] == "start" and e["child"] == "learner1"][-1]
    os.kill(pid, signal.SIGKILL)  # the non-primary: process 0 is left in a collective
    _, err = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, err[-3000:]

    events = read_jsonl(crashed / "events.jsonl")
    exits = [(e["child"], e["code"], e.get("reason")) for e in events if e["event"] == "exit"]
    assert exits[0][:2] == ("learner1", -9)
    assert exits[1][::2] == ("learner0", "group member failed")  # stopped with it
    assert sorted(x[:2] for x in exits[2:]) == [("learner0", 0), ("learner1", 0)]  # the end
    starts = [e["child"] for e in events if e["event"] == "start"]
    assert starts.count("learner0") == starts.count("learner1") == 2  # the group, restarted
    assert "resumed from step" in (crashed / "logs" / "learner0.log").read_text()
    steps = {r["step"] for r in read_jsonl(crashed / "metrics.jsonl")}
    assert steps == set(range(1, STEPS + 1))

    # The resumed group ends where the uninterrupted one did.
    step_a, params_a = final_state(two_process_run)
    step_b, params_b = final_state(crashed)
    assert step_a == step_b == STEPS
    for k in params_a:
        np.testing.assert_allclose(params_b[k], params_a[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_two_processes_train_lora_adapters_like_one_process(tmp_path, init):
    """LoRA on the multi-process learner: only adapters are trained, checkpointed and
    published, and 2 processes reach the same adapters as 1 process with all devices."""
    lora = ("--config.lora.enabled=True", "--config.lora.rank=4",
            "--config.learner.optimizer.learning_rate=1e-3")
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(one, *FLAGS, *lora, f"--config.warm_start.checkpoint={init}", env=FOUR_DEVICES)
    run_train(two, *FLAGS, *lora, *TWO_PROCS, f"--config.warm_start.checkpoint={init}")
    rows_one = {r["step"]: r for r in read_jsonl(one / "metrics.jsonl")}
    rows_two = {r["step"]: r for r in read_jsonl(two / "metrics.jsonl")}
    assert sorted(rows_two) == sorted(rows_one) == list(range(1, STEPS + 1))
    for step in rows_one:
        for k in ("loss/loss", "loss/grad_norm", "reward/mean"):
            np.testing.assert_allclose(rows_two[step][k], rows_one[step][k], rtol=1e-4,
                                       atol=1e-6, err_msg=f"step {step} {k}")
    step_one, adapters_one = final_state(one)
    step_two, adapters_two = final_state(two)
    assert step_one == step_two == STEPS and adapters_one.keys() == adapters_two.keys()
    names = [k for k in adapters_one if k.startswith("['params']")]
    assert names and all("_lora_" in k for k in names), names  # adapters only: no base
    for k in adapters_one:
        np.testing.assert_allclose(adapters_two[k], adapters_one[k], rtol=1e-4, atol=1e-6,
                                   err_msg=k)
    _, first = final_state(two, step=1)
    assert any(not np.array_equal(first[k], adapters_two[k]) for k in names)  # B moved off 0
