"""Discrete-event simulation of the three ways to run RL: sync, one_step and async.

  sync      every device samples a batch (batch_size prompts × group_size samples) with
            version k; the batch shrinks as samples finish; when the last one is done every
            device trains; then weights sync. Stragglers idle the whole machine.
  one_step  samplers generate batch k+1 with version k while trainers train batch k
            (one-step off-policy); each side waits for the other once per step.
  async     samplers decode continuously (continuous batching) and update weights in flight;
            finished groups go to a queue; the learner trains as soon as a batch is queued.
            Admission follows the rollout worker's (`_run_async.limit_admission`), checked
            whenever a slot frees: with `max_lag`, at most (v + max_lag + 1) batches of
            groups have started by the time version v is live; and a finished group is put
            whole into a queue of `queue_capacity_batches` batches: a group that finds it
            full waits (its put is held), and while one waits no sampler starts a sample
            (samples in flight go on). Groups whose start_lag still exceeds `max_lag` when
            the learner reaches them are dropped (and give their place back).

Lag (DESIGN.md "Provenance"): the learner at version L trains a sample whose generation
started at version v0 with `start_lag = L - v0`; per token `lag = L - version[t]`, where with
in-flight updates version[t] follows the samplers' version timeline during generation.

The driver advances the engine pool (`engines.py`) in epochs that end at every learner event
that changes what samplers may do (end of a train step, arrival of new weights), and at the
queue events that do (the put that finds the queue full; an idle learner's take while a put
waits), so within an epoch the admission limits and the policy version are constant and the
pool applies them at every admission. A queue event comes from sample completions, so an
epoch that may hold one is run to find it, undone and run again up to it (`advance`).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from pipelinerl_jax.sim.engines import EnginePool
from pipelinerl_jax.sim.latency import DecodeLatency, TrainTime
from pipelinerl_jax.sim.lengths import LengthDistribution
from pipelinerl_jax.sim.store import GroupQueue, SampleStore
from pipelinerl_jax.sim.timeline import TimeSeries, VersionTimeline
from pipelinerl_jax.sim.turns import TurnPool, Workload, turn_lags

MODES = ("sync", "one_step", "async")
_LAG_BINS = 64  # histogram bins for lags; larger lags land in the last bin
_IDLE_HORIZON_FRACTION = 0.5  # see _run_async.idle_horizon
_MAX_RERUNS = 8  # see _run_async.advance


@dataclasses.dataclass
class SimSetup:
    """A validated description of one simulation (built by `sim.sim_config.build_setup`)."""
    mode: str
    steps: int
    seed: int
    devices: int
    samplers: int  # devices that sample (async, one_step); sync uses all devices
    trainers: int
    tp: int  # devices per inference engine
    slots: int  # concurrent sequences per engine (concurrency and KV limited)
    decode: DecodeLatency
    train: TrainTime
    lengths: LengthDistribution
    prompt_len: int
    group_size: int
    batch_size: int  # prompts (groups) per learner step
    queue_capacity_batches: float = math.inf
    max_lag: int | None = None
    weight_sync_s: float = 0.0
    pause_samplers_on_sync: bool = True
    prefix_sharing: bool = True
    warmup_steps: int = 0
    series_dt_s: float = 1.0
    trace_steps: int = 0  # steps whose per-sample records are kept
    kv_capacity_tokens: float = math.inf
    workload: Workload | None = None  # multi-turn episodes (`turns.py`); None: one turn

    @property
    def engines(self) -> int:
        return (self.devices if self.mode == "sync" else self.samplers) // self.tp

    @property
    def learner_devices(self) -> int:
        return self.devices if self.mode == "sync" else self.trainers


@dataclasses.dataclass
class SimResult:
    setup: SimSetup
    steps: dict  # per learner step: arrays (see `_Learner.record`)
    series_t: np.ndarray  # bin start times
    series: dict  # per bin: tokens, slot_seconds, train_seconds, sync_seconds
    start_lag_hist: np.ndarray  # samples trained at each start_lag
    token_lag_hist: np.ndarray  # tokens trained at each lag
    trace: dict  # per trained sample of the first `trace_steps` steps
    sync_completion: list  # sync/one_step: per traced step, sample finish - step start
    counters: dict
    turn_lag: list = dataclasses.field(default_factory=list)  # multi-turn: per turn index

    def summary(self) -> dict:
        return summarize(self)


class _Learner:
    """Takes batches from the queue, trains them, keeps the step records and lag stats."""

    def __init__(self, s: SimSetup, store: SampleStore, timeline: VersionTimeline,
                 in_flight: bool):
        self.s, self.store, self.timeline = s, store, timeline
        self.in_flight = in_flight
        self.version = 0
        self.free_at = 0.0  # when the learner can start its next step
        self.consumed_groups = self.dropped_groups = 0
        self.trained_samples = self.dropped_samples = 0
        self.rows = []
        self.start_lag_hist = np.zeros(_LAG_BINS)
        self.token_lag_hist = np.zeros(_LAG_BINS)
        self.trace = {k: [] for k in ("step", "start_lag", "lag_mean", "length",
                                      "start_t", "finish_t", "group")}

    def try_take(self, queue: GroupQueue, t_limit: float):
        """If `batch_size` fresh groups had arrived by `t_limit`, pops them (dropping stale
        ones met on the way) and returns (groups, time the batch was complete)."""
        n = queue.ready(t_limit)
        bg = self.s.batch_size
        if n < bg:
            return None
        fresh = np.ones(n, bool)
        if self.s.max_lag is not None:
            fresh = self.version - self.store.min_start_version(queue.groups[:n]) <= self.s.max_lag
        cf = np.cumsum(fresh)
        if cf[-1] < bg:
            if not fresh.all():  # stale groups never become fresh: drop them now
                self._drop(queue, n, fresh)
            return None
        last = int(np.searchsorted(cf, bg))
        groups, times = queue.pop(last + 1)
        keep = fresh[: last + 1]
        self._resolve_dropped(groups[~keep])
        return groups[keep], float(times[last])

    def _drop(self, queue, n, fresh):
        groups, times = queue.pop(n)
        self._resolve_dropped(groups[~fresh])
        queue.push(groups[fresh], times[fresh])

    def _resolve_dropped(self, groups):
        if groups.size:
            self.store.resolve(groups)
            self.dropped_groups += groups.size
            self.consumed_groups += groups.size
            self.dropped_samples += groups.size * self.s.group_size

    def train(self, groups, ready_t: float) -> tuple[float, float]:
        """Trains one batch starting at max(ready_t, free_at); returns (train_end, sync_end)."""
        s, L = self.s, self.version
        rec = self.store.gather(groups)
        length = rec["length"].ravel()
        start_lag = L - rec["start_v"].ravel()
        tokens = float(length.sum())
        start = max(ready_t, self.free_at)
        ctx = s.prompt_len + (s.workload.mean_env_tokens if s.workload else 0.0)
        end = start + float(s.train.step_time(tokens + length.size * ctx, s.learner_devices))
        sync_end = end + s.weight_sync_s
        self.start_lag_hist += np.bincount(np.minimum(start_lag, _LAG_BINS - 1),
                                           minlength=_LAG_BINS)
        if self.in_flight:  # tokens carry the versions live while they were generated
            tok_hist = self.timeline.tokens_by_lag(rec["start_t"].ravel(), rec["finish_t"].ravel(),
                                                   length, L, _LAG_BINS - 1)
        else:
            tok_hist = np.bincount(np.minimum(start_lag, _LAG_BINS - 1), weights=length,
                                   minlength=_LAG_BINS)
        self.token_lag_hist += tok_hist
        if L < s.trace_steps:
            tr = self.trace
            if self.in_flight:
                mean_v = self.timeline.mean_version(rec["start_t"].ravel(), rec["finish_t"].ravel())
            else:
                mean_v = rec["start_v"].ravel()
            tr["step"].append(np.full(length.size, L))
            tr["start_lag"].append(start_lag)
            tr["lag_mean"].append(L - mean_v)
            tr["length"].append(length)
            tr["start_t"].append(rec["start_t"].ravel())
            tr["finish_t"].append(rec["finish_t"].ravel())
            tr["group"].append(np.repeat(groups, s.group_size))
        lag_mean = float(tok_hist @ np.arange(_LAG_BINS) / max(tok_hist.sum(), 1e-12))
        self.rows.append((L, ready_t, start, end, sync_end, length.size, tokens,
                          start_lag.mean(), start_lag.max(), lag_mean, self.dropped_samples))
        self.store.resolve(groups)
        self.consumed_groups += groups.size
        self.trained_samples += length.size
        self.version += 1
        self.free_at = sync_end
        return end, sync_end

    def records(self) -> dict:
        names = ("step", "ready_t", "start_t", "end_t", "sync_end_t", "samples", "tokens",
                 "start_lag_mean", "start_lag_max", "lag_mean", "dropped_total")
        cols = list(zip(*self.rows)) if self.rows else [[] for _ in names]
        return {n: np.asarray(c) for n, c in zip(names, cols)}


def _make(s: SimSetup):
    rng = np.random.default_rng(s.seed)
    series = TimeSeries(s.series_dt_s, ("tokens", "slot_seconds", "train_seconds", "sync_seconds"))
    prefill = s.prompt_len / s.group_size if s.prefix_sharing else s.prompt_len
    args = (s.engines, s.slots, s.decode, s.lengths, s.prompt_len, s.group_size, rng, series)
    if s.workload is not None and s.workload.multi_turn:
        pool = TurnPool(*args, prefill_tokens_per_sample=prefill, workload=s.workload)
    else:
        pool = EnginePool(*args, prefill_tokens_per_sample=prefill)
    store = SampleStore(s.group_size)
    timeline = VersionTimeline()
    return pool, store, timeline, series


def _collect(store, advanced, version):
    """Stores what an `advance` returned; returns completed groups and their times."""
    sids, t_adm, lens, fin, t_fin = advanced
    store.admit(sids, t_adm, lens, version)
    return store.finish(fin, t_fin)


def _run_batched(s: SimSetup) -> SimResult:
    """sync and one_step: each learner step's batch is generated whole, then trained."""
    pool, store, timeline, series = _make(s)
    learner = _Learner(s, store, timeline, in_flight=False)
    queue = GroupQueue()
    completion = []
    gen_end = 0.0
    for k in range(s.steps):
        gen_version = k if s.mode == "sync" else max(k - 1, 0)
        start = gen_end if s.mode == "one_step" else learner.free_at
        start = max(start, timeline.bumps()[gen_version])
        pool.clock[:] = start
        pool.set_group_cap((k + 1) * s.batch_size)
        out = pool.advance(np.inf)
        groups, times = _collect(store, out, gen_version)
        gen_end = float(times.max())
        if k < s.trace_steps:
            completion.append(np.sort(out[4]) - start)
        queue.push(groups, times)
        taken, ready = learner.try_take(queue, np.inf)  # the whole batch; no max_lag here
        _, sync_end = learner.train(taken, ready)
        timeline.publish(sync_end)
    return _result(s, pool, store, learner, queue, series, completion, timeline)


