"""The admission policies alone (rollout/admission.py), driven by a fake queue-stats source
and an engine that records what it is asked to install: batch places within the lag limit,
the queue's lower limit, drops freeing places earliest batch first, a restarted queue
releasing the places of groups it lost, rollbacks, waves; and the lag-injection policy
waiting for its step's weights, installing them as the policy version they carry, and
drawing a new prompt stream per step."""
import collections
import itertools
import json

import numpy as np

from pipelinerl_jax.rollout.admission import (BatchPlaces, InjectedLagAdmission,
                                              PipelineAdmission, QueueView, worker_share)
from pipelinerl_jax.rollout.rollout_log import RolloutLog
from pipelinerl_jax.transport.weight_version import WeightVersion


class StatsSource:
    """The queue as admission sees it: `stats()` of the queue server's shape."""

    def __init__(self, **stats):
        self.now = dict(server_id="q1", learner_version=0, max_lag=-1,
                        producer_dropped_groups=0)
        self.now.update(stats)
        self.calls = 0

    def stats(self):
        self.calls += 1
        return dict(self.now)


class Engine:
    """`version` and `update_weights`, recording every install."""

    def __init__(self, version=0):
        self.version, self.installs = version, []

    def update_weights(self, params, version, *, wait=True, allow_older=False):
        self.installs.append((params, version, allow_older))
        self.version = version


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def problems(tag="p"):
    return (f"{tag}{i}" for i in itertools.count())


def pipeline(tmp_path, *, share=2, max_lag=1, engine_version=0, lockstep=False, **stats):
    queue_stats, clock, counts = StatsSource(**stats), Clock(), collections.Counter()
    places = BatchPlaces(share)
    log = RolloutLog(str(tmp_path), 3, clock=clock)
    queue = QueueView(queue_stats, places, counts, log, clock=clock)
    engine = Engine(engine_version)
    policy = PipelineAdmission(engine=engine, queue=queue, places=places, problems=problems(),
                               max_lag=max_lag, seed=7, worker_index=3, nonce="abc123",
                               lockstep=lockstep, rollout_log=log)
    return policy, queue_stats, clock, counts, engine


def admit_all(policy, limit=100):
    out = []
    while policy.can_admit() and len(out) < limit:
        out.append(policy.book())
    return out


def events(tmp_path):
    path = tmp_path / "events.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


def test_share_splits_a_batch_evenly():
    assert [worker_share(10, 4, i) for i in range(4)] == [3, 3, 2, 2]
    assert sum(worker_share(7, 3, i) for i in range(3)) == 7


def test_places_fill_the_earliest_batch_within_max_lag(tmp_path):
    policy, _, _, _, _ = pipeline(tmp_path, share=2, max_lag=1)
    tickets = admit_all(policy)
    assert [t.batch for t in tickets] == [0, 0, 1, 1]  # batches 0 and 1: the lag-1 window
    assert [t.problem for t in tickets] == ["p0", "p1", "p2", "p3"]
    # ids and seeds: w<index>-<nonce>-<seq>; the seed from SeedSequence([seed, index, seq])
    assert [t.group_id for t in tickets] == [f"w3-abc123-{i}" for i in range(4)]
    assert [t.seed for t in tickets] == [
        int(np.random.SeedSequence([7, 3, i]).generate_state(1)[0]) % 2**31 for i in range(4)]
    assert policy.in_flight == 4 and policy.allowed_lag() == 1


def test_the_queue_lowers_the_limit(tmp_path):
    policy, stats, clock, _, _ = pipeline(tmp_path, share=2, max_lag=3)
    stats.now["max_lag"] = 0  # the lag controller's limit
    assert [t.batch for t in admit_all(policy)] == [0, 0]
    assert policy.allowed_lag() == 0
    stats.now["max_lag"] = 2
    clock.t += 1.0  # the cached stats expire
    assert [t.batch for t in admit_all(policy)] == [1, 1, 2, 2]


