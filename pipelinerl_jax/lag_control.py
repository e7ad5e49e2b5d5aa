"""Closed-loop staleness control: the learner moves the allowed lag of an async run to hold a
staleness health signal, instead of fixing `max_lag` up front.

Configuration. `lag_control.enabled=True` (async mode, no lag injection) turns it on; `max_lag`
stays the hard upper bound (the queue starts with it and its capacity is sized for it) and the
limit in force moves within [`lag_control.min_lag`, `max_lag`], starting at
`lag_control.initial_lag` (None = `max_lag`). A section rather than `max_lag='auto'`: config
fields are typed (`--config.max_lag=auto` on an int field is refused by ml_collections), the
controller needs its own keys anyway, and the hard bound keeps its meaning.

The signal, from the train step's per-lag-bucket diagnostics (`losses/diagnostics.py`) of
one step: the stalest lag bucket holding >= `min_tokens` trained tokens, and its
- `'ess'`: token ESS of rho = pi_theta/mu there, healthy when >= the thresholds, or
- `'kl_k3'`: KL(mu || pi_theta) (k3) there, healthy when <= the thresholds.
The stalest bucket is where staleness hurts first, and it is the one a limit change moves.

The law (AIMD with hysteresis; `decide`), after every step, on the evidence: the signals of
the steps trained since the limit last changed (each of those batches was cut by the queue
under the current limit, so no evidence mixes limits):
- back off: the mean of the last `window` signals is worse than `target` ->
  limit = max(min_lag, min(limit - 1, floor(limit * decrease)));
- open up: each of the last `patience` signals is better than `open_at` (a stricter
  threshold: the band between `target` and `open_at` holds, hysteresis) and the limit binds
  (the stalest trained token reached it in one of those steps: raising a limit the pipeline
  does not reach buys nothing and would be untested) and it throttles: the learner waited
  for its batches at least `open_wait` of its time over those steps (a learner-bound
  pipeline, whose learner never waits, gains no throughput from staler data, only
  staleness) -> limit = min(max_lag, limit + increase);
- otherwise hold. A change empties the evidence: the next decision waits for `window`
  (back off) or `patience` (open up) steps under the new limit.
Multiplicative decrease reacts fast to a degrading signal; additive increase probes one
version of staleness at a time.

Delivery. The learner announces the limit with its version (`SetVersion` and every
`GetBatch`): the queue drops groups staler than it, and workers read it from the queue's stats
(`QueueStats.max_lag`) with the learner version they already poll, so every admission uses the
limit in force. The batch trained at step s+1 was cut under the limit decided after step s;
`metrics.jsonl` records per step `lag_control/max_lag` (the limit that step's batch was cut
under, so `lag/max <= lag_control/max_lag`), `lag_control/next_max_lag`, `lag_control/action`
(-1, 0, +1) and `lag_control/signal` (absent when no bucket had enough tokens). A restarted
learner starts the controller afresh at `initial_lag`.

`replay(law, records)` runs the law over a `metrics.jsonl` (it is a pure function of the
history), e.g. to tune thresholds offline on a recorded run.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Mapping, Optional, Sequence

import ml_collections
import numpy as np
from ml_collections import config_dict

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.lag_buckets import LAG_BUCKETS  # the diagnostics' buckets, stalest last

SIGNALS = ("ess", "kl_k3")
HOLD, DECREASE, INCREASE = 0, -1, 1


def lag_control_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        enabled=False,  # True: the allowed lag follows the signal within [min_lag, max_lag]
        signal="ess",  # 'ess' | 'kl_k3' of the stalest lag bucket
        target=0.9,  # back off when the signal is worse than this (ess below, kl_k3 above)
        open_at=0.95,  # open up only when better than this (ess above, kl_k3 below)
        min_lag=0,
        initial_lag=config_dict.placeholder(int),  # None: start at max_lag
        window=2,  # steps averaged before backing off
        patience=5,  # consecutive healthy steps before opening up
        decrease=0.5,  # multiplicative decrease factor, in (0, 1)
        increase=1,  # additive increase, versions
        min_tokens=64,  # a lag bucket with fewer trained tokens is too noisy to be the signal
        # open up only while the learner waits for batches at least this fraction of its time
        # (wait / (wait + train step)); 0 = whatever the throughput
        open_wait=0.1,
    ))


@dataclasses.dataclass(frozen=True)
class LagLaw:
    signal: str = "ess"
    target: float = 0.9
    open_at: float = 0.95
    min_lag: int = 0
    max_lag: int = 4
    initial_lag: Optional[int] = None
    window: int = 2
    patience: int = 5
    decrease: float = 0.5
    increase: int = 1
    min_tokens: int = 64
    open_wait: float = 0.1

    @classmethod
    def from_config(cls, cfg) -> "LagLaw":
        """The law of a run config (`cfg.lag_control` within [.min_lag, cfg.max_lag])."""
        c = cfg.lag_control
        return cls(signal=c.signal, target=float(c.target), open_at=float(c.open_at),
                   min_lag=int(c.min_lag), max_lag=int(cfg.max_lag),
                   initial_lag=None if c.initial_lag is None else int(c.initial_lag),
                   window=int(c.window), patience=int(c.patience),
                   decrease=float(c.decrease), increase=int(c.increase),
                   min_tokens=int(c.min_tokens), open_wait=float(c.open_wait))

    @property
    def start(self) -> int:
        return self.max_lag if self.initial_lag is None else self.initial_lag

    def worse(self, value: float, threshold: float) -> bool:
        return value < threshold if self.signal == "ess" else value > threshold

    def better(self, value: float, threshold: float) -> bool:
        return value >= threshold if self.signal == "ess" else value <= threshold


@dataclasses.dataclass(frozen=True)
class Observation:
    """One step's signal: its value, the lag bucket it came from, the max trained lag, and
    the fraction of the step's time the learner waited for its batch."""
    value: float
    bucket: str
    lag_max: int
    wait_frac: float = 1.0