class _Deferred:
    """Stands in for the TimeSeries during an advance that may be undone; `commit` replays it."""

    def __init__(self):
        self.calls = []

    def add(self, *args, **kwargs):
        self.calls.append((args, kwargs))

    def commit(self, series: TimeSeries):
        for args, kwargs in self.calls:
            series.add(*args, **kwargs)


def _run_async(s: SimSetup) -> SimResult:
    pool, store, timeline, series = _make(s)
    learner = _Learner(s, store, timeline, in_flight=True)
    queue = GroupQueue()  # every finished group the learner has not taken (queued or waiting)
    bg, G = s.batch_size, s.group_size
    room = s.queue_capacity_batches * bg  # groups the queue holds
    min_tokens = bg * G * (s.prompt_len + 1)
    t_train_min = max(float(s.train.step_time(min_tokens, s.trainers)), 1e-6)
    now = 0.0
    train_end = sync_end = None  # of the step in progress
    late = 0  # learner steps that ended inside an epoch (their pause/bump applied late)
    cuts = 0  # epochs ended early at a queue event (a put blocked, a blocked learner take)
    near = None  # how far to look after an epoch that ended just short of its queue event
    halve = False  # the last look found a queue event

    def idle_horizon():
        # While the learner waits, no learner event can come sooner than one train step
        # from now. The true minimum (every response one token long) is far below any real
        # step, so half the last step's time is used instead: a step would have to run
        # twice as fast as the previous one to end inside the epoch (counted as `late`).
        last = learner.rows[-1][3] - learner.rows[-1][2] if learner.rows else 0.0
        return now + max(t_train_min, _IDLE_HORIZON_FRACTION * last)

    def limit_admission():
        # The rollout worker's admission control (rollout/admission.py), per sample: the pool
        # applies these limits whenever a slot frees, as the worker's loop (`RolloutWorker.
        # admit`) asks `can_admit` whenever a request may start. Engine e starts global
        # groups e, e+E, ... (EnginePool.set_group_cap): its share of every batch, like a
        # worker's `share` (`admission.worker_share`).
        # - max_lag (`PipelineAdmission.can_admit`): a group joins the earliest batch k whose
        #   share is not full, counting groups in flight and queued (`BatchPlaces.book`;
        #   batches below the learner's version are forgotten, `forget_before`), and starts
        #   only while k - engine_version <= max_lag; engines run the latest published
        #   version v, so at most (v + max_lag + 1) batches start. A group the queue drops as
        #   stale gives its place back, here at once; the worker learns of it from the
        #   queue's per-producer drop count (`QueueView`) at its next look at the stats.
        # - capacity: a finished group is put whole (`RolloutWorker.finish`); a full
        #   queue holds the put (transport/queue_core.py `put`), the client retries it
        #   (queue_client `_PUT_RETRY`), and a worker holding a put starts nothing (`run` is
        #   one loop). So nothing starts while more than `room` finished groups await the
        #   learner (the queue's plus the held puts); samples in flight do not count and go
        #   on. One held put stops every engine here (one worker for all of them).
        cap = math.inf
        if s.max_lag is not None:
            cap = (timeline.latest + s.max_lag + 1) * bg + learner.dropped_groups
        pool.set_group_cap(cap)
        if len(queue) > room:
            pool.allowed = np.minimum(pool.allowed, pool.admitted)

    def start_if_ready(t_limit):
        nonlocal train_end, sync_end
        got = learner.try_take(queue, t_limit)
        if got is not None:
            train_end, sync_end = learner.train(*got)

    def first_event(out, blocked, idle):
        """The first queue event in an advance's output that changes what samplers may do:
        the put that finds the queue full when samples started after it, or, with an idle
        learner, its take of a batch if a put is or gets held (counting stale groups too, so
        it may come early; the next epoch then goes on)."""
        _, t_done = store.completions(out[3], out[4])
        t_block = math.inf
        fit = int(room) - len(queue)  # completions that still find room
        if not blocked and t_done.size > fit:
            t_block = float(np.partition(t_done, fit)[fit])
            if not (out[1] >= t_block).any():  # a slot freed by that very group stays empty
                t_block = math.inf
        if idle and (blocked or t_block < math.inf):
            times = np.concatenate([queue.times, t_done])
            if times.size >= bg:
                return min(t_block, float(np.partition(times, bg - 1)[bg - 1]))
        return t_block

    def advance(horizon, idle):
        """Advances the pool to `horizon`, or to the first queue event before it
        (`first_event`). An event comes from sample completions, so the epoch is run to find
        it, undone and run again up to it; a shorter run times steps on a finer grid and can
        move completions a little, so this repeats until no event is left before the end.
        How far to look: after an epoch that ended just short of its event, a couple of grid
        bins; after one that held an event, half way (a long look is often undone);
        otherwise all the way. Returns (pool output, epoch end)."""
        nonlocal cuts, near, halve
        blocked = len(queue) > room
        if math.isinf(room) or (blocked and not idle):
            near = None
            return pool.advance(horizon), horizon
        if near is not None:
            end = min(horizon, now + near)
        else:
            end = now + 0.5 * (horizon - now) if halve else horizon
        near, halve = None, False
        for attempt in range(_MAX_RERUNS + 1):
            snap, log = pool.snapshot(), _Deferred()
            pool.series = log
            out = pool.advance(end)
            pool.series = series
            t = first_event(out, blocked, idle)
            if not now < t < end or attempt == _MAX_RERUNS:
                break
            pool.restore(snap)
            cuts += 1
            if attempt == 0:
                near, halve = 2 * (end - now) / pool.grid_bins, True
            end = t
        if t < end:
            near = None  # the event is in this epoch
        log.commit(series)
        return out, end

    while len(learner.rows) < s.steps or train_end is not None:
        if train_end is None and len(learner.rows) < s.steps:
            start_if_ready(now)
        limit_admission()
        if train_end is not None:
            out, horizon = advance(train_end if now < train_end else sync_end, idle=False)
        else:
            out, horizon = advance(idle_horizon(), idle=True)
        groups, times = _collect(store, out, timeline.latest)
        queue.push(groups, times)
        if train_end is None and len(learner.rows) < s.steps:
            start_if_ready(horizon)
            late += train_end is not None and train_end < horizon
        now = horizon
        if train_end is not None and now >= train_end:
            if s.pause_samplers_on_sync:  # engines stop while the new weights load
                pool.clock = np.maximum(pool.clock, sync_end)
                now = sync_end
            if now >= sync_end:
                timeline.publish(sync_end)
                train_end = sync_end = None
    result = _result(s, pool, store, learner, queue, series, [], timeline)
    result.counters["late_learner_events"] = int(late)
    result.counters["queue_event_cuts"] = int(cuts)
    return result