def test_consumed_batches_are_forgotten_and_a_freed_place_is_refilled(tmp_path):
    policy, stats, clock, _, engine = pipeline(tmp_path, share=2, max_lag=1)
    tickets = admit_all(policy)
    for t in tickets:
        policy.finished(t.group_id)
    policy.release(tickets[3].batch)  # e.g. filtered: a replacement takes its place
    assert [t.batch for t in admit_all(policy)] == [1]
    stats.now["learner_version"], engine.version = 1, 1  # batch 0 was consumed
    clock.t += 1.0
    assert [t.batch for t in admit_all(policy)] == [2, 2]


def test_groups_dropped_by_the_queue_free_places_earliest_batch_first(tmp_path):
    policy, stats, clock, counts, _ = pipeline(tmp_path, share=2, max_lag=2)
    for t in admit_all(policy):  # batches 0, 0, 1, 1, 2, 2: all put
        policy.finished(t.group_id)
    stats.now["producer_dropped_groups"] = 3
    clock.t += 1.0
    assert [t.batch for t in admit_all(policy)] == [0, 0, 1]
    assert counts["groups_dropped_in_queue"] == 3
    assert [(e["event"], e["groups"], e["places_freed"], e["child"]) for e in events(tmp_path)] \
        == [("groups_dropped_in_queue", 3, 3, "worker3")]
    clock.t += 1.0  # the same total again: nothing new
    assert admit_all(policy) == [] and counts["groups_dropped_in_queue"] == 3


def test_drops_of_consumed_batches_free_nothing(tmp_path):
    policy, stats, clock, counts, engine = pipeline(tmp_path, share=1, max_lag=1)
    for t in admit_all(policy):  # batches 0 and 1
        policy.finished(t.group_id)
    stats.now.update(learner_version=1, producer_dropped_groups=2)
    engine.version = 1
    clock.t += 1.0
    assert [t.batch for t in admit_all(policy)] == [1, 2]  # batch 1's place, then batch 2
    assert counts["groups_dropped_in_queue"] == 2
    assert events(tmp_path)[0]["places_freed"] == 1


def test_a_restarted_queue_releases_the_places_of_groups_it_lost(tmp_path):
    policy, stats, clock, counts, _ = pipeline(tmp_path, share=2, max_lag=1)
    tickets = admit_all(policy)
    for t in tickets[:3]:  # three put; the fourth (batch 1) still being generated
        policy.finished(t.group_id)
    stats.now.update(server_id="q2", producer_dropped_groups=0)  # new instance, empty
    clock.t += 1.0
    again = admit_all(policy)
    assert [t.batch for t in again] == [0, 0, 1]  # the lost three, regenerated
    assert counts["queue_restarts"] == 1 and counts["groups_lost_in_queue"] == 3
    restart = [e for e in events(tmp_path) if e["event"] == "queue_restart"]
    assert restart == [dict(restart[0], server_id="q2", lost_groups=3)]
    # the new instance counts drops from zero: its first drop frees a place
    for t in [tickets[3]] + again:
        policy.finished(t.group_id)
    stats.now["producer_dropped_groups"] = 1
    clock.t += 1.0
    assert [t.batch for t in admit_all(policy)] == [0]


def test_no_group_starts_before_weights_or_a_learner_or_while_the_engine_is_ahead(tmp_path):
    policy, stats, clock, _, engine = pipeline(tmp_path, engine_version=-1)
    assert not policy.can_admit() and stats.calls == 0  # no weights yet: the queue not asked
    engine.version, stats.now["learner_version"] = 0, -1
    assert not policy.can_admit()  # no learner announced
    # a learner restarted from an older checkpoint: version 1 while the engine holds 2
    engine.version, stats.now["learner_version"] = 2, 1
    clock.t += 1.0
    calls = stats.calls
    assert not policy.can_admit()
    assert stats.calls == calls + 2  # looked again at once, without waiting for the cache
    policy.on_weights(_msg(1, {"w": 1}))
    assert engine.installs[-1] == (_msg(1, {"w": 1}), 1, True) and policy.can_admit()
    assert [e["event"] for e in events(tmp_path)] == ["weights_rollback"]
    policy.on_weights(_msg(2, {"w": 2}))
    policy.on_weights(_msg(2, {"w": 2}))  # the same version again: nothing to do
    assert engine.installs[1:] == [(_msg(2, {"w": 2}), 2, False)]