def observe(metrics: Mapping[str, float], lag_max: int, law: LagLaw,
            wait_frac: float = 1.0) -> Optional[Observation]:
    """The signal of one step's loss metrics (`flatten_metrics` names: `lag_3-4/ess`,
    `lag_3-4/tokens`) and the largest lag of its trained tokens, or None when no lag bucket
    has `min_tokens` tokens."""
    for bucket in reversed(LAG_BUCKETS):
        if metrics.get(f"lag_{bucket}/tokens", 0.0) >= law.min_tokens:
            return Observation(float(metrics[f"lag_{bucket}/{law.signal}"]), bucket,
                               int(lag_max), float(wait_frac))
    return None


def loss_metrics(record: Mapping) -> dict:
    """The loss metrics of a `metrics.jsonl` record (`loss/<name>` -> `<name>`)."""
    return {k[len("loss/"):]: v for k, v in record.items() if k.startswith("loss/")}


def trained_lag_max(arrays: Mapping[str, np.ndarray]) -> int:
    """The largest lag of a packed batch's trained tokens (`lag` where `loss_mask` > 0)."""
    lag = np.asarray(arrays["lag"])[np.asarray(arrays["loss_mask"]) > 0]
    return int(lag.max()) if lag.size else 0


def decide(law: LagLaw, limit: int, evidence: Sequence[Observation]) -> int:
    """The control law (module docstring): the next limit, from the current one and the
    observations of the steps trained under it, oldest first."""
    recent = evidence[-law.window:]
    if (len(recent) >= law.window and limit > law.min_lag and
            law.worse(sum(o.value for o in recent) / len(recent), law.target)):
        return max(law.min_lag, min(limit - 1, math.floor(limit * law.decrease)))
    recent = evidence[-law.patience:]
    if (len(recent) >= law.patience and limit < law.max_lag and
            all(law.better(o.value, law.open_at) for o in recent) and
            max(o.lag_max for o in recent) >= limit and
            sum(o.wait_frac for o in recent) / len(recent) >= law.open_wait):
        return min(law.max_lag, limit + law.increase)
    return limit


@dataclasses.dataclass(frozen=True)
class Decision:
    limit: int  # the limit this step's batch was cut under
    next_limit: int  # the limit from the next step on
    observation: Optional[Observation]

    @property
    def action(self) -> int:
        return (self.next_limit > self.limit) - (self.next_limit < self.limit)