def simulate(s: SimSetup) -> SimResult:
    """Runs the simulation `s.mode` describes for `s.steps` learner steps."""
    if s.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {s.mode!r}")
    return _run_async(s) if s.mode == "async" else _run_batched(s)


def _result(s, pool, store, learner, queue, series, completion, timeline) -> SimResult:
    st = learner.records()  # learner busy time goes into the series in one pass
    series.add(st["start_t"], st["end_t"], train_seconds=st["end_t"] - st["start_t"])
    series.add(st["end_t"], st["sync_end_t"], sync_seconds=st["sync_end_t"] - st["end_t"])
    t, bins = series.bins()
    trace = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in learner.trace.items()}
    finished = learner.trained_samples + learner.dropped_samples + len(queue) * s.group_size \
        + store.pending_finished()
    counters = {"admitted": int(pool.admitted.sum()), "in_flight": pool.active_count,
                "finished": int(finished), "trained": learner.trained_samples,
                "dropped": learner.dropped_samples, "queued": len(queue) * s.group_size,
                "waiting_for_group": store.pending_finished(),
                "decode_tokens": pool.decode_tokens}
    return SimResult(s, st, t, bins, learner.start_lag_hist, learner.token_lag_hist, trace,
                     completion, counters, turn_lags(pool, timeline, trace, s.group_size))


