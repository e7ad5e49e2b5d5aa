"""The scorer alone (rollout/scoring.py) with the run's real advantage estimator, and the
worker's loop over parts handed to it: a kept group is put and keeps its batch place; a
filtered, failed, all-equal (dynamic sampling) or rejected group frees it for a replacement."""
import collections
import json

import grpc
import numpy as np

from pipelinerl_jax.losses import advantages_from_config
from pipelinerl_jax.losses.advantages import advantage_config
from pipelinerl_jax.rollout.admission import BatchPlaces, PipelineAdmission, QueueView
from pipelinerl_jax.rollout.group_source import FinishedGroup
from pipelinerl_jax.rollout.rollout_log import EngineMonitor, RolloutLog
from pipelinerl_jax.rollout.scoring import Scorer
from pipelinerl_jax.rollout.worker import RolloutWorker, WorkerParts
from pipelinerl_jax.run_config import base_config, resolve, validate
from pipelinerl_jax.transport import RolloutRejected


class Judged:
    def __init__(self, reward, correct):
        self.reward, self.correct = reward, correct


class Member:
    """A group member as the scorer uses it (group_source.GroupMember)."""

    def __init__(self, reward, length=4, truncated=False):
        self.reward, self.length, self.truncated = reward, length, truncated

    def judge(self, task, tokenizer, problem):
        return Judged(self.reward, self.reward > 0)

    def rollout_fields(self, judged, advantage, group_size, group_id):
        n = self.length
        return dict(prompt_ids=np.arange(3, dtype=np.int32),
                    completion_ids=np.full(n, 5, np.int32),
                    logp_behaviour=np.full(n, -0.5, np.float32),
                    version=np.zeros(n, np.int32), kv_version=np.zeros(n, np.int32),
                    reward=float(judged.reward), advantage=advantage, group_id=group_id,
                    group_size=group_size, task_id="fake", finish_reason="stop",
                    start_version=0, metrics={"correct": float(judged.correct)})

    def log_record(self, judged):
        return {"reward": judged.reward, "length": self.length}


def scorer(tmp_path, drop_zero_variance=False, drop_equal_rewards=False,
           stats=lambda: {"time_occupancy": 0.25, "tokens_per_s": 7}, counts=None):
    cfg = advantage_config()
    cfg.drop_zero_variance = drop_zero_variance
    counts = collections.Counter() if counts is None else counts
    s = Scorer(None, None, lambda r, lengths, truncated: advantages_from_config(
        cfg, r, lengths=lengths, max_length=16, truncated=truncated),
        drop_equal_rewards=drop_equal_rewards, counts=counts,
        rollout_log=RolloutLog(str(tmp_path), 2), engine_stats=stats)
    return s, counts


def lines(path):
    return [json.loads(x) for x in open(path)] if path.exists() else []


def test_a_kept_group_becomes_rollouts_with_group_advantages(tmp_path):
    s, counts = scorer(tmp_path)
    rewards = [1.0, 0.0, 0.0, 1.0]
    rollouts = s.score(FinishedGroup("g1", None, [Member(r) for r in rewards],
                                     counted_as="episodes"))
    adv = np.asarray([r.advantage for r in rollouts])
    np.testing.assert_allclose(adv, (rewards - np.mean(rewards)) / (np.std(rewards) + 1e-6),
                               rtol=1e-5)  # GRPO
    assert all(r.group_id == "g1" and r.group_size == 4 for r in rollouts)
    assert rollouts[0].metrics == {"correct": 1.0, "engine_occupancy": 0.25,
                                   "engine_tokens_per_s": 7.0}
    assert dict(counts) == {"groups_scored": 1, "episodes": 4}
    assert lines(tmp_path / "samples.w2.jsonl") == [{"reward": r, "length": 4} for r in rewards]


def test_a_filtered_group_is_scored_and_logged_but_not_put(tmp_path):
    s, counts = scorer(tmp_path, drop_zero_variance=True)
    assert s.score(FinishedGroup("g1", None, [Member(1.0), Member(1.0)])) is None
    assert dict(counts) == {"groups_scored": 1, "groups_filtered": 1}
    assert len(lines(tmp_path / "samples.w2.jsonl")) == 2


def test_dynamic_sampling_drops_all_equal_groups_before_scoring(tmp_path):
    s, counts = scorer(tmp_path, drop_equal_rewards=True)
    assert s.score(FinishedGroup("g1", None, [Member(0.0), Member(0.0)])) is None
    assert dict(counts) == {"groups_dropped_equal_rewards": 1}
    assert not (tmp_path / "samples.w2.jsonl").exists()
    assert s.score(FinishedGroup("g2", None, [Member(0.0), Member(1.0)])) is not None


