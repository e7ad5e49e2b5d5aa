"""Response-length distributions, truncated at the maximum response length.

Lengths are i.i.d. per sample. A response that would run past `max_len` stops there
(finish_reason "length"), so truncation clips: the tail mass piles up at `max_len`, which is
where the stragglers of a synchronous step come from.

  lognormal  by its median and one upper quantile (default p99):
             mu = ln(median), sigma = (ln(q) - ln(median)) / z(q), z the standard normal quantile.
  empirical  resampled with replacement from observed lengths (a list, or a run's
             `samples.jsonl` `response_length` column).
Either can add a point mass at `max_len`: `truncated_fraction` of samples ramble until they
are cut off (RL runs report this as the truncation or "overlong" rate).
"""
from __future__ import annotations

import json
import math
import os
from statistics import NormalDist

import numpy as np


class LengthDistribution:
    """Base: integer lengths in [1, max_len]. Subclasses implement `_raw(rng, n)`."""

    max_len: int
    truncated_fraction: float = 0.0

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = np.clip(np.ceil(self._raw(rng, n)), 1, self.max_len).astype(np.int64)
        if self.truncated_fraction > 0:
            x[rng.random(n) < self.truncated_fraction] = self.max_len
        return x

    def moments(self, n: int = 200_000, seed: int = 12345) -> tuple[float, float]:
        """(E[L], E[L²]) by Monte Carlo on a fixed seed, so results are reproducible."""
        x = self.sample(np.random.default_rng(seed), n).astype(np.float64)
        return float(x.mean()), float((x * x).mean())

    def quantile(self, q: float, n: int = 200_000, seed: int = 12345) -> float:
        return float(np.quantile(self.sample(np.random.default_rng(seed), n), q))


class LogNormal(LengthDistribution):
    def __init__(self, median: float, tail: float, tail_q: float = 0.99, max_len: int = 4096,
                 truncated_fraction: float = 0.0):
        if not 0 < median < tail:
            raise ValueError(f"need 0 < median < tail, got median={median}, tail={tail}")
        self.median, self.tail, self.tail_q, self.max_len = median, tail, tail_q, int(max_len)
        self.truncated_fraction = float(truncated_fraction)
        self.mu = math.log(median)
        self.sigma = (math.log(tail) - self.mu) / NormalDist().inv_cdf(tail_q)

    def _raw(self, rng, n):
        return np.exp(self.mu + self.sigma * rng.standard_normal(n))

    def __repr__(self):
        return (f"LogNormal(median={self.median:g}, p{100 * self.tail_q:g}={self.tail:g}, "
                f"max_len={self.max_len}, truncated={self.truncated_fraction:g})")


class Empirical(LengthDistribution):
    def __init__(self, values, max_len: int | None = None, truncated_fraction: float = 0.0):
        v = np.asarray(values, np.float64).ravel()
        if v.size == 0 or not np.all(np.isfinite(v)) or np.any(v < 1):
            raise ValueError("empirical lengths must be a non-empty list of numbers >= 1")
        self.values = v
        self.max_len = int(max_len) if max_len else int(np.ceil(v.max()))
        self.truncated_fraction = float(truncated_fraction)

    def _raw(self, rng, n):
        return self.values[rng.integers(0, self.values.size, n)]

    def __repr__(self):
        return f"Empirical(n={self.values.size}, mean={self.values.mean():.1f}, max_len={self.max_len})"


def lengths_from_run(path: str) -> np.ndarray:
    """`response_length` of every sample in a run directory's `samples.jsonl` (or that file)."""
    if os.path.isdir(path):
        path = os.path.join(path, "samples.jsonl")
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(float(json.loads(line)["response_length"]))
    return np.asarray(out)
