"""Roles on separate machines, rehearsed on loopback: the queue, a 2-process learner, two
rollout workers and the evaluator started as separate commands (docs/multihost.md), each in
its own process group, with a shared token and no launcher. A worker is killed and restarted by hand; the run
finishes and its audit trail shows every step trained once and no group trained twice."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.pipeline_testlib import (ROOT, TINY_FLAGS, make_init_checkpoint, read_jsonl,
                                    stop_process_groups, train_env)
from pipelinerl_jax.launch.learner_group import free_port

pytestmark = pytest.mark.slow

STEPS = 6
TOKEN = "a-shared-secret-token"


def test_queue_learner_and_workers_started_by_hand(tmp_path):
    init = make_init_checkpoint(str(tmp_path / "init"), seed=1)
    workdir = tmp_path / "run"
    logs = tmp_path / "logs"
    logs.mkdir()
    config = [f"--config={os.path.join(ROOT, 'configs', 'default.py')}:quick", *TINY_FLAGS,
              f"--config.transport.queue_port={free_port()}",
              f"--config.transport.weights_port={free_port()}",
              f"--config.transport.auth_token={TOKEN}",
              "--config.rollout.num_workers=2", "--config.launch.learner_processes=2",
              "--config.mesh.shape=(2,1,1)", f"--config.learner.total_steps={STEPS}",
              "--config.learner.checkpoint_every=2", "--config.learner.eval_every=3"]
    coordinator = f"127.0.0.1:{free_port()}"
    procs = {}

    def start(name, role, *extra, env=None):
        cmd = [sys.executable, "-m", "pipelinerl_jax.launch", f"--role={role}",
               f"--workdir={workdir}", *extra, *config]
        with open(logs / f"{name}.log", "a") as log:
            procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                           env=train_env(env), cwd=ROOT,
                                           start_new_session=True)

    try:
        start("queue", "queue")
        for i in range(2):  # what each learner host runs, with its own JAX_PROCESS_ID
            start(f"learner{i}", "learner", f"--init_checkpoint={init}",
                  env={"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_PROCESS_ID": str(i)})
        for i in range(2):
            start(f"worker{i}", "worker", f"--index={i}", f"--init_checkpoint={init}")
        start("evaluator", "evaluator", f"--init_checkpoint={init}")

        metrics = workdir / "metrics.jsonl"

        def wait_for_step(step, timeout=300):
            deadline = time.time() + timeout
            while time.time() < deadline:
                rows = read_jsonl(metrics) if metrics.exists() else []
                if any(r["step"] >= step for r in rows):
                    return
                for name, p in procs.items():
                    assert p.poll() is None, f"{name} exited:\n" + \
                        (logs / f"{name}.log").read_text()[-3000:]
                time.sleep(0.5)
            pytest.fail(f"step {step} not reached")

        wait_for_step(2)
        os.killpg(procs["worker1"].pid, signal.SIGKILL)  # by hand: kill, then start again
        procs["worker1"].wait()
        start("worker1", "worker", "--index=1", f"--init_checkpoint={init}")

        for i in range(2):
            assert procs[f"learner{i}"].wait(timeout=600) == 0, \
                (logs / f"learner{i}.log").read_text()[-3000:]
        # The evaluator ends by itself once the learner's last version is evaluated.
        assert procs["evaluator"].wait(timeout=600) == 0, \
            (logs / "evaluator.log").read_text()[-3000:]
    finally:
        stop_process_groups(procs.values())

    rows = read_jsonl(metrics)
    assert max(r["step"] for r in rows) == STEPS
    # The primary handed versions 0, 3 and 6 over; the evaluator evaluated each.
    assert [r["version"] for r in read_jsonl(workdir / "eval.jsonl")] == [0, 3, 6]
    batches = read_jsonl(workdir / "batches.jsonl")
    trained = [b for b in batches if b["action"] == "trained"]
    assert [b["step"] for b in trained] == list(range(1, STEPS + 1))  # each step once
    groups = [g for b in trained for g in b["group_ids"]]
    assert len(groups) == len(set(groups)), "a group was trained twice"
    assert not any(b["incomplete_groups"] for b in trained)
    # Both workers fed the learner, the restarted one under a new identity.
    assert {g.split("-")[0] for g in groups} == {"w0", "w1"}
    # One voice: one learner process wrote the files, each role its own resolved config.
    assert len({b["pid"] for b in batches}) == 1
    for name in ("queue", "learner0", "learner1", "worker0", "worker1", "evaluator"):
        assert (workdir / f"config.{name}.json").exists()
    assert TOKEN not in "".join((logs / f).read_text() for f in os.listdir(logs))
