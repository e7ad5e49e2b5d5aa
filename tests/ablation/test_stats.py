"""Interval math (stats.py) against independent oracles: published table values of Student's
t, hand computation, and scipy's own interval and Welch test functions."""
import math

import numpy as np
import pytest
import scipy.stats as sp

from pipelinerl_jax.ablation import stats

# Two-sided 95% critical values t_{0.975, df} (standard tables).
T975 = {1: 12.706204736174698, 2: 4.302652729749464, 3: 3.182446305284263,
        4: 2.7764451051977987, 10: 2.2281388519649385, 30: 2.042272456301238}


def test_t_quantiles_match_tables():
    for df, t in T975.items():
        assert stats.t_ppf(0.975, df) == pytest.approx(t, rel=1e-9)
        assert stats.t_cdf(t, df) == pytest.approx(0.975, abs=1e-12)
    assert stats.t_ppf(0.025, 2) == pytest.approx(-T975[2], rel=1e-9)
    assert stats.t_cdf(0.0, 5) == 0.5


def test_t_interval_hand_computed():
    iv = stats.t_interval([0.41, 0.44, 0.38])
    # mean 0.41, s = 0.03, half = 4.3027 * 0.03 / sqrt(3) = 0.074524...
    assert iv.mean == pytest.approx(0.41)
    assert iv.half == pytest.approx(T975[2] * 0.03 / math.sqrt(3), rel=1e-9)
    assert (iv.lo, iv.hi, iv.n) == (pytest.approx(0.41 - iv.half), pytest.approx(0.41 + iv.half), 3)
    assert iv.text(100) == "41.0 ± 7.5"
    one = stats.t_interval([0.5, float("nan"), None])
    assert one.n == 1 and math.isnan(one.half) and one.text(100) == "50.0"
    assert stats.t_interval([]).n == 0 and stats.t_interval([]).text() == "n/a"


def test_t_interval_against_scipy():
    x = np.random.default_rng(3).normal(0.4, 0.05, size=7)
    lo, hi = sp.t.interval(0.95, x.size - 1, loc=x.mean(), scale=sp.sem(x))
    iv = stats.t_interval(x)
    assert (iv.lo, iv.hi) == (pytest.approx(lo, rel=1e-9), pytest.approx(hi, rel=1e-9))


def test_compare_paired_by_seed():
    a = {0: 0.40, 1: 0.45, 2: 0.50}
    b = {0: 0.35, 1: 0.41, 2: 0.44}  # every seed 4-6 points lower: a tight paired interval
    c = stats.compare(a, b)
    d = np.array([0.05, 0.04, 0.06])
    assert c.paired and c.n == 3 and c.df == 2
    assert c.diff == pytest.approx(d.mean())
    assert c.half == pytest.approx(T975[2] * d.std(ddof=1) / math.sqrt(3))
    assert c.verdict == "better" and c.significant
    assert stats.compare(b, a).verdict == "worse"
    assert stats.compare(b, a, higher_is_better=False).verdict == "better"
    # Unpaired, the seed spread (5 points) hides the same 5-point difference.
    w = stats.compare({0: .40, 1: .45, 2: .50}, {3: .35, 4: .41, 5: .44})
    assert not w.paired and w.verdict == "n.s."


def test_compare_welch_against_scipy():
    a, b = [0.1, 0.3, 0.2, 0.25], [0.5, 0.45, 0.7]
    c = stats.compare(dict(enumerate(a)), {i + 10: v for i, v in enumerate(b)})
    va, vb = np.var(a, ddof=1) / 4, np.var(b, ddof=1) / 3
    df = (va + vb) ** 2 / (va ** 2 / 3 + vb ** 2 / 2)
    assert c.df == pytest.approx(df)
    assert c.half == pytest.approx(sp.t.ppf(0.975, df) * math.sqrt(va + vb), rel=1e-9)
    p = sp.ttest_ind(a, b, equal_var=False).pvalue
    assert (p < 0.05) == (c.verdict == "worse")


def test_compare_edge_cases():
    assert stats.compare({0: 0.4}, {0: 0.3}).verdict == "n/a"
    same = stats.compare({0: .4, 1: .5}, {0: .4, 1: .5})
    assert same.diff == 0 and same.half == 0 and same.verdict == "n.s."
    shift = stats.compare({0: .5, 1: .6}, {0: .4, 1: .5})  # identical differences: no spread
    assert shift.half == 0 and shift.verdict == "better"


def test_bootstrap_close_to_t_for_many_seeds():
    x = np.random.default_rng(0).normal(0, 1, size=200)
    t, b = stats.t_interval(x), stats.bootstrap_interval(x)
    assert b.mean == t.mean and b.half == pytest.approx(t.half, rel=0.15)
