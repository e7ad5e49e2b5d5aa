"""Groups of episodes (GRPO over episodes of one task item) and dynamic sampling.

A group is `group_size` episodes of one `Problem`. It is delivered whole or not at all: the
moment one of its episodes fails (`Episode.status == 'failed'`: a tool error, timeout, garbage,
an engine refusal), its other episodes are cancelled (their in-flight turns aborted) and the
group comes back with `reason` set and no episodes. Truncated episodes (limits) are ordinary
members: the policy ran out of turns or tokens and earns the truncated reward.

Dynamic sampling (DAPO, Yu et al. 2025): a group whose rewards are all equal has zero
advantage everywhere and carries no gradient. `GroupSampler` drops such groups (optionally)
and failed ones, and starts a replacement for each so the caller's batch stays full;
`counts` says how many were dropped for which reason and how many replacements were sampled.

    groups = GroupRunner(runner, group_size=8)       # non-blocking, for a worker loop
    gid = groups.start(problem, seed=...)
    for g in groups.poll(timeout=0.02): ...          # whole groups or failures, as they end

    g = run_group(runner, problem, group_size=8)     # blocking, one group
    batch = GroupSampler(groups, task.problems(seed)).sample(num_groups=16)
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Dict, Iterator, List, Optional

import numpy as np

from pipelinerl_jax.envs.runner import Episode, EpisodeRunner
from pipelinerl_jax.tasks.base import Problem


@dataclasses.dataclass
class GroupResult:
    """All `group_size` episodes of one problem (in index order), or a reason and none."""
    group_id: str
    problem: Problem
    episodes: List[Episode]
    reason: Optional[str] = None  # None = complete

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def rewards(self) -> np.ndarray:
        return np.asarray([e.reward for e in self.episodes], np.float64)

    @property
    def all_equal(self) -> bool:
        r = self.rewards
        return bool(r.size) and float(np.ptp(r)) == 0.0


def drop_reason(group: GroupResult, drop_equal_rewards: bool) -> Optional[str]:
    """Why a finished group must not reach the learner ('failed' | 'equal_rewards'), or None."""
    if not group.ok:
        return "failed"
    if drop_equal_rewards and group.all_equal:
        return "equal_rewards"
    return None


class _Pending:
    def __init__(self, gid: str, problem: Problem, size: int):
        self.gid, self.problem, self.size = gid, problem, size
        self.episodes: Dict[int, Episode] = {}
        self.ids: List[str] = []


class GroupRunner:
    """Runs groups of episodes on an `EpisodeRunner` (which it must own: it consumes every
    episode the runner finishes)."""

    def __init__(self, runner: EpisodeRunner, group_size: int):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.runner, self.group_size = runner, int(group_size)
        self._groups: Dict[str, _Pending] = {}
        self._of_episode: Dict[str, str] = {}
        self._done: List[GroupResult] = []
        self._seq = 0
        self.counts: collections.Counter = collections.Counter()

    @property
    def active(self) -> int:
        return len(self._groups)

    def start(self, problem: Problem, group_id: Optional[str] = None,
              seed: Optional[int] = None) -> str:
        """Starts `group_size` episodes of `problem`; episode i gets seed `seed * 1009 + i`."""
        gid = group_id or f"g{self._seq}"
        self._seq += 1
        if gid in self._groups:
            raise ValueError(f"group id {gid!r} is already running")
        g = self._groups[gid] = _Pending(gid, problem, self.group_size)
        self.counts["groups_started"] += 1
        for i in range(self.group_size):
            eid = f"{gid}/e{i}"
            g.ids.append(eid)
            self._of_episode[eid] = gid
            self.runner.start(problem, episode_id=eid, group_id=gid, index=i,
                              seed=None if seed is None else int(seed) * 1009 + i)
        return gid

    def cancel(self, group_id: str) -> bool:
        g = self._groups.pop(group_id, None)
        if g is None:
            return False
        for eid in g.ids:
            self._of_episode.pop(eid, None)
            self.runner.cancel(eid)
        self.counts["groups_cancelled"] += 1
        return True

    def poll(self, timeout: float = 0.0) -> List[GroupResult]:
        """Finished groups (complete or failed), waiting up to `timeout` s for one."""
        t_end = time.monotonic() + timeout
        while True:
            for ep in self.runner.poll(timeout=max(0.0, min(0.05, t_end - time.monotonic()))):
                self._on_episode(ep)
            if self._done or time.monotonic() >= t_end:
                out, self._done = self._done, []
                return out

    def _on_episode(self, ep: Episode) -> None:
        gid = self._of_episode.pop(ep.episode_id, None)
        g = self._groups.get(gid) if gid is not None else None
        if g is None:  # a sibling of a failed episode that finished meanwhile
            self.counts["episodes_discarded"] += 1
            return
        if not ep.ok:
            del self._groups[gid]
            for eid in g.ids:
                if eid != ep.episode_id and self._of_episode.pop(eid, None) is not None:
                    self.runner.cancel(eid)
            self.counts["groups_failed"] += 1
            self.counts[f"groups_failed.{ep.end_reason}"] += 1
            self._done.append(GroupResult(gid, g.problem, [], reason=(
                f"episode {ep.index}: {ep.end_reason}" + (f": {ep.detail}" if ep.detail else ""))))
            return
        g.episodes[ep.index] = ep
        if len(g.episodes) == g.size:
            del self._groups[gid]
            self.counts["groups_complete"] += 1
            self._done.append(GroupResult(gid, g.problem, [g.episodes[i] for i in range(g.size)]))


def run_group(runner: EpisodeRunner, problem: Problem, group_size: int, *,
              seed: Optional[int] = None, timeout: Optional[float] = None,
              group_id: Optional[str] = None) -> GroupResult:
    """Runs one group to the end (blocking): all its episodes, or a reason and none.
    `runner` must have no other episodes running (this consumes what it finishes)."""
    groups = GroupRunner(runner, group_size)
    gid = groups.start(problem, group_id=group_id, seed=seed)
    t_end = None if timeout is None else time.monotonic() + timeout
    while True:
        for g in groups.poll(timeout=0.05):
            if g.group_id == gid:
                return g
        if t_end is not None and time.monotonic() > t_end:
            groups.cancel(gid)
            return GroupResult(gid, problem, [], reason=f"timeout after {timeout}s")


class GroupSampler:
    """Fills batches with usable groups: failed and (with `drop_equal_rewards`) all-equal
    groups are dropped and replaced (module docstring). At most `max_groups_in_flight`
    groups run at once; no more groups are started than the batch still needs."""

    def __init__(self, groups: GroupRunner, problems: Iterator[Problem], *,
                 drop_equal_rewards: bool = True, max_groups_in_flight: int = 4,
                 seed: Optional[int] = 0):
        self.groups, self.problems = groups, problems
        self.drop_equal_rewards = drop_equal_rewards
        self.max_in_flight = max(1, int(max_groups_in_flight))
        self.seed = seed
        self._seq = 0
        self.counts: collections.Counter = collections.Counter()

    def sample(self, num_groups: int, timeout: Optional[float] = None) -> List[GroupResult]:
        """`num_groups` usable groups, in finishing order (TimeoutError if not in time)."""
        kept: List[GroupResult] = []
        mine: set = set()
        started = 0
        t_end = None if timeout is None else time.monotonic() + timeout
        while len(kept) < num_groups:
            while len(mine) < self.max_in_flight and len(kept) + len(mine) < num_groups:
                problem = next(self.problems, None)
                if problem is None:
                    if not mine:
                        raise RuntimeError(f"the problem stream ended with {len(kept)} of "
                                           f"{num_groups} groups ({dict(self.counts)})")
                    break
                seed = None if self.seed is None else self.seed * 1_000_003 + self._seq
                gid = self.groups.start(problem, group_id=f"ds{self._seq}", seed=seed)
                self._seq += 1
                mine.add(gid)
                started += 1
            for g in self.groups.poll(timeout=0.05):
                if g.group_id not in mine:
                    continue
                mine.discard(g.group_id)
                why = drop_reason(g, self.drop_equal_rewards)
                if why is None:
                    kept.append(g)
                    self.counts["groups_kept"] += 1
                else:
                    self.counts[f"groups_dropped_{why}"] += 1
            if t_end is not None and time.monotonic() > t_end:
                for gid in mine:
                    self.groups.cancel(gid)
                raise TimeoutError(f"{len(kept)} of {num_groups} groups after {timeout}s "
                                   f"({dict(self.counts)})")
        self.counts["replacements"] += started - num_groups
        self.counts["batches"] += 1
        return kept
