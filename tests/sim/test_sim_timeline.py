"""Version timeline and binned time series against direct computations."""
import numpy as np
import pytest

from pipelinerl_jax.sim.timeline import TimeSeries, VersionTimeline


def _timeline(bumps):
    tl = VersionTimeline()
    for t in bumps:
        tl.publish(t)
    return tl


def test_tokens_by_lag_matches_per_sample_overlaps():
    rng = np.random.default_rng(0)
    bumps = np.cumsum(rng.uniform(5, 15, 12))
    tl = _timeline(bumps)
    a = rng.uniform(0, 100, 300)
    b = a + rng.uniform(0.1, 60, 300)
    length = rng.integers(1, 5000, 300).astype(float)
    L, max_lag = 14, 8
    edges = np.concatenate([[0.0], bumps, [np.inf]])
    want = np.zeros(max_lag + 1)
    for ai, bi, li in zip(a, b, length):
        for v in range(edges.size - 1):
            share = max(0.0, min(bi, edges[v + 1]) - max(ai, edges[v])) / (bi - ai)
            want[min(max(L - v, 0), max_lag)] += share * li
    got = tl.tokens_by_lag(a, b, length, L, max_lag)
    np.testing.assert_allclose(got, want, rtol=1e-9)
    assert got.sum() == pytest.approx(length.sum())
    # The mean token version is the same time average.
    mv = tl.mean_version(a, b)
    one = tl.tokens_by_lag(a[:1], b[:1], length[:1], L, 64)
    assert L - (one @ np.arange(65)) / length[0] == pytest.approx(mv[0])


def test_time_series_bins_integrate_exactly():
    ts = TimeSeries(2.0, ["x"])
    ts.add([0.5, 3.0, 9.9], [4.5, 3.5, 10.1], x=[8.0, 1.0, 4.0])
    t, b = ts.bins()
    np.testing.assert_allclose(t, [0, 2, 4, 6, 8, 10])
    # Rates 2/s on [0.5, 4.5), 2/s on [3, 3.5), 20/s on [9.9, 10.1).
    np.testing.assert_allclose(b["x"], [3.0, 4.0 + 1.0, 1.0, 0.0, 2.0, 2.0])
    assert b["x"].sum() == pytest.approx(13.0)
