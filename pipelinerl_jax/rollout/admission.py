"""Admission: may one more group start now, for which learner batch, with which weights?

A rollout worker asks its admission policy before each group it starts (`can_admit`), then
books the group (`book`: its problem, id, seed and batch place); the policy installs the
weights the worker receives (`on_weights`). Two policies answer the same questions:

`PipelineAdmission` (async, PipelineRL style; with `lockstep` it is the sync baseline).
Generate nothing the learner would have to drop. Each worker owns `share` = B/W groups of
every learner batch. A new group is assigned to the earliest batch k >= L (the learner's
current version, from the queue) whose share is not yet full, and may start only while
`k - engine_version <= max_lag`: it will be trained at version ~k, so none of its tokens is
staler than max_lag. Batches below L are forgotten (consumed). With `max_lag = 0` and waves
this *is* the synchronous baseline: a worker samples exactly its share of batch v with
weights v, then waits for v+1. The state is only "what I started for which batch", so a
restarted worker or queue needs no history; the queue's staleness policy remains the hard
guarantee when timing is adversarial. The limit in force is the queue's (`stats()["max_lag"]`)
when lower than the config's: under closed-loop staleness control (`pipelinerl_jax.lag_control`)
the learner moves it during the run. Weights install as they arrive; an *older* version only
comes from a new publisher (a learner restarted from an older checkpoint) and is installed too
(`allow_older`), while no group starts as long as the engine is ahead of the learner's
version (its tokens would be refused as "from the future").

`InjectedLagAdmission` (lag injection, `pipelinerl_jax.lag_injection`): lock-step, batch L is
sampled with the weights the learner ships as weight-stream version L, which are policy
version `L - k_L`; the policy waits for them, installs them as that version, draws the step's
prompts from a stream of their own and names groups by (step, index in step), so every token
has lag exactly k_L and a restarted run repeats the ids, seeds and prompts exactly.

Both share the bookkeeping of batch places (`BatchPlaces`) and the view of the queue
(`QueueView`). Faults the view handles: a group the queue accepted and later dropped (stale
at get time; 'future' after a learner rollback) never fills its place: the queue counts each
producer's drops (the worker's `producer_id` rides on every put) and that many places are
freed, earliest batch first (`counts['groups_dropped_in_queue']`). A restarted queue comes
back empty with a new `server_id`: the places of groups put there and not yet taken are
released and regenerated (`counts['queue_restarts']`, `counts['groups_lost_in_queue']`).

Lock-step policies start groups in waves (`room`): a step's whole share at once, and
replacements only once nothing is in flight, so the engine always meets a wave idle and whole
and what it samples does not depend on thread timing.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Dict, Iterator, Optional, Protocol

import numpy as np

log = logging.getLogger(__name__)


def worker_share(batch_groups: int, num_workers: int, index: int) -> int:
    """Worker `index`'s groups per learner batch (workers split a batch evenly)."""
    return batch_groups // num_workers + (1 if index < batch_groups % num_workers else 0)


def group_seed(material) -> int:
    """A group's sampling seed from its identifying integers."""
    return int(np.random.SeedSequence(material).generate_state(1)[0] % (2**31))


@dataclasses.dataclass(frozen=True)
class Ticket:
    """One booked group: what to sample and under which name, for which learner batch."""
    group_id: str
    seed: int
    batch: int
    problem: Any  # tasks.Problem


class AdmissionPolicy(Protocol):
    """What the worker's loop asks (module docstring)."""
    share: int
    lockstep: bool

    def can_admit(self) -> bool: ...  # may one more group start now?

    def book(self) -> Ticket: ...  # after can_admit(): the group that starts

    @property
    def in_flight(self) -> int: ...  # groups booked and not yet finished

    def room(self, max_requests: int) -> int: ...  # how many may be in flight this round

    def finished(self, group_id: str) -> int: ...  # it left flight; its batch place

    def release(self, batch: int) -> None: ...  # a finished group will not fill its place

    def on_weights(self, message) -> None: ...  # a WeightVersion arrived

    def allowed_lag(self) -> int: ...