def test_lockstep_starts_groups_in_waves(tmp_path):
    policy, _, _, _, _ = pipeline(tmp_path, share=3, max_lag=0, lockstep=True)
    assert policy.room(2) == 3  # the whole share at once, even past max_requests
    tickets = admit_all(policy, limit=policy.room(2))
    assert [t.batch for t in tickets] == [0, 0, 0]
    policy.finished(tickets[0].group_id)
    assert policy.room(2) == 0  # nothing until the wave is in
    for t in tickets[1:]:
        policy.finished(t.group_id)
    assert policy.room(2) == 3
    assert pipeline(tmp_path, share=3)[0].room(2) == 2  # async: up to max_requests


def _msg(version, tensors=None, policy_version=None, path=None):
    return WeightVersion("full").carrying(version, tensors=tensors, path=path,
                                          policy_version=policy_version)


def injected(tmp_path, share=2):
    queue_stats, clock, counts = StatsSource(learner_version=-1), Clock(), collections.Counter()
    places = BatchPlaces(share)
    log = RolloutLog(str(tmp_path), 0, clock=clock)
    queue = QueueView(queue_stats, places, counts, log, clock=clock)
    engine, streams = Engine(-1), []

    def problems_for(step):
        streams.append(step)
        return problems(f"s{step}p")

    policy = InjectedLagAdmission(engine=engine, queue=queue, places=places,
                                  problems_for=problems_for, seed=5, worker_index=0)
    return policy, queue_stats, clock, engine, streams


def test_injection_waits_for_the_weights_of_its_step_and_installs_their_policy_version(
        tmp_path):
    policy, stats, clock, engine, streams = injected(tmp_path)
    assert policy.lockstep and policy.allowed_lag() == 0
    weights = {"w": np.arange(3.0)}
    policy.on_weights(_msg(0, weights, 0))
    assert not policy.can_admit()  # no learner announced yet
    stats.now["learner_version"] = 0
    clock.t += 1.0
    assert engine.installs == []  # installed when the step starts, not on arrival
    tickets = admit_all(policy)
    assert [(t.group_id, t.batch, t.problem) for t in tickets] == [
        ("w0-s0-0", 0, "s0p0"), ("w0-s0-1", 0, "s0p1")]
    assert [t.seed for t in tickets] == [
        int(np.random.SeedSequence([5, 0, 0, k]).generate_state(1)[0]) % 2**31 for k in (0, 1)]
    assert len(engine.installs) == 1 and engine.installs[0][1:] == (0, True)
    # step 1: the learner ships the weights of policy version 0 again (lag 1)
    for t in tickets:
        policy.finished(t.group_id)
    stats.now["learner_version"] = 1
    clock.t += 1.0
    assert not policy.can_admit()  # step 1's weights have not arrived
    policy.on_weights(_msg(1, weights, 0))
    tickets = admit_all(policy)
    assert [(t.group_id, t.problem) for t in tickets] == [("w0-s1-0", "s1p0"), ("w0-s1-1", "s1p1")]
    params, version, allow_older = engine.installs[1]
    assert (version, allow_older) == (0, True)  # installed as the policy version it holds
    assert params.version == 1 and params.policy == 0  # the message as it arrived
    # step 2: its weights are here, but step 1's groups finish first
    policy.on_weights(_msg(2, {"w": np.ones(3)}, 1))
    stats.now["learner_version"] = 2
    clock.t += 1.0
    assert not policy.can_admit() and len(engine.installs) == 2
    for t in tickets:
        policy.finished(t.group_id)
    assert [t.group_id for t in admit_all(policy)] == ["w0-s2-0", "w0-s2-1"]
    assert engine.installs[2][1:] == (1, True)
    assert streams == [0, 1, 2]  # a new prompt stream per step


def test_injection_refills_a_released_place_within_the_step(tmp_path):
    policy, stats, clock, engine, streams = injected(tmp_path, share=2)
    stats.now["learner_version"] = 0
    policy.on_weights(_msg(0, path="/weights/v0"))  # a directory: passed on as it is
    tickets = admit_all(policy)
    for t in tickets:
        policy.finished(t.group_id)
    policy.release(tickets[1].batch)  # filtered
    assert [t.group_id for t in admit_all(policy)] == ["w0-s0-2"]
    assert engine.installs == [(_msg(0, path="/weights/v0"), 0, True)] and streams == [0]
