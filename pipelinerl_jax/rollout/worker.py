"""Rollout worker: prompts → engine → scored groups with advantages → RolloutQueue.

One worker drives one `InferenceEngine` (it never knows which). It keeps the engine's slots
full with requests of `group_size` samples per prompt, scores each finished group with the
task's verifier, computes group advantages, and puts the whole group on the queue. A weight
subscriber installs every new policy version in the engine while it samples (in-flight
updates).

Admission control (PipelineRL style) — generate nothing the learner would have to drop.
Each worker owns `share` = B/W groups of every learner batch. A new group is assigned to the
earliest batch k >= L (the learner's current version, from the queue) whose share is not yet
full, and may start only while `k - engine_version <= max_lag`: it will be trained at
version ~k, so none of its tokens is staler than max_lag. Batches below L are forgotten
(consumed). With `max_lag = 0` this *is* the synchronous baseline: a worker samples exactly
its share of batch v with weights v, then waits for v+1. Groups the advantage estimator
filters out (zero variance) free their place for a replacement. The state is only "what I
started for which batch", so a restarted worker or queue needs no history. The queue's
staleness policy remains the hard guarantee when timing is adversarial (a straggler that
completes after later groups). The limit in force is the queue's (`stats()["max_lag"]`, read
with the learner version) when lower than the config's: under closed-loop staleness control
(`pipelinerl_jax.lag_control`) the learner moves it during the run.

A group the queue accepted and later dropped (stale at get time, e.g. after the limit was
lowered; 'future' after a learner rollback) will never fill its batch place: the queue counts
each producer's drops (the worker's `producer_id` rides on every put), and the worker frees
that many places, earliest batch first (`counts['groups_dropped_in_queue']`). Without this
every drop shrank the admission window by one group for good, down to a stall once the
window was smaller than the drops.

Faults. A learner restarted from an older checkpoint publishes an older version from a new
publisher: the engine installs it (`allow_older`) and no group starts while the engine is
ahead of the learner's version (its tokens would be refused as "from the future").
A restarted queue comes back empty, with a new `server_id` in its stats: the groups
this worker had put and the learner had not yet taken are gone, so their batch places are
released (and counted in `counts['groups_lost_in_queue']`) and regenerated. A request the
engine gives up on (`RequestError` with its `request_id`, e.g. a malformed SGLang answer)
drops its group and frees its place (`counts['groups_failed']`); a group the queue rejects
likewise (`counts['groups_rejected']`). Group ids carry a per-process nonce (async mode), so a
restarted worker never reuses the id of a group its predecessor put (the queue would refuse
it as a duplicate). Each of these is also a line of `workdir/events.jsonl`.

Environments (multi-turn episodes, `pipelinerl_jax.envs`): when the task is an `EnvTask`, a
group is `group_size` episodes of one problem run by a `GroupRunner` over an `EpisodeRunner`
(which is then the engine's only completion consumer) instead of one n-sample request;
admission, slots and ids are the same. A group with a failed episode (`counts
['groups_failed']`) or, with `env.dynamic_sampling`, all-equal rewards (`counts
['groups_dropped_equal_rewards']`, DAPO) frees its place and a replacement is sampled, so
batches stay full. Advantages are over the episodes' rewards; each episode is one rollout
carrying its `loss_mask` and `turn_index`. The runner's counters go to `engine_stats.jsonl`
(`env`) and each episode is a line of `samples.w<i>.jsonl`.

Lag injection (ablations at exact staleness, `pipelinerl_jax.lag_injection`): in lock-step,
batch L is sampled with the weights the learner ships as weight-stream version L, which are
policy version `L - k_L` (the weight header says which); every token then has lag exactly k_L,
independent of timing and across restarts.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from typing import Dict, List, Optional

import numpy as np

from pipelinerl_jax.envs import EnvTask, GroupResult, GroupRunner, drop_reason, make_runner
from pipelinerl_jax.envs.episode import FINISH_REASON
from pipelinerl_jax.metrics import append_jsonl
from pipelinerl_jax.rollout.engine import RequestError
from pipelinerl_jax.types import Completion, GenerationRequest, Rollout, SamplingParams

log = logging.getLogger(__name__)

# Engine stats totals copied into `engine_stats.jsonl` when the engine reports them.
ENGINE_FAULT_KEYS = ("retries", "rerouted_requests", "request_errors",
                     "server_aborted_segments", "resubmitted_samples",
                     "dropped_aborted_samples", "failed_samples", "servers_up", "refit_failures")


class RolloutWorker:
    def __init__(self, cfg, engine, task, tokenizer, client, *, worker_index: int = 0,
                 workdir: Optional[str] = None):
        from pipelinerl_jax.losses import advantages_from_config  # late: JAX
        from pipelinerl_jax.run_config import completion_tokens  # cycle: run_config
        self.cfg, self.engine, self.task, self.tok, self.client = cfg, engine, task, tokenizer, client
        self.index = worker_index
        self.num_workers = cfg.rollout.num_workers
        self.group_size = cfg.rollout.group_size
        self.batch_groups = cfg.learner.batch_groups
        self.max_lag = cfg.rollout.admission_lag  # run_config.lag_limits, set by resolve
        if self.max_lag is None:
            raise ValueError("RolloutWorker needs a resolved run config (run_config.resolve)")
        # Lock-step (sync or lag injection): groups start in waves (`admit`), so the samples'
        # bits do not depend on thread timing. Async keeps refilling as groups finish.
        self.lockstep = cfg.mode == "sync" or bool(cfg.lag_injection.enabled)
        self._advantages = lambda rewards, lengths, truncated: advantages_from_config(
            cfg.rollout.advantage, rewards, lengths=lengths,
            max_length=completion_tokens(cfg), truncated=truncated)
        self.workdir = workdir
        self.problems = task.problems(seed=cfg.seed * 1009 + worker_index)
        s = cfg.sampling
        self.sampling = dict(max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                             top_p=s.top_p, top_k=s.top_k, stop_token_ids=(tokenizer.eos_id,),
                             n=self.group_size)
        self.groups: Optional[GroupRunner] = None  # environment mode (module docstring)
        if isinstance(task, EnvTask):
            self.groups = GroupRunner(make_runner(cfg.env, engine, tokenizer, task=task,
                                                  temperature=s.temperature, top_p=s.top_p,
                                                  top_k=s.top_k), self.group_size)
        self._inflight: Dict[str, tuple] = {}  # request / group id -> (problem, batch slot)
        self._samples: Dict[str, List[Completion]] = collections.defaultdict(list)
        self._seq = 0
        self._nonce = uuid.uuid4().hex[:6]  # this process's group ids differ from its predecessor's
        self.producer_id = f"w{worker_index}-{self._nonce}"  # the queue counts our drops by it
        client.producer_id = self.producer_id
        self._dropped_seen = 0  # our groups the queue reported dropped, so far
        self._server_id: Optional[str] = None  # the queue instance our groups went to
        self._stop = threading.Event()
        self._stats = None
        self._stats_time = 0.0
        self._engine_stats: dict = {}
        self._engine_stats_time = time.time()
        self.counts = collections.Counter()
        self._slots: Dict[int, int] = {}  # learner batch -> groups of ours started for it
        self._next_slot = 0
        # lag injection: (stream version = learner step, policy version, weights) last
        # received, and which learner step we are feeding
        self._lock = threading.Lock()
        self._injected_weights = None
        self._injected_for, self._step_seq = -1, 0

    # ------------------------------------------------------------------ admission

    def _queue_stats(self, max_age_s: float = 0.1):
        if self._stats is None or time.time() - self._stats_time > max_age_s:
            stats = self.client.stats()
            if self._server_id is not None and stats["server_id"] != self._server_id:
                self._on_queue_restart(stats["server_id"])
            self._server_id = stats["server_id"]
            self._note_drops(stats)
            self._stats = stats
            self._stats_time = time.time()
        return self._stats

    def _note_drops(self, stats) -> None:
        """Frees a batch place for each of our groups the queue dropped since we last looked
        (module docstring)."""
        total = int(stats.get("producer_dropped_groups", 0))
        new, self._dropped_seen = total - self._dropped_seen, total
        if new <= 0:
            return
        learner, freed = int(stats["learner_version"]), 0
        for k in sorted(self._slots):
            while k >= learner and self._slots[k] > 0 and freed < new:
                self._slots[k] -= 1
                freed += 1
        self.counts["groups_dropped_in_queue"] += new
        self._event("groups_dropped_in_queue", groups=new, places_freed=freed)

    def allowed_lag(self) -> int:
        """The limit admission uses now: the config's, or the queue's when lower."""
        queue = int(self._queue_stats().get("max_lag", -1))
        return self.max_lag if queue < 0 else min(self.max_lag, queue)

    def _on_queue_restart(self, server_id: str) -> None:
        """A new queue instance: what we put on the old one and was not consumed is lost.
        Keep only the places of groups still being generated; the rest are sampled again."""
        inflight = collections.Counter(slot for _, slot in self._inflight.values())
        lost = sum(max(0, n - inflight[k]) for k, n in self._slots.items())
        self._slots = dict(inflight)
        self._dropped_seen = 0  # the new instance counts from zero
        self.counts["queue_restarts"] += 1
        self.counts["groups_lost_in_queue"] += lost
        log.warning("queue restarted (server %s -> %s): %d groups put there were lost and "
                    "will be regenerated", self._server_id, server_id, lost)
        self._event("queue_restart", server_id=server_id, lost_groups=lost)

    def _event(self, event: str, **fields) -> None:
        if self.workdir:
            append_jsonl(os.path.join(self.workdir, "events.jsonl"), [{
                "time_s": time.time(), "event": event, "child": f"worker{self.index}",
                **fields}])

    @property
    def share(self) -> int:
        """This worker's groups per learner batch (workers split a batch evenly)."""
        return self.batch_groups // self.num_workers + (
            1 if self.index < self.batch_groups % self.num_workers else 0)

    def can_admit(self) -> bool:
        """Whether one more group may start now (module docstring: admission control)."""
        if self.engine.version < 0 and not self.cfg.lag_injection.enabled:
            return False  # the learner's weights have not arrived yet
        learner = int(self._queue_stats()["learner_version"])
        if learner < 0:
            return False  # no learner has announced itself to the queue yet
        if self.cfg.lag_injection.enabled:
            return self._can_admit_injected(learner)
        if self.engine.version > learner:  # announced before it was shipped: look again
            learner = int(self._queue_stats(max_age_s=0.0)["learner_version"])
            if self.engine.version > learner:
                return False  # the learner restarted from an older checkpoint: its weights come
        for k in [k for k in self._slots if k < learner]:
            del self._slots[k]  # batches the learner has consumed
        k = learner
        while self._slots.get(k, 0) >= self.share:
            k += 1
        if k - self.engine.version > self.allowed_lag():
            return False
        self._next_slot = k
        return True

    def _can_admit_injected(self, step: int) -> bool:
        """Lock-step: this worker's share of batch `step`, sampled with version step - k."""
        if self._injected_for != step:
            if self._inflight:
                return False  # the previous step's groups finish first
            with self._lock:
                pending = self._injected_weights
            if pending is None or pending[0] != step:
                return False  # the weights for this step have not arrived yet
            _, policy_version, params = pending
            self.engine.update_weights(params, policy_version, allow_older=True)
            self._injected_for, self._step_seq = step, 0
            self._slots = {step: 0}
            self.problems = self.task.problems(seed=self._problem_seed(step))
        self._next_slot = step
        return self._slots.get(step, 0) < self.share

    def _problem_seed(self, step: int) -> int:
        # Injection runs draw each step's prompts from their own stream so that a restarted
        # run (same workdir) sees exactly the prompts an uninterrupted run would.
        return (self.cfg.seed * 1_000_003 + step) * 1009 + self.index

    # ------------------------------------------------------------------ weights

    def on_weights(self, version: int, params, policy_version: Optional[int] = None) -> None:
        """Weight-subscriber callback (subscriber thread): stream version `version` holds
        the weights of `policy_version` (the same but under lag injection).

        `params` is the `{name: array}` dict, or the path (a `str`) of the HF checkpoint
        directory the version was published as (`transport.weight_sink.HFDirSink`); the
        engine loads it there.
        """
        if self.workdir:
            append_jsonl(os.path.join(self.workdir, f"weights_received.w{self.index}.jsonl"),
                         [{"time_s": time.time(), "version": int(version)}])
        if self.cfg.lag_injection.enabled:
            policy_version = version if policy_version is None else int(policy_version)
            if not isinstance(params, str):  # the subscriber reuses its buffers: keep a
                params = {k: np.array(v) for k, v in params.items()}  # copy until installed
            with self._lock:
                self._injected_weights = (version, policy_version, params)
            return
        if version > self.engine.version:
            self.engine.update_weights(params, version, wait=False)
        elif version < self.engine.version:
            # Only a new publisher (a learner restarted from an older checkpoint) sends an
            # older version: sample with it, or every token would be "from the future".
            log.warning("learner rolled back to version %d (engine at %d): installing it",
                        version, self.engine.version)
            self._event("weights_rollback", version=int(version),
                        engine_version=int(self.engine.version))
            self.engine.update_weights(params, version, wait=False, allow_older=True)

    # ------------------------------------------------------------------ main loop

    def _start_group(self) -> Optional[GenerationRequest]:
        """Books one new group (problem, id, seed, batch place); returns the engine request
        to submit, or None when an environment's group runner submits the episodes itself."""
        problem = next(self.problems)
        if self.cfg.lag_injection.enabled:  # ids and seeds by (step, index in step): a
            key = f"s{self._next_slot}-{self._step_seq}"  # restarted run repeats them exactly
            material = [self.cfg.seed, self.index, self._next_slot, self._step_seq]
            self._step_seq += 1
        else:
            key, material = f"{self._nonce}-{self._seq}", [self.cfg.seed, self.index, self._seq]
            self._seq += 1
        rid = f"w{self.index}-{key}"
        seed = int(np.random.SeedSequence(material).generate_state(1)[0] % (2**31))
        request = None
        if self.groups is not None:
            self.groups.start(problem, group_id=rid, seed=seed)
        else:
            request = GenerationRequest(
                rid, np.asarray(self.tok.encode_prompt(problem.prompt), np.int32),
                SamplingParams(seed=seed, **self.sampling))
        slot = self._next_slot
        self._slots[slot] = self._slots.get(slot, 0) + 1
        self._inflight[rid] = (problem, slot)
        self.counts["started"] += 1
        return request

    def admit(self, max_requests: int) -> int:
        """Starts every group admission allows now (up to `max_requests` in flight) and hands
        their requests to the engine as one batch; returns how many groups started.

        Lock-step runs (`lockstep`) start groups in waves: a step's whole share at once, and
        replacements of filtered groups only once nothing is in flight. The engine then
        always meets a wave idle and whole, so how it batches the wave (and every bit of what
        it samples) does not depend on thread timing."""
        if self.lockstep:
            if self._inflight:
                return 0
            max_requests = max(max_requests, self.share)
        requests, started = [], 0
        while len(self._inflight) < max_requests and self.can_admit():
            request = self._start_group()
            started += 1
            if request is not None:
                requests.append(request)
        if requests:
            self.engine.submit_batch(requests)
        return started

    def finish_group(self, rid: str, samples: List[Completion]) -> None:
        problem, slot = self._inflight.pop(rid)
        samples.sort(key=lambda c: c.sample_index)
        results = [self.task.reward(problem, self.tok.decode(c.token_ids, stop_at_eos=True),
                                    c.finish_reason) for c in samples]
        rewards = np.asarray([r.reward for r in results], np.float64)
        lengths = np.asarray([len(c.token_ids) for c in samples])
        truncated = np.asarray([c.finish_reason != "stop" for c in samples])
        adv = self._advantages(rewards, lengths, truncated)
        self.counts["groups_scored"] += 1
        self._log_samples(samples, results)
        if not adv.keep:
            self._release(slot)  # a replacement takes its place in the batch
            self.counts["groups_filtered"] += 1
            return
        engine_stats = self._engine_stats
        rollouts = []
        for c, r, a, keep in zip(samples, results, adv.advantages, adv.sample_mask):
            rollouts.append(Rollout(
                prompt_ids=c.prompt_ids, completion_ids=c.token_ids,
                logp_behaviour=c.logp_behaviour, version=c.version, kv_version=c.kv_version,
                reward=float(r.reward), advantage=float(a) if keep else 0.0, group_id=rid,
                group_size=len(samples), task_id=self.task.name,
                finish_reason=c.finish_reason, start_version=c.start_version,
                engine_id=c.engine_id, submit_time=c.submit_time, start_time=c.start_time,
                finish_time=c.finish_time,
                metrics={"correct": float(r.correct),
                         "engine_occupancy": engine_stats.get("time_occupancy", 0.0),
                         "engine_tokens_per_s": float(engine_stats.get("tokens_per_s", 0.0))}))
        self._put(rid, slot, rollouts)

    def _put(self, rid: str, slot: int, rollouts: List[Rollout]) -> None:
        try:
            self.client.put_group(rollouts)
            self.counts["groups_put"] += 1
        except Exception as e:  # noqa: BLE001 - a rejected group is counted, the worker goes on
            from pipelinerl_jax.transport import RolloutRejected  # rare path
            if not isinstance(e, RolloutRejected):
                raise
            log.warning("group %s rejected by the queue: %s", rid, e)
            self.counts["groups_rejected"] += 1
            self._event("group_rejected", group_id=rid, reason=str(e)[:500])
            self._release(slot)

    def finish_episodes(self, g: GroupResult) -> None:
        """A finished group of episodes (environment mode): dropped (failed, or all-equal
        rewards under dynamic sampling) and replaced, or scored and put on the queue."""
        _, slot = self._inflight.pop(g.group_id)
        why = drop_reason(g, self.cfg.env.dynamic_sampling)
        if why is not None:
            self._release(slot)  # a replacement takes its place in the batch
            if why == "failed":
                self.counts["groups_failed"] += 1
                log.warning("group %s dropped: %s", g.group_id, g.reason)
                self._event("group_failed", group_id=g.group_id, reason=str(g.reason)[:500])
            else:
                self.counts[f"groups_dropped_{why}"] += 1
            return
        eps = g.episodes
        adv = self._advantages(g.rewards, np.asarray([len(e.completion_ids) for e in eps]),
                               np.asarray([e.status == "truncated" for e in eps]))
        self.counts["groups_scored"] += 1
        self.counts["episodes"] += len(eps)
        self._log_episodes(eps)
        if not adv.keep:
            self._release(slot)
            self.counts["groups_filtered"] += 1
            return
        stats = self._engine_stats
        rollouts = []
        for e, a, keep in zip(eps, adv.advantages, adv.sample_mask):
            fields = e.rollout_fields(float(a) if keep else 0.0, len(eps), g.group_id)
            fields["metrics"].update({
                f"end/{e.end_reason}": 1.0,
                "engine_occupancy": stats.get("time_occupancy", 0.0),
                "engine_tokens_per_s": float(stats.get("tokens_per_s", 0.0))})
            rollouts.append(Rollout(**fields))
        self._put(g.group_id, slot, rollouts)

    def _log_episodes(self, eps) -> None:
        if not self.workdir:
            return
        append_jsonl(os.path.join(self.workdir, f"samples.w{self.index}.jsonl"), [
            {"time_s": e.finish_time, "engine_id": e.engine_id,
             "response_length": len(e.completion_ids), "model_tokens": e.model_tokens,
             "reward": e.reward, "correct": e.correct, "finish_reason": FINISH_REASON[e.status],
             "status": e.status, "end_reason": e.end_reason,
             "turns": len(e.turns), "start_version": e.start_version,
             "turn_versions": [[t.version_min, t.version_max] for t in e.turns],
             "gen_time_s": e.finish_time - e.start_time,
             "tool_time_s": sum(t.tool_latency_s or 0.0 for t in e.turns)}
            for e in eps])

    def _drop_failed_request(self, error) -> None:
        """The engine gave up on a request (its samples will not come): forget the group."""
        rid = getattr(error, "request_id", None)
        if rid not in self._inflight:
            raise error  # not one of ours: a bug, not a fault to ride out
        _, slot = self._inflight.pop(rid)
        self._samples.pop(rid, None)
        self._release(slot)
        self.counts["groups_failed"] += 1
        log.warning("group %s dropped: %s", rid, error)
        self._event("group_failed", group_id=rid, reason=str(error)[:500])

    def _release(self, slot: int) -> None:
        if self._slots.get(slot, 0) > 0:
            self._slots[slot] -= 1

    def _log_samples(self, samples, results) -> None:
        if not self.workdir:
            return
        append_jsonl(os.path.join(self.workdir, f"samples.w{self.index}.jsonl"), [
            {"time_s": c.finish_time, "engine_id": c.engine_id, "response_length": len(c.token_ids),
             "reward": r.reward, "correct": r.correct, "finish_reason": c.finish_reason,
             "start_version": c.start_version, "gen_time_s": c.finish_time - c.start_time,
             "queue_time_s": c.start_time - c.submit_time}
            for c, r in zip(samples, results)])

    def _report_engine_stats(self, every_s: float) -> None:
        now = time.time()
        if now - self._engine_stats_time < every_s:
            return
        s = self.engine.stats()
        # Time-averaged fraction of slots holding a sample (idle time counts as empty).
        s["time_occupancy"] = float(s.get("slot_occupancy", 0.0) * s.get("busy_fraction", 0.0))
        self._engine_stats = s
        self._engine_stats_time = now
        if self.workdir:
            append_jsonl(os.path.join(self.workdir, "engine_stats.jsonl"), [{
                "time_s": now, "engine_id": s["engine_id"], "version": s["version"],
                "occupancy": s["time_occupancy"], "decode_occupancy": s["slot_occupancy"],
                # window means: slots active while decoding, and seconds per decode step
                "active_slots": s["slot_occupancy"] * s["num_slots"],
                "decode_step_time_s": (s["busy_fraction"] * s["window_s"]
                                       / max(s["window_decode_steps"], 1)),
                "num_slots": s["num_slots"], "tokens_per_s": s["tokens_per_s"],
                "busy_fraction": s["busy_fraction"], "queued_samples": s["queued_samples"],
                "decode_steps": s["window_decode_steps"],
                # fault counters: the worker's, and the engine's where it has them (SGLang)
                "worker": dict(self.counts),
                **({"env": self.groups.runner.stats()} if self.groups is not None else {}),
                **{k: s[k] for k in ENGINE_FAULT_KEYS if k in s}}])

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
            if self.groups is not None:
                for g in self.groups.poll(timeout=0.02):
                    self.finish_episodes(g)
                self._report_engine_stats(self.cfg.rollout.stats_every_s)
                continue
            try:
                completions = self.engine.get_completions(timeout=0.02)
            except RequestError as e:
                self._drop_failed_request(e)
                continue
            for c in completions:
                group = self._samples[c.request_id]
                group.append(c)
                if len(group) == self.group_size:
                    self.finish_group(c.request_id, self._samples.pop(c.request_id))
            self._report_engine_stats(self.cfg.rollout.stats_every_s)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Ends the episodes in flight and the tool threads (environment mode)."""
        if self.groups is not None:
            self.groups.runner.close()
