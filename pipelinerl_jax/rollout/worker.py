"""Rollout worker: prompts → engine → scored groups with advantages → RolloutQueue.

One worker drives one `InferenceEngine` (it never knows which) as a small loop over parts it
is handed:

    admit:   while the admission policy allows, book a group (problem, id, seed, batch place)
             and start it in the group source; the source hands the round to the engine
    collect: the source returns the groups that ended
    score:   the scorer turns each into rollouts with group advantages, or frees its place
    put:     the whole group goes on the queue (a rejected one frees its place)

- admission policy (`rollout/admission.py`): may a group start now, for which learner
  batch, with which weights. `PipelineAdmission`: async within `max_lag` of the learner or
  the queue's (lag controller's) lower limit, drop accounting, queue restarts, rollbacks; in
  waves with `max_lag = 0` it is `mode=sync`. `InjectedLagAdmission`: lock-step at the lag
  the learner prescribes (`pipelinerl_jax.lag_injection`).
- group source (`rollout/group_source.py`): `SampleGroups` (n samples of one prompt, one
  engine request) or `EpisodeGroups` (a group of multi-turn episodes, `pipelinerl_jax.envs`).
- scorer (`rollout/scoring.py`): rewards, `advantages_from_config`, dynamic sampling and the
  estimator's filter, `Rollout`s with their metrics.
- logger (`rollout/rollout_log.py`): `samples.w<i>.jsonl`, `events.jsonl`,
  `weights_received.w<i>.jsonl`, `engine_stats.jsonl` (`EngineMonitor` reads the engine).

`build_parts` makes them from a resolved run config (`RolloutWorker(cfg, ...)` calls it);
a new backend, environment or weight format lands in its part, not in this loop.

In short (each part's module docstring has the whole story): each worker owns `share` = B/W
groups of every learner batch and starts a group for batch k only while
`k - engine_version <= max_lag` (or the queue's lower limit), so nothing it samples is staler
than the learner accepts; `max_lag = 0` in waves is the synchronous baseline. Groups the queue
dropped, lost in a restarted queue, failed in the engine or environment, rejected by the
queue, or filtered by the advantage estimator / dynamic sampling free their batch place and
are sampled again, so batches stay full; each is counted in `counts`, and the faults among
them (everything but filtering) are lines of `workdir/events.jsonl`. Group ids are `w<index>-<nonce>-<seq>` (a per-process nonce, so a
restarted worker never reuses its predecessor's ids; the queue counts drops by the
`producer_id` `w<index>-<nonce>`), or `w<index>-s<step>-<k>` under lag injection, where a
restarted run repeats ids, seeds and prompts exactly. A weight subscriber calls `on_weights`
with every new version: the engine installs it while it samples (in-flight updates), or, under
lag injection, when the step it was shipped for starts.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import uuid
from typing import Optional

from pipelinerl_jax.envs import EnvTask, GroupRunner, make_runner
from pipelinerl_jax.rollout.admission import (AdmissionPolicy, BatchPlaces, InjectedLagAdmission,
                                              PipelineAdmission, QueueView, worker_share)
from pipelinerl_jax.rollout.group_source import EpisodeGroups, GroupSource, SampleGroups
from pipelinerl_jax.rollout.rollout_log import EngineMonitor, RolloutLog
from pipelinerl_jax.rollout.scoring import Scorer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkerParts:
    source: GroupSource
    admission: AdmissionPolicy
    scorer: Scorer
    rollout_log: RolloutLog
    monitor: EngineMonitor
    counts: collections.Counter  # shared by the parts: the worker's fault and progress counters
    producer_id: str  # the queue counts this worker's dropped groups by it


def problem_seed(cfg, worker_index: int, step: Optional[int] = None) -> int:
    """The seed of a worker's prompt stream; under lag injection one stream per step, so that
    a restarted run (same workdir) sees exactly the prompts an uninterrupted run would."""
    if step is None:
        return cfg.seed * 1009 + worker_index
    return (cfg.seed * 1_000_003 + step) * 1009 + worker_index


def build_parts(cfg, engine, task, tokenizer, client, *, worker_index: int = 0,
                workdir: Optional[str] = None) -> WorkerParts:
    """The parts of worker `worker_index` from a resolved run config; sets the client's
    `producer_id`."""
    from pipelinerl_jax.losses import advantages_from_config  # late: JAX
    from pipelinerl_jax.run_config import completion_tokens  # cycle: run_config
    max_lag = cfg.rollout.admission_lag  # run_config.lag_limits, set by resolve
    if max_lag is None:
        raise ValueError("RolloutWorker needs a resolved run config (run_config.resolve)")
    counts = collections.Counter()
    rollout_log = RolloutLog(workdir, worker_index)
    nonce = uuid.uuid4().hex[:6]  # this process's group ids differ from its predecessor's
    producer_id = f"w{worker_index}-{nonce}"
    client.producer_id = producer_id
    places = BatchPlaces(worker_share(cfg.learner.batch_groups, cfg.rollout.num_workers,
                                      worker_index))
    queue = QueueView(client, places, counts, rollout_log)
    if cfg.lag_injection.enabled:
        admission = InjectedLagAdmission(
            engine=engine, queue=queue, places=places, seed=cfg.seed, worker_index=worker_index,
            problems_for=lambda step: task.problems(seed=problem_seed(cfg, worker_index, step)))
    else:
        admission = PipelineAdmission(
            engine=engine, queue=queue, places=places, max_lag=max_lag, seed=cfg.seed,
            problems=task.problems(seed=problem_seed(cfg, worker_index)),
            worker_index=worker_index, nonce=nonce, lockstep=cfg.mode == "sync",
            rollout_log=rollout_log)
    s = cfg.sampling
    is_env = isinstance(task, EnvTask)
    if is_env:
        source = EpisodeGroups(GroupRunner(make_runner(
            cfg.env, engine, tokenizer, task=task, temperature=s.temperature, top_p=s.top_p,
            top_k=s.top_k), cfg.rollout.group_size))
    else:
        source = SampleGroups(engine, tokenizer, task_id=task.name,
                              group_size=cfg.rollout.group_size,
                              sampling=dict(max_new_tokens=s.max_new_tokens,
                                            temperature=s.temperature, top_p=s.top_p,
                                            top_k=s.top_k))
    monitor = EngineMonitor(engine, cfg.rollout.stats_every_s)
    scorer = Scorer(
        task, tokenizer,
        lambda rewards, lengths, truncated: advantages_from_config(
            cfg.rollout.advantage, rewards, lengths=lengths,
            max_length=completion_tokens(cfg), truncated=truncated),
        drop_equal_rewards=is_env and bool(cfg.env.dynamic_sampling), counts=counts,
        rollout_log=rollout_log, engine_stats=lambda: monitor.latest)
    return WorkerParts(source, admission, scorer, rollout_log, monitor, counts, producer_id)


class RolloutWorker:
    """The loop (module docstring). `parts` defaults to `build_parts` of the arguments."""

    def __init__(self, cfg, engine, task, tokenizer, client, *, worker_index: int = 0,
                 workdir: Optional[str] = None, parts: Optional[WorkerParts] = None):
        parts = parts or build_parts(cfg, engine, task, tokenizer, client,
                                     worker_index=worker_index, workdir=workdir)
        self.cfg, self.engine, self.client = cfg, engine, client
        self.index, self.workdir = worker_index, workdir
        self.group_size = cfg.rollout.group_size
        self.max_lag = cfg.rollout.admission_lag
        self.source, self.admission, self.scorer = parts.source, parts.admission, parts.scorer
        self.rollout_log, self.monitor = parts.rollout_log, parts.monitor
        self.counts, self.producer_id = parts.counts, parts.producer_id
        self._stop = threading.Event()

    @property
    def share(self) -> int:
        """This worker's groups per learner batch (workers split a batch evenly)."""
        return self.admission.share

    @property
    def lockstep(self) -> bool:
        """Groups start in waves (sync, lag injection): the samples' bits do not depend on
        thread timing."""
        return self.admission.lockstep

    def allowed_lag(self) -> int:
        """The limit admission uses now: the config's, or the queue's when lower."""
        return self.admission.allowed_lag()

    def can_admit(self) -> bool:
        """Whether one more group may start now (rollout/admission.py)."""
        return self.admission.can_admit()

    def on_weights(self, message) -> None:
        """Weight-subscriber callback (subscriber thread): `message`, a
        `transport.weight_version.WeightVersion`, is stream version `message.version` holding
        the weights of policy `message.policy` (the same but under lag injection), as arrays
        or a directory; the engine installs it by its kind."""
        self.rollout_log.weights_received(message.version)
        self.admission.on_weights(message)

    def admit(self, max_requests: int) -> int:
        """Starts every group admission allows now (up to `max_requests` in flight; in
        waves, a step's whole share once nothing is in flight) and hands them to the engine
        as one batch; returns how many groups started."""
        room, started = self.admission.room(max_requests), 0
        while self.admission.in_flight < room and self.admission.can_admit():
            self.source.start(self.admission.book())
            self.counts["started"] += 1
            started += 1
        self.source.submit()
        return started

    def finish(self, group) -> None:
        """A group that ended: scored and put, or its batch place freed for a replacement."""
        batch = self.admission.finished(group.group_id)
        rollouts = self.scorer.score(group)
        if rollouts is None:
            self.admission.release(batch)
            return
        try:
            self.client.put_group(rollouts)
            self.counts["groups_put"] += 1
        except Exception as e:  # noqa: BLE001 - a rejected group is counted, the worker goes on
            from pipelinerl_jax.transport import RolloutRejected  # rare path
            if not isinstance(e, RolloutRejected):
                raise
            log.warning("group %s rejected by the queue: %s", group.group_id, e)
            self.counts["groups_rejected"] += 1
            self.rollout_log.event("group_rejected", group_id=group.group_id,
                                   reason=str(e)[:500])
            self.admission.release(batch)

    def run(self, max_groups: Optional[int] = None, max_seconds: Optional[float] = None) -> None:
        """Runs until `stop()`, `max_groups` groups were scored, or `max_seconds` passed."""
        t0 = time.time()
        # Keep a couple of requests queued beyond the free slots so the engine never idles.
        slots = getattr(self.engine, "num_slots", 8)
        max_requests = max(1, -(-2 * slots // self.group_size))
        while not self._stop.is_set():
            if max_groups is not None and self.counts["groups_scored"] >= max_groups:
                break
            if max_seconds is not None and time.time() - t0 > max_seconds:
                break
            self.admit(max_requests)
            for group in self.source.poll(timeout=0.02):
                self.finish(group)
            self._report()
        # One last report, whatever `every_s` is: a run shorter than it still leaves its
        # cumulative counters in engine_stats.jsonl.
        self._report(force=True)

    def _report(self, force: bool = False) -> None:
        fresh = self.monitor.poll(force)
        if fresh is not None:
            self.rollout_log.engine_stats(*fresh, self.counts, self.source.stats())

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Ends the episodes in flight and the tool threads (environment mode)."""
        self.source.close()
