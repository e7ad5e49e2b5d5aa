"""The load figures both engines report: counts kept as totals and over a window.

`stats()` of an engine reports totals since it started and averages over the window since
the previous `stats()` call (tokens/s, busy fraction, slot occupancy). `StatsWindow` keeps
both for one engine part: `add(**counts)` adds to the totals and the window alike, `level()`
integrates a level that changes over time (samples in flight on SGLang servers: slot-seconds
and busy seconds), and `roll(now)` hands the window's counts over and starts the next one.
`window_rates` turns a window into the figures every engine reports under the same keys.

Not thread-safe by itself: its owner calls it under its own lock.
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Dict, Tuple


class StatsWindow:
    """Totals since start and counts over the current window (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.totals: collections.Counter = collections.Counter()
        self.window: collections.Counter = collections.Counter()
        self.window_start = self.level_since = clock()
        self.current_level = 0

    def add(self, **counts) -> None:
        for key, n in counts.items():
            self.totals[key] += n
            self.window[key] += n

    def level(self, delta: int, now: float = None) -> None:
        """Changes the tracked level by `delta` (0: just brings the integrals up to `now`):
        `slot_s` integrates the level over time, `busy_s` the time it was above zero."""
        now = self.clock() if now is None else now
        dt = now - self.level_since
        self.add(slot_s=self.current_level * dt,
                 busy_s=dt if self.current_level else 0.0)
        self.level_since = now
        self.current_level += delta

    def roll(self, now: float = None) -> Tuple[collections.Counter, float]:
        """(the window's counts, its length in seconds); the next window starts at `now`."""
        now = self.clock() if now is None else now
        window, span = self.window, max(now - self.window_start, 1e-9)
        self.window, self.window_start = collections.Counter(), now
        return window, span


def window_rates(window: Dict[str, float], span: float) -> Dict[str, float]:
    """The averages over a window every engine reports: its length, tokens per second and
    the fraction of it the engine was busy (from the window's `tokens` and `busy_s`)."""
    return {"window_s": span, "tokens_per_s": window["tokens"] / span,
            "busy_fraction": min(window["busy_s"] / span, 1.0)}


def ratio(num: float, den: float) -> float:
    """`num / den`, 0 for an empty denominator (an occupancy over no steps)."""
    return num / den if den else 0.0