class BatchPlaces:
    """What this worker started for which learner batch, and which groups are in flight."""

    def __init__(self, share: int):
        self.share = share
        self.started: Dict[int, int] = {}  # learner batch -> groups holding a place in it
        self.in_flight: Dict[str, int] = {}  # group id -> its batch

    def book(self, group_id: str, batch: int) -> None:
        self.started[batch] = self.started.get(batch, 0) + 1
        self.in_flight[group_id] = batch

    def finished(self, group_id: str) -> int:
        return self.in_flight.pop(group_id)

    def release(self, batch: int) -> None:
        if self.started.get(batch, 0) > 0:
            self.started[batch] -= 1

    def room(self, max_requests: int, waves: bool) -> int:
        """Groups that may be in flight this round: in waves, nothing until the last wave
        is in and then the whole share at once."""
        if not waves:
            return max_requests
        return 0 if self.in_flight else max(max_requests, self.share)

    def forget_before(self, learner: int) -> None:
        for k in [k for k in self.started if k < learner]:
            del self.started[k]  # batches the learner has consumed

    def first_open(self, learner: int) -> int:
        k = learner
        while self.started.get(k, 0) >= self.share:
            k += 1
        return k

    def free_dropped(self, n: int, learner: int) -> int:
        """Frees up to `n` places of batches >= `learner`, earliest first; returns how many."""
        freed = 0
        for k in sorted(self.started):
            while k >= learner and self.started[k] > 0 and freed < n:
                self.started[k] -= 1
                freed += 1
        return freed

    def keep_in_flight_only(self) -> int:
        """Keeps only the places of groups still being generated; returns how many others
        (groups finished and put) were let go."""
        inflight = collections.Counter(self.in_flight.values())
        lost = sum(max(0, n - inflight[k]) for k, n in self.started.items())
        self.started = dict(inflight)
        return lost

    def restart_at(self, batch: int) -> None:
        self.started = {batch: 0}


class QueueView:
    """The queue's stats as admission reads them (cached `max_age_s`), and the faults they
    show: our groups it dropped, and a restarted instance (module docstring)."""

    def __init__(self, client, places: BatchPlaces, counts: collections.Counter, rollout_log,
                 clock: Callable[[], float] = time.time):
        self.client, self.places, self.counts = client, places, counts
        self.rollout_log = rollout_log
        self.clock = clock
        self._stats: Optional[dict] = None
        self._stats_time = 0.0
        self._server_id: Optional[str] = None  # the queue instance our groups went to
        self._dropped_seen = 0  # our groups the queue reported dropped, so far

    def stats(self, max_age_s: float = 0.1) -> dict:
        """The last stats read if younger than `max_age_s` (0: read now)."""
        if self._stats is None or max_age_s <= 0 or self.clock() - self._stats_time > max_age_s:
            stats = self.client.stats()
            if self._server_id is not None and stats["server_id"] != self._server_id:
                self._on_restart(stats["server_id"])
            self._server_id = stats["server_id"]
            self._note_drops(stats)
            self._stats = stats
            self._stats_time = self.clock()
        return self._stats

    def learner_version(self, max_age_s: float = 0.1) -> int:
        return int(self.stats(max_age_s)["learner_version"])

    def lag_limit(self, configured: int) -> int:
        """The config's limit, or the queue's (the lag controller's) when lower."""
        queue = int(self.stats().get("max_lag", -1))
        return configured if queue < 0 else min(configured, queue)

    def _note_drops(self, stats: dict) -> None:
        total = int(stats.get("producer_dropped_groups", 0))
        new, self._dropped_seen = total - self._dropped_seen, total
        if new <= 0:
            return
        freed = self.places.free_dropped(new, int(stats["learner_version"]))
        self.counts["groups_dropped_in_queue"] += new
        self.rollout_log.event("groups_dropped_in_queue", groups=new, places_freed=freed)

    def _on_restart(self, server_id: str) -> None:
        """What we put on the old instance and was not consumed is lost: its places are
        sampled again."""
        lost = self.places.keep_in_flight_only()
        self._dropped_seen = 0  # the new instance counts from zero
        self.counts["queue_restarts"] += 1
        self.counts["groups_lost_in_queue"] += lost
        log.warning("queue restarted (server %s -> %s): %d groups put there were lost and "
                    "will be regenerated", self._server_id, server_id, lost)
        self.rollout_log.event("queue_restart", server_id=server_id, lost_groups=lost)


