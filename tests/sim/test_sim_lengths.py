import numpy as np
import pytest

from pipelinerl_jax.sim.lengths import Empirical, LogNormal


def test_lognormal_hits_its_median_and_tail_and_is_truncated():
    d = LogNormal(median=400, tail=5200, tail_q=0.99, max_len=100_000)
    x = d.sample(np.random.default_rng(0), 400_000)
    assert np.median(x) == pytest.approx(400, rel=0.02)
    assert np.quantile(x, 0.99) == pytest.approx(5200, rel=0.03)
    cut = LogNormal(median=400, tail=5200, max_len=2048).sample(np.random.default_rng(0), 100_000)
    assert cut.max() == 2048 and cut.min() >= 1
    assert (cut == 2048).mean() == pytest.approx((x >= 2048).mean(), abs=0.005)


def test_empirical_resamples_observed_lengths():
    d = Empirical([10, 20, 30], max_len=25)
    x = d.sample(np.random.default_rng(1), 3000)
    assert set(np.unique(x)) == {10, 20, 25}
    m1, m2 = Empirical([100]).moments()
    assert (m1, m2) == (100.0, 10000.0)
    with pytest.raises(ValueError):
        Empirical([])


def test_truncated_fraction_runs_to_the_cap():
    d = LogNormal(median=100, tail=500, max_len=8000, truncated_fraction=0.01)
    x = d.sample(np.random.default_rng(2), 200_000)
    assert (x == 8000).mean() == pytest.approx(0.01, abs=0.001)
