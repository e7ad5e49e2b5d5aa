"""Crashed processes during one real run (queue server, learner and rollout worker as separate
processes, gRPC on 127.0.0.1): a rollout worker, then the queue server, then the learner are
SIGKILLed, each while the run is training. The launcher restarts each; the run completes.

What the learner trained is read back from `batches.jsonl` (one line per delivered batch:
its id, delivery count, groups, what the learner did with it) and `events.jsonl` (every
process start/exit, every queue restart a worker noticed)."""
import collections
import os
import re
import signal
import zlib

import numpy as np
import pytest

from pipelinerl_jax import records

from tests.reliability.reliability_testlib import (
    committed, events, finish, logs, max_step, pid_of, queue_client, read_jsonl, sigkill,
    start_train, stop, wait_for)

pytestmark = pytest.mark.slow

TOTAL = 30
BATCH_GROUPS = GROUP_SIZE = 2  # as in TINY_FLAGS
FLAGS = (f"--config.learner.total_steps={TOTAL}", "--config.learner.checkpoint_every=2",
         "--config.learner.keep_checkpoints=3", "--config.max_lag=2",
         "--config.launch.max_worker_restarts=1", "--config.launch.max_queue_restarts=1",
         "--config.launch.max_learner_restarts=1")


@pytest.fixture(scope="module")
def chaos(tmp_path_factory, init_ckpt):
    """Runs the fault sequence once; returns (workdir, {fault: learner step when injected}).

    Every fault is placed under a hold the test releases, never on a state caught between
    polls: a SIGSTOPped rollout worker bounds what the learner can train (it trains what the
    queue holds, then waits), so the run cannot reach its last step while the test looks."""
    workdir = str(tmp_path_factory.mktemp("chaos") / "run")
    proc = start_train(workdir, f"--config.warm_start.checkpoint={init_ckpt}", *FLAGS)
    at = {}
    held = None
    try:
        # 1. A rollout worker dies mid-run. The learner then waits for data: the run pauses
        #    until the restarted worker samples again.
        wait_for(lambda: max_step(workdir) >= 2, workdir, proc, what="step 2")
        at["worker"] = max_step(workdir)
        sigkill(pid_of(workdir, "worker0"))
        wait_for(lambda: len(_worker_nonces(workdir)) == 2, workdir, proc,
                 what="a batch from the restarted worker")
        # 2. The queue server dies with groups (and delivered, unacknowledged batches) in it.
        #    The worker is held (SIGSTOP) the moment it has noticed the new queue: from then on
        #    the learner trains only what the new queue holds and what this test puts in.
        at["queue"] = max_step(workdir)
        sigkill(pid_of(workdir, "queue"))
        wait_for(lambda: [e for e in events(workdir) if e["event"] == "queue_restart"],
                 workdir, proc, what="the worker noticing the new queue")
        held = pid_of(workdir, "worker0")
        os.kill(held, signal.SIGSTOP)
        # 3. The learner dies at an odd step, at least 4 steps after the queue restart and
        #    after a checkpoint made since then: its last batch is trained, not covered by a
        #    checkpoint, so the new queue redelivers it to the restarted learner. The test
        #    steps the learner one batch at a time by putting whole groups into the queue.
        with queue_client(workdir) as client:
            for injected in range(4 * TOTAL):
                step = wait_for(lambda: _learner_idle(workdir, client), workdir, proc,
                                what="the learner waiting for data")
                if step >= at["queue"] + 4 and step % 2:  # the learner waits; its save finishes
                    wait_for(lambda: committed(workdir, step - 1), workdir, proc,
                             what=f"checkpoint {step - 1}")
                    break
                assert step < TOTAL - 1, f"no room left to kill the learner: {at}, step {step}"
                # One more whole group; the idle learner takes a batch once the queue holds
                # BATCH_GROUPS fresh ones (a held worker's stale group is dropped on delivery,
                # and then the learner is idle again at the same step).
                client.put_group(_group(f"held-{injected}", client.stats()["learner_version"]))
            else:
                raise AssertionError(f"the learner never reached a step to kill it at: {at}")
        at["learner"] = step
        sigkill(pid_of(workdir, "learner"))
        os.kill(held, signal.SIGCONT)
        held = None
        code = finish(proc, workdir)
    finally:
        if held is not None:
            os.kill(held, signal.SIGCONT)
        stop(proc)
    assert code == 0, logs(workdir)
    assert at["learner"] < TOTAL, f"the run ended before the learner was killed: {at}"
    return workdir, at


def _learner_idle(workdir, client):
    """The learner's step once it has announced itself to this queue, trained everything the
    queue delivered, and the queue holds no whole batch for it (with the worker held, nothing
    changes this any more); None before. Steps start at 1, so an idle learner is truthy."""
    stats = client.stats()
    if stats["learner_version"] < 0:
        return None  # the learner has not reached this (restarted) queue yet: not waiting on it
    delivered = stats["batches_delivered"] + stats["batches_redelivered"]
    handled = [b for b in read_jsonl(os.path.join(workdir, "batches.jsonl"))
               if b["batch_id"].startswith(stats["server_id"])]
    step = max_step(workdir)
    if stats["ready_groups"] >= BATCH_GROUPS or len(handled) != delivered:
        return None
    if step != max((b["step"] for b in _trained(workdir)), default=0):
        return None  # the last trained step's metrics row is not written yet
    return step


