"""Multi-turn (agentic) episodes: an engine pool where a sample is an episode of turns.

An episode draws its number of turns, one output length per turn (the `lengths`
distribution) and one tool latency between turns. As in `envs/runner.py` with `JaxEngine`,
every turn is a fresh request on the episode's ids so far: it takes a slot, prefills the whole
episode so far (prompt, earlier turns, environment tokens; no prefix cache), decodes its
tokens and frees the slot. While the tool runs the slot serves other episodes' turns; the next
turn is ready `tool_latency` seconds after the previous one finished, and waits for a slot.

Unlike `EnginePool` (which schedules in decode-step space, where nothing depends on time),
tool latencies make admissions depend on time, so this pool is an event loop per engine:
between two events (a turn finishing, a tool answering while a slot is free, the horizon) the
batch B is constant and the cached tokens grow by B per step, and the interval costs
n · step_time(B, C + B(n-1)/2). Slower than `EnginePool` (one Python iteration per event);
used only when episodes have more than one turn, so single-turn runs are unchanged.

For the store a sample is the episode: admitted when its first turn is, its length the
model tokens of all its turns, finished when its last turn is. `turn_log` keeps
(sample id, turn index, start, finish) of every finished turn (per-turn staleness).
"""
from __future__ import annotations

import copy
import dataclasses
import heapq
import math

import numpy as np

from pipelinerl_jax.sim.engines import EnginePool


@dataclasses.dataclass(frozen=True)
class Workload:
    """Episodes of `turns` model turns (values drawn uniformly, e.g. (4,) or (1, 2, 8)),
    `tool_latency` seconds between turns (drawn uniformly from the values), and
    `env_tokens` environment tokens appended after every turn but the last."""
    turns: tuple = (1,)
    tool_latency: tuple = (0.0,)
    env_tokens: int = 0

    @property
    def multi_turn(self) -> bool:
        return max(self.turns) > 1

    @property
    def mean_turns(self) -> float:
        return float(np.mean(self.turns))

    @property
    def mean_env_tokens(self) -> float:
        """Environment tokens of an episode on average (trained, masked out of the loss)."""
        return self.env_tokens * (self.mean_turns - 1)


class _Episode:
    __slots__ = ("lens", "lat", "turn", "ctx")

    def __init__(self, lens, lat, ctx):
        self.lens, self.lat, self.turn, self.ctx = lens, lat, 0, ctx