def test_a_failed_group_is_counted_and_an_event(tmp_path):
    s, counts = scorer(tmp_path)
    assert s.score(FinishedGroup("g1", None, [], failure="episode 1: tool_error")) is None
    assert dict(counts) == {"groups_failed": 1}
    [e] = lines(tmp_path / "events.jsonl")
    assert (e["event"], e["group_id"], e["reason"], e["child"]) == (
        "group_failed", "g1", "episode 1: tool_error", "worker2")


class Stats:
    def stats(self):
        return {"server_id": "q", "learner_version": 0}


class Queue(Stats):
    def __init__(self):
        self.groups, self.reject = [], False

    def put_group(self, rollouts):
        if self.reject:
            raise RolloutRejected(grpc.StatusCode.INVALID_ARGUMENT, "token_ids: out of range")
        self.groups.append(rollouts)


class Engine:
    version = 0

    def stats(self):
        return {"engine_id": "e0", "version": 0, "slot_occupancy": 0.5, "busy_fraction": 1.0,
                "num_slots": 2, "window_s": 1.0, "window_decode_steps": 4, "tokens_per_s": 3.0,
                "queued_samples": 0, "retries": 7}


class Source:
    """A group source that returns the groups a test scripts."""

    def __init__(self):
        self.started, self.ready = [], []

    def start(self, ticket):
        self.started.append(ticket)

    def submit(self):
        pass

    def poll(self, timeout):
        out, self.ready = self.ready, []
        return out

    def stats(self):
        return {}

    def close(self):
        pass


def test_the_loop_frees_the_place_of_every_group_that_is_not_put(tmp_path):
    cfg = base_config()
    cfg.learner.batch_groups, cfg.max_lag = 2, 0
    validate(cfg)
    cfg = resolve(cfg)
    counts, places, log, queue = collections.Counter(), BatchPlaces(2), RolloutLog(None, 0), Queue()
    s, _ = scorer(tmp_path, drop_zero_variance=True, counts=counts)
    admission = PipelineAdmission(engine=Engine(), queue=QueueView(queue, places, counts, log),
                                  places=places, problems=iter(range(100)), max_lag=0, seed=0,
                                  worker_index=0, nonce="n", lockstep=False, rollout_log=log)
    source = Source()
    worker = RolloutWorker(cfg, Engine(), None, None, queue, parts=WorkerParts(
        source, admission, s, log, EngineMonitor(Engine(), 1e9), counts, "w0-n"))
    assert worker.admit(10) == 2 and not worker.can_admit()  # batch 0: the whole window
    a, b = source.started
    source.ready = [FinishedGroup(a.group_id, a.problem, [Member(1.0), Member(0.0)]),
                    FinishedGroup(b.group_id, b.problem, [Member(1.0), Member(1.0)])]
    worker.run(max_groups=2)
    assert len(queue.groups) == 1 and counts["groups_put"] == 1  # b was filtered
    assert worker.admit(10) == 1  # b's place: one replacement, no more
    c = source.started[-1]
    queue.reject = True
    source.ready = [FinishedGroup(c.group_id, c.problem, [Member(1.0), Member(0.0)])]
    worker.run(max_groups=3)
    assert counts["groups_rejected"] == 1 and worker.admit(10) == 1
    d = source.started[-1]
    source.ready = [FinishedGroup(d.group_id, d.problem, [], failure="engine refused")]
    worker.run(max_seconds=0.2)  # a failed group is not scored
    assert counts["groups_failed"] == 1  # and the loop started its replacement:
    assert counts["started"] == 5 and [t.batch for t in source.started] == [0] * 5
    assert not worker.can_admit()


def test_a_run_shorter_than_the_stats_period_still_leaves_its_counters(tmp_path):
    """Regression (a flaky fault test under load): engine_stats.jsonl was written only when
    `stats_every_s` had passed, so a run that ended sooner left it empty. The loop's end now
    writes one last report with the cumulative counters."""
    cfg = resolve(base_config())
    counts, log = collections.Counter(groups_failed=2), RolloutLog(str(tmp_path), 0)
    engine = Engine()
    worker = RolloutWorker(cfg, engine, None, None, Queue(), parts=WorkerParts(
        Source(), None, None, log, EngineMonitor(engine, 1e9), counts, "w0-n"))
    worker.run(max_groups=0)
    [last] = lines(tmp_path / "engine_stats.jsonl")
    assert last["retries"] == 7 and last["worker"] == {"groups_failed": 2}