class LagController:
    """The law run step by step. With `law=None` (control off) `limit` is None (nothing to
    announce: the queue keeps its configured max_lag) and `update` records nothing."""

    def __init__(self, law: Optional[LagLaw]):
        self.law = law
        self.limit: Optional[int] = None if law is None else law.start
        self.evidence: List[Observation] = []

    @classmethod
    def from_config(cls, cfg) -> "LagController":
        return cls(LagLaw.from_config(cfg) if cfg.lag_control.enabled else None)

    def announce(self) -> dict:
        """What the learner tells the queue with its version: `{"max_lag": limit}`, or
        nothing when control is off."""
        return {} if self.limit is None else {"max_lag": self.limit}

    def update(self, metrics: Mapping[str, float], arrays: Mapping[str, np.ndarray],
               wait_s: float = 0.0, step_s: float = 0.0) -> dict:
        """Feeds one step's loss metrics, packed batch `arrays` (for the largest trained
        lag) and the learner's wait for that batch and train-step time; returns that step's
        `lag_control/*` record. Call before publishing the step's version, which announces
        the new limit."""
        if self.law is None:
            return {}
        frac = wait_fraction({"learner/wait_time_s": wait_s, "learner/step_time_s": step_s})
        d = self.step(metrics, trained_lag_max(arrays), frac)
        out = {"lag_control/max_lag": d.limit, "lag_control/next_max_lag": d.next_limit,
               "lag_control/action": d.action}
        if d.observation is not None:
            out["lag_control/signal"] = d.observation.value
            out["lag_control/wait_fraction"] = d.observation.wait_frac
        return out

    def step(self, metrics: Mapping[str, float], lag_max: int,
             wait_frac: float = 1.0) -> Decision:
        obs = observe(metrics, lag_max, self.law, wait_frac)
        if obs is not None:
            self.evidence.append(obs)
        limit = self.limit
        self.limit = decide(self.law, limit, self.evidence)
        if self.limit != limit:
            self.evidence = []
        return Decision(limit, self.limit, obs)


def replay(law: LagLaw, records: Sequence[Mapping]) -> List[Decision]:
    """The decisions the law makes over `metrics.jsonl` records (step > 0 rows, in order)."""
    ctl = LagController(law)
    return [ctl.step(loss_metrics(r), r.get("lag/max", 0), wait_fraction(r)) for r in records]


def wait_fraction(record: Mapping) -> float:
    """wait / (wait + train step) of a `metrics.jsonl` record (1.0 when it has neither)."""
    wait, step = record.get("learner/wait_time_s"), record.get("learner/step_time_s")
    if wait is None or step is None or wait + step <= 0:
        return 1.0
    return float(wait) / float(wait + step)


def validate_lag_control(cfg) -> None:
    """Checks `cfg.lag_control` against the run config; raises ConfigError naming the key."""
    c = cfg.lag_control
    if not isinstance(c.enabled, bool):
        raise ConfigError("lag_control.enabled", f"must be True or False, got {c.enabled!r}")
    if c.signal not in SIGNALS:
        raise ConfigError("lag_control.signal", f"must be one of {SIGNALS}, got {c.signal!r}")
    for key in ("target", "open_at"):
        v = c[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"lag_control.{key}", f"must be a number, got {v!r}")
        if c.signal == "ess" and not 0 < v <= 1:
            raise ConfigError(f"lag_control.{key}", f"an ESS threshold must be in (0, 1], "
                                                    f"got {v!r}")
        if c.signal == "kl_k3" and v < 0:
            raise ConfigError(f"lag_control.{key}", f"a KL threshold must be >= 0, got {v!r}")
    if (c.open_at < c.target) if c.signal == "ess" else (c.open_at > c.target):
        side = ">=" if c.signal == "ess" else "<="
        raise ConfigError("lag_control.open_at", f"must be {side} lag_control.target="
                          f"{c.target} for signal {c.signal!r} (the hysteresis band), "
                          f"got {c.open_at}")
    w = c.open_wait
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < 1:
        raise ConfigError("lag_control.open_wait", f"must be a fraction in [0, 1), got {w!r}")
    for key, lo in (("min_lag", 0), ("window", 1), ("patience", 1), ("increase", 1),
                    ("min_tokens", 1)):
        v = c[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"lag_control.{key}", f"must be an integer >= {lo}, got {v!r}")
    if isinstance(c.decrease, bool) or not isinstance(c.decrease, (int, float)) or not (
            0 < c.decrease < 1):
        raise ConfigError("lag_control.decrease", f"must be in (0, 1), got {c.decrease!r}")
    if not c.enabled:
        return
    if c.min_lag > cfg.max_lag:
        raise ConfigError("lag_control.min_lag", f"{c.min_lag} exceeds max_lag={cfg.max_lag} "
                                                  f"(the controller's upper bound)")
    if c.initial_lag is not None and (
            isinstance(c.initial_lag, bool) or not c.min_lag <= c.initial_lag <= cfg.max_lag):
        raise ConfigError("lag_control.initial_lag", f"must be None or in [lag_control.min_lag"
                          f"={c.min_lag}, max_lag={cfg.max_lag}], got {c.initial_lag!r}")
    if cfg.mode != "async":
        raise ConfigError("lag_control.enabled", f"needs mode='async' (mode={cfg.mode!r} "
                                                 f"trains at lag 0)")
    if cfg.lag_injection.enabled:
        raise ConfigError("lag_control.enabled", "cannot be combined with lag_injection "
                                                 "(the lag is prescribed there)")
