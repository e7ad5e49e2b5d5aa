"""Records of samples in flight or queued, and the queue of finished groups.

Sample ids are `group · G + member`. Only groups not yet trained or dropped are kept, in a
ring of `cap` (a power of two) group slots, `group & (cap - 1)`, each holding its G samples:
memory follows what is in the pipeline, not the length of the run. The ring doubles when the
live range of groups [lo, hi) outgrows it.
"""
from __future__ import annotations

import numpy as np

_SAMPLE_FIELDS = {"length": np.int64, "start_t": np.float64, "finish_t": np.float64,
                  "start_v": np.int64}


class SampleStore:
    def __init__(self, group_size: int, capacity: int = 1024):
        self.G = int(group_size)
        self.lo = 0  # every group below lo is resolved (trained or dropped)
        self.hi = 0  # one past the highest group id admitted
        self._alloc(int(capacity))

    def _alloc(self, cap: int):
        self.cap = cap
        self.f = {k: np.zeros(cap * self.G, t) for k, t in _SAMPLE_FIELDS.items()}
        self.n_done = np.zeros(cap, np.int64)
        self.resolved = np.zeros(cap, bool)

    def _pos(self, sids):
        """Ring position of each sample: its group's ring slot, then the member."""
        return ((sids // self.G) & (self.cap - 1)) * self.G + sids % self.G

    def _group_pos(self, groups):
        groups = np.asarray(groups, np.int64)
        return ((groups & (self.cap - 1)) * self.G)[:, None] + np.arange(self.G)

    def _reserve(self, hi: int):
        if hi <= self.hi:
            return
        if hi - self.lo > self.cap:
            cap = self.cap
            while hi - self.lo > cap:
                cap *= 2
            live = np.arange(self.lo, self.hi)
            old_f, old_done, old_res = self.f, self.n_done, self.resolved
            src = self._group_pos(live).ravel()
            src_g = live & (self.cap - 1)
            self._alloc(cap)
            dst = self._group_pos(live).ravel()
            for k in self.f:
                self.f[k][dst] = old_f[k][src]
            self.n_done[live & (cap - 1)] = old_done[src_g]
            self.resolved[live & (cap - 1)] = old_res[src_g]
        fresh = np.arange(self.hi, hi) & (self.cap - 1)
        self.n_done[fresh] = 0
        self.resolved[fresh] = False
        self.hi = hi

    def admit(self, sids, times, lengths, version):
        if sids.size == 0:
            return
        self._reserve(int(sids.max()) // self.G + 1)
        pos = self._pos(sids)
        self.f["start_t"][pos] = times
        self.f["length"][pos] = lengths
        self.f["start_v"][pos] = version

    def finish(self, sids, times):
        """Records finished samples; returns (ids, completion times) of groups now complete."""
        if sids.size == 0:
            return np.zeros(0, np.int64), np.zeros(0)
        pos = self._pos(sids)
        self.f["finish_t"][pos] = times
        slot = pos // self.G
        got = np.bincount(slot, minlength=self.cap)
        self.n_done += got
        ring = np.flatnonzero((got > 0) & (self.n_done == self.G))
        groups = self.lo + ((ring - self.lo) & (self.cap - 1))  # ring slot -> live group id
        return groups, self.f["finish_t"][self._group_pos(groups)].max(1)

    def completions(self, sids, times):
        """(ids, completion times) of the groups that finishing samples `sids` at `times`
        would complete, without recording anything. The samples may be newer than the store
        (groups >= hi have nothing recorded yet); a group completes at its last finish, one
        of these, as they come after every recorded one."""
        if sids.size == 0:
            return np.zeros(0, np.int64), np.zeros(0)
        rel = sids // self.G - self.lo  # every finishing sample's group is live: >= lo
        span = int(rel.max()) + 1
        got = np.bincount(rel, minlength=span)
        groups = np.arange(self.lo, self.lo + span)
        before = np.where(groups < self.hi, self.n_done[groups & (self.cap - 1)], 0)
        last = np.full(span, -np.inf)
        np.maximum.at(last, rel, times)
        full = (got > 0) & (before + got == self.G)
        return groups[full], last[full]

    def gather(self, groups) -> dict:
        """Per-sample fields of `groups`, each [len(groups), G]."""
        pos = self._group_pos(groups)
        return {k: v[pos] for k, v in self.f.items()}

    def min_start_version(self, groups):
        return self.f["start_v"][self._group_pos(groups)].min(1)

    def resolve(self, groups):
        self.resolved[np.asarray(groups, np.int64) & (self.cap - 1)] = True
        if self.lo < self.hi:
            span = self.resolved[np.arange(self.lo, self.hi) & (self.cap - 1)]
            self.lo = self.hi if span.all() else self.lo + int(np.argmin(span))

    def pending_finished(self) -> int:
        """Finished samples of groups that are not complete yet."""
        live = np.arange(self.lo, self.hi) & (self.cap - 1)
        part = self.n_done[live]
        return int(part[(part < self.G) & ~self.resolved[live]].sum())


class GroupQueue:
    """Finished groups in order of completion; the learner takes them from the front."""

    def __init__(self):
        self.groups = np.zeros(0, np.int64)
        self.times = np.zeros(0)

    def __len__(self):
        return self.groups.size

    def push(self, groups, times):
        if groups.size == 0:
            return
        order = np.argsort(times, kind="stable")
        groups, times = groups[order], times[order]
        if self.times.size and times[0] < self.times[-1]:  # rare: merge out-of-order arrivals
            groups = np.concatenate([self.groups, groups])
            times = np.concatenate([self.times, times])
            order = np.argsort(times, kind="stable")
            self.groups, self.times = groups[order], times[order]
        else:
            self.groups = np.concatenate([self.groups, groups])
            self.times = np.concatenate([self.times, times])

    def ready(self, t_limit: float) -> int:
        """Number of groups that had arrived by `t_limit`."""
        return int(np.searchsorted(self.times, t_limit, side="right"))

    def pop(self, n: int):
        g, t = self.groups[:n], self.times[:n]
        self.groups, self.times = self.groups[n:], self.times[n:]
        return g, t
