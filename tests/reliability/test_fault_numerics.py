"""Numerical faults and hostile producers during a real run.

A rogue producer connects to the run's queue (as a misbehaving sampler would) and
 1. sends malformed rollouts (NaN / positive log-probs, out-of-vocabulary ids, negative and
    future versions, wrong lengths and dtypes, empty and truncated messages): each is refused
    INVALID_ARGUMENT naming the field, and none reaches the learner;
 2. puts one group that passes every check (all values finite) but whose advantage is so
    large that the loss overflows: that step is skipped (parameters and optimizer state kept)
    and counted, and training goes on;
 3. floods the queue with such groups: after `learner.max_consecutive_skips` skipped steps in
    a row the learner stops with a clear message and a checkpoint of the last good state."""
import os

import grpc
import numpy as np
import pytest

from pipelinerl_jax import records
from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport.codec import rollout_to_pb
from tests.reliability.reliability_testlib import (
    checkpoint_state, finish, logs, max_step, queue_client, read_jsonl, run_config,
    start_train, stop, wait_for)

pytestmark = pytest.mark.slow

# The worker keeps the queue max_lag batches ahead, so a group put now is trained ~max_lag
# steps later: 'keep' delivers it (counted as stale) instead of dropping it.
# Truncated answers earn -1 (EOS-ended ones 0): the good steps really change the parameters.
FLAGS = ("--config.learner.total_steps=40", "--config.learner.max_consecutive_skips=3",
         "--config.learner.checkpoint_every=1", "--config.learner.keep_checkpoints=40",
         "--config.max_lag=2", "--config.transport.stale_policy=keep",
         "--config.task.truncated_reward=-1.0", "--config.sampling.max_new_tokens=20")
HUGE = 3e38  # finite (float32 max is 3.4e38), but advantage x log-prob overflows


def _group(gid, version, advantage=HUGE, size=2):
    return [records.Rollout(
        prompt_ids=np.asarray([3, 4, 5, 6], np.int32),
        completion_ids=np.asarray([7, 8, 9, 10, 2], np.int32),
        logp_behaviour=np.full(5, -4.0, np.float32), version=np.full(5, version, np.int32),
        kv_version=np.full(5, version, np.int32), reward=1.0, advantage=advantage,
        group_id=gid, group_size=size, task_id="reverse", finish_reason="stop",
        start_version=version, engine_id="rogue", submit_time=1.0, start_time=1.0,
        finish_time=1.0) for _ in range(size)]