def _group(group_id: str, version: int) -> list:
    """A whole group of valid rollouts sampled (so its provenance says) at `version`."""
    rng = np.random.default_rng(zlib.crc32(group_id.encode()))
    out = []
    for i in range(GROUP_SIZE):
        n = 4
        out.append(records.Rollout(
            prompt_ids=rng.integers(1, 40, 3).astype(np.int32),
            completion_ids=rng.integers(1, 40, n).astype(np.int32),
            logp_behaviour=np.full(n, -1.0, np.float32),
            version=np.full(n, version, np.int32), kv_version=np.full(n, version, np.int32),
            reward=float(i), advantage=float(i) - 0.5, group_id=group_id,
            group_size=GROUP_SIZE, task_id="held", finish_reason="stop",
            start_version=version, engine_id="test", submit_time=0.0, start_time=0.0,
            finish_time=0.0))
    return out


def _worker_nonces(workdir):
    """Worker incarnations whose groups were trained (group ids are 'w0-<nonce>-<seq>'; the
    groups this test puts are 'held-<n>')."""
    return {g.split("-")[1] for b in _trained(workdir) for g in b["group_ids"]
            if g.startswith("w0-")}


def _trained(workdir):
    return [b for b in read_jsonl(os.path.join(workdir, "batches.jsonl"))
            if b["action"] == "trained"]


def test_killed_worker_is_restarted_and_no_partial_group_is_trained(chaos):
    workdir, at = chaos
    exits = [e for e in events(workdir) if e["event"] == "exit" and e["child"] == "worker0"]
    assert [e["code"] for e in exits] == [-9]
    batches = _trained(workdir)
    # Every group the learner trained on was whole (the killed worker's half-sampled groups
    # never reached the queue), and every batch had exactly batch_groups groups.
    assert all(b["incomplete_groups"] == [] for b in batches)
    assert all(b["num_groups"] == 2 and b["num_rollouts"] == 4 for b in batches)
    # The learner trained on groups of both worker incarnations (group ids carry a
    # per-process nonce: "w0-<nonce>-<seq>"), and the restarted worker's groups were not
    # refused as duplicates of its predecessor's.
    assert len(_worker_nonces(workdir)) == 2
    assert not [e for e in events(workdir) if e["event"] == "group_rejected"
                and "already" in e["reason"]]
    rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert max(r["step"] for r in rows) == TOTAL


def test_restarted_queue_is_refilled_and_the_run_completes(chaos):
    workdir, at = chaos
    assert [e["code"] for e in events(workdir) if e["event"] == "exit"
            and e["child"] == "queue"] == [-9]
    # The worker noticed the new queue instance and counted what was lost with the old one.
    noticed = [e for e in events(workdir) if e["event"] == "queue_restart"]
    assert len(noticed) == 1 and noticed[0]["lost_groups"] >= 0
    queues = {e["server_id"] for e in noticed}
    # Batches came from both queue instances (batch ids start with the server id), and the
    # batches of the new one carry rollouts regenerated after the restart.
    batches = _trained(workdir)
    servers = [b["batch_id"].split("-")[0] for b in batches]
    assert len(set(servers)) == 2 and servers[-1] in queues
    first_new = servers.index(servers[-1])
    assert all(s == servers[-1] for s in servers[first_new:])  # never back to the old one
    assert all(b["incomplete_groups"] == [] for b in batches)
    # The learner reconnected and announced its version to the new queue: training went on
    # for at least 4 steps between the queue restart and the learner kill.
    assert at["learner"] >= at["queue"] + 4
    learner_log = open(os.path.join(workdir, "logs", "learner.log")).read()
    assert "Traceback" not in learner_log.split("restart 1")[0]


def test_killed_learner_resumes_and_never_retrains_a_committed_batch(chaos):
    workdir, at = chaos
    learner_exits = [e for e in events(workdir) if e["event"] == "exit"
                     and e["child"] == "learner"]
    assert [e["code"] for e in learner_exits] == [-9, 0]  # the kill, then its clean end
    log = open(os.path.join(workdir, "logs", "learner.log")).read()
    resumed = int(re.search(r"resumed from step (\d+)", log).group(1))
    assert resumed >= 2 and resumed % 2 == 0
    rows = read_jsonl(os.path.join(workdir, "batches.jsonl"))
    first, second = [p for p in dict.fromkeys(r["pid"] for r in rows)]
    before = [r for r in rows if r["pid"] == first]
    after = [r for r in rows if r["pid"] == second]
    committed_ids = {r["batch_id"] for r in before
                     if r["action"] == "trained" and r["step"] <= resumed}
    # Batches delivered to the killed learner but never acknowledged came back ...
    redelivered = [r for r in after if r["delivery_count"] > 1]
    assert redelivered, "no batch was redelivered to the restarted learner"
    # ... those whose step was committed were skipped (and acknowledged), never retrained;
    retrained = {r["batch_id"] for r in after if r["action"] == "trained"}
    assert not retrained & committed_ids
    assert {r["batch_id"] for r in after if r["action"] == "skipped_committed"} <= committed_ids
    # ... and those trained after the checkpoint were trained again, at the same steps.
    lost_steps = {r["batch_id"]: r["step"] for r in before
                  if r["action"] == "trained" and r["step"] > resumed}
    again = {r["batch_id"]: r["step"] for r in after if r["batch_id"] in lost_steps}
    assert again == {b: s for b, s in lost_steps.items() if b in again}
    # The final lineage: steps 1..TOTAL, each trained once on a distinct batch.
    lineage = {}
    for r in rows:
        if r["action"] == "trained" and not (r["pid"] == first and r["step"] > resumed):
            assert r["step"] not in lineage, f"step {r['step']} trained twice"
            lineage[r["step"]] = r["batch_id"]
    assert sorted(lineage) == list(range(1, TOTAL + 1))
    assert len(set(lineage.values())) == TOTAL
    assert collections.Counter(r["step"] for r in read_jsonl(
        os.path.join(workdir, "metrics.jsonl")))[TOTAL] == 1
