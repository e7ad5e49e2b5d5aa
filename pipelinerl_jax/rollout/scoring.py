"""Scoring a finished group: rewards, group advantages, the keep decision, `Rollout`s.

A group that comes back failed (`counts['groups_failed']`), that has all-equal rewards under
dynamic sampling (`counts['groups_dropped_equal_rewards']`, DAPO; environments only) or that
the advantage estimator filters out (`counts['groups_filtered']`, e.g. zero variance) is not
put: its batch place is freed and a replacement is sampled, so batches stay full. Every
scored group's samples are a line each of `samples.w<i>.jsonl`. A kept group becomes one
`Rollout` per member, whose metrics carry the member's own (`correct`; for episodes `turns`,
`env_tokens`, `tool_time_s`, `end/<reason>`) and the engine's occupancy and throughput at
the time (`engine_occupancy`, `engine_tokens_per_s`).
"""
from __future__ import annotations

import collections
import logging
from typing import Callable, List, Optional

import numpy as np

from pipelinerl_jax.records import Rollout

log = logging.getLogger(__name__)


class Scorer:
    """`score(group)` -> the group's rollouts, or None when it must not reach the learner.

    `advantages(rewards, lengths, truncated)` is the run's estimator
    (`losses.advantages_from_config`): `.advantages`, `.sample_mask`, `.keep`.
    `engine_stats()` returns the engine's latest stats (`time_occupancy`, `tokens_per_s`)."""

    def __init__(self, task, tokenizer, advantages: Callable, *, drop_equal_rewards: bool,
                 counts: collections.Counter, rollout_log, engine_stats: Callable[[], dict]):
        self.task, self.tok, self.advantages = task, tokenizer, advantages
        self.drop_equal_rewards = drop_equal_rewards
        self.counts, self.rollout_log, self.engine_stats = counts, rollout_log, engine_stats

    def score(self, group) -> Optional[List[Rollout]]:
        if group.failure is not None:
            self.counts["groups_failed"] += 1
            log.warning("group %s dropped: %s", group.group_id, group.failure)
            self.rollout_log.event("group_failed", group_id=group.group_id,
                           reason=str(group.failure)[:500])
            return None
        members = group.members
        judged = [m.judge(self.task, self.tok, group.problem) for m in members]
        rewards = np.asarray([j.reward for j in judged], np.float64)
        if self.drop_equal_rewards and rewards.size and float(np.ptp(rewards)) == 0.0:
            self.counts["groups_dropped_equal_rewards"] += 1
            return None
        adv = self.advantages(rewards, np.asarray([m.length for m in members]),
                              np.asarray([m.truncated for m in members]))
        self.counts["groups_scored"] += 1
        if group.counted_as:
            self.counts[group.counted_as] += len(members)
        self.rollout_log.samples(m.log_record(j) for m, j in zip(members, judged))
        if not adv.keep:
            self.counts["groups_filtered"] += 1
            return None
        stats = self.engine_stats()
        rollouts = []
        for m, j, a, keep in zip(members, judged, adv.advantages, adv.sample_mask):
            fields = m.rollout_fields(j, float(a) if keep else 0.0, len(members),
                                      group.group_id)
            fields["metrics"].update({
                "engine_occupancy": stats.get("time_occupancy", 0.0),
                "engine_tokens_per_s": float(stats.get("tokens_per_s", 0.0))})
            rollouts.append(Rollout(**fields))
        return rollouts