def _hist_stats(hist) -> dict:
    n = hist.sum()
    if n == 0:
        return {"mean": 0.0, "max": 0, "hist": []}
    lags = np.arange(hist.size)
    last = int(np.flatnonzero(hist)[-1])
    return {"mean": float((lags * hist).sum() / n), "max": last,
            "hist": [float(x) for x in hist[: last + 1]]}


def summarize(r: SimResult) -> dict:
    """Steady-state figures (steps after `warmup_steps`) and whole-run counters."""
    s, st = r.setup, r.steps
    n = st["step"].size
    w = min(s.warmup_steps, max(n - 2, 0))
    t0 = st["sync_end_t"][w - 1] if w > 0 else 0.0
    t1 = st["sync_end_t"][-1] if n else 0.0
    span = max(t1 - t0, 1e-12)
    samples = float(st["samples"][w:].sum())
    tokens = float(st["tokens"][w:].sum())
    dt = s.series_dt_s
    sel = (r.series_t >= t0) & (r.series_t + dt <= t1)  # whole bins inside the window
    if not sel.any():
        sel = r.series_t < t1
    capacity = s.engines * s.slots
    busy = (r.series["train_seconds"][sel].sum() + r.series["sync_seconds"][sel].sum()) \
        / (max(sel.sum(), 1) * dt)  # fraction of the window
    out = {
        "mode": s.mode, "devices": s.devices, "samplers": s.samplers if s.mode != "sync" else s.devices,
        "trainers": s.learner_devices, "engines": s.engines, "slots_per_engine": s.slots,
        "kv_capacity_tokens_per_engine": float(s.kv_capacity_tokens),
        "steps": n, "warmup_steps": w, "sim_time_s": float(t1),
        "step_time_s": span / max(n - w, 1),
        "samples_per_s": samples / span, "tokens_per_s": tokens / span,
        "decode_tokens_per_s": float(r.series["tokens"][sel].sum() / (max(sel.sum(), 1) * dt)),
        "sampler_occupancy": float(r.series["slot_seconds"][sel].sum() / (capacity * max(sel.sum(), 1) * dt)),
        "learner_busy_fraction": float(min(busy, 1.0)),
        "learner_idle_fraction": float(max(0.0, 1.0 - busy)),
        "start_lag": _hist_stats(r.start_lag_hist),
        "token_lag": _hist_stats(r.token_lag_hist),
        "start_lag_max_steady": int(st["start_lag_max"][w:].max()) if n > w else 0,
        "start_lag_mean_steady": float((st["start_lag_mean"][w:] * st["samples"][w:]).sum()
                                       / max(samples, 1)),
        "lag_mean_steady": float((st["lag_mean"][w:] * st["tokens"][w:]).sum() / max(tokens, 1)),
        "response_length_mean": float(st["tokens"].sum() / max(st["samples"].sum(), 1)),
        "counters": r.counters,
    }
    if r.turn_lag:
        out["turn_start_lag_mean"] = r.turn_lag
    if r.sync_completion:
        c = r.sync_completion[0]
        out["sync_step_completion_s"] = {"p50": float(np.quantile(c, 0.5)),
                                         "p99": float(np.quantile(c, 0.99)), "max": float(c.max())}
    return out
