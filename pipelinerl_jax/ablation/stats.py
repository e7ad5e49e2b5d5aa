"""Intervals over seeds and significance of a difference between two grid cells.

    iv = t_interval([0.41, 0.44, 0.39])            # mean ± half-width, 95% Student t, n-1 df
    c = compare({0: .41, 1: .44, 2: .39}, {0: .35, 1: .37, 2: .36})   # paired by seed
    c.verdict                                      # 'better' | 'worse' | 'n.s.' | 'n/a'

A seed is the replicate: with lag injection two runs of the same seed share the warm start,
the sampling seed and the lag-injection seed, so cells that share seeds are compared on the
per-seed differences (a paired t-interval, n-1 df). Cells without >= 2 shared seeds fall back
to Welch's unpaired interval. With n = 3 a t-interval is wide (t = 4.30 at 2 df): a cell is
called better or worse only when the whole interval of the difference is on one side of 0.
Student's t quantiles are scipy's (`scipy.stats.t`; scipy is a dependency of jax).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Hashable, Optional, Sequence

import numpy as np
import scipy.stats

LEVEL = 0.95


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` (> 0, not necessarily integer) degrees of freedom."""
    return float(scipy.stats.t.cdf(t, df))


def t_ppf(q: float, df: float) -> float:
    """The q-quantile of Student's t."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q}")
    return float(scipy.stats.t.ppf(q, df))


@dataclasses.dataclass(frozen=True)
class Interval:
    mean: float
    half: float  # half-width; nan when n < 2
    n: int
    level: float = LEVEL

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half

    def text(self, scale: float = 1.0, digits: int = 1) -> str:
        """'41.2 ± 3.1' (`scale` 100 for percent); 'n/a' without values."""
        if self.n == 0:
            return "n/a"
        if not math.isfinite(self.half):
            return f"{self.mean * scale:.{digits}f}"
        return f"{self.mean * scale:.{digits}f} ± {self.half * scale:.{digits}f}"


def t_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean and the Student-t interval of the mean: mean ± t_{(1+level)/2, n-1}·s/√n, s the
    sample standard deviation (ddof 1). Non-finite values are left out."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], float)
    if x.size == 0:
        return Interval(math.nan, math.nan, 0, level)
    if x.size == 1:
        return Interval(float(x[0]), math.nan, 1, level)
    half = t_ppf(0.5 + level / 2.0, x.size - 1) * float(np.std(x, ddof=1)) / math.sqrt(x.size)
    return Interval(float(x.mean()), half, int(x.size), level)


def bootstrap_interval(values: Sequence[float], level: float = LEVEL, reps: int = 10000,
                       seed: int = 0) -> Interval:
    """Percentile bootstrap of the mean, reported as mean ± the larger side (an optional
    check on the t-interval; with n = 3 it is too narrow to trust on its own)."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], float)
    if x.size < 2:
        return t_interval(x, level)
    means = np.random.default_rng(seed).choice(x, (reps, x.size)).mean(axis=1)
    lo, hi = np.quantile(means, [0.5 - level / 2, 0.5 + level / 2])
    m = float(x.mean())
    return Interval(m, float(max(m - lo, hi - m)), int(x.size), level)


def min_detectable_effect(sd: float, n: int, level: float = LEVEL, power: float = 0.8) -> float:
    """The smallest true difference a paired t-test over `n` seed pairs detects (two-sided at
    `level`) with probability `power`, given the SD of the per-seed differences:
    (t_{(1+level)/2, n-1} + t_{power, n-1})·sd/√n (the usual normal-approximation formula with
    t quantiles; nan for n < 2)."""
    if n < 2 or not math.isfinite(sd):
        return math.nan
    df = n - 1
    return (t_ppf(0.5 + level / 2.0, df) + t_ppf(power, df)) * sd / math.sqrt(n)


def seeds_for_half_width(sd: float, half: float, level: float = LEVEL) -> Optional[int]:
    """The fewest seed pairs whose paired t-interval has half-width <= `half` at this SD."""
    if not (math.isfinite(sd) and half > 0):
        return None
    for n in range(2, 10_000):
        if t_ppf(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n) <= half:
            return n
    return None


@dataclasses.dataclass(frozen=True)
class Comparison:
    diff: float  # mean of a - b
    half: float
    n: int  # pairs (paired) or the smaller group (Welch)
    paired: bool
    df: float
    verdict: str  # 'better' | 'worse' (a than b) | 'n.s.' | 'n/a' (too few values)
    sd: float = math.nan  # SD (ddof 1) of the per-seed differences (paired only)

    @property
    def lo(self) -> float:
        return self.diff - self.half

    @property
    def hi(self) -> float:
        return self.diff + self.half

    @property
    def significant(self) -> bool:
        return self.verdict in ("better", "worse")


def _finite(d: Dict[Hashable, Optional[float]]) -> Dict[Hashable, float]:
    return {k: float(v) for k, v in d.items() if v is not None and math.isfinite(v)}


def compare(a: Dict[Hashable, Optional[float]], b: Dict[Hashable, Optional[float]],
            level: float = LEVEL, higher_is_better: bool = True) -> Comparison:
    """Is cell `a` better or worse than cell `b`? Each maps seed -> value. Paired by seed when
    >= 2 seeds are shared (the difference's t-interval over those seeds), else Welch's interval
    (each side needs >= 2 values). 'better'/'worse' only when the interval excludes 0."""
    a, b = _finite(a), _finite(b)
    shared = sorted(set(a) & set(b), key=str)
    if len(shared) >= 2:
        d = [a[s] - b[s] for s in shared]
        iv = t_interval(d, level)
        diff, half, n, paired, df = iv.mean, iv.half, iv.n, True, float(iv.n - 1)
        sd = float(np.std(d, ddof=1))
    elif len(a) >= 2 and len(b) >= 2:
        sd = math.nan
        xa, xb = np.asarray(list(a.values())), np.asarray(list(b.values()))
        va, vb = xa.var(ddof=1) / xa.size, xb.var(ddof=1) / xb.size
        diff, n, paired = float(xa.mean() - xb.mean()), int(min(xa.size, xb.size)), False
        if va + vb == 0:
            df, half = float(xa.size + xb.size - 2), 0.0
        else:
            df = (va + vb) ** 2 / (va ** 2 / (xa.size - 1) + vb ** 2 / (xb.size - 1))
            half = t_ppf(0.5 + level / 2.0, df) * math.sqrt(va + vb)
    else:
        m = (np.mean(list(a.values())) - np.mean(list(b.values()))) if a and b else math.nan
        return Comparison(float(m), math.nan, min(len(a), len(b)), False, math.nan, "n/a")
    sign = 1 if higher_is_better else -1
    if diff - half > 0:
        verdict = "better" if sign > 0 else "worse"
    elif diff + half < 0:
        verdict = "worse" if sign > 0 else "better"
    else:
        verdict = "n.s."
    return Comparison(diff, half, n, paired, df, verdict, sd)
