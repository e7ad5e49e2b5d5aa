"""Two time-indexed records the simulator keeps: policy versions and binned time series.

`VersionTimeline`: `bump[v]` is when version v reached the samplers (bump[0] = 0). With
in-flight updates a sample started at `a` and finished at `b` carries, token by token, the
versions live during [a, b]; tokens are taken as spread evenly in time over [a, b] (decode
steps of one engine are near-uniform), so its mean token version is the time-average
(1/(b-a)) ∫_a^b v(t) dt, and the share of its tokens at version v is the overlap of [a, b]
with [bump[v], bump[v+1]) over (b - a).

`TimeSeries`: accumulates quantities that accrue at a constant rate over intervals [a, b)
(tokens decoded, slot-seconds busy, trainer-seconds busy) and returns their exact integral
per bin of width `dt`, via the cumulative function F(t) = Σ rate·((t-a)⁺ - (t-b)⁺).
"""
from __future__ import annotations

import numpy as np


class VersionTimeline:
    def __init__(self):
        self._bump = [0.0]

    @property
    def latest(self) -> int:
        return len(self._bump) - 1

    def publish(self, t: float) -> int:
        """Version latest+1 reaches the samplers at time `t`; returns it."""
        self._bump.append(float(t))
        return self.latest

    def bumps(self) -> np.ndarray:
        return np.asarray(self._bump)

    def version_at(self, t) -> np.ndarray:
        return np.searchsorted(self.bumps(), np.asarray(t), side="right") - 1

    def mean_version(self, a, b) -> np.ndarray:
        """Time-averaged version over [a, b] (the version at `a` where b <= a)."""
        bumps = self.bumps()
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        # F(t) = ∫_0^t v(s) ds, piecewise linear with slope v on [bump[v], bump[v+1]).
        f_at_bump = np.concatenate([[0.0], np.cumsum(np.diff(bumps) * np.arange(len(bumps) - 1))])

        def integral(t):
            v = np.searchsorted(bumps, t, side="right") - 1
            return f_at_bump[v] + v * (t - bumps[v])

        width = b - a
        safe = np.where(width > 0, width, 1.0)
        return np.where(width > 0, (integral(b) - integral(a)) / safe,
                        self.version_at(a).astype(np.float64))

    def tokens_by_lag(self, a, b, lengths, learner_version, max_lag: int) -> np.ndarray:
        """Histogram of per-token lag, tokens at each lag 0..max_lag (larger lags land in the
        last bin), for samples generated over [a, b] and trained at `learner_version`.

        Each sample emits tokens at rate length/(b-a) over [a, b]; the tokens of version v
        are the integral of the summed rate over [bump[v], bump[v+1]), i.e. differences of
        F(t) = Σ rate·((t-a)⁺ - (t-b)⁺) at the bumps: O(samples + versions), no loop.
        """
        bumps = self.bumps()
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        lengths = np.asarray(lengths, np.float64)
        rate = lengths / np.maximum(b - a, 1e-12)
        n = bumps.size + 1
        ia = np.searchsorted(bumps, a, side="right")  # bumps j >= ia lie after a
        ib = np.searchsorted(bumps, b, side="right")
        s1 = np.cumsum(np.bincount(ia, rate, n) - np.bincount(ib, rate, n))[: bumps.size]
        s2 = np.cumsum(np.bincount(ia, rate * a, n) - np.bincount(ib, rate * b, n))[: bumps.size]
        f = np.append(bumps * s1 - s2, lengths.sum())  # F at each bump, then at +inf
        per_version = np.diff(f)  # tokens generated while version v was live, v = 0..latest
        lag = np.clip(learner_version - np.arange(per_version.size), 0, max_lag)
        return np.bincount(lag, per_version, max_lag + 1)


class TimeSeries:
    """Integrals per time bin of quantities accrued at constant rates over intervals."""

    def __init__(self, dt: float, names):
        self.dt = float(dt)
        self.names = tuple(names)
        self._n = 1024
        self._slope = {k: np.zeros(self._n + 2) for k in self.names}
        self._offset = {k: np.zeros(self._n + 2) for k in self.names}
        self.t_max = 0.0

    def _grow(self, n_needed: int):
        n = self._n
        while n < n_needed:
            n *= 2
        if n != self._n:
            for d in (self._slope, self._offset):
                for k in self.names:
                    d[k] = np.concatenate([d[k], np.zeros(n - self._n)])
            self._n = n

    def add(self, a, b, **totals):
        """Spreads each `totals[name][i]` evenly over [a[i], b[i])."""
        a = np.asarray(a, np.float64).ravel()
        b = np.asarray(b, np.float64).ravel()
        ok = b > a
        if not ok.any():
            return
        a, b = a[ok], b[ok]
        self.t_max = max(self.t_max, float(b.max()))
        ia = np.floor(a / self.dt).astype(np.int64) + 1  # first grid point strictly after a
        ib = np.floor(b / self.dt).astype(np.int64) + 1
        self._grow(int(ib.max()) + 1)
        size = self._n + 2
        for name, tot in totals.items():
            rate = np.asarray(tot, np.float64).ravel()[ok] / (b - a)
            self._slope[name] += (np.bincount(ia, rate, size) - np.bincount(ib, rate, size))
            self._offset[name] += (np.bincount(ia, rate * a, size) - np.bincount(ib, rate * b, size))

    def bins(self) -> tuple[np.ndarray, dict]:
        """(bin start times, {name: integral over each bin})."""
        n = int(np.ceil(self.t_max / self.dt))
        grid = np.arange(n + 1) * self.dt
        out = {}
        for k in self.names:
            f = grid * np.cumsum(self._slope[k])[: n + 1] - np.cumsum(self._offset[k])[: n + 1]
            out[k] = np.diff(f)
        return grid[:-1], out