class TurnPool(EnginePool):
    """`EnginePool`'s interface (set_group_cap, advance, snapshot/restore, counters) for
    multi-turn episodes (module docstring)."""

    def __init__(self, *args, workload: Workload, **kwargs):
        super().__init__(*args, **kwargs)
        self.w = workload
        self.run = [[] for _ in range(self.E)]  # per engine: [rem, ctx, sid, start, turn]
        self.ready = [[] for _ in range(self.E)]  # per engine: heap of (ready_t, seq, sid)
        self.eps: dict = {}
        self.turn_log: list = []
        self._seq = 0
        self._turns = np.asarray(workload.turns, np.int64)
        self._lat = np.asarray(workload.tool_latency, np.float64)

    @property
    def active_count(self) -> int:
        return sum(len(r) for r in self.run)

    def snapshot(self):
        return (super().snapshot(), copy.deepcopy((self.run, self.ready, self.eps)),
                len(self.turn_log), self._seq)

    def restore(self, snap):
        base, (self.run, self.ready, self.eps), n_log, self._seq = snap
        super().restore(base)
        del self.turn_log[n_log:]

    def _new_episode(self):
        n = int(self._turns[self.rng.integers(0, self._turns.size)])
        lens = [int(x) for x in self._draw(n)]
        lat = [float(x) for x in self._lat[self.rng.integers(0, self._lat.size, n - 1)]]
        return _Episode(lens, lat, self.P)

    def advance(self, horizon: float):
        """Runs each engine from its clock to `horizon` (np.inf: until out of work); returns
        (admitted_sids, admit_times, episode_lengths, finished_sids, finish_times)."""
        out = ([], [], [], [], [])
        ser = ([], [], [], [])
        for e in range(self.E):
            self._run_engine(e, horizon, out, ser)
        if self.series is not None and ser[0]:
            a, b, tok, slot_s = (np.asarray(x) for x in ser)
            self.series.add(a, b, tokens=tok, slot_seconds=slot_s)
        types = (np.int64, np.float64, np.int64, np.int64, np.float64)
        return tuple(np.asarray(x, t) for x, t in zip(out, types))

    def _run_engine(self, e, horizon, out, ser):
        lat, S, w = self.latency, self.S, self.w
        finite = math.isfinite(horizon)
        arrive = horizon - 1e-9 * max(1.0, horizon) if finite else horizon
        run, ready = self.run[e], self.ready[e]
        t = float(self.clock[e])
        while t < arrive:
            while len(run) < S:  # fill free slots: waiting turns first, then new episodes
                if ready and ready[0][0] <= t:
                    sid = heapq.heappop(ready)[2]
                    ep = self.eps[sid]
                    prefill = ep.ctx  # the whole episode so far, as a fresh request
                elif self.admitted[e] < self.allowed[e]:
                    sid = int(self.sample_ids(e, int(self.admitted[e])))
                    self.admitted[e] += 1
                    ep = self.eps[sid] = self._new_episode()
                    prefill = self.prefill_per_sample
                    out[0].append(sid)
                    out[1].append(t)
                    out[2].append(sum(ep.lens))
                else:
                    break
                t += float(lat.prefill_time(prefill))
                run.append([ep.lens[ep.turn], ep.ctx, sid, t, ep.turn])
            if not run:
                if ready and ready[0][0] < arrive:
                    t = ready[0][0]  # idle until a tool answers
                    continue
                break
            b = len(run)
            c = sum(r[1] for r in run)
            ts = float(lat.step_time(b, c))
            n = min(r[0] for r in run)
            if ready and b < S:
                n = min(n, max(1, math.ceil((ready[0][0] - t) / ts)))
            if finite:
                n = min(n, max(1, math.ceil((horizon - t) / ts)))
            dt = n * float(lat.step_time(b, c + b * (n - 1) * 0.5))
            ser[0].append(t)
            ser[1].append(t + dt)
            ser[2].append(b * n)
            ser[3].append(b * dt)
            t += dt
            self.decode_tokens += b * n
            keep = []
            for r in run:
                r[0] -= n
                r[1] += n
                if r[0] > 0:
                    keep.append(r)
                    continue
                sid, turn = r[2], r[4]
                self.turn_log.append((sid, turn, r[3], t))
                ep = self.eps[sid]
                ep.turn += 1
                if ep.turn == len(ep.lens):
                    del self.eps[sid]
                    out[3].append(sid)
                    out[4].append(t)
                else:
                    ep.ctx = r[1] + w.env_tokens
                    self._seq += 1
                    heapq.heappush(ready, (t + ep.lat[turn], self._seq, sid))
            run[:] = keep
        self.clock[e] = max(t, horizon) if finite else t


def turn_lags(pool: TurnPool, timeline, trace: dict, group_size: int) -> list:
    """Mean start lag per turn index over the traced trained episodes: learner version at
    training minus the version live when the turn started (one entry per turn index)."""
    if not isinstance(pool, TurnPool) or not pool.turn_log or trace["step"].size == 0:
        return []
    sid = trace["group"].astype(np.int64) * group_size \
        + np.tile(np.arange(group_size), trace["group"].size // group_size)
    order = np.argsort(sid)
    sid, step = sid[order], trace["step"][order]
    log = np.asarray(pool.turn_log, np.float64)
    lsid = log[:, 0].astype(np.int64)
    pos = np.clip(np.searchsorted(sid, lsid), 0, sid.size - 1)
    hit = sid[pos] == lsid
    turn = log[hit, 1].astype(np.int64)
    lag = step[pos[hit]] - timeline.version_at(log[hit, 2])
    return [float(lag[turn == j].mean()) for j in range(int(turn.max()) + 1 if turn.size else 0)
            if (turn == j).any()]