def _hostile(version, vocab):
    """(name, serialized PutRequest) pairs a misbehaving sampler might send."""
    def with_(gid, **changes):
        m = rollout_to_pb(_group(gid, version, advantage=0.5, size=1)[0])
        for name, values in changes.items():
            arr = getattr(m, name)
            arr.data = np.asarray(values, arr.dtype).tobytes()
            arr.shape[:] = [len(values)]
        return pb.PutRequest(rollouts=[m]).SerializeToString()
    good = with_("hostile-ok-bytes")
    return [
        ("nan logp", with_("hostile-nan", logp_behaviour=[-1, -1, np.nan, -1, -1])),
        ("positive logp", with_("hostile-pos", logp_behaviour=[-1, -1, 0.7, -1, -1])),
        ("inf logp", with_("hostile-inf", logp_behaviour=[-np.inf] * 5)),
        ("out-of-vocab id", with_("hostile-oov", completion_ids=[1, 2, vocab, 3, 2])),
        ("negative id", with_("hostile-neg", prompt_ids=[-3, 4])),
        ("negative version", with_("hostile-negv", version=[-1] * 5, kv_version=[-1] * 5)),
        ("future version", with_("hostile-fut", version=[version + 100] * 5)),
        ("short logp", with_("hostile-short", logp_behaviour=[-1.0, -1.0])),
        ("empty request", b""),
        ("truncated message", good[:len(good) // 2]),
        ("garbage bytes", bytes(range(7, 250, 3))),
    ]


def _skipped(workdir):
    return [r["step"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
            if r.get("learner/skipped_steps")]


def test_non_finite_steps_are_skipped_then_too_many_stop_the_run(tmp_path, init_ckpt):
    workdir = str(tmp_path / "run")
    proc = start_train(workdir, f"--config.warm_start.checkpoint={init_ckpt}", *FLAGS)
    try:
        wait_for(lambda: os.path.exists(os.path.join(workdir, "events.jsonl")), workdir, proc,
                 what="the queue")
        client = queue_client(workdir)
        wait_for(lambda: client.stats()["learner_version"] >= 0, workdir, proc,
                 what="the learner's first version")
        version = client.stats()["learner_version"]
        vocab = run_config(workdir)["transport"]["vocab_size"]
        put = client._channel.unary_unary("/pipelinerl_jax.RolloutQueue/Put",
                                          request_serializer=lambda b: b,
                                          response_deserializer=pb.PutResponse.FromString)
        refused = {}
        for name, raw in _hostile(version, vocab):
            with pytest.raises(grpc.RpcError) as e:
                put(raw, timeout=10, metadata=client._md)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.value)
            refused[name] = e.value.details()
        assert refused["nan logp"].startswith("rollouts[0].logp_behaviour: contains NaN")
        assert refused["future version"].startswith("rollouts[0].version: version")
        client.put_group(_group("poison-0", version))  # one overflowing step
        wait_for(lambda: _skipped(workdir), workdir, proc, what="the poisoned step")
        wait_for(lambda: max_step(workdir) >= _skipped(workdir)[0] + 2, workdir, proc,
                 what="training after the skipped step")
        version = client.stats()["learner_version"]
        # A flood, in one atomic put so that no worker group lands between them: the next
        # six batches all overflow.
        client.put([r for i in range(1, 13) for r in _group(f"poison-{i}", version)])
        client.close()
        code = finish(proc, workdir)
    finally:
        stop(proc)
    out = open(os.path.join(workdir, "launcher.out")).read()
    assert code != 0
    assert "TooManySkippedSteps: 3 consecutive steps had a non-finite loss or gradient " \
           "(learner.max_consecutive_skips=3)" in out, logs(workdir)
    assert "with a checkpoint of the last good state" in out
    # ... and said so in a record, not only in words: what the ablation runner reads.
    (stopped,) = [e for e in read_jsonl(os.path.join(workdir, "events.jsonl"))
                  if e["event"] == "learner_stopped"]
    assert stopped["reason"] == "diverged" and stopped["error"] == "TooManySkippedSteps"

    rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r["step"] > 0]
    skipped = [r["step"] for r in rows if r["learner/skipped_steps"]]
    stop_step = rows[-1]["step"]
    # One isolated skip (the single poisoned group), training on, then three in a row.
    assert skipped[-3:] == [stop_step - 2, stop_step - 1, stop_step]
    assert len(skipped) == 4 and skipped[0] < stop_step - 3
    assert any(r["step"] > skipped[0] and not r["learner/skipped_steps"] for r in rows)
    # What the learner saw: every poisoned batch, and only those, was skipped; no malformed
    # rollout ever reached it.
    batches = read_jsonl(os.path.join(workdir, "batches.jsonl"))
    for b in batches:
        poisoned = any(g.startswith("poison-") for g in b["group_ids"])
        assert b["update_skipped"] == poisoned, b
        assert not any(g.startswith("hostile-") for g in b["group_ids"])
    # The checkpoint written at the stop holds the state of the last good step, exactly
    # (while the good steps before it did change the parameters).
    last_good = checkpoint_state(workdir, stop_step - 3)
    at_stop = checkpoint_state(workdir, stop_step)
    assert len(last_good) == len(at_stop)
    for a, b in zip(last_good, at_stop):
        np.testing.assert_array_equal(a, b)
    first = checkpoint_state(workdir, 1)
    assert any(not np.array_equal(a, b) for a, b in zip(first, last_good))