class PipelineAdmission:
    """Async admission within `max_lag` of the learner (module docstring); `lockstep` starts
    groups in waves (sync mode)."""

    def __init__(self, *, engine, queue: QueueView, places: BatchPlaces,
                 problems: Iterator, max_lag: int, seed: int, worker_index: int, nonce: str,
                 lockstep: bool, rollout_log):
        self.engine, self.queue, self.places, self.problems = engine, queue, places, problems
        self.max_lag, self.seed, self.index, self.nonce = max_lag, seed, worker_index, nonce
        self.lockstep, self.rollout_log = lockstep, rollout_log
        self.share = places.share
        self._next_batch = 0
        self._seq = 0

    @property
    def in_flight(self) -> int:
        return len(self.places.in_flight)

    def room(self, max_requests: int) -> int:
        return self.places.room(max_requests, self.lockstep)

    def allowed_lag(self) -> int:
        return self.queue.lag_limit(self.max_lag)

    def can_admit(self) -> bool:
        if self.engine.version < 0:
            return False  # the learner's weights have not arrived yet
        learner = self.queue.learner_version()
        if learner < 0:
            return False  # no learner has announced itself to the queue yet
        if self.engine.version > learner:  # announced before it was shipped: look again
            learner = self.queue.learner_version(max_age_s=0.0)
            if self.engine.version > learner:
                return False  # the learner restarted from an older checkpoint: its weights come
        self.places.forget_before(learner)
        k = self.places.first_open(learner)
        if k - self.engine.version > self.allowed_lag():
            return False
        self._next_batch = k
        return True

    def book(self) -> Ticket:
        """Group ids carry the per-process nonce: a restarted worker never reuses an id its
        predecessor put (the queue would refuse it as a duplicate)."""
        problem = next(self.problems)
        gid = f"w{self.index}-{self.nonce}-{self._seq}"
        seed = group_seed([self.seed, self.index, self._seq])
        self._seq += 1
        self.places.book(gid, self._next_batch)
        return Ticket(gid, seed, self._next_batch, problem)

    def finished(self, group_id: str) -> int:
        return self.places.finished(group_id)

    def release(self, batch: int) -> None:
        self.places.release(batch)

    def on_weights(self, message) -> None:
        """Installs a newer version while sampling; an older one only comes from a learner
        restarted from an older checkpoint: sample with it, or every token would be "from
        the future"."""
        version = message.version
        if version > self.engine.version:
            self.engine.update_weights(message, version, wait=False)
        elif version < self.engine.version:
            log.warning("learner rolled back to version %d (engine at %d): installing it",
                        version, self.engine.version)
            self.rollout_log.event("weights_rollback", version=int(version),
                                   engine_version=int(self.engine.version))
            self.engine.update_weights(message, version, wait=False, allow_older=True)


class InjectedLagAdmission:
    """Lock-step at a prescribed lag (module docstring): this worker's share of batch
    `step`, sampled with the weights shipped as stream version `step`."""

    lockstep = True  # waves: the samples' bits do not depend on thread timing

    def __init__(self, *, engine, queue: QueueView, places: BatchPlaces,
                 problems_for: Callable[[int], Iterator], seed: int, worker_index: int):
        self.engine, self.queue, self.places = engine, queue, places
        self.problems_for, self.seed, self.index = problems_for, seed, worker_index
        self.share = places.share
        self.problems: Optional[Iterator] = None
        self._lock = threading.Lock()  # on_weights runs on the subscriber's thread
        self._pending = None  # (stream version = learner step, policy version, weights)
        self._step, self._step_seq = -1, 0  # the step we feed, groups started for it

    @property
    def in_flight(self) -> int:
        return len(self.places.in_flight)

    def room(self, max_requests: int) -> int:
        return self.places.room(max_requests, waves=True)

    def allowed_lag(self) -> int:
        return 0  # the lag is prescribed: every group is for the learner's current step

    def can_admit(self) -> bool:
        step = self.queue.learner_version()
        if step < 0:
            return False  # no learner has announced itself to the queue yet
        if self._step != step:
            if self.places.in_flight:
                return False  # the previous step's groups finish first
            with self._lock:
                pending = self._pending
            if pending is None or pending[0] != step:
                return False  # the weights for this step have not arrived yet
            _, policy_version, message = pending
            self.engine.update_weights(message, policy_version, allow_older=True)
            self._step, self._step_seq = step, 0
            self.places.restart_at(step)
            # each step's prompts come from a stream of their own, so that a restarted run
            # (same workdir) sees exactly the prompts an uninterrupted run would
            self.problems = self.problems_for(step)
        return self.places.started.get(step, 0) < self.share

    def book(self) -> Ticket:
        """Ids and seeds by (step, index in step): a restarted run repeats them exactly."""
        problem = next(self.problems)
        gid = f"w{self.index}-s{self._step}-{self._step_seq}"
        seed = group_seed([self.seed, self.index, self._step, self._step_seq])
        self._step_seq += 1
        self.places.book(gid, self._step)
        return Ticket(gid, seed, self._step, problem)

    def finished(self, group_id: str) -> int:
        return self.places.finished(group_id)

    def release(self, batch: int) -> None:
        self.places.release(batch)

    def on_weights(self, message) -> None:
        """Keeps stream version `message.version` (policy version `message.policy`) until
        the step it is for starts (`can_admit`). The subscriber recycles a buffer only once
        no view of it is alive, so keeping the message's arrays keeps them intact."""
        with self._lock:
            self._pending = (message.version, message.policy, message)
