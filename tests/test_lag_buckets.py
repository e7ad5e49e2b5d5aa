"""One set of lag buckets: the train step's diagnostics put every lag in the bucket whose name
covers it, so the names the controller and the results tables read mean what they say."""
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.lag_buckets import LAG_BUCKETS
from pipelinerl_jax.losses.diagnostics import lag_bucket


def _covers(name: str, lag: int) -> bool:
    if name.endswith("+"):
        return lag >= int(name[:-1])
    lo, _, hi = name.partition("-")
    return int(lo) <= lag <= int(hi or lo)


def test_each_lag_lands_in_the_bucket_its_name_covers():
    lags = np.arange(-2, 40)
    got = np.asarray(lag_bucket(jnp.asarray(lags)))
    for lag, index in zip(lags, got):
        assert _covers(LAG_BUCKETS[index], max(int(lag), 0)), (lag, LAG_BUCKETS[index])


def test_every_bucket_is_reachable_and_they_are_ordered_stalest_last():
    got = np.asarray(lag_bucket(jnp.arange(0, 40)))
    assert sorted(set(got.tolist())) == list(range(len(LAG_BUCKETS)))
    assert np.all(np.diff(got) >= 0)
